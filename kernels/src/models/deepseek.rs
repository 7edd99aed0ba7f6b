//! Families `mla` and `sparse_mla`: DeepSeek-V3 (`model_type` deepseek_v3) and DeepSeek-V3.2
//! (deepseek_v32). Every layer is multi-head latent attention
//! ([`MlaAttention`](super::parts::mla::MlaAttention)) with interleaved RoPE on the rope dims,
//! then a dense SwiGLU MLP for the first layers and a sigmoid-routed MoE with shared experts
//! after. V3.2 adds to each layer's attention the DSA indexer
//! ([`Indexer`](super::parts::indexer::Indexer)), which picks the keys each query attends to, and
//! may list each layer's feed-forward kind in `mlp_layer_types`. Config fields are named as in
//! `config.json`.

use super::config::check_silu;
use super::decoder::{DecoderLayer, Ffn, Mixer, Model};
use super::family::Family;
use super::parts::indexer::{load_indexer, IndexerDims};
use super::parts::layers::{Mlp, RmsNorm};
use super::parts::mla::{load_mla, MlaDims};
use super::parts::moe::{MoeBlock, Routing, Scoring, SigmoidMoe};
use crate::checkpoint::{parse_rope, ConfigSource, LoadError, WeightSource};
use crate::cpu::rope::{Rope, RopeStyle};
use serde::Deserialize;

/// The `config.json` fields of deepseek_v3 and deepseek_v32.
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub n_shared_experts: Option<usize>,
    #[serde(default = "super::config::one")]
    pub n_group: usize,
    #[serde(default = "super::config::one")]
    pub topk_group: usize,
    #[serde(default = "super::config::yes")]
    pub norm_topk_prob: bool,
    #[serde(default = "super::config::one_f64")]
    pub routed_scaling_factor: f64,
    #[serde(default)]
    pub first_k_dense_replace: usize,
    #[serde(default = "super::config::yes")]
    pub rope_interleave: bool,
    #[serde(default = "super::config::rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// deepseek_v32: per-layer `dense` / `sparse` (else `first_k_dense_replace` decides).
    #[serde(default)]
    pub mlp_layer_types: Option<Vec<String>>,
    // deepseek_v32's indexer
    pub index_topk: Option<usize>,
    pub index_n_heads: Option<usize>,
    pub index_head_dim: Option<usize>,
}

/// Builds a deepseek_v3 model, or (with `sparse`) a deepseek_v32 one, whose attention layers add
/// the indexer.
pub fn build(cfg: &ConfigSource, w: &dyn WeightSource, sparse: bool) -> Result<Model, LoadError> {
    let c: Config = cfg.family_config()?;
    check_silu(cfg, &c.hidden_act)?;
    let hidden = c.hidden_size;
    let eps = c.rms_norm_eps as f32;
    if c.n_group == 0 || c.n_routed_experts % c.n_group != 0 {
        return Err(
            cfg.error("n_group", format!("{} does not divide n_routed_experts {}", c.n_group, c.n_routed_experts))
        );
    }
    if c.topk_group > c.n_group || c.num_experts_per_tok > c.n_routed_experts {
        return Err(cfg.error("topk_group", "more groups or experts chosen than exist"));
    }
    // transformers sets head_dim = qk_rope_head_dim for the rotary embedding.
    let rope_params = parse_rope(cfg)?;
    let (inv_freq, attention_scaling) = rope_params.inv_freq(c.qk_rope_head_dim, c.qk_rope_head_dim);
    let style = if c.rope_interleave { RopeStyle::Interleaved } else { RopeStyle::Neox };
    let rope = Rope::new(inv_freq, attention_scaling, style);
    let scale = ((c.qk_nope_head_dim + c.qk_rope_head_dim) as f32).powf(-0.5) * rope_params.softmax_scale_correction();
    let index_dims = if sparse { Some(indexer_dims(cfg, &c)?) } else { None };
    let dense = mlp_is_dense(cfg, &c, sparse)?;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for (l, &is_dense) in dense.iter().enumerate() {
        let p = format!("model.layers.{l}");
        let indexer = match index_dims {
            Some(d) => {
                // The indexer's rope rotates half-split, with the main rope's frequencies.
                let (inv, s) = rope_params.inv_freq(c.qk_rope_head_dim, c.qk_rope_head_dim);
                Some(load_indexer(w, &format!("{p}.self_attn"), d, Rope::new(inv, s, RopeStyle::Neox))?)
            }
            None => None,
        };
        let attn =
            load_mla(w, &format!("{p}.self_attn"), dims(&c), c.attention_bias, Some(rope.clone()), indexer, scale)?;
        let ffn = if is_dense {
            Ffn::Dense(Mlp::load(w, &format!("{p}.mlp"), hidden, c.intermediate_size, false)?)
        } else {
            Ffn::Moe(Box::new(deepseek_moe(w, &format!("{p}.mlp"), &c)?))
        };
        layers.push(DecoderLayer {
            input_norm: RmsNorm::load(w, &format!("{p}.input_layernorm.weight"), hidden, eps)?,
            mixer: Mixer::Mla(Box::new(attn)),
            post_norm: RmsNorm::load(w, &format!("{p}.post_attention_layernorm.weight"), hidden, eps)?,
            ffn,
        });
    }
    let family = if sparse { Family::SparseMla } else { Family::Mla };
    Model::assemble(family, &c.model_type, w, c.vocab_size, hidden, eps, c.tie_word_embeddings, layers)
}

