//! Paged attention within a step: each query row over the cache rows its sequence sees. On a bf16
//! cache with keys and values of one width d ≤ 128 (d % 16 == 0), on tensor cores in the
//! FlashAttention manner (`kernels/cuda/attention.cu`: `flash_attention_{16,32,64,128}` and their
//! one-warp `…x1` for decode, then
//! `flash_attention_merge` where a step's few rows are split by key part); otherwise, and where
//! DeepSeek-V3.2's indexer selects the keys ([`Selection`]), `kernels/cuda/model.cu`'s
//! `paged_attention` and `attention_merge`. Which kernel a layer takes follows from its sizes and
//! the cache's dtype alone, never from the batch. Shared by `gqa.rs` and `mla.rs`.

use super::Step;
use crate::cuda::error::CudaError;
use crate::cuda::gpu::DeviceBuf;
use crate::cuda::launch::{reduce_threads, Arg};
use crate::cuda::rows::StepShape;
use crate::cuda::sources::large_shared;

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

/// `kernels/cuda/attention.cu`: the mma rows ((row, query head) pairs) of a warp, and the keys of
/// a part (a row's keys fold part by part from key 0).
const FA_WARP_ROWS: usize = 16;
const FA_PART: usize = 256;
/// The tensor-core kernels by the head width they hold (a narrower d is zero-padded up).
const FA_WIDTHS: [(usize, &str); 4] =
    [(16, "flash_attention_16"), (32, "flash_attention_32"), (64, "flash_attention_64"), (128, "flash_attention_128")];

