//! Grouped-query attention over the paged KV cache, as transformers' `LlamaAttention`,
//! `Qwen3Attention` and `Qwen3NextAttention` compute it: fused `q/k/v` projections, optional
//! per-head q/k RMSNorm (Qwen3 plain, Qwen3-Next zero-centred), RoPE at each row's position,
//! softmax attention of each query head over the cache rows its KV head `q_head / (q_heads /
//! kv_heads)` can see (all earlier positions, or a sliding window), then `o_proj`. Qwen3-Next's
//! gated variant reads `[query | gate]` per head from `q_proj` and multiplies the attention output
//! by `sigmoid(gate)` before `o_proj`.
//!
//! Shapes for `t` rows: `x [t × hidden]` → `q [t × q_heads·head_dim]`, `k, v [t × kv_heads·head_dim]`
//! → attention `[t × q_heads·head_dim]` → `[t × hidden]`. Cache row per token and layer:
//! `[k: kv_heads × head_dim | v: kv_heads × head_dim]`, keys after RoPE (and after the k-norm).

use super::layers::{Linear, RmsNorm};
use crate::checkpoint::{LoadError, WeightSource};
use crate::cpu::activation::sigmoid;
use crate::cpu::attention::{attend_row, AttentionShape};
use crate::cpu::rope::Rope;
use crate::kv::KvLayer;
use crate::models::batch::BatchLayout;

/// Grouped-query attention of one layer.
pub struct GqaAttention {
    pub(crate) qkv: Linear,
    pub(crate) o: Linear,
    pub(crate) q_norm: Option<RmsNorm>,
    pub(crate) k_norm: Option<RmsNorm>,
    pub(crate) rope: Rope,
    pub(crate) shape: AttentionShape,
    pub(crate) sliding_window: Option<usize>,
    /// Qwen3-Next: `q_proj` yields `[query | gate]` per head and the attention output is
    /// multiplied by `sigmoid(gate)` before `o_proj`.
    pub(crate) output_gate: bool,
}

/// Per-head q/k RMSNorm of an attention layer, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QkNorm {
    None,
    /// `w · x̂` (qwen3).
    Plain,
    /// `(1 + w) · x̂` (qwen3_next).
    ZeroCentred,
}

/// Parameters of one attention layer of these sizes (projections and q/k norms; biases aside).
pub(crate) fn gqa_params(hidden: usize, q_heads: usize, kv_heads: usize, head_dim: usize, output_gate: bool) -> u128 {
    let (h, q, kv, d) = (hidden as u128, q_heads as u128, kv_heads as u128, head_dim as u128);
    let q_width = q * d * if output_gate { 2 } else { 1 };
    h * (q_width + 2 * kv * d) + q * d * h + 2 * d
}

/// What a grouped-query attention layer is loaded with: its sizes and variant.
#[derive(Clone, Debug)]
pub(crate) struct GqaConfig {
    pub hidden: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Biases on the q/k/v and o projections.
    pub bias: bool,
    pub qk_norm: QkNorm,
    /// Qwen3-Next: `q_proj` yields `[query | gate]` per head.
    pub output_gate: bool,
    /// The q/k norms' epsilon.
    pub eps: f32,
    pub rope: Rope,
    /// Keys further back than this many positions are not attended to (`None`: all are).
    pub sliding_window: Option<usize>,
}

