//! The state one rank owns — its sequences, memory bookkeeping, scheduler, executor and the
//! records of its steps in flight — and what a step does with it:
//! 1. `schedule` (at `schedule(t)`): apply the completions that arrived, decide the batch, report;
//! 2. `launch` (at `forward(t)`): book the batch as launched — tokens in flight, prefix blocks
//!    published, snapshots asked for — and hand it to the executor, one phase at a time;
//! 3. `poll` (at `verify(t)`, and at `schedule` for what landed since): apply completions —
//!    sampled tokens and verifications (`spec`), finished requests, exported handoffs — in
//!    launch order, dropping (and counting) those for an older generation, and the acks of
//!    handoffs it sent and the completions of its offload saves and loads (queues raised by the
//!    consumer and the rank's save and load threads, which wake the rank: none of them gates a
//!    step);
//! 4. `propose` (at `propose(t)`, with `[speculative]`): drafts for the next step (`spec`).
//!
//! A step's record owns what the step reads until its completion returns it (see
//! `RankMemory::release`). Each feature's part of a rank is a struct of its own, there only when
//! the pool uses the feature: a producer's handoffs (`HandoffOut`), a consumer's (`HandoffIn`), a
//! deciding decode rank's remote prefills (`RemotePrefills`; all three in `handoff_state`), the
//! offload tier (`RankOffload`, in `offload_state`), the KV-aware index's reports. Shared by the
//! `schedule`, `forward`, `verify` and `propose` operators of the rank's worker (`Rc<RefCell<_>>`:
//! same thread).

mod complete;
mod disaggregate;
mod experts;
mod handoff;
mod handoff_state;
mod launch;
mod load;
mod offload;
mod offload_state;
mod recent_set;
mod spec;
mod stats;
mod step_summary;
mod stream;
mod switches;

pub use disaggregate::leave_queue;
pub use handoff_state::{DisaggregationRule, HandoffOut, PrefillTarget, RemotePrefill};
use handoff_state::{HandoffIn, RemotePrefills};
pub use offload_state::{OffloadSetup, OffloadStats, RankOffload};
pub use stats::{Distribution, GaugeValues, RankGauges, RankStats, SpecStats, StepTimes, Utilization, STEADY_SKIP};
pub use switches::{ExchangeSwitches, TestSwitches};

use crate::executor::Executor;
use crate::messages::{Admission, Event, RankReport};
use crate::policy::kv_index::{CacheChange, CacheEvent, CacheSnapshot, DEVICE};
use crate::policy::memory::{MemoryLayout, RankMemory};
use crate::policy::scheduler::{Scheduler, SchedulerConfig, StepDecision};
use crate::policy::sequence::{Sequence, Sequences};
use crate::pool::wake::RankWaker;
use crate::sim::clock::VirtualClock;
use crate::step::{SeqKey, StepCompletion};
use kvflow_kernels::kv::SnapshotId;
use std::collections::VecDeque;
use std::sync::Arc;

/// A launched step that has not completed: what it reads, so its completion can return it.
#[derive(Debug)]
struct StepRecord {
    step: u64,
    /// Every sequence the step feeds (in the generation it was launched for).
    seqs: Vec<SeqKey>,
    /// Those it samples, in batch order: its completion must report a token for each.
    sampling: Vec<SeqKey>,
    /// Snapshots its restores read, each holding a reference (with its generation).
    restoring: Vec<(SnapshotId, u32)>,
    /// Prefix-cache entries it publishes (dropped if the step fails).
    published: Vec<u64>,
    /// Its exports that are handoffs; the ones after them are offload saves.
    handoff_exports: usize,
    /// The sequences whose handoff export is a piece sent ahead when the step completes (`stream`).
    pieces: Vec<SeqKey>,
    /// Its exports (by index) that were pieces sent as it launched (`stream`).
    sent_at_launch: Vec<usize>,
    /// Those whose drafter proposes from the token the step samples (`Chunk::drafter_successors`).
    draft_from: Vec<SeqKey>,
}

/// A rank's reporting to the KV-aware routing index (router `kv-aware`).
#[derive(Debug)]
struct CacheReports {
    /// The last plan asked for its whole cache (its events came with a gap): its next report
    /// carries a snapshot instead of events.
    snapshot_owed: bool,
}

