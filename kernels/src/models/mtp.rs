//! DeepSeek's multi-token-prediction (MTP) layer, used as a drafter. DeepSeek-V3 checkpoints store
//! it as layer `num_hidden_layers` (`model.layers.{L}.enorm`, `.hnorm`, `.eh_proj`,
//! `.shared_head.norm`, `.shared_head.head` and the usual decoder-layer tensors); transformers
//! drops it, so there is no oracle here: its correctness shows through exact verification (a
//! draft only ever proposes) and through self-consistency (its KV handed off equals its KV
//! recomputed).
//!
//! At position `i`, with the target's final-normed hidden state `h_i` and the token at `i + 1`:
//! `x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])`, one decoder layer over `x` (its attention
//! reads and writes its own layer of the paged cache at position `i`), then
//! `shared_head.head(shared_head.norm(·))` gives logits for the token at `i + 2`. Chained drafts
//! feed the layer's own output hidden state back as `h`.

use super::batch::{BatchLayout, ForwardOutput, SeqInput};
use super::layer::{add_into, CacheBinding, DecoderLayer, Ffn, ModelCache, PendingMoe, RoutedRows};
use super::parts::layers::{Linear, RmsNorm};
use crate::checkpoint::{LoadError, WeightSource};

pub struct MtpLayer {
    pub(crate) enorm: RmsNorm,
    pub(crate) hnorm: RmsNorm,
    /// `[hidden × 2·hidden]`: the normed embedding, then the normed hidden state.
    pub(crate) eh_proj: Linear,
    pub(crate) block: DecoderLayer,
    pub(crate) head_norm: RmsNorm,
    pub(crate) head: Linear,
    pub(crate) binding: CacheBinding,
}

/// One MTP pass's output: logits rows (as a step's, per sequence) and the block's output hidden
/// state of every row `[rows × hidden]` (what a chained draft feeds back).
pub struct MtpOutput {
    pub logits: ForwardOutput,
    pub hidden: Vec<f32>,
}

impl MtpLayer {
    /// Whether the checkpoint holds an MTP layer at index `layer`.
    pub fn present(w: &dyn WeightSource, layer: usize) -> bool {
        w.contains(&format!("model.layers.{layer}.eh_proj.weight"))
    }

    /// Loads the MTP tensors of layer `layer` around `block` (built from the same layer's
    /// decoder tensors), its attention bound to `binding`.
    pub(crate) fn load(
        w: &dyn WeightSource,
        layer: usize,
        hidden: usize,
        vocab: usize,
        eps: f32,
        block: DecoderLayer,
        binding: CacheBinding,
    ) -> Result<Self, LoadError> {
        let p = format!("model.layers.{layer}");
        Ok(MtpLayer {
            enorm: RmsNorm::load(w, &format!("{p}.enorm.weight"), hidden, eps)?,
            hnorm: RmsNorm::load(w, &format!("{p}.hnorm.weight"), hidden, eps)?,
            eh_proj: Linear::load(w, &format!("{p}.eh_proj"), 2 * hidden, hidden, false)?,
            block,
            head_norm: RmsNorm::load(w, &format!("{p}.shared_head.norm.weight"), hidden, eps)?,
            head: Linear::load(w, &format!("{p}.shared_head.head"), hidden, vocab, false)?,
            binding,
        })
    }

    pub(crate) fn kv_row_width(&self) -> Option<usize> {
        self.block.mixer.kv_row_width()
    }

    /// Runs the layer over `batch`: each sequence's `tokens` are the successor tokens of its
    /// positions `start_pos..` (the token at `i + 1` for position `i`), and `hidden` holds the
    /// matching rows of `h` `[rows × hidden]`, in batch order. Writes the layer's KV at those
    /// positions; returns the logits the batch asks for and every row's output hidden state.
    /// The same arithmetic as [`MtpLayer::begin`], the experts, then [`MtpLayer::finish`].
    pub fn forward(&self, embed: &[f32], batch: &[SeqInput], hidden: &[f32], cache: &mut ModelCache) -> MtpOutput {
        let acts = self.begin(embed, batch, hidden, cache);
        self.finish_local(acts)
    }

    /// [`MtpLayer::finish`] with this model's own experts (it holds them all).
    pub fn finish_local(&self, mut acts: MtpActs) -> MtpOutput {
        if let (Some(p), Ffn::Moe(m)) = (acts.pending.take(), &self.block.ffn) {
            add_into(&mut acts.h, &m.forward(&p.x, acts.rows));
        }
        self.finish(acts, |_, _| &[])
    }

