//! Grouped-query attention on the device (the CPU's is `models::parts::gqa`): the fused q/k/v
//! product, the optional q/k norms and Qwen3-Next's output gate, rope, the rows' keys and values
//! written to the cache, paged attention, then `o_proj` added to the hidden state.

use super::layers::{self, DevLinear, DevNorm, DevRope};
use super::Step;
use crate::cuda::error::CudaError;
use crate::cuda::launch::{blocks_for, Arg};
use crate::cuda::weights::Up;
use crate::models::parts::gqa::GqaAttention;

pub(crate) struct DevGqa {
    pub qkv: DevLinear,
    pub o: DevLinear,
    pub q_norm: Option<DevNorm>,
    pub k_norm: Option<DevNorm>,
    pub rope: DevRope,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub window: Option<usize>,
    pub scale: f32,
    /// Qwen3-Next: q_proj yields `[query | gate]` per head; the output is × sigmoid(gate).
    pub output_gate: bool,
}

pub(crate) fn upload(gpu: &Up, a: &GqaAttention) -> Result<DevGqa, CudaError> {
    let s = a.shape;
    Ok(DevGqa {
        qkv: layers::linear(gpu, &a.qkv)?,
        o: layers::linear(gpu, &a.o)?,
        q_norm: a.q_norm.as_ref().map(|n| layers::norm(gpu, n)).transpose()?,
        k_norm: a.k_norm.as_ref().map(|n| layers::norm(gpu, n)).transpose()?,
        rope: layers::rope(gpu, &a.rope)?,
        q_heads: s.q_heads,
        kv_heads: s.kv_heads,
        head_dim: s.qk_dim,
        window: a.sliding_window,
        scale: s.scale,
        output_gate: a.output_gate,
    })
}

impl Step<'_> {
    /// The attention block, its output added into `h`; `x_bf16`: x rounded to bf16, or 0.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gqa(
        &self,
        h: u64,
        x: u64,
        x_bf16: u64,
        a: &DevGqa,
        kv_layer: usize,
        hidden: usize,
    ) -> Result<(), CudaError> {
        let (t, d) = (self.rows, a.head_dim);
        let (qw, kw) = (a.q_heads * d, a.kv_heads * d);
        // with the output gate, q_proj's part is [query | gate] per head
        let qp = if a.output_gate { 2 * qw } else { qw };
        let width = qp + 2 * kw;
        let qkv = self.gpu.scratch::<f32>(t * width)?;
        self.linear_rounded(qkv.ptr(), x, x_bf16, &a.qkv, t, hidden, width, false)?;
        // queries: in place in `qkv` (stride `width`), or split from their gates (stride `qw`)
        let split = if a.output_gate {
            let (q, gate) = (self.gpu.scratch::<f32>(t * qw)?, self.gpu.scratch::<f32>(t * qw)?);
            self.gpu.launch(
                "split_query_gate",
                (t as u32, a.q_heads as u32, 1),
                32,
                0,
                &[
                    Arg::Ptr(q.ptr()),
                    Arg::Ptr(gate.ptr()),
                    Arg::Ptr(qkv.ptr()),
                    Arg::I32(width as i32),
                    Arg::I32(a.q_heads as i32),
                    Arg::I32(d as i32),
                ],
            )?;
            Some((q, gate))
        } else {
            None
        };
        let (q, q_stride) = match &split {
            Some((q, _)) => (q.ptr(), qw),
            None => (qkv.ptr(), width),
        };
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            self.norm(q, 0, q, qn, t * a.q_heads, a.q_heads, q_stride, 0)?;
            self.norm(qkv.ptr(), 0, qkv.ptr(), kn, t * a.kv_heads, a.kv_heads, width, qp)?;
        }
        // queries and keys rotated, then the keys and values into the cache rows — in one launch
        // where a cache row is [keys | values] of every kv head, as the projection lays them out
        let (queries, keys) = ((q, a.q_heads, q_stride, 0), (qkv.ptr(), a.kv_heads, width, qp));
        if self.kv.width(kv_layer) == 2 * kw {
            self.rope_pair(&a.rope, queries, keys, d, Some((kv_layer, kw)))?;
        } else {
            self.rope_pair(&a.rope, queries, keys, d, None)?;
            self.kv.write_rows(self.gpu, kv_layer, qkv.at(qp), width, self.at.write_rows, t)?;
        }
        let attn = self.gpu.scratch::<f32>(t * qw)?;
        self.attention(attn.ptr(), q, q_stride, kv_layer, a.q_heads, a.kv_heads, d, d, 0, kw, a.window, a.scale, None)?;
        if let Some((_, gate)) = &split {
            let n = t * qw;
            self.gpu.launch(
                "apply_sigmoid_gate",
                (blocks_for(n, 256), 1, 1),
                256,
                0,
                &[Arg::Ptr(attn.ptr()), Arg::Ptr(gate.ptr()), Arg::I64(n as i64)],
            )?;
        }
        self.linear(h, attn.ptr(), &a.o, t, qw, hidden, true)
    }
}
