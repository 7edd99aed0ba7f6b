//! Families `mla` and `sparse_mla`: DeepSeek-V3 (`model_type` deepseek_v3) and DeepSeek-V3.2
//! (deepseek_v32). Every layer is multi-head latent attention
//! ([`MlaAttention`](super::parts::mla::MlaAttention)) with interleaved RoPE on the rope dims,
//! then a dense SwiGLU MLP for the first layers and a sigmoid-routed MoE with shared experts
//! after. V3.2 adds to each layer's attention the DSA indexer
//! ([`Indexer`](super::parts::indexer::Indexer)), which picks the keys each query attends to, and
//! may list each layer's feed-forward kind in `mlp_layer_types`. Config fields are named as in
//! `config.json`.

use super::config::{checked_rope, RoutingFields};
use super::decoder::Model;
use super::family::Family;
use super::layer::{DecoderLayer, Ffn, Mixer};
use super::mla_moe::{MlaStack, SigmoidMoeConfig};
use super::parts::indexer::{load_indexer, IndexerDims};
use super::parts::layers::{Mlp, RmsNorm};
use super::parts::mla::{load_mla, MlaDims};
use super::size::ModelSize;
use crate::checkpoint::{parse_rope, ConfigSource, LoadError, WeightSource, ROPE_KEYS};
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
    /// MTP layers stored after the decoder stack (the first is loaded as a drafter when its
    /// tensors are present).
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
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

impl Config {
    /// Reads the fields and checks every one the math depends on, before any weight is read;
    /// `sparse` for deepseek_v32 (the indexer's fields, `mlp_layer_types`).
    pub fn read(cfg: &ConfigSource, sparse: bool) -> Result<Self, LoadError> {
        let c: Config = cfg.family_config(ROPE_KEYS)?;
        c.validate(cfg, sparse)?;
        Ok(c)
    }

    fn validate(&self, cfg: &ConfigSource, sparse: bool) -> Result<(), LoadError> {
        let stack = self.stack(sparse);
        stack.check(cfg)?;
        if stack.mlp_is_dense(cfg)?.contains(&false) {
            self.moe().check(cfg)?;
        }
        // transformers sets head_dim = qk_rope_head_dim for the rotary embedding.
        checked_rope(cfg, "qk_rope_head_dim", self.qk_rope_head_dim, self.qk_rope_head_dim)?;
        if sparse {
            indexer_dims(cfg, self)?;
        }
        Ok(())
    }

    /// The parameters of this config's model, by term.
    pub fn size(&self, cfg: &ConfigSource, sparse: bool) -> Result<ModelSize, LoadError> {
        let (layers, hidden) = (self.num_hidden_layers, self.hidden_size);
        let dense = self.stack(sparse).mlp_is_dense(cfg)?.iter().filter(|d| **d).count();
        let experts = self.moe().params(hidden);
        let mut size = ModelSize::default();
        size.add("vocab_size × hidden_size × 2 (embeddings, LM head)", self.vocab_size, 2 * hidden as u128)
            .add(
                "num_hidden_layers × latent attention (num_attention_heads, q_lora_rank, kv_lora_rank, head dims)",
                layers,
                dims(self).params(),
            )
            .add(
                "dense layers × 3 × hidden_size × intermediate_size (MLP)",
                dense,
                3 * hidden as u128 * self.intermediate_size as u128,
            )
            .add(
                "MoE layers × n_routed_experts × 3 × hidden_size × moe_intermediate_size (experts)",
                layers - dense,
                experts,
            )
            .add("num_hidden_layers × 2 × hidden_size (norms)", layers, 2 * hidden as u128);
        if sparse {
            size.add(
                "num_hidden_layers × indexer (index_n_heads, index_head_dim)",
                layers,
                indexer_dims(cfg, self)?.params(),
            );
        }
        Ok(size)
    }

