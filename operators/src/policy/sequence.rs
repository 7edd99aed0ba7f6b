//! One request as a rank sees it: its tokens (prompt, then what it generated), how many of them
//! the cache holds, the tokens it has in flight, and the memory it owns. Prefill and decode are
//! the same thing here: a step feeds `tokens[computed..]` (or a chunk of it) and samples when it
//! feeds through the last token known *or in flight*.
//!
//! Counters, with their invariant (`check`):
//! `cached ≤ computed ≤ known_len() = tokens.len() + pending.len()`, `computed` never exceeds
//! what the blocks held cover, and with tokens in flight only the newest is unfed
//! (`computed == known_len() − 1`). `pending` counts the tokens launched steps will sample
//! (deferred output).

use crate::request::{BackTo, Delivery, TokenTimes, TransferId};
use kvflow_kernels::cpu::sampling::RequestSampling;
use kvflow_kernels::kv::{BlockTable, SlotId};
use std::collections::HashMap;

/// A sequence of one rank in one generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqKey {
    /// Index in the rank's slab of sequences.
    pub index: u32,
    /// Changes every time the request starts (again) on this rank.
    pub generation: u32,
}

impl std::fmt::Display for SeqKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}#{}", self.index, self.generation)
    }
}

/// The tokens a sequence has in flight: sampled by launched steps that have not completed.
/// Only the newest is ever fed before it is known (each decode feeds the token sampled just
/// before it), so its step is all a launch names; the others complete in launch order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingTokens {
    count: u32,
    /// The step that samples the newest token in flight.
    newest: u64,
}

/// No step (the sequence fields keep plain `u64`s: an `Option` would double their size).
const NONE: u64 = u64::MAX;

impl PendingTokens {
    pub fn len(&self) -> usize {
        self.count as usize
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Step `t` was launched and samples the next token.
    pub fn push(&mut self, t: u64) {
        self.count += 1;
        self.newest = t;
    }

    /// The step that samples the newest token in flight.
    pub fn newest(&self) -> Option<u64> {
        (self.count > 0).then_some(self.newest)
    }

    /// Step `t`'s token arrived: the oldest in flight (completions come in step order; a step's
    /// second completion finds no record and never gets here). Returns false (and changes
    /// nothing) for a step that cannot be it — none in flight, or later than the newest.
    pub fn pop(&mut self, t: u64) -> bool {
        let possible = self.count > 0 && t <= self.newest;
        if possible {
            self.count -= 1;
        }
        possible
    }

    /// Forgets every token in flight (the request starts over).
    pub fn clear(&mut self) {
        self.count = 0;
    }
}

/// How a request's tokens go out: its stop tokens and whether they stream, how many were
/// streamed, and when its first and last output tokens became known.
#[derive(Debug, Default)]
pub struct StreamState {
    /// Its stop tokens, and whether its tokens stream out.
    pub delivery: Delivery,
    /// Output tokens already streamed out (`Event::Tokens`).
    pub streamed: usize,
    /// When its first and last output tokens became known.
    pub token_times: TokenTimes,
}

/// What a request is on its pool, decided once, when its rank admits it (`Rank::sequence_for`,
/// from the admission's kind): served whole, or one side of a P/D handoff. Only the two sides
/// reach the handoff code; a whole request never does.
#[derive(Debug, Default)]
pub enum RequestKind {
    /// Served whole here: an aggregated pool's request, or a decode pool's new request that its
    /// rank prefills itself.
    #[default]
    Whole,
    /// A prefill pool's request: it samples T0 only, then hands off.
    Producer(ProducerState),
    /// A decode pool's request that arrived as a handoff: it continues from T0.
    Consumer(ConsumerState),
}

/// A prefill pool's request (the producer's side of a handoff): the outputs it hands off with,
/// its handoff's transfer, and where it goes back to.
#[derive(Debug, Default)]
pub struct ProducerState {
    /// The outputs the request asked for: its handoff carries this many (T0 is the first).
    pub handoff_outputs: usize,
    /// Its logits-hash chain through T0 (what a handoff carries).
    pub t0_chain: Option<u64>,
    /// Once its handoff was sent: the transfer it awaits the ack of, and whether it was cancelled
    /// meanwhile (reported already; its memory goes with the ack).
    pub in_transfer: Option<TransferId>,
    pub aborted: bool,
    /// A request a decode rank asked for: where its handoff goes back to, and whether it still
    /// counts in the prefill pool's queue.
    pub back_to: Option<BackTo>,
    pub in_prefill_queue: bool,
}

/// A decode pool's request that arrived as a handoff (the consumer's side).
#[derive(Debug, Default)]
pub struct ConsumerState {
    /// Its handoff (which the rank holds) waits to be written in by the step that feeds T0: set
    /// at admission, cleared by its first launch (a request that started over before it
    /// recomputes instead). Its first decode feeds the producer's drafts, and it looks nothing
    /// up in the prefix cache.
    pub awaits_import: bool,
}

impl RequestKind {
    /// The producer's side, for a prefill pool's request.
    pub fn producer(&self) -> Option<&ProducerState> {
        match self {
            RequestKind::Producer(p) => Some(p),
            _ => None,
        }
    }

