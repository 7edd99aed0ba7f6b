//! The decoder stack every family shares: embeddings, then per layer
//! `h += mixer(norm(h)); h += ffn(norm(h))`, then the final norm and the LM head on the rows that
//! asked for logits. Families differ only in their mixers (attention kinds) and feed-forwards.
//!
//! A step can also run in phases, so that an executor launches one [`Phase`] (a range of layers)
//! at a time: [`Model::begin_step`] builds the batch layout and the embeddings into
//! [`StepActivations`], [`Model::run_layers`] advances them through each phase's layers in order,
//! and [`Model::finish_step`] applies the final norm and the LM head. [`Model::forward`] is the
//! three in a row and computes the same bits.
//!
//! Expert parallel, a step stops at every MoE layer instead: [`Model::run_to_experts`] runs on to
//! the next MoE layer's routing and leaves its routed rows in the activations
//! ([`Model::routed`]), the ranks owning the experts run them ([`Model::run_expert`]), and
//! [`Model::combine_experts`] sums their outputs into the hidden state — the same arithmetic, in
//! the same order, as the layer run whole.

use super::batch::{BatchLayout, ForwardOutput, SeqInput};
use super::family::Family;
use super::parts::gated_delta::GatedDeltaNet;
use super::parts::gqa::GqaAttention;
use super::parts::kda::KimiDeltaAttention;
use super::parts::layers::{Linear, Mlp, RmsNorm};
use super::parts::mla::MlaAttention;
use super::parts::moe::MoeBlock;
use crate::checkpoint::{LoadError, WeightSource};
use crate::kv::{PagedKvCache, StatePool};
use std::ops::Range;

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
pub(crate) struct CacheBinding {
    pub(crate) kv_layer: Option<usize>,
    pub(crate) state_offset: usize,
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

/// A range of consecutive decoder layers that an executor launches as one unit of a step.
/// [`Model::phases`] lists a step's phases in launch order; together they cover every layer once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Phase {
    pub name: String,
    pub layers: Range<usize>,
}

/// One step's activations between phases: the batch's layout and the hidden state
/// `[rows × hidden]`. It owns what it holds and borrows neither the batch nor the model, so an
/// executor can keep it between phase launches. Built by [`Model::begin_step`], advanced by
/// [`Model::run_layers`], consumed by [`Model::finish_step`].
pub struct StepActivations {
    layout: BatchLayout,
    hidden: Vec<f32>,
    /// The block size the layout's cache rows were computed for.
    block_size: usize,
    /// Layers `0..layers_done` have run (phases run in order, each layer once).
    layers_done: usize,
    /// Expert parallel: layer `layers_done`'s mixer has run and its MoE rows await their experts.
    pending: Option<PendingMoe>,
}

/// A MoE layer's rows waiting for their experts: the normed input and each row's routes.
pub(crate) struct PendingMoe {
    pub(crate) x: Vec<f32>,
    pub(crate) routes: Vec<Vec<(usize, f32)>>,
}

/// The rows of one step routed at a MoE layer (expert parallel): what dispatch sends.
#[derive(Clone, Copy, Debug)]
pub struct RoutedRows<'a> {
    pub layer: usize,
    pub hidden: usize,
    /// The layer's normed input `[rows × hidden]`.
    pub x: &'a [f32],
    /// Each row's `(expert, weight)` pairs, ascending by expert.
    pub routes: &'a [Vec<(usize, f32)>],
}

impl StepActivations {
    /// The step's per-row facts (positions, sequences, cache rows, slots).
    pub fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    /// The hidden state after the layers run so far, `[rows × hidden]`.
    pub fn hidden(&self) -> &[f32] {
        &self.hidden
    }

    /// How many layers have run: the next phase starts at this layer.
    pub fn layers_done(&self) -> usize {
        self.layers_done
    }
}