    /// The stack's fields as both latent-attention families read them; deepseek_v32 alone reads
    /// `mlp_layer_types` (deepseek_v3 only `first_k_dense_replace`, as transformers does).
    fn stack(&self, sparse: bool) -> MlaStack<'_> {
        MlaStack {
            hidden_act: &self.hidden_act,
            vocab_size: self.vocab_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            first_k_dense_replace: self.first_k_dense_replace,
            rms_norm_eps: self.rms_norm_eps,
            mlp_layer_types: self.mlp_layer_types.as_deref().filter(|_| sparse),
            mla: dims(self),
        }
    }

    /// The MoE layers under DeepSeek's names.
    fn moe(&self) -> SigmoidMoeConfig {
        SigmoidMoeConfig {
            routing_fields: ROUTING_FIELDS,
            shared_experts_field: "n_shared_experts",
            moe_intermediate_size: self.moe_intermediate_size,
            num_experts: self.n_routed_experts,
            top_k: self.num_experts_per_tok,
            n_group: self.n_group,
            topk_group: self.topk_group,
            shared_experts: self.n_shared_experts.unwrap_or(0),
            norm_topk_prob: self.norm_topk_prob,
            routed_scaling_factor: self.routed_scaling_factor,
        }
    }
}

/// The fields of DeepSeek's expert routing.
const ROUTING_FIELDS: RoutingFields = ["n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"];

/// Builds a deepseek_v3 model, or (with `sparse`) a deepseek_v32 one, whose attention layers add
/// the indexer.
pub fn build(cfg: &ConfigSource, w: &dyn WeightSource, sparse: bool) -> Result<Model, LoadError> {
    let c = Config::read(cfg, sparse)?;
    let hidden = c.hidden_size;
    let eps = c.rms_norm_eps as f32;
    let rope_params = parse_rope(cfg)?;
    let (inv_freq, attention_scaling) = rope_params.inv_freq(c.qk_rope_head_dim, c.qk_rope_head_dim);
    let style = if c.rope_interleave { RopeStyle::Interleaved } else { RopeStyle::Neox };
    let rope = Rope::new(inv_freq, attention_scaling, style);
    let scale = ((c.qk_nope_head_dim + c.qk_rope_head_dim) as f32).powf(-0.5) * rope_params.softmax_scale_correction();
    let index_dims = if sparse { Some(indexer_dims(cfg, &c)?) } else { None };
    let dense = c.stack(sparse).mlp_is_dense(cfg)?;
    let layer = |l: usize, is_dense: bool| -> Result<DecoderLayer, LoadError> {
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
            Ffn::Moe(Box::new(c.moe().load(w, &format!("{p}.mlp"), hidden, ["gate_proj", "up_proj", "down_proj"])?))
        };
        Ok(DecoderLayer {
            input_norm: RmsNorm::load(w, &format!("{p}.input_layernorm.weight"), hidden, eps)?,
            mixer: Mixer::Mla(Box::new(attn)),
            post_norm: RmsNorm::load(w, &format!("{p}.post_attention_layernorm.weight"), hidden, eps)?,
            ffn,
        })
    };
    let layers = dense.iter().enumerate().map(|(l, &is_dense)| layer(l, is_dense)).collect::<Result<_, _>>()?;
    let family = if sparse { Family::SparseMla } else { Family::Mla };
    let mut model =
        Model::assemble(family, &c.model_type, w, c.vocab_size, hidden, eps, c.tie_word_embeddings, layers)?;
    if c.num_nextn_predict_layers > 0 {
        // The MTP layer's block is built like layer L of the stack (MoE past the dense ones).
        let l = c.num_hidden_layers;
        model.attach_mtp(w, l, eps, || layer(l, l < c.first_k_dense_replace || c.n_routed_experts == 0))?;
    }
    Ok(model)
}

fn indexer_dims(cfg: &ConfigSource, c: &Config) -> Result<IndexerDims, LoadError> {
    let need = |v: Option<usize>, field: &str| {
        let v = v.ok_or_else(|| cfg.error(field, "missing (deepseek_v32 needs the indexer sizes)"))?;
        cfg.dim(field, v)
    };
    let head_dim = need(c.index_head_dim, "index_head_dim")?;
    cfg.at_most("qk_rope_head_dim", c.qk_rope_head_dim, "index_head_dim", head_dim)?;
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
