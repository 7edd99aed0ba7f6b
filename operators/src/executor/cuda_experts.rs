//! `cuda` under expert parallelism (DESIGN §4; the CPU's is `cpu.rs`'s dispatch, run_experts and
//! combine): a step is enqueued up to its first MoE block's routing, and each `combine` runs it on
//! to the next (kvflow_kernels::cuda::experts). The rows a rank routes and the results of the
//! experts it holds stay in device memory ([`Payload::Device`]): the receiver copies them on its
//! own stream after the sender's event, so timely carries the pairs, the counts and the events,
//! never the floats. The host reads back only each block's routes (who gets which rows).
//!
//! Which time it holds: the rank's step `t`, from launch through each MoE block's exchange; the
//! record goes in flight (`cuda.rs`) after the last one.
//! Which guarantee it carries: records own what they read — a payload stays alive with every
//! record whose stream copies it until that stream is past the copy (the step's event, or the
//! served experts' event), so no rank frees rows another still reads; and the combination sums
//! each row's routes in ascending expert order from the unsplit layout, so the result is the
//! unsplit model's bit for bit. A pair that got no result fails its request, never a silent zero.

use super::{fail, CudaExecutor, InFlight, Staged};
use crate::executor::contract::{ExpertParallel, ExpertPlacement};
use crate::messages::{ExpertPair, ExpertRows, Payload};
use crate::step::{ExecutorError, KvExport, SeqKey, StateOp, StepLaunch};
use kvflow_kernels::cuda::{DeviceBuf, DeviceRows, Event, Gpu, PinnedBuf, SplitStep, StepRows, RESULT_WORDS};
use kvflow_kernels::models::parts::moe::{expert_owner, expert_range};
use kvflow_kernels::models::Model;
use std::collections::{HashMap, VecDeque};

/// A rank's side of expert parallelism on the device.
pub(super) struct ExpertSide {
    place: ExpertPlacement,
    /// The model's MoE layers: `(layer, experts)`.
    moe_layers: Vec<(usize, usize)>,
    /// The step between its exchanges.
    split: Option<SplitRecord>,
    /// Rows served to other ranks, held (with their staged expert ids) until the GPU is past
    /// the experts that read them.
    serving: VecDeque<(Event, Vec<DeviceRows>, PinnedBuf<u32>)>,
}

impl ExpertSide {
    pub(super) fn new(place: ExpertPlacement, model: &Model) -> ExpertSide {
        ExpertSide { place, moe_layers: model.moe_layers(), split: None, serving: VecDeque::new() }
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
    /// The routed block's routes, read at dispatch: `[rows × top_k]`.
    routes: Vec<u32>,
    top_k: usize,
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
            routes: Vec::new(),
            top_k: 0,
        });
        self.end_split_if_done();
        Ok(())
    }

    /// Once the split step's layers are all enqueued (its head too): its end, and in flight.
    fn end_split_if_done(&mut self) {
        let Some(side) = self.experts.as_mut() else { return };
        if !side.split.as_ref().is_some_and(|s| s.split.finished(&self.model)) {
            return;
        }
        let Some(SplitRecord { mut record, split, staged, results, sampled, after, exports, .. }) = side.split.take()
        else {
            return;
        };
        let gpu = self.gpu.clone();
        let (rows, staged_words) = split.into_held();
        record.exchanged = Exchanged { rows, staged: staged_words };
        if let Err(e) = self.end_step(&gpu, &mut record, staged.meta, sampled, results.ptr(), &after, &exports) {
            record.error = Some(e);
            record.event = None;
        }
        self.go_in_flight(record);
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

impl ExpertParallel for CudaExecutor {
    fn dispatch(&mut self, moe: usize) -> Vec<ExpertRows> {
        let Some(side) = self.experts.as_mut() else { return Vec::new() };
        let (place, Some(&(_, experts))) = (side.place, side.moe_layers.get(moe)) else { return Vec::new() };
        let Some(split) = side.split.as_mut() else { return Vec::new() };
        let Some(k) = split.split.routed_top_k(&self.model) else { return Vec::new() };
        let routes = match split.split.routes(&self.gpu, k) {
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
        let gpu = self.gpu.clone();
        let gathered = self.pinned_words.take(&gpu, n).map_err(fail).and_then(|mut index| {
            let order = by_rank.iter().flatten().map(|&(row, _)| row);
            index.as_mut_slice().iter_mut().zip(order).for_each(|(slot, row)| *slot = row);
            let split = self.experts.as_mut().and_then(|s| s.split.as_mut()).expect("a split step");
            split.split.gather(&gpu, index, n).map_err(fail)
        });
        let gathered = match gathered {
            Ok(g) => g,
            Err(e) => {
                self.fail_split(e);
                return Vec::new();
            }
        };
        let split = self.experts.as_mut().and_then(|s| s.split.as_mut()).expect("a split step");
        (split.routes, split.top_k) = (routes, k);
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
        let (place, Some(&(_, experts))) = (side.place, side.moe_layers.get(moe)) else { return Vec::new() };
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
            let out = self.model.serve_experts(&gpu, &self.kv.kv, moe, &refs, &ids).map_err(|e| e.to_string())?;
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
                ExpertRows { moe, from: place.rank, to: m.from, pairs: m.pairs.clone(), payload }
            })
            .collect()
    }

    fn combine(&mut self, moe: usize, results: Vec<ExpertRows>, _missing: &[ExpertPair]) {
        let Some(side) = self.experts.as_mut() else { return };
        let (place, Some(&(layer, experts))) = (side.place, side.moe_layers.get(moe)) else { return };
        let Some(split) = side.split.as_mut() else { return };
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
        let k = split.top_k;
        let mut index = Vec::with_capacity(split.routes.len());
        for (i, &e) in split.routes.iter().enumerate() {
            let row = (i / k.max(1)) as u32;
            index.push(found.get(&(row, e)).copied().unwrap_or_else(|| {
                let (seq, owner) = (split.seq_of_row[row as usize], expert_owner(experts, e as usize, place.ranks));
                let key = split.keys[seq];
                if !split.record.failed.iter().any(|(s, _)| *s == key) {
                    let why = format!(
                        "MoE layer {moe} (model layer {layer}) of step {}: expert {e} on rank {owner} returned no result \
                         for this request's token (row {row}); its output would be wrong, so the request fails",
                        split.record.step
                    );
                    split.record.failed.push((key, why));
                }
                zero_row
            }));
        }
        let gpu = self.gpu.clone();
        let staged = self.pinned_words.take(&gpu, index.len()).map_err(fail).and_then(|mut staged| {
            staged.as_mut_slice()[..index.len()].copy_from_slice(&index);
            let split = self.experts.as_mut().and_then(|s| s.split.as_mut()).expect("a split step");
            let (model, kv, state) = (&self.model, &self.kv.kv, self.state.as_ref());
            let results_at = split.results.ptr();
            model.continue_split(&gpu, kv, state, &mut split.split, payloads, staged, results_at, 0).map_err(fail)
        });
        match staged {
            Ok(()) => self.end_split_if_done(),
            Err(e) => self.fail_split(e),
        }
    }
}
