//! Per-rank scheduling policy, a plain struct: continuous batching with chunked prefill, decodes
//! first, admissions in arrival order, prefix reuse at admission, and preemption by recompute
//! (the youngest running request gives its memory back and starts over) when blocks run out.
//!
//! A step feeds each scheduled sequence `tokens[computed..computed + len]`; it samples when that
//! reaches the last known token. With recurrent state and a prefix cache, chunks stop at snapshot
//! boundaries (every `snapshot_interval_blocks` blocks, and the prompt's last full block) so the
//! state there can be kept.
//!
//! Speculative decoding: a decoding sequence with nothing in flight may carry drafts (up to the
//! limit fixed here — `draft_tokens`, its outputs left, the step's room — at a bucketed width
//! that only shrinks it, blocks reserved for each, never preempting for them); it is not
//! scheduled again until their verification completes. A handed-off request's first decode
//! carries the producer's drafts. Chunks state "verifies drafts" (`Chunk::drafts`) and "drafter
//! needs successor tokens" (`Chunk::drafter_successors`) separately.
//!
//! Deferred output: a sequence whose last sampled token is still in flight can be scheduled at
//! once — its next decode names that token (`Sequence::remaining` counts tokens in flight), so a
//! pool whose executor completes later still decodes one token per step. With a drafter, a decode
//! waits for its token in flight instead (the drafter proposes from it; `running.rs`).
//!
//! The policy decides and books memory ids; the state copies it needs (a new slot starts from
//! zero, a prefix hit restores a snapshot) go into the decision for the executor to apply.

mod admit;
mod config;
mod decision;
mod draft;
#[cfg(test)]
mod policy_tests;
mod running;

pub use config::{AdmissionPolicy, SchedulerConfig};
pub use decision::{Chunk, StateOp, StepDecision};
pub use draft::{propose_into, SpecConfig};

use super::memory::RankMemory;
use super::sequence::{Sequence, Sequences};
use std::collections::VecDeque;

/// Waiting and running requests of one rank, as indices into its [`Sequences`].
#[derive(Debug)]
pub struct Scheduler {
    pub config: SchedulerConfig,
    waiting: VecDeque<usize>,
    /// Admission order; the last is the youngest.
    running: Vec<usize>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        Scheduler { config, waiting: VecDeque::new(), running: Vec::new() }
    }

    pub fn enqueue(&mut self, index: usize) {
        self.waiting.push_back(index);
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Forgets a request (finished or cancelled; its memory was already released). Returns
    /// whether it was running (else it was waiting, or unknown).
    pub fn forget(&mut self, index: usize) -> bool {
        if let Some(p) = self.running.iter().position(|&r| r == index) {
            self.running.remove(p);
            true
        } else {
            self.waiting.retain(|&r| r != index);
            false
        }
    }

    /// The waiting requests, in admission order.
    pub fn waiting(&self) -> impl Iterator<Item = usize> + '_ {
        self.waiting.iter().copied()
    }

    /// The running requests, oldest first.
    pub fn running(&self) -> &[usize] {
        &self.running
    }

    /// Decides the batch of step `t`, allocating the memory it needs, and books every chunk as
    /// launched at `t` (the step is always launched as decided): its tokens count as computed,
    /// a token it samples as in flight.
    pub fn schedule(&mut self, seqs: &mut Sequences, mem: &mut RankMemory, t: u64) -> StepDecision {
        let mut out = StepDecision::default();
        self.schedule_into(seqs, mem, t, &mut out);
        out
    }

    /// [`Scheduler::schedule`] into `out` (emptied first; its buffers are reused): running
    /// requests first, oldest first — their decodes (one token each), then their prefill chunks —
    /// and then admissions in arrival order, while the step's token budget lasts.
    pub fn schedule_into(&mut self, seqs: &mut Sequences, mem: &mut RankMemory, t: u64, out: &mut StepDecision) {
        out.clear();
        out.chunks.reserve(self.running.len() + 8);
        let mut budget = self.config.max_batched_tokens;
        let prefilling = self.book_decodes(seqs, mem, t, &mut budget, out);
        self.book_prefill_chunks(&prefilling, seqs, mem, t, &mut budget, out);
        self.admit_waiting(seqs, mem, t, &mut budget, out);
    }

    /// Tokens to feed `seq` this step within `budget`, stopping at a snapshot boundary.
    fn chunk_len(&self, seq: &Sequence, budget: usize, block_size: usize) -> usize {
        let mut len = seq.remaining().min(self.config.chunk_tokens).min(budget);
        if len > 1 {
            if let Some(b) = self.next_boundary(seq, block_size) {
                if b < seq.computed + len {
                    len = b - seq.computed;
                }
            }
        }
        len
    }

    /// The next snapshot boundary after `computed` within the prompt, if snapshots are kept.
    fn next_boundary(&self, seq: &Sequence, block_size: usize) -> Option<usize> {
        if !self.config.prefix_cache || seq.slot.is_none() || seq.computed >= seq.prompt_len {
            return None;
        }
        snapshot_boundaries(seq.prompt_len, block_size, self.config.snapshot_interval_blocks)
            .into_iter()
            .find(|&b| b > seq.computed)
    }

    /// Releases a request's memory and puts it back at the head of the queue (it recomputes).
    /// Returns the tokens of the chunk it had in this step (back to the budget).
    /// Its steps in flight keep what they read (see `RankMemory::release`); completions for
    /// them no longer reach it (it gets a new generation).
    fn preempt(&mut self, index: usize, seqs: &mut Sequences, mem: &mut RankMemory, out: &mut StepDecision) -> usize {
        let seq = seqs.get_mut(index);
        mem.release(seq);
        seq.preemptions += 1;
        out.preempted.push(seq.id);
        seqs.renew(index);
        self.waiting.push_front(index);
        let freed = out.chunks.iter().filter(|c| c.seq == index).map(|c| c.len).sum();
        out.chunks.retain(|c| c.seq != index);
        freed
    }
}

