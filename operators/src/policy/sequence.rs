//! One request as a rank sees it: its tokens (prompt, then what it generated), how many of them
//! the cache holds, and the memory it owns. Prefill and decode are the same thing here: a step
//! feeds `tokens[computed..]` (or a chunk of it) and samples when everything known was fed.

use kvflow_kernels::kv::{BlockTable, SlotId};

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
    /// Whether any chunk of it has run yet (queueing ends then).
    pub started: bool,
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
            started: false,
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
