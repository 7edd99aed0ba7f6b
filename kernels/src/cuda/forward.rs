//! One step of the model on the device, enqueued on the rank's stream and never waited for:
//! embeddings (a token still in flight is read from the sampled-token ring the step before
//! wrote), then per layer `h += mixer(norm(h)); h += ffn(norm(h))` as the CPU decoder computes
//! it, then the final norm, the LM head on the rows that sample, and greedy sampling on the
//! device into the ring and a results buffer. Activations are stream-ordered allocations, freed
//! (in stream order) as soon as the step is enqueued.

use super::error::CudaError;
use super::gpu::{DeviceBuf, Gpu};
use super::kv::DeviceKv;
use super::launch::Arg;
use super::model::{DevFfn, DevMixer, DeviceModel};
use super::parts::Step;
use super::rows::{RowsOnDevice, StepRows, StepShape};
use super::state::DeviceState;

impl DeviceModel {
    /// Enqueues one step over `rows` (already at `at` on the device) against `kv`: writes each
    /// row's KV into its cache row, and for each sampling row its greedy token into `ring` at its
    /// slot and `RESULT_WORDS` words into `results`. Returns the sampled rows' logits when
    /// `keep_logits` (checks and tests only). Waits for nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue_step(
        &self,
        gpu: &Gpu,
        kv: &DeviceKv,
        state: Option<&DeviceState>,
        rows: &StepRows,
        at: RowsOnDevice,
        ring: u64,
        results: u64,
        keep_logits: bool,
    ) -> Result<Option<DeviceBuf<f32>>, CudaError> {
        self.enqueue_shaped(gpu, kv, state, rows.shape(), at, ring, results, keep_logits)
    }

    /// [`DeviceModel::enqueue_step`] from the rows' shape alone (what a captured step is built
    /// from): the rows themselves are read on the device at `at`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn enqueue_shaped(
        &self,
        gpu: &Gpu,
        kv: &DeviceKv,
        state: Option<&DeviceState>,
        shape: StepShape,
        at: RowsOnDevice,
        ring: u64,
        results: u64,
        keep_logits: bool,
    ) -> Result<Option<DeviceBuf<f32>>, CudaError> {
        let (t, hidden) = (shape.rows, self.hidden);
        if t == 0 {
            return Ok(None);
        }
        let s = Step { gpu, kv, state, rows: t, seqs: shape.seqs, at, index_row: shape.index_row };
        let h = gpu.scratch::<f32>(t * hidden)?;
        gpu.launch(
            "embed_rows",
            (t as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(h.ptr()),
                Arg::Ptr(self.embed.ptr()),
                Arg::Ptr(at.tokens),
                Arg::Ptr(ring),
                Arg::I32(hidden as i32),
                Arg::I32(self.vocab as i32),
            ],
        )?;
        let x = gpu.scratch::<f32>(t * hidden)?;
        // x rounded to bf16 by the norm that writes it, where a bf16 product reads it next
        let x_bf16 = gpu.scratch::<u16>(t * hidden)?;
        let rounded_for = |bf16: bool| if bf16 { x_bf16.ptr() } else { 0 };
        for layer in &self.layers {
            let mixer_bf16 = rounded_for(matches!(&layer.mixer, DevMixer::Gqa(a) if a.qkv.w.is_bf16()));
            s.norm_rows(x.ptr(), mixer_bf16, h.ptr(), &layer.input_norm, t)?;
            match &layer.mixer {
                DevMixer::Gqa(a) => s.gqa(h.ptr(), x.ptr(), mixer_bf16, a, layer.kv_layer, hidden)?,
                DevMixer::Mla(a) => s.mla(h.ptr(), x.ptr(), a, layer.kv_layer, hidden)?,
                DevMixer::Gdn(g) => s.gdn(h.ptr(), x.ptr(), g, layer.state_offset, hidden)?,
                DevMixer::Kda(k) => s.kda(h.ptr(), x.ptr(), k, layer.state_offset, hidden)?,
            }
            let ffn_bf16 = rounded_for(matches!(&layer.ffn, DevFfn::Dense(m) if m.gate_up.w.is_bf16()));
            s.norm_rows(x.ptr(), ffn_bf16, h.ptr(), &layer.post_norm, t)?;
            match &layer.ffn {
                DevFfn::Dense(m) => s.mlp(h.ptr(), x.ptr(), ffn_bf16, m, t, hidden, true)?,
                DevFfn::Moe(m) => s.moe(h.ptr(), x.ptr(), m, hidden)?,
            }
        }
        let n = shape.sampled;
        if n == 0 {
            return Ok(None);
        }
        let last = gpu.scratch::<f32>(n * hidden)?;
        gpu.launch(
            "gather_rows",
            (n as u32, 1, 1),
            256,
            0,
            &[Arg::Ptr(last.ptr()), Arg::Ptr(h.ptr()), Arg::Ptr(at.logit_rows), Arg::I32(hidden as i32)],
        )?;
        let last_bf16 = match self.lm_head.w.is_bf16() {
            true => Some(gpu.scratch::<u16>(n * hidden)?),
            false => None,
        };
        let last_bf16_ptr = last_bf16.as_ref().map_or(0, DeviceBuf::ptr);
        s.norm_rows(last.ptr(), last_bf16_ptr, last.ptr(), &self.final_norm, n)?;
        let logits = gpu.scratch::<f32>(n * self.vocab)?;
        s.linear_rounded(logits.ptr(), last.ptr(), last_bf16_ptr, &self.lm_head, n, hidden, self.vocab, false)?;
        gpu.launch(
            "sample_greedy",
            (n as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(results),
                Arg::Ptr(ring),
                Arg::Ptr(at.ring_slots),
                Arg::Ptr(logits.ptr()),
                Arg::I32(self.vocab as i32),
            ],
        )?;
        Ok(keep_logits.then_some(logits))
    }
}