    /// Starts a pass (see [`MtpLayer::forward`]) and runs it up to its feed-forward: a dense one
    /// runs whole; a MoE one stops at its routing, its rows awaiting their experts
    /// ([`MtpLayer::routed`]).
    pub fn begin(&self, embed: &[f32], batch: &[SeqInput], hidden: &[f32], cache: &mut ModelCache) -> MtpActs {
        let d = self.enorm.weight.len();
        let layout = BatchLayout::new(batch, cache.kv.block_size(), true);
        let t = layout.rows;
        assert_eq!(hidden.len(), t * d, "one hidden row per successor token");
        let (logit_rows, wanted) = super::batch::wanted_rows(batch);
        if t == 0 {
            return MtpActs { rows: 0, h: Vec::new(), pending: None, logit_rows, wanted };
        }
        let mut joined = Vec::with_capacity(t * 2 * d);
        let mut r = 0;
        for s in batch {
            for &tok in s.tokens {
                let mut e = embed[tok as usize * d..(tok as usize + 1) * d].to_vec();
                self.enorm.forward_inplace(&mut e);
                joined.extend_from_slice(&e);
                let mut h = hidden[r * d..(r + 1) * d].to_vec();
                self.hnorm.forward_inplace(&mut h);
                joined.extend_from_slice(&h);
                r += 1;
            }
        }
        let mut h = self.eh_proj.forward(&joined, t);
        let pending = self.block.run_to_routing(&self.binding, &mut h, &layout, cache);
        MtpActs { rows: t, h, pending, logit_rows, wanted }
    }

    /// The rows of a pass awaiting their experts (expert parallel), as [`Model::routed`] gives
    /// a decoder layer's; `layer` names the MTP layer.
    pub fn routed<'a>(&self, acts: &'a MtpActs, layer: usize) -> Option<RoutedRows<'a>> {
        let p = acts.pending.as_ref()?;
        Some(RoutedRows { layer, hidden: self.enorm.weight.len(), x: &p.x, routes: &p.routes })
    }

    /// Runs routed expert `expert` of the MTP layer over `n` rows; `None` when this model does not
    /// hold it.
    pub fn run_expert(&self, expert: usize, rows: &[f32], n: usize) -> Option<Vec<f32>> {
        match &self.block.ffn {
            Ffn::Moe(m) => m.run_expert(expert, rows, n),
            Ffn::Dense(_) => None,
        }
    }

    /// Routed experts of the MTP layer's MoE block (0 when dense).
    pub fn num_experts(&self) -> usize {
        match &self.block.ffn {
            Ffn::Moe(m) => m.routing.num_experts,
            Ffn::Dense(_) => 0,
        }
    }

    /// Ends a pass: a MoE block sums `expert_out(r, k)` (row `r`'s `k`-th expert, ascending) as
    /// [`Model::combine_experts`] does, then the shared head gives the logits asked for.
    pub fn finish<'y>(&self, mut acts: MtpActs, expert_out: impl Fn(usize, usize) -> &'y [f32]) -> MtpOutput {
        let d = self.enorm.weight.len();
        if let (Some(p), Ffn::Moe(m)) = (acts.pending.take(), &self.block.ffn) {
            let out = m.combine(&p.x, acts.rows, &p.routes, expert_out);
            add_into(&mut acts.h, &out);
        }
        let h = acts.h;
        let mut selected = Vec::with_capacity(acts.wanted.len() * d);
        for &r in &acts.wanted {
            selected.extend_from_slice(&h[r * d..(r + 1) * d]);
        }
        self.head_norm.forward_inplace(&mut selected);
        let logits = if acts.wanted.is_empty() { Vec::new() } else { self.head.forward(&selected, acts.wanted.len()) };
        let logits = ForwardOutput { vocab: self.head.out_dim(), logits, rows: acts.logit_rows, hidden: Vec::new() };
        MtpOutput { logits, hidden: h }
    }
}

/// A pass of the MTP layer between [`MtpLayer::begin`] and [`MtpLayer::finish`].
pub struct MtpActs {
    rows: usize,
    h: Vec<f32>,
    pending: Option<PendingMoe>,
    logit_rows: Vec<std::ops::Range<usize>>,
    wanted: Vec<usize>,
}

impl MtpActs {
    pub fn rows(&self) -> usize {
        self.rows
    }
}

#[cfg(test)]
mod tests {
    use crate::models::{self, LogitsWanted, Model, ModelCache, SeqInput};
    use std::path::PathBuf;

