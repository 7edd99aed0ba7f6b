//! One step of the model on the device, enqueued on the rank's stream and never waited for:
//! embeddings (a token still in flight is read from the sampled-token ring the step before
//! wrote), then per layer `h += mixer(norm(h)); h += ffn(norm(h))` as the CPU decoder computes
//! it, then the final norm, the LM head on the rows that sample, and greedy sampling on the
//! device into the ring and a results buffer. Activations are stream-ordered allocations, freed
//! (in stream order) as soon as the step is enqueued.

use super::gpu::{blocks_for, Arg, CudaError, DeviceBuf, Gpu};
use super::indexer::Selection;
use super::kv::DeviceKv;
use super::state::DeviceState;
use super::weights::{
    DevFfn, DevGdn, DevGqa, DevKda, DevLinear, DevMixer, DevMla, DevMlp, DevMoe, DevNorm, DevQuery, DevRope, DevWeight,
    DeviceModel,
};

/// The high bit of a fed token: the rest is a slot of the sampled-token ring.
pub const FROM_RING: u32 = 0x8000_0000;

/// u32 words of one sampled row in a step's results: token, finite flag, hash low, hash high.
pub const RESULT_WORDS: usize = 4;

/// A step's rows as the kernels read them (host side; uploaded as one array).
#[derive(Clone, Debug, Default)]
pub struct StepRows {
    /// Per row: a token id, or `FROM_RING | slot`.
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    /// Per row: the sequence it belongs to.
    pub seqs: Vec<u32>,
    /// Per row: the cache row its own key and value go to.
    pub write_rows: Vec<u32>,
    /// Every sequence's block table, one after another.
    pub tables: Vec<u32>,
    /// Per sequence: where its table starts in `tables`.
    pub table_at: Vec<u32>,
    /// Rows that sample, and the ring slot each one's token goes to.
    pub logit_rows: Vec<u32>,
    pub ring_slots: Vec<u32>,
    /// Per sequence: its first row (its rows are contiguous, in position order) and its state
    /// slot ([`NO_SLOT`]: none).
    pub row_at: Vec<u32>,
    pub slots: Vec<u32>,
    /// Per sequence: its request's prompt length (DeepSeek-V3.2's indexer ranks a prompt row's
    /// keys in a row as long as the prompt; see `kernels/cuda/indexer.cu`).
    pub prompt_lens: Vec<u32>,
}

/// The sizes a step's launches are built from. Two steps of one shape enqueue the same launches
/// with the same arguments when their rows sit at the same device addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StepShape {
    pub rows: usize,
    pub seqs: usize,
    pub sampled: usize,
    /// The longest index row: attention cuts keys into `index_row / KEY_SPLIT` parts (rounded
    /// up), DeepSeek-V3.2's indexer scores rows this long.
    pub index_row: usize,
}

impl StepShape {
    /// Attention's key parts for this shape.
    pub fn key_parts(&self) -> usize {
        self.index_row.div_ceil(KEY_SPLIT).max(1)
    }
}

/// A sequence without a state slot.
pub const NO_SLOT: u32 = u32::MAX;

/// Device addresses of an uploaded [`StepRows`].
#[derive(Clone, Copy, Debug)]
pub struct RowsOnDevice {
    pub(super) tokens: u64,
    pub(super) positions: u64,
    pub(super) seqs: u64,
    pub(super) write_rows: u64,
    pub(super) tables: u64,
    pub(super) table_at: u64,
    pub(super) logit_rows: u64,
    pub(super) ring_slots: u64,
    pub(super) row_at: u64,
    pub(super) slots: u64,
    pub(super) prompt_lens: u64,
}

impl StepRows {
    /// Adds a sequence: its fed tokens (ring-encoded where in flight) from `start_pos`, its block
    /// table, and the ring slot of its sample if it samples. Its prompt is taken to end with
    /// these tokens unless [`StepRows::prompt_len`] says otherwise (a prompt fed in chunks).
    pub fn push_seq(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        table: &[u32],
        block_size: usize,
        sample: Option<u32>,
    ) -> &mut Self {
        let seq = self.table_at.len() as u32;
        self.table_at.push(self.tables.len() as u32);
        self.tables.extend_from_slice(table);
        self.row_at.push(self.tokens.len() as u32);
        self.slots.push(NO_SLOT);
        self.prompt_lens.push((start_pos + tokens.len()) as u32);
        for (i, &t) in tokens.iter().enumerate() {
            let pos = start_pos + i;
            self.tokens.push(t);
            self.positions.push(pos as u32);
            self.seqs.push(seq);
            // A family without paged KV has no table: nothing is written.
            let row = table.get(pos / block_size).map_or(0, |b| b * block_size as u32 + (pos % block_size) as u32);
            self.write_rows.push(row);
        }
        if let Some(slot) = sample {
            self.logit_rows.push(self.tokens.len() as u32 - 1);
            self.ring_slots.push(slot);
        }
        self
    }