/// The tensor-core kernel for a layer, where it takes it: a bf16 cache, keys and values of one
/// width d (a multiple of 16, at most 128), rows of the cache 16-byte aligned, every key, and
/// query heads in equal groups per kv head.
fn flash_kernel(
    bf16: bool,
    qk: usize,
    v: usize,
    offsets: [usize; 3],
    heads: (usize, usize),
    sparse: bool,
) -> Option<&'static str> {
    let aligned = offsets.iter().all(|o| o % 8 == 0);
    let grouped = heads.1 > 0 && heads.0 >= heads.1 && heads.0 % heads.1 == 0;
    if !bf16 || qk != v || qk % 16 != 0 || sparse || !aligned || !grouped {
        return None;
    }
    FA_WIDTHS.iter().find(|(w, _)| qk <= *w).map(|(_, name)| *name)
}

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
        let offsets = [k_offset, v_offset, self.kv.width(kv_layer)];
        let bf16 = self.kv.dtype == crate::cuda::Dtype::Bfloat16;
        if let Some(kernel) = flash_kernel(bf16, qk, v, offsets, (q_heads, kv_heads), sparse.is_some()) {
            return self
                .flash_attention(kernel, out, q, q_stride, kv_layer, q_heads, kv_heads, qk, offsets, window, scale);
        }
        // as many warps as the group's heads need, up to ATTENTION_WARPS (the kernel reads them)
        let group = q_heads / kv_heads;
        let warps = group.div_ceil(HEADS_PER_WARP).min(ATTENTION_WARPS);
        let head_parts = group.div_ceil(warps * HEADS_PER_WARP);
        // every row's keys fit in `splits` parts (index_row ≥ position + 1 ≥ its keys); the
        // rows go in slices so the parts' scratch stays bounded (a row's bits do not depend on it)
        let splits =
            StepShape { rows: self.rows, seqs: self.seqs, sampled: 0, index_row: self.index_row, drawn: false }
                .key_parts();
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

    /// `flash_attention_*` over the step's rows: tiles of one sequence's consecutive rows (as
    /// many as fill 64 mma rows with the group's heads), every kv head; the parts of a row's keys
    /// go to blocks of their own (and `flash_attention_merge`) only when the step has too few
    /// tiles to fill the GPU — both give a row the same bits.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention(
        &self,
        kernel: &str,
        out: u64,
        q: u64,
        q_stride: usize,
        kv_layer: usize,
        q_heads: usize,
        kv_heads: usize,
        d: usize,
        [k_offset, v_offset, row_width]: [usize; 3],
        window: Option<usize>,
        scale: f32,
    ) -> Result<(), CudaError> {
        if self.rows == 0 {
            return Ok(());
        }
        let group = q_heads / kv_heads;
        // a step of one or two rows a sequence (decode) in blocks of one warp, whose tiles then
        // hold a sequence's rows alone: four times the blocks in flight; longer ones in blocks of
        // four warps sharing each key tile among 64 mma rows. Both give a row the same bits.
        let warps = if group <= FA_WARP_ROWS && self.rows <= 2 * self.seqs { 1 } else { 4 };
        let kernel = if warps == 1 { format!("{kernel}x1") } else { kernel.to_string() };
        let rows_per_block = FA_WARP_ROWS * warps;
        let heads_per_block = group.min(rows_per_block);
        let head_parts = group.div_ceil(heads_per_block);
        let per_tile = rows_per_block / heads_per_block;
        // at most this many tiles: each sequence's rows cut every `per_tile` from its first
        let tiles = self.seqs + self.rows.saturating_sub(self.seqs) / per_tile;
        let parts = self.index_row.div_ceil(FA_PART).max(1);
        let scratch = self.rows * q_heads * parts * (d + 2);
        let blocks = tiles * kv_heads * head_parts;
        // (a grid's z is at most 65,535)
        let split = parts > 1 && parts <= 65_535 && blocks < 4 * self.gpu.sms && scratch <= ATTENTION_PARTS_FLOATS;
        let partial = self.gpu.scratch::<f32>(if split { scratch } else { 1 })?;
        self.gpu.launch(
            &kernel,
            (tiles as u32, (kv_heads * head_parts) as u32, if split { parts as u32 } else { 1 }),
            32 * warps as u32,
            large_shared(&kernel).unwrap_or(0),
            &[
                Arg::Ptr(out),
                Arg::Ptr(partial.ptr()),
                Arg::Ptr(q),
                Arg::I64(q_stride as i64),
                Arg::Ptr(self.kv.layer(kv_layer)),
                Arg::Ptr(self.at.tables),
                Arg::Ptr(self.at.table_at),
                Arg::Ptr(self.at.positions),
                Arg::Ptr(self.at.row_at),
                Arg::I32(self.seqs as i32),
                Arg::I32(self.rows as i32),
                Arg::I32(q_heads as i32),
                Arg::I32(kv_heads as i32),
                Arg::I32(d as i32),
                Arg::I32(k_offset as i32),
                Arg::I32(v_offset as i32),
                Arg::I32(row_width as i32),
                Arg::I32(self.kv.block_size as i32),
                Arg::I32(window.unwrap_or(0) as i32),
                Arg::F32(scale),
                Arg::I32(heads_per_block as i32),
                Arg::I32(split as i32),
            ],
        )?;
        if split {
            self.gpu.launch(
                "flash_attention_merge",
                ((self.rows * q_heads) as u32, 1, 1),
                reduce_threads(d),
                0,
                &[Arg::Ptr(out), Arg::Ptr(partial.ptr()), Arg::I32(d as i32), Arg::I32(parts as i32)],
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tensor-core kernel takes bf16 caches of equal key and value widths up to 128 (the
    /// narrowest instance that holds them), aligned rows and equal head groups; the rest keep
    /// model.cu's kernel.
    #[test]
    fn attention_layers_take_the_tensor_core_kernel_by_their_sizes() {
        let aligned = [0, 512, 1024];
        assert_eq!(flash_kernel(true, 64, 64, aligned, (32, 8), false), Some("flash_attention_64"));
        assert_eq!(flash_kernel(true, 80, 80, aligned, (32, 8), false), Some("flash_attention_128"));
        assert_eq!(flash_kernel(true, 16, 16, aligned, (4, 2), false), Some("flash_attention_16"));
        assert_eq!(flash_kernel(false, 64, 64, aligned, (32, 8), false), None, "f32 cache");
        assert_eq!(flash_kernel(true, 576, 512, aligned, (16, 1), false), None, "MLA's latent heads");
        assert_eq!(flash_kernel(true, 256, 256, aligned, (8, 1), false), None, "wider than 128");
        assert_eq!(flash_kernel(true, 72, 72, aligned, (8, 1), false), None, "not a multiple of 16");
        assert_eq!(flash_kernel(true, 64, 64, aligned, (32, 8), true), None, "the indexer's selection");
        assert_eq!(flash_kernel(true, 64, 64, [0, 500, 1000], (32, 8), false), None, "unaligned rows");
        assert_eq!(flash_kernel(true, 64, 64, aligned, (30, 8), false), None, "unequal groups");
    }
}
