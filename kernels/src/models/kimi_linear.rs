//! Family `hybrid_kda`: Kimi Linear (`model_type` kimi_linear). Kimi Delta Attention layers
//! ([`KimiDeltaAttention`](super::parts::kda::KimiDeltaAttention)) and latent attention layers
//! without positional encoding ([`MlaAttention`](super::parts::mla::MlaAttention) with no rope),
//! a DeepSeek-style MoE (sigmoid scores + `e_score_correction_bias`, grouped top-k, scaled
//! weights, an ungated shared expert), plain RMSNorms. Config fields are named as in
//! `config.json` (Moonshot's names, with transformers' aliases).

use super::config::check_silu;
use super::decoder::{DecoderLayer, Ffn, Mixer, Model};
use super::family::Family;
use super::parts::kda::load_kda;
use super::parts::layers::{Mlp, RmsNorm};
use super::parts::mla::{load_mla, MlaDims};
use super::parts::moe::{MoeBlock, Routing, Scoring, SigmoidMoe};
use crate::checkpoint::{ConfigSource, LoadError, WeightSource};
use serde::Deserialize;

/// `linear_attn_config` of a Kimi Linear config.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct LinearAttnConfig {
    pub num_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub short_conv_kernel_size: Option<usize>,
    /// 1-based layer numbers.
    pub kda_layers: Option<Vec<usize>>,
    /// 1-based layer numbers.
    pub full_attn_layers: Option<Vec<usize>>,
}

/// The `config.json` fields of kimi_linear (Moonshot's names, with transformers' aliases).
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    pub layer_types: Option<Vec<String>>,
    pub mlp_layer_types: Option<Vec<String>>,
    #[serde(default = "super::config::one")]
    pub first_k_dense_replace: usize,
    #[serde(default)]
    pub linear_attn_config: LinearAttnConfig,
    pub linear_num_heads: Option<usize>,
    pub linear_head_dim: Option<usize>,
    pub linear_conv_kernel_dim: Option<usize>,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    #[serde(alias = "num_local_experts")]
    pub num_experts: usize,
    #[serde(alias = "num_experts_per_tok")]
    pub num_experts_per_token: usize,
    #[serde(alias = "norm_topk_prob", default = "super::config::yes")]
    pub moe_renormalize: bool,
    #[serde(alias = "n_group", default = "super::config::one")]
    pub num_expert_group: usize,
    #[serde(default = "super::config::one")]
    pub topk_group: usize,
    #[serde(alias = "n_shared_experts", default = "super::config::one")]
    pub num_shared_experts: usize,
    #[serde(default = "default_scaling")]
    pub routed_scaling_factor: f64,
    pub moe_intermediate_size: usize,
}

fn default_eps() -> f64 {
    1e-5
}
fn default_scaling() -> f64 {
    2.446
}

