//! `cuda`: a rank's steps on its GPU (one dataflow worker per GPU; DESIGN §4, §6). `launch`
//! enqueues the whole step on the rank's stream — its rows' metadata through pinned memory,
//! handoffs written into their blocks (device to device from a producer on this GPU, from the
//! device memory a tcp handoff landed in, else unpacked from pinned memory), the forward, sampling
//! (greedy, or each row's seeded draw keyed on its request and position, as the CPU executor draws;
//! a sequence that verifies drafts gets a row after its last known token and after each draft, each
//! checked on the device as the CPU executor checks it) — records a CUDA event and returns. An
//! export is the blocks themselves, read in place after the step (`SharedKv`), and, for a family
//! with recurrent state, the slot copied out to pinned memory after the forward (`DeviceState`); an
//! arriving handoff's state is copied into its slot before the forward. State copies a step asks
//! for (zero, restore, snapshot, and a rejected draft's rewind — one copy from the states the
//! verification's kernels kept after each fed position) are enqueued in step order. `poll` asks
//! each event, oldest first, whether it has passed (never waits); with deferred output a host
//! function after each step wakes the rank as that step completes, so tokens are applied and
//! streamed as they are computed, not in a burst when the stream runs dry. With the MTP drafter a
//! step's forward also keeps every row's hidden state, and once its samples are known the drafter's
//! passes are enqueued and the step completes after them (`cuda_mtp.rs`). A decode whose previous
//! token is still in flight is fed from the device ring slot the previous step's sampling writes,
//! so the host never waits for sampled tokens to schedule the next step (deferred output on the
//! device). Each in-flight record owns what the GPU still reads or writes: pinned metadata and
//! result buffers, and the handoffs it imports (their producers hold the blocks until those drop).
//!
//! Under expert parallelism a step is enqueued MoE block by MoE block, its routed rows served by
//! the ranks holding their experts device to device (`cuda_experts.rs`), and never captured.
//!
//! Settings: `gpus = [..]` (a rank uses `gpus[rank % len]`, else GPU `rank % visible`),
//! `deferred_output = true` (false: the host waits for each step before the next launch —
//! counted, for comparison), `emulate = false` (true: the same kernels on the CPU, for checks
//! on machines without a GPU), `dtype = "float32"` (`"bfloat16"`: the products' weights in bf16
//! on tensor cores and the KV cache in bf16, kvflow_kernels::cuda::Dtype), `cuda_graphs = true`
//! (a step without handoffs replays its shape's captured CUDA graph instead of launching kernel
//! by kernel, kvflow_kernels::cuda::graph, decode and verification steps padded to few shapes,
//! `cuda_padding.rs`; false: always launched, never padded).
//! Which time it holds: the rank's step, from launch to completion.
//! Which guarantee it carries: deferred output (the ring slot a token in flight is read from;
//! `test_stale_ring_slot` removes it), the device rollback of a rejected draft (the rewind;
//! `keep_rejected_state` removes it), and that a record owns what its step reads.

use super::contract::{Executor, ExecutorContext, ExecutorKind};
use super::cuda_mtp::{MtpPasses, MtpPlan};
use super::cuda_padding;
use super::cuda_settings::CudaSettings;
use super::settings::SettingError;
use crate::step::{
    DraftCheck, ExecutorError, Exported, KvExport, KvImport, Sampled, SeqKey, StateOp, StepCompletion, StepLaunch,
};
use kvflow_kernels::cuda::CudaError;
use kvflow_kernels::cuda::PinnedPool;
use kvflow_kernels::cuda::{
    DeviceBuf, DeviceKv, DeviceModel, DeviceState, Event, Gpu, GraphCounts, LayerMarks, PinnedBuf, RowsOnDevice,
    SharedKv, StepGraphs, StepRows, FROM_RING, RESULT_WORDS,
};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

// (a child of this module: it reads the executor's fields)
#[path = "cuda_completions.rs"]
mod completions;
#[path = "cuda_experts.rs"]
mod experts;
#[path = "cuda_handoffs.rs"]
mod handoffs;
use experts::{Exchanged, ExpertSide};

/// What `enqueue` staged for a step: its metadata in pinned memory, and either the device
/// address a replayed graph writes the results to, or the metadata's device copy (with the
/// rows' addresses in it) and the block lists' addresses for a step enqueued kernel by kernel.
/// The device buffers live until the step is enqueued.
struct Staged {
    meta: PinnedBuf<u32>,
    /// Where a replayed graph writes the results and (keeping them) the hidden states.
    replayed: Option<(u64, u64)>,
    block_lists: Vec<u64>,
    direct: Option<(DeviceBuf<u32>, RowsOnDevice)>,
    results_dev: Option<DeviceBuf<u32>>,
}

