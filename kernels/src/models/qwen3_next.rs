//! Families `hybrid_gdn` and `gdn`: Qwen3-Next (`model_type` qwen3_next). Gated DeltaNet
//! linear-attention layers ([`GatedDeltaNet`](super::parts::gated_delta::GatedDeltaNet)), and —
//! unless every layer is linear (`gdn`) — gated full-attention layers
//! ([`GqaAttention`](super::parts::gqa::GqaAttention) with its output gate and zero-centred q/k
//! norms), placed by `layer_types`; zero-centred RMSNorms `(1 + w)·x̂`; a softmax-routed MoE with
//! a sigmoid-gated shared expert. Config fields are named as in `config.json`.

use super::config::check_silu;
use super::decoder::{DecoderLayer, Ffn, Mixer, Model};
use super::family::Family;
use super::parts::gated_delta::{load_gdn, GdnDims};
use super::parts::gqa::{load_gqa, QkNorm};
use super::parts::layers::{Linear, Mlp, RmsNorm};
use super::parts::moe::{load_experts, MoeBlock, Routing, Scoring};
use crate::checkpoint::{parse_rope, ConfigSource, LoadError, WeightSource};
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
            let every = c.full_attention_interval.unwrap_or(4).max(1);
            (0..n).map(|i| if (i + 1) % every == 0 { "full_attention" } else { "linear_attention" }).collect()
        }
    };
    if types.len() != n {
        return Err(cfg.error("layer_types", format!("{} entries for {n} layers", types.len())));
    }
    Ok(types)
}

/// Builds a qwen3_next model (`gdn` when no layer is full attention, else `hybrid_gdn`).
pub fn build(cfg: &ConfigSource, w: &dyn WeightSource) -> Result<Model, LoadError> {
    let c: Config = cfg.family_config()?;
    check_silu(cfg, &c.hidden_act)?;
    let (hidden, eps) = (c.hidden_size, c.rms_norm_eps as f32);
    if c.linear_num_key_heads == 0 || c.linear_num_value_heads % c.linear_num_key_heads != 0 {
        return Err(cfg.error("linear_num_value_heads", "must be a multiple of linear_num_key_heads"));
    }
    if c.linear_conv_kernel_dim == 0 {
        return Err(cfg.error("linear_conv_kernel_dim", "must be at least 1"));
    }
    let types = layer_types(cfg, &c)?;
    let rope_params = parse_rope(cfg)?;
    // Qwen3-Next's default rope rotates int(head_dim · partial_rotary_factor) dims, half-split.
    let rotary = (c.head_dim as f64 * rope_params.partial_rotary_factor) as usize;
    let (inv, scaling) = rope_params.inv_freq(c.head_dim, rotary);
    let rope = Rope::new(inv, scaling, RopeStyle::Neox);
    let mlp_only = c.mlp_only_layers.clone().unwrap_or_default();
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for (l, kind) in types.iter().enumerate() {
        let p = format!("model.layers.{l}");
        let mixer = if *kind == "full_attention" {
            Mixer::Gqa(load_gqa(
                w,
                &format!("{p}.self_attn"),
                hidden,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.attention_bias,
                QkNorm::ZeroCentred,
                true,
                eps,
                rope.clone(),
                None,
            )?)
        } else {
            let dims = GdnDims {
                hidden,
                k_heads: c.linear_num_key_heads,
                v_heads: c.linear_num_value_heads,
                dk: c.linear_key_head_dim,
                dv: c.linear_value_head_dim,
                kernel: c.linear_conv_kernel_dim,
            };
            Mixer::Gdn(load_gdn(w, &format!("{p}.linear_attn"), dims, eps)?)
        };
        let is_moe = !mlp_only.contains(&l) && c.num_experts > 0 && (l + 1) % c.decoder_sparse_step.max(1) == 0;
        let ffn = if is_moe {
            Ffn::Moe(Box::new(qwen_moe(cfg, w, &format!("{p}.mlp"), &c)?))
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

fn qwen_moe(cfg: &ConfigSource, w: &dyn WeightSource, prefix: &str, c: &Config) -> Result<MoeBlock, LoadError> {
    let (hidden, n) = (c.hidden_size, c.num_experts);
    if c.num_experts_per_tok == 0 || c.num_experts_per_tok > n {
        return Err(cfg.error("num_experts_per_tok", format!("must be in 1..={n}")));
    }
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
        let c: Config = cfg.family_config().unwrap();
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
