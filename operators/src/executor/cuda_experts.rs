//! `cuda` under expert parallelism (DESIGN §4; the CPU's is `cpu.rs`'s dispatch, run_experts and
//! combine): a step is enqueued up to its first MoE block's routing, and each `combine` runs it on
//! to the next (kvflow_kernels::cuda::experts). The rows a rank routes and the results of the
//! experts it holds stay in device memory ([`Payload::Device`]): the receiver copies them on its
//! own stream after the sender's event, so timely carries the pairs, the counts and the events,
//! never the floats. The host reads back only each block's routes (who gets which rows). With
//! the MTP drafter and a MoE MTP layer, the step samples after its last MoE block (the host waits
//! for its samples) and its draft passes follow as further exchanges, each split at the MTP
//! layer's MoE block the same way; every rank joins every pass, with rows or without.
//!
//! Which time it holds: the rank's step `t`, from launch through each MoE block's exchange; the
//! record goes in flight (`cuda.rs`) after the last one.
//! Which guarantee it carries: records own what they read — a payload stays alive with every
//! record whose stream copies it until that stream is past the copy (the step's event, or the
//! served experts' event), so no rank frees rows another still reads; and the combination sums
//! each row's routes in ascending expert order from the unsplit layout, so the result is the
//! unsplit model's bit for bit. A pair that got no result fails its request, never a silent zero.

use super::super::cuda_mtp::{DraftChains, MtpPasses, PlannedPass};
use super::{fail, ring_slot, CudaExecutor, InFlight, Staged};
use crate::executor::contract::{ExpertParallel, ExpertPlacement};
use crate::messages::{ExpertPair, ExpertRows, Payload};
use crate::step::{ExecutorError, KvExport, Sampled, SeqKey, StateOp, StepLaunch};
use kvflow_kernels::cuda::{DeviceBuf, DeviceRows, Event, Gpu, PinnedBuf, SplitStep, StepRows, RESULT_WORDS};
use kvflow_kernels::models::parts::moe::{expert_owner, expert_range};
use kvflow_kernels::models::Model;
use std::collections::{HashMap, VecDeque};

/// A rank's side of expert parallelism on the device.
pub(super) struct ExpertSide {
    place: ExpertPlacement,
    /// The model's MoE layers: `(layer, experts)`.
    moe_layers: Vec<(usize, usize)>,
    /// With a MoE MTP layer: the draft passes after them (each an exchange of its experts), and
    /// the layer, numbered after the model's, with its experts.
    draft_passes: usize,
    mtp_block: (usize, usize),
    /// The step between its exchanges.
    split: Option<SplitRecord>,
    /// Rows served to other ranks, held (with their staged expert ids) until the GPU is past
    /// the experts that read them.
    serving: VecDeque<(Event, Vec<DeviceRows>, PinnedBuf<u32>)>,
}

impl ExpertSide {
    pub(super) fn new(place: ExpertPlacement, model: &Model, draft_passes: usize) -> ExpertSide {
        let mtp_block = (model.num_layers(), model.mtp().map_or(0, |m| m.num_experts()));
        let moe_layers = model.moe_layers();
        ExpertSide { place, moe_layers, draft_passes, mtp_block, split: None, serving: VecDeque::new() }
    }

    /// Exchange `moe`'s block: `(layer, experts)` — a model layer's, or a draft pass's.
    fn block(&self, moe: usize) -> Option<(usize, usize)> {
        match moe.checked_sub(self.moe_layers.len()) {
            None => self.moe_layers.get(moe).copied(),
            Some(pass) => (pass < self.draft_passes).then_some(self.mtp_block),
        }
    }
}

/// What a step read of other ranks' memory, and the indices it staged: held until it completes.
#[derive(Default)]
pub(super) struct Exchanged {
    #[allow(dead_code)] // (held, never read)
    rows: Vec<DeviceRows>,
    staged: Vec<PinnedBuf<u32>>,
}

