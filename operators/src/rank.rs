//! The state one rank owns — model cache, memory, sequences, scheduler — and the two things a
//! step does with it: decide the batch (`schedule`) and run it (`execute`). Shared by the
//! `schedule` and `forward` operators of the rank's worker (`Rc<RefCell<_>>`: same thread).

use crate::messages::{wall_ms, Admission, Event, RankReport};
use crate::policy::memory::{MemoryLayout, RankMemory};
use crate::policy::scheduler::{snapshot_boundaries, Chunk, Scheduler, SchedulerConfig, StepDecision};
use crate::policy::sequence::{Sequence, Sequences};
use kvflow_kernels::cpu::sampling::argmax;
use kvflow_kernels::hash;
use kvflow_kernels::models::{LogitsWanted, Model, SeqInput};
use std::collections::HashMap;
use std::sync::Arc;

/// Counters a rank keeps over the run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankStats {
    pub steps: u64,
    pub empty_steps: u64,
    pub forward_tokens: u64,
    pub preemptions: u64,
    pub prefix_lookups: u64,
    pub prefix_hit_blocks: u64,
    /// When each step ran (`wall_ms`), for measuring step cost in steady state.
    pub step_ms: Vec<f64>,
    /// Sampled at every step with work: fraction of KV blocks, state slots and snapshots in use,
    /// and the batch (sequences, tokens).
    pub samples: UtilizationSamples,
}

/// Per-step samples of a rank's memory use and batch size.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UtilizationSamples {
    pub kv: Vec<f32>,
    pub slots: Vec<f32>,
    pub snapshots: Vec<f32>,
    pub batch_seqs: Vec<u32>,
    pub batch_tokens: Vec<u32>,
}

/// Test-only switches, each removing or breaking exactly one mechanism so a test can show that
/// the check guarding it fails (see tests/GUARANTEES.md). All off by default.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TestSwitches {
    /// Requests whose id is a multiple of this read their KV through a block table with its
    /// first two entries swapped on every decode step (to show `--verify` catches a wrong read).
    pub swap_block_table_every: Option<u64>,
    /// Cancels request `id` through the pool's cancellation path as soon as the rank holding it
    /// sees it in `stage` ("queued", "prefilling" or "decoding"): deterministic cancellation
    /// points for tests.
    pub cancel_at_stage: Vec<(u64, String)>,
    /// `(operator, rank, step)`: that operator on that rank keeps a capability for that step
    /// forever, to show the stall watchdog names exactly it.
    pub hold_capability: Option<(String, usize, u64)>,
    /// `align` plans from the reports it has instead of waiting for the frontier to pass the
    /// step (removes the collective-alignment mechanism).
    pub align_without_waiting: bool,
    /// `(rank, step)`: that rank's forward sleeps (for an hour) inside step `step`, to show the
    /// stall watchdog notices a worker stuck inside an operator.
    pub stuck_in_forward: Option<(usize, u64)>,
}

impl TestSwitches {
    /// The step at which `operator` on `rank` must hold its capability, if any.
    pub fn hold_at(&self, operator: &str, rank: usize) -> Option<u64> {
        self.hold_capability.as_ref().filter(|(o, r, _)| o == operator && *r == rank).map(|(_, _, t)| *t)
    }
}

/// What runs a rank's batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Executor {
    /// The CPU reference executor: the model's real math.
    Cpu,
    /// No math: every sampled token is 0. Only for measuring what coordination costs
    /// (`kvflow bench step`); outputs are meaningless.
    Null,
}

pub struct Rank {
    pub index: usize,
    executor: Executor,
    switches: TestSwitches,
    model: Arc<Model>,
    pub memory: RankMemory,
    pub scheduler: Scheduler,
    seqs: Sequences,
    /// The batch decided at `schedule(t)`, run at `forward(t)`.
    decided: StepDecision,
    pub stats: RankStats,
}

impl Rank {
    pub fn new(index: usize, model: Arc<Model>, layout: MemoryLayout, config: SchedulerConfig) -> Self {
        let cache = model.new_cache(
            layout.block_size,
            if layout.keeps_kv { layout.blocks } else { 0 },
            layout.slots,
            layout.snapshots,
        );
        Rank {
            index,
            model,
            memory: RankMemory::new(layout, cache),
            scheduler: Scheduler::new(config),
            seqs: Sequences::default(),
            decided: StepDecision::default(),
            stats: RankStats::default(),
            switches: TestSwitches::default(),
            executor: Executor::Cpu,
        }
    }

    pub fn with_executor(mut self, executor: Executor) -> Self {
        self.executor = executor;
        self
    }

    pub fn with_switches(mut self, switches: TestSwitches) -> Self {
        self.switches = switches;
        self
    }

    /// Queues a request routed to this rank.
    pub fn admit(&mut self, a: Admission) {
        let mut seq = Sequence::new(a.id, a.prompt, a.max_output_tokens, a.warmup);
        if self.scheduler.config.prefix_cache {
            seq.prompt_hashes = self.memory.prompt_hashes(&seq);
        }
        let index = self.seqs.insert(seq);
        self.scheduler.enqueue(index);
    }

