//! Kimi Delta Attention on the device (`kernels/cuda/linear.cu`; the CPU's is
//! `models::parts::kda`): its weights, their upload, and its launches within a step against the
//! sequences' state slots.

use super::layers::{self, DevLinear, DevNorm};
use super::Step;
use crate::cuda::error::CudaError;
use crate::cuda::gpu::DeviceBuf;
use crate::cuda::launch::{blocks_for, reduce_threads, Arg};
use crate::cuda::weights::Up;
use crate::models::parts::kda::KimiDeltaAttention;

/// A Kimi Delta Attention layer (`kernels/cuda/linear.cu`).
pub(crate) struct DevKda {
    /// `[q; k; v; f_a; g_a; b]`.
    pub in_proj: DevLinear,
    pub f_b: DevLinear,
    pub g_b: DevLinear,
    /// `[3·heads·d × kernel]`.
    pub conv_weight: DeviceBuf<f32>,
    pub neg_a: DeviceBuf<f32>,
    pub dt_bias: DeviceBuf<f32>,
    pub o_norm: DevNorm,
    pub o_proj: DevLinear,
    pub heads: usize,
    pub head_dim: usize,
    pub kernel: usize,
    pub conv_width: usize,
}

pub(crate) fn upload(gpu: &Up, k: &KimiDeltaAttention) -> Result<DevKda, CudaError> {
    Ok(DevKda {
        in_proj: layers::linear(gpu, &k.in_proj)?,
        f_b: layers::linear(gpu, &k.f_b)?,
        g_b: layers::linear(gpu, &k.g_b)?,
        conv_weight: gpu.upload(&k.conv_weight)?,
        neg_a: gpu.upload(&k.neg_a)?,
        dt_bias: gpu.upload(&k.dt_bias)?,
        o_norm: layers::norm(gpu, &k.o_norm)?,
        o_proj: layers::linear(gpu, &k.o_proj)?,
        heads: k.heads,
        head_dim: k.head_dim,
        kernel: k.kernel,
        conv_width: k.conv_state_width(),
    })
}

impl Step<'_> {
    /// Kimi Delta Attention (`kernels/cuda/linear.cu`): the fused projection, the low-rank forget
    /// and output gates, the causal conv of `[q | k | v]` and the per-channel-decay delta rule
    /// over each sequence's rows in order against its slot, the gated RMSNorm, then
    /// `h += o_proj(·)`.
    pub(crate) fn kda(&self, h: u64, x: u64, k: &DevKda, state_offset: usize, hidden: usize) -> Result<(), CudaError> {
        let state = self.state.ok_or_else(|| CudaError::Unsupported("a kda layer runs with device state".into()))?;
        let (t, heads, d) = (self.rows, k.heads, k.head_dim);
        let hd = heads * d;
        let width = k.in_proj.n;
        let proj = self.gpu.scratch::<f32>(t * width)?;
        self.linear(proj.ptr(), x, &k.in_proj, t, hidden, width, false)?;
        let forget = self.gpu.scratch::<f32>(t * hd)?;
        self.linear(forget.ptr(), proj.at(3 * hd), &k.f_b, t, width, hd, false)?;
        let gate = self.gpu.scratch::<f32>(t * hd)?;
        self.linear(gate.ptr(), proj.at(3 * hd + d), &k.g_b, t, width, hd, false)?;
        let conv = self.gpu.scratch::<f32>(t * 3 * hd)?;
        let args = [
            Arg::Ptr(conv.ptr()),
            Arg::Ptr(proj.ptr()),
            Arg::I32(width as i32),
            Arg::Ptr(k.conv_weight.ptr()),
            Arg::Ptr(state.base()),
            Arg::I64(state.width as i64),
            Arg::I32(state_offset as i32),
            Arg::Ptr(self.at.slots),
            Arg::Ptr(self.at.row_at),
            Arg::Ptr(state.kept_base()),
            Arg::Ptr(self.at.keeps),
            Arg::I32(self.seqs as i32),
            Arg::I32(t as i32),
            Arg::I32(heads as i32),
            Arg::I32(d as i32),
            Arg::I32(1),
            Arg::I32(d as i32),
            Arg::I32(k.kernel as i32),
            Arg::I32(0),
        ];
        self.gpu.launch("gdn_conv", (self.seqs as u32, blocks_for(3 * hd, 128), 1), 128, 0, &args)?;
        let out = self.gpu.scratch::<f32>(t * hd)?;
        let threads = reduce_threads(d);
        let args = [
            Arg::Ptr(out.ptr()),
            Arg::Ptr(conv.ptr()),
            Arg::Ptr(proj.ptr()),
            Arg::I32(width as i32),
            Arg::Ptr(forget.ptr()),
            Arg::Ptr(gate.ptr()),
            Arg::Ptr(state.base()),
            Arg::I64(state.width as i64),
            Arg::I32(state_offset as i32),
            Arg::I32(k.conv_width as i32),
            Arg::Ptr(self.at.slots),
            Arg::Ptr(self.at.row_at),
            Arg::Ptr(state.kept_base()),
            Arg::Ptr(self.at.keeps),
            Arg::I32(self.seqs as i32),
            Arg::I32(t as i32),
            Arg::Ptr(k.neg_a.ptr()),
            Arg::Ptr(k.dt_bias.ptr()),
            Arg::Ptr(k.o_norm.w.ptr()),
            Arg::F32(k.o_norm.eps),
            Arg::F32(crate::models::parts::gated_delta::L2_NORM_EPS),
            Arg::I32(heads as i32),
            Arg::I32(d as i32),
        ];
        // shared: the reductions' partial sums, then a decay, q and k per key channel
        let smem = (threads as usize + 3 * d) * 4;
        self.gpu.launch("kda_recurrent", (self.seqs as u32, heads as u32, 1), threads, smem as u32, &args)?;
        self.linear(h, out.ptr(), &k.o_proj, t, hd, hidden, true)
    }
}
