//! Paged attention within a step (`kernels/cuda/model.cu`: `paged_attention`, then
//! `attention_merge`): each query row over the cache rows its sequence sees, cut into key parts
//! merged after, optionally only the keys DeepSeek-V3.2's indexer selected ([`Selection`]). Shared
//! by `gqa.rs` and `mla.rs`.

use super::Step;
use crate::cuda::error::CudaError;
use crate::cuda::gpu::DeviceBuf;
use crate::cuda::launch::{reduce_threads, Arg};
use crate::cuda::rows::StepShape;

/// `kernels/cuda/model.cu`'s paged_attention: query heads of one kv head per block
/// (`HEADS_PER_WARP` a warp, up to `ATTENTION_WARPS` warps sharing the staged keys), keys staged
/// at a time, a row's keys in parts of `KEY_SPLIT` (merged by attention_merge), and the widest
/// heads it holds in registers.
const HEADS_PER_WARP: usize = 2;
const ATTENTION_WARPS: usize = 8;
const STAGED_KEYS: usize = 8;
/// The parts' scratch of one launch (floats; 256 MiB): longer batches go in slices of rows.
const ATTENTION_PARTS_FLOATS: usize = 64 << 20;
const MAX_QK_WIDTH: usize = 24 * 32;
const MAX_V_WIDTH: usize = 16 * 32;

/// The keys each row attends to, as DeepSeek-V3.2's indexer picked them (`index_topk`): per row
/// a count (−1: all it sees) and up to `stride` ascending positions.
pub(super) struct Selection {
    pub(super) selected: DeviceBuf<i32>,
    pub(super) counts: DeviceBuf<i32>,
    pub(super) stride: usize,
}

impl Step<'_> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        out: u64,
        q: u64,
        q_stride: usize,
        kv_layer: usize,
        q_heads: usize,
        kv_heads: usize,
        qk: usize,
        v: usize,
        k_offset: usize,
        v_offset: usize,
        window: Option<usize>,
        scale: f32,
        sparse: Option<&Selection>,
    ) -> Result<(), CudaError> {
        if qk > MAX_QK_WIDTH || v > MAX_V_WIDTH {
            return Err(CudaError::Unsupported(format!(
                "attention heads of {qk} (scores) and {v} (values): the CUDA kernel holds at most {MAX_QK_WIDTH} and \
                 {MAX_V_WIDTH}"
            )));
        }
        // as many warps as the group's heads need, up to ATTENTION_WARPS (the kernel reads them)
        let group = q_heads / kv_heads;
        let warps = group.div_ceil(HEADS_PER_WARP).min(ATTENTION_WARPS);
        let head_parts = group.div_ceil(warps * HEADS_PER_WARP);
        // every row's keys fit in `splits` parts (index_row ≥ position + 1 ≥ its keys); the
        // rows go in slices so the parts' scratch stays bounded (a row's bits do not depend on it)
        let splits = StepShape { rows: self.rows, seqs: self.seqs, sampled: 0, index_row: self.index_row }.key_parts();
        let per_row = q_heads * splits * (v + 2);
        let slice = (ATTENTION_PARTS_FLOATS / per_row).clamp(1, self.rows);
        let parts = self.gpu.scratch::<f32>(slice * per_row)?;
        for r0 in (0..self.rows).step_by(slice) {
            let n = slice.min(self.rows - r0);
            self.gpu.launch(
                "paged_attention",
                ((n * kv_heads * head_parts) as u32, splits as u32, 1),
                (32 * warps) as u32,
                (STAGED_KEYS * (qk + v) * 4) as u32,
                &[
                    Arg::Ptr(parts.ptr()),
                    Arg::Ptr(q),
                    Arg::Ptr(self.kv.layer(kv_layer)),
                    self.kv.bf16_arg(),
                    Arg::Ptr(self.at.tables),
                    Arg::Ptr(self.at.table_at),
                    Arg::Ptr(self.at.positions),
                    Arg::Ptr(self.at.seqs),
                    Arg::I32(r0 as i32),
                    Arg::I32(self.rows as i32),
                    Arg::I32(q_heads as i32),
                    Arg::I32(kv_heads as i32),
                    Arg::I32(qk as i32),
                    Arg::I32(v as i32),
                    Arg::I32(k_offset as i32),
                    Arg::I32(v_offset as i32),
                    Arg::I32(self.kv.width(kv_layer) as i32),
                    Arg::I32(self.kv.block_size as i32),
                    Arg::I32(window.unwrap_or(0) as i32),
                    Arg::F32(scale),
                    Arg::I64(q_stride as i64),
                    Arg::Ptr(sparse.map_or(0, |s| s.selected.ptr())),
                    Arg::Ptr(sparse.map_or(0, |s| s.counts.ptr())),
                    Arg::I32(sparse.map_or(0, |s| s.stride) as i32),
                ],
            )?;
            self.gpu.launch(
                "attention_merge",
                ((n * q_heads) as u32, 1, 1),
                reduce_threads(v),
                0,
                &[
                    Arg::Ptr(out),
                    Arg::Ptr(parts.ptr()),
                    Arg::I32(r0 as i32),
                    Arg::I32(q_heads as i32),
                    Arg::I32(v as i32),
                    Arg::I32(splits as i32),
                ],
            )?;
        }
        Ok(())
    }
}
