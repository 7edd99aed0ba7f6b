//! Recurrent state: snapshots restore exactly, the exactly-once rule for the first token matters
//! on every recurrent family (and rewriting a position's KV is harmless on attention families),
//! the family table agrees with what each family's model needs, and accounting is exact.

use crate::common::{expected, fixture, load};
use kvflow_kernels::cpu::sampling::argmax;
use kvflow_kernels::kv::{block_pool, BlockPool, BlockTable, IdPool, SlotId};
use kvflow_kernels::models::{Family, LogitsWanted, Model, ModelCache, SeqInput};

const BLOCK: usize = 16;

/// The ids a test hands out: blocks, slots and snapshots (the cache holds the values).
struct Pools {
    blocks: BlockPool,
    slots: IdPool,
    snapshots: IdPool,
}

impl Pools {
    fn all_free(&self) -> bool {
        self.blocks.all_free() && self.slots.all_free() && self.snapshots.all_free()
    }
}

/// One request's memory in a test: its blocks and its slot.
struct Seq {
    blocks: BlockTable,
    slot: Option<SlotId>,
    prompt_len: usize,
}

impl Seq {
    fn new(model: &Model, cache: &mut ModelCache, pool: &mut Pools, tokens: usize, prompt_len: usize) -> Seq {
        let mut blocks = BlockTable::new();
        if model.needs_blocks() {
            blocks.grow_to(tokens, BLOCK, &mut pool.blocks, 0).unwrap();
        }
        let slot = model.needs_slots().then(|| pool.slots.allocate().unwrap());
        if let Some(s) = slot {
            cache.states.zero_slot(s);
        }
        Seq { blocks, slot, prompt_len }
    }

    /// Feeds `tokens` at `start` and returns the last logits.
    fn feed(&self, model: &Model, cache: &mut ModelCache, tokens: &[u32], start: usize) -> Vec<f32> {
        let input = SeqInput {
            tokens,
            start_pos: start,
            block_table: self.blocks.blocks(),
            slot: self.slot,
            prompt_len: self.prompt_len,
            logits: LogitsWanted::Last,
        };
        model.forward(&[input], cache).last(0).unwrap().to_vec()
    }

    /// Greedy continuation of `n` tokens from `logits`, the first fed at position `pos`.
    fn continue_greedy(
        &self,
        model: &Model,
        cache: &mut ModelCache,
        mut logits: Vec<f32>,
        pos: usize,
        n: usize,
    ) -> Vec<u32> {
        let mut out = Vec::new();
        for i in 0..n {
            let tok = argmax(&logits);
            out.push(tok);
            logits = self.feed(model, cache, &[tok], pos + i);
        }
        out
    }

    fn release(self, pool: &mut Pools) {
        let mut blocks = self.blocks;
        blocks.release_all(&mut pool.blocks);
        if let Some(s) = self.slot {
            pool.slots.release(s);
        }
    }
}

fn setup(model: &Model) -> (ModelCache, Pools) {
    let pools = Pools {
        blocks: block_pool(64),
        slots: IdPool::new("state slots", 4),
        snapshots: IdPool::new("state snapshots", 2),
    };
    (model.new_cache(BLOCK, 64, 4, 2), pools)
}

fn prompt_of(dir: &str) -> Vec<u32> {
    expected(&fixture(dir)).cases[1].prompt.clone()
}

const RECURRENT: [&str; 4] = ["hf/qwen3_next", "hf/qwen3_next_gdn", "hf/kimi_linear", "hf-extra/kimi_linear_mla_heavy"];
const ATTENTION: [&str; 4] = ["hf/llama", "hf/qwen3", "hf/deepseek_v3", "hf/deepseek_v32"];