/// A CUDA error as a launch failure.
fn fail(e: CudaError) -> ExecutorError {
    ExecutorError::Launch(e.to_string())
}

/// Slots of the sampled-token ring: far more than the samples of the steps in flight.
const RING_SLOTS: usize = 1 << 20;

/// The steps a rank keeps launched on its GPU ([`Executor::max_in_flight`]); the simulated
/// executor, standing for a GPU, keeps as many.
pub const STEPS_IN_FLIGHT: usize = 2;

/// The next slot of the ring, `next` advanced past it.
fn ring_slot(next: &mut usize) -> u32 {
    let s = *next;
    *next = (s + 1) % RING_SLOTS;
    s as u32
}

/// A step the GPU has been given and not finished.
struct InFlight {
    step: u64,
    /// `None`: the step failed at launch (its completion is the error).
    event: Option<Event>,
    error: Option<ExecutorError>,
    /// The sequences sampled, in row order, each with the drafts it verifies (a row each, after
    /// the row of its last known token).
    sampling: Vec<(SeqKey, Vec<u32>)>,
    meta: Option<PinnedBuf<u32>>,
    results: Option<PinnedBuf<u32>>,
    exports: Vec<Exported>,
    /// Handoffs being unpacked (their producers keep the blocks until these drop) and the
    /// pinned copies the GPU reads them from.
    imports: Vec<(KvImport, Option<PinnedBuf<f32>>)>,
    /// Pinned copies of arriving handoffs' state, read by the GPU into their slots.
    states_in: Vec<PinnedBuf<f32>>,
    /// Exports' state slots, copied out after the forward: (export index, floats, pinned copy).
    states_out: Vec<(usize, usize, PinnedBuf<f32>)>,
    /// With the MTP drafter: the drafting planned at launch, then its passes once enqueued.
    mtp: Option<MtpPlan>,
    passes: Option<MtpPasses>,
    /// Expert parallel: what the step's stream read of other ranks' memory and its staged
    /// indices (`cuda_experts.rs`), and the sequences that lost an expert result, with why.
    exchanged: Exchanged,
    failed: Vec<(SeqKey, String)>,
}

impl InFlight {
    /// A step enqueued up to its forward (its event and results come later).
    fn started(step: u64, sampling: Vec<(SeqKey, Vec<u32>)>) -> InFlight {
        InFlight {
            step,
            event: None,
            error: None,
            sampling,
            meta: None,
            results: None,
            exports: Vec::new(),
            imports: Vec::new(),
            states_in: Vec::new(),
            states_out: Vec::new(),
            mtp: None,
            passes: None,
            exchanged: Exchanged::default(),
            failed: Vec::new(),
        }
    }
}

pub struct CudaExecutor {
    gpu: Arc<Gpu>,
    model: DeviceModel,
    /// The rank's paged KV, shared with the handoffs that read its blocks in place.
    kv: Arc<SharedKv>,
    /// Its recurrent state slots and snapshots (families with linear-attention layers).
    state: Option<DeviceState>,
    /// Handoffs imported device to device (from a producer on this GPU) and through the host.
    imported_on_device: u64,
    imported_through_host: u64,
    ring: DeviceBuf<u32>,
    next_slot: usize,
    /// Each sequence's latest sample: the step and the ring slot it goes to.
    sampled: HashMap<SeqKey, (u64, u32)>,
    in_flight: VecDeque<InFlight>,
    deferred_output: bool,
    /// Captured step shapes (`cuda_graphs = true`), else `None`.
    graphs: Option<StepGraphs>,
    /// Pinned buffers of completed steps, for the next ones (page-locking memory is slow, and
    /// freeing it may wait for the device).
    pinned_words: PinnedPool<u32>,
    pinned_floats: PinnedPool<f32>,
    /// With `test_stale_ring_slot`: each sequence's sample before its latest.
    older: Option<HashMap<SeqKey, u32>>,
    /// `test_draws_keyed_on_row`.
    draws_keyed_on_row: bool,
    /// The MTP drafter: drafts proposed after each sampled token (0: none).
    mtp_drafts: usize,
    /// The blocks padding rows write (`cuda_padding.rs`), where steps are padded.
    padding: Option<Vec<u32>>,
    waker: Arc<crate::pool::wake::RankWaker>,
    /// Where launch and poll must never wait for the device (deferred output on a GPU): the
    /// name a call that took longer than [`STALL`] is reported under.
    watch_stalls: Option<String>,
    /// Expert parallel (`cuda_experts.rs`): this rank's experts, the step between its MoE
    /// exchanges, and what serving other ranks' rows holds until the GPU is past it.
    experts: Option<ExpertSide>,
    /// Exports handed back as their step launched (`cuda_handoffs.rs`), until the rank takes them.
    launched_exports: Vec<(usize, Exported)>,
    /// Whether it does (`Executor::exports_at_launch`): fixed by the model and the pool.
    exports_at_launch: bool,
}

