//! The config fields the two latent-attention families read alike — `deepseek` (deepseek_v3,
//! deepseek_v32) and `kimi_linear`: the decoder stack's and MLA's sizes, each layer's feed-forward
//! kind, and their DeepSeek-style MoE (sigmoid scores, grouped top-k, scaled weights, shared
//! experts). Each family gives its values, and its own names where the two configs differ; the
//! checks, sizes and loading are made here, once.

use super::config::{check_eps, check_routing, check_silu, RoutingFields};
use super::parts::mla::MlaDims;
use super::parts::moe::{moe_params, MoeBlock, Routing, Scoring, SigmoidMoe};
use crate::checkpoint::{ConfigSource, LoadError, WeightSource};

/// The stack of a latent-attention family: the fields both configs name alike.
pub(crate) struct MlaStack<'a> {
    pub hidden_act: &'a Option<String>,
    pub vocab_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub first_k_dense_replace: usize,
    pub rms_norm_eps: f64,
    /// `mlp_layer_types`, when the family reads it.
    pub mlp_layer_types: Option<&'a [String]>,
    /// `hidden_size`, `num_attention_heads`, `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`,
    /// `qk_rope_head_dim`, `v_head_dim`.
    pub mla: MlaDims,
}

impl MlaStack<'_> {
    /// The checks every latent-attention config takes first: SiLU, the sizes, the layer count,
    /// `first_k_dense_replace`, the norm epsilon.
    pub(crate) fn check(&self, cfg: &ConfigSource) -> Result<(), LoadError> {
        check_silu(cfg, self.hidden_act)?;
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.mla.hidden),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.mla.heads),
            ("kv_lora_rank", self.mla.kv_lora),
            ("qk_nope_head_dim", self.mla.nope),
            ("qk_rope_head_dim", self.mla.rope_dim),
            ("v_head_dim", self.mla.v_dim),
        ] {
            cfg.dim(field, v)?;
        }
        cfg.layers("num_hidden_layers", self.num_hidden_layers)?;
        cfg.opt_dim("q_lora_rank", self.mla.q_lora_rank)?;
        cfg.count("first_k_dense_replace", self.first_k_dense_replace)?;
        check_eps(cfg, self.rms_norm_eps)?;
        Ok(())
    }

    /// Whether each layer's feed-forward is dense (else MoE): `mlp_layer_types` when given, else
    /// the first `first_k_dense_replace` layers, as transformers decides.
    pub(crate) fn mlp_is_dense(&self, cfg: &ConfigSource) -> Result<Vec<bool>, LoadError> {
        match self.mlp_layer_types {
            Some(types) => {
                cfg.one_per_layer("mlp_layer_types", types.len(), self.num_hidden_layers)?;
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        "dense" => Ok(true),
                        "sparse" => Ok(false),
                        other => {
                            Err(cfg.error("mlp_layer_types", format!("{other:?} is neither \"dense\" nor \"sparse\"")))
                        }
                    })
                    .collect()
            }
            None => Ok((0..self.num_hidden_layers).map(|l| l < self.first_k_dense_replace).collect()),
        }
    }
}

/// A DeepSeek-style MoE as a config gives it, with the family's names for the fields the two
/// configs name differently.
pub(crate) struct SigmoidMoeConfig {
    /// The family's names of `num_experts`, `top_k`, `n_group`, `topk_group`.
    pub routing_fields: RoutingFields,
    /// The family's name of the shared expert count.
    pub shared_experts_field: &'static str,
    pub moe_intermediate_size: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub shared_experts: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
}

impl SigmoidMoeConfig {
    /// Checks the fields a MoE layer reads (made when some layer is MoE).
    pub(crate) fn check(&self, cfg: &ConfigSource) -> Result<(), LoadError> {
        cfg.dim("moe_intermediate_size", self.moe_intermediate_size)?;
        cfg.count(self.shared_experts_field, self.shared_experts)?;
        cfg.positive("routed_scaling_factor", self.routed_scaling_factor)?;
        let (n, k) = (self.num_experts, self.top_k);
        check_routing(cfg, self.routing_fields, n, k, self.n_group, self.topk_group)
    }

    /// Intermediate size of the shared experts together.
    fn shared_inter(&self) -> usize {
        self.moe_intermediate_size * self.shared_experts
    }

    /// Parameters of one MoE layer over `hidden` (routed and shared experts, router).
    pub(crate) fn params(&self, hidden: usize) -> u128 {
        moe_params(hidden, self.num_experts, self.moe_intermediate_size, self.shared_inter())
    }

    /// Loads the MoE block at `prefix`, its experts' projections named `expert_names`
    /// (`[gate, up, down]`).
    pub(crate) fn load(
        &self,
        w: &dyn WeightSource,
        prefix: &str,
        hidden: usize,
        expert_names: [&str; 3],
    ) -> Result<MoeBlock, LoadError> {
        SigmoidMoe {
            prefix,
            hidden,
            inter: self.moe_intermediate_size,
            expert_names,
            shared_inter: self.shared_inter(),
            routing: Routing {
                num_experts: self.num_experts,
                top_k: self.top_k,
                scoring: Scoring::Sigmoid,
                correction_bias: None,
                n_group: self.n_group,
                topk_group: self.topk_group,
                norm_topk_prob: self.norm_topk_prob,
                scaling: self.routed_scaling_factor as f32,
            },
        }
        .load(w)
    }
}