pub struct Rank {
    pub index: usize,
    pub pool: String,
    switches: TestSwitches,
    pub memory: RankMemory,
    pub scheduler: Scheduler,
    seqs: Sequences,
    executor: Box<dyn Executor>,
    waker: Arc<RankWaker>,
    /// Steps launched and not completed, in launch order.
    in_flight: VecDeque<StepRecord>,
    /// The batch decided at `schedule(t)`, launched at `forward(t)`, and that `t`.
    decided: StepDecision,
    decided_for: Option<u64>,
    /// The step `schedule` last ran for.
    step: u64,
    /// Events not yet emitted, each with the step whose output carries it.
    events: Vec<(u64, Event)>,
    completions: Vec<StepCompletion>,
    /// The newest step whose completion was applied.
    applied_through: Option<u64>,
    /// Buffers kept between steps: the keys a launch samples, and records' key lists.
    sampling: Vec<SeqKey>,
    spare_keys: Vec<Vec<SeqKey>>,
    /// What the accounting checks found.
    accounting: Vec<String>,
    pub stats: RankStats,
    /// Rank 0 under `admission = "reserve"`: admissions waiting for a rank that can hold them.
    deferred: Vec<Admission>,
    // Each feature's part of the rank: `None` unless the pool uses the feature.
    /// A prefill pool's rank (a producer): where its handoffs go, and those under way.
    handoff_out: Option<HandoffOut>,
    /// A decode pool's rank (a consumer): where arriving handoffs wait, and those taken that
    /// await their import.
    handoff_in: Option<HandoffIn>,
    /// A decode rank deciding where its new requests are prefilled, and its remote prefills.
    remote_prefill: Option<RemotePrefills>,
    /// The offload tier, when the graph has one.
    offload: Option<RankOffload>,
    /// Router `kv-aware`: this rank reports its cache events in its reports.
    cache_reports: Option<CacheReports>,
    /// Its memory and queues at its last `schedule`, for readers on other threads.
    gauges: Option<Arc<RankGauges>>,
}

impl Rank {
    pub fn new(
        index: usize,
        pool: &str,
        layout: MemoryLayout,
        config: SchedulerConfig,
        executor: Box<dyn Executor>,
        waker: Arc<RankWaker>,
    ) -> Self {
        Rank {
            index,
            pool: pool.to_string(),
            switches: TestSwitches::default(),
            memory: RankMemory::new(layout),
            scheduler: Scheduler::new(config),
            seqs: Sequences::default(),
            executor,
            waker,
            in_flight: VecDeque::new(),
            decided: StepDecision::default(),
            decided_for: None,
            step: 0,
            events: Vec::new(),
            completions: Vec::new(),
            applied_through: None,
            sampling: Vec::new(),
            spare_keys: Vec::new(),
            accounting: Vec::new(),
            stats: RankStats { rank: index, ..RankStats::default() },
            handoff_out: None,
            handoff_in: None,
            remote_prefill: None,
            deferred: Vec::new(),
            offload: None,
            cache_reports: None,
            gauges: None,
        }
    }

    /// Keeps every launched step's shape and times (`[report] steps`).
    pub fn logging_steps(mut self) -> Self {
        self.stats.steps_log = Some(Vec::new());
        self
    }

    /// Publishes its memory and queues into `gauges` at every `schedule`.
    pub fn with_gauges(mut self, gauges: Arc<RankGauges>) -> Self {
        self.gauges = Some(gauges);
        self
    }

    fn publish_gauges(&self) {
        let Some(g) = &self.gauges else { return };
        let m = &self.memory;
        let (total_blocks, total_slots) = (m.blocks.num_ids(), m.slots.num_ids());
        g.set(GaugeValues {
            used_blocks: total_blocks - m.blocks.num_free(),
            total_blocks,
            used_slots: total_slots - m.slots.num_free(),
            total_slots,
            waiting: self.scheduler.num_waiting(),
            running: self.scheduler.num_running(),
        });
        let remote_prefills = self.remote_prefill.iter().flat_map(|r| r.awaiting.keys());
        let relayed = self.handoff_out.iter().filter_map(|o| o.relayed.as_ref()).flat_map(|r| r.awaited.iter());
        g.set_awaited(self.seqs.iter().map(|s| s.id).chain(remote_prefills.chain(relayed).copied()));
    }