impl CudaExecutor {
    pub fn new(ctx: &ExecutorContext, settings: &CudaSettings) -> Result<Self, String> {
        if let (Some(place), false) = (ctx.experts, settings.emulate) {
            // (the exchanged rows are copied device to device within one GPU)
            let (first, own) = (settings.gpu_of(0), settings.gpu_of(ctx.rank));
            if let (Ok(first), Ok(own)) = (first, own) {
                if first != own {
                    return Err(format!(
                        "pool {}: expert_parallel = true on cuda keeps a pool's {} ranks on one GPU, but rank {} would \
                         use GPU {own} and rank 0 GPU {first}; set executor_settings.gpus = [{first}]",
                        ctx.pool, place.ranks, ctx.rank
                    ));
                }
            }
        }
        let gpu = settings.open(ctx.rank).map_err(|e| e.to_string())?;
        let ordinal = gpu.ordinal;
        let model = DeviceModel::upload_as(&gpu, &ctx.model, settings.dtype).map_err(|e| e.to_string())?;
        let l = &ctx.layout;
        let blocks = if l.keeps_kv { l.blocks } else { 0 };
        // decode and verification steps padded to few shapes (graphs replay), where they can be
        let mtp_drafts = if model.has_mtp() { ctx.mtp_drafts } else { 0 };
        let draft_passes = super::mtp::draft_passes(&ctx.model, ctx.experts.is_some(), mtp_drafts);
        let experts = ctx.experts.map(|place| ExpertSide::new(place, &ctx.model, draft_passes));
        let graphs = settings.cuda_graphs && experts.is_none();
        let pads = graphs && l.keeps_kv && model.state_width == 0 && !model.has_indexer();
        let padding: Option<Vec<u32>> =
            pads.then(|| (blocks..blocks + cuda_padding::padding_blocks(l.block_size)).map(|b| b as u32).collect());
        let all_blocks = blocks + padding.as_ref().map_or(0, Vec::len);
        let kv =
            DeviceKv::new(&gpu, &model.kv_widths, l.block_size, all_blocks, model.dtype).map_err(|e| e.to_string())?;
        let kv = Arc::new(SharedKv::new(kv, &gpu).map_err(|e| e.to_string())?);
        let state = match model.state_width {
            0 => None,
            width => {
                Some(DeviceState::new(&gpu, width, l.slots, l.snapshots, l.verify_rows).map_err(|e| e.to_string())?)
            }
        };
        let ring = gpu.zeros::<u32>(RING_SLOTS).map_err(|e| e.to_string())?;
        gpu.wait().map_err(|e| e.to_string())?;
        tracing::info!(pool = %ctx.pool, rank = ctx.rank, gpu = ordinal, name = %gpu.name(), arch = gpu.arch(), "cuda executor ready");
        // (pieces leave at launch where every KV layer is written by the forward's layers)
        let exports_at_launch = experts.is_none() && mtp_drafts == 0 && model.forward_writes_every_kv_layer();
        Ok(CudaExecutor {
            gpu,
            model,
            kv,
            state,
            imported_on_device: 0,
            imported_through_host: 0,
            ring,
            next_slot: 0,
            sampled: HashMap::new(),
            in_flight: VecDeque::new(),
            deferred_output: settings.deferred_output,
            graphs: graphs.then(|| graphs_keeping_hidden(mtp_drafts > 0)),
            older: settings.test_stale_ring_slot.then(HashMap::new),
            draws_keyed_on_row: settings.test_draws_keyed_on_row,
            mtp_drafts,
            padding,
            pinned_words: PinnedPool::default(),
            pinned_floats: PinnedPool::default(),
            waker: ctx.waker.clone(),
            watch_stalls: (settings.deferred_output && !settings.emulate)
                .then(|| format!("pool {} rank {}", ctx.pool, ctx.rank)),
            exports_at_launch,
            experts,
            launched_exports: Vec::new(),
        })
    }

    /// The model as it sits on the device (its sizes, for benches).
    pub fn device_model(&self) -> &DeviceModel {
        &self.model
    }

    /// The rank's paged KV as a save reads it in place (for `bench calibrate`'s save reads).
    pub fn shared_kv(&self) -> &Arc<SharedKv> {
        &self.kv
    }