/// Each layer's kind. An explicit `layer_types` wins, and is cross-checked against the 1-based
/// `linear_attn_config.kda_layers` / `full_attn_layers` when those are given too; otherwise those
/// lists decide; otherwise full attention sits at 0-based layers 4, 8, 12, ….
pub fn layer_is_linear(cfg: &ConfigSource, c: &Config) -> Result<Vec<bool>, LoadError> {
    let n = c.num_hidden_layers;
    let from_lists = match (&c.linear_attn_config.kda_layers, &c.linear_attn_config.full_attn_layers) {
        (Some(kda), Some(full)) => {
            let mut kinds: Vec<Option<bool>> = vec![None; n];
            for (list, linear, field) in [(kda, true, "kda_layers"), (full, false, "full_attn_layers")] {
                for &l in list {
                    if l == 0 || l > n {
                        return Err(cfg.error(
                            &format!("linear_attn_config.{field}"),
                            format!("layer {l} is outside 1..={n} (the lists are 1-based)"),
                        ));
                    }
                    if kinds[l - 1].is_some() {
                        return Err(
                            cfg.error(&format!("linear_attn_config.{field}"), format!("layer {l} is listed twice"))
                        );
                    }
                    kinds[l - 1] = Some(linear);
                }
            }
            let kinds: Option<Vec<bool>> = kinds.into_iter().collect();
            Some(kinds.ok_or_else(|| {
                cfg.error("linear_attn_config", "kda_layers and full_attn_layers do not cover every layer")
            })?)
        }
        _ => None,
    };
    let explicit =
        match &c.layer_types {
            Some(types) => {
                if types.len() != n {
                    return Err(cfg.error("layer_types", format!("{} entries for {n} layers", types.len())));
                }
                Some(
                    types
                        .iter()
                        .map(|t| match t.as_str() {
                            "linear_attention" => Ok(true),
                            "full_attention" => Ok(false),
                            other => Err(cfg
                                .error("layer_types", format!("{other:?} is not linear_attention or full_attention"))),
                        })
                        .collect::<Result<Vec<_>, _>>()?,
                )
            }
            None => None,
        };
    match (explicit, from_lists) {
        (Some(e), Some(l)) if e != l => Err(cfg.error(
            "layer_types",
            format!("disagrees with linear_attn_config.kda_layers/full_attn_layers (1-based): {e:?} vs {l:?} (true = linear)"),
        )),
        (Some(e), _) => Ok(e),
        (None, Some(l)) => Ok(l),
        (None, None) => Ok((0..n).map(|i| !(i > 0 && i % 4 == 0)).collect()),
    }
}

/// Builds a kimi_linear model.
pub fn build(cfg: &ConfigSource, w: &dyn WeightSource) -> Result<Model, LoadError> {
    let c: Config = cfg.family_config()?;
    check_silu(cfg, &c.hidden_act)?;
    let (hidden, eps) = (c.hidden_size, c.rms_norm_eps as f32);
    let linear = layer_is_linear(cfg, &c)?;
    let heads = c.linear_attn_config.num_heads.or(c.linear_num_heads).unwrap_or(32);
    let head_dim = c.linear_attn_config.head_dim.or(c.linear_head_dim).unwrap_or(128);
    let kernel = c.linear_attn_config.short_conv_kernel_size.or(c.linear_conv_kernel_dim).unwrap_or(4);
    if kernel == 0 {
        return Err(cfg.error("linear_attn_config.short_conv_kernel_size", "must be at least 1"));
    }
    if c.num_key_value_heads.is_some_and(|k| k != c.num_attention_heads) {
        return Err(
            cfg.error("num_key_value_heads", "Kimi Linear's MLA needs num_key_value_heads == num_attention_heads")
        );
    }
    if c.num_expert_group == 0 || c.num_experts % c.num_expert_group != 0 || c.topk_group > c.num_expert_group {
        return Err(cfg.error("num_expert_group", "must divide num_experts and be at least topk_group"));
    }
    let dense: Vec<bool> = match &c.mlp_layer_types {
        Some(t) if t.len() == c.num_hidden_layers => t.iter().map(|k| k == "dense").collect(),
        Some(t) => {
            return Err(cfg.error("mlp_layer_types", format!("{} entries for {} layers", t.len(), c.num_hidden_layers)))
        }
        None => (0..c.num_hidden_layers).map(|l| l < c.first_k_dense_replace).collect(),
    };
    let dims = MlaDims {
        hidden,
        heads: c.num_attention_heads,
        q_lora_rank: c.q_lora_rank,
        kv_lora: c.kv_lora_rank,
        nope: c.qk_nope_head_dim,
        rope_dim: c.qk_rope_head_dim,
        v_dim: c.v_head_dim,
    };
    let scale = ((c.qk_nope_head_dim + c.qk_rope_head_dim) as f32).powf(-0.5);
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let mixer = if linear[l] {
            Mixer::Kda(load_kda(w, &format!("{p}.self_attn"), hidden, heads, head_dim, kernel, eps)?)
        } else {
            // MLA with no positional encoding: the "rope" dims are used as they are.
            Mixer::Mla(Box::new(load_mla(w, &format!("{p}.self_attn"), dims, false, None, None, scale)?))
        };
        // transformers stores the feed-forward under `block_sparse_moe` (Moonshot's name) or `mlp`.
        let ffn_prefix =
            if w.contains(&format!("{p}.mlp.gate.weight")) || w.contains(&format!("{p}.mlp.gate_proj.weight")) {
                format!("{p}.mlp")
            } else {
                format!("{p}.block_sparse_moe")
            };
        let ffn = if dense[l] {
            Ffn::Dense(Mlp::load(w, &ffn_prefix, hidden, c.intermediate_size, false)?)
        } else {
            Ffn::Moe(Box::new(kimi_moe(w, &ffn_prefix, &c)?))
        };
        layers.push(DecoderLayer {
            input_norm: RmsNorm::load(w, &format!("{p}.input_layernorm.weight"), hidden, eps)?,
            mixer,
            post_norm: RmsNorm::load(w, &format!("{p}.post_attention_layernorm.weight"), hidden, eps)?,
            ffn,
        });
    }
    Model::assemble(Family::HybridKda, &c.model_type, w, c.vocab_size, hidden, eps, c.tie_word_embeddings, layers)
}

