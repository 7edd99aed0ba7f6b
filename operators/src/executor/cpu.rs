//! The CPU reference executor. [`CpuStepRunner`] owns the rank's model storage (paged KV, state
//! slots and snapshots) and runs a step phase by phase: state copies before, the model's layers,
//! sampling (greedy, or seeded: each sequence's `Sampler`) with the hash of each sampled logits
//! row, snapshots after. A sequence that feeds drafts is scored: a row after each token fed, each
//! draft checked against the row before it (greedy: the argmax; sampling: the speculative-sampling
//! rule) and the state after each position kept (`score_drafts`); `verify(t)` decides which hold,
//! and a rejection's rollback comes with the sequence's next launch (`StateOp::Rewind`, a copy of
//! the kept state). With the `mtp` drafter the MTP layer's passes follow sampling
//! (`super::mtp`; under expert parallelism as draft passes every rank joins). A decode whose
//! previous token was still in flight at launch names it by (sequence, step); the runner resolves
//! it from the tokens it sampled itself. The storage sits behind a `RwLock` that a phase of this
//! rank holds while it runs, shared with the saves that read a chunk's blocks in place (such a
//! reader waits for the phase). A handoff's blocks are copied out by the step that completes
//! its prompt (`KvExport::copy_out`), so its transfer never waits for this rank's later steps.
//! [`CpuExecutor`] runs it on the rank's own thread (`cpu`); `DeferredExecutor` on a thread of
//! its own (`cpu-deferred`).

use super::contract::{Executor, ExecutorContext, ExpertParallel, ExpertPlacement};
use super::gate::{CompletionGate, Delay};
use super::owned_step::OwnedStep;
use crate::messages::{ExpertPair, ExpertRows, Payload};
use crate::step::{
    BlockStore, DraftCheck, ExecutorError, Exported, KvExport, KvSource, Sampled, SeqKey, StateOp, StepCompletion,
    StepLaunch,
};
use kvflow_kernels::hash;
use kvflow_kernels::models::parts::moe::{expert_owner, expert_range};
use kvflow_kernels::models::{ForwardOutput, Model, ModelCache, RoutedRows, StepActivations};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

/// A step between its phases.
pub(super) struct Running {
    pub(super) step: OwnedStep,
    /// `Err` when the step cannot run (then no phase computes anything).
    pub(super) acts: Result<StepActivations, ExecutorError>,
    /// Expert parallel: the sequences (batch indices) that lost an expert result, with why.
    pub(super) failed: Vec<(usize, String)>,
    /// Expert parallel with the MTP drafter: the step sampled, its draft passes under way.
    pub(super) drafting: Option<super::mtp::Drafting>,
}

/// The model, the rank's storage, and the tokens it sampled.
pub struct CpuStepRunner {
    pub(super) model: Arc<Model>,
    /// Shared with the saves that read its blocks in place (`KvSource`; handoffs carry a copy).
    pub(super) cache: Arc<RwLock<ModelCache>>,
    /// Layers of each phase (from the model config).
    pub(super) phases: Vec<Range<usize>>,
    /// The step whose phases are running.
    pub(super) current: Option<Running>,
    /// The latest token each sequence sampled, and at which step.
    pub(super) sampled: HashMap<SeqKey, (u64, u32)>,
    /// Expert parallel: this rank's place, and the model's MoE layers `(layer, experts)`.
    pub(super) experts: Option<ExpertPlacement>,
    pub(super) moe_layers: Vec<(usize, usize)>,
    /// The `mtp` drafter: drafts proposed after each sampled token (0: no MTP pass).
    pub(super) mtp_drafts: usize,
    /// Expert parallel with the `mtp` drafter: the draft passes every step runs after its MoE
    /// layers (each an exchange of the MTP layer's experts), `mtp_drafts` or 0.
    pub(super) draft_passes: usize,
}

impl CpuStepRunner {
    pub fn new(ctx: &ExecutorContext) -> Self {
        CpuStepRunner {
            phases: ctx.model.phases().into_iter().map(|p| p.layers).collect(),
            cache: Arc::new(RwLock::new(ctx.new_cache())),
            model: ctx.model.clone(),
            current: None,
            sampled: HashMap::new(),
            experts: ctx.experts,
            moe_layers: ctx.model.moe_layers(),
            mtp_drafts: if ctx.model.mtp().is_some() { ctx.mtp_drafts } else { 0 },
            draft_passes: super::mtp::draft_passes(&ctx.model, ctx.experts.is_some(), ctx.mtp_drafts),
        }
    }