    pub fn producer_mut(&mut self) -> Option<&mut ProducerState> {
        match self {
            RequestKind::Producer(p) => Some(p),
            _ => None,
        }
    }

    pub fn is_producer(&self) -> bool {
        matches!(self, RequestKind::Producer(_))
    }

    /// A handed-off request whose handoff the step that feeds T0 has yet to write in.
    pub fn awaits_import(&self) -> bool {
        matches!(self, RequestKind::Consumer(ConsumerState { awaits_import: true }))
    }
}

/// A request's offload-tier state: its chunks' keys in the store, and a prefix loaded from it.
#[derive(Debug, Default)]
pub struct OffloadState {
    /// With an offload tier: the digests of the prompt's full chunks (the store's keys), set
    /// when the rank queues the request.
    pub chunk_digests: Vec<crate::offload::Digest>,
    /// A prefix loaded from the offload store, until the step that admits it writes it in.
    pub restored: Option<crate::offload::RestoredPrefix>,
    /// Tokens of `cached` restored from the offload store (counted when it is admitted).
    pub loaded_tokens: usize,
}

/// A request's speculative-decoding state: what was proposed, the drafts in flight, how well
/// its drafts did, the drafts a handoff carries, and the rewind a rejection asks for.
#[derive(Debug)]
pub struct SpecState {
    /// Speculative decoding: what `propose(t)` drafted after its last token, for the scheduler to
    /// book as many of as the width it earns allows (empty until then, and once booked).
    pub proposed: Vec<u32>,
    /// A verification rejected drafts: the position after which its state slot holds (its last
    /// token that held), restored from the copy the verifying step kept, before its next forward.
    pub rewind_to: Option<usize>,
    /// Speculative decoding: the drafts its step in flight verifies (fed after its last known
    /// token); empty when it has none in flight.
    pub drafts: Vec<u32>,
    /// The share of its drafts its recent verifications kept (1 until it has drafted): the
    /// width it drafts at follows it.
    pub draft_acceptance: f32,
    /// Drafts made from T0 by a producer's drafter: on the producer, what its handoff carries;
    /// on the consumer, what its first decode verifies.
    pub handed_drafts: Vec<u32>,
    /// Drafts the executor's MTP pass proposed when it sampled the last known token (the `mtp`
    /// drafter), for the next step.
    pub model_drafts: Vec<u32>,
}

impl Default for SpecState {
    fn default() -> Self {
        SpecState {
            proposed: Vec::new(),
            rewind_to: None,
            drafts: Vec::new(),
            draft_acceptance: 1.0,
            handed_drafts: Vec::new(),
            model_drafts: Vec::new(),
        }
    }
}

/// A request running (or waiting) on a rank. The fields the scheduler reads every step come
/// first, in declaration order (`repr(C)`), so scheduling a decode reads two cache lines.
#[derive(Debug)]
#[repr(C)]
pub struct Sequence {
    /// Positions whose KV (and state) is computed or being computed by a launched step.
    pub computed: usize,
    pub prompt_len: usize,
    pub max_output_tokens: usize,
    /// The last step launched that feeds it (which reads and writes its memory).
    last_launched: u64,
    /// Tokens sampled by launched steps that have not completed.
    pub pending: PendingTokens,
    /// Prompt followed by every generated token whose value is known.
    pub tokens: Vec<u32>,
    pub blocks: BlockTable,
    pub slot: Option<SlotId>,
    /// Its slab index and generation (set by [`Sequences`]).
    pub key: SeqKey,
    pub warmup: bool,
    pub id: u64,
    /// How it picks its tokens.
    pub sampling: RequestSampling,
    /// How its tokens go out: stop tokens, streaming, and when they became known.
    pub stream: StreamState,
    /// Tokens restored from the prefix cache at the last admission.
    pub cached: usize,
    pub preemptions: usize,
    /// Hash of the logits' bit patterns at every sampled position (for `--verify`).
    pub logits_hash: u64,
    /// When its first chunk ran (`wall_ms`; queueing ends then).
    pub started_ms: Option<f64>,
    /// Prompt tokens reused from the prefix cache at its first admission.
    pub first_cached: usize,
    /// Chained hashes of the prompt's full blocks (the prefix cache's keys), set when the rank
    /// queues the request.
    pub prompt_hashes: Vec<u64>,
    /// Whole, or one side of a P/D handoff (with that side's state).
    pub kind: RequestKind,
    /// The offload tier's state.
    pub offload: OffloadState,
    /// Speculative decoding's state.
    pub spec: SpecState,
}

impl Sequence {
    pub fn new(id: u64, mut prompt: Vec<u32>, max_output_tokens: usize, warmup: bool) -> Self {
        let prompt_len = prompt.len();
        prompt.reserve_exact(max_output_tokens); // outputs are pushed one per step: no regrowth
        Sequence {
            id,
            sampling: RequestSampling::default(),
            stream: StreamState::default(),
            key: SeqKey { index: u32::MAX, generation: VACANT },
            tokens: prompt,
            prompt_len,
            max_output_tokens,
            computed: 0,
            cached: 0,
            pending: PendingTokens::default(),
            last_launched: NONE,
            blocks: BlockTable::new(),
            slot: None,
            preemptions: 0,
            logits_hash: kvflow_kernels::hash::EMPTY,
            warmup,
            started_ms: None,
            first_cached: 0,
            prompt_hashes: Vec::new(),
            kind: RequestKind::Whole,
            offload: OffloadState::default(),
            spec: SpecState::default(),
        }
    }

