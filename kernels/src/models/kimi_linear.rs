//! Family `hybrid_kda`: Kimi Linear (`model_type` kimi_linear). Kimi Delta Attention layers
//! ([`KimiDeltaAttention`](super::parts::kda::KimiDeltaAttention)) and latent attention layers
//! without positional encoding ([`MlaAttention`](super::parts::mla::MlaAttention) with no rope),
//! a DeepSeek-style MoE (sigmoid scores + `e_score_correction_bias`, grouped top-k, scaled
//! weights, an ungated shared expert), plain RMSNorms. Config fields are named as in
//! `config.json` (Moonshot's names, with transformers' aliases).

use super::config::RoutingFields;
use super::decoder::Model;
use super::family::Family;
use super::layer::{DecoderLayer, Ffn, Mixer};
use super::mla_moe::{MlaStack, SigmoidMoeConfig};
use super::parts::kda::{kda_params, load_kda};
use super::parts::layers::{Mlp, RmsNorm};
use super::parts::mla::{load_mla, MlaDims};
use super::size::ModelSize;
use crate::checkpoint::{keys_of, ConfigSource, LoadError, WeightSource};
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
                cfg.one_per_layer("layer_types", types.len(), n)?;
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

impl Config {
    /// Reads the fields and checks every one the math depends on, before any weight is read.
    pub fn read(cfg: &ConfigSource) -> Result<Self, LoadError> {
        // Kimi Linear's latent attention has no positional encoding: no rope keys are read.
        let c: Config = cfg.family_config(&[])?;
        cfg.check_table_keys("linear_attn_config", keys_of::<LinearAttnConfig>())?;
        c.validate(cfg)?;
        Ok(c)
    }

    fn validate(&self, cfg: &ConfigSource) -> Result<(), LoadError> {
        let stack = self.stack();
        stack.check(cfg)?;
        if self.num_key_value_heads.is_some_and(|k| k != self.num_attention_heads) {
            return Err(
                cfg.error("num_key_value_heads", "Kimi Linear's MLA needs num_key_value_heads == num_attention_heads")
            );
        }
        let (heads, head_dim, kernel) = self.kda_sizes();
        cfg.dim("linear_attn_config.num_heads", heads)?;
        cfg.dim("linear_attn_config.head_dim", head_dim)?;
        cfg.dim("linear_attn_config.short_conv_kernel_size", kernel)?;
        layer_is_linear(cfg, self)?;
        if stack.mlp_is_dense(cfg)?.contains(&false) {
            self.moe().check(cfg)?;
        }
        Ok(())
    }

    /// KDA heads, head size and conv kernel: `linear_attn_config`'s, else transformers' names,
    /// else Moonshot's defaults.
    fn kda_sizes(&self) -> (usize, usize, usize) {
        let l = &self.linear_attn_config;
        (
            l.num_heads.or(self.linear_num_heads).unwrap_or(32),
            l.head_dim.or(self.linear_head_dim).unwrap_or(128),
            l.short_conv_kernel_size.or(self.linear_conv_kernel_dim).unwrap_or(4),
        )
    }

    /// The stack's fields as both latent-attention families read them.
    fn stack(&self) -> MlaStack<'_> {
        MlaStack {
            hidden_act: &self.hidden_act,
            vocab_size: self.vocab_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            first_k_dense_replace: self.first_k_dense_replace,
            rms_norm_eps: self.rms_norm_eps,
            mlp_layer_types: self.mlp_layer_types.as_deref(),
            mla: self.mla_dims(),
        }
    }

    /// The MoE layers under Kimi Linear's names.
    fn moe(&self) -> SigmoidMoeConfig {
        SigmoidMoeConfig {
            routing_fields: ROUTING_FIELDS,
            shared_experts_field: "num_shared_experts",
            moe_intermediate_size: self.moe_intermediate_size,
            num_experts: self.num_experts,
            top_k: self.num_experts_per_token,
            n_group: self.num_expert_group,
            topk_group: self.topk_group,
            shared_experts: self.num_shared_experts,
            norm_topk_prob: self.moe_renormalize,
            routed_scaling_factor: self.routed_scaling_factor,
        }
    }

    fn mla_dims(&self) -> MlaDims {
        MlaDims {
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            q_lora_rank: self.q_lora_rank,
            kv_lora: self.kv_lora_rank,
            nope: self.qk_nope_head_dim,
            rope_dim: self.qk_rope_head_dim,
            v_dim: self.v_head_dim,
        }
    }

    /// The parameters of this config's model, by term.
    pub fn size(&self, cfg: &ConfigSource) -> Result<ModelSize, LoadError> {
        let (layers, hidden) = (self.num_hidden_layers, self.hidden_size);
        let linear = layer_is_linear(cfg, self)?.iter().filter(|l| **l).count();
        let dense = self.stack().mlp_is_dense(cfg)?.iter().filter(|d| **d).count();
        let (heads, head_dim, kernel) = self.kda_sizes();
        let experts = self.moe().params(hidden);
        let mut size = ModelSize::default();
        size.add("vocab_size × hidden_size × 2 (embeddings, LM head)", self.vocab_size, 2 * hidden as u128)
            .add(
                "KDA layers × KDA (linear_attn_config.num_heads, head_dim)",
                linear,
                kda_params(hidden, heads, head_dim, kernel),
            )
            .add(
                "MLA layers × latent attention (num_attention_heads, kv_lora_rank, head dims)",
                layers - linear,
                self.mla_dims().params(),
            )
            .add(
                "dense layers × 3 × hidden_size × intermediate_size (MLP)",
                dense,
                3 * hidden as u128 * self.intermediate_size as u128,
            )
            .add(
                "MoE layers × num_experts × 3 × hidden_size × moe_intermediate_size (experts)",
                layers - dense,
                experts,
            )
            .add("num_hidden_layers × 2 × hidden_size (norms)", layers, 2 * hidden as u128);
        Ok(size)
    }
}

/// The fields of Kimi Linear's expert routing.
const ROUTING_FIELDS: RoutingFields = ["num_experts", "num_experts_per_token", "num_expert_group", "topk_group"];

/// Builds a kimi_linear model.
pub fn build(cfg: &ConfigSource, w: &dyn WeightSource) -> Result<Model, LoadError> {
    let c = Config::read(cfg)?;
    let (hidden, eps) = (c.hidden_size, c.rms_norm_eps as f32);
    let linear = layer_is_linear(cfg, &c)?;
    let (heads, head_dim, kernel) = c.kda_sizes();
    let dense = c.stack().mlp_is_dense(cfg)?;
    let dims = c.mla_dims();
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
            Ffn::Moe(Box::new(c.moe().load(w, &ffn_prefix, hidden, ["w1", "w3", "w2"])?))
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
        let c: Config = cfg.family_config(&[]).unwrap();
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
