//! A streamed handoff's pieces on a tcp link (`transfer::stream`): the producer's sending thread
//! writes each piece as it comes (paced at the link's rate, checksummed as it goes), and the
//! consumer stages it on the connection it came by (a cuda pool lands its floats in device
//! memory as they arrive), checked against its own layout before a byte of payload is read. A
//! piece that does not arrive whole is not staged: the handoff that needs it is then refused,
//! and sent again whole. Staged pieces go with their handoff, an abort, a drop frame, or the end
//! of their connection.

use super::frames::{self, PieceHeader, ToConsumer};
use super::landing::land;
use super::read_u32;
use crate::checksum::Crc32c;
use crate::transfer::wire::ConsumerLayout;
use crate::transfer::{le_bytes, read_floats, KvPiece, Landed, LinkRate, TransferId, PIECE_FLOATS};
use kvflow_kernels::cuda::Landing;
use std::io::{Read, Write};

/// How a consumer's refusal of a handoff whose pieces it lacks begins (the producer sends it
/// again, whole).
pub(super) const PIECES_REFUSAL: &str = "streamed pieces";

/// Writes `piece`: its frame (whether it is checksummed in its header), its floats and their
/// CRC32C (0 when `checksum` is off). Adds the bytes written to `written`.
pub(super) fn write_piece(
    w: &mut impl Write,
    piece: &KvPiece,
    checksum: bool,
    rate: Option<&LinkRate>,
    written: &mut u64,
) -> std::io::Result<()> {
    let header = PieceHeader {
        request: piece.request,
        nonce: piece.transfer.nonce,
        generation: piece.transfer.generation,
        first_block: piece.first_block as u32,
        blocks: piece.blocks as u32,
        layer_floats: piece.layer_floats.iter().map(|&n| n as u32).collect(),
        sent_ms: piece.sent_ms,
        checked: checksum,
    };
    let header = frames::encode(&ToConsumer::Piece(header));
    let pace = |bytes: usize| rate.inspect(|r| r.pace(bytes as u64));
    pace(header.len());
    w.write_all(&header)?;
    *written += header.len() as u64;
    let mut crc = Crc32c::new();
    let mut sent = Ok(());
    let mut send = |floats: &[f32]| {
        if sent.is_err() {
            return;
        }
        let bytes = le_bytes(floats);
        pace(bytes.len());
        if checksum {
            crc.update(&bytes);
        }
        sent = w.write_all(&bytes);
        *written += bytes.len() as u64;
    };
    match &piece.source {
        // In a cuda rank's device memory: read a staged piece at a time, on this thread.
        Some(source) => source.stream(PIECE_FLOATS, &mut send),
        None => piece.kv.chunks(PIECE_FLOATS).for_each(&mut send),
    }
    sent?;
    w.write_all(&(if checksum { crc.value() } else { 0 }).to_le_bytes())?;
    *written += 4;
    w.flush()
}