    /// The rank's GPU.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Times the host waited for this rank's GPU (0 on the decode path with deferred output).
    pub fn host_waits(&self) -> u64 {
        self.gpu.host_waits()
    }

    /// How steps went through captured graphs (`None`: `cuda_graphs = false`).
    pub fn graph_counts(&self) -> Option<GraphCounts> {
        self.graphs.as_ref().map(|g| g.counts)
    }

    /// Turns captured graphs on or off from the next step (benches compare the two).
    pub fn use_graphs(&mut self, on: bool) {
        if on != self.graphs.is_some() && self.experts.is_none() {
            self.graphs = on.then(|| graphs_keeping_hidden(self.mtp_drafts > 0));
        }
    }

    /// Handoffs imported so far: (device to device, through the host).
    pub fn imports(&self) -> (u64, u64) {
        (self.imported_on_device, self.imported_through_host)
    }

    fn slot(&mut self) -> u32 {
        ring_slot(&mut self.next_slot)
    }

    /// Enqueues the step; `Err` when it cannot run (nothing it enqueued is waited for). In
    /// stream order: the state copies before the forward, the rows' metadata, the handoffs into
    /// their blocks, the forward and sampling, the snapshots after it, the results back to pinned
    /// memory, the exports' state slots; then the event the step completes at.
    fn enqueue(&mut self, launch: &StepLaunch<'_>) -> Result<Option<InFlight>, ExecutorError> {
        if self.state.is_none() && (!launch.before.is_empty() || !launch.after.is_empty()) {
            return Err(ExecutorError::Launch(
                "the model keeps no recurrent state, and state copies were asked".into(),
            ));
        }
        if let Some(applied) = launch.applied_through {
            self.sampled.retain(|_, (when, _)| *when > applied);
        }
        let (mut rows, sampling) = self.step_rows(launch)?;
        let gpu = self.gpu.clone();
        self.copy_states_before(&gpu, launch)?;
        self.keep_verified_states(launch, &mut rows)?;
        let mut staged = self.stage_metadata(&gpu, launch, &rows)?;
        let mut record = InFlight::started(launch.step, sampling);
        (record.imports, record.states_in) = self.import_handoffs(&gpu, launch, &staged.block_lists)?;
        record.mtp = match (self.mtp_drafts, rows.rows()) {
            (0, _) | (_, 0) => None,
            (_, t) => Some(MtpPlan::of(launch, &rows, gpu.scratch::<f32>(t * self.model.hidden).map_err(fail)?)),
        };
        if self.experts.is_some() && rows.rows() > 0 {
            // run MoE layer by MoE layer; the record goes in flight after the last exchange
            return self.begin_split(&gpu, launch, &rows, staged, record).map(|()| None);
        }
        let hidden_out = record.mtp.as_ref().map_or(0, |p| p.hidden.ptr());
        // streamed pieces leave now, each layer once the forward wrote it (`cuda_handoffs.rs`)
        let marking = self.exports_at_launch() && launch.exports.iter().any(|e| e.at_launch);
        let (results_at, marks) = self.enqueue_forward(&gpu, &rows, &mut staged, hidden_out, marking)?;
        self.end_step(&gpu, &mut record, staged.meta, rows.sampled(), results_at, launch.after, launch.exports)?;
        if let Some(marks) = marks {
            self.hand_out_at_launch(launch.exports, &record.exports, Arc::new(marks));
        }
        Ok(Some(record))
    }

    /// The end of a step enqueued up to its results at `results_at` (`sampled` rows): the
    /// snapshots of the boundaries it reached, the results back to pinned memory, the exports;
    /// then the event it completes at.
    #[allow(clippy::too_many_arguments)]
    fn end_step(
        &mut self,
        gpu: &Gpu,
        record: &mut InFlight,
        meta: PinnedBuf<u32>,
        sampled: usize,
        results_at: u64,
        after: &[StateOp],
        exports: &[KvExport],
    ) -> Result<(), ExecutorError> {
        record.meta = Some(meta);
        self.end_forward(gpu, record, sampled, results_at, after)?;
        self.end_exports(gpu, record, exports)
    }

    /// The first half of [`Self::end_step`]: the snapshots, and the results back to pinned memory.
    fn end_forward(
        &mut self,
        gpu: &Gpu,
        record: &mut InFlight,
        sampled: usize,
        results_at: u64,
        after: &[StateOp],
    ) -> Result<(), ExecutorError> {
        if let Some(state) = &self.state {
            for op in after {
                if let StateOp::Snapshot { slot, snapshot } = *op {
                    state.snapshot(gpu, slot, snapshot).map_err(fail)?;
                }
            }
        }
        let mut results = self.pinned_words.take(gpu, sampled * RESULT_WORDS).map_err(fail)?;
        if sampled > 0 {
            gpu.copy_to_host(&mut results, results_at, sampled * RESULT_WORDS).map_err(fail)?;
        }
        record.results = Some(results);
        Ok(())
    }