    /// Reports this rank's prefix cache (and offload tier) to the KV-aware routing index, as
    /// numbered events in its reports (router `kv-aware`).
    pub fn reporting_cache_events(mut self) -> Self {
        self.memory.prefix.publish_events(self.index as u32);
        self.cache_reports = Some(CacheReports { snapshot_owed: false });
        self
    }

    /// The cache events since the last report (the offload tier's among them), or — when the
    /// last plan asked (its events came with a gap) — the whole cache, which covers them.
    fn cache_report(&mut self) -> (Vec<CacheEvent>, Option<CacheSnapshot>) {
        if self.cache_reports.is_none() {
            return (Vec::new(), None);
        }
        self.report_offload_tier();
        let mut events = self.memory.prefix.take_events();
        if let Some(n) = self.switches.drop_cache_event_every.filter(|&n| n > 0) {
            events.retain(|e| e.seq % n != 0); // test switch: events lost on the way
        }
        if self.cache_reports.as_mut().is_some_and(|r| std::mem::take(&mut r.snapshot_owed)) {
            self.stats.index_resyncs += 1;
            return (Vec::new(), self.memory.prefix.events_snapshot());
        }
        self.stats.index_events += events.len() as u64;
        self.stats.index_offload_events += events
            .iter()
            .filter(|e| {
                !matches!(
                    e.change,
                    CacheChange::Stored { tier: DEVICE, .. } | CacheChange::Removed { tier: DEVICE, .. }
                )
            })
            .count() as u64;
        (events, None)
    }

    /// The plan named this rank among those whose events came with a gap.
    pub fn owe_cache_snapshot(&mut self) {
        if let Some(reports) = self.cache_reports.as_mut() {
            reports.snapshot_owed = true;
        }
    }

    /// Saves full prompt chunks to the offload tier's store, and loads prefixes back, through a
    /// save thread and a load thread of its own (the tier is a cache: if a thread cannot start,
    /// this rank uses no store, and says so).
    /// In a simulated run (`clock`) with a simulated store, both are workers on the virtual
    /// clock instead, the saves saying in `saves` until when they run.
    pub fn with_offload(
        mut self,
        setup: OffloadSetup,
        clock: Option<Arc<VirtualClock>>,
        saves: Option<Arc<crate::offload::SavesBusy>>,
    ) -> Self {
        use crate::offload::{clocked_loader, clocked_saver, spawn_loader, spawn_saver};
        use std::time::Duration;
        let (pool, index, waker) = (&self.pool, self.index, &self.waker);
        if let (Some(sim), Some(clock)) = (&setup.simulated, clock) {
            let busy = saves.unwrap_or_else(|| Arc::new(crate::offload::SavesBusy::new(sim.save_bytes_per_s)));
            let saver = clocked_saver(sim.clone(), clock.clone(), waker.clone(), index as u64, busy);
            let loader = clocked_loader(sim.clone(), clock, waker.clone(), index as u64);
            self.offload = Some(RankOffload::new(setup, saver, loader));
            return self;
        }
        let save_delay = Duration::from_millis(self.switches.slow_saves_ms);
        let load_delay = Duration::from_millis(self.switches.slow_loads_ms);
        let saver = spawn_saver(
            setup.store.clone(),
            setup.max_retries,
            waker.clone(),
            save_delay,
            format!("kvflow-save-{pool}-{index}"),
        );
        let loader =
            spawn_loader(setup.store.clone(), waker.clone(), load_delay, format!("kvflow-load-{pool}-{index}"));
        match saver.and_then(|s| loader.map(|l| (s, l))) {
            Ok((saver, loader)) => self.offload = Some(RankOffload::new(setup, saver, loader)),
            Err(e) => tracing::error!(pool = %self.pool, rank = self.index, "offload off on this rank: {e}"),
        }
        self
    }

    /// The offload tier's counters (zero without one).
    pub fn offload_stats(&self) -> OffloadStats {
        self.offload.as_ref().map(|o| o.stats.clone()).unwrap_or_default()
    }