/// Reads the floats of the piece `header` announced, its shape checked against `layout` first:
/// into device memory through `landing` when the pool has one and the piece's blocks are of its
/// own size (a piece to re-cut stays on the host). `Err`: the connection cannot go on (it ended,
/// or the header does not fit this pool); `Ok(Err(why))`: the piece was read but is not staged
/// (damaged bytes, or a device that failed to take them).
pub(super) fn read_piece(
    r: &mut impl Read,
    header: PieceHeader,
    layout: &ConsumerLayout,
    landing: Option<&Landing>,
) -> std::io::Result<Result<KvPiece, String>> {
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let (first_block, blocks) = (header.first_block as usize, header.blocks as usize);
    let layer_floats: Vec<usize> = header.layer_floats.iter().map(|&n| n as usize).collect();
    // Blocks of any size, of this pool's floats a token.
    let per_token = layout.floats_per_token();
    let per_block: usize = layer_floats.iter().sum();
    if per_token == 0 || per_block == 0 || per_block % per_token != 0 {
        return Err(bad(format!(
            "a piece of {per_block} floats a block, this pool holds {per_token} a token (layout)"
        )));
    }
    let most_blocks = layout.max_prompt.div_ceil(per_block / per_token);
    if blocks == 0 || first_block.saturating_add(blocks) > most_blocks {
        return Err(bad(format!("a piece of blocks {first_block}..+{blocks}: this pool takes at most {most_blocks}")));
    }
    let mut crc = Crc32c::new();
    let mut seen = |bytes: &[u8]| {
        if header.checked {
            crc.update(bytes)
        }
    };
    let (mut kv, mut landed) = (Vec::new(), None);
    match landing.filter(|_| per_block == per_token * layout.block_size) {
        Some(landing) => match land(r, landing, blocks * per_block, &mut seen)? {
            Ok(kv) => landed = Some(Landed(std::sync::Arc::new(kv))),
            Err(why) => {
                read_u32(r)?;
                return Ok(Err(format!("landing in device memory: {why}")));
            }
        },
        None => {
            kv = vec![0f32; blocks * per_block];
            read_floats(r, &mut kv, &mut seen)?;
        }
    }
    let sent_crc = read_u32(r)?;
    if header.checked && crc.value() != sent_crc {
        return Ok(Err(format!("checksum {:#010x}, expected {sent_crc:#010x}", crc.value())));
    }
    let transfer = TransferId { nonce: header.nonce, generation: header.generation };
    let arrived_ms = crate::messages::wall_ms();
    let (request, sent_ms) = (header.request, header.sent_ms);
    Ok(Ok(KvPiece {
        request,
        transfer,
        first_block,
        blocks,
        layer_floats,
        kv,
        source: None,
        landed,
        sent_ms,
        arrived_ms,
    }))
}

/// The drop frame for `request`'s pieces of `transfer`.
pub(super) fn drop_frame(request: u64, transfer: TransferId) -> Vec<u8> {
    frames::encode(&ToConsumer::DropPieces { request, nonce: transfer.nonce })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::wire::tests::layout;

    /// A piece frame and its floats read back from `bytes`.
    fn read(bytes: &[u8]) -> std::io::Result<Result<KvPiece, String>> {
        let mut r = bytes;
        match frames::read_to_consumer(&mut r)? {
            ToConsumer::Piece(header) => read_piece(&mut r, header, &layout(), None),
            other => panic!("not a piece: {other:?}"),
        }
    }

    fn piece() -> KvPiece {
        KvPiece {
            request: 5,
            transfer: TransferId { nonce: 3, generation: 1 },
            first_block: 2,
            blocks: 2,
            layer_floats: vec![2, 4],
            kv: (0..12).map(|i| i as f32).collect(),
            source: None,
            landed: None,
            sent_ms: 12.5,
            arrived_ms: 0.0,
        }
    }

    #[test]
    fn a_piece_round_trips_and_a_damaged_one_is_not_staged() {
        let (mut bytes, mut written) = (Vec::new(), 0);
        write_piece(&mut bytes, &piece(), true, None, &mut written).unwrap();
        assert_eq!(written as usize, bytes.len());
        let got = read(&bytes).unwrap().unwrap();
        assert_eq!(KvPiece { arrived_ms: 0.0, ..got }, piece());
        let mut damaged = bytes.clone();
        let at = damaged.len() - 8;
        damaged[at] ^= 1;
        assert!(read(&damaged).unwrap().is_err(), "damaged: refused");
    }

    #[test]
    fn a_piece_of_another_layout_or_outside_the_prompt_ends_the_connection() {
        let mut wide = piece();
        wide.layer_floats = vec![2, 5];
        wide.kv.extend([0.0; 2]);
        let far = KvPiece { first_block: 100, ..piece() };
        for p in [wide, far] {
            let (mut bytes, mut written) = (Vec::new(), 0);
            write_piece(&mut bytes, &p, true, None, &mut written).unwrap();
            let e = read(&bytes).unwrap_err();
            assert!(e.to_string().contains("this pool"), "{e}");
        }
        let mut truncated = Vec::new();
        write_piece(&mut truncated, &piece(), true, None, &mut 0).unwrap();
        truncated.truncate(30);
        assert!(read(&truncated).is_err());
    }
}
