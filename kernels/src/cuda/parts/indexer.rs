//! The host side of DeepSeek-V3.2's DSA indexer on the device (`kernels/cuda/indexer.cu`; the
//! CPU executor's is `models::parts::indexer`): index keys into the cache rows, then per row its
//! scores and the keys it attends to, chosen as torch's CPU top-k chooses them. Part of a step
//! ([`crate::cuda::forward`]): enqueued on the rank's stream, never waited for.

use super::attention::Selection;
use super::layers::{self, DevLinear, DevRope};
use super::Step;
use crate::cuda::error::CudaError;
use crate::cuda::gpu::{DeviceBuf, Gpu};
use crate::cuda::launch::{blocks_for, reduce_threads, Arg};
use crate::cuda::weights::Up;
use crate::models::parts::indexer::Indexer;

/// DeepSeek-V3.2's DSA indexer of one layer. Its index key sits after the latent and rope key
/// in each cache row.
pub(crate) struct DevIndexer {
    pub wq_b: DevLinear,
    pub wk: DevLinear,
    pub k_norm_weight: DeviceBuf<f32>,
    pub k_norm_bias: DeviceBuf<f32>,
    pub weights_proj: DevLinear,
    /// Rotate-half, on the first `qk_rope_head_dim` dims of index queries and keys.
    pub rope: DevRope,
    pub heads: usize,
    pub head_dim: usize,
    pub topk: usize,
}

pub(crate) fn upload(gpu: &Up, ix: &Indexer) -> Result<DevIndexer, CudaError> {
    Ok(DevIndexer {
        wq_b: layers::linear(gpu, &ix.wq_b)?,
        wk: layers::linear(gpu, &ix.wk)?,
        k_norm_weight: gpu.upload(&ix.k_norm_weight)?,
        k_norm_bias: gpu.upload(&ix.k_norm_bias)?,
        weights_proj: layers::linear(gpu, &ix.weights_proj)?,
        rope: layers::rope(gpu, &ix.rope)?,
        heads: ix.heads,
        head_dim: ix.head_dim,
        topk: ix.topk,
    })
}

impl Step<'_> {
    /// V3.2's index keys `rope(LayerNorm(wk(x)))` into `keys` (row stride `row_w`, in the rows
    /// about to be written to the cache).
    pub(super) fn index_keys(
        &self,
        keys: u64,
        x: u64,
        ix: &DevIndexer,
        row_w: usize,
        hidden: usize,
    ) -> Result<(), CudaError> {
        let d = ix.head_dim;
        self.linear(keys, x, &ix.wk, self.rows, hidden, row_w, false)?;
        let threads = reduce_threads(d);
        self.gpu.launch(
            "layer_norm",
            (self.rows as u32, 1, 1),
            threads,
            threads * 4,
            &[
                Arg::Ptr(keys),
                Arg::Ptr(ix.k_norm_weight.ptr()),
                Arg::Ptr(ix.k_norm_bias.ptr()),
                Arg::I32(d as i32),
                Arg::I64(row_w as i64),
                Arg::I32(0),
                Arg::F32(crate::models::parts::indexer::INDEX_KEY_NORM_EPS),
            ],
        )?;
        self.rope(keys, &ix.rope, 1, row_w, 0, 0)
    }

    /// V3.2's selection (`kernels/cuda/indexer.cu`): index queries `rope(wq_b(q_latent))` and
    /// head weights `weights_proj(x)`, every row's scores against the index keys at `key_offset`
    /// of the cache rows it sees, then its top-k as torch's CPU top-k picks it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn index_select(
        &self,
        ix: &DevIndexer,
        q_latent: u64,
        rank: usize,
        x: u64,
        hidden: usize,
        kv_layer: usize,
        key_offset: usize,
    ) -> Result<Selection, CudaError> {
        let (t, h, d, stride) = (self.rows, ix.heads, ix.head_dim, self.index_row);
        let q = self.gpu.scratch::<f32>(t * h * d)?;
        self.linear(q.ptr(), q_latent, &ix.wq_b, t, rank, h * d, false)?;
        self.rope(q.ptr(), &ix.rope, h, h * d, 0, d)?;
        let weights = self.gpu.scratch::<f32>(t * h)?;
        self.linear(weights.ptr(), x, &ix.weights_proj, t, hidden, h, false)?;
        let scores = self.gpu.scratch::<f32>(t * stride)?;
        self.gpu.launch(
            "index_scores",
            (blocks_for(t * stride, 8), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(scores.ptr()),
                Arg::Ptr(q.ptr()),
                Arg::Ptr(weights.ptr()),
                Arg::Ptr(self.kv.layer(kv_layer)),
                self.kv.bf16_arg(),
                Arg::Ptr(self.at.tables),
                Arg::Ptr(self.at.table_at),
                Arg::Ptr(self.at.positions),
                Arg::Ptr(self.at.seqs),
                Arg::Ptr(self.at.prompt_lens),
                Arg::I32(t as i32),
                Arg::I64(stride as i64),
                Arg::I32(h as i32),
                Arg::I32(d as i32),
                Arg::I32(key_offset as i32),
                Arg::I32(self.kv.width(kv_layer) as i32),
                Arg::I32(self.kv.block_size as i32),
                Arg::I32(ix.topk as i32),
            ],
        )?;
        // (value, position) pairs: 8 bytes each
        let pairs = self.gpu.scratch::<u64>(t * stride)?;
        let selection = Selection {
            selected: self.gpu.scratch::<i32>(t * ix.topk)?,
            counts: self.gpu.scratch::<i32>(t)?,
            stride: ix.topk,
        };
        let rows = [self.at.positions, self.at.seqs, self.at.prompt_lens];
        launch_topk(self.gpu, &selection, scores.ptr(), pairs.ptr(), rows, t, stride)?;
        Ok(selection)
    }
}

