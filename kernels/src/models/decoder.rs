//! The decoder stack every family shares: embeddings, then per layer
//! `h += mixer(norm(h)); h += ffn(norm(h))`, then the final norm and the LM head on the rows that
//! asked for logits. Families differ only in their mixers (attention kinds) and feed-forwards.

use super::batch::{BatchLayout, ForwardOutput, LogitsWanted, SeqInput};
use super::family::Family;
use super::parts::gated_delta::GatedDeltaNet;
use super::parts::gqa::GqaAttention;
use super::parts::kda::KimiDeltaAttention;
use super::parts::layers::{Linear, Mlp, RmsNorm};
use super::parts::mla::MlaAttention;
use super::parts::moe::MoeBlock;
use crate::checkpoint::{LoadError, WeightSource};
use crate::kv::{PagedKvCache, StatePool};

/// A layer's token mixer: attention over the paged cache, or linear attention over a state slot.
pub enum Mixer {
    Gqa(GqaAttention),
    Mla(Box<MlaAttention>),
    Gdn(GatedDeltaNet),
    Kda(KimiDeltaAttention),
}

impl Mixer {
    /// Width of this layer's paged-cache row, if it keeps one.
    pub fn kv_row_width(&self) -> Option<usize> {
        match self {
            Mixer::Gqa(a) => Some(a.kv_row_width()),
            Mixer::Mla(a) => Some(a.kv_row_width()),
            Mixer::Gdn(_) | Mixer::Kda(_) => None,
        }
    }

    /// Floats of per-request state this layer keeps in a slot (0 for attention).
    pub fn state_width(&self) -> usize {
        match self {
            Mixer::Gqa(_) | Mixer::Mla(_) => 0,
            Mixer::Gdn(m) => m.state_width(),
            Mixer::Kda(m) => m.state_width(),
        }
    }

    fn forward(&self, x: &[f32], layout: &BatchLayout, cache: &mut ModelCache, at: &CacheBinding) -> Vec<f32> {
        match (self, at.kv_layer) {
            (Mixer::Gqa(a), Some(k)) => a.forward(x, layout, cache.kv.layer_mut(k)),
            (Mixer::Mla(a), Some(k)) => a.forward(x, layout, cache.kv.layer_mut(k)),
            (Mixer::Gdn(m), None) => m.forward(x, layout, &mut cache.states, at.state_offset),
            (Mixer::Kda(m), None) => m.forward(x, layout, &mut cache.states, at.state_offset),
            _ => unreachable!("cache bindings follow the mixer kinds"),
        }
    }

    fn macs_per_row(&self) -> usize {
        match self {
            Mixer::Gqa(a) => a.macs_per_row(),
            Mixer::Mla(a) => a.macs_per_row(),
            Mixer::Gdn(m) => m.macs_per_row(),
            Mixer::Kda(m) => m.macs_per_row(),
        }
    }

    fn attention_macs(&self, ctx: usize) -> usize {
        match self {
            Mixer::Gqa(a) => a.attention_macs(ctx),
            Mixer::Mla(a) => a.attention_macs(ctx),
            Mixer::Gdn(m) => m.state_macs(),
            Mixer::Kda(m) => m.state_macs(),
        }
    }
}

/// Where a layer keeps its per-request memory: a layer of the paged cache, or a range of the
/// state slot.
#[derive(Clone, Copy, Debug)]
struct CacheBinding {
    kv_layer: Option<usize>,
    state_offset: usize,
}

/// A layer's feed-forward.
pub enum Ffn {
    Dense(Mlp),
    Moe(Box<MoeBlock>),
}

impl Ffn {
    fn forward(&self, x: &[f32], t: usize) -> Vec<f32> {
        match self {
            Ffn::Dense(m) => m.forward(x, t),
            Ffn::Moe(m) => m.forward(x, t),
        }
    }

    fn macs_per_row(&self) -> usize {
        match self {
            Ffn::Dense(m) => m.macs_per_row(),
            Ffn::Moe(m) => m.macs_per_row(),
        }
    }
}

