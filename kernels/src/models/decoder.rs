//! A loaded model of any family ([`Model`]): the embeddings, the decoder layers (`layer.rs`), the
//! final norm and the LM head, where each layer keeps its per-request memory, the MTP drafter when
//! the checkpoint holds one, and what callers read of its geometry and cost. Families assemble it
//! (`Model::assemble`); a step runs through it in `step.rs`.

use super::family::Family;
use super::layer::{CacheBinding, DecoderLayer, Ffn, ModelCache};
use super::mtp::MtpLayer;
use super::parts::layers::{Linear, RmsNorm};
use crate::checkpoint::{LoadError, WeightSource};
use crate::kv::{PagedKvCache, StatePool};

/// A loaded model of any family. Immutable once built: ranks share it and own their caches.
pub struct Model {
    pub family: Family,
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The longest sequence (prompt + output) the model was trained for, from the config's
    /// `max_position_embeddings` (`None` when the config gives none).
    pub max_positions: Option<usize>,
    /// A hash of the whole config the model was built from (RoPE scaling and every other field
    /// that may change its math; 0 for a model built without one).
    pub config_fingerprint: u64,
    pub(crate) embed: Vec<f32>,
    pub(crate) layers: Vec<DecoderLayer>,
    pub(crate) final_norm: RmsNorm,
    pub(crate) lm_head: Linear,
    /// For each layer, where its per-request memory lives.
    pub(super) bindings: Vec<CacheBinding>,
    state_width: usize,
    /// DeepSeek's multi-token-prediction layer, when the checkpoint holds one (its KV is the
    /// paged cache's last layer).
    pub(crate) mtp: Option<MtpLayer>,
}