impl Exchanged {
    /// The staged buffers, for the pool (the rows are let go).
    pub(super) fn released(self) -> Vec<PinnedBuf<u32>> {
        self.staged
    }
}

/// A step between its MoE exchanges, and what it needs at its end.
struct SplitRecord {
    record: InFlight,
    split: SplitStep,
    /// The rows' metadata on the device (the later layers read it).
    staged: Staged,
    results: DeviceBuf<u32>,
    sampled: usize,
    /// The sequence of each row, and each sequence's key.
    seq_of_row: Vec<usize>,
    keys: Vec<SeqKey>,
    after: Vec<StateOp>,
    exports: Vec<KvExport>,
    /// The routed block's routes, read at dispatch.
    routes: Routes,
    /// With draft passes: the step sampled, its passes under way.
    drafting: Option<SplitDrafting>,
}

/// A routed block's routes, read at dispatch: `[rows × top_k]`.
#[derive(Default)]
struct Routes {
    experts: Vec<u32>,
    top_k: usize,
}

/// Expert parallel with a MoE MTP layer: a step's samples, known once its layers have run, and
/// its draft passes, one exchange each.
struct SplitDrafting {
    sampled: Vec<Sampled>,
    chains: DraftChains,
    passes: MtpPasses,
    /// The pass between its routing and its combine.
    pass: Option<PassSplit>,
    /// Draft passes this rank has joined (combined, or had no rows for).
    joined: usize,
    /// The last pass's output hidden rows (the next pass reads them).
    previous: Option<DeviceBuf<f32>>,
    /// What the passes' streams read, held until the step completes.
    held: Exchanged,
}

/// A draft pass split at the MTP layer's MoE block.
struct PassSplit {
    planned: PlannedPass,
    split: SplitStep,
    /// Its rows' metadata on the device (the combine's kernels read it) and its results.
    _meta: DeviceBuf<u32>,
    results: DeviceBuf<u32>,
    routes: Routes,
}

impl SplitRecord {
    /// The split waiting at exchange `moe` (`model_blocks` the model's MoE layers): the step's,
    /// or its draft pass's; with where its routes are kept.
    fn at_exchange(&mut self, moe: usize, model_blocks: usize) -> Option<(&mut SplitStep, &mut Routes)> {
        match moe.checked_sub(model_blocks) {
            None => Some((&mut self.split, &mut self.routes)),
            Some(pass) => {
                let drafting = self.drafting.as_mut().filter(|d| d.joined == pass)?;
                drafting.pass.as_mut().map(|p| (&mut p.split, &mut p.routes))
            }
        }
    }
}

impl CudaExecutor {
    /// Enqueues the step up to its first MoE block's routing; `combine` runs it on.
    pub(super) fn begin_split(
        &mut self,
        gpu: &Gpu,
        launch: &StepLaunch<'_>,
        rows: &StepRows,
        staged: Staged,
        record: InFlight,
    ) -> Result<(), ExecutorError> {
        let Some((_, at)) = staged.direct.as_ref() else {
            return Err(ExecutorError::Launch("an expert-parallel step is never replayed".into()));
        };
        let routes = self.pinned_words.take(gpu, rows.rows() * self.model.max_top_k()).map_err(fail)?;
        let (model, kv, state) = (&self.model, &self.kv.kv, self.state.as_ref());
        let split = model.begin_split(gpu, kv, state, rows.shape(), *at, self.ring.ptr(), routes).map_err(fail)?;
        let results = gpu.scratch::<u32>(rows.sampled() * RESULT_WORDS).map_err(fail)?;
        let seq_of_row = (0..rows.num_seqs()).flat_map(|i| std::iter::repeat_n(i, rows.seq_rows(i))).collect();
        let side = self.experts.as_mut().expect("expert parallel");
        side.split = Some(SplitRecord {
            record,
            split,
            staged,
            results,
            sampled: rows.sampled(),
            seq_of_row,
            keys: launch.seqs().map(|s| s.key).collect(),
            after: launch.after.to_vec(),
            exports: launch.exports.to_vec(),
            routes: Routes::default(),
            drafting: None,
        });
        self.end_split_if_done();
        Ok(())
    }