/// Loads the attention of layer prefix `p` (`model.layers.{l}.self_attn`).
pub(crate) fn load_gqa(w: &dyn WeightSource, p: &str, config: GqaConfig) -> Result<GqaAttention, LoadError> {
    let GqaConfig { hidden, q_heads, kv_heads, head_dim, bias, qk_norm, output_gate, eps, rope, sliding_window } =
        config;
    let q_width = q_heads * head_dim * if output_gate { 2 } else { 1 };
    let norm = |name: &str| -> Result<Option<RmsNorm>, LoadError> {
        Ok(match qk_norm {
            QkNorm::None => None,
            QkNorm::Plain => Some(RmsNorm::load(w, &format!("{p}.{name}.weight"), head_dim, eps)?),
            QkNorm::ZeroCentred => Some(RmsNorm::load_zero_centred(w, &format!("{p}.{name}.weight"), head_dim, eps)?),
        })
    };
    Ok(GqaAttention {
        qkv: Linear::fused(
            w,
            &[&format!("{p}.q_proj"), &format!("{p}.k_proj"), &format!("{p}.v_proj")],
            hidden,
            &[q_width, kv_heads * head_dim, kv_heads * head_dim],
            bias,
        )?,
        o: Linear::load(w, &format!("{p}.o_proj"), q_heads * head_dim, hidden, bias)?,
        q_norm: norm("q_norm")?,
        k_norm: norm("k_norm")?,
        rope,
        shape: AttentionShape {
            q_heads,
            kv_heads,
            qk_dim: head_dim,
            v_dim: head_dim,
            k_offset: 0,
            v_offset: kv_heads * head_dim,
            scale: (head_dim as f32).powf(-0.5),
        },
        sliding_window,
        output_gate,
    })
}

impl GqaAttention {
    /// Cache row width: keys then values of every KV head.
    pub fn kv_row_width(&self) -> usize {
        self.shape.kv_heads * (self.shape.qk_dim + self.shape.v_dim)
    }

    pub fn forward(&self, x: &[f32], layout: &BatchLayout, kv: &mut KvLayer) -> Vec<f32> {
        let t = layout.rows;
        let AttentionShape { q_heads, kv_heads, qk_dim: d, .. } = self.shape;
        let (qw, kw) = (q_heads * d, kv_heads * d);
        let qp = if self.output_gate { 2 * qw } else { qw };
        // 1. q (and gate), k, v = x·[Wq; Wk; Wv]ᵀ          [t × (qp + 2·kw)]
        let mut qkv = self.qkv.forward(x, t);
        let mut q = vec![0.0f32; t * qw];
        let mut gate = if self.output_gate { vec![0.0f32; t * qw] } else { Vec::new() };
        for r in 0..t {
            let row = &mut qkv[r * (qp + 2 * kw)..(r + 1) * (qp + 2 * kw)];
            let (q_part, rest) = row.split_at_mut(qp);
            if self.output_gate {
                // per head: [query (d) | gate (d)]
                for n in 0..q_heads {
                    gate[r * qw + n * d..r * qw + (n + 1) * d].copy_from_slice(&q_part[n * 2 * d + d..(n + 1) * 2 * d]);
                    q_part.copy_within(n * 2 * d..n * 2 * d + d, n * d);
                }
            }
            let qr = &mut q_part[..qw];
            let kr = &mut rest[..kw];
            // 2. per-head q/k norm (qwen3), then RoPE at the row's position
            if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
                qn.forward_inplace(qr);
                kn.forward_inplace(kr);
            }
            let (cos, sin) = self.rope.cos_sin(layout.positions[r]);
            self.rope.rotate_heads(qr, d, &cos, &sin);
            self.rope.rotate_heads(kr, d, &cos, &sin);
            // 3. the row's key and value go to its cache row
            kv.row_mut(layout.write_row(r)).copy_from_slice(&rest[..2 * kw]);
            q[r * qw..(r + 1) * qw].copy_from_slice(qr);
        }
        // 4. each row attends to the cache rows it can see          [t × q_heads·d]
        let mut attn = vec![0.0f32; t * qw];
        let mut scores = Vec::new();
        for r in 0..t {
            let keys = layout.visible_rows(r, self.sliding_window);
            attend_row(&self.shape, &q[r * qw..(r + 1) * qw], kv, keys, &mut attn[r * qw..(r + 1) * qw], &mut scores);
        }
        // 5. output gate (qwen3_next), then the output projection   [t × hidden]
        if self.output_gate {
            for (a, g) in attn.iter_mut().zip(&gate) {
                *a *= sigmoid(*g);
            }
        }
        self.o.forward(&attn, t)
    }

    pub fn macs_per_row(&self) -> usize {
        self.qkv.macs_per_row() + self.o.macs_per_row()
    }

    /// Attention multiply-adds of one query at context length `ctx`.
    pub fn attention_macs(&self, ctx: usize) -> usize {
        self.shape.q_heads * (self.shape.qk_dim + self.shape.v_dim) * ctx
    }
}
