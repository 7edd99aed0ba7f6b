//! DeepSeek-V3.2's DSA indexer (DeepSeek Sparse Attention, as transformers' deepseek_v32 computes
//! it): for each query, the cache rows its [latent attention](super::mla) attends to.
//!
//! Per query token at position `s`: index queries `wq_b(q_latent)` (`index_n_heads ×
//! index_head_dim`) and one index key per token `LayerNorm(wk(x))` (kept in the paged cache after
//! the main row), both with rotate-half RoPE on their first `qk_rope_head_dim` dims (the main
//! attention's rope is interleaved); head weights `weights_proj(x) · heads^-½`; score of key `t`:
//! `Σ_h w_h · relu(q_h·k_t · head_dim^-½)`. The query attends to the `index_topk` best keys.
//!
//! Which keys win a tie (ReLU makes many scores exactly 0) follows torch's CPU top-k over a row
//! padded with −inf to the row length transformers uses: the prompt length for prompt tokens
//! (its prefill sees the whole prompt), the position + 1 for generated tokens (its cached decode).
//! Both depend only on the request, never on batching or chunking.

use super::layers::Linear;
use crate::checkpoint::{LoadError, WeightSource};
use crate::cpu::rope::Rope;
use crate::cpu::simd::{dot, Best};
use crate::cpu::torch_topk::torch_topk_indices;
use crate::kv::KvLayer;
use crate::models::batch::BatchLayout;

/// `nn.LayerNorm(eps=1e-6)` of the index keys.
pub(crate) const INDEX_KEY_NORM_EPS: f32 = 1e-6;

/// The DSA indexer of one layer.
pub struct Indexer {
    pub(crate) wq_b: Linear,
    pub(crate) wk: Linear,
    pub(crate) k_norm_weight: Vec<f32>,
    pub(crate) k_norm_bias: Vec<f32>,
    pub(crate) weights_proj: Linear,
    pub(crate) heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) topk: usize,
    pub(crate) rope: Rope,
}

/// The indexer's sizes, from the config.
#[derive(Clone, Copy, Debug)]
pub(crate) struct IndexerDims {
    pub hidden: usize,
    pub q_lora_rank: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub topk: usize,
}

/// Loads `{prefix}.indexer` (prefix = `model.layers.{l}.self_attn`).
impl IndexerDims {
    /// Parameters of one indexer of these sizes.
    pub(crate) fn params(&self) -> u128 {
        let [h, r, heads, d] = [self.hidden, self.q_lora_rank, self.heads, self.head_dim].map(|x| x as u128);
        r * heads * d + h * d + 2 * d + h * heads
    }
}

pub(crate) fn load_indexer(
    w: &dyn WeightSource,
    prefix: &str,
    d: IndexerDims,
    rope: Rope,
) -> Result<Indexer, LoadError> {
    let p = format!("{prefix}.indexer");
    Ok(Indexer {
        wq_b: Linear::load(w, &format!("{p}.wq_b"), d.q_lora_rank, d.heads * d.head_dim, false)?,
        wk: Linear::load(w, &format!("{p}.wk"), d.hidden, d.head_dim, false)?,
        k_norm_weight: w.tensor(&format!("{p}.k_norm.weight"), &[d.head_dim])?,
        k_norm_bias: w.tensor(&format!("{p}.k_norm.bias"), &[d.head_dim])?,
        weights_proj: Linear::load(w, &format!("{p}.weights_proj"), d.hidden, d.heads, false)?,
        heads: d.heads,
        head_dim: d.head_dim,
        topk: d.topk,
        rope,
    })
}

fn layer_norm(x: &mut [f32], weight: &[f32], bias: &[f32], eps: f32) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, w), b) in x.iter_mut().zip(weight).zip(bias) {
        *v = (*v - mean) * inv * w + b;
    }
}

impl Indexer {
    /// Floats of one index key in the cache row.
    pub fn key_width(&self) -> usize {
        self.head_dim
    }

    pub fn topk(&self) -> usize {
        self.topk
    }

    /// Index keys of every row: `rope(LayerNorm(wk(x)))`.             [t × head_dim]
    pub fn index_keys(&self, x: &[f32], layout: &BatchLayout) -> Vec<f32> {
        let mut keys = self.wk.forward(x, layout.rows);
        for (r, key) in keys.chunks_exact_mut(self.head_dim).enumerate() {
            layer_norm(key, &self.k_norm_weight, &self.k_norm_bias, INDEX_KEY_NORM_EPS);
            let (cos, sin) = self.rope.cos_sin(layout.positions[r]);
            self.rope.rotate_heads(key, self.head_dim, &cos, &sin);
        }
        keys
    }

    /// For every row, the cache rows it attends to, in position order. Index keys sit at
    /// `key_offset` in each cache row (already written for this step's rows).
    pub fn select(
        &self,
        q_latent: &[f32],
        x: &[f32],
        layout: &BatchLayout,
        kv: &KvLayer,
        key_offset: usize,
    ) -> Vec<Vec<usize>> {
        let t = layout.rows;
        let (h, d) = (self.heads, self.head_dim);
        let mut q = self.wq_b.forward(q_latent, t);
        let weights = self.weights_proj.forward(x, t);
        let head_scale = (h as f32).powf(-0.5);
        let score_scale = (d as f32).powf(-0.5);
        let mut row_scores = Vec::new();
        (0..t)
            .map(|r| {
                let visible = layout.visible_rows(r, None);
                let s = layout.positions[r];
                if visible.len() <= self.topk {
                    return visible.to_vec();
                }
                let qr = &mut q[r * h * d..(r + 1) * h * d];
                let (cos, sin) = self.rope.cos_sin(s);
                self.rope.rotate_heads(qr, d, &cos, &sin);
                let w: Vec<f32> = weights[r * h..(r + 1) * h].iter().map(|v| v * head_scale).collect();
                // Row length as transformers sees it: the prompt for prompt rows, else s + 1.
                let row_len = layout.prompt_lens[layout.seq_of_row[r]].max(s + 1);
                row_scores.clear();
                row_scores.extend(visible.iter().map(|&cr| {
                    let key = &kv.row(cr)[key_offset..key_offset + d];
                    let mut total = 0.0f32;
                    for (head, wh) in w.iter().enumerate() {
                        let score = (dot::<Best>(&qr[head * d..(head + 1) * d], key) * score_scale).max(0.0);
                        total += wh * score;
                    }
                    total
                }));
                row_scores.resize(row_len, f32::NEG_INFINITY);
                let mut picked: Vec<usize> =
                    torch_topk_indices(&row_scores, self.topk).into_iter().filter(|&p| p <= s).collect();
                picked.sort_unstable();
                picked.into_iter().map(|p| visible[p]).collect()
            })
            .collect()
    }

    pub fn macs_per_row(&self) -> usize {
        self.wq_b.macs_per_row() + self.wk.macs_per_row() + self.weights_proj.macs_per_row()
    }

    /// Multiply-adds of scoring `ctx` keys for one query.
    pub fn scoring_macs(&self, ctx: usize) -> usize {
        if ctx <= self.topk {
            0
        } else {
            ctx * self.heads * self.head_dim
        }
    }
}
