//! Family `mha`: grouped-query attention over a paged KV cache — Llama (`model_type` llama) and
//! Qwen3 (per-head q/k RMSNorm before RoPE, optional sliding-window layers). Config fields are
//! named as in `config.json`.
//!
//! Cache row per token and layer: `[k: kv_heads × head_dim | v: kv_heads × head_dim]`, keys
//! after RoPE (and after Qwen3's k-norm).

use super::batch::BatchLayout;
use super::decoder::{DecoderLayer, Ffn, Mixer, Model};
use super::layers::{Linear, Mlp, RmsNorm};
use super::Family;
use crate::checkpoint::{parse_rope, ConfigSource, LoadError, WeightSource};
use crate::cpu::activation::sigmoid;
use crate::cpu::attention::{attend_row, AttentionShape};
use crate::cpu::rope::{Rope, RopeStyle};
use crate::kv::KvLayer;
use serde::Deserialize;

/// The `config.json` fields of llama and qwen3 that change the math.
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    #[serde(default = "super::defaults::rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    // qwen3 sliding windows
    #[serde(default)]
    pub use_sliding_window: bool,
    pub sliding_window: Option<usize>,
    pub max_window_layers: Option<usize>,
    pub layer_types: Option<Vec<String>>,
}

/// Rejects an activation other than SiLU (the only one these families use).
pub(crate) fn check_silu(cfg: &ConfigSource, act: &Option<String>) -> Result<(), LoadError> {
    match act.as_deref() {
        None | Some("silu") | Some("swish") => Ok(()),
        Some(other) => Err(cfg.error("hidden_act", format!("{other:?} is not supported (silu)"))),
    }
}

/// Grouped-query attention of one layer.
pub struct GqaAttention {
    qkv: Linear,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    rope: Rope,
    shape: AttentionShape,
    sliding_window: Option<usize>,
    /// Qwen3-Next: `q_proj` yields `[query | gate]` per head and the attention output is
    /// multiplied by `sigmoid(gate)` before `o_proj`.
    output_gate: bool,
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

/// Loads the attention of layer prefix `p` (`model.layers.{l}.self_attn`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_gqa(
    w: &dyn WeightSource,
    p: &str,
    hidden: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    bias: bool,
    qk_norm: QkNorm,
    output_gate: bool,
    eps: f32,
    rope: Rope,
    sliding_window: Option<usize>,
) -> Result<GqaAttention, LoadError> {
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

/// Builds a llama or qwen3 model.
pub fn build(cfg: &ConfigSource, w: &dyn WeightSource) -> Result<Model, LoadError> {
    let c: Config = cfg.family_config()?;
    check_silu(cfg, &c.hidden_act)?;
    let is_qwen3 = c.model_type == "qwen3";
    let hidden = c.hidden_size;
    let q_heads = c.num_attention_heads;
    let kv_heads = c.num_key_value_heads.unwrap_or(q_heads);
    if q_heads == 0 || kv_heads == 0 || q_heads % kv_heads != 0 {
        return Err(
            cfg.error("num_key_value_heads", format!("{kv_heads} does not divide num_attention_heads {q_heads}"))
        );
    }
    let head_dim = match c.head_dim {
        Some(d) => d,
        None if is_qwen3 => 128,
        None => hidden / q_heads,
    };
    let eps = c.rms_norm_eps as f32;
    let rope_params = parse_rope(cfg)?;
    let (inv_freq, scaling) = rope_params.inv_freq(head_dim, head_dim);
    let rope = Rope::new(inv_freq, scaling, RopeStyle::Neox);
    let layer_types = layer_types(cfg, &c)?;
    // Qwen3 keeps `sliding_window` only when `use_sliding_window` is set.
    let window = if c.use_sliding_window { c.sliding_window } else { None };
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for (l, kind) in layer_types.iter().enumerate() {
        let p = format!("model.layers.{l}");
        let attn = load_gqa(
            w,
            &format!("{p}.self_attn"),
            hidden,
            q_heads,
            kv_heads,
            head_dim,
            c.attention_bias,
            if is_qwen3 { QkNorm::Plain } else { QkNorm::None },
            false,
            eps,
            rope.clone(),
            if kind == "sliding_attention" { window } else { None },
        )?;
        layers.push(DecoderLayer {
            input_norm: RmsNorm::load(w, &format!("{p}.input_layernorm.weight"), hidden, eps)?,
            mixer: Mixer::Gqa(attn),
            post_norm: RmsNorm::load(w, &format!("{p}.post_attention_layernorm.weight"), hidden, eps)?,
            ffn: Ffn::Dense(Mlp::load(w, &format!("{p}.mlp"), hidden, c.intermediate_size, c.mlp_bias)?),
        });
    }
    Model::assemble(Family::Mha, &c.model_type, w, c.vocab_size, hidden, eps, c.tie_word_embeddings, layers)
}

/// Each layer's attention kind. Qwen3 derives them from the sliding-window fields when
/// `layer_types` is absent; llama layers are all full attention.
fn layer_types(cfg: &ConfigSource, c: &Config) -> Result<Vec<String>, LoadError> {
    let n = c.num_hidden_layers;
    let sliding = if c.use_sliding_window { c.sliding_window } else { None };
    let types = match &c.layer_types {
        Some(t) if c.model_type == "qwen3" => t.clone(),
        _ if c.model_type == "qwen3" => (0..n)
            .map(|i| {
                if sliding.is_some() && i >= c.max_window_layers.unwrap_or(28) {
                    "sliding_attention".to_string()
                } else {
                    "full_attention".to_string()
                }
            })
            .collect(),
        _ => vec!["full_attention".to_string(); n],
    };
    if types.len() != n {
        return Err(cfg.error("layer_types", format!("{} entries for {n} layers", types.len())));
    }
    for t in &types {
        match t.as_str() {
            "full_attention" | "sliding_attention" => {}
            other => {
                return Err(
                    cfg.error("layer_types", format!("{other:?} is not supported (full_attention, sliding_attention)"))
                )
            }
        }
    }
    Ok(types)
}
