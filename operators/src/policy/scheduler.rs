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
//! pool whose executor completes later still decodes one token per step.
//!
//! The policy decides and books memory ids; the state copies it needs (a new slot starts from
//! zero, a prefix hit restores a snapshot) go into the decision for the executor to apply.

use super::memory::RankMemory;
use super::sequence::{Sequence, Sequences};
use crate::step::StateOp;
use kvflow_kernels::kv::SnapshotId;
use std::collections::VecDeque;

/// The knobs of the policy (one per pool: the graph's `[scheduler]` table, with the pool's own
/// `[pool.scheduler]` over it, and `memory.snapshot_interval_blocks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_running: usize,
    pub max_batched_tokens: usize,
    pub chunk_tokens: usize,
    pub prefix_cache: bool,
    pub snapshot_interval_blocks: usize,
    /// When a waiting request may start (a pool's `admission`).
    pub admission: AdmissionPolicy,
    /// Speculative decoding (`[speculative]`): decodes carry drafts to verify.
    pub spec: Option<SpecConfig>,
}

/// Speculative decoding: a decoding sequence with nothing in flight feeds its last token and up
/// to `draft_tokens` drafts, which the step verifies (the width is fixed here, when the blocks
/// for it are reserved; nothing later may widen it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecConfig {
    pub draft_tokens: usize,
    pub drafter: super::drafter::Drafter,
    /// Test switch `widen_draft_buckets`: bucketing rounds a request's width up to a bucket,
    /// past what the scheduler fixed for it (removes "scheduled width").
    pub widen_buckets: bool,
}

impl SpecConfig {
    /// The widths a decode may draft at: powers of two up to `draft_tokens`, and it (for 4:
    /// 1, 2, 4).
    pub fn buckets(&self) -> impl Iterator<Item = usize> + '_ {
        (0..).map(|i| 1usize << i).take_while(|&w| w < self.draft_tokens).chain([self.draft_tokens])
    }

    /// Dynamic width from recent acceptance (`recent`: the share of its drafts a request's last
    /// verifications kept): the largest bucket within `limit` (what the request can still use)
    /// that is at most about what it would keep — 0 when it keeps next to nothing. Never more
    /// than `limit`: bucketing only shrinks.
    pub fn width(&self, recent: f32, limit: usize) -> usize {
        let want = (recent * self.draft_tokens as f32).ceil() as usize;
        if recent * (self.draft_tokens as f32) < 0.5 {
            return 0;
        }
        if self.widen_buckets {
            return self.buckets().find(|&w| w >= want.min(limit).max(1)).unwrap_or(self.draft_tokens);
        }
        self.buckets().filter(|&w| w <= want.max(1).min(limit)).max().unwrap_or(0)
    }
}

/// When a rank starts a waiting request (a pool's `admission` key).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AdmissionPolicy {
    /// Start it once its first chunk fits; when memory runs out later, the youngest running
    /// request is preempted and recomputed (the default).
    #[default]
    Optimistic,
    /// Start it only when the rank's KV blocks and slots can hold it to its end (prompt and every
    /// output token), counting what the requests it already runs will still need: no request
    /// is ever preempted, and the router sends work only to ranks that can hold it.
    Reserve,
}

impl AdmissionPolicy {
    pub const NAMES: &'static [&'static str] = &["optimistic", "reserve"];

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "optimistic" => Some(AdmissionPolicy::Optimistic),
            "reserve" => Some(AdmissionPolicy::Reserve),
            _ => None,
        }
    }
}