pub struct DecoderLayer {
    pub input_norm: RmsNorm,
    pub mixer: Mixer,
    pub post_norm: RmsNorm,
    pub ffn: Ffn,
}

/// Per-rank mutable memory a model reads and writes: the paged KV cache, and the state slots and
/// snapshots of its linear-attention layers.
pub struct ModelCache {
    pub kv: PagedKvCache,
    pub states: StatePool,
}

/// A loaded model of any family. Immutable once built: ranks share it and own their caches.
pub struct Model {
    pub family: Family,
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    embed: Vec<f32>,
    layers: Vec<DecoderLayer>,
    final_norm: RmsNorm,
    lm_head: Linear,
    /// For each layer, where its per-request memory lives.
    bindings: Vec<CacheBinding>,
    state_width: usize,
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
        let embed = w.tensor("model.embed_tokens.weight", &[vocab, hidden])?;
        let lm_head = if tie_word_embeddings {
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
            family,
            model_type: model_type.to_string(),
            vocab_size: vocab,
            hidden_size: hidden,
            embed,
            final_norm,
            lm_head,
            layers,
            bindings,
            state_width,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Row widths of the paged cache, one per layer that keeps KV.
    pub fn kv_row_widths(&self) -> Vec<usize> {
        self.layers.iter().filter_map(|l| l.mixer.kv_row_width()).collect()
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

    /// Bytes of paged cache one block takes (0 for families without paged KV).
    pub fn kv_bytes_per_block(&self, block_size: usize) -> usize {
        PagedKvCache::bytes_per_block(block_size, &self.kv_row_widths())
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

    /// Runs one step over `batch` (see [`SeqInput`]), writing each row's KV into `cache` and
    /// returning the logits asked for. Tokens must be in the vocabulary and block tables must
    /// cover every position fed (the caller's contract; checked in debug builds).
    pub fn forward(&self, batch: &[SeqInput], cache: &mut ModelCache) -> ForwardOutput {
        let hidden = self.hidden_size;
        let layout = BatchLayout::new(batch, cache.kv.block_size(), self.needs_blocks());
        let t = layout.rows;
        // 1. embeddings                                            [t × hidden]
        let mut h = Vec::with_capacity(t * hidden);
        for s in batch {
            for &tok in s.tokens {
                debug_assert!((tok as usize) < self.vocab_size);
                h.extend_from_slice(&self.embed[tok as usize * hidden..(tok as usize + 1) * hidden]);
            }
        }
        if self.needs_slots() {
            assert!(batch.iter().all(|s| s.slot.is_some()), "{} needs a state slot for every sequence", self.family);
        }
        // 2. layers
        for (layer, binding) in self.layers.iter().zip(&self.bindings) {
            let x = layer.input_norm.forward(&h);
            let mixed = layer.mixer.forward(&x, &layout, cache, binding);
            add_into(&mut h, &mixed);
            let x = layer.post_norm.forward(&h);
            add_into(&mut h, &layer.ffn.forward(&x, t));
        }
        // 3. final norm and LM head on the rows that want logits
        let mut wanted = Vec::new();
        let mut rows = Vec::with_capacity(batch.len());
        let mut first_row = 0;
        for s in batch {
            let start = wanted.len();
            match s.logits {
                LogitsWanted::None => {}
                LogitsWanted::Last => wanted.push(first_row + s.tokens.len() - 1),
                LogitsWanted::All => wanted.extend(first_row..first_row + s.tokens.len()),
            }
            rows.push(start..wanted.len());
            first_row += s.tokens.len();
        }
        let mut selected = Vec::with_capacity(wanted.len() * hidden);
        for &r in &wanted {
            selected.extend_from_slice(&h[r * hidden..(r + 1) * hidden]);
        }
        self.final_norm.forward_inplace(&mut selected);
        let logits = self.lm_head.forward(&selected, wanted.len());
        ForwardOutput { vocab: self.vocab_size, logits, rows }
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

fn add_into(h: &mut [f32], delta: &[f32]) {
    for (a, b) in h.iter_mut().zip(delta) {
        *a += b;
    }
}
