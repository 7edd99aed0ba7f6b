//! A step of a [`Model`] over a batch: the embeddings, then per layer
//! `h += mixer(norm(h)); h += ffn(norm(h))` (`layer.rs`), then the final norm and the LM head on the
//! rows that asked for logits.
//!
//! A step can run in phases, so that an executor launches one [`Phase`] (a range of layers)
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
use super::decoder::Model;
use super::layer::{add_into, run_layer, Ffn, ModelCache, PendingMoe, RoutedRows};
use std::ops::Range;

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

impl Model {
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
