//! One request as a rank sees it: its tokens (prompt, then what it generated), how many of them
//! the cache holds, the tokens it has in flight, and the memory it owns. Prefill and decode are
//! the same thing here: a step feeds `tokens[computed..]` (or a chunk of it) and samples when it
//! feeds through the last token known *or in flight*.
//!
//! Counters, with their invariant (`check`):
//! `cached ≤ computed ≤ known_len() = tokens.len() + pending.len()`, and `computed` never exceeds
//! what the blocks held cover. `pending` lists, oldest first, the steps that will sample this
//! sequence's next tokens: launched, not yet completed (deferred output).

use crate::step::SeqKey;
use kvflow_kernels::kv::{BlockTable, SlotId};
use std::collections::{HashMap, VecDeque};

/// A request running (or waiting) on a rank.
#[derive(Debug)]
pub struct Sequence {
    pub id: u64,
    /// Its slab index and generation (set by [`Sequences`]).
    pub key: SeqKey,
    /// Prompt followed by every generated token whose value is known.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_output_tokens: usize,
    /// Positions whose KV (and state) is computed or being computed by a launched step.
    pub computed: usize,
    /// Tokens restored from the prefix cache at the last admission.
    pub cached: usize,
    /// Steps launched that sample this sequence and have not completed, oldest first.
    pub pending: VecDeque<u64>,
    /// Launched steps that read or write this sequence's memory and have not completed.
    pub in_flight_steps: u32,
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
    /// When each output token became known (`wall_ms`).
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
            key: SeqKey { index: u32::MAX, generation: 0 },
            tokens: prompt,
            prompt_len,
            max_output_tokens,
            computed: 0,
            cached: 0,
            pending: VecDeque::new(),
            in_flight_steps: 0,
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

    /// Output tokens whose values are known.
    pub fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens known or in flight.
    pub fn known_len(&self) -> usize {
        self.tokens.len() + self.pending.len()
    }

    /// Whether every output token it must produce has been sampled or is being sampled.
    pub fn all_outputs_launched(&self) -> bool {
        self.output_len() + self.pending.len() >= self.max_output_tokens
    }

    /// Where feeding stops: the last token known or in flight, except the final output token,
    /// which is never fed.
    pub fn feed_end(&self) -> usize {
        if self.all_outputs_launched() {
            self.known_len().saturating_sub(1)
        } else {
            self.known_len()
        }
    }

    /// Tokens still to feed before the next sample (or before it ends).
    pub fn remaining(&self) -> usize {
        self.feed_end().saturating_sub(self.computed)
    }

    /// Every output token is known: the request is done.
    pub fn finished(&self) -> bool {
        self.output_len() >= self.max_output_tokens
    }

    /// Tokens still to compute, counting every output not yet launched (the router's load).
    pub fn outstanding_tokens(&self) -> usize {
        self.remaining() + self.max_output_tokens.saturating_sub(self.output_len() + self.pending.len())
    }

    /// The step that samples the token at `position` (≥ `tokens.len()`), if it is in flight.
    pub fn pending_step(&self, position: usize) -> Option<u64> {
        position.checked_sub(self.tokens.len()).and_then(|i| self.pending.get(i).copied())
    }

    /// Whether `cached ≤ computed ≤ known_len()` and the blocks held cover `computed` (when it
    /// keeps KV).
    pub fn check(&self, block_size: usize, keeps_kv: bool) -> Result<(), String> {
        if !(self.cached <= self.computed && self.computed <= self.known_len()) {
            return Err(format!(
                "request {}: counters out of order (cached {}, computed {}, known {})",
                self.id,
                self.cached,
                self.computed,
                self.known_len()
            ));
        }
        if keeps_kv && self.computed > self.blocks.len() * block_size {
            return Err(format!(
                "request {}: computed {} tokens past its {} blocks",
                self.id,
                self.computed,
                self.blocks.len()
            ));
        }
        Ok(())
    }
}

/// The requests a rank holds, in a slab: the scheduler works on stable indices (no hashing on
/// the per-step path); ids map to indices for admissions and cancellations; every insertion and
/// every restart gives the sequence a new generation.
#[derive(Debug, Default)]
pub struct Sequences {
    slots: Vec<Option<Sequence>>,
    free: Vec<usize>,
    by_id: HashMap<u64, usize>,
    next_generation: u32,
}

impl Sequences {
    pub fn insert(&mut self, mut seq: Sequence) -> usize {
        let id = seq.id;
        let index = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        seq.key = SeqKey { index: index as u32, generation: self.bump() };
        self.slots[index] = Some(seq);
        self.by_id.insert(id, index);
        index
    }

    fn bump(&mut self) -> u32 {
        self.next_generation = self.next_generation.wrapping_add(1);
        self.next_generation
    }

    /// Gives the sequence at `index` a new generation (it starts over): completions for the old
    /// one no longer reach it.
    pub fn renew(&mut self, index: usize) {
        let generation = self.bump();
        self.get_mut(index).key.generation = generation;
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

    /// The sequence `key` names, if it is still held in that generation.
    pub fn by_key_mut(&mut self, key: SeqKey) -> Option<&mut Sequence> {
        self.slots.get_mut(key.index as usize)?.as_mut().filter(|s| s.key == key)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_in_flight_can_be_fed_by_the_next_step() {
        let mut seq = Sequence::new(1, vec![5, 6, 7], 3, false);
        assert_eq!(seq.remaining(), 3);
        seq.computed = 3;
        seq.pending.push_back(10); // step 10 samples the first output
        assert_eq!((seq.known_len(), seq.remaining()), (4, 1), "a decode can feed it before it is known");
        assert_eq!(seq.pending_step(3), Some(10));
        seq.computed = 4;
        seq.pending.push_back(11);
        seq.computed = 5;
        seq.pending.push_back(12);
        assert!(seq.all_outputs_launched());
        assert_eq!(seq.remaining(), 0, "the final output token is never fed");
        assert!(!seq.finished());
        assert_eq!(seq.outstanding_tokens(), 0);
        assert!(seq.check(16, false).is_ok());
    }

    #[test]
    fn every_insertion_and_restart_gets_a_new_generation() {
        let mut seqs = Sequences::default();
        let a = seqs.insert(Sequence::new(1, vec![1], 1, false));
        let first = seqs.get(a).key;
        seqs.renew(a);
        let second = seqs.get(a).key;
        assert_eq!(first.index, second.index);
        assert_ne!(first.generation, second.generation);
        assert!(seqs.by_key_mut(first).is_none(), "the old generation no longer names it");
        assert!(seqs.by_key_mut(second).is_some());
        seqs.remove(a);
        let b = seqs.insert(Sequence::new(2, vec![1], 1, false));
        assert_eq!(b, a, "the slab slot is reused");
        assert!(seqs.by_key_mut(second).is_none(), "but not under the old key");
    }
}
