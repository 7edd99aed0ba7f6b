//! Families `hybrid_gdn` and `gdn`: Qwen3-Next (`model_type` qwen3_next). Gated DeltaNet
//! linear-attention layers ([`GatedDeltaNet`](super::parts::gated_delta::GatedDeltaNet)), and —
//! unless every layer is linear (`gdn`) — gated full-attention layers
//! ([`GqaAttention`](super::parts::gqa::GqaAttention) with its output gate and zero-centred q/k
//! norms), placed by `layer_types`; zero-centred RMSNorms `(1 + w)·x̂`; a softmax-routed MoE with
//! a sigmoid-gated shared expert. Config fields are named as in `config.json`.

use super::config::{check_eps, check_routing, check_silu, checked_rope, RoutingFields};
use super::decoder::Model;
use super::family::Family;
use super::layer::{DecoderLayer, Ffn, Mixer};
use super::parts::gated_delta::{load_gdn, GdnDims};
use super::parts::gqa::{gqa_params, load_gqa, GqaConfig, QkNorm};
use super::parts::layers::{Linear, Mlp, RmsNorm};
use super::parts::moe::{load_experts, moe_params, MoeBlock, Routing, Scoring};
use super::size::ModelSize;
use crate::checkpoint::{parse_rope, ConfigSource, LoadError, WeightSource, ROPE_KEYS};
use crate::cpu::rope::{Rope, RopeStyle};
use serde::Deserialize;

/// The `config.json` fields of qwen3_next.
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default = "default_head_dim")]
    pub head_dim: usize,
    #[serde(default = "super::config::rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    pub layer_types: Option<Vec<String>>,
    pub full_attention_interval: Option<usize>,
    #[serde(default = "default_conv")]
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    #[serde(default)]
    pub num_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: usize,
    #[serde(default = "super::config::yes")]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub shared_expert_intermediate_size: usize,
    #[serde(default = "super::config::one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
}

fn default_head_dim() -> usize {
    256
}
fn default_conv() -> usize {
    4
}