    pub fn phases(&self) -> usize {
        self.phases.len()
    }

    /// Runs phase `phase` of a step (the step itself comes with phase 0); returns the step's
    /// completion after its last phase.
    pub fn run_phase(&mut self, phase: usize, step: Option<OwnedStep>) -> Option<StepCompletion> {
        if let Some(mut step) = step {
            let acts = self.begin(&mut step);
            self.current = Some(Running { step, acts, failed: Vec::new(), drafting: None });
        }
        let Self { model, cache, phases, current, .. } = self;
        let running = current.as_mut()?;
        if self.experts.is_some() && !self.moe_layers.is_empty() {
            // Expert parallel: on to the first MoE layer's routing; `combine` runs the rest.
            if let Ok(acts) = running.acts.as_mut() {
                model.run_to_experts(acts, &mut cache.write());
            }
            return None;
        }
        if let (Ok(acts), Some(layers)) = (running.acts.as_mut(), phases.get(phase)) {
            model.run_layers(acts, layers.clone(), &mut cache.write());
        }
        if phase + 1 < phases.len() {
            return None;
        }
        self.complete()
    }

    /// Ends the step in progress: the LM head, sampling, snapshots and exports.
    pub(super) fn complete(&mut self) -> Option<StepCompletion> {
        let Running { step, acts, failed, drafting } = self.current.take()?;
        let result = match (drafting, acts) {
            // With draft passes the step sampled before them.
            (Some(drafting), _) => Ok(drafting.into_sampled()),
            (None, Err(e)) => Err(e),
            (None, Ok(acts)) => Ok(self.sample(&step, acts)),
        };
        let exports = if result.is_ok() { self.export(&step.exports) } else { Vec::new() };
        let failed = failed.into_iter().map(|(i, why)| (step.seqs[i].key, why)).collect();
        Some(StepCompletion { step: step.step, result, exports, failed })
    }

    /// The LM head and sampling of a step whose layers have run; with the `mtp` drafter (on this
    /// rank alone), its draft passes too.
    fn sample(&mut self, step: &OwnedStep, acts: StepActivations) -> Vec<Sampled> {
        if self.mtp_drafts == 0 {
            let out = self.model.finish_step(&step.batch(), acts);
            return self.finish(step, &out);
        }
        let out = self.model.finish_step_keeping_hidden(&step.batch(), acts);
        let mut sampled = self.finish(step, &out);
        let k = self.mtp_drafts;
        super::mtp::propose(&self.model, &mut self.cache.write(), step, &out.hidden, &mut sampled, k);
        sampled
    }

    /// The rows the step in progress routed at MoE layer `moe` (past the model's MoE layers: a
    /// draft pass's), one message per owning rank.
    pub fn dispatch(&self, moe: usize) -> Vec<ExpertRows> {
        let (Some(place), Some(running)) = (self.experts, self.current.as_ref()) else { return Vec::new() };
        let routed = match moe.checked_sub(self.moe_layers.len()) {
            None => running.acts.as_ref().ok().and_then(|a| self.model.routed(a)).map(|r| (r, self.moe_layers[moe].1)),
            Some(_) => super::mtp::routed(&self.model, running.drafting.as_ref()),
        };
        let Some((routed, experts)) = routed else { return Vec::new() };
        let h = routed.hidden;
        let mut out: Vec<ExpertRows> = (0..place.ranks)
            .map(|to| ExpertRows { moe, from: place.rank, to, pairs: Vec::new(), payload: Payload::Host(Vec::new()) })
            .collect();
        for (r, route) in routed.routes.iter().enumerate() {
            for &(e, _) in route {
                let msg = &mut out[expert_owner(experts, e, place.ranks)];
                msg.pairs.push((r as u32, e as u32));
                if let Payload::Host(x) = &mut msg.payload {
                    x.extend_from_slice(&routed.x[r * h..(r + 1) * h]);
                }
            }
        }
        out.retain(|m| !m.pairs.is_empty());
        out
    }