    /// Gives the sequence pushed last the state slot `slot`.
    pub fn in_slot(&mut self, slot: u32) -> &mut Self {
        if let Some(last) = self.slots.last_mut() {
            *last = slot;
        }
        self
    }

    /// Gives the sequence pushed last a prompt of `len` tokens.
    pub fn prompt_len(&mut self, len: usize) -> &mut Self {
        if let Some(last) = self.prompt_lens.last_mut() {
            *last = len as u32;
        }
        self
    }

    /// What the host side of [`DeviceModel::enqueue_step`] reads of these rows: every launch's
    /// grid, scalar and scratch size follows from it (the rest is read on the device).
    pub fn shape(&self) -> StepShape {
        StepShape { rows: self.rows(), seqs: self.num_seqs(), sampled: self.sampled(), index_row: self.index_row_len() }
    }

    /// Words of the packed rows before the tables (fixed by the shape).
    pub fn words_before_tables(&self) -> usize {
        self.words() - self.tables.len()
    }

    /// The longest index row of the step (the indexer's scores per row): max(prompt length,
    /// position + 1) over the rows.
    fn index_row_len(&self) -> usize {
        let seq_len = |r: usize| self.prompt_lens[self.seqs[r] as usize] as usize;
        (0..self.rows()).map(|r| seq_len(r).max(self.positions[r] as usize + 1)).max().unwrap_or(0)
    }

    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    pub fn num_seqs(&self) -> usize {
        self.row_at.len()
    }

    pub fn sampled(&self) -> usize {
        self.logit_rows.len()
    }

    /// The parts in the order they are packed: every part's length is fixed by the step's
    /// shape except the tables', which go last, so a captured step (`graph.rs`) finds each part
    /// at the same address in every step of its shape.
    fn parts(&self) -> [&[u32]; 11] {
        [
            &self.tokens,
            &self.positions,
            &self.seqs,
            &self.write_rows,
            &self.table_at,
            &self.logit_rows,
            &self.ring_slots,
            &self.row_at,
            &self.slots,
            &self.prompt_lens,
            &self.tables,
        ]
    }

    /// Words the rows take packed.
    pub fn words(&self) -> usize {
        self.parts().iter().map(|p| p.len()).sum()
    }

    /// Packs the rows into `out` (at least [`StepRows::words`] long) and returns where each part
    /// will sit once `out` is copied to device address `base`.
    pub fn pack(&self, out: &mut [u32], base: u64) -> RowsOnDevice {
        let mut at = 0;
        let mut addr = [0u64; 11];
        for (i, part) in self.parts().iter().enumerate() {
            out[at..at + part.len()].copy_from_slice(part);
            addr[i] = base + 4 * at as u64;
            at += part.len();
        }
        RowsOnDevice {
            tokens: addr[0],
            positions: addr[1],
            seqs: addr[2],
            write_rows: addr[3],
            table_at: addr[4],
            logit_rows: addr[5],
            ring_slots: addr[6],
            row_at: addr[7],
            slots: addr[8],
            prompt_lens: addr[9],
            tables: addr[10],
        }
    }
}

/// Threads of a block that reduces `dim` values: a power of two from 32 to 256 fixed by `dim`
/// alone (never by the batch), so a row's reduction tree is the same in every step.
pub(super) fn reduce_threads(dim: usize) -> u32 {
    dim.next_power_of_two().clamp(32, 256) as u32
}

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

/// A bf16 product (`kernels/cuda/bf16.cu`, 64-square tiles of four warps): split by chunk of k
/// while its tiles would leave SMs without two blocks; both give an element the same chains.
fn bf16_plan(sms: usize, m: usize, n: usize, k: usize) -> LinearPlan {
    let grid = (blocks_for(n, 64), blocks_for(m, 64));
    let chunks = k.div_ceil(LINEAR_CHUNK);
    if (grid.0 * grid.1) < 2 * sms as u32 && chunks > 1 {
        return LinearPlan::Split { chunks, grid: (grid.0, grid.1, chunks as u32) };
    }
    LinearPlan::Whole("linear_bf16", (grid.0, grid.1, 1))
}

