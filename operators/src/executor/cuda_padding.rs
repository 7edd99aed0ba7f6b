//! Decode and verification steps padded to a few shapes on a cuda rank, so that their CUDA graphs
//! replay (kvflow_kernels::cuda::graph captures a graph per step shape): with drafting, a step's
//! rows are the sum of each sequence's verification width, which varies step to step, so without
//! padding nearly every verification step has a shape seen once and is launched kernel by kernel.
//! A step whose every row samples (decodes and verifications) and whose rows are below
//! [`PAD_AT_MOST`] gets a padding sequence of its own, up to the next multiple of
//! [`PAD_ROWS_TO`] rows: its rows write KV only into blocks no request holds (allocated beside
//! the pool's), sample into ring slots nothing reads, and come after every real row, so the
//! step's completion never sees them. Families with recurrent state are not padded (a padding
//! row would need a state slot of its own).

use kvflow_kernels::cuda::StepRows;

/// A padded step's rows are a multiple of this.
pub(super) const PAD_ROWS_TO: usize = 8;

/// Steps of this many rows or more are not padded.
pub(super) const PAD_AT_MOST: usize = 64;

/// Blocks of a cuda rank's cache that only padding rows write.
pub(super) fn padding_blocks(block_size: usize) -> usize {
    PAD_AT_MOST.div_ceil(block_size.max(1))
}

/// Pads `rows` (see the module) with a sequence over `table` (the padding blocks), each of its
/// rows sampling into a ring slot `slot` gives.
pub(super) fn pad(rows: &mut StepRows, table: &[u32], block_size: usize, slot: &mut dyn FnMut() -> u32) {
    let n = rows.rows();
    if n == 0 || n != rows.sampled() || n >= PAD_AT_MOST {
        return;
    }
    let pad = n.next_multiple_of(PAD_ROWS_TO) - n;
    if pad == 0 {
        return;
    }
    let tokens = vec![0u32; pad];
    let slots: Vec<u32> = (0..pad).map(|_| slot()).collect();
    rows.push_seq_sampling(&tokens, 0, table, block_size, &slots);
}