    /// The second half of [`Self::end_step`] (after an expert-parallel step's draft passes, which
    /// write the MTP layer's KV the exports carry): the exports, and the event it completes at.
    fn end_exports(&mut self, gpu: &Gpu, record: &mut InFlight, exports: &[KvExport]) -> Result<(), ExecutorError> {
        (record.exports, record.states_out) = self.export_handoffs(gpu, exports)?;
        record.event = Some(gpu.record().map_err(fail)?);
        Ok(())
    }

    /// 1. The step's rows: literal tokens, or the ring slot of a token still in flight; each
    ///    sampled row gets a ring slot. Returns the rows and the sequences sampled, in row order.
    #[allow(clippy::type_complexity)]
    fn step_rows(&mut self, launch: &StepLaunch<'_>) -> Result<(StepRows, Vec<(SeqKey, Vec<u32>)>), ExecutorError> {
        let mut rows = StepRows::default();
        let mut sampling: Vec<(SeqKey, Vec<u32>)> = Vec::new();
        let mut fed = Vec::new();
        for s in launch.seqs() {
            fed.clear();
            fed.extend_from_slice(s.known);
            if let Some(at) = s.deferred {
                match self.sampled.get(&s.key) {
                    Some(&(when, slot)) if when == at => {
                        let stale = self.older.as_ref().and_then(|o| o.get(&s.key).copied());
                        fed.push(FROM_RING | stale.unwrap_or(slot))
                    }
                    _ => return Err(ExecutorError::UnresolvedToken { seq: s.key, step: at }),
                }
            }
            self.kv.kv.check_blocks(s.block_table).map_err(fail)?;
            let keeps_kv = !self.model.kv_widths.is_empty();
            if keeps_kv && s.block_table.len() * self.kv.kv.block_size < s.start_pos + fed.len() {
                return Err(ExecutorError::Launch(format!(
                    "sequence {}: its block table does not cover the step",
                    s.key
                )));
            }
            // a verifying sequence samples after its last known token and after each draft
            fed.extend_from_slice(s.drafts);
            let slots: Vec<u32> = match s.sample {
                true => (0..=s.drafts.len()).map(|_| self.slot()).collect(),
                false => Vec::new(),
            };
            let first_row = rows.sampled();
            rows.push_seq_sampling(&fed, s.start_pos, s.block_table, self.kv.kv.block_size, &slots);
            rows.prompt_len(s.prompt_len);
            if let Some(state_slot) = s.slot {
                rows.in_slot(state_slot);
            }
            let mut sampler = s.sampler;
            if self.draws_keyed_on_row {
                sampler.request_id = sampling.len() as u64;
            }
            // row k chooses the token at the position after the one it reads
            let first = s.start_pos + fed.len() - s.drafts.len();
            for k in 0..slots.len() {
                rows.row_drawn_by(first_row + k, &sampler, first + k);
                if let Some(&draft) = s.drafts.get(k) {
                    rows.row_checks_draft(first_row + k, draft);
                }
            }
            if let Some(&slot) = slots.last() {
                sampling.push((s.key, s.drafts.to_vec()));
                // A verification's last row is not the sequence's next token until `verify` says
                // so, and its sequence is not scheduled before: no later launch reads it.
                let named = if s.drafts.is_empty() { Some((launch.step, slot)) } else { None };
                match named.and_then(|n| self.sampled.insert(s.key, n)) {
                    Some(previous) => {
                        if let Some(older) = self.older.as_mut() {
                            older.insert(s.key, previous.1);
                        }
                    }
                    None if named.is_none() => {
                        self.sampled.remove(&s.key);
                    }
                    None => {}
                }
            }
        }
        if let Some(table) = self.padding.as_ref().filter(|_| self.graphs.is_some()) {
            let (bs, next_slot) = (self.kv.kv.block_size, &mut self.next_slot);
            cuda_padding::pad(&mut rows, table, bs, &mut || ring_slot(next_slot));
        }
        Ok((rows, sampling))
    }