/// `index_topk` over `t` rows whose scores are `stride` apart: `rows` holds the device addresses
/// of their positions, sequences and per-sequence prompt lengths.
fn launch_topk(
    gpu: &Gpu,
    sel: &Selection,
    scores: u64,
    pairs: u64,
    rows: [u64; 3],
    t: usize,
    stride: usize,
) -> Result<(), CudaError> {
    let [positions, seqs, prompt_lens] = rows;
    gpu.launch(
        "index_topk",
        (blocks_for(t, 32), 1, 1),
        32,
        0,
        &[
            Arg::Ptr(sel.selected.ptr()),
            Arg::Ptr(sel.counts.ptr()),
            Arg::Ptr(scores),
            Arg::Ptr(pairs),
            Arg::Ptr(positions),
            Arg::Ptr(seqs),
            Arg::Ptr(prompt_lens),
            Arg::I32(t as i32),
            Arg::I64(stride as i64),
            Arg::I32(sel.stride as i32),
        ],
    )
}

/// The positions `torch.topk(values, k)` picks on CPU, ascending, as the device picks them
/// (one row of `values.len()` scores, all visible): the check that `index_topk` follows torch,
/// tie for tie, on this device.
pub fn torch_topk_on_device(gpu: &Gpu, values: &[f32], k: usize) -> Result<Vec<usize>, CudaError> {
    let n = values.len();
    if k == 0 {
        return Ok(Vec::new());
    }
    let scores = gpu.upload(values)?;
    let positions = gpu.upload(&[n as i32 - 1])?;
    let seqs = gpu.upload(&[0i32])?;
    let prompt_lens = gpu.upload(&[n as u32])?;
    let pairs = gpu.scratch::<u64>(n)?;
    let sel = Selection { selected: gpu.zeros::<i32>(k)?, counts: gpu.zeros::<i32>(1)?, stride: k };
    let rows = [positions.ptr(), seqs.ptr(), prompt_lens.ptr()];
    launch_topk(gpu, &sel, scores.ptr(), pairs.ptr(), rows, 1, n)?;
    let count = gpu.download(&sel.counts, 1)?[0];
    if count < 0 {
        return Ok((0..n).collect()); // at most k keys: all of them
    }
    let picked = gpu.download(&sel.selected, k)?;
    Ok(picked[..count as usize].iter().map(|&p| p as usize).collect())
}
