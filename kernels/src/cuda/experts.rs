//! Expert parallelism on the device (DESIGN §4): a step run MoE layer by MoE layer
//! ([`SplitStep`]), each MoE block's routed experts served by the ranks that hold them. The floats
//! stay in device memory: a rank's routed rows, and the results of the experts it holds, are
//! [`DeviceRows`] that the receiving rank copies device to device on its own stream after the
//! sender's event. The host learns only the routes (each row's experts: who gets which rows).
//!
//! Bit for bit the unsplit block: each pair's expert output does not depend on which pairs share
//! its launch (`expert_products`), and the combination sums each row's routes in ascending expert
//! order from the same `[rows × top_k]` layout (`moe_combine`).

use super::error::CudaError;
use super::gpu::{DeviceBuf, Event, Gpu, PinnedBuf};
use super::kv::DeviceKv;
use super::model::{DevFfn, DevLayer, DeviceModel};
use super::parts::moe::DevMoe;
use super::parts::Step;
use super::rows::{RowsOnDevice, StepShape};
use super::state::DeviceState;
use crate::cuda::launch::Arg;
use std::sync::Arc;

/// Rows of floats in one rank's device memory that a rank on the same device copies once
/// `ready` has passed on the GPU: an expert exchange's payload. The buffer lives while a holder
/// does, and each holder keeps it until its own stream is past its copy (seen from the host), so
/// it is never freed under a reader.
#[derive(Clone)]
pub struct DeviceRows {
    buf: Arc<DeviceBuf<f32>>,
    first: usize,
    pub rows: usize,
    pub width: usize,
    ready: Arc<Event>,
    ordinal: usize,
    emulated: bool,
}

impl std::fmt::Debug for DeviceRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceRows({} × {} on GPU {} at {:#x})", self.rows, self.width, self.ordinal, self.ptr())
    }
}

impl PartialEq for DeviceRows {
    fn eq(&self, other: &Self) -> bool {
        self.ptr() == other.ptr() && self.rows == other.rows && self.width == other.width
    }
}

impl DeviceRows {
    fn of(gpu: &Gpu, buf: DeviceBuf<f32>, rows: usize, width: usize) -> Result<DeviceRows, CudaError> {
        let ready = Arc::new(gpu.record()?);
        Ok(DeviceRows {
            buf: Arc::new(buf),
            first: 0,
            rows,
            width,
            ready,
            ordinal: gpu.ordinal,
            emulated: gpu.is_emulated(),
        })
    }

    /// Rows `first..first + rows` of these.
    pub fn slice(&self, first: usize, rows: usize) -> DeviceRows {
        DeviceRows { first: self.first + first, rows, ..self.clone() }
    }

    pub fn bytes(&self) -> usize {
        self.rows * self.width * std::mem::size_of::<f32>()
    }

    fn ptr(&self) -> u64 {
        self.buf.at(self.first * self.width)
    }

    /// Enqueues on `gpu`'s stream, after the sender's event, the copy of these rows to `dst`.
    pub fn copy_to(&self, gpu: &Gpu, dst: u64) -> Result<(), CudaError> {
        if gpu.is_emulated() != self.emulated || gpu.ordinal != self.ordinal {
            return Err(CudaError::Unsupported(format!(
                "expert rows in the memory of GPU {} read from GPU {} (expert parallelism keeps a pool on one device)",
                self.ordinal, gpu.ordinal
            )));
        }
        gpu.stream_waits_for(&self.ready)?;
        gpu.copy_on_device(dst, self.ptr(), self.bytes())
    }
}

/// A step — or an MTP pass (`mtp`: its one layer is the MTP block) — between its MoE exchanges:
/// its activations, where it stands, and what its stream still reads.
pub struct SplitStep {
    mtp: bool,
    shape: StepShape,
    at: RowsOnDevice,
    ring: u64,
    hidden: usize,
    h: DeviceBuf<f32>,
    x: DeviceBuf<f32>,
    x_bf16: DeviceBuf<u16>,
    /// The layer whose MoE block is next (routed), or `layers.len()`: the layers are done.
    layer: usize,
    /// The routing of that block: each row's experts and weights, `[rows × top_k]`.
    routed: Option<(DeviceBuf<i32>, DeviceBuf<f32>)>,
    /// The experts copied to the host, and when they are there.
    routes: PinnedBuf<u32>,
    routes_ready: Option<Event>,
    /// Payloads and staged indices this step's stream reads (held until it completes).
    held: Vec<DeviceRows>,
    staged: Vec<PinnedBuf<u32>>,
}