    /// Once the split step's layers are all enqueued (its head too): its draft passes, if it
    /// has any, then its end, and in flight.
    fn end_split_if_done(&mut self) {
        let Some(side) = self.experts.as_mut() else { return };
        if !side.split.as_ref().is_some_and(|s| s.split.finished(&self.model)) {
            return;
        }
        let drafts = side.draft_passes > 0 && side.split.as_ref().is_some_and(|s| s.record.mtp.is_some());
        if drafts {
            if let Err(e) = self.advance_drafting() {
                return self.fail_split(e);
            }
            let side = self.experts.as_ref().expect("expert parallel");
            let joined = side.split.as_ref().and_then(|s| s.drafting.as_ref()).map_or(0, |d| d.joined);
            if joined < side.draft_passes {
                return;
            }
        }
        let side = self.experts.as_mut().expect("expert parallel");
        let Some(SplitRecord { mut record, split, staged, results, sampled, after, exports, drafting, .. }) =
            side.split.take()
        else {
            return;
        };
        let gpu = self.gpu.clone();
        let (_, rows, staged_words) = split.into_held();
        record.exchanged = Exchanged { rows, staged: staged_words };
        let ended = match drafting {
            Some(d) => {
                record.meta = Some(staged.meta);
                record.exchanged.rows.extend(d.held.rows);
                record.exchanged.staged.extend(d.held.staged);
                record.passes = Some(d.passes);
                self.end_exports(&gpu, &mut record, &exports)
            }
            None => self.end_step(&gpu, &mut record, staged.meta, sampled, results.ptr(), &after, &exports),
        };
        if let Err(e) = ended {
            // (what it enqueued may still write what it holds, which its completion gives back)
            let _ = self.gpu.wait();
            record.error = Some(e);
            record.event = None;
        }
        self.go_in_flight(record);
    }

    /// The draft passes of a step whose layers are enqueued: at the first call its samples
    /// (results back to the host, waited for), then the next pass up to its routing, unless one
    /// waits at its exchange or all have been joined. A pass with no rows is joined at once by
    /// nothing here: the rank still joins its exchange, sending nothing (`dispatch`).
    fn advance_drafting(&mut self) -> Result<(), ExecutorError> {
        let gpu = self.gpu.clone();
        let side = self.experts.as_mut().expect("expert parallel");
        let split = side.split.as_mut().expect("a split step");
        if split.drafting.is_none() {
            let mut record = std::mem::replace(&mut split.record, InFlight::started(0, Vec::new()));
            let (sampled, results, after) = (split.sampled, split.results.ptr(), std::mem::take(&mut split.after));
            let ended = self.end_forward(&gpu, &mut record, sampled, results, &after);
            let split = self.experts.as_mut().and_then(|s| s.split.as_mut()).expect("a split step");
            split.record = record;
            ended?;
            gpu.wait_for(&gpu.record().map_err(fail)?).map_err(fail)?;
            let sampled = Self::sampled_of(&split.record);
            let k = self.mtp_drafts;
            split.drafting = Some(SplitDrafting {
                sampled,
                chains: DraftChains::new(k),
                passes: MtpPasses::default(),
                pass: None,
                joined: 0,
                previous: None,
                held: Exchanged::default(),
            });
        }
        let Self { gpu, model, kv, ring, next_slot, pinned_words, experts, .. } = self;
        let side = experts.as_mut().expect("expert parallel");
        let split = side.split.as_mut().expect("a split step");
        let (Some(drafting), Some(plan)) = (split.drafting.as_mut(), split.record.mtp.as_ref()) else { return Ok(()) };
        if drafting.pass.is_some() || drafting.joined >= side.draft_passes {
            return Ok(());
        }
        let mut slot = || ring_slot(next_slot);
        let previous = drafting.previous.take();
        let (d, bs) = (model.hidden, kv.kv.block_size);
        let planned = drafting.chains.next_pass(plan, gpu, d, bs, &drafting.sampled, previous.as_ref(), &mut slot);
        let Some(planned) = planned.map_err(fail)? else { return Ok(()) };
        let (at, meta) = drafting.passes.stage(gpu, &planned.rows, pinned_words).map_err(fail)?;
        let routes = pinned_words.take(gpu, planned.rows.rows() * model.max_top_k()).map_err(fail)?;
        let shape = planned.rows.shape();
        let results = gpu.scratch::<u32>(shape.sampled.max(1) * RESULT_WORDS).map_err(fail)?;
        let (hidden_in, ring) = (planned.hidden_in.ptr(), ring.ptr());
        let split = model.begin_mtp_split(gpu, &kv.kv, shape, at, hidden_in, ring, routes).map_err(fail)?;
        drafting.pass = Some(PassSplit { planned, split, _meta: meta, results, routes: Routes::default() });
        Ok(())
    }