    /// Runs this rank's experts of MoE layer `moe` (or of a draft pass: the MTP layer's) over the
    /// rows dispatched to it: each expert once, over its rows from every sender in sender order.
    pub fn run_experts(&self, moe: usize, rows: &[ExpertRows]) -> Vec<ExpertRows> {
        let Some(place) = self.experts else { return Vec::new() };
        if let Some(m) = rows.iter().find(|m| !matches!(m.payload, Payload::Host(_))) {
            // (its senders' combine names each pair left without a result)
            tracing::error!(from = m.from, "cpu experts: rows in device memory reached a cpu rank");
            return Vec::new();
        }
        let h = self.model.hidden_size;
        let mtp = self.model.mtp();
        let (experts, run): (usize, Box<RunExpert>) = match (moe.checked_sub(self.moe_layers.len()), mtp) {
            (None, _) => {
                let (layer, experts) = self.moe_layers[moe];
                (experts, Box::new(move |e, x, n| self.model.run_expert(layer, e, x, n)))
            }
            (Some(_), Some(mtp)) => (mtp.num_experts(), Box::new(move |e, x, n| mtp.run_expert(e, x, n))),
            (Some(_), None) => return Vec::new(),
        };
        let mut results: Vec<Vec<f32>> = rows.iter().map(|m| vec![0.0; m.pairs.len() * h]).collect();
        for e in expert_range(experts, place.rank, place.ranks) {
            let at: Vec<(usize, usize)> = rows
                .iter()
                .enumerate()
                .flat_map(|(m, msg)| {
                    msg.pairs.iter().enumerate().filter(|p| p.1 .1 as usize == e).map(move |(i, _)| (m, i))
                })
                .collect();
            if at.is_empty() {
                continue;
            }
            let x: Vec<f32> =
                at.iter().flat_map(|&(m, i)| rows[m].payload.host()[i * h..(i + 1) * h].iter().copied()).collect();
            let Some(y) = run(e, &x, at.len()) else { continue };
            for (j, &(m, i)) in at.iter().enumerate() {
                results[m][i * h..(i + 1) * h].copy_from_slice(&y[j * h..(j + 1) * h]);
            }
        }
        rows.iter().zip(results).map(|(m, y)| m.reply(place.rank, Payload::Host(y))).collect()
    }

    /// Sums the expert results of MoE layer `moe` into the step in progress (a row that got none
    /// fails its request) and runs on to the next MoE layer's routing, or completes the step.
    pub fn combine(&mut self, moe: usize, results: &[ExpertRows], missing: &[ExpertPair]) -> Option<StepCompletion> {
        if moe >= self.moe_layers.len() {
            return self.combine_draft_pass(moe, results, missing);
        }
        let Self { model, cache, current, moe_layers, draft_passes, .. } = self;
        let running = current.as_mut()?;
        if let Ok(acts) = running.acts.as_mut() {
            let found = ExpertResults::new(results, model.routed(acts), model.hidden_size);
            for miss in missing {
                let seq = acts.layout().seq_of_row[miss.row as usize];
                if !running.failed.iter().any(|(s, _)| *s == seq) {
                    let why = format!(
                        "MoE layer {} (model layer {}) of step {}: expert {} on rank {} returned no result for this \
                         request's token (row {}); its output would be wrong, so the request fails",
                        moe, moe_layers[moe].0, running.step.step, miss.expert, miss.owner, miss.row
                    );
                    running.failed.push((seq, why));
                }
            }
            model.combine_experts(acts, |r, k| found.get(r, k));
            if model.run_to_experts(acts, &mut cache.write()) {
                return None;
            }
            if *draft_passes > 0 {
                return self.start_draft_passes(); // sample, then pass 0's rows to their experts
            }
        } else if moe + 1 < moe_layers.len() + *draft_passes {
            return None;
        }
        self.complete()
    }

