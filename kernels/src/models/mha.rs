//! Family `mha`: Llama (`model_type` llama) and Qwen3 (qwen3: per-head q/k RMSNorm before RoPE,
//! optional sliding-window layers). Every layer is grouped-query attention
//! ([`GqaAttention`](super::parts::gqa::GqaAttention)) and a SwiGLU MLP; config fields are named
//! as in `config.json`.

use super::config::{check_eps, check_silu, checked_rope};
use super::decoder::Model;
use super::family::Family;
use super::layer::{DecoderLayer, Ffn, Mixer};
use super::parts::gqa::{gqa_params, load_gqa, GqaConfig, QkNorm};
use super::parts::layers::{Mlp, RmsNorm};
use super::size::ModelSize;
use crate::checkpoint::{parse_rope, ConfigSource, LoadError, WeightSource, ROPE_KEYS};
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

impl Config {
    /// Reads the fields and checks every one the math depends on, before any weight is read.
    pub fn read(cfg: &ConfigSource) -> Result<Self, LoadError> {
        let c: Config = cfg.family_config(ROPE_KEYS)?;
        c.validate(cfg)?;
        Ok(c)
    }

    fn validate(&self, cfg: &ConfigSource) -> Result<(), LoadError> {
        check_silu(cfg, &self.hidden_act)?;
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.kv_heads()),
        ] {
            cfg.dim(field, v)?;
        }
        cfg.layers("num_hidden_layers", self.num_hidden_layers)?;
        cfg.divides("num_key_value_heads", self.kv_heads(), "num_attention_heads", self.num_attention_heads)?;
        let head_dim = cfg.dim("head_dim", self.head_dim())?;
        check_eps(cfg, self.rms_norm_eps)?;
        if self.use_sliding_window {
            cfg.opt_dim("sliding_window", self.sliding_window)?;
        }
        layer_types(cfg, self)?;
        checked_rope(cfg, "head_dim", head_dim, head_dim)?;
        Ok(())
    }

    fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// `head_dim`, else Qwen3's default 128, else `hidden_size / num_attention_heads`.
    fn head_dim(&self) -> usize {
        match self.head_dim {
            Some(d) => d,
            None if self.model_type == "qwen3" => 128,
            None => self.hidden_size / self.num_attention_heads.max(1),
        }
    }

    /// The parameters of this config's model, by term.
    pub fn size(&self) -> ModelSize {
        let (layers, hidden) = (self.num_hidden_layers, self.hidden_size);
        let attention = gqa_params(hidden, self.num_attention_heads, self.kv_heads(), self.head_dim(), false);
        let mut size = ModelSize::default();
        size.add("vocab_size × hidden_size × 2 (embeddings, LM head)", self.vocab_size, 2 * hidden as u128)
            .add(
                "num_hidden_layers × 3 × hidden_size × intermediate_size (MLP)",
                layers,
                3 * hidden as u128 * self.intermediate_size as u128,
            )
            .add(
                "num_hidden_layers × attention (hidden_size, num_attention_heads, num_key_value_heads, head_dim)",
                layers,
                attention,
            )
            .add("num_hidden_layers × 2 × hidden_size (norms)", layers, 2 * hidden as u128);
        size
    }
}

/// Builds a llama or qwen3 model.
pub fn build(cfg: &ConfigSource, w: &dyn WeightSource) -> Result<Model, LoadError> {
    let c = Config::read(cfg)?;
    let is_qwen3 = c.model_type == "qwen3";
    let hidden = c.hidden_size;
    let (q_heads, kv_heads, head_dim) = (c.num_attention_heads, c.kv_heads(), c.head_dim());
    let eps = c.rms_norm_eps as f32;
    let rope_params = parse_rope(cfg)?;
    let (inv_freq, scaling) = rope_params.inv_freq(head_dim, head_dim);
    let rope = Rope::new(inv_freq, scaling, RopeStyle::Neox);
    let layer_types = layer_types(cfg, &c)?;
    // Qwen3 keeps `sliding_window` only when `use_sliding_window` is set.
    let window = if c.use_sliding_window { c.sliding_window } else { None };
    let attention = GqaConfig {
        hidden,
        q_heads,
        kv_heads,
        head_dim,
        bias: c.attention_bias,
        qk_norm: if is_qwen3 { QkNorm::Plain } else { QkNorm::None },
        output_gate: false,
        eps,
        rope,
        sliding_window: None,
    };
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for (l, kind) in layer_types.iter().enumerate() {
        let p = format!("model.layers.{l}");
        let sliding_window = if kind == "sliding_attention" { window } else { None };
        let attn = load_gqa(w, &format!("{p}.self_attn"), GqaConfig { sliding_window, ..attention.clone() })?;
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
    cfg.one_per_layer("layer_types", types.len(), n)?;
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