/// One product `y[z] = (accumulate ? y[z] : 0) + x[z] · W[z]ᵀ + bias` as [`linear_plan`] says.
pub(super) struct Product {
    pub y: u64,
    pub x: u64,
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
        match bf16_plan(gpu.sms, m, n, k) {
            LinearPlan::Whole(kernel, grid) => gpu.launch(
                kernel,
                grid,
                128,
                0,
                &[
                    Arg::Ptr(self.y),
                    Arg::Ptr(self.x),
                    Arg::Ptr(self.w),
                    Arg::Ptr(self.bias),
                    Arg::I32(m as i32),
                    Arg::I32(n as i32),
                    Arg::I32(k as i32),
                    Arg::I64(self.x_stride as i64),
                    Arg::I64(self.y_stride as i64),
                    Arg::I32(self.accumulate as i32),
                ],
            ),
            LinearPlan::Split { chunks, grid } => {
                let partial = gpu.scratch::<f32>(chunks * m * n)?;
                gpu.launch(
                    "linear_bf16_split",
                    grid,
                    128,
                    0,
                    &[
                        Arg::Ptr(partial.ptr()),
                        Arg::Ptr(self.x),
                        Arg::Ptr(self.w),
                        Arg::I32(m as i32),
                        Arg::I32(n as i32),
                        Arg::I32(k as i32),
                        Arg::I64(self.x_stride as i64),
                    ],
                )?;
                self.sum_chunks(gpu, &partial, chunks)
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

/// `kernels/cuda/model.cu`'s paged_attention: query heads of one kv head per block
/// (`HEADS_PER_WARP` a warp, up to `ATTENTION_WARPS` warps sharing the staged keys), keys staged
/// at a time, a row's keys in parts of `KEY_SPLIT` (merged by attention_merge), and the widest
/// heads it holds in registers.
const HEADS_PER_WARP: usize = 2;
const ATTENTION_WARPS: usize = 8;
const STAGED_KEYS: usize = 8;
const KEY_SPLIT: usize = 64;
/// The parts' scratch of one launch (floats; 256 MiB): longer batches go in slices of rows.
const ATTENTION_PARTS_FLOATS: usize = 64 << 20;
const MAX_QK_WIDTH: usize = 24 * 32;
const MAX_V_WIDTH: usize = 16 * 32;

pub(super) struct Step<'a> {
    pub(super) gpu: &'a Gpu,
    pub(super) kv: &'a DeviceKv,
    state: Option<&'a DeviceState>,
    pub(super) rows: usize,
    seqs: usize,
    pub(super) at: RowsOnDevice,
    /// The longest index row (DeepSeek-V3.2's indexer scores): max(prompt, position + 1).
    pub(super) index_row: usize,
}

impl Step<'_> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear(
        &self,
        y: u64,
        x: u64,
        l: &DevLinear,
        m: usize,
        x_stride: usize,
        y_stride: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        Product {
            y,
            x,
            w: l.w.ptr(),
            bf16: l.w.is_bf16(),
            bias: l.bias.as_ref().map_or(0, DeviceBuf::ptr),
            m,
            n: l.n,
            k: l.k,
            z: 1,
            x_stride,
            y_stride,
            x_batch: 0,
            w_batch: 0,
            y_batch: 0,
            accumulate,
        }
        .launch(self.gpu)
    }

    /// `heads` independent products `y[z] = x[z] · W[z]ᵀ` (`W[z]` is `[n × k]`).
    #[allow(clippy::too_many_arguments)]
    fn linear_per_head(
        &self,
        y: u64,
        x: u64,
        w: u64,
        n: usize,
        k: usize,
        heads: usize,
        x_stride: usize,
        y_stride: usize,
        x_head: usize,
        y_head: usize,
    ) -> Result<(), CudaError> {
        Product {
            y,
            x,
            w,
            bf16: false,
            bias: 0,
            m: self.rows,
            n,
            k,
            z: heads,
            x_stride,
            y_stride,
            x_batch: x_head,
            w_batch: n * k,
            y_batch: y_head,
            accumulate: false,
        }
        .launch(self.gpu)
    }

    /// RMSNorm of `count` vectors, `per_row` per row of `row_stride` floats from `offset`.
    #[allow(clippy::too_many_arguments)]
    fn norm(
        &self,
        out: u64,
        x: u64,
        n: &DevNorm,
        count: usize,
        per_row: usize,
        row_stride: usize,
        offset: usize,
    ) -> Result<(), CudaError> {
        let threads = reduce_threads(n.dim);
        self.gpu.launch(
            "rms_norm",
            (count as u32, 1, 1),
            threads,
            threads * 4,
            &[
                Arg::Ptr(out),
                Arg::Ptr(x),
                Arg::Ptr(n.w.ptr()),
                Arg::I32(n.dim as i32),
                Arg::I32(per_row as i32),
                Arg::I64(row_stride as i64),
                Arg::I32(offset as i32),
                Arg::F32(n.eps),
            ],
        )
    }