    /// Resolves the tokens still in flight at launch, applies the state copies asked for before
    /// the forward, and embeds the batch.
    fn begin(&mut self, step: &mut OwnedStep) -> Result<StepActivations, ExecutorError> {
        for s in &step.seqs {
            if let Some(at) = s.deferred {
                match self.sampled.get(&s.key) {
                    Some(&(when, token)) if when == at => step.tokens[s.tokens.end - 1] = token,
                    _ => return Err(ExecutorError::UnresolvedToken { seq: s.key, step: at }),
                }
            }
        }
        if let Some(applied) = step.applied_through {
            self.sampled.retain(|_, (when, _)| *when > applied);
        }
        let mut cache = self.cache.write();
        for op in &step.before {
            match *op {
                StateOp::Zero { slot } => cache.states.zero_slot(slot),
                StateOp::Restore { snapshot, slot } => cache.states.restore(snapshot, slot),
                StateOp::Rewind { slot, position } => {
                    if !cache.states.rewind(slot, position) {
                        let why = format!("slot {slot} kept no state after position {position} to roll back to");
                        return Err(ExecutorError::Launch(why));
                    }
                }
                StateOp::Snapshot { .. } => {}
            }
        }
        // Handoffs land after the state copies (a new slot is zeroed first) and before the
        // forward that reads them; their sizes were checked against this layout on arrival,
        // and are checked again here so nothing is written outside what was allocated.
        for import in &step.imports {
            let from = &import.from;
            let bad = |e: String| ExecutorError::Launch(format!("{}: {e}", from.describe()));
            let landed = match from.source() {
                // In place (test switch `read-handoffs-in-place`): one copy from the producer's
                // blocks, under its lock (it holds them until our ack).
                Some(KvSource { store: BlockStore::Host(producer), blocks, .. }) => {
                    let producer = producer.read();
                    cache.kv.copy_blocks_from(&producer.kv, blocks, &import.blocks)
                }
                // A GPU producer's blocks: copied out through a stream of their own.
                Some(source) => cache.kv.import_blocks(&import.blocks, &source.read()),
                None => cache.kv.import_blocks(&import.blocks, &from.kv_floats()),
            };
            landed.map_err(|e| bad(e.to_string()))?;
            match (import.slot, from.state()) {
                (Some(slot), Some(state)) => {
                    cache.states.import_slot(slot, state).map_err(|e| bad(e.to_string()))?;
                    if let Some(snapshot) = import.snapshot {
                        cache.states.snapshot_into(slot, snapshot);
                    }
                }
                (None, None) => {}
                _ => return Err(bad("the slot and the state it carries do not match (all-or-nothing state)".into())),
            }
        }
        // What a rejected draft must not leave behind: the state after each position it feeds is
        // kept, so a rejection rolls back by a copy.
        for s in step.seqs.iter().filter(|s| s.drafts > 0) {
            if let Some(slot) = s.slot {
                cache.states.track_rows(slot, s.start_pos, s.tokens.len());
            }
        }
        Ok(self.model.begin_step(&step.batch(), cache.kv.block_size()))
    }

    /// Samples every sequence that asked for logits (a verifying one: scores each draft,
    /// [`score_drafts`]), and keeps the state snapshots the step asked for after its forward.
    pub(super) fn finish(&mut self, step: &OwnedStep, out: &ForwardOutput) -> Vec<Sampled> {
        let mut sampled = Vec::with_capacity(step.seqs.len());
        for (i, s) in step.seqs.iter().enumerate() {
            let scored = if s.drafts > 0 {
                score_drafts(step, i, out)
            } else if let Some(logits) = out.last(i) {
                let token = s.sampler.pick(logits, s.start_pos + s.tokens.len());
                Sampled::one(s.key, token, hash::logits_row(logits))
            } else {
                continue;
            };
            // A step already launched behind this one may name the token: it is fed a
            // placeholder (the request fails when this completion lands, and what that step
            // computes for it is dropped), so the others in its batch are not failed too.
            self.sampled.insert(s.key, (step.step, scored.last_verified().unwrap_or(0)));
            sampled.push(scored);
        }
        let mut cache = self.cache.write();
        for op in &step.after {
            if let StateOp::Snapshot { slot, snapshot } = *op {
                cache.states.snapshot_into(slot, snapshot);
            }
        }
        sampled
    }

    /// What the step's exports ask for (after its forward and snapshots): the state slot,
    /// copied now, and the blocks — copied now too (`copy_out`: a handoff, which then owns its
    /// bytes and never waits for this rank's later steps, which hold the cache), or named in
    /// place for their reader (a save).
    fn export(&self, exports: &[KvExport]) -> Vec<Exported> {
        let cache = self.cache.read();
        let floats_per_block = cache.kv.floats_per_block();
        exports
            .iter()
            .map(|e| {
                let state = e.slot.map(|slot| cache.states.slot(slot).to_vec());
                if e.copy_out {
                    let mut kv = Vec::new();
                    cache.kv.export_blocks(&e.blocks, &mut kv);
                    return Exported { key: e.key, kv, source: None, state, simulated: None };
                }
                let source = KvSource {
                    store: BlockStore::Host(self.cache.clone()),
                    blocks: e.blocks.clone(),
                    floats_per_block,
                    marks: None,
                };
                Exported { key: e.key, kv: Vec::new(), source: Some(source), state, simulated: None }
            })
            .collect()
    }
}