    /// 2. The state copies the step asks for before its forward, in step order.
    ///    A rejected draft's rollback (`Rewind`) is one copy from the states the verification kept.
    fn copy_states_before(&self, gpu: &Gpu, launch: &StepLaunch<'_>) -> Result<(), ExecutorError> {
        let Some(state) = &self.state else { return Ok(()) };
        for op in launch.before {
            match *op {
                StateOp::Zero { slot } => state.zero_slot(gpu, slot).map_err(fail)?,
                StateOp::Restore { snapshot, slot } => state.restore(gpu, snapshot, slot).map_err(fail)?,
                StateOp::Rewind { slot, position } => {
                    if !state.rewind(gpu, slot, position).map_err(fail)? {
                        let why = format!("slot {slot} kept no state after position {position} to roll back to");
                        return Err(ExecutorError::Launch(why));
                    }
                }
                StateOp::Snapshot { .. } => {}
            }
        }
        Ok(())
    }

    /// 3. What a rejected draft must not leave behind: a verifying sequence with a state slot
    ///    has the state after each position it feeds kept on the device (after this step's own
    ///    rollbacks, which read the previous verification's).
    fn keep_verified_states(&self, launch: &StepLaunch<'_>, rows: &mut StepRows) -> Result<(), ExecutorError> {
        let Some(state) = &self.state else { return Ok(()) };
        for (i, s) in launch.seqs().enumerate() {
            if let (Some(slot), false) = (s.slot, s.drafts.is_empty()) {
                let first = state.track_rows(slot, s.start_pos, rows.seq_rows(i)).map_err(fail)?;
                rows.keeps_states(i, first);
            }
        }
        Ok(())
    }

    /// The rows and block lists into pinned memory — the imports' own blocks, then the
    /// exports', then the blocks each in-place import reads — and either replayed through the
    /// shape's captured graph (a step without handoffs, where there is one: the graph reads the
    /// rows from its own buffer and writes the results to its own) or copied to the device.
    fn stage_metadata(&mut self, gpu: &Gpu, launch: &StepLaunch<'_>, rows: &StepRows) -> Result<Staged, ExecutorError> {
        let sources = launch.imports.iter().map(|i| i.from.source().map_or(&[][..], |s| &s.blocks[..]));
        let lists: Vec<&[u32]> = launch
            .imports
            .iter()
            .map(|i| &i.blocks[..])
            .chain(launch.exports.iter().map(|e| &e.blocks[..]))
            .chain(sources)
            .collect();
        let meta_words = rows.words() + lists.iter().map(|l| l.len()).sum::<usize>();
        let mut meta = self.pinned_words.take(gpu, meta_words).map_err(fail)?;
        let replayed = match self.graphs.as_mut() {
            Some(graphs) if lists.is_empty() => {
                rows.pack(meta.as_mut_slice(), 0);
                let (model, kv, state) = (&self.model, &self.kv.kv, self.state.as_ref());
                graphs.enqueue(gpu, model, kv, state, rows, &meta, self.ring.ptr()).map_err(fail)?
            }
            _ => None,
        };
        let mut block_lists = Vec::new();
        let mut direct = None;
        if replayed.is_none() {
            let meta_dev = gpu.scratch::<u32>(meta_words).map_err(fail)?;
            let at = rows.pack(meta.as_mut_slice(), meta_dev.ptr());
            let mut cursor = rows.words();
            for (i, blocks) in lists.into_iter().enumerate() {
                if i < launch.imports.len() + launch.exports.len() {
                    self.kv.kv.check_blocks(blocks).map_err(fail)?;
                }
                meta.as_mut_slice()[cursor..cursor + blocks.len()].copy_from_slice(blocks);
                block_lists.push(meta_dev.at(cursor));
                cursor += blocks.len();
            }
            gpu.copy_to_device(meta_dev.ptr(), &meta, meta_words).map_err(fail)?;
            direct = Some((meta_dev, at));
        }
        Ok(Staged { meta, replayed, block_lists, direct, results_dev: None })
    }