/// Each layer's kind: `layer_types` when present (legacy names remapped), else full attention
/// every `full_attention_interval` (default 4) layers.
pub fn layer_types(cfg: &ConfigSource, c: &Config) -> Result<Vec<&'static str>, LoadError> {
    let n = c.num_hidden_layers;
    let types: Vec<&'static str> = match &c.layer_types {
        Some(t) => t
            .iter()
            .map(|k| match k.as_str() {
                "linear_attention" | "mamba" => Ok("linear_attention"),
                "full_attention" | "attention" => Ok("full_attention"),
                other => Err(cfg.error("layer_types", format!("{other:?} is not linear_attention or full_attention"))),
            })
            .collect::<Result<_, _>>()?,
        None => {
            let every = cfg.dim("full_attention_interval", c.full_attention_interval.unwrap_or(4))?;
            (0..n).map(|i| if (i + 1) % every == 0 { "full_attention" } else { "linear_attention" }).collect()
        }
    };
    cfg.one_per_layer("layer_types", types.len(), n)?;
    Ok(types)
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
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("decoder_sparse_step", self.decoder_sparse_step),
        ] {
            cfg.dim(field, v)?;
        }
        let n = cfg.layers("num_hidden_layers", self.num_hidden_layers)?;
        let (k_heads, v_heads) = (self.linear_num_key_heads, self.linear_num_value_heads);
        cfg.divides("linear_num_key_heads", k_heads, "linear_num_value_heads", v_heads)?;
        check_eps(cfg, self.rms_norm_eps)?;
        for &l in self.mlp_only_layers.iter().flatten() {
            cfg.at_most("mlp_only_layers", l, "num_hidden_layers - 1", n - 1)?;
        }
        if layer_types(cfg, self)?.contains(&"full_attention") {
            cfg.dim("num_attention_heads", self.num_attention_heads)?;
            cfg.dim("num_key_value_heads", self.num_key_value_heads)?;
            let q_heads = self.num_attention_heads;
            cfg.divides("num_key_value_heads", self.num_key_value_heads, "num_attention_heads", q_heads)?;
        }
        let head_dim = cfg.dim("head_dim", self.head_dim)?;
        checked_rope(cfg, "head_dim", head_dim, self.rotary_dims(cfg)?)?;
        if self.moe_layers(n) > 0 {
            cfg.dim("moe_intermediate_size", self.moe_intermediate_size)?;
            cfg.count("shared_expert_intermediate_size", self.shared_expert_intermediate_size)?;
            check_routing(cfg, ROUTING_FIELDS, self.num_experts, self.num_experts_per_tok, 1, 1)?;
        }
        Ok(())
    }

    /// Qwen3-Next's default rope rotates `int(head_dim · partial_rotary_factor)` dims, half-split.
    fn rotary_dims(&self, cfg: &ConfigSource) -> Result<usize, LoadError> {
        Ok((self.head_dim as f64 * parse_rope(cfg)?.partial_rotary_factor) as usize)
    }

    /// Whether layer `l`'s feed-forward is the MoE.
    fn is_moe(&self, l: usize) -> bool {
        let mlp_only = self.mlp_only_layers.as_deref().unwrap_or_default();
        !mlp_only.contains(&l) && self.num_experts > 0 && (l + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }

    fn moe_layers(&self, layers: usize) -> usize {
        (0..layers).filter(|&l| self.is_moe(l)).count()
    }

    /// The parameters of this config's model, by term.
    pub fn size(&self, cfg: &ConfigSource) -> Result<ModelSize, LoadError> {
        let (layers, hidden) = (self.num_hidden_layers, self.hidden_size);
        let full = layer_types(cfg, self)?.iter().filter(|t| **t == "full_attention").count();
        let moe = self.moe_layers(layers);
        let (q_heads, kv_heads) = (self.num_attention_heads, self.num_key_value_heads);
        let gdn = self.gdn_dims().params();
        let experts =
            moe_params(hidden, self.num_experts, self.moe_intermediate_size, self.shared_expert_intermediate_size);
        let mut size = ModelSize::default();
        size.add("vocab_size × hidden_size × 2 (embeddings, LM head)", self.vocab_size, 2 * hidden as u128)
            .add(
                "full-attention layers × attention (num_attention_heads, num_key_value_heads, head_dim)",
                full,
                gqa_params(hidden, q_heads, kv_heads, self.head_dim, true),
            )
            .add("linear-attention layers × Gated DeltaNet (linear_num_*_heads, linear_*_head_dim)", layers - full, gdn)
            .add("MoE layers × num_experts × 3 × hidden_size × moe_intermediate_size (experts)", moe, experts)
            .add(
                "dense layers × 3 × hidden_size × intermediate_size (MLP)",
                layers - moe,
                3 * hidden as u128 * self.intermediate_size as u128,
            )
            .add("num_hidden_layers × 2 × hidden_size (norms)", layers, 2 * hidden as u128);
        Ok(size)
    }

    fn gdn_dims(&self) -> GdnDims {
        GdnDims {
            hidden: self.hidden_size,
            k_heads: self.linear_num_key_heads,
            v_heads: self.linear_num_value_heads,
            dk: self.linear_key_head_dim,
            dv: self.linear_value_head_dim,
            kernel: self.linear_conv_kernel_dim,
        }
    }
}

/// The fields of Qwen3-Next's expert routing (it has no expert groups).
const ROUTING_FIELDS: RoutingFields = ["num_experts", "num_experts_per_tok", "(1 group)", "(1 group kept)"];

