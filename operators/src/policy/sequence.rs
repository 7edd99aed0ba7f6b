//! One request as a rank sees it: its tokens (prompt, then what it generated), how many of them
//! the cache holds, and the memory it owns. Prefill and decode are the same thing here: a step
//! feeds `tokens[computed..]` (or a chunk of it) and samples when everything known was fed.

use kvflow_kernels::kv::{BlockTable, SlotId};
use std::collections::HashMap;

/// A request running (or waiting) on a rank.
#[derive(Debug)]
pub struct Sequence {
    pub id: u64,
    /// Prompt followed by every generated token.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_output_tokens: usize,
    /// Tokens whose KV (and state) the cache holds: `cached ≤ computed ≤ tokens.len()`.
    pub computed: usize,
    /// Tokens restored from the prefix cache at the last admission.
    pub cached: usize,
    pub blocks: BlockTable,
    pub slot: Option<SlotId>,
    pub preemptions: usize,
    /// Hash of the logits' bit patterns at every sampled position (for `--verify`).
    pub logits_hash: u64,
    pub warmup: bool,
    /// When its first chunk ran (`wall_ms`; queueing ends then).
    pub started_ms: Option<f64>,
    /// Prompt tokens reused from the prefix cache at its first admission.
    pub first_cached: usize,
    /// When each output token was sampled (`wall_ms`).
    pub token_ms: Vec<f64>,
    /// Chained hashes of the prompt's full blocks (the prefix cache's keys), set when the rank
    /// queues the request.
    pub prompt_hashes: Vec<u64>,
}

impl Sequence {
    pub fn new(id: u64, prompt: Vec<u32>, max_output_tokens: usize, warmup: bool) -> Self {
        let prompt_len = prompt.len();
        Sequence {
            id,
            tokens: prompt,
            prompt_len,
            max_output_tokens,
            computed: 0,
            cached: 0,
            blocks: BlockTable::new(),
            slot: None,
            preemptions: 0,
            logits_hash: kvflow_kernels::hash::EMPTY,
            warmup,
            started_ms: None,
            first_cached: 0,
            token_ms: Vec::new(),
            prompt_hashes: Vec::new(),
        }
    }

    pub fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens known but not yet in the cache.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.computed
    }

    pub fn finished(&self) -> bool {
        self.output_len() >= self.max_output_tokens
    }

    /// Tokens still to compute, counting every output still to produce (the router's load).
    pub fn outstanding_tokens(&self) -> usize {
        self.remaining() + self.max_output_tokens.saturating_sub(self.output_len())
    }

    /// Checks `cached ≤ computed ≤ tokens ≤ capacity of the blocks held` (when it keeps KV).
    pub fn check(&self, block_size: usize, keeps_kv: bool) {
        assert!(
            self.cached <= self.computed && self.computed <= self.tokens.len(),
            "request {}: counters out of order",
            self.id
        );
        if keeps_kv {
            assert!(self.computed <= self.blocks.len() * block_size, "request {}: computed past its blocks", self.id);
        }
    }
}

/// The requests a rank holds, in a slab: the scheduler works on stable indices (no hashing on
/// the per-step path); ids map to indices for admissions and cancellations.
#[derive(Debug, Default)]
pub struct Sequences {
    slots: Vec<Option<Sequence>>,
    free: Vec<usize>,
    by_id: HashMap<u64, usize>,
}

impl Sequences {
    pub fn insert(&mut self, seq: Sequence) -> usize {
        let id = seq.id;
        let index = match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(seq);
                i
            }
            None => {
                self.slots.push(Some(seq));
                self.slots.len() - 1
            }
        };
        self.by_id.insert(id, index);
        index
    }

    pub fn remove(&mut self, index: usize) -> Sequence {
        let seq = self.slots[index].take().expect("removing a held request");
        self.by_id.remove(&seq.id);
        self.free.push(index);
        seq
    }

    pub fn index_of(&self, id: u64) -> Option<usize> {
        self.by_id.get(&id).copied()
    }

    #[inline]
    pub fn get(&self, index: usize) -> &Sequence {
        self.slots[index].as_ref().expect("a held request")
    }

    #[inline]
    pub fn get_mut(&mut self, index: usize) -> &mut Sequence {
        self.slots[index].as_mut().expect("a held request")
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Sequence> {
        self.slots.iter().flatten()
    }
}