/// One sequence's work in a step (`seq` is its index in the rank's [`Sequences`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub seq: usize,
    /// The sequence's generation when the chunk was decided.
    pub key: crate::step::SeqKey,
    pub start: usize,
    pub len: usize,
    /// Sample a token after this chunk.
    pub sample: bool,
    /// The chunk's last token is still in flight: the one the sequence samples at this step.
    pub deferred: Option<u64>,
    /// The chunk feeds prompt tokens (prefix blocks and snapshots may follow from it).
    pub prefill: bool,
    /// "Verifies drafts": drafts fed after the chunk's last known token (`Sequence::drafts`),
    /// to verify: the chunk is `len - drafts` known tokens and then these.
    pub drafts: usize,
    /// "Drafter needs successor tokens": the drafter proposes from the token this chunk samples
    /// as soon as it is known — a producer's T0, whose drafts go with the handoff (the producer
    /// never verifies, so nothing else would hand its drafter that token). A separate fact from
    /// `drafts` (DESIGN §5, "drafter inputs explicit").
    pub drafter_successors: bool,
}

/// What `schedule` decided, beyond the chunks.
#[derive(Debug, Default, PartialEq)]
pub struct StepDecision {
    pub chunks: Vec<Chunk>,
    /// Requests (ids) that gave their memory back this step.
    pub preempted: Vec<u64>,
    /// Requests (ids) that can never run here, with the reason; already removed.
    pub failed: Vec<(u64, String)>,
    /// Requests (ids) admitted this step, with the prompt tokens restored from the prefix cache.
    pub admitted: Vec<(u64, usize)>,
    /// State copies to apply before the forward (new slots zeroed, prefix snapshots restored).
    pub state_ops: Vec<StateOp>,
    /// Snapshots the restores read, each with a reference taken (and its generation): the step
    /// owns them until it completes.
    pub restoring: Vec<(SnapshotId, u32)>,
}

