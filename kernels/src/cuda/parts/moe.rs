//! Mixture-of-experts on the device (the CPU's is `models::parts::moe`): the router and `route`,
//! the routed pairs grouped by expert into work items, the experts' products over them, the shared
//! experts and their gate, and `moe_combine` into the hidden state.

use super::layers::{self, DevLinear, DevMlp};
use super::Step;
use crate::cuda::error::CudaError;
use crate::cuda::gpu::{DeviceBuf, Gpu};
use crate::cuda::launch::{blocks_for, Arg};
use crate::cuda::weights::{DevWeight, Up};
use crate::models::parts::moe::{MoeBlock, Scoring};

pub(crate) struct DevMoe {
    pub router: DevLinear,
    pub correction_bias: Option<DeviceBuf<f32>>,
    pub num_experts: usize,
    pub top_k: usize,
    pub softmax: bool,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub scaling: f32,
    /// The experts held (all of them, or one rank's range under expert parallelism): their
    /// weights below are theirs alone, expert `first_expert + i` at `i`.
    pub first_expert: usize,
    pub held: usize,
    /// Every held expert's `[gate; up]` rows, `[held × 2·inter × hidden]`.
    pub gate_up: DevWeight,
    /// Every held expert's down rows, `[held × hidden × inter]`.
    pub down: DevWeight,
    pub inter: usize,
    pub shared: Option<DevMlp>,
    /// Qwen-style gate on the shared expert: `sigmoid(x·g)` per row.
    pub shared_gate: Option<DevLinear>,
}

pub(crate) fn upload(gpu: &Up, m: &MoeBlock) -> Result<DevMoe, CudaError> {
    let r = &m.routing;
    let inter = m.experts.first().map_or(0, |e| e.inter);
    let gate_up: Vec<f32> = m.experts.iter().flat_map(|e| e.gate_up.weight.to_rows()).collect();
    let down: Vec<f32> = m.experts.iter().flat_map(|e| e.down.weight.to_rows()).collect();
    if m.experts.iter().any(|e| e.gate_up.bias.is_some() || e.down.bias.is_some()) {
        return Err(CudaError::Unsupported("MoE experts with biases".into()));
    }
    Ok(DevMoe {
        router: layers::linear(gpu, &m.router)?,
        correction_bias: r.correction_bias.as_ref().map(|b| gpu.upload(b)).transpose()?,
        num_experts: r.num_experts,
        top_k: r.top_k,
        softmax: r.scoring == Scoring::Softmax,
        n_group: r.n_group,
        topk_group: r.topk_group,
        norm_topk_prob: r.norm_topk_prob,
        scaling: r.scaling,
        first_expert: m.first_expert,
        held: m.experts.len(),
        gate_up: gpu.weight(&gate_up, false)?,
        down: gpu.weight(&down, false)?,
        inter,
        shared: m.shared.as_ref().map(|s| layers::mlp(gpu, s)).transpose()?,
        shared_gate: m.shared_gate.as_ref().map(|g| layers::linear(gpu, g)).transpose()?,
    })
}