impl Model {
    /// Adds the embeddings, final norm and LM head (tied to the embeddings when
    /// `tie_word_embeddings`, in which case no `lm_head.weight` is read) around `layers`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn assemble(
        family: Family,
        model_type: &str,
        w: &dyn WeightSource,
        vocab: usize,
        hidden: usize,
        eps: f32,
        tie_word_embeddings: bool,
        layers: Vec<DecoderLayer>,
    ) -> Result<Model, LoadError> {
        let final_norm = RmsNorm::load(w, "model.norm.weight", hidden, eps)?;
        Self::assemble_with_norm(family, model_type, w, vocab, hidden, final_norm, tie_word_embeddings, layers)
    }

    /// [`Model::assemble`] with a final norm the family built itself.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn assemble_with_norm(
        family: Family,
        model_type: &str,
        w: &dyn WeightSource,
        vocab: usize,
        hidden: usize,
        final_norm: RmsNorm,
        tie_word_embeddings: bool,
        layers: Vec<DecoderLayer>,
    ) -> Result<Model, LoadError> {
        // A model of shapes alone keeps no embeddings; its tied head is a matrix of their shape.
        let embed = if w.shapes_only() { Vec::new() } else { w.tensor("model.embed_tokens.weight", &[vocab, hidden])? };
        let lm_head = if tie_word_embeddings && w.shapes_only() {
            Linear { weight: crate::cpu::gemm::PackedMatrix::shape_only(vocab, hidden), bias: None }
        } else if tie_word_embeddings {
            Linear::from_parts(&embed, vocab, hidden, None)
        } else {
            Linear::load(w, "lm_head", hidden, vocab, false)?
        };
        let (mut next_kv, mut state_width) = (0, 0);
        let bindings = layers
            .iter()
            .map(|l| {
                let kv_layer = l.mixer.kv_row_width().map(|_| {
                    next_kv += 1;
                    next_kv - 1
                });
                let binding = CacheBinding { kv_layer, state_offset: state_width };
                state_width += l.mixer.state_width();
                binding
            })
            .collect();
        Ok(Model {
            config_fingerprint: 0,
            family,
            model_type: model_type.to_string(),
            vocab_size: vocab,
            hidden_size: hidden,
            max_positions: None, // set by `models::build` from the config
            embed,
            final_norm,
            lm_head,
            layers,
            bindings,
            state_width,
            mtp: None,
        })
    }

    /// Loads the MTP layer stored as layer `layer` around `block` (that layer's decoder
    /// tensors), when the checkpoint holds it; its attention gets the paged cache's last layer.
    pub(crate) fn attach_mtp(
        &mut self,
        w: &dyn WeightSource,
        layer: usize,
        eps: f32,
        block: impl FnOnce() -> Result<DecoderLayer, LoadError>,
    ) -> Result<(), LoadError> {
        if !MtpLayer::present(w, layer) {
            return Ok(());
        }
        let binding = CacheBinding { kv_layer: Some(self.kv_row_widths().len()), state_offset: 0 };
        let (hidden, vocab) = (self.hidden_size, self.vocab_size);
        self.mtp = Some(MtpLayer::load(w, layer, hidden, vocab, eps, block()?, binding)?);
        Ok(())
    }

    /// The MTP drafter layer, when the checkpoint holds one.
    pub fn mtp(&self) -> Option<&MtpLayer> {
        self.mtp.as_ref()
    }

    /// The token embeddings `[vocab × hidden]`.
    pub fn embeddings(&self) -> &[f32] {
        &self.embed
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Row widths of the paged cache, one per layer that keeps KV (the MTP layer's last).
    pub fn kv_row_widths(&self) -> Vec<usize> {
        let mtp = self.mtp.as_ref().and_then(|m| m.kv_row_width());
        self.layers.iter().filter_map(|l| l.mixer.kv_row_width()).chain(mtp).collect()
    }

    /// A cache of `num_blocks` blocks of `block_size` tokens for this model.
    pub fn new_cache(
        &self,
        block_size: usize,
        num_blocks: usize,
        num_slots: usize,
        num_snapshots: usize,
    ) -> ModelCache {
        ModelCache {
            kv: PagedKvCache::new(block_size, num_blocks, &self.kv_row_widths()),
            states: StatePool::new(self.state_width, num_slots, num_snapshots),
        }
    }

    /// Floats of recurrent state per request (0 for families without it).
    pub fn state_width(&self) -> usize {
        self.state_width
    }

    /// Layer `l`'s place in the cache: its paged-KV layer, if it keeps one, and the offset of
    /// its state in a slot.
    pub(crate) fn binding(&self, l: usize) -> (Option<usize>, usize) {
        let b = &self.bindings[l];
        (b.kv_layer, b.state_offset)
    }

    /// Whether requests of this model need a state slot.
    pub fn needs_slots(&self) -> bool {
        self.state_width > 0
    }

    /// Whether this model keeps a paged KV cache.
    pub fn needs_blocks(&self) -> bool {
        self.bindings.iter().any(|b| b.kv_layer.is_some())
    }

    /// Bytes of one state slot (or snapshot).
    pub fn state_bytes_per_slot(&self) -> usize {
        self.state_width * std::mem::size_of::<f32>()
    }

    /// The fingerprint of this model's per-rank memory at `block_size` (see
    /// [`crate::kv::layout_fingerprint`]): pools exchange handoffs only when theirs agree.
    pub fn layout_fingerprint(&self, block_size: usize) -> u64 {
        crate::kv::layout_fingerprint(&self.model_type, &self.kv_row_widths(), self.state_width, block_size)
    }

    /// The fingerprint two pools of this model compare before they exchange handoffs: the
    /// layout's, its block size left out (a consumer re-cuts a producer's blocks into its own).
    pub fn handoff_fingerprint(&self) -> u64 {
        self.layout_fingerprint(0)
    }

    /// Bytes of paged cache one block takes (0 for families without paged KV).
    pub fn kv_bytes_per_block(&self, block_size: usize) -> usize {
        PagedKvCache::bytes_per_block(block_size, &self.kv_row_widths())
    }

    /// Whether a request of `prompt_len` tokens that generates `outputs` more fits the model's
    /// context (`max_position_embeddings`); the error says by how much it does not.
    pub fn check_context(&self, prompt_len: usize, outputs: usize) -> Result<(), String> {
        check_context(self.max_positions, prompt_len, outputs)
    }

    /// `Err` naming the first token outside the vocabulary.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<(), String> {
        match tokens.iter().position(|&t| t as usize >= self.vocab_size) {
            Some(i) => {
                Err(format!("token {} at index {i} is outside the vocabulary (size {})", tokens[i], self.vocab_size))
            }
            None => Ok(()),
        }
    }

    /// A fingerprint of the weights (a sample of the embeddings and the final norm): stored KV
    /// computed by one checkpoint is not another's, even of the same geometry.
    pub fn weights_fingerprint(&self) -> u64 {
        let sample = &self.embed[..self.embed.len().min(1 << 14)];
        crate::hash::logits_bits(crate::hash::logits_bits(0, sample), &self.final_norm.weight)
    }

    /// The layers whose feed-forward is a MoE block, with their routed expert counts.
    pub fn moe_layers(&self) -> Vec<(usize, usize)> {
        let moe = |(i, l): (usize, &DecoderLayer)| match &l.ffn {
            Ffn::Moe(m) => Some((i, m.routing.num_experts)),
            Ffn::Dense(_) => None,
        };
        self.layers.iter().enumerate().filter_map(moe).collect()
    }

    /// Bytes of the routed experts' weights this model holds (one rank's share when it was
    /// loaded for an expert-parallel rank).
    pub fn expert_bytes(&self) -> usize {
        let bytes = |l: &DecoderLayer| match &l.ffn {
            Ffn::Moe(m) => m.expert_bytes(),
            Ffn::Dense(_) => 0,
        };
        self.layers.iter().map(bytes).sum()
    }

    /// The experts a token routes to in a MoE layer (the first one's `top_k`; 0 without MoE).
    pub fn experts_per_token(&self) -> usize {
        let top_k = |l: &DecoderLayer| match &l.ffn {
            Ffn::Moe(m) => Some(m.routing.top_k),
            Ffn::Dense(_) => None,
        };
        self.layers.iter().find_map(top_k).unwrap_or(0)
    }

    /// Whether every MoE layer holds all its routed experts (a model loaded whole).
    pub fn holds_every_expert(&self) -> bool {
        self.layers.iter().all(|l| !matches!(&l.ffn, Ffn::Moe(m) if !m.holds_every_expert()))
    }

    /// Multiply-adds per token in the weights (routed MoE counts its `top_k` experts), excluding
    /// the LM head.
    pub fn body_macs_per_token(&self) -> usize {
        self.layers.iter().map(|l| l.mixer.macs_per_row() + l.ffn.macs_per_row()).sum()
    }

    pub fn lm_head_macs(&self) -> usize {
        self.lm_head.macs_per_row()
    }

    /// Attention multiply-adds of one token at context length `ctx` over all layers (for linear
    /// layers, the state update, which does not grow with the context).
    pub fn attention_macs(&self, ctx: usize) -> usize {
        self.layers.iter().map(|l| l.mixer.attention_macs(ctx)).sum()
    }

    /// Shape `(rows, cols)` of the largest weight matrix (the benchmark's GEMM baseline).
    pub fn largest_weight_shape(&self) -> (usize, usize) {
        (self.lm_head.out_dim(), self.lm_head.in_dim())
    }
}

/// Whether `prompt_len` + `outputs` tokens fit a context of `max_positions` (no limit when
/// `None`); the error says by how much they do not.
pub fn check_context(max_positions: Option<usize>, prompt_len: usize, outputs: usize) -> Result<(), String> {
    let total = prompt_len.saturating_add(outputs);
    match max_positions {
        Some(max) if total > max => Err(format!(
            "{prompt_len} prompt tokens + {outputs} output tokens = {total} exceed the model's context of {max} \
             positions (max_position_embeddings)"
        )),
        _ => Ok(()),
    }
}