/// Runs one expert over `n` rows: `(expert, rows, n)`, `None` when this rank does not hold it.
type RunExpert<'a> = dyn Fn(usize, &[f32], usize) -> Option<Vec<f32>> + 'a;

/// A MoE layer's expert results, by row and route: what `combine` sums. A pair that got no
/// result reads zeros — its request fails (a model layer) or the step's drafts are dropped (a
/// draft pass), so a zero is never silent.
pub(super) struct ExpertResults<'a> {
    found: HashMap<(u32, u32), &'a [f32]>,
    /// Each routed row's experts, ascending (its `k`-th route is `routes[r][k]`).
    routes: Vec<Vec<u32>>,
    zeros: Vec<f32>,
}

impl<'a> ExpertResults<'a> {
    pub(super) fn new(results: &'a [ExpertRows], routed: Option<RoutedRows<'_>>, h: usize) -> Self {
        let mut found = HashMap::new();
        for m in results {
            let Payload::Host(y) = &m.payload else { continue };
            for (i, &pair) in m.pairs.iter().enumerate() {
                found.insert(pair, &y[i * h..(i + 1) * h]);
            }
        }
        let routes = routed
            .map(|r| r.routes.iter().map(|route| route.iter().map(|p| p.0 as u32).collect()).collect())
            .unwrap_or_default();
        ExpertResults { found, routes, zeros: vec![0.0; h] }
    }

    /// Row `r`'s result from its `k`-th expert.
    pub(super) fn get(&self, r: usize, k: usize) -> &[f32] {
        self.found.get(&(r as u32, self.routes[r][k])).copied().unwrap_or(&self.zeros)
    }
}

/// `cpu`: runs each step on the rank's own thread as it is launched.
pub struct CpuExecutor {
    runner: CpuStepRunner,
    gate: CompletionGate,
    /// When the step whose phases are running completes (a launch count).
    due: u64,
}

impl CpuExecutor {
    pub fn new(runner: CpuStepRunner, delay: Delay) -> Self {
        CpuExecutor { runner, gate: CompletionGate::new(delay), due: 0 }
    }
}

impl Executor for CpuExecutor {
    fn phases(&self) -> usize {
        self.runner.phases()
    }

    fn launch(&mut self, step: &StepLaunch<'_>, phase: usize) {
        let owned = (phase == 0).then(|| {
            self.due = self.gate.launched();
            OwnedStep::copy_of(step)
        });
        if let Some(done) = self.runner.run_phase(phase, owned) {
            self.gate.hold(self.due, done);
        }
    }

    fn poll(&mut self, out: &mut Vec<StepCompletion>) {
        self.gate.release(out);
    }

    fn flush(&mut self) {
        self.gate.flush();
    }

    fn expert_parallel(&mut self) -> Option<&mut dyn ExpertParallel> {
        self.runner.experts.is_some().then_some(self as &mut dyn ExpertParallel)
    }
}

impl ExpertParallel for CpuExecutor {
    fn dispatch(&mut self, moe: usize) -> Vec<ExpertRows> {
        self.runner.dispatch(moe)
    }

    fn run_experts(&mut self, moe: usize, rows: &[ExpertRows]) -> Vec<ExpertRows> {
        self.runner.run_experts(moe, rows)
    }

    fn combine(&mut self, moe: usize, results: Vec<ExpertRows>, missing: &[ExpertPair]) {
        if let Some(done) = self.runner.combine(moe, &results, missing) {
            self.gate.hold(self.due, done);
        }
    }
}