impl SplitStep {
    /// A split at its first layer, its hidden rows `h` (`rows × hidden`) ready.
    #[allow(clippy::too_many_arguments)]
    fn new(
        gpu: &Gpu,
        mtp: bool,
        shape: StepShape,
        at: RowsOnDevice,
        ring: u64,
        hidden: usize,
        h: DeviceBuf<f32>,
        routes: PinnedBuf<u32>,
    ) -> Result<SplitStep, CudaError> {
        let n = shape.rows * hidden;
        let (x, x_bf16) = (gpu.scratch::<f32>(n)?, gpu.scratch::<u16>(n)?);
        let (layer, routed, routes_ready, held, staged) = (0, None, None, Vec::new(), Vec::new());
        Ok(SplitStep { mtp, shape, at, ring, hidden, h, x, x_bf16, layer, routed, routes, routes_ready, held, staged })
    }

    /// The MoE block routed and waiting for its experts, with its `top_k`, if any.
    pub fn routed_top_k(&self, model: &DeviceModel) -> Option<usize> {
        self.routed.as_ref().and_then(|_| model.split_moe(self)).map(|m| m.top_k)
    }

    /// Every row's experts at the routed block, `[rows × top_k]` ascending per row; waits for
    /// the copy (a host wait, counted: who gets which rows is what the dataflow carries).
    pub fn routes(&self, gpu: &Gpu, top_k: usize) -> Result<&[u32], CudaError> {
        if let Some(ready) = &self.routes_ready {
            gpu.wait_for(ready)?;
        }
        Ok(&self.routes.as_slice()[..self.shape.rows * top_k])
    }

    /// Rows of the routed block's input `x` picked by `index` (staged in pinned memory, which
    /// the step holds until it completes): the rows this rank sends to the experts' owners.
    pub fn gather(&mut self, gpu: &Gpu, index: PinnedBuf<u32>, n: usize) -> Result<DeviceRows, CudaError> {
        let width = self.hidden;
        let out = gpu.scratch::<f32>(n * width)?;
        if n > 0 {
            let on_device = gpu.scratch::<u32>(n)?;
            gpu.copy_to_device(on_device.ptr(), &index, n)?;
            gather_rows(gpu, out.ptr(), self.x.ptr(), on_device.ptr(), n, width)?;
        }
        self.staged.push(index);
        DeviceRows::of(gpu, out, n, width)
    }

    /// Everything the step's stream reads that it holds, to keep until it has completed, and
    /// its hidden rows (an MTP pass's output, which the next pass reads).
    pub fn into_held(self) -> (DeviceBuf<f32>, Vec<DeviceRows>, Vec<PinnedBuf<u32>>) {
        let mut staged = self.staged;
        staged.push(self.routes);
        (self.h, self.held, staged)
    }

    pub fn finished(&self, model: &DeviceModel) -> bool {
        self.layer >= model.split_layers(self).len()
    }
}

fn gather_rows(gpu: &Gpu, out: u64, src: u64, index: u64, n: usize, width: usize) -> Result<(), CudaError> {
    gpu.launch(
        "gather_rows",
        (n as u32, 1, 1),
        256,
        0,
        &[Arg::Ptr(out), Arg::Ptr(src), Arg::Ptr(index), Arg::I32(width as i32)],
    )
}

impl DeviceModel {
    /// The layers a split runs: the model's, or an MTP pass's one.
    fn split_layers(&self, split: &SplitStep) -> &[DevLayer] {
        match (split.mtp, &self.mtp) {
            (true, Some(m)) => std::slice::from_ref(&m.block),
            (true, None) => &[],
            (false, _) => &self.layers,
        }
    }

    /// The MoE block of the split's current layer, if it is one.
    fn split_moe(&self, split: &SplitStep) -> Option<&DevMoe> {
        match &self.split_layers(split).get(split.layer)?.ffn {
            DevFfn::Moe(m) => Some(m),
            DevFfn::Dense(_) => None,
        }
    }

    /// The model's MoE blocks in order, then the MTP layer's if it is one.
    fn moe_blocks(&self) -> impl Iterator<Item = &DevMoe> {
        let mtp = self.mtp.as_ref().map(|m| &m.block);
        self.layers.iter().chain(mtp).filter_map(|l| if let DevFfn::Moe(m) = &l.ffn { Some(m) } else { None })
    }