/// Adds `seq`'s chunk of `len` tokens to the step and books it as launched at `t`. A chunk with
/// drafts (`Sequence::drafts`) feeds its last known token and them: it samples after each, and
/// only the known token counts as computed until the verification says how many drafts held.
fn book(out: &mut StepDecision, index: usize, seq: &mut Sequence, len: usize, t: u64) {
    // What `propose` drafted after its last token is used (in `seq.drafts`) or stale now.
    seq.spec.proposed.clear();
    let drafts = seq.spec.drafts.len();
    let (start, end) = (seq.computed, seq.computed + len - drafts);
    let sample = end == seq.known_len();
    let deferred = if end > seq.tokens.len() { seq.pending_step(end - 1) } else { None };
    let prefill = start < seq.prompt_len;
    let drafter_successors = false; // set for the whole step by `Scheduler::mark_drafter_successors`
    out.chunks.push(Chunk {
        seq: index,
        key: seq.key,
        start,
        len,
        sample,
        deferred,
        prefill,
        drafts,
        drafter_successors,
    });
    seq.computed = end;
    seq.launched_at(t);
    if sample {
        seq.pending.push(t);
    }
}

/// Token counts after which a request's state is snapshotted for prefix reuse: every
/// `interval_blocks` full blocks of the prompt, and its last full block.
pub fn snapshot_boundaries(prompt_len: usize, block_size: usize, interval_blocks: usize) -> Vec<usize> {
    let full = prompt_len / block_size;
    let mut b: Vec<usize> =
        (1..=full).filter(|k| interval_blocks > 0 && k % interval_blocks == 0).map(|k| k * block_size).collect();
    if full > 0 && b.last() != Some(&(full * block_size)) {
        b.push(full * block_size);
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundaries_fall_every_interval_and_at_the_last_full_block() {
        assert_eq!(snapshot_boundaries(100, 16, 2), vec![32, 64, 96]);
        assert_eq!(snapshot_boundaries(90, 16, 2), vec![32, 64, 80]);
        assert_eq!(snapshot_boundaries(10, 16, 2), Vec::<usize>::new());
    }
}
