//! Products `y = x · Wᵀ + bias` on the device: how an `m × n` product over `k` is launched —
//! `linear_narrow`, a square tile, or split by chunk of k and summed (`kernels/cuda/model.cu`; bf16
//! weights: `kernels/cuda/bf16.cu`) — chosen from the sizes alone, so an element is summed the same
//! way whatever the batch.

use super::error::CudaError;
use super::gpu::{DeviceBuf, Gpu, TILE_ARRIVALS};
use super::launch::{blocks_for, Arg};
use super::sources::{tuned, WIDE_SHARED};

/// Outputs at most this wide (`kernels/cuda/model.cu`'s NARROW_N) summed over at least
/// [`NARROW_MIN_K`] inputs take `linear_narrow`: long chains on few blocks are what it avoids.
const NARROW_N: usize = 256;
const NARROW_MIN_K: usize = 512;

/// Whether an `n × k` product takes `linear_narrow` (and so stays f32 in a bf16 model).
pub(super) fn is_narrow(n: usize, k: usize) -> bool {
    n <= NARROW_N && k >= NARROW_MIN_K
}

/// `kernels/cuda/model.cu`'s LINEAR_CHUNK: the inputs each fma chain of a product covers.
const LINEAR_CHUNK: usize = 256;

/// How an `m × n` product over `k` (`z` of them) is launched.
#[derive(Debug, PartialEq)]
enum LinearPlan {
    /// One kernel writes y: `linear_narrow` or a square tile.
    Whole(&'static str, (u32, u32, u32)),
    /// `linear_split` writes each chunk's chains of 64 × 64 tiles, `linear_chunks_sum` adds them.
    Split { chunks: usize, grid: (u32, u32, u32) },
}

/// Narrow outputs over long inputs take `linear_narrow` (one warp per element; chosen by `n` and
/// `k` alone, so a layer sums its elements one way whatever the batch). Wider ones take 64-square
/// tiles when they give every SM two blocks; else those tiles split by chunk of k when that gives
/// every SM one (each with four times a small tile's work);
/// else the largest smaller tile (32 or 16) that does, else the smallest. Every tile and the split
/// give an element the same chains, so these choices never change a bit.
fn linear_plan(sms: usize, m: usize, n: usize, k: usize, z: usize) -> LinearPlan {
    if is_narrow(n, k) {
        return LinearPlan::Whole("linear_narrow", (m.max(1) as u32, blocks_for(n, 8), z as u32));
    }
    let blocks = |tile: usize| m.div_ceil(tile) * n.div_ceil(tile) * z;
    let enough = 2 * sms;
    let chunks = k.div_ceil(LINEAR_CHUNK);
    if blocks(64) < enough && chunks > 1 && blocks(64) * chunks >= sms {
        return LinearPlan::Split { chunks, grid: (blocks_for(n, 64), blocks_for(m, 64), (z * chunks) as u32) };
    }
    let (kernel, tile) = [("linear", 64), ("linear_t2", 32)]
        .into_iter()
        .find(|&(_, tile)| blocks(tile) >= enough)
        .unwrap_or(("linear_t1", 16));
    LinearPlan::Whole(kernel, (blocks_for(n, tile), blocks_for(m, tile), z as u32))
}

/// A bf16 product (`kernels/cuda/bf16.cu`, its input rounded once: by the kernel that wrote it
/// — `Product::x_bf16` — or by `round_rows_bf16`): 128-square
/// tiles of eight warps where they give every SM two blocks, else 64-square tiles of four warps,
/// split by chunk of k while those would leave SMs without SPLIT_UNDER (1) block; all give an
/// element the same chains.
fn bf16_plan(sms: usize, m: usize, n: usize, k: usize) -> LinearPlan {
    let wide = (blocks_for(n, 128), blocks_for(m, 128));
    if wide.0 * wide.1 >= 2 * sms as u32 {
        return LinearPlan::Whole("linear_bf16_wide", (wide.0, wide.1, 1));
    }
    let grid = (blocks_for(n, 64), blocks_for(m, 64));
    let chunks = k.div_ceil(LINEAR_CHUNK);
    if (grid.0 * grid.1) < tuned("SPLIT_UNDER", 1) as u32 * sms as u32 && chunks > 1 {
        return LinearPlan::Split { chunks, grid: (grid.0, grid.1, chunks as u32) };
    }
    LinearPlan::Whole("linear_bf16", (grid.0, grid.1, 1))
}

/// One product `y[z] = (accumulate ? y[z] : 0) + x[z] · W[z]ᵀ + bias` as [`linear_plan`] says.
pub(super) struct Product {
    pub y: u64,
    pub x: u64,
    /// x already rounded to bf16, `m × k` rows of `k` (0: none; a bf16 product rounds x itself).
    pub x_bf16: u64,
    pub w: u64,
    /// W holds bf16 (`kernels/cuda/bf16.cu`), else f32.
    pub bf16: bool,
    pub bias: u64,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub z: usize,
    pub x_stride: usize,
    pub y_stride: usize,
    pub x_batch: usize,
    pub w_batch: usize,
    pub y_batch: usize,
    pub accumulate: bool,
}

impl Product {
    pub(super) fn launch(&self, gpu: &Gpu) -> Result<(), CudaError> {
        if self.bf16 {
            return self.launch_bf16(gpu);
        }
        match linear_plan(gpu.sms, self.m, self.n, self.k, self.z) {
            LinearPlan::Whole(kernel, grid) => gpu.launch(
                kernel,
                grid,
                256,
                0,
                &[
                    Arg::Ptr(self.y),
                    Arg::Ptr(self.x),
                    Arg::Ptr(self.w),
                    Arg::Ptr(self.bias),
                    Arg::I32(self.m as i32),
                    Arg::I32(self.n as i32),
                    Arg::I32(self.k as i32),
                    Arg::I64(self.x_stride as i64),
                    Arg::I64(self.y_stride as i64),
                    Arg::I64(self.x_batch as i64),
                    Arg::I64(self.w_batch as i64),
                    Arg::I64(self.y_batch as i64),
                    Arg::I32(self.accumulate as i32),
                ],
            ),
            LinearPlan::Split { chunks, grid } => {
                let (m, n) = (self.m, self.n);
                let partial = gpu.scratch::<f32>(self.z * chunks * m * n)?;
                gpu.launch(
                    "linear_split",
                    grid,
                    256,
                    0,
                    &[
                        Arg::Ptr(partial.ptr()),
                        Arg::Ptr(self.x),
                        Arg::Ptr(self.w),
                        Arg::I32(m as i32),
                        Arg::I32(n as i32),
                        Arg::I32(self.k as i32),
                        Arg::I64(self.x_stride as i64),
                        Arg::I64(self.x_batch as i64),
                        Arg::I64(self.w_batch as i64),
                        Arg::I32(chunks as i32),
                    ],
                )?;
                self.sum_chunks(gpu, &partial, chunks)
            }
        }
    }

