//! Streaming handoffs (DESIGN §8): a prefill's completed chunks leave as pieces while its later
//! chunks compute, and its handoff carries only what was not sent ahead. A piece is the KV of a
//! run of whole prompt blocks, packed by layer: copied out by the CPU step that completed them,
//! or named in place in a cuda rank's device memory (read by the link, on a stream of its own,
//! never by the rank's thread); the producer keeps the blocks until the handoff's ack, and a
//! producer preempted mid-stream starts its stream over under a new transfer.
//! The consumer stages what arrives (a cuda consumer over tcp lands each piece in device memory
//! as it comes) and takes the handoff only once every piece is there: imported with the rest, or
//! refused (then the producer sends it whole) — it never decodes from a partial prompt. An abort at any point drops the staged
//! pieces.

use super::TransferId;
use std::collections::HashMap;
use std::sync::Arc;

/// The KV of a run of a prompt's blocks, sent ahead of its handoff.
#[derive(Clone, Debug, PartialEq)]
pub struct KvPiece {
    pub request: u64,
    /// The handoff it belongs to (the request's one transfer).
    pub transfer: TransferId,
    /// The first block it carries, counted from the first block the handoff sends (after the
    /// blocks the consumer already holds).
    pub first_block: usize,
    pub blocks: usize,
    /// Floats of one block in each layer, in order (their sum is the floats of a block).
    pub layer_floats: Vec<usize>,
    /// Packed by layer: every block's floats of layer 0, then layer 1, … — empty when `source`
    /// names the blocks in place.
    pub kv: Vec<f32>,
    pub source: Option<crate::kv_source::KvSource>,
    /// Its floats in a cuda consumer's device memory, landed as they arrived (`kv` then empty).
    pub landed: Option<super::landed::Landed>,
    /// When it was handed to the link, and when its last byte reached the consumer (`wall_ms`).
    pub sent_ms: f64,
    pub arrived_ms: f64,
}