/// Scores a verifying sequence's drafts: the row after its last known token chooses the first
/// draft's position, and each row after a draft the next — greedy by the argmax, sampling by the
/// speculative-sampling rule ([`Sampler::check_draft`]: a draft is kept with probability
/// p(draft), else the token there is drawn from what remains), every draw keyed on its
/// position, so each row's choice is its own whatever the rows before it chose. Which drafts
/// hold (each while every one before it held) is `verify`'s decision
/// ([`Sampled::kept_drafts`]); the state after each position is kept for its rewind.
fn score_drafts(step: &OwnedStep, i: usize, out: &ForwardOutput) -> Sampled {
    let s = &step.seqs[i];
    let drafts = &step.tokens[s.tokens.end - s.drafts..s.tokens.end];
    let first = s.start_pos + s.tokens.len() - s.drafts;
    let mut rows = out.seq(i);
    let mut choose = |k: usize| {
        let row = rows.next()?;
        let chosen = match drafts.get(k) {
            Some(&draft) => s.sampler.check_draft(row, first + k, draft),
            None => s.sampler.pick(row, first + k).map(|t| (t, false)),
        };
        Some((chosen, hash::logits_row(row)))
    };
    let Some((chosen, logits_hash)) = choose(0) else { return Sampled::one(s.key, None, 0) };
    let mut scored = Sampled::one(s.key, chosen.map(|(t, _)| t), logits_hash);
    let mut kept = chosen.is_some_and(|(_, kept)| kept);
    for k in 1..=drafts.len() {
        let Some((next, next_hash)) = choose(k) else { break };
        scored.checks.push(DraftCheck { kept, next: next.map(|(t, _)| t), next_hash });
        kept = next.is_some_and(|(_, kept)| kept);
    }
    scored
}

/// Expert parallel with the MTP drafter: the draft passes after the model's MoE layers.
impl CpuStepRunner {
    /// The model's MoE layers are done: the LM head and sampling run now, and draft pass 0 starts
    /// (its rows wait for the MTP layer's experts). Every rank starts it, rows or not.
    pub(super) fn start_draft_passes(&mut self) -> Option<crate::step::StepCompletion> {
        let mut running = self.current.take()?;
        let placeholder = Err(crate::step::ExecutorError::Launch("sampled before its draft passes".into()));
        let Ok(acts) = std::mem::replace(&mut running.acts, placeholder) else { return None };
        let out = self.model.finish_step_keeping_hidden(&running.step.batch(), acts);
        let sampled = self.finish(&running.step, &out);
        let (d, k) = (self.model.hidden_size, self.draft_passes);
        let mut mtp = super::mtp::MtpDrafting::new(&running.step, &out.hidden, &sampled, d, k);
        let acts = mtp.begin_pass(&self.model, &running.step, &mut self.cache.write());
        running.drafting = Some(super::mtp::Drafting { sampled, mtp, acts: Some(acts), lost: false });
        self.current = Some(running);
        None
    }

    /// Ends draft pass `moe − (model's MoE layers)`: its experts' results summed, its drafts
    /// taken; then the next pass starts, or the step completes after the last.
    pub(super) fn combine_draft_pass(
        &mut self,
        moe: usize,
        results: &[crate::messages::ExpertRows],
        missing: &[crate::messages::ExpertPair],
    ) -> Option<crate::step::StepCompletion> {
        let last = moe + 1 >= self.moe_layers.len() + self.draft_passes;
        let Some(mtp) = self.model.mtp() else { return if last { self.complete() } else { None } };
        let running = self.current.as_mut()?;
        let Some(drafting) = running.drafting.as_mut() else {
            return if last { self.complete() } else { None }; // the step could not run
        };
        let d = self.model.hidden_size;
        if let Some(acts) = drafting.acts.take() {
            if !missing.is_empty() {
                tracing::error!(
                    step = running.step.step,
                    pass = moe - self.moe_layers.len(),
                    "draft pass: {} expert results missing; this step's drafts are dropped",
                    missing.len()
                );
                drafting.lost = true;
            }
            let found = ExpertResults::new(results, mtp.routed(&acts, self.model.num_layers()), d);
            let out = mtp.finish(acts, |r, k| found.get(r, k));
            drafting.mtp.end_pass(out, &mut drafting.sampled, d);
        }
        if last {
            return self.complete();
        }
        let running = self.current.as_mut()?;
        let drafting = running.drafting.as_mut()?;
        drafting.acts = Some(drafting.mtp.begin_pass(&self.model, &running.step, &mut self.cache.write()));
        None
    }
}