    pub(super) fn rope(
        &self,
        x: u64,
        r: &DevRope,
        heads: usize,
        row_stride: usize,
        offset: usize,
        head_stride: usize,
    ) -> Result<(), CudaError> {
        self.gpu.launch(
            "rope",
            (self.rows as u32, heads as u32, 1),
            r.half as u32,
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(self.at.positions),
                Arg::Ptr(r.inv_freq.ptr()),
                Arg::I32(r.half as i32),
                Arg::F32(r.scaling),
                Arg::I32(r.interleaved as i32),
                Arg::I64(row_stride as i64),
                Arg::I32(offset as i32),
                Arg::I32(head_stride as i32),
            ],
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
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

    fn swiglu(&self, act: u64, gu: u64, rows: usize, inter: usize) -> Result<(), CudaError> {
        self.gpu.launch(
            "swiglu",
            (blocks_for(rows * inter, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(act), Arg::Ptr(gu), Arg::I32(rows as i32), Arg::I32(inter as i32)],
        )
    }

    fn gqa(&self, h: u64, x: u64, a: &DevGqa, kv_layer: usize, hidden: usize) -> Result<(), CudaError> {
        let (t, d) = (self.rows, a.head_dim);
        let (qw, kw) = (a.q_heads * d, a.kv_heads * d);
        // with the output gate, q_proj's part is [query | gate] per head
        let qp = if a.output_gate { 2 * qw } else { qw };
        let width = qp + 2 * kw;
        let qkv = self.gpu.scratch::<f32>(t * width)?;
        self.linear(qkv.ptr(), x, &a.qkv, t, hidden, width, false)?;
        // queries: in place in `qkv` (stride `width`), or split from their gates (stride `qw`)
        let split = if a.output_gate {
            let (q, gate) = (self.gpu.scratch::<f32>(t * qw)?, self.gpu.scratch::<f32>(t * qw)?);
            self.gpu.launch(
                "split_query_gate",
                (t as u32, a.q_heads as u32, 1),
                32,
                0,
                &[
                    Arg::Ptr(q.ptr()),
                    Arg::Ptr(gate.ptr()),
                    Arg::Ptr(qkv.ptr()),
                    Arg::I32(width as i32),
                    Arg::I32(a.q_heads as i32),
                    Arg::I32(d as i32),
                ],
            )?;
            Some((q, gate))
        } else {
            None
        };
        let (q, q_stride) = match &split {
            Some((q, _)) => (q.ptr(), qw),
            None => (qkv.ptr(), width),
        };
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            self.norm(q, q, qn, t * a.q_heads, a.q_heads, q_stride, 0)?;
            self.norm(qkv.ptr(), qkv.ptr(), kn, t * a.kv_heads, a.kv_heads, width, qp)?;
        }
        self.rope(q, &a.rope, a.q_heads, q_stride, 0, d)?;
        self.rope(qkv.ptr(), &a.rope, a.kv_heads, width, qp, d)?;
        self.kv.write_rows(self.gpu, kv_layer, qkv.at(qp), width, self.at.write_rows, t)?;
        let attn = self.gpu.scratch::<f32>(t * qw)?;
        self.attention(attn.ptr(), q, q_stride, kv_layer, a.q_heads, a.kv_heads, d, d, 0, kw, a.window, a.scale, None)?;
        if let Some((_, gate)) = &split {
            let n = t * qw;
            self.gpu.launch(
                "apply_sigmoid_gate",
                (blocks_for(n, 256), 1, 1),
                256,
                0,
                &[Arg::Ptr(attn.ptr()), Arg::Ptr(gate.ptr()), Arg::I64(n as i64)],
            )?;
        }
        self.linear(h, attn.ptr(), &a.o, t, qw, hidden, true)
    }

    fn mla(&self, h: u64, x: u64, a: &DevMla, kv_layer: usize, hidden: usize) -> Result<(), CudaError> {
        let (t, heads, nope, rd, lora) = (self.rows, a.heads, a.nope, a.rope_dim, a.kv_lora);
        let qk = nope + rd;
        // 1. queries [t × heads·qk] (and the normalised LoRA latent: V3.2's indexer reads it)
        let q = self.gpu.scratch::<f32>(t * heads * qk)?;
        let q_latent = match &a.q {
            DevQuery::Lora { a: qa, norm, b } => {
                let lat = self.gpu.scratch::<f32>(t * qa.n)?;
                self.linear(lat.ptr(), x, qa, t, hidden, qa.n, false)?;
                self.norm(lat.ptr(), lat.ptr(), norm, t, 1, qa.n, 0)?;
                self.linear(q.ptr(), lat.ptr(), b, t, qa.n, heads * qk, false)?;
                Some((lat, qa.n))
            }
            DevQuery::Plain(l) => {
                self.linear(q.ptr(), x, l, t, hidden, heads * qk, false)?;
                None
            }
        };
        // 2. the cache row: normalised latent, rotated rope key (and V3.2's index key)
        let ckv_w = lora + rd;
        let row_w = ckv_w + a.indexer.as_ref().map_or(0, |ix| ix.head_dim);
        let ckv = self.gpu.scratch::<f32>(t * row_w)?;
        self.linear(ckv.ptr(), x, &a.kv_a, t, hidden, row_w, false)?;
        self.norm(ckv.ptr(), ckv.ptr(), &a.kv_norm, t, 1, row_w, 0)?;
        if let Some(rope) = &a.rope {
            self.rope(ckv.ptr(), rope, 1, row_w, lora, 0)?;
            self.rope(q.ptr(), rope, heads, heads * qk, nope, qk)?;
        }
        if let Some(ix) = &a.indexer {
            self.index_keys(ckv.at(ckv_w), x, ix, row_w, hidden)?;
        }
        self.kv.write_rows(self.gpu, kv_layer, ckv.ptr(), row_w, self.at.write_rows, t)?;
        // 2b. V3.2: the keys each query attends to
        let selection = match (&a.indexer, &q_latent) {
            (Some(ix), Some((lat, rank))) => {
                Some(self.index_select(ix, lat.ptr(), *rank, x, hidden, kv_layer, ckv_w)?)
            }
            (Some(_), None) => return Err(CudaError::Unsupported("the V3.2 indexer needs the q LoRA latent".into())),
            _ => None,
        };
        // 3. absorbed queries [W_ukᵀ q_nope | q_rope] per head
        let aq = lora + rd;
        let absorbed = self.gpu.scratch::<f32>(t * heads * aq)?;
        self.linear_per_head(
            absorbed.ptr(),
            q.ptr(),
            a.absorb_k.ptr(),
            lora,
            nope,
            heads,
            heads * qk,
            heads * aq,
            qk,
            aq,
        )?;
        self.gpu.launch(
            "copy_heads",
            (t as u32, heads as u32, 1),
            32,
            0,
            &[
                Arg::Ptr(absorbed.ptr()),
                Arg::Ptr(q.ptr()),
                Arg::I32(rd as i32),
                Arg::I64((heads * aq) as i64),
                Arg::I32(lora as i32),
                Arg::I32(aq as i32),
                Arg::I64((heads * qk) as i64),
                Arg::I32(nope as i32),
                Arg::I32(qk as i32),
            ],
        )?;
        // 4. attention in latent space [t × heads·lora]
        let o_lat = self.gpu.scratch::<f32>(t * heads * lora)?;
        self.attention(
            o_lat.ptr(),
            absorbed.ptr(),
            heads * aq,
            kv_layer,
            heads,
            1,
            aq,
            lora,
            0,
            0,
            None,
            a.scale,
            selection.as_ref(),
        )?;
        // 5. values out of latent space, then the output projection
        let attn = self.gpu.scratch::<f32>(t * heads * a.v_dim)?;
        self.linear_per_head(
            attn.ptr(),
            o_lat.ptr(),
            a.absorb_v.ptr(),
            a.v_dim,
            lora,
            heads,
            heads * lora,
            heads * a.v_dim,
            lora,
            a.v_dim,
        )?;
        self.linear(h, attn.ptr(), &a.o, t, heads * a.v_dim, hidden, true)
    }

    /// Gated DeltaNet (`kernels/cuda/linear.cu`): the fused input projection, the causal conv
    /// and the delta rule over each sequence's rows in order against its slot, the gated
    /// RMSNorm, then `h += out_proj(·)`.
    fn gdn(&self, h: u64, x: u64, g: &DevGdn, state_offset: usize, hidden: usize) -> Result<(), CudaError> {
        let state = self.state.ok_or_else(|| CudaError::Unsupported("a gdn layer runs with device state".into()))?;
        let (t, nk, nv, dk, dv) = (self.rows, g.k_heads, g.v_heads, g.dk, g.dv);
        let proj_width = g.in_proj.n;
        let proj = self.gpu.scratch::<f32>(t * proj_width)?;
        self.linear(proj.ptr(), x, &g.in_proj, t, hidden, proj_width, false)?;
        let channels = 2 * nk * dk + nv * dv;
        let conv = self.gpu.scratch::<f32>(t * channels)?;
        let common = [Arg::Ptr(state.base()), Arg::I64(state.width as i64), Arg::I32(state_offset as i32)];
        let mut args = vec![Arg::Ptr(conv.ptr()), Arg::Ptr(proj.ptr()), Arg::I32(proj_width as i32)];
        args.push(Arg::Ptr(g.conv_weight.ptr()));
        args.extend(common);
        args.extend([
            Arg::Ptr(self.at.slots),
            Arg::Ptr(self.at.row_at),
            Arg::I32(self.seqs as i32),
            Arg::I32(t as i32),
            Arg::I32(nk as i32),
            Arg::I32(dk as i32),
            Arg::I32((nv / nk) as i32),
            Arg::I32(dv as i32),
            Arg::I32(g.kernel as i32),
            Arg::I32(1),
        ]);
        self.gpu.launch("gdn_conv", (self.seqs as u32, blocks_for(channels, 128), 1), 128, 0, &args)?;
        let out = self.gpu.scratch::<f32>(t * nv * dv)?;
        let threads = reduce_threads(dv);
        let mut args =
            vec![Arg::Ptr(out.ptr()), Arg::Ptr(conv.ptr()), Arg::Ptr(proj.ptr()), Arg::I32(proj_width as i32)];
        args.extend(common);
        args.extend([
            Arg::I32(g.conv_width as i32),
            Arg::Ptr(self.at.slots),
            Arg::Ptr(self.at.row_at),
            Arg::I32(self.seqs as i32),
            Arg::I32(t as i32),
            Arg::Ptr(g.neg_a.ptr()),
            Arg::Ptr(g.dt_bias.ptr()),
            Arg::Ptr(g.norm.w.ptr()),
            Arg::F32(g.norm.eps),
            Arg::F32(crate::models::parts::gated_delta::L2_NORM_EPS),
            Arg::I32(nk as i32),
            Arg::I32(nv as i32),
            Arg::I32(dk as i32),
            Arg::I32(dv as i32),
        ]);
        // shared: the reductions' partial sums, then a decay, q and k per key channel
        let smem = (threads as usize + 3 * dk) * 4;
        self.gpu.launch("gdn_recurrent", (self.seqs as u32, nv as u32, 1), threads, smem as u32, &args)?;
        self.linear(h, out.ptr(), &g.out_proj, t, nv * dv, hidden, true)
    }

    /// Kimi Delta Attention (`kernels/cuda/linear.cu`): the fused projection, the low-rank forget
    /// and output gates, the causal conv of `[q | k | v]` and the per-channel-decay delta rule
    /// over each sequence's rows in order against its slot, the gated RMSNorm, then
    /// `h += o_proj(·)`.
    fn kda(&self, h: u64, x: u64, k: &DevKda, state_offset: usize, hidden: usize) -> Result<(), CudaError> {
        let state = self.state.ok_or_else(|| CudaError::Unsupported("a kda layer runs with device state".into()))?;
        let (t, heads, d) = (self.rows, k.heads, k.head_dim);
        let hd = heads * d;
        let width = k.in_proj.n;
        let proj = self.gpu.scratch::<f32>(t * width)?;
        self.linear(proj.ptr(), x, &k.in_proj, t, hidden, width, false)?;
        let forget = self.gpu.scratch::<f32>(t * hd)?;
        self.linear(forget.ptr(), proj.at(3 * hd), &k.f_b, t, width, hd, false)?;
        let gate = self.gpu.scratch::<f32>(t * hd)?;
        self.linear(gate.ptr(), proj.at(3 * hd + d), &k.g_b, t, width, hd, false)?;
        let conv = self.gpu.scratch::<f32>(t * 3 * hd)?;
        let args = [
            Arg::Ptr(conv.ptr()),
            Arg::Ptr(proj.ptr()),
            Arg::I32(width as i32),
            Arg::Ptr(k.conv_weight.ptr()),
            Arg::Ptr(state.base()),
            Arg::I64(state.width as i64),
            Arg::I32(state_offset as i32),
            Arg::Ptr(self.at.slots),
            Arg::Ptr(self.at.row_at),
            Arg::I32(self.seqs as i32),
            Arg::I32(t as i32),
            Arg::I32(heads as i32),
            Arg::I32(d as i32),
            Arg::I32(1),
            Arg::I32(d as i32),
            Arg::I32(k.kernel as i32),
            Arg::I32(0),
        ];
        self.gpu.launch("gdn_conv", (self.seqs as u32, blocks_for(3 * hd, 128), 1), 128, 0, &args)?;
        let out = self.gpu.scratch::<f32>(t * hd)?;
        let threads = reduce_threads(d);
        let args = [
            Arg::Ptr(out.ptr()),
            Arg::Ptr(conv.ptr()),
            Arg::Ptr(proj.ptr()),
            Arg::I32(width as i32),
            Arg::Ptr(forget.ptr()),
            Arg::Ptr(gate.ptr()),
            Arg::Ptr(state.base()),
            Arg::I64(state.width as i64),
            Arg::I32(state_offset as i32),
            Arg::I32(k.conv_width as i32),
            Arg::Ptr(self.at.slots),
            Arg::Ptr(self.at.row_at),
            Arg::I32(self.seqs as i32),
            Arg::I32(t as i32),
            Arg::Ptr(k.neg_a.ptr()),
            Arg::Ptr(k.dt_bias.ptr()),
            Arg::Ptr(k.o_norm.w.ptr()),
            Arg::F32(k.o_norm.eps),
            Arg::F32(crate::models::parts::gated_delta::L2_NORM_EPS),
            Arg::I32(heads as i32),
            Arg::I32(d as i32),
        ];
        // shared: the reductions' partial sums, then a decay, q and k per key channel
        let smem = (threads as usize + 3 * d) * 4;
        self.gpu.launch("kda_recurrent", (self.seqs as u32, heads as u32, 1), threads, smem as u32, &args)?;
        self.linear(h, out.ptr(), &k.o_proj, t, hd, hidden, true)
    }

    /// `out (+)= down(silu(gate(x)) · up(x))` over `rows` rows.
    fn mlp(&self, out: u64, x: u64, m: &DevMlp, rows: usize, hidden: usize, accumulate: bool) -> Result<(), CudaError> {
        let gu = self.gpu.scratch::<f32>(rows * 2 * m.inter)?;
        self.linear(gu.ptr(), x, &m.gate_up, rows, hidden, 2 * m.inter, false)?;
        let act = self.gpu.scratch::<f32>(rows * m.inter)?;
        self.swiglu(act.ptr(), gu.ptr(), rows, m.inter)?;
        self.linear(out, act.ptr(), &m.down, rows, m.inter, hidden, accumulate)
    }

    #[allow(clippy::too_many_arguments)]
    /// Routed expert products over the pairs grouped by expert (`order`, `offsets`).
    #[allow(clippy::too_many_arguments)]
    fn expert_linear(
        &self,
        y: u64,
        x: u64,
        w: &DevWeight,
        grouped: &GroupedPairs,
        n: usize,
        k: usize,
        x_per: usize,
    ) -> Result<(), CudaError> {
        self.gpu.launch(
            if w.is_bf16() { "expert_linear_bf16" } else { "expert_linear" },
            // a block per work item and 8 warps of 4 outputs (`kernels/cuda/model.cu`)
            (grouped.items_at_most as u32, blocks_for(n, 32), 1),
            256,
            0,
            &[
                Arg::Ptr(y),
                Arg::Ptr(x),
                Arg::Ptr(w.ptr()),
                Arg::Ptr(grouped.order.ptr()),
                Arg::Ptr(grouped.offsets.ptr()),
                Arg::Ptr(grouped.work.ptr()),
                Arg::I32(grouped.per_item as i32),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
                Arg::I32(x_per as i32),
            ],
        )
    }

    fn moe(&self, h: u64, x: u64, m: &DevMoe, hidden: usize) -> Result<(), CudaError> {
        let (t, k, inter) = (self.rows, m.top_k, m.inter);
        let logits = self.gpu.scratch::<f32>(t * m.num_experts)?;
        self.linear(logits.ptr(), x, &m.router, t, hidden, m.num_experts, false)?;
        let experts = self.gpu.scratch::<i32>(t * k)?;
        let weights = self.gpu.scratch::<f32>(t * k)?;
        self.gpu.launch(
            "route",
            // a token per block; shared: scores and choice per expert, two floats per group
            (t as u32, 1, 1),
            32,
            ((2 * m.num_experts + 2 * m.n_group.max(1)) * 4) as u32,
            &[
                Arg::Ptr(experts.ptr()),
                Arg::Ptr(weights.ptr()),
                Arg::Ptr(logits.ptr()),
                Arg::Ptr(m.correction_bias.as_ref().map_or(0, DeviceBuf::ptr)),
                Arg::I32(t as i32),
                Arg::I32(m.num_experts as i32),
                Arg::I32(k as i32),
                Arg::I32(m.softmax as i32),
                Arg::I32(m.n_group as i32),
                Arg::I32(m.topk_group as i32),
                Arg::I32(m.norm_topk_prob as i32),
                Arg::F32(m.scaling),
            ],
        )?;
        let pairs = t * k;
        let ne = m.num_experts;
        let grouped = GroupedPairs::new(self.gpu, pairs, ne)?;
        self.gpu.launch(
            "group_pairs",
            (1, 1, 1),
            256,
            (ne * 4) as u32,
            &[
                Arg::Ptr(grouped.order.ptr()),
                Arg::Ptr(grouped.offsets.ptr()),
                Arg::Ptr(grouped.work.ptr()),
                Arg::Ptr(experts.ptr()),
                Arg::I32(pairs as i32),
                Arg::I32(ne as i32),
                Arg::I32(grouped.per_item as i32),
            ],
        )?;
        let gu = self.gpu.scratch::<f32>(pairs * 2 * inter)?;
        self.expert_linear(gu.ptr(), x, &m.gate_up, &grouped, 2 * inter, hidden, k)?;
        let act = self.gpu.scratch::<f32>(pairs * inter)?;
        self.swiglu(act.ptr(), gu.ptr(), pairs, inter)?;
        let out = self.gpu.scratch::<f32>(pairs * hidden)?;
        self.expert_linear(out.ptr(), act.ptr(), &m.down, &grouped, hidden, inter, 1)?;
        let shared = match &m.shared {
            Some(s) => {
                let y = self.gpu.scratch::<f32>(t * hidden)?;
                self.mlp(y.ptr(), x, s, t, hidden, false)?;
                Some(y)
            }
            None => None,
        };
        let shared_gate = match &m.shared_gate {
            Some(g) => {
                let logits = self.gpu.scratch::<f32>(t)?;
                self.linear(logits.ptr(), x, g, t, hidden, 1, false)?;
                Some(logits)
            }
            None => None,
        };
        self.gpu.launch(
            "moe_combine",
            (blocks_for(t * hidden, 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(h),
                Arg::Ptr(out.ptr()),
                Arg::Ptr(weights.ptr()),
                Arg::Ptr(shared.as_ref().map_or(0, DeviceBuf::ptr)),
                Arg::Ptr(shared_gate.as_ref().map_or(0, DeviceBuf::ptr)),
                Arg::I32(t as i32),
                Arg::I32(k as i32),
                Arg::I32(hidden as i32),
            ],
        )
    }
}

/// A step's routed pairs grouped by expert (`group_pairs`) and cut into work items of up to
/// `per_item` pairs of one expert, a block each in the expert products.
struct GroupedPairs {
    order: DeviceBuf<i32>,
    offsets: DeviceBuf<i32>,
    /// [items, then (expert, first pair) per item]
    work: DeviceBuf<i32>,
    per_item: usize,
    /// Items there can be: one per expert, plus one per `per_item` pairs.
    items_at_most: usize,
}

/// Pairs of one work item at least (`kernels/cuda/model.cu`'s PAIRS_PER_PASS: one pass).
const PAIRS_PER_PASS: usize = 8;

impl GroupedPairs {
    fn new(gpu: &Gpu, pairs: usize, experts: usize) -> Result<GroupedPairs, CudaError> {
        // about four items an expert when the routing is even: decode's few pairs a pass each,
        // prefill's thousands in a few hundred pairs an item
        let per_item = pairs.div_ceil(4 * experts).next_multiple_of(PAIRS_PER_PASS).max(PAIRS_PER_PASS);
        let items_at_most = pairs.div_ceil(per_item) + experts;
        Ok(GroupedPairs {
            order: gpu.scratch::<i32>(pairs)?,
            offsets: gpu.scratch::<i32>(experts + 1)?,
            work: gpu.scratch::<i32>(1 + 2 * items_at_most)?,
            per_item,
            items_at_most,
        })
    }
}

impl DeviceModel {
    /// Enqueues one step over `rows` (already at `at` on the device) against `kv`: writes each
    /// row's KV into its cache row, and for each sampling row its greedy token into `ring` at its
    /// slot and `RESULT_WORDS` words into `results`. Returns the sampled rows' logits when
    /// `keep_logits` (checks and tests only). Waits for nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue_step(
        &self,
        gpu: &Gpu,
        kv: &DeviceKv,
        state: Option<&DeviceState>,
        rows: &StepRows,
        at: RowsOnDevice,
        ring: u64,
        results: u64,
        keep_logits: bool,
    ) -> Result<Option<DeviceBuf<f32>>, CudaError> {
        self.enqueue_shaped(gpu, kv, state, rows.shape(), at, ring, results, keep_logits)
    }

    /// [`DeviceModel::enqueue_step`] from the rows' shape alone (what a captured step is built
    /// from): the rows themselves are read on the device at `at`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn enqueue_shaped(
        &self,
        gpu: &Gpu,
        kv: &DeviceKv,
        state: Option<&DeviceState>,
        shape: StepShape,
        at: RowsOnDevice,
        ring: u64,
        results: u64,
        keep_logits: bool,
    ) -> Result<Option<DeviceBuf<f32>>, CudaError> {
        let (t, hidden) = (shape.rows, self.hidden);
        if t == 0 {
            return Ok(None);
        }
        let s = Step { gpu, kv, state, rows: t, seqs: shape.seqs, at, index_row: shape.index_row };
        let h = gpu.scratch::<f32>(t * hidden)?;
        gpu.launch(
            "embed_rows",
            (t as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(h.ptr()),
                Arg::Ptr(self.embed.ptr()),
                Arg::Ptr(at.tokens),
                Arg::Ptr(ring),
                Arg::I32(hidden as i32),
                Arg::I32(self.vocab as i32),
            ],
        )?;
        let x = gpu.scratch::<f32>(t * hidden)?;
        for layer in &self.layers {
            s.norm(x.ptr(), h.ptr(), &layer.input_norm, t, 1, hidden, 0)?;
            match &layer.mixer {
                DevMixer::Gqa(a) => s.gqa(h.ptr(), x.ptr(), a, layer.kv_layer, hidden)?,
                DevMixer::Mla(a) => s.mla(h.ptr(), x.ptr(), a, layer.kv_layer, hidden)?,
                DevMixer::Gdn(g) => s.gdn(h.ptr(), x.ptr(), g, layer.state_offset, hidden)?,
                DevMixer::Kda(k) => s.kda(h.ptr(), x.ptr(), k, layer.state_offset, hidden)?,
            }
            s.norm(x.ptr(), h.ptr(), &layer.post_norm, t, 1, hidden, 0)?;
            match &layer.ffn {
                DevFfn::Dense(m) => s.mlp(h.ptr(), x.ptr(), m, t, hidden, true)?,
                DevFfn::Moe(m) => s.moe(h.ptr(), x.ptr(), m, hidden)?,
            }
        }
        let n = shape.sampled;
        if n == 0 {
            return Ok(None);
        }
        let last = gpu.scratch::<f32>(n * hidden)?;
        gpu.launch(
            "gather_rows",
            (n as u32, 1, 1),
            256,
            0,
            &[Arg::Ptr(last.ptr()), Arg::Ptr(h.ptr()), Arg::Ptr(at.logit_rows), Arg::I32(hidden as i32)],
        )?;
        s.norm(last.ptr(), last.ptr(), &self.final_norm, n, 1, hidden, 0)?;
        let logits = gpu.scratch::<f32>(n * self.vocab)?;
        s.linear(logits.ptr(), last.ptr(), &self.lm_head, n, hidden, self.vocab, false)?;
        gpu.launch(
            "sample_greedy",
            (n as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(results),
                Arg::Ptr(ring),
                Arg::Ptr(at.ring_slots),
                Arg::Ptr(logits.ptr()),
                Arg::I32(self.vocab as i32),
            ],
        )?;
        Ok(keep_logits.then_some(logits))
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
}