impl KvPiece {
    /// Its floats (read from the producer's blocks when in place).
    pub fn floats(&self) -> std::borrow::Cow<'_, [f32]> {
        match (&self.source, &self.landed) {
            (Some(source), _) => std::borrow::Cow::Owned(source.read()),
            (None, Some(landed)) => std::borrow::Cow::Owned(landed.read_back(self.request)),
            (None, None) => std::borrow::Cow::Borrowed(&self.kv),
        }
    }

    /// How many floats it carries.
    pub fn len(&self) -> usize {
        match (&self.source, &self.landed) {
            (Some(s), _) => s.blocks.len() * s.floats_per_block,
            (None, Some(landed)) => landed.0.floats,
            (None, None) => self.kv.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn bytes(&self) -> u64 {
        4 * self.len() as u64
    }
}

/// Why pieces and the rest of a handoff do not make its KV.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MergeError {
    #[error("streamed pieces cover blocks {covered} of the {expected} sent ahead (a piece is missing)")]
    Missing { covered: String, expected: usize },
    #[error("a streamed piece's layers ({got} floats a block) differ from the handoff's {expected}")]
    Layers { got: usize, expected: usize },
    #[error("{what} holds {got} floats, {expected} expected")]
    Size { what: &'static str, got: usize, expected: usize },
}

/// Checks that `pieces` (in block order) cover blocks `0..streamed` exactly, each of
/// `floats_per_block` floats a block.
pub fn check_cover(pieces: &[Arc<KvPiece>], streamed: usize, floats_per_block: usize) -> Result<(), MergeError> {
    let mut next = 0;
    for p in pieces {
        if p.first_block != next {
            break;
        }
        if p.layer_floats.iter().sum::<usize>() != floats_per_block {
            return Err(MergeError::Layers { got: p.layer_floats.iter().sum(), expected: floats_per_block });
        }
        if p.len() != p.blocks * floats_per_block {
            return Err(MergeError::Size {
                what: "a streamed piece",
                got: p.len(),
                expected: p.blocks * floats_per_block,
            });
        }
        next += p.blocks;
    }
    if next != streamed || pieces.iter().map(|p| p.blocks).sum::<usize>() != streamed {
        let covered = pieces.iter().map(|p| format!("{}..{}", p.first_block, p.first_block + p.blocks)).collect();
        return Err(MergeError::Missing { covered: join(covered), expected: streamed });
    }
    Ok(())
}

fn join(parts: Vec<String>) -> String {
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

/// The KV of `pieces` followed by `rest` (`rest_blocks` blocks, packed by layer), packed by
/// layer over all of them — the layout a whole handoff carries. `pieces` must pass
/// [`check_cover`].
pub fn merge(pieces: &[Arc<KvPiece>], rest: &[f32], rest_blocks: usize) -> Result<Vec<f32>, MergeError> {
    let Some(layers) = pieces.first().map(|p| &p.layer_floats) else { return Ok(rest.to_vec()) };
    let per_block: usize = layers.iter().sum();
    if rest.len() != rest_blocks * per_block {
        return Err(MergeError::Size {
            what: "the handoff's unsent blocks",
            got: rest.len(),
            expected: rest_blocks * per_block,
        });
    }
    let floats: Vec<std::borrow::Cow<'_, [f32]>> = pieces.iter().map(|p| p.floats()).collect();
    let parts = floats.iter().zip(pieces).map(|(kv, p)| (&kv[..], p.blocks));
    let parts: Vec<(&[f32], usize)> = parts.chain(std::iter::once((rest, rest_blocks))).collect();
    let total: usize = parts.iter().map(|(kv, _)| kv.len()).sum();
    let mut out = Vec::with_capacity(total);
    // Layer l of a part starts after its blocks' floats of the layers before l.
    let mut before = 0;
    for &width in layers {
        for &(kv, blocks) in &parts {
            let at = before * blocks;
            out.extend_from_slice(&kv[at..at + width * blocks]);
        }
        before += width;
    }
    Ok(out)
}

/// Test switch `accept_missing_pieces` only: `pieces` with every block of `0..streamed` they
/// lack read as zeros, one piece a block.
pub fn zeros_for_missing(pieces: Vec<Arc<KvPiece>>, streamed: usize, floats_per_block: usize) -> Vec<Arc<KvPiece>> {
    let Some(first) = pieces.first().cloned() else { return pieces };
    let mut have = vec![None; streamed];
    for p in pieces.into_iter().filter(|p| p.first_block + p.blocks <= streamed) {
        let at = p.first_block;
        have[at] = Some(p);
    }
    let mut out = Vec::new();
    let mut b = 0;
    while b < streamed {
        match have[b].take() {
            Some(p) => {
                b += p.blocks;
                out.push(p);
            }
            None => {
                let kv = vec![0.0; floats_per_block];
                out.push(Arc::new(KvPiece {
                    first_block: b,
                    blocks: 1,
                    kv,
                    source: None,
                    landed: None,
                    ..(*first).clone()
                }));
                b += 1;
            }
        }
    }
    out
}

/// Pieces that reached a consumer, by request, until their handoff takes them (or an abort,
/// or the end of the connection they came by, drops them).
#[derive(Default)]
pub struct StagedPieces {
    by_request: HashMap<u64, Vec<Arc<KvPiece>>>,
}

impl StagedPieces {
    /// Stages `piece` (one of an older transfer of the same request is dropped first).
    pub fn put(&mut self, piece: KvPiece) {
        let pieces = self.by_request.entry(piece.request).or_default();
        pieces.retain(|p| p.transfer.nonce == piece.transfer.nonce);
        let at = pieces.partition_point(|p| p.first_block < piece.first_block);
        pieces.insert(at, Arc::new(piece));
    }

    /// The pieces of `request`'s transfer `transfer`, in block order (none left staged). A
    /// transfer is named by its nonce: a preemption after the first piece moves the request to
    /// a newer generation, and its handoff carries that one.
    pub fn take(&mut self, request: u64, transfer: TransferId) -> Vec<Arc<KvPiece>> {
        let mut pieces = self.by_request.remove(&request).unwrap_or_default();
        pieces.retain(|p| p.transfer.nonce == transfer.nonce);
        pieces
    }

    /// Drops what is staged for `request`. Returns the pieces dropped.
    pub fn drop_request(&mut self, request: u64) -> usize {
        self.by_request.remove(&request).map_or(0, |p| p.len())
    }

    /// Pieces staged.
    pub fn len(&self) -> usize {
        self.by_request.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.by_request.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: TransferId = TransferId { nonce: 1, generation: 0 };

    /// Blocks `ids` of a two-layer cache (widths 2 and 3 floats a block), packed by layer: each
    /// float names its layer, block and place.
    fn packed(ids: std::ops::Range<usize>) -> Vec<f32> {
        let mut out = Vec::new();
        for (l, width) in [(0, 2), (1, 3)] {
            for b in ids.clone() {
                out.extend((0..width).map(|i| (l * 1000 + b * 10 + i) as f32));
            }
        }
        out
    }

    fn piece(first: usize, blocks: usize) -> KvPiece {
        KvPiece {
            request: 7,
            transfer: T,
            first_block: first,
            blocks,
            layer_floats: vec![2, 3],
            kv: packed(first..first + blocks),
            source: None,
            landed: None,
            sent_ms: 0.0,
            arrived_ms: 0.0,
        }
    }

    #[test]
    fn pieces_and_the_rest_merge_into_the_whole_handoffs_layout() {
        let pieces = vec![Arc::new(piece(0, 2)), Arc::new(piece(2, 1))];
        check_cover(&pieces, 3, 5).unwrap();
        assert_eq!(merge(&pieces, &packed(3..5), 2).unwrap(), packed(0..5));
        assert_eq!(merge(&pieces, &[], 0).unwrap(), packed(0..3));
    }

    #[test]
    fn a_missing_or_misshapen_piece_is_refused_by_name() {
        let gap = vec![Arc::new(piece(0, 2)), Arc::new(piece(3, 1))];
        let e = check_cover(&gap, 4, 5).unwrap_err();
        assert!(e.to_string().contains("0..2, 3..4") && e.to_string().contains("missing"), "{e}");
        assert!(check_cover(&[], 1, 5).is_err());
        assert!(check_cover(&[Arc::new(piece(0, 2))], 1, 5).is_err(), "more than was sent ahead");
        assert!(matches!(check_cover(&[Arc::new(piece(0, 1))], 1, 6), Err(MergeError::Layers { .. })));
        let pieces = vec![Arc::new(piece(0, 1))];
        assert!(matches!(merge(&pieces, &[0.0; 4], 1), Err(MergeError::Size { .. })));
    }

    #[test]
    fn staged_pieces_come_out_in_block_order_for_their_transfer_only() {
        let mut staged = StagedPieces::default();
        staged.put(piece(2, 1));
        staged.put(piece(0, 2));
        assert_eq!(staged.len(), 2);
        let other = TransferId { nonce: 2, generation: 0 };
        assert!(staged.take(7, other).is_empty(), "another transfer's pieces are not this one's");
        assert!(staged.is_empty(), "taking drops what was staged for the request");
        staged.put(piece(2, 1));
        staged.put(piece(0, 2));
        let firsts: Vec<usize> = staged.take(7, T).iter().map(|p| p.first_block).collect();
        assert_eq!(firsts, [0, 2]);
        staged.put(piece(0, 1));
        assert_eq!(staged.drop_request(7), 1);
        assert!(staged.is_empty());
    }
}
