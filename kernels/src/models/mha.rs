//! Family `mha`: Llama (`model_type` llama) and Qwen3 (qwen3: per-head q/k RMSNorm before RoPE,
//! optional sliding-window layers). Every layer is grouped-query attention
//! ([`GqaAttention`](super::parts::gqa::GqaAttention)) and a SwiGLU MLP; config fields are named
//! as in `config.json`.

use super::config::check_silu;
use super::decoder::{DecoderLayer, Ffn, Mixer, Model};
use super::family::Family;
use super::parts::gqa::{load_gqa, QkNorm};
use super::parts::layers::{Mlp, RmsNorm};
use crate::checkpoint::{parse_rope, ConfigSource, LoadError, WeightSource};
use crate::cpu::rope::{Rope, RopeStyle};
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
    #[serde(default = "super::config::rms_norm_eps")]
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
