//! The layers every part is built of, on the device: products with their bias ([`DevLinear`]),
//! RMSNorm, rope, and the SwiGLU MLP — their weights, their upload, and their launches within a
//! step.

use super::Step;
use crate::cpu::rope::{Rope, RopeStyle};
use crate::cuda::error::CudaError;
use crate::cuda::gpu::DeviceBuf;
use crate::cuda::launch::{blocks_for, reduce_threads, Arg};
use crate::cuda::product::{is_narrow, Product};
use crate::cuda::weights::{DevWeight, Up};
use crate::models::parts::layers::{Linear, Mlp, RmsNorm};

pub(crate) struct DevLinear {
    pub w: DevWeight,
    pub bias: Option<DeviceBuf<f32>>,
    pub n: usize,
    pub k: usize,
}

pub(crate) struct DevNorm {
    pub w: DeviceBuf<f32>,
    pub eps: f32,
    pub dim: usize,
}

pub(crate) struct DevRope {
    pub inv_freq: DeviceBuf<f32>,
    pub half: usize,
    pub scaling: f32,
    pub interleaved: bool,
}

pub(crate) struct DevMlp {
    pub gate_up: DevLinear,
    pub down: DevLinear,
    pub inter: usize,
}

pub(crate) fn linear(gpu: &Up, l: &Linear) -> Result<DevLinear, CudaError> {
    Ok(DevLinear {
        w: gpu.weight(&l.weight.to_rows(), is_narrow(l.out_dim(), l.in_dim()))?,
        bias: l.bias.as_ref().map(|b| gpu.upload(b)).transpose()?,
        n: l.out_dim(),
        k: l.in_dim(),
    })
}

pub(crate) fn norm(gpu: &Up, n: &RmsNorm) -> Result<DevNorm, CudaError> {
    Ok(DevNorm { w: gpu.upload(&n.weight)?, eps: n.eps, dim: n.weight.len() })
}

pub(crate) fn rope(gpu: &Up, r: &Rope) -> Result<DevRope, CudaError> {
    Ok(DevRope {
        inv_freq: gpu.upload(&r.inv_freq)?,
        half: r.inv_freq.len(),
        scaling: r.attention_scaling,
        interleaved: r.style == RopeStyle::Interleaved,
    })
}

pub(crate) fn mlp(gpu: &Up, m: &Mlp) -> Result<DevMlp, CudaError> {
    Ok(DevMlp { gate_up: linear(gpu, &m.gate_up)?, down: linear(gpu, &m.down)?, inter: m.inter })
}

