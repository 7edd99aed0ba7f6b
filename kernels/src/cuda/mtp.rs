//! DeepSeek's MTP layer on the device (the CPU's `models::mtp`, the same arithmetic): one pass
//! over rows whose tokens are the successor tokens of their positions and whose `hidden` rows are
//! the target's final-normed hidden states (pass 0) or the layer's own output (a chained pass):
//! `x = eh_proj([enorm(embed(t)), hnorm(h)])`, one decoder layer over `x` writing the MTP layer of
//! the paged cache, then `shared_head.head(shared_head.norm(·))` on the rows that sample, sampled
//! greedily into the ring and a results buffer as a step's rows are. Enqueued, never waited for.
//! Under expert parallelism a pass is split at its MoE block as a step is (`experts.rs`).

use super::error::CudaError;
use super::forward::enqueue_sampling;
use super::gpu::Gpu;
use super::kv::DeviceKv;
use super::launch::Arg;
use super::model::{DevMtp, DeviceModel};
use super::parts::Step;
use super::rows::{RowsOnDevice, StepRows, StepShape};

impl DeviceModel {
    /// Whether the model drafts with an MTP layer.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    pub(crate) fn mtp_layer(&self) -> Result<&DevMtp, CudaError> {
        self.mtp.as_ref().ok_or_else(|| CudaError::Unsupported("the model holds no MTP layer".into()))
    }

    /// Enqueues one MTP pass over `rows` (at `at` on the device; each row's token the successor
    /// of its position, ring-encoded where in flight) with `hidden_in` (`rows × hidden`, in row
    /// order) against `kv`: writes the MTP layer's KV at the rows' positions, every row's output
    /// hidden state into `hidden_out`, and each sampling row's greedy draft into `ring` at its
    /// slot and `RESULT_WORDS` words into `results`. Waits for nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue_mtp_pass(
        &self,
        gpu: &Gpu,
        kv: &DeviceKv,
        rows: &StepRows,
        at: RowsOnDevice,
        hidden_in: u64,
        hidden_out: u64,
        ring: u64,
        results: u64,
    ) -> Result<(), CudaError> {
        let m = self.mtp_layer()?;
        let shape = rows.shape();
        let (t, d) = (shape.rows, self.hidden);
        if t == 0 {
            return Ok(());
        }
        let s = Step { gpu, kv, state: None, rows: t, seqs: shape.seqs, at, index_row: shape.index_row };
        self.mtp_input(&s, m, ring, hidden_in, hidden_out)?;
        let x = gpu.scratch::<f32>(t * d)?;
        let x_bf16 = gpu.scratch::<u16>(t * d)?;
        s.layer(&m.block, hidden_out, x.ptr(), x_bf16.ptr(), d)?;
        self.mtp_head(&s, m, shape, hidden_out, ring, results)
    }

    /// The pass's input: `h = eh_proj([enorm(embed(t)), hnorm(hidden_in)])` into `h`.
    pub(crate) fn mtp_input(
        &self,
        s: &Step<'_>,
        m: &DevMtp,
        ring: u64,
        hidden_in: u64,
        h: u64,
    ) -> Result<(), CudaError> {
        let (t, d) = (s.rows, self.hidden);
        let joined = s.gpu.scratch::<f32>(t * 2 * d)?;
        s.gpu.launch(
            "join_embedded",
            (t as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(joined.ptr()),
                Arg::Ptr(self.embed.ptr()),
                Arg::Ptr(s.at.tokens),
                Arg::Ptr(ring),
                Arg::Ptr(hidden_in),
                Arg::I32(d as i32),
                Arg::I32(self.vocab as i32),
            ],
        )?;
        s.norm(joined.ptr(), 0, joined.ptr(), &m.enorm, t, 1, 2 * d, 0)?;
        s.norm(joined.ptr(), 0, joined.ptr(), &m.hnorm, t, 1, 2 * d, d)?;
        s.linear(h, joined.ptr(), &m.eh_proj, t, 2 * d, d, false)
    }

    /// The pass's end: the shared head over its sampling rows of `h`, sampled into `ring` and
    /// `results`.
    pub(crate) fn mtp_head(
        &self,
        s: &Step<'_>,
        m: &DevMtp,
        shape: StepShape,
        h: u64,
        ring: u64,
        results: u64,
    ) -> Result<(), CudaError> {
        let (gpu, at, d, n) = (s.gpu, s.at, self.hidden, shape.sampled);
        if n == 0 {
            return Ok(());
        }
        let last = gpu.scratch::<f32>(n * d)?;
        gpu.launch(
            "gather_rows",
            (n as u32, 1, 1),
            256,
            0,
            &[Arg::Ptr(last.ptr()), Arg::Ptr(h), Arg::Ptr(at.logit_rows), Arg::I32(d as i32)],
        )?;
        s.norm_rows(last.ptr(), 0, last.ptr(), &m.head_norm, n)?;
        let logits = gpu.scratch::<f32>(n * self.vocab)?;
        s.linear(logits.ptr(), last.ptr(), &m.head, n, d, self.vocab, false)?;
        enqueue_sampling(gpu, shape, at, ring, results, logits.ptr(), self.vocab)
    }
}