#[test]
fn a_restored_snapshot_continues_exactly_like_the_uninterrupted_run() {
    for dir in RECURRENT {
        let model = load(&fixture(dir));
        let prompt = prompt_of(dir);
        let n = 12;
        let (mut cache, mut pool) = setup(&model);
        // Uninterrupted.
        let a = Seq::new(&model, &mut cache, &mut pool, prompt.len() + n, prompt.len());
        let logits = a.feed(&model, &mut cache, &prompt, 0);
        let want = a.continue_greedy(&model, &mut cache, logits, prompt.len(), n);
        a.release(&mut pool);
        // Prefill, snapshot, dirty the slot with another request, restore into a fresh slot.
        let b = Seq::new(&model, &mut cache, &mut pool, prompt.len() + n, prompt.len());
        let logits = b.feed(&model, &mut cache, &prompt, 0);
        let snap = pool.snapshots.allocate().unwrap();
        cache.states.snapshot_into(b.slot.unwrap(), snap);
        let other = Seq::new(&model, &mut cache, &mut pool, 8, 8);
        other.feed(&model, &mut cache, &prompt[..8], 0);
        let fresh = pool.slots.allocate().unwrap();
        cache.states.restore(snap, fresh);
        pool.snapshots.release(snap);
        let moved = Seq { blocks: b.blocks.clone(), slot: Some(fresh), prompt_len: prompt.len() };
        let got = moved.continue_greedy(&model, &mut cache, logits, prompt.len(), n);
        assert_eq!(got, want, "{dir}: restored continuation differs");
        pool.slots.release(b.slot.unwrap());
        moved.release(&mut pool);
        other.release(&mut pool);
        assert!(pool.all_free(), "{dir}: blocks, slots or snapshots leaked");
    }
}

/// Prefills the prompt, then feeds its last token a second time at the same position, and
/// returns (normal continuation, continuation after the repeat).
fn continuation_with_and_without_repeat(dir: &str) -> (Vec<u32>, Vec<u32>) {
    let model = load(&fixture(dir));
    let prompt = prompt_of(dir);
    let n = 16;
    let (mut cache, mut pool) = setup(&model);
    let once = Seq::new(&model, &mut cache, &mut pool, prompt.len() + n, prompt.len());
    let logits = once.feed(&model, &mut cache, &prompt, 0);
    let normal = once.continue_greedy(&model, &mut cache, logits, prompt.len(), n);
    once.release(&mut pool);
    let twice = Seq::new(&model, &mut cache, &mut pool, prompt.len() + n, prompt.len());
    twice.feed(&model, &mut cache, &prompt, 0);
    let last = prompt.len() - 1;
    let logits = twice.feed(&model, &mut cache, &prompt[last..], last);
    let repeated = twice.continue_greedy(&model, &mut cache, logits, prompt.len(), n);
    twice.release(&mut pool);
    assert!(pool.all_free(), "{dir}: leaked");
    (normal, repeated)
}

#[test]
fn applying_the_last_prompt_token_twice_changes_every_recurrent_family() {
    for dir in RECURRENT {
        let (normal, repeated) = continuation_with_and_without_repeat(dir);
        assert_ne!(normal, repeated, "{dir}: a second pass of the token left the continuation unchanged");
    }
}

#[test]
fn rewriting_a_positions_kv_leaves_attention_families_unchanged() {
    for dir in ATTENTION {
        let (normal, repeated) = continuation_with_and_without_repeat(dir);
        assert_eq!(normal, repeated, "{dir}: rewriting the same KV changed the continuation");
    }
}

#[test]
fn every_family_states_its_recurrent_state_and_the_model_agrees() {
    let fixture_of = |f: Family| match f {
        Family::Mha => "hf/llama",
        Family::Mla => "hf/deepseek_v3",
        Family::SparseMla => "hf/deepseek_v32",
        Family::HybridGdn => "hf/qwen3_next",
        Family::Gdn => "hf/qwen3_next_gdn",
        Family::HybridKda => "hf/kimi_linear",
    };
    for &family in Family::ALL {
        let model = load(&fixture(fixture_of(family)));
        assert_eq!(model.family, family);
        assert_eq!(model.needs_slots(), family.has_recurrent_state(), "{family}: table vs model (recurrent state)");
        assert_eq!(model.needs_blocks(), family.has_paged_kv(), "{family}: table vs model (paged KV)");
    }
}