    /// A draft pass's exchange is over (combined, or it had no rows here): its drafts back to
    /// pinned memory, and the rank joins the next pass, or ends the step.
    fn end_draft_pass(&mut self) -> Result<(), ExecutorError> {
        let Self { gpu, pinned_words, experts, .. } = self;
        let split = experts.as_mut().and_then(|s| s.split.as_mut()).expect("a split step");
        let drafting = split.drafting.as_mut().expect("a draft pass");
        if let Some(PassSplit { planned, split, results, .. }) = drafting.pass.take() {
            // (held first: a failed read-back ends the step, which waits before letting go)
            let (hidden, rows, staged) = split.into_held();
            drafting.previous = Some(hidden);
            drafting.held.rows.extend(rows);
            drafting.held.staged.extend(staged);
            drafting.passes.read_back(gpu, &planned, results.ptr(), pinned_words).map_err(fail)?;
        }
        drafting.joined += 1;
        Ok(())
    }

    /// The split step failed: it completes with the error once nothing it enqueued runs.
    fn fail_split(&mut self, e: ExecutorError) {
        let Some(split) = self.experts.as_mut().and_then(|side| side.split.take()) else { return };
        let _ = self.gpu.wait(); // (what it enqueued may still read what it holds)
        let mut record = split.record;
        record.error = Some(e);
        record.event = None;
        self.go_in_flight(record);
    }

    /// Lets go of the rows served to other ranks that the GPU is past.
    pub(super) fn release_served(&mut self) {
        let Some(side) = self.experts.as_mut() else { return };
        while let Some((event, _, _)) = side.serving.front() {
            if !self.gpu.done(event).unwrap_or(true) {
                break;
            }
            let (_, _, staged) = side.serving.pop_front().expect("front exists");
            self.pinned_words.give_back(Some(staged));
        }
    }

    /// Whether rows served to other ranks may still be read by this rank's GPU.
    pub(super) fn serves_rows(&self) -> bool {
        self.experts.as_ref().is_some_and(|side| !side.serving.is_empty())
    }
}

impl CudaExecutor {
    /// The split waiting at exchange `moe`, if this rank has one there.
    fn split_at(&mut self, moe: usize) -> Option<(&mut SplitStep, &mut Routes)> {
        let side = self.experts.as_mut()?;
        let blocks = side.moe_layers.len();
        side.split.as_mut()?.at_exchange(moe, blocks)
    }
}