    pub fn with_switches(mut self, switches: TestSwitches) -> Self {
        if let Some(spec) = self.scheduler.config.spec.as_mut() {
            spec.widen_buckets = switches.widen_draft_buckets;
        }
        self.switches = switches;
        self
    }

    /// Queues a request routed to this rank (an empty prompt, which nothing upstream lets
    /// through, fails at once).
    pub fn admit(&mut self, a: Admission) {
        if a.prompt.is_empty() {
            let event = Event::Failed {
                id: a.id,
                rank: self.index,
                cause: "bad-request".into(),
                message: "the prompt is empty (at least one token is needed)".into(),
                tokens: Vec::new(),
                token_times: Default::default(),
                started_ms: None,
            };
            self.events.push((self.step, event));
            return;
        }
        let Some(mut seq) = self.new_sequence(a) else { return };
        if self.scheduler.config.prefix_cache {
            seq.prompt_hashes = self.memory.prompt_hashes(&seq);
        }
        if let Some(off) = &self.offload {
            seq.offload.chunk_digests = off.chunk_digests(&seq, &self.memory.layout);
        }
        let index = self.seqs.insert(seq);
        if self.drops_prefill_silently(index) {
            return;
        }
        // A prefix the store holds beyond what this rank's cache does is loaded first; the
        // request is queued when its load completes.
        if !self.start_load(index) {
            self.scheduler.enqueue(index);
        }
    }

    pub fn outstanding_tokens(&self) -> usize {
        self.seqs.iter().map(Sequence::outstanding_tokens).sum()
    }

    /// Steps launched whose completion has not been applied.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The oldest step in flight, if any.
    pub fn oldest_in_flight(&self) -> Option<u64> {
        self.in_flight.front().map(|r| r.step)
    }

    /// Whether step `t` is launched and not completed.
    pub fn is_in_flight(&self, t: u64) -> bool {
        self.in_flight.iter().any(|r| r.step == t)
    }

    /// Whether this rank's step `t` (in flight) samples a token for some request: a step of
    /// middle prompt chunks only samples none, so it has nothing to draft from.
    pub fn samples_at(&self, t: u64) -> bool {
        self.in_flight.iter().any(|r| r.step == t && !r.sampling.is_empty())
    }

    /// Events to emit, each with the step whose output carries it.
    pub fn take_events(&mut self) -> Vec<(u64, Event)> {
        std::mem::take(&mut self.events)
    }