impl StepDecision {
    /// Whether the step feeds nothing.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Empties it, keeping its buffers for the next step.
    pub fn clear(&mut self) {
        self.chunks.clear();
        self.preempted.clear();
        self.failed.clear();
        self.admitted.clear();
        self.state_ops.clear();
        self.restoring.clear();
    }
}

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

    /// [`Scheduler::schedule`] into `out` (emptied first; its buffers are reused).
    pub fn schedule_into(&mut self, seqs: &mut Sequences, mem: &mut RankMemory, t: u64, out: &mut StepDecision) {
        out.clear();
        out.chunks.reserve(self.running.len() + 8);
        let mut budget = self.config.max_batched_tokens;
        let bs = mem.layout.block_size;
        // 1. running requests, oldest first: decodes (one token), then prefill chunks
        let mut prefilling = Vec::new();
        for decodes in [true, false] {
            let mut i = 0;
            while budget > 0 {
                let index = if decodes {
                    match self.running.get(i) {
                        Some(&r) => r,
                        None => break,
                    }
                } else {
                    match prefilling.get(i) {
                        Some(&r) if self.running.contains(&r) => r,
                        Some(_) => {
                            i += 1;
                            continue;
                        }
                        None => break,
                    }
                };
                i += 1;
                let seq = seqs.get_mut(index);
                let remaining = seq.remaining();
                if decodes && remaining != 1 {
                    if remaining > 1 {
                        prefilling.push(index);
                    }
                    continue;
                }
                if !seq.drafts.is_empty() {
                    continue; // its drafts are being verified: where it goes on is not known yet
                }
                if remaining == 1 && budget > 1 {
                    if let Some(spec) = self.config.spec {
                        let fed = draft_into(seq, mem, spec, budget - 1);
                        if fed > 1 {
                            book(out, index, seq, fed, t);
                            budget -= fed;
                            continue;
                        }
                    }
                }
                // The common case: a decode whose next token fits in the blocks it holds.
                if remaining == 1 && (!mem.layout.keeps_kv || seq.computed < seq.blocks.len() * bs) {
                    book(out, index, seq, 1, t);
                    budget -= 1;
                    continue;
                }
                let len = self.chunk_len(seq, budget, bs);
                loop {
                    let seq = seqs.get_mut(index);
                    if mem.ensure_blocks(seq, seq.computed + len) {
                        book(out, index, seq, len, t);
                        budget -= len;
                        break;
                    }
                    // Out of blocks: the youngest running request gives its memory back.
                    let victim = self.running.pop().expect("this request is running");
                    budget += self.preempt(victim, seqs, mem, out);
                    if victim == index {
                        break;
                    }
                    if decodes {
                        i = i.min(self.running.len());
                    }
                }
            }
        }
        // 2. admissions, in arrival order, while seats, budget and memory last
        while self.running.len() < self.config.max_running && budget > 0 {
            let Some(&index) = self.waiting.front() else { break };
            let seq = seqs.get_mut(index);
            let total = seq.prompt_len + seq.max_output_tokens;
            if mem.blocks_for(total) > mem.blocks.num_ids() {
                out.failed.push((
                    seq.id,
                    format!(
                        "needs {} KV blocks for {} tokens but the rank has {} (raise memory.budget_bytes)",
                        mem.blocks_for(total),
                        total,
                        mem.blocks.num_ids()
                    ),
                ));
                self.waiting.pop_front();
                seqs.remove(index);
                continue;
            }
            if self.config.admission == AdmissionPolicy::Reserve {
                // Only what the rank can hold to the end: the running requests' own ends first.
                let promised: usize = self.running.iter().map(|&r| mem.blocks_to_end(seqs.get(r))).sum();
                let seq = seqs.get(index);
                if mem.blocks_to_end(seq) + promised > mem.blocks.num_free() + mem.prefix.evictable_blocks(&mem.blocks)
                {
                    break;
                }
            }
            let seq = seqs.get_mut(index);
            if mem.layout.keeps_state {
                match mem.slots.allocate_for(seq.id) {
                    Ok(slot) => seq.slot = Some(slot),
                    Err(_) => break, // every slot is held (or pinned by a step in flight)
                }
            }
            // (A handoff or a loaded prefix brings its prompt's memory; it looks nothing up.)
            let snapshot =
                if self.config.prefix_cache && !seq.brings_prefix() { restore_prefix(seq, mem) } else { None };
            let len = self.chunk_len(seq, budget, mem.layout.block_size);
            if !mem.ensure_blocks(seq, seq.computed + len) {
                if seq.restored.is_some() {
                    // Keep the loaded prefix and its blocks; only the slot goes back.
                    if let Some(slot) = seq.slot.take() {
                        mem.slots.release(slot);
                    }
                    break;
                }
                mem.release(seq); // undo the prefix hit and the slot; try again next step
                if let Some(s) = snapshot {
                    mem.snapshots.release(s);
                }
                break;
            }
            if let Some(slot) = seq.slot {
                out.state_ops.push(match snapshot {
                    Some(snapshot) => StateOp::Restore { snapshot, slot },
                    None => StateOp::Zero { slot },
                });
            }
            out.restoring.extend(snapshot.map(|s| (s, mem.snapshots.generation(s))));
            out.admitted.push((seq.id, seq.cached));
            // A handed-off request's first decode: T0 and the producer's drafts.
            let len = match self.config.spec {
                Some(spec) if seq.import.is_some() && len == 1 && budget > 1 => draft_into(seq, mem, spec, budget - 1),
                _ => len,
            };
            book(out, index, seq, len, t);
            budget -= len;
            self.waiting.pop_front();
            self.running.push(index);
        }
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

    /// Marks the chunks whose sampled token the drafter needs as soon as it is known: with
    /// drafting on, a prefill-only request's chunk that samples T0 (`Chunk::drafter_successors`).
    pub fn mark_drafter_successors(&self, seqs: &Sequences, out: &mut StepDecision) {
        if self.config.spec.is_none() {
            return;
        }
        for c in &mut out.chunks {
            c.drafter_successors = c.sample && seqs.get(c.seq).handoff_outputs.is_some();
        }
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
    seq.proposed.clear();
    let drafts = seq.drafts.len();
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

/// Drafts a decode may still feed: up to `spec.draft_tokens`, within the outputs it has left
/// (its last output is never a draft) and not counting tokens in flight.
fn draft_limit(seq: &Sequence, spec: &SpecConfig) -> usize {
    let outputs_left = seq.max_output_tokens.saturating_sub(seq.output_len() + seq.pending.len());
    spec.draft_tokens.min(outputs_left.saturating_sub(1))
}

/// `propose(t)` for one sequence: when it decodes next with nothing in flight and has nothing
/// proposed, the drafter's proposal after its last token (`draft_limit` tokens at most) goes
/// into `seq.proposed`, for the scheduler to book at the width it earns. Returns how many.
pub fn propose_into(seq: &mut Sequence, spec: &SpecConfig) -> usize {
    let decodes = seq.computed >= seq.prompt_len && seq.handoff_outputs.is_none() && seq.import.is_none();
    let idle = seq.pending.is_empty() && seq.drafts.is_empty() && seq.proposed.is_empty();
    if !decodes || !idle || seq.remaining() != 1 || seq.finished() {
        return 0;
    }
    let limit = draft_limit(seq, spec);
    if limit > 0 {
        spec.drafter.propose(&seq.tokens, &seq.model_drafts, limit, &mut seq.proposed);
    }
    seq.proposed.len()
}

/// A decode with nothing in flight: books the drafts `propose` made for it at the width its
/// recent acceptance earns (`SpecConfig::width`, within `spec.draft_tokens`, the outputs it has
/// left and `room` tokens of the step's budget — the proposal's first ones: a shorter proposal
/// is its prefix) and reserves blocks for the last token and all of them. Returns the tokens the
/// chunk feeds (1 when it drafts nothing: no blocks for them, or no proposal); the drafts are in
/// `seq.drafts`.
fn draft_into(seq: &mut Sequence, mem: &mut RankMemory, spec: SpecConfig, room: usize) -> usize {
    let limit = draft_limit(seq, &spec).min(room);
    let mut drafts = std::mem::take(&mut seq.proposed);
    if !seq.pending.is_empty() || seq.computed < seq.prompt_len {
        return 1;
    }
    if seq.import.is_some() {
        // A handed-off request's first decode: T0 and the producer's drafts made from it, at
        // full width (the drafter that made them saw what this rank's may not: with MTP, the
        // producer's last hidden state).
        drafts = std::mem::take(&mut seq.handed_drafts);
        drafts.truncate(limit);
        if !drafts.is_empty() && !mem.ensure_blocks(seq, seq.computed + 1 + drafts.len()) {
            drafts.clear();
        }
        seq.drafts = drafts;
        return 1 + seq.drafts.len();
    }
    let width = spec.width(seq.draft_acceptance, limit);
    if width == 0 {
        // Not drafting while it keeps next to nothing; hope returns slowly, so it tries again.
        seq.draft_acceptance = (seq.draft_acceptance + 0.05).min(1.0);
        return 1;
    }
    drafts.truncate(width);
    // Blocks for every position the chunk writes; without them it decodes plainly (a draft never
    // preempts anyone).
    if drafts.is_empty() || !mem.ensure_blocks(seq, seq.computed + 1 + drafts.len()) {
        drafts.clear();
    }
    seq.drafts = drafts;
    1 + seq.drafts.len()
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

/// Reuses the longest cached prefix of the prompt: shares its blocks and, for recurrent state,
/// returns the snapshot at its end with a reference taken (both or neither), leaving at least one
/// prompt token to compute.
fn restore_prefix(seq: &mut Sequence, mem: &mut RankMemory) -> Option<SnapshotId> {
    let bs = mem.layout.block_size;
    let usable = seq.prompt_hashes.len().min((seq.prompt_len - 1) / bs);
    let in_flight_from = mem.in_flight_from();
    let hit = mem.prefix.lookup(&seq.prompt_hashes[..usable], &mut mem.blocks, in_flight_from);
    if hit.matched == 0 {
        return None;
    }
    for b in hit.blocks {
        seq.blocks.push(b);
    }
    seq.computed = hit.matched * bs;
    seq.cached = seq.computed;
    let snapshot = hit.snapshot.filter(|_| seq.slot.is_some())?;
    mem.snapshots.share(snapshot);
    Some(snapshot)
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

#[cfg(test)]
mod policy_tests {
    use super::*;
    use crate::policy::memory::MemoryLayout;

    fn memory(blocks: usize) -> RankMemory {
        RankMemory::new(MemoryLayout::kv_only(4, blocks))
    }

    fn config(max_batched_tokens: usize, chunk_tokens: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_running: 8,
            max_batched_tokens,
            chunk_tokens,
            prefix_cache: true,
            snapshot_interval_blocks: 4,
            admission: AdmissionPolicy::Optimistic,
            spec: None,
        }
    }

    fn add(s: &mut Scheduler, seqs: &mut Sequences, id: u64, prompt: Vec<u32>, out: usize) -> usize {
        let mut seq = Sequence::new(id, prompt, out, false);
        seq.prompt_hashes = super::super::prefix_cache::block_hashes(&seq.tokens, 4, 0);
        let index = seqs.insert(seq);
        s.enqueue(index);
        index
    }

    /// Pretends step `t` (booked by `schedule`) completed: token 7 arrives where it sampled.
    fn run(decision: &StepDecision, seqs: &mut Sequences, t: u64) {
        for c in &decision.chunks {
            let s = seqs.get_mut(c.seq);
            if c.sample {
                assert!(s.pending.pop(t));
                s.tokens.push(7);
            }
        }
    }

    fn chunk(seqs: &Sequences, seq: usize, start: usize, len: usize, sample: bool, prefill: bool) -> Chunk {
        Chunk {
            seq,
            key: seqs.get(seq).key,
            start,
            len,
            sample,
            deferred: None,
            prefill,
            drafts: 0,
            drafter_successors: false,
        }
    }

    #[test]
    fn reserve_admits_only_what_the_rank_can_hold_to_the_end_and_never_preempts() {
        // 8 blocks of 4 tokens. Each request needs 3 blocks to its end (8 prompt + 4 outputs).
        for (policy, admitted_at_first) in [(AdmissionPolicy::Optimistic, 3), (AdmissionPolicy::Reserve, 2)] {
            let config = SchedulerConfig { admission: policy, ..config(64, 4) };
            let (mut s, mut seqs, mut mem) = (Scheduler::new(config), Sequences::default(), memory(8));
            for id in 0..3 {
                add(&mut s, &mut seqs, id, (id as u32 * 10..id as u32 * 10 + 8).collect(), 4);
            }
            let mut preempted = 0;
            for t in 1..40 {
                let d = s.schedule(&mut seqs, &mut mem, t);
                if t == 1 {
                    assert_eq!(d.admitted.len(), admitted_at_first, "{policy:?}: first chunks fit for 3");
                }
                preempted += d.preempted.len();
                run(&d, &mut seqs, t);
                for id in 0..3 {
                    let Some(i) = seqs.index_of(id).filter(|&i| seqs.get(i).finished()) else { continue };
                    s.forget(i);
                    mem.release(seqs.get_mut(i));
                    seqs.remove(i);
                }
            }
            assert!(seqs.is_empty(), "{policy:?}: every request finished");
            if policy == AdmissionPolicy::Reserve {
                assert_eq!(preempted, 0, "reserve never preempts");
            } else {
                assert!(preempted > 0, "optimistic admission runs out and preempts");
            }
        }
    }

    #[test]
    fn prefill_is_chunked_and_the_budget_holds() {
        let (mut s, mut seqs, mut mem) = (Scheduler::new(config(6, 4)), Sequences::default(), memory(16));
        let a = add(&mut s, &mut seqs, 1, (0..10).collect(), 2);
        let b = add(&mut s, &mut seqs, 2, (0..10).collect(), 2);
        let d = s.schedule(&mut seqs, &mut mem, 1);
        assert_eq!(d.chunks, vec![chunk(&seqs, a, 0, 4, false, true), chunk(&seqs, b, 0, 2, false, true)]);
        run(&d, &mut seqs, 1);
        let d = s.schedule(&mut seqs, &mut mem, 2);
        assert_eq!(d.chunks.iter().map(|c| c.len).sum::<usize>(), 6);
    }

    #[test]
    fn decodes_go_first() {
        let (mut s, mut seqs, mut mem) = (Scheduler::new(config(8, 8)), Sequences::default(), memory(16));
        let a = add(&mut s, &mut seqs, 1, vec![1, 2, 3], 4);
        run(&s.schedule(&mut seqs, &mut mem, 1), &mut seqs, 1); // 1 prefilled and sampled: now decoding
        let b = add(&mut s, &mut seqs, 2, (0..20).collect(), 2);
        let d = s.schedule(&mut seqs, &mut mem, 2);
        assert_eq!(d.chunks[0], chunk(&seqs, a, 3, 1, true, false));
        assert_eq!(d.chunks[1].seq, b);
    }

    #[test]
    fn a_decode_follows_a_token_still_in_flight_every_step() {
        let (mut s, mut seqs, mut mem) = (Scheduler::new(config(8, 8)), Sequences::default(), memory(16));
        let a = add(&mut s, &mut seqs, 1, vec![1, 2, 3], 3);
        let d1 = s.schedule(&mut seqs, &mut mem, 1); // prefill; its first token is in flight
        assert_eq!(d1.chunks, vec![chunk(&seqs, a, 0, 3, true, true)]);
        // Steps 2 and 3 launch before step 1 completes: each names the token sampled before it.
        let d2 = s.schedule(&mut seqs, &mut mem, 2);
        assert_eq!(d2.chunks, vec![Chunk { deferred: Some(1), ..chunk(&seqs, a, 3, 1, true, false) }]);
        let d3 = s.schedule(&mut seqs, &mut mem, 3);
        assert_eq!(d3.chunks, vec![Chunk { deferred: Some(2), ..chunk(&seqs, a, 4, 1, true, false) }]);
        assert!(seqs.get(a).all_outputs_launched(), "three tokens in flight: all three outputs launched");
        assert!(s.schedule(&mut seqs, &mut mem, 4).is_empty(), "nothing more to launch until tokens arrive");
        for (t, d) in [(1, &d1), (2, &d2), (3, &d3)] {
            run(d, &mut seqs, t);
        }
        let seq = seqs.get(a);
        assert_eq!((seq.output_len(), seq.pending.len()), (3, 0));
        assert!(seq.check(4, true).is_ok());
    }

    #[test]
    fn the_youngest_running_request_is_preempted_when_blocks_run_out() {
        let (mut s, mut seqs, mut mem) = (Scheduler::new(config(64, 64)), Sequences::default(), memory(4));
        let a = add(&mut s, &mut seqs, 1, (0..8).collect(), 8); // 2 blocks, grows to 4
        let b = add(&mut s, &mut seqs, 2, (100..108).collect(), 8); // 2 blocks
        run(&s.schedule(&mut seqs, &mut mem, 1), &mut seqs, 1);
        assert_eq!(s.num_running(), 2);
        let d = s.schedule(&mut seqs, &mut mem, 2); // request 1 needs a third block: none is free
        assert_eq!(d.preempted, vec![2]);
        assert_eq!(seqs.get(b).computed, 0);
        assert_eq!(seqs.get(b).preemptions, 1);
        assert!(d.chunks.iter().all(|c| c.seq == a));
        assert_eq!(s.num_waiting(), 1);
    }

    #[test]
    fn a_request_that_can_never_fit_fails_instead_of_waiting_forever() {
        let (mut s, mut seqs, mut mem) = (Scheduler::new(config(64, 64)), Sequences::default(), memory(2));
        add(&mut s, &mut seqs, 1, (0..10).collect(), 4);
        let d = s.schedule(&mut seqs, &mut mem, 1);
        assert_eq!(d.failed.len(), 1);
        assert!(d.failed[0].1.contains("KV blocks"));
        assert!(s.is_idle());
    }

    #[test]
    fn a_decode_carries_drafts_only_with_nothing_in_flight_and_blocks_for_them() {
        let spec = SpecConfig {
            draft_tokens: 3,
            drafter: crate::policy::drafter::Drafter::Ngram(crate::policy::drafter::NgramDrafter {
                min_n: 1,
                max_n: 2,
            }),
            widen_buckets: false,
        };
        let config = SchedulerConfig { spec: Some(spec), ..config(64, 64) };
        let (mut s, mut seqs, mut mem) = (Scheduler::new(config), Sequences::default(), memory(16));
        let a = add(&mut s, &mut seqs, 1, vec![5, 6, 7, 5, 6], 8);
        let d = s.schedule(&mut seqs, &mut mem, 1);
        assert_eq!(d.chunks, vec![chunk(&seqs, a, 0, 5, true, true)], "the prompt first");
        run(&d, &mut seqs, 1); // samples 7: tokens 5 6 7 5 6 7
        assert_eq!(propose_into(seqs.get_mut(a), &spec), 3, "propose(1)");
        let d = s.schedule(&mut seqs, &mut mem, 2);
        assert_eq!(d.chunks, vec![Chunk { drafts: 3, ..chunk(&seqs, a, 5, 4, true, false) }]);
        assert_eq!(seqs.get(a).drafts, vec![5, 6, 7], "what followed the last 7 6... match");
        assert_eq!(seqs.get(a).computed, 6, "only the known token counts until the verification");
        assert!(seqs.get(a).blocks.len() * 4 >= 6 + 3, "blocks for every position the chunk writes");
        assert_eq!(propose_into(seqs.get_mut(a), &spec), 0, "nothing proposed while its drafts are verified");
        assert!(s.schedule(&mut seqs, &mut mem, 3).is_empty(), "not again while its drafts are verified");
        // The verification kept 1 draft (what `Rank::apply` does): on it goes, drafting again.
        let seq = seqs.get_mut(a);
        assert!(seq.pending.pop(2));
        seq.drafts.clear();
        seq.computed += 1;
        seq.tokens.extend([5, 9]);
        propose_into(seqs.get_mut(a), &spec);
        let d = s.schedule(&mut seqs, &mut mem, 4);
        assert_eq!(d.chunks[0].start, 7);
        assert!(d.chunks[0].drafts <= 1, "one output left after this token: at most one draft");
        // No free block for drafts: a plain decode, nobody preempted.
        let (mut s, mut seqs, mut mem) = (Scheduler::new(config), Sequences::default(), memory(3));
        let b = add(&mut s, &mut seqs, 2, vec![1, 2, 1, 2, 1, 2], 6); // 2 blocks now, 3 to its end
        add(&mut s, &mut seqs, 3, vec![9, 9, 9], 1); // holds the third block
        run(&s.schedule(&mut seqs, &mut mem, 1), &mut seqs, 1);
        propose_into(seqs.get_mut(b), &spec);
        let d = s.schedule(&mut seqs, &mut mem, 2);
        assert_eq!((d.chunks[0].len, d.chunks[0].drafts, d.preempted.len()), (1, 0, 0), "{:?}", d.chunks);
        assert!(seqs.get(b).proposed.is_empty(), "a proposal is used or dropped when the decode is booked");
        assert!(seqs.get(b).drafts.is_empty());
    }

    #[test]
    fn the_draft_width_is_a_bucket_that_never_exceeds_what_the_request_can_use() {
        // A property over random schedules: whatever the recent acceptance and the outputs left,
        // a chunk carries at most the scheduler's limit of drafts, at a configured width, with
        // blocks for every position it writes. With bucketing allowed to round up (test switch
        // `widen_draft_buckets`, "scheduled width" in docs/design.md §5) it does not hold.
        assert_eq!(first_width_violation(false), None);
        let widened = first_width_violation(true);
        assert!(widened.is_some(), "rounding buckets up must break the property");
    }

    /// The first schedule, over 300 random ones, that breaks the width property (a message).
    fn first_width_violation(widen_buckets: bool) -> Option<String> {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (rng >> 33) % n
        };
        for _ in 0..300 {
            let k = 1 + next(8) as usize;
            let drafter =
                crate::policy::drafter::Drafter::Ngram(crate::policy::drafter::NgramDrafter { min_n: 1, max_n: 2 });
            let spec = SpecConfig { draft_tokens: k, drafter, widen_buckets };
            let buckets: Vec<usize> = spec.buckets().collect();
            for recent in [0.0, 0.05, 0.3, 0.6, 1.0] {
                let limit = next(10) as usize;
                let w = spec.width(recent, limit);
                if !(w <= limit && w <= k && (w == 0 || buckets.contains(&w))) {
                    return Some(format!("k {k} recent {recent} limit {limit}: {w}"));
                }
                if recent == 1.0 && limit >= k {
                    assert_eq!(w, k, "full acceptance drafts at full width");
                }
            }
            let config = SchedulerConfig { spec: Some(spec), ..config(1 + next(40) as usize, 64) };
            let (mut s, mut seqs, mut mem) =
                (Scheduler::new(config), Sequences::default(), memory(8 + next(24) as usize));
            let outputs = 1 + next(12) as usize;
            let a = add(&mut s, &mut seqs, 1, (0..6).map(|i| (i % 2) as u32).collect(), outputs);
            for t in 1..30 {
                seqs.get_mut(a).draft_acceptance = next(11) as f32 / 10.0;
                propose_into(seqs.get_mut(a), &spec);
                let d = s.schedule(&mut seqs, &mut mem, t);
                for c in &d.chunks {
                    let seq = seqs.get(c.seq);
                    let left = seq.max_output_tokens - seq.output_len();
                    if !(c.drafts <= k && c.drafts < left.max(1)) {
                        return Some(format!("{c:?}: {left} outputs left"));
                    }
                    assert!(seq.blocks.len() * 4 >= c.start + c.len, "blocks for every position: {c:?}");
                    if c.len > config.max_batched_tokens {
                        return Some(format!("{c:?} over the step's budget"));
                    }
                }
                // The step completed: no draft kept, the token after the known one arrives.
                let Some(seq) = seqs.index_of(1).map(|i| seqs.get_mut(i)) else { break };
                if seq.pending.pop(t) {
                    seq.drafts.clear();
                    seq.tokens.push(1);
                }
                if seq.finished() {
                    break;
                }
            }
        }
        None
    }

    #[test]
    fn an_admission_reuses_cached_prompt_blocks() {
        let (mut s, mut seqs, mut mem) = (Scheduler::new(config(64, 64)), Sequences::default(), memory(16));
        let a = add(&mut s, &mut seqs, 1, (0..9).collect(), 1);
        let d = s.schedule(&mut seqs, &mut mem, 1);
        run(&d, &mut seqs, 1);
        // What the rank does after the step: cache the prompt's full blocks.
        let seq = seqs.get(a);
        let hashes = mem.prompt_hashes(seq);
        for (b, h) in hashes.iter().enumerate() {
            let block = seq.blocks.blocks()[b];
            mem.prefix.insert_block(*h, Some(block), &mut mem.blocks, 1);
        }
        let b = add(&mut s, &mut seqs, 2, (0..9).chain(50..53).collect(), 1);
        let d = s.schedule(&mut seqs, &mut mem, 2);
        assert_eq!(d.admitted, vec![(2, 8)]);
        assert_eq!(d.chunks.last().unwrap(), &chunk(&seqs, b, 8, 4, true, true));
        assert_eq!(seqs.get(b).blocks.blocks()[..2], seqs.get(a).blocks.blocks()[..2]);
    }
}