impl ExpertParallel for CudaExecutor {
    fn dispatch(&mut self, moe: usize) -> Vec<ExpertRows> {
        let Some(side) = self.experts.as_ref() else { return Vec::new() };
        let (place, Some((_, experts))) = (side.place, side.block(moe)) else { return Vec::new() };
        let (gpu, blocks) = (self.gpu.clone(), side.moe_layers.len());
        let Self { experts: Some(side), model, .. } = self else { return Vec::new() };
        let Some((split, _)) = side.split.as_mut().and_then(|s| s.at_exchange(moe, blocks)) else { return Vec::new() };
        let Some(k) = split.routed_top_k(model) else { return Vec::new() };
        let routes = match split.routes(&gpu, k) {
            Ok(r) => r.to_vec(),
            Err(e) => {
                self.fail_split(fail(e));
                return Vec::new();
            }
        };
        // pairs by owning rank, each rank's rows ascending and each row's experts ascending
        let mut by_rank: Vec<Vec<(u32, u32)>> = vec![Vec::new(); place.ranks];
        for (i, &e) in routes.iter().enumerate() {
            by_rank[expert_owner(experts, e as usize, place.ranks)].push(((i / k) as u32, e));
        }
        let n = routes.len();
        let gathered = self.pinned_words.take(&gpu, n).map_err(fail).and_then(|mut index| {
            let order = by_rank.iter().flatten().map(|&(row, _)| row);
            index.as_mut_slice().iter_mut().zip(order).for_each(|(slot, row)| *slot = row);
            let (split, _) = self.split_at(moe).expect("a split step");
            split.gather(&gpu, index, n).map_err(fail)
        });
        let gathered = match gathered {
            Ok(g) => g,
            Err(e) => {
                self.fail_split(e);
                return Vec::new();
            }
        };
        let (_, kept) = self.split_at(moe).expect("a split step");
        *kept = Routes { experts: routes, top_k: k };
        let mut at = 0;
        let mut out = Vec::new();
        for (to, pairs) in by_rank.into_iter().enumerate().filter(|(_, p)| !p.is_empty()) {
            let payload = Payload::Device(gathered.slice(at, pairs.len()));
            at += pairs.len();
            out.push(ExpertRows { moe, from: place.rank, to, pairs, payload });
        }
        out
    }

    fn run_experts(&mut self, moe: usize, rows: &[ExpertRows]) -> Vec<ExpertRows> {
        self.release_served();
        let Some(side) = self.experts.as_ref() else { return Vec::new() };
        let (place, Some((_, experts))) = (side.place, side.block(moe)) else { return Vec::new() };
        // (every draft pass runs the one MTP block, numbered after the model's)
        let block = moe.min(side.moe_layers.len());
        let held = expert_range(experts, place.rank, place.ranks);
        let mut inputs = Vec::with_capacity(rows.len());
        for m in rows {
            match &m.payload {
                Payload::Device(d) if d.rows == m.pairs.len() => inputs.push(d.clone()),
                // (its sender's combine names each pair left without a result)
                _ => {
                    tracing::error!(rank = place.rank, from = m.from, moe, "cuda experts: rows not in device memory");
                    return Vec::new();
                }
            }
        }
        let pairs: usize = rows.iter().map(|m| m.pairs.len()).sum();
        let gpu = self.gpu.clone();
        let served = self.pinned_words.take(&gpu, pairs).map_err(|e| e.to_string()).and_then(|mut ids| {
            let all = rows.iter().flat_map(|m| m.pairs.iter().map(|&(_, e)| e as usize));
            for (slot, e) in ids.as_mut_slice().iter_mut().zip(all) {
                if !held.contains(&e) {
                    return Err(format!("expert {e} is not among this rank's {held:?}"));
                }
                *slot = (e - held.start) as u32;
            }
            let refs: Vec<&DeviceRows> = inputs.iter().collect();
            let out = self.model.serve_experts(&gpu, &self.kv.kv, block, &refs, &ids).map_err(|e| e.to_string())?;
            let done = gpu.record().map_err(|e| e.to_string())?;
            Ok((out, done, ids))
        });
        let (out, done, ids) = match served {
            Ok(s) => s,
            Err(why) => {
                tracing::error!(rank = place.rank, moe, "cuda experts: {why}");
                return Vec::new();
            }
        };
        if let Some(side) = self.experts.as_mut() {
            side.serving.push_back((done, inputs, ids));
        }
        let mut at = 0;
        rows.iter()
            .map(|m| {
                let payload = Payload::Device(out.slice(at, m.pairs.len()));
                at += m.pairs.len();
                m.reply(place.rank, payload)
            })
            .collect()
    }