fn indexer_dims(cfg: &ConfigSource, c: &Config) -> Result<IndexerDims, LoadError> {
    let need = |v: Option<usize>, field: &str| {
        v.ok_or_else(|| cfg.error(field, "missing (deepseek_v32 needs the indexer sizes)"))
    };
    let head_dim = need(c.index_head_dim, "index_head_dim")?;
    if head_dim < c.qk_rope_head_dim {
        return Err(cfg.error("index_head_dim", "smaller than qk_rope_head_dim"));
    }
    Ok(IndexerDims {
        hidden: c.hidden_size,
        q_lora_rank: c
            .q_lora_rank
            .ok_or_else(|| cfg.error("q_lora_rank", "deepseek_v32's indexer reads the q LoRA latent"))?,
        heads: need(c.index_n_heads, "index_n_heads")?,
        head_dim,
        topk: need(c.index_topk, "index_topk")?,
    })
}

/// Whether each layer's feed-forward is dense (else MoE). deepseek_v32 reads `mlp_layer_types`;
/// deepseek_v3 only `first_k_dense_replace`, as transformers does.
fn mlp_is_dense(cfg: &ConfigSource, c: &Config, sparse: bool) -> Result<Vec<bool>, LoadError> {
    match c.mlp_layer_types.as_ref().filter(|_| sparse) {
        Some(types) => {
            if types.len() != c.num_hidden_layers {
                return Err(
                    cfg.error("mlp_layer_types", format!("{} entries for {} layers", types.len(), c.num_hidden_layers))
                );
            }
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
        None => Ok((0..c.num_hidden_layers).map(|l| l < c.first_k_dense_replace).collect()),
    }
}

fn dims(c: &Config) -> MlaDims {
    MlaDims {
        hidden: c.hidden_size,
        heads: c.num_attention_heads,
        q_lora_rank: c.q_lora_rank,
        kv_lora: c.kv_lora_rank,
        nope: c.qk_nope_head_dim,
        rope_dim: c.qk_rope_head_dim,
        v_dim: c.v_head_dim,
    }
}

fn deepseek_moe(w: &dyn WeightSource, prefix: &str, c: &Config) -> Result<MoeBlock, LoadError> {
    SigmoidMoe {
        prefix,
        hidden: c.hidden_size,
        inter: c.moe_intermediate_size,
        expert_names: ["gate_proj", "up_proj", "down_proj"],
        shared_inter: c.moe_intermediate_size * c.n_shared_experts.unwrap_or(0),
        routing: Routing {
            num_experts: c.n_routed_experts,
            top_k: c.num_experts_per_tok,
            scoring: Scoring::Sigmoid,
            correction_bias: None,
            n_group: c.n_group,
            topk_group: c.topk_group,
            norm_topk_prob: c.norm_topk_prob,
            scaling: c.routed_scaling_factor as f32,
        },
    }
    .load(w)
}
