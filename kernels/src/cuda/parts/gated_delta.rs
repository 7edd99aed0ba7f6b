//! Gated DeltaNet on the device (`kernels/cuda/linear.cu`; the CPU's is
//! `models::parts::gated_delta`): its weights, their upload, and its launches within a step against
//! the sequences' state slots.

use super::layers::{self, DevLinear, DevNorm};
use super::Step;
use crate::cuda::error::CudaError;
use crate::cuda::gpu::DeviceBuf;
use crate::cuda::launch::{blocks_for, reduce_threads, Arg};
use crate::cuda::weights::Up;
use crate::models::parts::gated_delta::GatedDeltaNet;

/// A Gated DeltaNet layer (`kernels/cuda/linear.cu`).
pub(crate) struct DevGdn {
    /// `[in_proj_qkvz; in_proj_ba]`.
    pub in_proj: DevLinear,
    /// `[channels × kernel]`.
    pub conv_weight: DeviceBuf<f32>,
    pub neg_a: DeviceBuf<f32>,
    pub dt_bias: DeviceBuf<f32>,
    /// The gated RMSNorm of each head's output.
    pub norm: DevNorm,
    pub out_proj: DevLinear,
    pub k_heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
    pub kernel: usize,
    /// Floats of the conv window at the start of the layer's state.
    pub conv_width: usize,
}

pub(crate) fn upload(gpu: &Up, g: &GatedDeltaNet) -> Result<DevGdn, CudaError> {
    Ok(DevGdn {
        in_proj: layers::linear(gpu, &g.in_proj)?,
        conv_weight: gpu.upload(&g.conv_weight)?,
        neg_a: gpu.upload(&g.neg_a)?,
        dt_bias: gpu.upload(&g.dt_bias)?,
        norm: layers::norm(gpu, &g.norm)?,
        out_proj: layers::linear(gpu, &g.out_proj)?,
        k_heads: g.k_heads,
        v_heads: g.v_heads,
        dk: g.dk,
        dv: g.dv,
        kernel: g.kernel,
        conv_width: g.conv_state_width(),
    })
}

impl Step<'_> {
    /// Gated DeltaNet (`kernels/cuda/linear.cu`): the fused input projection, the causal conv
    /// and the delta rule over each sequence's rows in order against its slot, the gated
    /// RMSNorm, then `h += out_proj(·)`.
    pub(crate) fn gdn(&self, h: u64, x: u64, g: &DevGdn, state_offset: usize, hidden: usize) -> Result<(), CudaError> {
        let state = self.state.ok_or_else(|| CudaError::Unsupported("a gdn layer runs with device state".into()))?;
        let (t, nk, nv, dk, dv) = (self.rows, g.k_heads, g.v_heads, g.dk, g.dv);
        let proj_width = g.in_proj.n;
        let proj = self.gpu.scratch::<f32>(t * proj_width)?;
        self.linear(proj.ptr(), x, &g.in_proj, t, hidden, proj_width, false)?;
        let channels = 2 * nk * dk + nv * dv;
        let conv = self.gpu.scratch::<f32>(t * channels)?;
        let common = [Arg::Ptr(state.base()), Arg::I64(state.width as i64), Arg::I32(state_offset as i32)];
        let mut args = vec![Arg::Ptr(conv.ptr()), Arg::Ptr(proj.ptr()), Arg::I32(proj_width as i32)];
        args.push(Arg::Ptr(g.conv_weight.ptr()));
        args.extend(common);
        args.extend([
            Arg::Ptr(self.at.slots),
            Arg::Ptr(self.at.row_at),
            Arg::Ptr(state.kept_base()),
            Arg::Ptr(self.at.keeps),
            Arg::I32(self.seqs as i32),
            Arg::I32(t as i32),
            Arg::I32(nk as i32),
            Arg::I32(dk as i32),
            Arg::I32((nv / nk) as i32),
            Arg::I32(dv as i32),
            Arg::I32(g.kernel as i32),
            Arg::I32(1),
        ]);
        self.gpu.launch("gdn_conv", (self.seqs as u32, blocks_for(channels, 128), 1), 128, 0, &args)?;
        let out = self.gpu.scratch::<f32>(t * nv * dv)?;
        let threads = reduce_threads(dv);
        let mut args =
            vec![Arg::Ptr(out.ptr()), Arg::Ptr(conv.ptr()), Arg::Ptr(proj.ptr()), Arg::I32(proj_width as i32)];
        args.extend(common);
        args.extend([
            Arg::I32(g.conv_width as i32),
            Arg::Ptr(self.at.slots),
            Arg::Ptr(self.at.row_at),
            Arg::Ptr(state.kept_base()),
            Arg::Ptr(self.at.keeps),
            Arg::I32(self.seqs as i32),
            Arg::I32(t as i32),
            Arg::Ptr(g.neg_a.ptr()),
            Arg::Ptr(g.dt_bias.ptr()),
            Arg::Ptr(g.norm.w.ptr()),
            Arg::F32(g.norm.eps),
            Arg::F32(crate::models::parts::gated_delta::L2_NORM_EPS),
            Arg::I32(nk as i32),
            Arg::I32(nv as i32),
            Arg::I32(dk as i32),
            Arg::I32(dv as i32),
        ]);
        // shared: the reductions' partial sums, then a decay, q and k per key channel
        let smem = (threads as usize + 3 * dk) * 4;
        self.gpu.launch("gdn_recurrent", (self.seqs as u32, nv as u32, 1), threads, smem as u32, &args)?;
        self.linear(h, out.ptr(), &g.out_proj, t, nv * dv, hidden, true)
    }
}