    /// 4. The forward and sampling (already enqueued when replayed); every row's final-normed
    ///    hidden state into `hidden_out` unless it is 0 (the MTP drafter). Returns where the
    ///    results are on the device, and with `marking` (a step with exports, never replayed)
    ///    when each KV layer is written.
    fn enqueue_forward(
        &mut self,
        gpu: &Gpu,
        rows: &StepRows,
        staged: &mut Staged,
        hidden_out: u64,
        marking: bool,
    ) -> Result<(u64, Option<LayerMarks>), ExecutorError> {
        let n = rows.sampled();
        let mut marked = marking.then(|| LayerMarks::unset(self.kv.kv.num_layers()));
        let results_at = match (staged.replayed, &staged.direct) {
            (Some((results_at, hidden_at)), _) => {
                if hidden_out != 0 {
                    let bytes = rows.rows() * self.model.hidden * 4;
                    gpu.copy_on_device(hidden_out, hidden_at, bytes).map_err(fail)?;
                }
                results_at
            }
            (None, Some((_, at))) => {
                let dev = staged.results_dev.insert(gpu.scratch::<u32>(n * RESULT_WORDS).map_err(fail)?);
                let (model, kv, state, ring) = (&self.model, &self.kv.kv, self.state.as_ref(), self.ring.ptr());
                let marks = marked.as_mut();
                model
                    .enqueue_step(gpu, kv, state, rows, *at, ring, dev.ptr(), hidden_out, false, marks)
                    .map_err(fail)?;
                dev.ptr()
            }
            (None, None) => unreachable!("a step not replayed is enqueued directly"),
        };
        // (a replayed step has no exports, so nothing to mark)
        let unwritten = || ExecutorError::Launch("a KV layer the forward does not write".into());
        let marks = marked.filter(|_| staged.replayed.is_none()).map(|m| LayerMarks::of(m).ok_or_else(unwritten));
        let marks = marks.transpose()?;
        Ok((results_at, marks))
    }

    /// The completion of a finished record; its pinned buffers go back to the pools.
    fn complete(&mut self, mut f: InFlight) -> StepCompletion {
        let completion = Self::completion_of(&mut f);
        if let Some(passes) = f.passes.take() {
            passes.give_back(&mut self.pinned_words);
        }
        self.pinned_words.give_back(f.meta.take());
        self.pinned_words.give_back(f.results.take());
        for (_, staged) in f.imports.drain(..) {
            self.pinned_floats.give_back(staged);
        }
        for staged in f.states_in.drain(..).chain(f.states_out.drain(..).map(|(_, _, b)| b)) {
            self.pinned_floats.give_back(Some(staged));
        }
        for staged in std::mem::take(&mut f.exchanged).released() {
            self.pinned_words.give_back(Some(staged));
        }
        completion
    }

    fn completion_of(f: &mut InFlight) -> StepCompletion {
        if let Some(e) = f.error.take() {
            return StepCompletion::of(f.step, Err(e));
        }
        let mut sampled = Self::sampled_of(f);
        if let Some(passes) = &f.passes {
            passes.drafts_into(&mut sampled);
        }
        let mut exports = std::mem::take(&mut f.exports);
        for (i, floats, copy) in &f.states_out {
            // the step's event has passed: the copy out is complete
            if let Some(e) = exports.get_mut(*i) {
                e.state = Some(copy.as_slice()[..*floats].to_vec());
            }
        }
        StepCompletion { step: f.step, result: Ok(sampled), exports, failed: std::mem::take(&mut f.failed) }
    }

    /// What a completed forward sampled, sequence by sequence.
    fn sampled_of(f: &InFlight) -> Vec<Sampled> {
        let words = f.results.as_ref().map_or(&[][..], |r| r.as_slice());
        let mut rows =
            words.chunks(RESULT_WORDS).map(|r| ((r[1] != 0).then_some(r[0]), r[2] as u64 | (r[3] as u64) << 32));
        f.sampling.iter().map(|(seq, drafts)| scored(*seq, drafts, &mut rows)).collect()
    }

    /// A record whose step is enqueued whole (or failed) goes in flight: the rank is woken as
    /// it completes, not when the stream runs dry, so each token is applied (and streamed) when
    /// computed, however far ahead the rank launched.
    fn go_in_flight(&mut self, record: InFlight) {
        let launched = record.event.is_some();
        self.in_flight.push_back(record);
        if launched && self.deferred_output {
            let waker = self.waker.clone();
            if let Err(e) = self.gpu.when_reached(Box::new(move || waker.wake())) {
                tracing::error!("cuda: {e}");
            }
        }
        if !self.deferred_output {
            // For comparison only: the host waits for the step before the next is scheduled.
            if let Err(e) = self.gpu.wait() {
                tracing::error!("cuda: {e}");
            }
        }
    }

    /// 6. With the MTP drafter, once a step's forward has completed: its draft passes, enqueued
    ///    on the stream (`cuda_mtp.rs`), and the event the step now completes at.
    fn enqueue_drafting(&mut self, f: &mut InFlight) -> Result<(), ExecutorError> {
        let Some(plan) = &f.mtp else { return Ok(()) };
        let sampled = Self::sampled_of(f);
        let Self { gpu, model, kv, ring, next_slot, pinned_words, mtp_drafts, .. } = self;
        let mut slot = || {
            let s = *next_slot;
            *next_slot = (s + 1) % RING_SLOTS;
            s as u32
        };
        let passes = plan
            .enqueue(gpu, model, &kv.kv, ring.ptr(), &sampled, *mtp_drafts, &mut slot, pinned_words)
            .map_err(fail)?;
        f.passes = Some(passes);
        f.event = Some(gpu.record().map_err(fail)?);
        let waker = self.waker.clone();
        self.gpu.when_reached(Box::new(move || waker.wake())).map_err(fail)
    }
}