/// Builds a qwen3_next model (`gdn` when no layer is full attention, else `hybrid_gdn`).
pub fn build(cfg: &ConfigSource, w: &dyn WeightSource) -> Result<Model, LoadError> {
    let c = Config::read(cfg)?;
    let (hidden, eps) = (c.hidden_size, c.rms_norm_eps as f32);
    let types = layer_types(cfg, &c)?;
    let rope_params = parse_rope(cfg)?;
    let (inv, scaling) = rope_params.inv_freq(c.head_dim, c.rotary_dims(cfg)?);
    let rope = Rope::new(inv, scaling, RopeStyle::Neox);
    let attention = GqaConfig {
        hidden,
        q_heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        bias: c.attention_bias,
        qk_norm: QkNorm::ZeroCentred,
        output_gate: true,
        eps,
        rope,
        sliding_window: None,
    };
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for (l, kind) in types.iter().enumerate() {
        let p = format!("model.layers.{l}");
        let mixer = if *kind == "full_attention" {
            Mixer::Gqa(load_gqa(w, &format!("{p}.self_attn"), attention.clone())?)
        } else {
            Mixer::Gdn(load_gdn(w, &format!("{p}.linear_attn"), c.gdn_dims(), eps)?)
        };
        let ffn = if c.is_moe(l) {
            Ffn::Moe(Box::new(qwen_moe(w, &format!("{p}.mlp"), &c)?))
        } else {
            Ffn::Dense(Mlp::load(w, &format!("{p}.mlp"), hidden, c.intermediate_size, false)?)
        };
        layers.push(DecoderLayer {
            input_norm: RmsNorm::load_zero_centred(w, &format!("{p}.input_layernorm.weight"), hidden, eps)?,
            mixer,
            post_norm: RmsNorm::load_zero_centred(w, &format!("{p}.post_attention_layernorm.weight"), hidden, eps)?,
            ffn,
        });
    }
    let family = if types.iter().all(|t| *t == "linear_attention") { Family::Gdn } else { Family::HybridGdn };
    let final_norm = RmsNorm::load_zero_centred(w, "model.norm.weight", hidden, eps)?;
    Model::assemble_with_norm(family, &c.model_type, w, c.vocab_size, hidden, final_norm, c.tie_word_embeddings, layers)
}

fn qwen_moe(w: &dyn WeightSource, prefix: &str, c: &Config) -> Result<MoeBlock, LoadError> {
    let (hidden, n) = (c.hidden_size, c.num_experts);
    let shared = (c.shared_expert_intermediate_size > 0)
        .then(|| Mlp::load(w, &format!("{prefix}.shared_expert"), hidden, c.shared_expert_intermediate_size, false))
        .transpose()?;
    let shared_gate = (c.shared_expert_intermediate_size > 0)
        .then(|| Linear::load(w, &format!("{prefix}.shared_expert_gate"), hidden, 1, false))
        .transpose()?;
    Ok(MoeBlock {
        router: Linear::load(w, &format!("{prefix}.gate"), hidden, n, false)?,
        routing: Routing {
            num_experts: n,
            top_k: c.num_experts_per_tok,
            scoring: Scoring::Softmax,
            correction_bias: None,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: c.norm_topk_prob,
            scaling: 1.0,
        },
        first_expert: w.experts_to_load(n).start,
        experts: load_experts(
            w,
            &format!("{prefix}.experts"),
            ["gate_proj", "up_proj", "down_proj"],
            n,
            hidden,
            c.moe_intermediate_size,
        )?,
        shared,
        shared_gate,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn types(extra: &str) -> Vec<&'static str> {
        let text = format!(
            r#"{{"model_type": "qwen3_next", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "linear_key_head_dim": 2,
            "linear_value_head_dim": 2, "linear_num_key_heads": 1, "linear_num_value_heads": 2 {extra}}}"#
        );
        let cfg = ConfigSource::parse("config.json".into(), &text).unwrap();
        let c: Config = cfg.family_config(ROPE_KEYS).unwrap();
        layer_types(&cfg, &c).unwrap()
    }

    #[test]
    fn layer_types_win_over_the_interval() {
        let t = types(
            r#", "full_attention_interval": 2, "layer_types": ["linear_attention", "linear_attention", "linear_attention", "linear_attention"]"#,
        );
        assert!(t.iter().all(|k| *k == "linear_attention"));
    }

    #[test]
    fn the_interval_places_full_attention_on_every_nth_layer() {
        assert_eq!(
            types(r#", "full_attention_interval": 2"#),
            vec!["linear_attention", "full_attention", "linear_attention", "full_attention"]
        );
        assert_eq!(types("")[3], "full_attention");
    }
}