    /// Where a request it holds stands: "loading", "queued", "prefilling", "in transfer" or
    /// "decoding".
    fn stage(&self, index: usize) -> &'static str {
        let seq = self.seqs.get(index);
        if seq.kind.producer().is_some_and(|p| p.in_transfer.is_some()) {
            "in transfer"
        } else if self.is_loading(seq.key) {
            "loading"
        } else if !self.scheduler.running().contains(&index) {
            "queued"
        } else if seq.computed < seq.prompt_len {
            "prefilling"
        } else {
            "decoding"
        }
    }

    /// Whether request `index` stands at `stage` (test switch `cancel_at_stage`): one of
    /// [`Self::stage`]'s, or "between pieces" — prefilling with some of its handoff streamed
    /// ahead.
    fn at_stage(&self, index: usize, stage: &str) -> bool {
        let streamed = self.streaming(self.seqs.get(index).id);
        self.stage(index) == stage || (stage == "between pieces" && streamed && self.stage(index) == "prefilling")
    }

    /// Frees every request of `ids` this rank holds, wherever it stands (its steps in flight keep
    /// what they read until they complete), and reports each as cancelled with what it had
    /// produced. Ids it does not hold are someone else's (or done).
    pub fn cancel(&mut self, ids: &[u64]) {
        for &id in ids {
            let Some(index) = self.seqs.index_of(id) else {
                self.cancel_remote_prefill(id);
                self.abort_arriving(id);
                continue;
            };
            if self.seqs.get(index).kind.is_producer() && self.abort_in_transfer(index) {
                continue;
            }
            let stage = self.stage(index);
            self.fail(index, self.step, "cancelled", format!("cancelled while {stage}"));
        }
    }

    /// Ends a request it holds with `cause` (its memory released or pinned by its steps).
    fn fail(&mut self, index: usize, step: u64, cause: &str, message: String) {
        self.scheduler.forget(index);
        let mut seq = self.seqs.remove(index);
        self.handoff_ended(&mut seq);
        self.memory.release(&mut seq);
        self.events.push((
            step,
            Event::Failed {
                id: seq.id,
                rank: self.index,
                cause: cause.into(),
                message,
                tokens: seq.tokens.split_off(seq.prompt_len),
                token_times: seq.stream.token_times,
                started_ms: seq.started_ms,
            },
        ));
    }

    /// Decides this rank's batch for step `t` (after applying what completed) and reports it.
    pub fn schedule(&mut self, t: u64) -> RankReport {
        self.step = t;
        let (cache_events, cache_snapshot) = self.cache_report();
        self.waker.take(); // what raised it is polled now
        if self.poll() > 0 {
            // Landed since `verify(t − 1)`: proposed for here (what `propose(t − 1)` would have).
            self.propose();
        }
        self.decide_batch(t);
        if self.is_stuck() {
            // Nothing will wake this rank: memory freed now must be used now. A waiting
            // request's loaded prefix given back is decided on again in this step; only if that
            // finds nothing either is the rank truly unschedulable.
            let gave_back = self.drop_waiting_prefixes();
            if gave_back && !self.switches.no_reschedule_after_giving_back_prefixes {
                self.decide_batch_again(t);
            }
            if !gave_back || (!self.switches.no_reschedule_after_giving_back_prefixes && self.is_stuck()) {
                self.fail_unschedulable();
            }
        }
        let mut cancels = Vec::new();
        if !self.switches.cancel_at_stage.is_empty() {
            let due: Vec<u64> = self
                .switches
                .cancel_at_stage
                .iter()
                .filter(|(id, stage)| self.seqs.index_of(*id).is_some_and(|i| self.at_stage(i, stage)))
                .map(|(id, _)| *id)
                .collect();
            self.switches.cancel_at_stage.retain(|(id, _)| !due.contains(id));
            cancels = due;
        }
        self.publish_gauges();
        RankReport {
            rank: self.index,
            scheduled_tokens: self.decided.chunks.iter().map(|c| c.len).sum(),
            scheduled_seqs: self.decided.chunks.len(),
            outstanding_tokens: self.outstanding_tokens(),
            waiting: self.scheduler.num_waiting(),
            running: self.scheduler.num_running(),
            in_flight: self.in_flight.len()
                + self.awaiting_acks()
                + self.awaiting_ends()
                + self.awaiting_prefills()
                + self.offload.as_ref().map_or(0, RankOffload::in_flight),
            admissions: std::mem::take(&mut self.deferred),
            cancels,
            closing: false,
            capacity: self.capacity(),
            cache_events,
            cache_snapshot,
        }
    }

    /// Decides the batch of step `t` into `self.decided` — none while the executor holds as many
    /// steps in flight as it keeps (the rank decides again when one completes).
    fn decide_batch(&mut self, t: u64) {
        let bound = self.executor.max_in_flight().filter(|_| !self.switches.unbounded_steps_in_flight);
        if bound.is_some_and(|n| self.in_flight.len() >= n) {
            self.stats.steps_held_back += 1;
            self.decided_for = Some(t);
            return;
        }
        self.scheduler.schedule_into(&mut self.seqs, &mut self.memory, t, &mut self.decided);
        if let Some(handoff_in) = self.handoff_in.as_mut() {
            // The scheduler dropped the requests that can never fit: a handoff held for one goes too.
            for (id, _) in &self.decided.failed {
                handoff_in.imports.remove(id);
            }
        }
        self.scheduler.mark_drafter_successors(&self.seqs, &mut self.decided);
        if self.switches.drafter_successors_only_when_verifying {
            for c in &mut self.decided.chunks {
                c.drafter_successors = c.drafts > 0;
            }
        }
        self.decided_for = Some(t);
    }

    /// Decides step `t` a second time (after memory was freed), keeping what the first pass
    /// already did to requests: those it failed and those it preempted. (A first pass that
    /// booked no chunk admitted nothing and took no snapshot reference.)
    fn decide_batch_again(&mut self, t: u64) {
        let failed = std::mem::take(&mut self.decided.failed);
        let preempted = std::mem::take(&mut self.decided.preempted);
        debug_assert!(self.decided.admitted.is_empty() && self.decided.restoring.is_empty());
        self.decide_batch(t);
        self.decided.failed.splice(0..0, failed);
        self.decided.preempted.splice(0..0, preempted);
    }

    /// Whether nothing can run and nothing will change that by itself: no batch decided, no
    /// step in flight, no handoff awaiting its ack (which frees memory when it comes), no
    /// offload save or load in flight (they return memory when they complete), yet requests
    /// are held.
    fn is_stuck(&self) -> bool {
        let offload_busy = self.offload.as_ref().is_some_and(|o| o.in_flight() > 0);
        self.decided.is_empty()
            && self.in_flight.is_empty()
            && self.awaiting_acks() == 0
            && !offload_busy
            && !self.scheduler.is_idle()
    }

    /// Under `admission = "reserve"`: what this rank can still hold to the end for new requests
    /// (free blocks and slots less what the requests it holds will still need).
    fn capacity(&self) -> Option<crate::messages::Capacity> {
        if self.scheduler.config.admission != crate::policy::scheduler::AdmissionPolicy::Reserve {
            return None;
        }
        let m = &self.memory;
        let promised_blocks: usize = self.seqs.iter().map(|s| m.blocks_to_end(s)).sum();
        let slotless = self.seqs.iter().filter(|s| s.slot.is_none()).count();
        Some(crate::messages::Capacity {
            blocks: (m.blocks.num_free() + m.prefix.evictable_blocks(&m.blocks)).saturating_sub(promised_blocks),
            slots: if m.layout.keeps_state { m.slots.num_free().saturating_sub(slotless) } else { 0 },
            total_blocks: if m.layout.keeps_kv { m.blocks.num_ids() } else { 0 },
            block_size: if m.layout.keeps_kv { m.layout.block_size } else { 0 },
            needs_slot: m.layout.keeps_state,
        })
    }

    /// Rank 0: admissions no rank could hold yet, reported again at its next step.
    pub fn defer(&mut self, admissions: &[Admission]) {
        self.deferred.extend_from_slice(admissions);
    }

    /// Fails (on rank 0) the admissions the router could not place.
    pub fn reject_unroutable(&mut self, unroutable: &[(Admission, String)]) {
        for (a, why) in unroutable {
            let event = Event::Failed {
                id: a.id,
                rank: self.index,
                cause: "unroutable".into(),
                message: why.clone(),
                tokens: Vec::new(),
                token_times: Default::default(),
                started_ms: None,
            };
            self.events.push((self.step, event));
        }
    }

    /// Nothing can run and nothing is in flight: waiting requests that hold prefixes loaded from
    /// the offload store give them back (they recompute), so the head of the queue can start.
    /// Returns whether any did.
    fn drop_waiting_prefixes(&mut self) -> bool {
        let holding: Vec<usize> =
            self.scheduler.waiting().filter(|&i| self.seqs.get(i).offload.restored.is_some()).collect();
        let mut ids = Vec::with_capacity(holding.len());
        for &index in &holding {
            let seq = self.seqs.get_mut(index);
            ids.push(seq.id);
            self.memory.release(seq);
        }
        if !ids.is_empty() {
            // One line per time it happens, not one per request.
            let shown: Vec<String> = ids.iter().take(8).map(u64::to_string).collect();
            let more =
                if ids.len() > shown.len() { format!(" and {} more", ids.len() - shown.len()) } else { String::new() };
            tracing::warn!(
                pool = %self.pool,
                rank = self.index,
                "{} waiting request(s) give back the prefixes they loaded from the offload store (memory is short): \
                 they recompute (requests {}{more})",
                ids.len(),
                shown.join(", ")
            );
        }
        !ids.is_empty()
    }

    /// Nothing can run, nothing is in flight or awaiting an ack, yet requests are held: no completion will ever
    /// change that, so they fail now with what the rank holds, instead of waiting in silence.
    fn fail_unschedulable(&mut self) {
        let m = &self.memory;
        let why = format!(
            "cannot be scheduled on rank {} of pool {}: {} of {} KV blocks, {} of {} state slots free, nothing in flight",
            self.index,
            self.pool,
            m.blocks.num_free(),
            m.blocks.num_ids(),
            m.slots.num_free(),
            m.slots.num_ids()
        );
        tracing::error!(pool = %self.pool, rank = self.index, "{why}");
        let held: Vec<usize> = self.scheduler.running().iter().copied().chain(self.scheduler.waiting()).collect();
        for index in held {
            self.fail(index, self.step, "unschedulable", why.clone());
        }
    }

    /// The accounting check (DESIGN §7): every block, slot and snapshot is free or owned by a
    /// live request, an in-flight step or the prefix cache, and prefix blocks are kept only for
    /// handoffs the rank awaits. Run every time the pool parks with
    /// nothing in flight, and at the end of the run; what it finds is printed at once and fails
    /// the run at its end.
    pub fn check_accounting(&mut self, when: &str) {
        let restoring: Vec<SnapshotId> =
            self.in_flight.iter().flat_map(|r| r.restoring.iter().map(|&(s, _)| s)).collect();
        let mut problems = self.memory.audit(&self.seqs, &restoring);
        let (bs, kv) = (self.memory.layout.block_size, self.memory.layout.keeps_kv);
        problems.extend(self.seqs.iter().filter_map(|s| s.check(bs, kv).err()));
        problems.extend(self.reserved_without_awaited_prefill());
        for p in problems {
            let line = format!("pool {} rank {}, accounting check {when}: {p}", self.pool, self.index);
            tracing::error!("{line}");
            eprintln!("{line}");
            self.accounting.push(line);
        }
        self.stats.accounting_checks += 1;
    }

    /// End of run: completes what is in flight, checks the accounting, drops the prefix cache's
    /// references and checks that every block, slot and snapshot is free and no request is left.
    pub fn finish_run(&mut self) -> Result<RankStats, String> {
        // Saves still being written return their blocks when they end, and loads of requests
        // cancelled while loading end too (bounded: a store call that never returns is reported
        // below as blocks still held).
        for _ in 0..30_000 {
            if self.offload.as_ref().is_none_or(|o| o.in_flight() == 0) {
                break;
            }
            let jobs = self.take_save_jobs();
            self.submit_saves(jobs);
            if self.apply_saves() + self.apply_loads() == 0 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        if !self.in_flight.is_empty() {
            self.executor.flush();
            for _ in 0..10_000 {
                if self.poll() == 0 && !self.in_flight.is_empty() {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                if self.in_flight.is_empty() {
                    break;
                }
            }
        }
        self.check_accounting("at the end of the run");
        self.log_dropped_saves();
        self.stats.offload = self.offload_stats();
        self.stats.pool_wakes = self.waker.pool_wakes();
        self.stats.stale_releases = self.memory.stale_releases;
        self.stats.prefix_lookups = self.memory.prefix.lookups;
        self.stats.prefix_hit_blocks = self.memory.prefix.hit_blocks;
        self.memory.clear_prefix_cache();
        let mut problems = std::mem::take(&mut self.accounting);
        if !self.in_flight.is_empty() {
            problems.push(format!(
                "pool {} rank {}: {} step(s) never completed",
                self.pool,
                self.index,
                self.in_flight.len()
            ));
        }
        if self.awaiting_ends() > 0 {
            problems.push(format!(
                "pool {} rank {}: {} handed-off request(s) whose end never came back from the decode pool",
                self.pool,
                self.index,
                self.awaiting_ends()
            ));
        }
        if !self.seqs.is_empty() {
            problems.push(format!(
                "pool {} rank {}: {} request(s) still held at the end of the run",
                self.pool,
                self.index,
                self.seqs.len()
            ));
        }
        if problems.is_empty() && !self.memory.all_free() {
            let m = &self.memory;
            problems.push(format!(
                "pool {} rank {}: memory leaked: {}/{} blocks, {}/{} slots and {}/{} snapshots free",
                self.pool,
                self.index,
                m.blocks.num_free(),
                m.blocks.num_ids(),
                m.slots.num_free(),
                m.slots.num_ids(),
                m.snapshots.num_free(),
                m.snapshots.num_ids()
            ));
        }
        if problems.is_empty() {
            Ok(self.stats.clone())
        } else {
            Err(problems.join("\n"))
        }
    }
}