    /// The `moe`-th MoE block (after the model's, the MTP layer's).
    fn moe_block(&self, moe: usize) -> Option<&DevMoe> {
        self.moe_blocks().nth(moe)
    }

    /// The widest `top_k` of the MoE blocks (0 without one).
    pub fn max_top_k(&self) -> usize {
        self.moe_blocks().map(|m| m.top_k).max().unwrap_or(0)
    }

    /// The first MoE block's held experts: `(first, held)` (every block holds the same range).
    pub fn held_experts(&self) -> Option<(usize, usize)> {
        self.moe_block(0).map(|m| (m.first_expert, m.held))
    }

    /// Enqueues a step up to its first MoE block's routing: the embeddings, the layers before,
    /// and the routes copied to `routes` (pinned, `rows × top_k` at least). A model without a
    /// MoE block is refused (it has nothing to split at).
    #[allow(clippy::too_many_arguments)]
    pub fn begin_split(
        &self,
        gpu: &Gpu,
        kv: &DeviceKv,
        state: Option<&DeviceState>,
        shape: StepShape,
        at: RowsOnDevice,
        ring: u64,
        routes: PinnedBuf<u32>,
    ) -> Result<SplitStep, CudaError> {
        if self.max_top_k() == 0 {
            return Err(CudaError::Unsupported("a step split at MoE blocks of a model without one".into()));
        }
        let h = self.embed_rows(gpu, shape.rows, at, ring)?;
        let mut split = SplitStep::new(gpu, false, shape, at, ring, self.hidden, h, routes)?;
        self.run_to_routing(gpu, kv, state, &mut split)?;
        Ok(split)
    }

    /// Enqueues an MTP pass (as [`DeviceModel::enqueue_mtp_pass`]) up to its MoE block's
    /// routing, the routes copied to `routes`; `continue_split` runs it on to its drafts. An MTP
    /// layer without a MoE block is refused (it has nothing to split at).
    #[allow(clippy::too_many_arguments)]
    pub fn begin_mtp_split(
        &self,
        gpu: &Gpu,
        kv: &DeviceKv,
        shape: StepShape,
        at: RowsOnDevice,
        hidden_in: u64,
        ring: u64,
        routes: PinnedBuf<u32>,
    ) -> Result<SplitStep, CudaError> {
        let m = self.mtp_layer()?;
        if !matches!(m.block.ffn, DevFfn::Moe(_)) {
            return Err(CudaError::Unsupported("an MTP pass split at the MoE block of a dense MTP layer".into()));
        }
        let (t, d) = (shape.rows, self.hidden);
        let h = gpu.scratch::<f32>(t * d)?;
        let s = Step { gpu, kv, state: None, rows: t, seqs: shape.seqs, at, index_row: shape.index_row };
        self.mtp_input(&s, m, ring, hidden_in, h.ptr())?;
        let mut split = SplitStep::new(gpu, true, shape, at, ring, d, h, routes)?;
        self.run_to_routing(gpu, kv, None, &mut split)?;
        Ok(split)
    }

    /// Runs the layers from the split's current one: whole layers up to the next MoE block, whose
    /// mixer and routing it enqueues, then stops.
    fn run_to_routing(
        &self,
        gpu: &Gpu,
        kv: &DeviceKv,
        state: Option<&DeviceState>,
        split: &mut SplitStep,
    ) -> Result<(), CudaError> {
        let (shape, hidden) = (split.shape, self.hidden);
        let s = Step { gpu, kv, state, rows: shape.rows, seqs: shape.seqs, at: split.at, index_row: shape.index_row };
        let (h, x, x_bf16) = (split.h.ptr(), split.x.ptr(), split.x_bf16.ptr());
        while let Some(layer) = self.split_layers(split).get(split.layer) {
            let DevFfn::Moe(m) = &layer.ffn else {
                s.layer(layer, h, x, x_bf16, hidden)?;
                split.layer += 1;
                continue;
            };
            s.attend(layer, h, x, x_bf16, hidden)?;
            let (experts, weights) = s.route(x, m, hidden)?;
            let n = shape.rows * m.top_k;
            if split.routes.len() < n {
                return Err(CudaError::Unsupported(format!("{n} routes staged in {}", split.routes.len())));
            }
            gpu.copy_to_host(&mut split.routes, experts.ptr(), n)?;
            split.routes_ready = Some(gpu.record()?);
            split.routed = Some((experts, weights));
            return Ok(());
        }
        Ok(())
    }