    fn launch_bf16(&self, gpu: &Gpu) -> Result<(), CudaError> {
        if self.z != 1 {
            return Err(CudaError::Unsupported("batched bf16 products".into()));
        }
        let (m, n, k) = (self.m, self.n, self.k);
        let tail = [
            Arg::Ptr(self.bias),
            Arg::I32(m as i32),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            Arg::I64(self.y_stride as i64),
            Arg::I32(self.accumulate as i32),
        ];
        // every bf16 kernel reads the input rounded to bf16 once, [m × k]: by its producer, or here
        debug_assert!(self.x_bf16 == 0 || self.x_stride == k, "a rounded copy of x is rows of k");
        let rounded;
        let xb = match self.x_bf16 {
            0 => {
                rounded = gpu.scratch::<u16>(m * k)?;
                gpu.launch(
                    "round_rows_bf16",
                    (m as u32, blocks_for(k, 256), 1),
                    256,
                    0,
                    &[
                        Arg::Ptr(rounded.ptr()),
                        Arg::Ptr(self.x),
                        Arg::I32(m as i32),
                        Arg::I32(k as i32),
                        Arg::I64(self.x_stride as i64),
                    ],
                )?;
                rounded.ptr()
            }
            given => given,
        };
        let head = [Arg::Ptr(self.y), Arg::Ptr(xb), Arg::Ptr(self.w)];
        match bf16_plan(gpu.sms, m, n, k) {
            LinearPlan::Whole(kernel, grid) => {
                let (threads, shared) = if kernel == "linear_bf16_wide" { (256, WIDE_SHARED) } else { (128, 0) };
                gpu.launch(kernel, grid, threads, shared, &[&head[..], &tail[..]].concat())
            }
            LinearPlan::Split { chunks, grid } => {
                let partial = gpu.scratch::<f32>(chunks * m * n)?;
                // the tile's last block adds its chunks where the device's counters cover the grid
                // (unless SPLIT_SUM_LAUNCH: then linear_chunks_sum does)
                let arrivals = gpu
                    .tile_arrivals()
                    .filter(|_| (grid.0 * grid.1) as usize <= TILE_ARRIVALS && tuned("SPLIT_SUM_LAUNCH", 1) == 0);
                // a block runs `group` consecutive chunks (SPLIT_CHUNKS: the same chains either way)
                let group = tuned("SPLIT_CHUNKS", 1) as usize;
                gpu.launch(
                    "linear_bf16_split",
                    (grid.0, grid.1, chunks.div_ceil(group) as u32),
                    128,
                    0,
                    &[
                        Arg::Ptr(partial.ptr()),
                        Arg::Ptr(xb),
                        Arg::Ptr(self.w),
                        Arg::I32(m as i32),
                        Arg::I32(n as i32),
                        Arg::I32(k as i32),
                        Arg::Ptr(self.y),
                        Arg::Ptr(self.bias),
                        Arg::I64(self.y_stride as i64),
                        Arg::I32(self.accumulate as i32),
                        Arg::Ptr(arrivals.unwrap_or(0)),
                        Arg::I32(group as i32),
                    ],
                )?;
                match arrivals {
                    Some(_) => Ok(()),
                    None => self.sum_chunks(gpu, &partial, chunks),
                }
            }
        }
    }

