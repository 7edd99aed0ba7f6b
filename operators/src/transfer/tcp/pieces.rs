//! A streamed handoff's pieces on a tcp link (`transfer::stream`): the producer's sending thread
//! writes each piece as it comes (paced at the link's rate, checksummed as it goes), and the
//! consumer stages it on the connection it came by, checked against its own layout before a
//! byte of payload is read. A piece that does not arrive whole is not staged: the handoff that
//! needs it is then refused, and sent again whole. Staged pieces go with their handoff, an
//! abort, a drop frame, or the end of their connection.

use super::{read_u32, read_u64};
use crate::checksum::Crc32c;
use crate::transfer::wire::ConsumerLayout;
use crate::transfer::{le_bytes, read_floats, KvPiece, LinkRate, TransferId, PIECE_FLOATS};
use std::io::{Read, Write};

/// In place of a descriptor's length: a piece sent ahead of its handoff follows.
pub(super) const PIECE_FRAME: u32 = u32::MAX - 2;
/// In place of a descriptor's length: drop the pieces staged for a request (request, nonce).
pub(super) const DROP_PIECES_FRAME: u32 = u32::MAX - 3;
/// How a consumer's refusal of a handoff whose pieces it lacks begins (the producer sends it
/// again, whole).
pub(super) const PIECES_REFUSAL: &str = "streamed pieces";
/// The most layers a piece names.
const MAX_LAYERS: usize = 1 << 12;

/// Writes `piece` (the frame's marker, its header — with whether it is checksummed —, its floats
/// and their CRC32C, or 0 when `checksum` is off). Adds the bytes written to `written`.
pub(super) fn write_piece(
    w: &mut impl Write,
    piece: &KvPiece,
    checksum: bool,
    rate: Option<&LinkRate>,
    written: &mut u64,
) -> std::io::Result<()> {
    let mut header = PIECE_FRAME.to_le_bytes().to_vec();
    header.extend_from_slice(&piece.request.to_le_bytes());
    header.extend_from_slice(&piece.transfer.nonce.to_le_bytes());
    header.extend_from_slice(&piece.transfer.generation.to_le_bytes());
    for n in [piece.first_block, piece.blocks, usize::from(checksum), piece.layer_floats.len()] {
        header.extend_from_slice(&(n as u32).to_le_bytes());
    }
    for &n in &piece.layer_floats {
        header.extend_from_slice(&(n as u32).to_le_bytes());
    }
    header.extend_from_slice(&piece.sent_ms.to_bits().to_le_bytes());
    let pace = |bytes: usize| rate.inspect(|r| r.pace(bytes as u64));
    pace(header.len());
    w.write_all(&header)?;
    *written += header.len() as u64;
    let mut crc = Crc32c::new();
    for floats in piece.kv.chunks(PIECE_FLOATS) {
        let bytes = le_bytes(floats);
        pace(bytes.len());
        if checksum {
            crc.update(&bytes);
        }
        w.write_all(&bytes)?;
        *written += bytes.len() as u64;
    }
    w.write_all(&(if checksum { crc.value() } else { 0 }).to_le_bytes())?;
    *written += 4;
    w.flush()
}

/// Reads a piece after its frame marker, checking its shape against `layout` before its floats.
/// `Err`: the connection cannot go on (it ended, or the header was malformed); `Ok(Err(why))`:
/// the piece was read but is not staged (damaged bytes).
pub(super) fn read_piece(r: &mut impl Read, layout: &ConsumerLayout) -> std::io::Result<Result<KvPiece, String>> {
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let request = read_u64(r)?;
    let transfer = TransferId { nonce: read_u64(r)?, generation: read_u32(r)? };
    let (first_block, blocks) = (read_u32(r)? as usize, read_u32(r)? as usize);
    let (checked, layers) = (read_u32(r)? != 0, read_u32(r)? as usize);
    if layers > MAX_LAYERS {
        return Err(bad(format!("a piece of {layers} layers (at most {MAX_LAYERS})")));
    }
    let layer_floats = (0..layers).map(|_| read_u32(r).map(|n| n as usize)).collect::<std::io::Result<Vec<_>>>()?;
    let sent_ms = f64::from_bits(read_u64(r)?);
    let most_blocks = layout.max_prompt.div_ceil(layout.block_size.max(1));
    let per_block: usize = layer_floats.iter().sum();
    if per_block != layout.floats_per_block || per_block == 0 {
        return Err(bad(format!(
            "a piece of {per_block} floats a block, this pool holds {} (layout)",
            layout.floats_per_block
        )));
    }
    if blocks == 0 || first_block.saturating_add(blocks) > most_blocks {
        return Err(bad(format!("a piece of blocks {first_block}..+{blocks}: this pool takes at most {most_blocks}")));
    }
    let mut kv = vec![0f32; blocks * per_block];
    let mut crc = Crc32c::new();
    read_floats(r, &mut kv, |bytes| {
        if checked {
            crc.update(bytes)
        }
    })?;
    let sent_crc = read_u32(r)?;
    if checked && crc.value() != sent_crc {
        return Ok(Err(format!("checksum {:#010x}, expected {sent_crc:#010x}", crc.value())));
    }
    let arrived_ms = crate::messages::wall_ms();
    Ok(Ok(KvPiece { request, transfer, first_block, blocks, layer_floats, kv, sent_ms, arrived_ms }))
}

/// The drop frame for `request`'s pieces of `transfer`.
pub(super) fn drop_frame(request: u64, transfer: TransferId) -> Vec<u8> {
    let mut frame = DROP_PIECES_FRAME.to_le_bytes().to_vec();
    frame.extend_from_slice(&request.to_le_bytes());
    frame.extend_from_slice(&transfer.nonce.to_le_bytes());
    frame
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::wire::tests::layout;

    fn piece() -> KvPiece {
        KvPiece {
            request: 5,
            transfer: TransferId { nonce: 3, generation: 1 },
            first_block: 2,
            blocks: 2,
            layer_floats: vec![2, 4],
            kv: (0..12).map(|i| i as f32).collect(),
            sent_ms: 12.5,
            arrived_ms: 0.0,
        }
    }

    #[test]
    fn a_piece_round_trips_and_a_damaged_one_is_not_staged() {
        let (mut bytes, mut written) = (Vec::new(), 0);
        write_piece(&mut bytes, &piece(), true, None, &mut written).unwrap();
        assert_eq!(written as usize, bytes.len());
        assert_eq!(u32::from_le_bytes(bytes[..4].try_into().unwrap()), PIECE_FRAME);
        let got = read_piece(&mut &bytes[4..], &layout()).unwrap().unwrap();
        assert_eq!(KvPiece { arrived_ms: 0.0, ..got }, piece());
        let mut damaged = bytes.clone();
        let at = damaged.len() - 8;
        damaged[at] ^= 1;
        assert!(read_piece(&mut &damaged[4..], &layout()).unwrap().is_err(), "damaged: refused");
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
            let e = read_piece(&mut &bytes[4..], &layout()).unwrap_err();
            assert!(e.to_string().contains("this pool"), "{e}");
        }
        let mut truncated = Vec::new();
        write_piece(&mut truncated, &piece(), true, None, &mut 0).unwrap();
        truncated.truncate(30);
        assert!(read_piece(&mut &truncated[4..], &layout()).is_err());
    }
}