    /// This rank's experts of MoE block `moe` over the rows other ranks sent it (`inputs`, in
    /// sender order; each pair's expert in `experts`, staged: its index among the experts held
    /// here), each expert once over all its rows: their outputs, in the same order, once the
    /// returned rows' event has passed.
    pub fn serve_experts(
        &self,
        gpu: &Gpu,
        kv: &DeviceKv,
        moe: usize,
        inputs: &[&DeviceRows],
        experts: &PinnedBuf<u32>,
    ) -> Result<DeviceRows, CudaError> {
        let m = self.moe_block(moe).ok_or_else(|| CudaError::Unsupported(format!("no MoE block {moe}")))?;
        let (hidden, pairs) = (self.hidden, inputs.iter().map(|r| r.rows).sum::<usize>());
        let out = gpu.scratch::<f32>(pairs * hidden)?;
        if pairs > 0 {
            let x = gpu.scratch::<f32>(pairs * hidden)?;
            let mut at = 0;
            for rows in inputs {
                rows.copy_to(gpu, x.at(at * hidden))?;
                at += rows.rows;
            }
            let ids = gpu.scratch::<u32>(pairs)?;
            gpu.copy_to_device(ids.ptr(), experts, pairs)?;
            let s = Step { gpu, kv, state: None, rows: pairs, seqs: 0, at: RowsOnDevice::default(), index_row: 0 };
            s.expert_products(out.ptr(), x.ptr(), ids.ptr(), pairs, 1, m, hidden)?;
        }
        DeviceRows::of(gpu, out, pairs, hidden)
    }

    /// Combines the routed block's expert outputs into the split step — `results` (the
    /// owners' rows, in any order) copied after their events into one buffer whose last row is
    /// zeros, `index` (staged, `rows × top_k`) naming each route's row there — and runs on to
    /// the next routing. Once the layers are done it enqueues the head as
    /// [`DeviceModel::enqueue_head`] does (`results_at`, `hidden_out`), or an MTP pass's as
    /// [`DeviceModel::enqueue_mtp_pass`] does (`results_at`). The step holds the results and the
    /// index until it completes.
    #[allow(clippy::too_many_arguments)]
    pub fn continue_split(
        &self,
        gpu: &Gpu,
        kv: &DeviceKv,
        state: Option<&DeviceState>,
        split: &mut SplitStep,
        results: Vec<DeviceRows>,
        index: PinnedBuf<u32>,
        results_at: u64,
        hidden_out: u64,
    ) -> Result<(), CudaError> {
        let (shape, hidden) = (split.shape, self.hidden);
        let state = if split.mtp { None } else { state };
        if let (Some((_, weights)), Some(m)) = (split.routed.take(), self.split_moe(split)) {
            let received = results.iter().map(|r| r.rows).sum::<usize>();
            let recv = gpu.zeros::<f32>((received + 1) * hidden)?;
            let mut at = 0;
            for rows in &results {
                rows.copy_to(gpu, recv.at(at * hidden))?;
                at += rows.rows;
            }
            let n = shape.rows * m.top_k;
            let on_device = gpu.scratch::<u32>(n)?;
            gpu.copy_to_device(on_device.ptr(), &index, n)?;
            let expert_out = gpu.scratch::<f32>(n * hidden)?;
            gather_rows(gpu, expert_out.ptr(), recv.ptr(), on_device.ptr(), n, hidden)?;
            let s =
                Step { gpu, kv, state, rows: shape.rows, seqs: shape.seqs, at: split.at, index_row: shape.index_row };
            s.moe_combine(split.h.ptr(), split.x.ptr(), expert_out.ptr(), weights.ptr(), m, hidden)?;
            split.layer += 1;
            split.held.extend(results);
            split.staged.push(index);
        }
        self.run_to_routing(gpu, kv, state, split)?;
        if split.finished(self) {
            let s =
                Step { gpu, kv, state, rows: shape.rows, seqs: shape.seqs, at: split.at, index_row: shape.index_row };
            match split.mtp {
                true => self.mtp_head(&s, self.mtp_layer()?, shape, split.h.ptr(), split.ring, results_at)?,
                false => _ = self.enqueue_head(&s, shape, split.h.ptr(), split.ring, results_at, hidden_out, false)?,
            }
        }
        Ok(())
    }
}