impl Step<'_> {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear(
        &self,
        y: u64,
        x: u64,
        l: &DevLinear,
        m: usize,
        x_stride: usize,
        y_stride: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        self.linear_rounded(y, x, 0, l, m, x_stride, y_stride, accumulate)
    }

    /// [`Step::linear`] given also x rounded to bf16 (`x_bf16`, `m × k` rows of `k`, or 0), which a
    /// bf16 product then reads instead of rounding x itself.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_rounded(
        &self,
        y: u64,
        x: u64,
        x_bf16: u64,
        l: &DevLinear,
        m: usize,
        x_stride: usize,
        y_stride: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        Product {
            y,
            x,
            x_bf16,
            w: l.w.ptr(),
            bf16: l.w.is_bf16(),
            bias: l.bias.as_ref().map_or(0, DeviceBuf::ptr),
            m,
            n: l.n,
            k: l.k,
            z: 1,
            x_stride,
            y_stride,
            x_batch: 0,
            w_batch: 0,
            y_batch: 0,
            accumulate,
        }
        .launch(self.gpu)
    }

    /// `heads` independent products `y[z] = x[z] · W[z]ᵀ` (`W[z]` is `[n × k]`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear_per_head(
        &self,
        y: u64,
        x: u64,
        w: u64,
        n: usize,
        k: usize,
        heads: usize,
        x_stride: usize,
        y_stride: usize,
        x_head: usize,
        y_head: usize,
    ) -> Result<(), CudaError> {
        Product {
            y,
            x,
            x_bf16: 0,
            w,
            bf16: false,
            bias: 0,
            m: self.rows,
            n,
            k,
            z: heads,
            x_stride,
            y_stride,
            x_batch: x_head,
            w_batch: n * k,
            y_batch: y_head,
            accumulate: false,
        }
        .launch(self.gpu)
    }

    /// RMSNorm of `rows` whole rows of `x` into `out` and, unless `out_bf16` is 0, rounded to bf16
    /// there too (`rows × dim`: the input of the bf16 products that read `out`).
    pub(crate) fn norm_rows(&self, out: u64, out_bf16: u64, x: u64, n: &DevNorm, rows: usize) -> Result<(), CudaError> {
        self.norm(out, out_bf16, x, n, rows, 1, n.dim, 0)
    }

    /// RMSNorm of `count` vectors, `per_row` per row of `row_stride` floats from `offset`, and
    /// rounded to bf16 into `out_bf16` (`count × dim`) unless it is 0.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm(
        &self,
        out: u64,
        out_bf16: u64,
        x: u64,
        n: &DevNorm,
        count: usize,
        per_row: usize,
        row_stride: usize,
        offset: usize,
    ) -> Result<(), CudaError> {
        let threads = reduce_threads(n.dim);
        self.gpu.launch(
            "rms_norm",
            (count as u32, 1, 1),
            threads,
            threads * 4,
            &[
                Arg::Ptr(out),
                Arg::Ptr(x),
                Arg::Ptr(n.w.ptr()),
                Arg::I32(n.dim as i32),
                Arg::I32(per_row as i32),
                Arg::I64(row_stride as i64),
                Arg::I32(offset as i32),
                Arg::F32(n.eps),
                Arg::Ptr(out_bf16),
            ],
        )
    }

    pub(super) fn rope(
        &self,
        x: u64,
        r: &DevRope,
        heads: usize,
        row_stride: usize,
        offset: usize,
        head_stride: usize,
    ) -> Result<(), CudaError> {
        self.gpu.launch(
            "rope",
            (self.rows as u32, heads as u32, 1),
            r.half as u32,
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(self.at.positions),
                Arg::Ptr(r.inv_freq.ptr()),
                Arg::I32(r.half as i32),
                Arg::F32(r.scaling),
                Arg::I32(r.interleaved as i32),
                Arg::I64(row_stride as i64),
                Arg::I32(offset as i32),
                Arg::I32(head_stride as i32),
            ],
        )
    }

    /// [`Step::rope`] of `heads` heads of `x` and `y_heads` of `y` (a layer's queries and keys,
    /// each head `head_stride` apart) in one launch; with `cache` (kv layer, value heads `v_from`
    /// floats after the keys in `y` and in a cache row: rows of [keys | values]), the rows' rotated
    /// keys and their values then go to the layer's cache rows (as [`crate::cuda::DeviceKv`]'s
    /// `write_rows` would write them).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope_pair(
        &self,
        r: &DevRope,
        (x, heads, x_stride, x_offset): (u64, usize, usize, usize),
        (y, y_heads, y_stride, y_offset): (u64, usize, usize, usize),
        head_stride: usize,
        cache: Option<(usize, usize)>,
    ) -> Result<(), CudaError> {
        let (layer, v_from) = cache.unwrap_or((0, 0));
        let width = if cache.is_some() { self.kv.width(layer) } else { 0 };
        self.gpu.launch(
            "rope_pair",
            (self.rows as u32, (heads + y_heads) as u32, 1),
            r.half as u32,
            0,
            &[
                Arg::Ptr(x),
                Arg::I64(x_stride as i64),
                Arg::I32(x_offset as i32),
                Arg::I32(heads as i32),
                Arg::Ptr(y),
                Arg::I64(y_stride as i64),
                Arg::I32(y_offset as i32),
                Arg::Ptr(self.at.positions),
                Arg::Ptr(r.inv_freq.ptr()),
                Arg::I32(r.half as i32),
                Arg::F32(r.scaling),
                Arg::I32(r.interleaved as i32),
                Arg::I32(head_stride as i32),
                Arg::Ptr(if cache.is_some() { self.kv.layer(layer) } else { 0 }),
                self.kv.bf16_arg(),
                Arg::Ptr(self.at.write_rows),
                Arg::I32(width as i32),
                Arg::I32(head_stride as i32),
                Arg::I32(v_from as i32),
                Arg::I32(v_from as i32),
            ],
        )
    }

    /// `act = silu(gate) · up` over `rows` rows of `gu` ([gate | up] each), and rounded to bf16 into
    /// `act_bf16` unless it is 0.
    pub(super) fn swiglu(&self, act: u64, act_bf16: u64, gu: u64, rows: usize, inter: usize) -> Result<(), CudaError> {
        self.gpu.launch(
            "swiglu",
            (blocks_for(rows * inter, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(act), Arg::Ptr(gu), Arg::I32(rows as i32), Arg::I32(inter as i32), Arg::Ptr(act_bf16)],
        )
    }

    /// `out (+)= down(silu(gate(x)) · up(x))` over `rows` rows; `x_bf16`: x rounded to bf16, or 0.
    /// The activations reach a bf16 down product rounded by `swiglu` itself.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mlp(
        &self,
        out: u64,
        x: u64,
        x_bf16: u64,
        m: &DevMlp,
        rows: usize,
        hidden: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let gu = self.gpu.scratch::<f32>(rows * 2 * m.inter)?;
        self.linear_rounded(gu.ptr(), x, x_bf16, &m.gate_up, rows, hidden, 2 * m.inter, false)?;
        let act = self.gpu.scratch::<f32>(rows * m.inter)?;
        let act_bf16 = match m.down.w.is_bf16() {
            true => Some(self.gpu.scratch::<u16>(rows * m.inter)?),
            false => None,
        };
        let act_bf16_ptr = act_bf16.as_ref().map_or(0, DeviceBuf::ptr);
        self.swiglu(act.ptr(), act_bf16_ptr, gu.ptr(), rows, m.inter)?;
        self.linear_rounded(out, act.ptr(), act_bf16_ptr, &m.down, rows, m.inter, hidden, accumulate)
    }
}