    /// A small DeepSeek-V3 with one MTP layer (MoE: 8 experts, top 2): the repository's spec.
    fn spec_path() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../benches/specs/deepseek_mtp.toml")
    }

    /// The seeded checkpoint, written with DeepSeek's MTP tensor names and loaded back.
    fn checkpoint(name: &str) -> (PathBuf, Model) {
        let dir = crate::models::load_tests::scratch(&format!("mtp-{name}"));
        let names = models::write_seeded_checkpoint(&spec_path(), &dir.join("ckpt")).unwrap();
        for suffix in
            ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight"]
        {
            assert!(names.contains(&format!("model.layers.3.{suffix}")), "{suffix} in {names:?}");
        }
        for decoder in
            ["self_attn.kv_a_proj_with_mqa.weight", "mlp.experts.7.down_proj.weight", "input_layernorm.weight"]
        {
            assert!(names.contains(&format!("model.layers.3.{decoder}")), "{decoder} in {names:?}");
        }
        let model = models::load(&dir.join("ckpt")).unwrap();
        (dir, model)
    }

    /// The target's final-normed hidden rows of `tokens` (one sequence from position 0).
    fn target_hidden(model: &Model, cache: &mut ModelCache, tokens: &[u32], table: &[u32]) -> Vec<f32> {
        let seq = SeqInput {
            tokens,
            start_pos: 0,
            block_table: table,
            slot: None,
            prompt_len: tokens.len(),
            logits: LogitsWanted::Last,
        };
        let acts = model.begin_step(&[seq], cache.kv.block_size());
        let mut acts = acts;
        model.run_layers(&mut acts, 0..model.num_layers(), cache);
        model.finish_step_keeping_hidden(&[seq], acts).hidden
    }

    #[test]
    fn a_seeded_checkpoint_with_deepseek_mtp_names_loads_its_mtp_layer_with_its_own_kv() {
        let (dir, model) = checkpoint("load");
        let mtp = model.mtp().expect("the MTP layer loads from its tensors");
        assert_eq!(model.kv_row_widths().len(), 4, "three decoder layers and the MTP layer keep KV");
        assert_eq!(mtp.binding.kv_layer, Some(3));
        // The fixture's config names an MTP layer its checkpoint does not hold: none is loaded.
        let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hf/deepseek_v3");
        assert!(models::load(&fixture).unwrap().mtp().is_none());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn mtp_kv_and_drafts_do_not_depend_on_chunking_or_on_which_cache_computed_the_prefix() {
        // Self-consistency: the MTP pass over a prompt in one chunk, or in two chunks on two
        // caches (the first chunk's blocks copied over, as a handoff moves them), writes the same
        // MTP KV bits and proposes the same next-token logits bits.
        let (dir, model) = checkpoint("consistent");
        let mtp = model.mtp().unwrap();
        let bs = 4;
        let prompt: Vec<u32> = (0..13u32).map(|i| (i * 37 + 5) % 512).collect();
        let t0 = 99u32;
        let table: Vec<u32> = (0..4).collect();
        let successors: Vec<u32> = prompt[1..].iter().copied().chain([t0]).collect();
        let mtp_seq = |tokens: &'static [u32], start_pos: usize, logits| SeqInput {
            tokens,
            start_pos,
            block_table: &[0, 1, 2, 3],
            slot: None,
            prompt_len: 13,
            logits,
        };
        let leak = |v: Vec<u32>| -> &'static [u32] { Box::leak(v.into_boxed_slice()) };
        // One cache, one pass over every position.
        let mut whole = model.new_cache(bs, 4, 0, 0);
        let h = target_hidden(&model, &mut whole, &prompt, &table);
        let one = mtp.forward(
            model.embeddings(),
            &[mtp_seq(leak(successors.clone()), 0, LogitsWanted::Last)],
            &h,
            &mut whole,
        );
        // Two caches: the first eight positions on one, copied over, the rest on the other.
        let mut producer = model.new_cache(bs, 4, 0, 0);
        let h_first = target_hidden(&model, &mut producer, &prompt, &table);
        assert_eq!(h_first, h, "the target's hidden rows are the same bits");
        mtp.forward(
            model.embeddings(),
            &[mtp_seq(leak(successors[..8].to_vec()), 0, LogitsWanted::None)],
            &h[..8 * 64],
            &mut producer,
        );
        let mut consumer = model.new_cache(bs, 4, 0, 0);
        consumer.kv.copy_blocks_from(&producer.kv, &[0, 1, 2, 3], &[0, 1, 2, 3]).unwrap();
        let two = mtp.forward(
            model.embeddings(),
            &[mtp_seq(leak(successors[8..].to_vec()), 8, LogitsWanted::Last)],
            &h[8 * 64..],
            &mut consumer,
        );
        assert_eq!(one.logits.logits, two.logits.logits, "the same draft logits");
        let mtp_layer = 3;
        for block in 0..4 {
            let rows = |c: &ModelCache| c.kv.layer(mtp_layer).rows(block * bs, bs).to_vec();
            assert_eq!(rows(&whole), rows(&consumer), "MTP KV of block {block}");
        }
        assert!(whole.kv.layer(mtp_layer).rows(0, bs).iter().any(|&v| v != 0.0), "the MTP layer wrote its KV");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