impl Step<'_> {
    /// Routed expert products over the pairs grouped by expert (`order`, `offsets`).
    #[allow(clippy::too_many_arguments)]
    fn expert_linear(
        &self,
        y: u64,
        x: u64,
        w: &DevWeight,
        grouped: &GroupedPairs,
        n: usize,
        k: usize,
        x_per: usize,
    ) -> Result<(), CudaError> {
        self.gpu.launch(
            if w.is_bf16() { "expert_linear_bf16" } else { "expert_linear" },
            // a block per work item and 8 warps of 4 outputs (`kernels/cuda/model.cu`)
            (grouped.items_at_most as u32, blocks_for(n, 32), 1),
            256,
            0,
            &[
                Arg::Ptr(y),
                Arg::Ptr(x),
                Arg::Ptr(w.ptr()),
                Arg::Ptr(grouped.order.ptr()),
                Arg::Ptr(grouped.offsets.ptr()),
                Arg::Ptr(grouped.work.ptr()),
                Arg::I32(grouped.per_item as i32),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
                Arg::I32(x_per as i32),
            ],
        )
    }

    /// The block over the step's rows, every expert held here: routing, the routed experts'
    /// products, then [`Step::moe_combine`].
    pub(crate) fn moe(&self, h: u64, x: u64, m: &DevMoe, hidden: usize) -> Result<(), CudaError> {
        if m.held != m.num_experts {
            return Err(CudaError::Unsupported(format!(
                "a MoE block holding {} of its {} experts runs only expert parallel",
                m.held, m.num_experts
            )));
        }
        let (experts, weights) = self.route(x, m, hidden)?;
        let pairs = self.rows * m.top_k;
        let out = self.gpu.scratch::<f32>(pairs * hidden)?;
        self.expert_products(out.ptr(), x, experts.ptr(), pairs, m.top_k, m, hidden)?;
        self.moe_combine(h, x, out.ptr(), weights.ptr(), m, hidden)
    }

    /// The router and `route` over the step's rows: each row's `top_k` experts in ascending
    /// order and their weights, `[rows × top_k]` each.
    pub(crate) fn route(
        &self,
        x: u64,
        m: &DevMoe,
        hidden: usize,
    ) -> Result<(DeviceBuf<i32>, DeviceBuf<f32>), CudaError> {
        let (t, k) = (self.rows, m.top_k);
        let logits = self.gpu.scratch::<f32>(t * m.num_experts)?;
        self.linear(logits.ptr(), x, &m.router, t, hidden, m.num_experts, false)?;
        let experts = self.gpu.scratch::<i32>(t * k)?;
        let weights = self.gpu.scratch::<f32>(t * k)?;
        self.gpu.launch(
            "route",
            // a token per block; shared: scores and choice per expert, two floats per group
            (t as u32, 1, 1),
            32,
            ((2 * m.num_experts + 2 * m.n_group.max(1)) * 4) as u32,
            &[
                Arg::Ptr(experts.ptr()),
                Arg::Ptr(weights.ptr()),
                Arg::Ptr(logits.ptr()),
                Arg::Ptr(m.correction_bias.as_ref().map_or(0, DeviceBuf::ptr)),
                Arg::I32(t as i32),
                Arg::I32(m.num_experts as i32),
                Arg::I32(k as i32),
                Arg::I32(m.softmax as i32),
                Arg::I32(m.n_group as i32),
                Arg::I32(m.topk_group as i32),
                Arg::I32(m.norm_topk_prob as i32),
                Arg::F32(m.scaling),
            ],
        )?;
        Ok((experts, weights))
    }

    /// `out[p] = expert(experts[p])(x[p / x_per])` over `pairs` pairs, `experts` holding each
    /// pair's held expert (its index among the held ones): grouped by expert, each expert's
    /// `[gate; up]`, SwiGLU and down products over its pairs. A pair's value does not depend on
    /// the others (`expert_products` in `kernels/cuda/model.cu`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn expert_products(
        &self,
        out: u64,
        x: u64,
        experts: u64,
        pairs: usize,
        x_per: usize,
        m: &DevMoe,
        hidden: usize,
    ) -> Result<(), CudaError> {
        let (inter, held) = (m.inter, m.held);
        let grouped = GroupedPairs::new(self.gpu, pairs, held)?;
        self.gpu.launch(
            "group_pairs",
            (1, 1, 1),
            256,
            (held * 4) as u32,
            &[
                Arg::Ptr(grouped.order.ptr()),
                Arg::Ptr(grouped.offsets.ptr()),
                Arg::Ptr(grouped.work.ptr()),
                Arg::Ptr(experts),
                Arg::I32(pairs as i32),
                Arg::I32(held as i32),
                Arg::I32(grouped.per_item as i32),
            ],
        )?;
        let gu = self.gpu.scratch::<f32>(pairs * 2 * inter)?;
        self.expert_linear(gu.ptr(), x, &m.gate_up, &grouped, 2 * inter, hidden, x_per)?;
        let act = self.gpu.scratch::<f32>(pairs * inter)?;
        self.swiglu(act.ptr(), 0, gu.ptr(), pairs, inter)?;
        self.expert_linear(out, act.ptr(), &m.down, &grouped, hidden, inter, 1)
    }

    /// `h += Σ_k weight · expert_out[row, k]` over each row's routes in ascending expert order,
    /// plus the shared experts (and their gate) over `x`.
    pub(crate) fn moe_combine(
        &self,
        h: u64,
        x: u64,
        expert_out: u64,
        weights: u64,
        m: &DevMoe,
        hidden: usize,
    ) -> Result<(), CudaError> {
        let t = self.rows;
        let shared = match &m.shared {
            Some(s) => {
                let y = self.gpu.scratch::<f32>(t * hidden)?;
                self.mlp(y.ptr(), x, 0, s, t, hidden, false)?;
                Some(y)
            }
            None => None,
        };
        let shared_gate = match &m.shared_gate {
            Some(g) => {
                let logits = self.gpu.scratch::<f32>(t)?;
                self.linear(logits.ptr(), x, g, t, hidden, 1, false)?;
                Some(logits)
            }
            None => None,
        };
        self.gpu.launch(
            "moe_combine",
            (blocks_for(t * hidden, 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(h),
                Arg::Ptr(expert_out),
                Arg::Ptr(weights),
                Arg::Ptr(shared.as_ref().map_or(0, DeviceBuf::ptr)),
                Arg::Ptr(shared_gate.as_ref().map_or(0, DeviceBuf::ptr)),
                Arg::I32(t as i32),
                Arg::I32(m.top_k as i32),
                Arg::I32(hidden as i32),
            ],
        )
    }
}

/// A step's routed pairs grouped by expert (`group_pairs`) and cut into work items of up to
/// `per_item` pairs of one expert, a block each in the expert products.
struct GroupedPairs {
    order: DeviceBuf<i32>,
    offsets: DeviceBuf<i32>,
    /// [items, then (expert, first pair) per item]
    work: DeviceBuf<i32>,
    per_item: usize,
    /// Items there can be: one per expert, plus one per `per_item` pairs.
    items_at_most: usize,
}

/// Pairs of one work item at least (`kernels/cuda/model.cu`'s PAIRS_PER_PASS: one pass).
const PAIRS_PER_PASS: usize = 8;

impl GroupedPairs {
    fn new(gpu: &Gpu, pairs: usize, experts: usize) -> Result<GroupedPairs, CudaError> {
        // about four items an expert when the routing is even: decode's few pairs a pass each,
        // prefill's thousands in a few hundred pairs an item
        let per_item = pairs.div_ceil(4 * experts).next_multiple_of(PAIRS_PER_PASS).max(PAIRS_PER_PASS);
        let items_at_most = pairs.div_ceil(per_item) + experts;
        Ok(GroupedPairs {
            order: gpu.scratch::<i32>(pairs)?,
            offsets: gpu.scratch::<i32>(experts + 1)?,
            work: gpu.scratch::<i32>(1 + 2 * items_at_most)?,
            per_item,
            items_at_most,
        })
    }
}