    pub fn outstanding_tokens(&self) -> usize {
        self.seqs.iter().map(Sequence::outstanding_tokens).sum()
    }

    /// Where a request it holds stands: "queued", "prefilling" or "decoding".
    fn stage(&self, index: usize) -> &'static str {
        let seq = self.seqs.get(index);
        if !self.scheduler.running().contains(&index) {
            "queued"
        } else if seq.computed < seq.prompt_len {
            "prefilling"
        } else {
            "decoding"
        }
    }

    /// Frees every request of `ids` this rank holds, wherever it stands, and reports each as
    /// cancelled with what it had produced. Ids it does not hold are someone else's (or done).
    pub fn cancel(&mut self, ids: &[u64]) -> Vec<Event> {
        let mut events = Vec::new();
        for &id in ids {
            let Some(index) = self.seqs.index_of(id) else { continue };
            let stage = self.stage(index);
            self.scheduler.forget(index);
            let mut seq = self.seqs.remove(index);
            self.memory.release(&mut seq);
            events.push(Event::Failed {
                id,
                rank: self.index,
                cause: "cancelled".into(),
                message: format!("cancelled while {stage}"),
                tokens: seq.tokens.split_off(seq.prompt_len),
                token_ms: std::mem::take(&mut seq.token_ms),
                started_ms: seq.started_ms,
            });
        }
        events
    }

    /// Decides this rank's batch for the coming step and reports it.
    pub fn schedule(&mut self) -> RankReport {
        self.decided = self.scheduler.schedule(&mut self.seqs, &mut self.memory);
        let mut cancels = Vec::new();
        if !self.switches.cancel_at_stage.is_empty() {
            let due: Vec<u64> = self
                .switches
                .cancel_at_stage
                .iter()
                .filter(|(id, stage)| self.seqs.index_of(*id).is_some_and(|i| self.stage(i) == stage))
                .map(|(id, _)| *id)
                .collect();
            self.switches.cancel_at_stage.retain(|(id, _)| !due.contains(id));
            cancels = due;
        }
        RankReport {
            rank: self.index,
            scheduled_tokens: self.decided.chunks.iter().map(|c| c.len).sum(),
            scheduled_seqs: self.decided.chunks.len(),
            outstanding_tokens: self.outstanding_tokens(),
            waiting: self.scheduler.num_waiting(),
            running: self.scheduler.num_running(),
            admissions: Vec::new(),
            cancels,
        }
    }

    /// Runs the decided batch (an idle rank runs the empty step: on the CPU executor, nothing),
    /// samples, advances every sequence, and returns what happened.
    pub fn execute(&mut self) -> Vec<Event> {
        if self.switches.stuck_in_forward == Some((self.index, self.stats.steps)) {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
        let decided = std::mem::take(&mut self.decided);
        let mut events = Vec::new();
        self.stats.steps += 1;
        self.stats.step_ms.push(wall_ms());
        self.stats.preemptions += decided.preempted.len() as u64;
        for (id, message) in decided.failed.iter().cloned() {
            events.push(Event::Failed {
                id,
                rank: self.index,
                cause: "does-not-fit".into(),
                message,
                tokens: Vec::new(),
                token_ms: Vec::new(),
                started_ms: None,
            });
        }
        let now = wall_ms();
        for &(id, cached) in &decided.admitted {
            let index = self.seqs.index_of(id).expect("admitted requests exist");
            let seq = self.seqs.get_mut(index);
            if seq.started_ms.is_none() {
                seq.started_ms = Some(now);
                seq.first_cached = cached;
            }
        }
        if decided.chunks.is_empty() {
            self.stats.empty_steps += 1;
            return events;
        }
        self.sample(&decided);
        self.stats.forward_tokens += decided.chunks.iter().map(|c| c.len as u64).sum::<u64>();
        if self.executor == Executor::Null {
            let zeros = [0.0f32; 1];
            let now = wall_ms();
            for chunk in &decided.chunks {
                self.advance(chunk, chunk.sample.then_some(&zeros[..]), now, &mut events);
            }
            return events;
        }
        let swapped: HashMap<usize, Vec<u32>> = decided
            .chunks
            .iter()
            .filter_map(|c| {
                let every = self.switches.swap_block_table_every?;
                let s = self.seqs.get(c.seq);
                let decode = c.len == 1 && c.start >= s.prompt_len;
                (s.id % every == 0 && decode && s.blocks.len() >= 3).then(|| {
                    let mut t = s.blocks.blocks().to_vec();
                    t.swap(0, 1);
                    (c.seq, t)
                })
            })
            .collect();
        let batch: Vec<SeqInput> = decided
            .chunks
            .iter()
            .map(|c| {
                let s = self.seqs.get(c.seq);
                SeqInput {
                    tokens: &s.tokens[c.start..c.start + c.len],
                    start_pos: c.start,
                    block_table: swapped.get(&c.seq).map_or(s.blocks.blocks(), |t| &t[..]),
                    slot: s.slot,
                    prompt_len: s.prompt_len,
                    logits: if c.sample { LogitsWanted::Last } else { LogitsWanted::None },
                }
            })
            .collect();
        let out = self.model.forward(&batch, &mut self.memory.cache);
        drop(batch);
        let now = wall_ms();
        for (i, chunk) in decided.chunks.iter().enumerate() {
            self.advance(chunk, out.last(i), now, &mut events);
        }
        events
    }

    fn sample(&mut self, decided: &StepDecision) {
        let used = |total: usize, free: usize| if total == 0 { 0.0 } else { (total - free) as f32 / total as f32 };
        let m = &self.memory;
        let s = &mut self.stats.samples;
        s.kv.push(used(m.pool.num_blocks(), m.pool.num_free()));
        s.slots.push(used(m.cache.states.num_slots(), m.cache.states.num_free_slots()));
        s.snapshots.push(used(m.cache.states.num_snapshots(), m.cache.states.num_free_snapshots()));
        s.batch_seqs.push(decided.chunks.len() as u32);
        s.batch_tokens.push(decided.chunks.iter().map(|c| c.len as u32).sum());
    }

    /// Moves a sequence past its chunk: cache its full prompt blocks (and snapshots), sample,
    /// finish.
    fn advance(&mut self, chunk: &Chunk, logits: Option<&[f32]>, now: f64, events: &mut Vec<Event>) {
        let bs = self.memory.layout.block_size;
        let seq = self.seqs.get_mut(chunk.seq);
        let before = seq.computed;
        seq.computed += chunk.len;
        seq.check(bs, self.memory.layout.keeps_kv);
        if self.scheduler.config.prefix_cache && before < seq.prompt_len {
            let hashes = &seq.prompt_hashes;
            let done_blocks = seq.computed.min(seq.prompt_len) / bs;
            for (b, h) in hashes.iter().enumerate().take(done_blocks).skip(before / bs) {
                let block = self.memory.layout.keeps_kv.then(|| seq.blocks.blocks()[b]);
                self.memory.prefix.insert_block(*h, block, &mut self.memory.pool);
            }
            let at_boundary = snapshot_boundaries(seq.prompt_len, bs, self.scheduler.config.snapshot_interval_blocks)
                .contains(&seq.computed);
            if let (true, Some(slot)) = (at_boundary, seq.slot) {
                let h = hashes[seq.computed / bs - 1];
                if !self.memory.prefix.has_snapshot(h) && self.memory.layout.snapshots > 0 {
                    if self.memory.cache.states.num_free_snapshots() == 0 {
                        self.memory.prefix.evict_snapshot(&mut self.memory.cache.states);
                    }
                    if let Ok(snap) = self.memory.cache.states.snapshot(slot) {
                        self.memory.prefix.insert_snapshot(h, snap, &mut self.memory.cache.states);
                    }
                }
            }
        }
        let Some(logits) = logits else { return };
        let token = argmax(logits);
        seq.logits_hash = hash::logits_bits(seq.logits_hash, logits);
        seq.tokens.push(token);
        seq.token_ms.push(now);
        if seq.finished() {
            let mut seq = self.seqs.remove(chunk.seq);
            self.memory.release(&mut seq);
            self.scheduler.forget(chunk.seq);
            events.push(Event::Finished {
                id: seq.id,
                rank: self.index,
                tokens: seq.tokens.split_off(seq.prompt_len),
                token_ms: std::mem::take(&mut seq.token_ms),
                started_ms: seq.started_ms.unwrap_or_else(wall_ms),
                cached_tokens: seq.first_cached,
                logits_hash: seq.logits_hash,
                preemptions: seq.preemptions,
            });
        }
    }

    /// End of run: drops the prefix cache's references and checks that every block, slot and
    /// snapshot is free and no request is left behind.
    pub fn finish_run(&mut self) -> Result<RankStats, String> {
        self.stats.prefix_lookups = self.memory.prefix.lookups;
        self.stats.prefix_hit_blocks = self.memory.prefix.hit_blocks;
        self.memory.clear_prefix_cache();
        if !self.seqs.is_empty() {
            return Err(format!(
                "rank {}: {} request(s) still held at the end of the run",
                self.index,
                self.seqs.len()
            ));
        }
        if !self.memory.all_free() {
            return Err(format!(
                "rank {}: memory leaked: {} of {} blocks free, {}/{} slots and {}/{} snapshots free",
                self.index,
                self.memory.pool.num_free(),
                self.memory.pool.num_blocks(),
                self.memory.cache.states.num_free_slots(),
                self.memory.cache.states.num_slots(),
                self.memory.cache.states.num_free_snapshots(),
                self.memory.cache.states.num_snapshots()
            ));
        }
        Ok(self.stats.clone())
    }
}