    /// y from the chunks' chains in `partial` (`linear_chunks_sum`).
    fn sum_chunks(&self, gpu: &Gpu, partial: &DeviceBuf<f32>, chunks: usize) -> Result<(), CudaError> {
        let (m, n) = (self.m, self.n);
        gpu.launch(
            "linear_chunks_sum",
            (blocks_for(m * n, 256), self.z as u32, 1),
            256,
            0,
            &[
                Arg::Ptr(self.y),
                Arg::Ptr(partial.ptr()),
                Arg::Ptr(self.bias),
                Arg::I32(m as i32),
                Arg::I32(n as i32),
                Arg::I32(chunks as i32),
                Arg::I64(self.y_stride as i64),
                Arg::I64(self.y_batch as i64),
                Arg::I32(self.accumulate as i32),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On an H200 (132 SMs), a decode batch's skinny products split by chunk of k, prefill's
    /// take whole tiles and narrow ones take `linear_narrow`, whatever the batch.
    #[test]
    fn products_are_planned_by_shape() {
        let split = |m, n, k| linear_plan(132, m, n, k, 1);
        assert_eq!(split(64, 2048, 2048), LinearPlan::Split { chunks: 8, grid: (32, 1, 8) });
        assert_eq!(split(64, 2048, 5632), LinearPlan::Split { chunks: 22, grid: (32, 1, 22) });
        assert_eq!(split(16384, 2048, 2048), LinearPlan::Whole("linear", (32, 256, 1)));
        assert_eq!(split(64, 32000, 2048), LinearPlan::Whole("linear", (500, 1, 1)));
        assert_eq!(split(1, 128, 2048), LinearPlan::Whole("linear_narrow", (1, 16, 1)));
        assert_eq!(split(64, 128, 2048), LinearPlan::Whole("linear_narrow", (64, 16, 1)));
        // one chunk of k: nothing to split, smaller tiles instead
        assert_eq!(linear_plan(132, 64, 512, 128, 16), LinearPlan::Whole("linear_t2", (16, 2, 16)));
    }

    /// bf16: prefill takes 128-square tiles, a short chunk 64-square ones, decode splits by chunk.
    #[test]
    fn bf16_products_are_planned_by_shape() {
        assert_eq!(bf16_plan(132, 16384, 2048, 2048), LinearPlan::Whole("linear_bf16_wide", (16, 128, 1)));
        assert_eq!(bf16_plan(132, 1024, 2048, 2048), LinearPlan::Whole("linear_bf16", (32, 16, 1)));
        assert_eq!(bf16_plan(132, 64, 2048, 2048), LinearPlan::Split { chunks: 8, grid: (32, 1, 8) });
        // a tile for every SM: not split (no chains written out and read back)
        assert_eq!(bf16_plan(132, 64, 16384, 2048), LinearPlan::Whole("linear_bf16", (256, 1, 1)));
        assert_eq!(bf16_plan(132, 64, 32000, 2048), LinearPlan::Whole("linear_bf16", (500, 1, 1)));
    }
}