    /// Whether it brings its prompt's first blocks with it (a handoff, or a prefix loaded from
    /// the offload store): an admission then looks nothing up in the prefix cache.
    pub fn brings_prefix(&self) -> bool {
        self.kind.awaits_import() || self.offload.restored.is_some()
    }

    /// The last step launched that feeds it.
    pub fn last_launched(&self) -> Option<u64> {
        (self.last_launched != NONE).then_some(self.last_launched)
    }

    /// Step `t` was launched and feeds it.
    pub fn launched_at(&mut self, t: u64) {
        self.last_launched = t;
    }

    /// Forgets its launches (it let go of its memory); returns the last one.
    pub fn take_last_launched(&mut self) -> Option<u64> {
        let last = self.last_launched();
        self.last_launched = NONE;
        last
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

    /// Every output token is known, or the last one is a stop token: the request is done.
    pub fn finished(&self) -> bool {
        self.output_len() >= self.max_output_tokens
            || (self.output_len() > 0 && self.tokens.last().is_some_and(|&t| self.stream.delivery.stops_at(t)))
    }

    /// Tokens still to compute, counting every output not yet launched (the router's load).
    pub fn outstanding_tokens(&self) -> usize {
        self.remaining() + self.max_output_tokens.saturating_sub(self.output_len() + self.pending.len())
    }

    /// The step that samples the token at `position`, if that is the newest token in flight
    /// (the only one ever fed before it is known).
    pub fn pending_step(&self, position: usize) -> Option<u64> {
        (position + 1 == self.known_len()).then(|| self.pending.newest()).flatten()
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
        if !self.pending.is_empty() && self.computed + 1 != self.known_len() {
            return Err(format!(
                "request {}: {} token(s) in flight but {} of {} positions fed",
                self.id,
                self.pending.len(),
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
    /// In place, so the scheduler walks contiguous memory; a free slot holds a vacant sequence
    /// (generation 0, which no held sequence has).
    slots: Vec<Sequence>,
    free: Vec<usize>,
    by_id: HashMap<u64, usize>,
    next_generation: u32,
}

/// The generation of a free slot.
const VACANT: u32 = 0;

impl Sequences {
    pub fn insert(&mut self, mut seq: Sequence) -> usize {
        let id = seq.id;
        let index = self.free.pop().unwrap_or_else(|| {
            self.slots.push(Sequence::new(u64::MAX, Vec::new(), 0, false));
            self.slots.len() - 1
        });
        seq.key = SeqKey { index: index as u32, generation: self.bump() };
        self.slots[index] = seq;
        self.by_id.insert(id, index);
        index
    }

    fn bump(&mut self) -> u32 {
        self.next_generation = self.next_generation.wrapping_add(1).max(VACANT + 1);
        self.next_generation
    }

    /// Gives the sequence at `index` a new generation (it starts over): completions for the old
    /// one no longer reach it.
    pub fn renew(&mut self, index: usize) {
        let generation = self.bump();
        self.get_mut(index).key.generation = generation;
    }

    pub fn remove(&mut self, index: usize) -> Sequence {
        let seq = std::mem::replace(&mut self.slots[index], Sequence::new(u64::MAX, Vec::new(), 0, false));
        debug_assert_ne!(seq.key.generation, VACANT, "removing a free slot");
        self.by_id.remove(&seq.id);
        self.free.push(index);
        seq
    }

    pub fn index_of(&self, id: u64) -> Option<usize> {
        self.by_id.get(&id).copied()
    }

    /// The sequence `key` names, if it is still held in that generation.
    pub fn by_key_mut(&mut self, key: SeqKey) -> Option<&mut Sequence> {
        self.slots.get_mut(key.index as usize).filter(|s| s.key == key && key.generation != VACANT)
    }

    /// The sequence held in slab slot `index`, whatever its generation.
    pub fn held_at_mut(&mut self, index: usize) -> Option<&mut Sequence> {
        self.slots.get_mut(index).filter(|s| s.key.generation != VACANT)
    }

    /// The held sequence at `index` (the scheduler's indices always name held ones).
    #[inline]
    pub fn get(&self, index: usize) -> &Sequence {
        debug_assert_ne!(self.slots[index].key.generation, VACANT, "slot {index} is free");
        &self.slots[index]
    }

    #[inline]
    pub fn get_mut(&mut self, index: usize) -> &mut Sequence {
        debug_assert_ne!(self.slots[index].key.generation, VACANT, "slot {index} is free");
        &mut self.slots[index]
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Sequence> {
        self.slots.iter().filter(|s| s.key.generation != VACANT)
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Sequence> {
        self.slots.iter_mut().filter(|s| s.key.generation != VACANT)
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
        seq.pending.push(10); // step 10 samples the first output
        assert_eq!((seq.known_len(), seq.remaining()), (4, 1), "a decode can feed it before it is known");
        assert_eq!(seq.pending_step(3), Some(10));
        seq.computed = 4;
        seq.pending.push(11);
        assert_eq!(seq.pending_step(4), Some(11), "the next decode names the newest token in flight");
        seq.computed = 5;
        seq.pending.push(12);
        assert!(seq.all_outputs_launched());
        assert_eq!(seq.remaining(), 0, "the final output token is never fed");
        assert!(!seq.finished());
        assert_eq!(seq.outstanding_tokens(), 0);
        assert!(seq.check(16, false).is_ok());
        assert!(!seq.pending.pop(13), "no step after the newest samples it");
        assert!(seq.pending.pop(10) && seq.pending.pop(11) && seq.pending.pop(12));
        assert!(seq.pending.is_empty() && !seq.pending.pop(12), "nothing is left in flight");
    }

    #[test]
    fn only_a_handed_off_request_awaiting_its_import_brings_its_prefix() {
        let mut seq = Sequence::new(1, vec![1, 2], 2, false);
        assert!(matches!(seq.kind, RequestKind::Whole), "a request is whole until admission says otherwise");
        assert!(!seq.kind.is_producer() && !seq.brings_prefix());
        seq.kind = RequestKind::Consumer(ConsumerState { awaits_import: true });
        assert!(seq.brings_prefix(), "its handoff brings the prompt's blocks: no prefix lookup");
        seq.kind = RequestKind::Consumer(ConsumerState { awaits_import: false });
        assert!(!seq.brings_prefix(), "once its first decode launched it decodes like any request");
        seq.kind = RequestKind::Producer(ProducerState { handoff_outputs: 4, ..ProducerState::default() });
        assert_eq!(seq.kind.producer().map(|p| p.handoff_outputs), Some(4));
        assert!(!seq.kind.awaits_import());
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