fn kimi_moe(w: &dyn WeightSource, prefix: &str, c: &Config) -> Result<MoeBlock, LoadError> {
    SigmoidMoe {
        prefix,
        hidden: c.hidden_size,
        inter: c.moe_intermediate_size,
        expert_names: ["w1", "w3", "w2"],
        shared_inter: c.moe_intermediate_size * c.num_shared_experts,
        routing: Routing {
            num_experts: c.num_experts,
            top_k: c.num_experts_per_token,
            scoring: Scoring::Sigmoid,
            correction_bias: None,
            n_group: c.num_expert_group,
            topk_group: c.topk_group,
            norm_topk_prob: c.moe_renormalize,
            scaling: c.routed_scaling_factor as f32,
        },
    }
    .load(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(extra: &str) -> Result<Vec<bool>, LoadError> {
        let text = format!(
            r#"{{"model_type": "kimi_linear", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 4, "num_attention_heads": 2, "kv_lora_rank": 4, "qk_nope_head_dim": 2,
            "qk_rope_head_dim": 2, "v_head_dim": 2, "num_experts": 2, "num_experts_per_token": 1,
            "moe_intermediate_size": 4 {extra}}}"#
        );
        let cfg = ConfigSource::parse("config.json".into(), &text).unwrap();
        let c: Config = cfg.family_config().unwrap();
        layer_is_linear(&cfg, &c)
    }

    #[test]
    fn the_one_based_lists_decide_when_layer_types_is_absent() {
        let got = kinds(r#", "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3]}"#).unwrap();
        assert_eq!(got, vec![true, true, false, true]);
    }

    #[test]
    fn layer_types_that_agree_with_the_lists_are_accepted() {
        let got = kinds(
            r#", "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3]}"#,
        )
        .unwrap();
        assert_eq!(got, vec![true, true, false, true]);
    }

    #[test]
    fn layer_types_that_disagree_with_the_lists_are_an_error() {
        let e = kinds(
            r#", "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("layer_types") && e.contains("disagrees"), "{e}");
    }

    #[test]
    fn a_zero_layer_number_is_rejected_as_not_one_based() {
        let e = kinds(r#", "linear_attn_config": {"kda_layers": [0, 1, 2], "full_attn_layers": [3]}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("1-based"), "{e}");
    }

    #[test]
    fn without_lists_full_attention_sits_at_every_fourth_layer_from_four() {
        assert_eq!(kinds("").unwrap(), vec![true, true, true, true]);
    }
}