/// A sequence's completion from its rows' results: the token after its last known token, and
/// for each draft whether the row before it chose it and what the row after it chose (the
/// CPU executor's `score_drafts`; a drawn row keeps a draft by the speculative-sampling rule, so
/// it chose the draft exactly when it kept it).
fn scored(seq: SeqKey, drafts: &[u32], rows: &mut impl Iterator<Item = (Option<u32>, u64)>) -> Sampled {
    let (token, hash) = rows.next().unwrap_or((None, 0));
    let mut sampled = Sampled::one(seq, token, hash);
    let mut chose = token;
    for &draft in drafts {
        let (next, next_hash) = rows.next().unwrap_or((None, 0));
        sampled.checks.push(DraftCheck { kept: chose == Some(draft), next, next_hash });
        chose = next;
    }
    sampled
}

impl CudaExecutor {
    fn launch_step(&mut self, step: &StepLaunch<'_>) {
        let record = match self.enqueue(step) {
            Ok(Some(record)) => record,
            // expert parallel: in flight after its last exchange (`cuda_experts.rs`)
            Ok(None) => return,
            Err(e) => {
                let mut failed = InFlight::started(step.step, Vec::new());
                failed.error = Some(e);
                failed
            }
        };
        self.go_in_flight(record);
    }
}

impl Executor for CudaExecutor {
    fn phases(&self) -> usize {
        1
    }

    /// One step running and the next launched behind it: all deferred output needs.
    fn max_in_flight(&self) -> Option<usize> {
        Some(STEPS_IN_FLIGHT)
    }

    fn expert_parallel(&mut self) -> Option<&mut dyn super::contract::ExpertParallel> {
        self.experts.is_some().then_some(self as &mut dyn super::contract::ExpertParallel)
    }

    /// Without expert parallelism or the MTP drafter (their steps write KV after the forward's
    /// layers), when the forward writes every KV layer.
    fn exports_at_launch(&self) -> bool {
        self.exports_at_launch
    }

    fn take_launched_exports(&mut self, out: &mut Vec<(usize, Exported)>) {
        out.append(&mut self.launched_exports);
    }

    fn launch(&mut self, step: &StepLaunch<'_>, _phase: usize) {
        let started = Instant::now();
        self.launch_step(step);
        self.note_stall("launching step", step.step, started);
    }

    fn poll(&mut self, out: &mut Vec<StepCompletion>) {
        let started = Instant::now();
        let front = self.in_flight.front().map_or(0, |f| f.step);
        self.poll_steps(out);
        self.note_stall("taking the completions from step", front, started);
    }

    fn flush(&mut self) {
        if self.in_flight.iter().any(|f| f.event.is_some()) {
            let waker = self.waker.clone();
            if let Err(e) = self.gpu.when_reached(Box::new(move || waker.wake())) {
                tracing::error!("cuda: {e}");
                self.waker.wake();
            }
        } else if !self.in_flight.is_empty() {
            self.waker.wake();
        }
    }
}

impl Drop for CudaExecutor {
    /// Nothing the GPU may still use is freed under it (a run ends with no step in flight; this
    /// is for one that did not).
    fn drop(&mut self) {
        if self.in_flight.iter().any(|f| f.event.is_some()) || self.serves_rows() {
            let _ = self.gpu.wait();
        }
    }
}

/// A rank's captured steps, also keeping every row's hidden state for the MTP drafter.
fn graphs_keeping_hidden(keep_hidden: bool) -> StepGraphs {
    let mut graphs = StepGraphs::default();
    graphs.keep_hidden = keep_hidden;
    graphs
}

pub(super) struct CudaKind;

impl ExecutorKind for CudaKind {
    fn check(&self, settings: &toml::Table) -> Result<(), SettingError> {
        let s = CudaSettings::read(settings)?;
        if s.gpus.as_ref().is_some_and(Vec::is_empty) {
            return Err(SettingError { key: "gpus".into(), message: "expected at least one GPU index".into() });
        }
        Ok(())
    }

    fn build(&self, settings: &toml::Table, ctx: ExecutorContext) -> Result<Box<dyn Executor>, String> {
        let s = CudaSettings::read(settings).map_err(|e| e.to_string())?;
        Ok(Box::new(CudaExecutor::new(&ctx, &s)?))
    }
}