/// A loaded model of any family. Immutable once built: ranks share it and own their caches.
pub struct Model {
    pub family: Family,
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The longest sequence (prompt + output) the model was trained for, from the config's
    /// `max_position_embeddings` (`None` when the config gives none).
    pub max_positions: Option<usize>,
    pub(crate) embed: Vec<f32>,
    pub(crate) layers: Vec<DecoderLayer>,
    pub(crate) final_norm: RmsNorm,
    pub(crate) lm_head: Linear,
    /// For each layer, where its per-request memory lives.
    bindings: Vec<CacheBinding>,
    state_width: usize,
    /// DeepSeek's multi-token-prediction layer, when the checkpoint holds one (its KV is the
    /// paged cache's last layer).
    pub(crate) mtp: Option<super::mtp::MtpLayer>,
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
        if !super::mtp::MtpLayer::present(w, layer) {
            return Ok(());
        }
        let binding = CacheBinding { kv_layer: Some(self.kv_row_widths().len()), state_offset: 0 };
        let (hidden, vocab) = (self.hidden_size, self.vocab_size);
        self.mtp = Some(super::mtp::MtpLayer::load(w, layer, hidden, vocab, eps, block()?, binding)?);
        Ok(())
    }

    /// The MTP drafter layer, when the checkpoint holds one.
    pub fn mtp(&self) -> Option<&super::mtp::MtpLayer> {
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

    /// The phases of one step, in launch order. A model without expert parallelism is one phase,
    /// `"forward"`, over all its layers.
    pub fn phases(&self) -> Vec<Phase> {
        vec![Phase { name: "forward".to_string(), layers: 0..self.layers.len() }]
    }

    /// Runs one step over `batch` (see [`SeqInput`]), writing each row's KV into `cache` and
    /// returning the logits asked for. Tokens must be in the vocabulary and block tables must
    /// cover every position fed (the caller's contract; checked in debug builds). The same as
    /// [`Model::begin_step`], [`Model::run_layers`] over every layer, then [`Model::finish_step`].
    pub fn forward(&self, batch: &[SeqInput], cache: &mut ModelCache) -> ForwardOutput {
        let mut acts = self.begin_step(batch, cache.kv.block_size());
        self.run_layers(&mut acts, 0..self.layers.len(), cache);
        self.finish_step(batch, acts)
    }

    /// Starts a step over `batch`: its layout (cache rows for blocks of `block_size` tokens, the
    /// block size of the cache the layers will write) and its embeddings `[t × hidden]`. Panics
    /// if the model keeps recurrent state and a sequence has no slot.
    pub fn begin_step(&self, batch: &[SeqInput], block_size: usize) -> StepActivations {
        let hidden = self.hidden_size;
        let layout = BatchLayout::new(batch, block_size, self.needs_blocks());
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
        StepActivations { layout, hidden: h, block_size, layers_done: 0, pending: None }
    }

    /// Runs decoder layers `layers` over the step, in order, reading and writing `cache`. Phases
    /// must run in order and cover every layer once: `layers` starts where the previous call
    /// ended (at 0 for the first).
    pub fn run_layers(&self, acts: &mut StepActivations, layers: Range<usize>, cache: &mut ModelCache) {
        assert!(
            layers.start == acts.layers_done && layers.start <= layers.end && layers.end <= self.layers.len(),
            "layers {layers:?} cannot run next: layers 0..{} of {} have run",
            acts.layers_done,
            self.layers.len()
        );
        assert!(acts.pending.is_none(), "layer {} awaits its experts", acts.layers_done);
        if self.needs_blocks() {
            assert_eq!(acts.block_size, cache.kv.block_size(), "the step was laid out for another block size");
        }
        // 2. layers
        for (layer, binding) in self.layers[layers.clone()].iter().zip(&self.bindings[layers.clone()]) {
            run_layer(layer, binding, &mut acts.hidden, &acts.layout, cache);
        }
        acts.layers_done = layers.end;
    }

    /// Expert parallel: runs the step on from where it stands, through dense layers whole, up to
    /// the next MoE layer's routing (its mixer, post-attention norm and router), whose rows then
    /// await their experts ([`Model::routed`]). Returns `false` when it ran to the last layer.
    pub fn run_to_experts(&self, acts: &mut StepActivations, cache: &mut ModelCache) -> bool {
        assert!(acts.pending.is_none(), "layer {} awaits its experts", acts.layers_done);
        if self.needs_blocks() {
            assert_eq!(acts.block_size, cache.kv.block_size(), "the step was laid out for another block size");
        }
        while acts.layers_done < self.layers.len() {
            let (layer, binding) = (&self.layers[acts.layers_done], &self.bindings[acts.layers_done]);
            acts.pending = layer.run_to_routing(binding, &mut acts.hidden, &acts.layout, cache);
            if acts.pending.is_some() {
                return true;
            }
            acts.layers_done += 1;
        }
        false
    }

    /// The rows awaiting their experts after [`Model::run_to_experts`] stopped at a MoE layer.
    pub fn routed<'a>(&self, acts: &'a StepActivations) -> Option<RoutedRows<'a>> {
        let p = acts.pending.as_ref()?;
        Some(RoutedRows { layer: acts.layers_done, hidden: self.hidden_size, x: &p.x, routes: &p.routes })
    }

    /// Runs routed expert `expert` of layer `layer` over `n` rows `[n × hidden]`; `None` when
    /// the layer is dense or this model does not hold that expert (another rank's).
    pub fn run_expert(&self, layer: usize, expert: usize, rows: &[f32], n: usize) -> Option<Vec<f32>> {
        match &self.layers.get(layer)?.ffn {
            Ffn::Moe(m) => m.run_expert(expert, rows, n),
            Ffn::Dense(_) => None,
        }
    }

    /// Ends the MoE layer the step stopped at: `expert_out(r, k)` is the output of row `r`'s
    /// `k`-th expert (ascending); each row sums them weighted, adds its shared experts, and the
    /// result is added to the hidden state. The step then stands at the next layer.
    pub fn combine_experts<'y>(&self, acts: &mut StepActivations, expert_out: impl Fn(usize, usize) -> &'y [f32]) {
        let p = acts.pending.take().expect("combine_experts follows run_to_experts");
        let Ffn::Moe(m) = &self.layers[acts.layers_done].ffn else { unreachable!("a pending layer is a MoE layer") };
        let out = m.combine(&p.x, acts.layout.rows, &p.routes, expert_out);
        add_into(&mut acts.hidden, &out);
        acts.layers_done += 1;
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

    /// Whether every MoE layer holds all its routed experts (a model loaded whole).
    pub fn holds_every_expert(&self) -> bool {
        self.layers.iter().all(|l| !matches!(&l.ffn, Ffn::Moe(m) if !m.holds_every_expert()))
    }

    /// Ends a step once every layer has run: the final norm and the LM head on the rows of
    /// `batch` (the batch the step began with) that asked for logits.
    pub fn finish_step(&self, batch: &[SeqInput], acts: StepActivations) -> ForwardOutput {
        self.finish(batch, acts, false)
    }

    /// [`Model::finish_step`], also returning every row's final-normed hidden state
    /// (`ForwardOutput::hidden`: what the MTP drafter reads).
    pub fn finish_step_keeping_hidden(&self, batch: &[SeqInput], acts: StepActivations) -> ForwardOutput {
        self.finish(batch, acts, true)
    }

    fn finish(&self, batch: &[SeqInput], acts: StepActivations, keep_hidden: bool) -> ForwardOutput {
        assert!(
            acts.layers_done == self.layers.len() && acts.pending.is_none(),
            "finish_step before every layer has run"
        );
        assert_eq!(
            batch.iter().map(|s| s.tokens.len()).sum::<usize>(),
            acts.layout.rows,
            "finish_step with another batch than the step began with"
        );
        let hidden = self.hidden_size;
        let mut h = acts.hidden;
        // 3. final norm and LM head on the rows that want logits
        let (rows, wanted) = super::batch::wanted_rows(batch);
        let mut selected = Vec::with_capacity(wanted.len() * hidden);
        for &r in &wanted {
            selected.extend_from_slice(&h[r * hidden..(r + 1) * hidden]);
        }
        self.final_norm.forward_inplace(&mut selected);
        let logits = self.lm_head.forward(&selected, wanted.len());
        let hidden = if keep_hidden {
            // Row by row, the same norm as the selected rows got: the same bits.
            self.final_norm.forward_inplace(&mut h);
            h
        } else {
            Vec::new()
        };
        ForwardOutput { vocab: self.vocab_size, logits, rows, hidden }
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

/// One decoder layer over the step's hidden state: `h += mixer(norm(h)); h += ffn(norm(h))`.
fn run_layer(
    layer: &DecoderLayer,
    binding: &CacheBinding,
    h: &mut [f32],
    layout: &BatchLayout,
    cache: &mut ModelCache,
) {
    let x = layer.attend(binding, h, layout, cache);
    add_into(h, &layer.ffn.forward(&x, layout.rows));
}

impl DecoderLayer {
    /// `h += mixer(norm(h))`; returns the feed-forward's input, `post_norm(h)`.
    fn attend(&self, binding: &CacheBinding, h: &mut [f32], layout: &BatchLayout, cache: &mut ModelCache) -> Vec<f32> {
        let x = self.input_norm.forward(h);
        add_into(h, &self.mixer.forward(&x, layout, cache, binding));
        self.post_norm.forward(h)
    }

    /// The layer up to its experts: a dense feed-forward runs whole (`None`); a MoE block stops
    /// at its routing and returns its input and each row's routes, awaiting the experts.
    pub(crate) fn run_to_routing(
        &self,
        binding: &CacheBinding,
        h: &mut [f32],
        layout: &BatchLayout,
        cache: &mut ModelCache,
    ) -> Option<PendingMoe> {
        let x = self.attend(binding, h, layout, cache);
        match &self.ffn {
            Ffn::Dense(m) => {
                add_into(h, &m.forward(&x, layout.rows));
                None
            }
            Ffn::Moe(m) => {
                let routes = m.route_rows(&x, layout.rows);
                Some(PendingMoe { x, routes })
            }
        }
    }
}

pub(crate) fn add_into(h: &mut [f32], delta: &[f32]) {
    for (a, b) in h.iter_mut().zip(delta) {
        *a += b;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::ModelSpec;
    use crate::kv::SlotId;
    use crate::models::LogitsWanted;

    /// Grouped-query attention only.
    const LLAMA: &str = r#"
model_type = "llama"
seed = 3
vocab_size = 64
hidden_size = 32
intermediate_size = 48
num_hidden_layers = 3
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 8
"#;

    /// Latent attention with the sparse indexer (top-4 of up to 8 keys), dense then MoE layers.
    const DEEPSEEK_V32: &str = r#"
model_type = "deepseek_v32"
seed = 5
vocab_size = 64
hidden_size = 32
intermediate_size = 48
moe_intermediate_size = 16
num_hidden_layers = 3
num_attention_heads = 2
q_lora_rank = 16
kv_lora_rank = 16
qk_nope_head_dim = 8
qk_rope_head_dim = 8
v_head_dim = 8
n_routed_experts = 4
num_experts_per_tok = 2
n_shared_experts = 1
first_k_dense_replace = 1
index_topk = 4
index_n_heads = 2
index_head_dim = 16
"#;

    /// Gated DeltaNet layers with a gated attention layer every second layer, MoE feed-forwards.
    const QWEN3_NEXT: &str = r#"
model_type = "qwen3_next"
seed = 7
vocab_size = 64
hidden_size = 32
intermediate_size = 48
num_hidden_layers = 4
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 8
full_attention_interval = 2
linear_key_head_dim = 8
linear_value_head_dim = 8
linear_num_key_heads = 2
linear_num_value_heads = 4
num_experts = 4
num_experts_per_tok = 2
moe_intermediate_size = 16
shared_expert_intermediate_size = 16
"#;

    /// Kimi Delta Attention layers around a NoPE latent attention layer.
    const KIMI_LINEAR: &str = r#"
model_type = "kimi_linear"
seed = 9
vocab_size = 64
hidden_size = 32
intermediate_size = 48
num_hidden_layers = 3
num_attention_heads = 2
kv_lora_rank = 16
qk_nope_head_dim = 8
qk_rope_head_dim = 8
v_head_dim = 8
num_experts = 4
num_experts_per_token = 2
moe_intermediate_size = 16
linear_num_heads = 2
linear_head_dim = 8
layer_types = ["linear_attention", "full_attention", "linear_attention"]
"#;

    const BLOCK: usize = 4;

    fn model(spec: &str) -> Model {
        let spec = ModelSpec::parse("spec.toml".into(), spec).unwrap();
        crate::models::build(&spec.config, &spec.weights).unwrap()
    }

    fn bits(logits: &[f32]) -> Vec<u32> {
        logits.iter().map(|v| v.to_bits()).collect()
    }

    /// Runs a prefill step of two sequences, then a decode step of both, once with `forward` and
    /// once phase by phase (`[0..1, 1..n]` for the prefill, one layer per phase for the decode),
    /// each on its own cache, and asserts the logits agree bit for bit.
    fn assert_split_steps_match_forward(spec: &str) {
        let model = model(spec);
        let n = model.num_layers();
        assert!(n >= 3, "the splits below need at least three layers");
        let mut whole = model.new_cache(BLOCK, 8, 2, 0);
        let mut phased = model.new_cache(BLOCK, 8, 2, 0);
        // Slots 0 and 1 (a new store holds the zero state).
        let slots: Vec<Option<SlotId>> = (0..2).map(|i| model.needs_slots().then_some(i)).collect();
        let tables: [&[u32]; 2] = [&[0, 1, 2], &[3, 4, 5]];
        let prompts: [Vec<u32>; 2] = [(0..7).map(|i| (i * 5 + 1) % 64).collect(), (0..5).map(|i| i * 11 + 2).collect()];
        let prefill = [
            SeqInput {
                tokens: &prompts[0],
                start_pos: 0,
                block_table: tables[0],
                slot: slots[0],
                prompt_len: prompts[0].len(),
                logits: LogitsWanted::All,
            },
            SeqInput {
                tokens: &prompts[1],
                start_pos: 0,
                block_table: tables[1],
                slot: slots[1],
                prompt_len: prompts[1].len(),
                logits: LogitsWanted::Last,
            },
        ];
        let decode = [
            SeqInput { tokens: &[9], start_pos: 7, logits: LogitsWanted::Last, ..prefill[0] },
            SeqInput { tokens: &[17], start_pos: 5, ..prefill[1] },
        ];
        let per_layer: Vec<Range<usize>> = (0..n).map(|l| l..l + 1).collect();
        for (batch, phases) in [(&prefill[..], vec![0..1, 1..n]), (&decode[..], per_layer)] {
            let want = model.forward(batch, &mut whole);
            let mut acts = model.begin_step(batch, BLOCK);
            for layers in phases {
                model.run_layers(&mut acts, layers, &mut phased);
            }
            let got = model.finish_step(batch, acts);
            assert_eq!(got.rows, want.rows);
            assert!(!got.logits.is_empty());
            assert_eq!(bits(&got.logits), bits(&want.logits), "{}: phased logits differ", model.model_type);
        }
    }

    #[test]
    fn split_steps_match_forward_bit_for_bit_on_llama() {
        assert_split_steps_match_forward(LLAMA);
    }

    #[test]
    fn split_steps_match_forward_bit_for_bit_on_deepseek_v32() {
        assert_split_steps_match_forward(DEEPSEEK_V32);
    }

    #[test]
    fn split_steps_match_forward_bit_for_bit_on_qwen3_next() {
        assert_split_steps_match_forward(QWEN3_NEXT);
    }

    #[test]
    fn split_steps_match_forward_bit_for_bit_on_kimi_linear() {
        assert_split_steps_match_forward(KIMI_LINEAR);
    }

    #[test]
    fn a_model_without_expert_parallelism_is_one_forward_phase() {
        let model = model(LLAMA);
        assert_eq!(model.phases(), vec![Phase { name: "forward".to_string(), layers: 0..3 }]);
    }

    #[test]
    fn step_activations_borrow_nothing_and_can_cross_threads() {
        fn owned_and_send<T: Send + 'static>() {}
        owned_and_send::<StepActivations>();
    }

    #[test]
    #[should_panic(expected = "cannot run next")]
    fn layers_run_out_of_order_are_refused() {
        let model = model(LLAMA);
        let mut cache = model.new_cache(BLOCK, 2, 0, 0);
        let batch = [SeqInput {
            tokens: &[1, 2],
            start_pos: 0,
            block_table: &[0],
            slot: None,
            prompt_len: 2,
            logits: LogitsWanted::Last,
        }];
        let mut acts = model.begin_step(&batch, BLOCK);
        model.run_layers(&mut acts, 1..3, &mut cache);
    }
}