    fn combine(&mut self, moe: usize, results: Vec<ExpertRows>, _missing: &[ExpertPair]) {
        let Some(side) = self.experts.as_ref() else { return };
        let (place, blocks, Some((layer, experts))) = (side.place, side.moe_layers.len(), side.block(moe)) else {
            return;
        };
        let draft_pass = moe >= blocks;
        let Some(routes) = self.split_at(moe).map(|(_, r)| std::mem::take(r)) else {
            // no step here, or a draft pass without rows here: joined all the same
            if draft_pass && self.experts.as_ref().is_some_and(|s| s.split.is_some()) {
                if let Err(e) = self.end_draft_pass() {
                    return self.fail_split(e);
                }
                self.end_split_if_done();
            }
            return;
        };
        // each result's row in the received buffer; its last row is zeros
        let mut found: HashMap<(u32, u32), u32> = HashMap::new();
        let mut payloads = Vec::new();
        let mut received = 0;
        for m in results {
            if let Payload::Device(rows) = m.payload {
                if rows.rows == m.pairs.len() {
                    for (i, &pair) in m.pairs.iter().enumerate() {
                        found.insert(pair, (received + i) as u32);
                    }
                    received += rows.rows;
                    payloads.push(rows);
                }
            }
        }
        let zero_row = received as u32;
        let k = routes.top_k.max(1);
        let mut index = Vec::with_capacity(routes.experts.len());
        let mut lost = Vec::new();
        for (i, &e) in routes.experts.iter().enumerate() {
            let row = (i / k) as u32;
            index.push(found.get(&(row, e)).copied().unwrap_or_else(|| {
                lost.push((row, e));
                zero_row
            }));
        }
        let split = self.experts.as_mut().and_then(|s| s.split.as_mut()).expect("a split step");
        match (draft_pass, split.drafting.as_mut()) {
            // drafts only propose: a lost result drops the step's drafts, no request fails
            (true, Some(drafting)) => drafting.passes.lost |= !lost.is_empty(),
            _ => {
                for (row, e) in lost {
                    let (seq, owner) = (split.seq_of_row[row as usize], expert_owner(experts, e as usize, place.ranks));
                    let key = split.keys[seq];
                    if !split.record.failed.iter().any(|(s, _)| *s == key) {
                        let why = format!(
                            "MoE layer {moe} (model layer {layer}) of step {}: expert {e} on rank {owner} returned no \
                             result for this request's token (row {row}); its output would be wrong, so the request fails",
                            split.record.step
                        );
                        split.record.failed.push((key, why));
                    }
                }
            }
        }
        let gpu = self.gpu.clone();
        let continued = self.pinned_words.take(&gpu, index.len()).map_err(fail).and_then(|mut staged| {
            staged.as_mut_slice()[..index.len()].copy_from_slice(&index);
            let Self { model, kv, state, experts, .. } = self;
            let split = experts.as_mut().and_then(|s| s.split.as_mut()).expect("a split step");
            let hidden_out = split.record.mtp.as_ref().map_or(0, |p| p.hidden.ptr());
            let (at, results_at, state) = match split.drafting.as_mut().and_then(|d| d.pass.as_mut()) {
                Some(pass) if draft_pass => (&mut pass.split, pass.results.ptr(), None),
                _ => (&mut split.split, split.results.ptr(), state.as_ref()),
            };
            model.continue_split(&gpu, &kv.kv, state, at, payloads, staged, results_at, hidden_out).map_err(fail)
        });
        let ended = continued.and_then(|()| if draft_pass { self.end_draft_pass() } else { Ok(()) });
        match ended {
            Ok(()) => self.end_split_if_done(),
            Err(e) => self.fail_split(e),
        }
    }
}
