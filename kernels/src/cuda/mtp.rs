//! DeepSeek's MTP layer on the device (the CPU's `models::mtp`, the same arithmetic): one pass
//! over rows whose tokens are the successor tokens of their positions and whose `hidden` rows are
//! the target's final-normed hidden states (pass 0) or the layer's own output (a chained pass):
//! `x = eh_proj([enorm(embed(t)), hnorm(h)])`, one decoder layer over `x` writing the MTP layer of
//! the paged cache, then `shared_head.head(shared_head.norm(·))` on the rows that sample, sampled
//! greedily into the ring and a results buffer as a step's rows are. Enqueued, never waited for.

use super::error::CudaError;
use super::forward::enqueue_sampling;
use super::gpu::Gpu;
use super::kv::DeviceKv;
use super::launch::Arg;
use super::model::DeviceModel;
use super::parts::Step;
use super::rows::{RowsOnDevice, StepRows};

impl DeviceModel {
    /// Whether the model drafts with an MTP layer.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
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
        let Some(m) = &self.mtp else {
            return Err(CudaError::Unsupported("the model holds no MTP layer".into()));
        };
        let shape = rows.shape();
        let (t, d) = (shape.rows, self.hidden);
        if t == 0 {
            return Ok(());
        }
        let s = Step { gpu, kv, state: None, rows: t, seqs: shape.seqs, at, index_row: shape.index_row };
        let joined = gpu.scratch::<f32>(t * 2 * d)?;
        gpu.launch(
            "join_embedded",
            (t as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(joined.ptr()),
                Arg::Ptr(self.embed.ptr()),
                Arg::Ptr(at.tokens),
                Arg::Ptr(ring),
                Arg::Ptr(hidden_in),
                Arg::I32(d as i32),
                Arg::I32(self.vocab as i32),
            ],
        )?;
        s.norm(joined.ptr(), 0, joined.ptr(), &m.enorm, t, 1, 2 * d, 0)?;
        s.norm(joined.ptr(), 0, joined.ptr(), &m.hnorm, t, 1, 2 * d, d)?;
        s.linear(hidden_out, joined.ptr(), &m.eh_proj, t, 2 * d, d, false)?;
        let x = gpu.scratch::<f32>(t * d)?;
        let x_bf16 = gpu.scratch::<u16>(t * d)?;
        s.layer(&m.block, hidden_out, x.ptr(), x_bf16.ptr(), d)?;
        let n = shape.sampled;
        if n == 0 {
            return Ok(());
        }
        let last = gpu.scratch::<f32>(n * d)?;
        gpu.launch(
            "gather_rows",
            (n as u32, 1, 1),
            256,
            0,
            &[Arg::Ptr(last.ptr()), Arg::Ptr(hidden_out), Arg::Ptr(at.logit_rows), Arg::I32(d as i32)],
        )?;
        s.norm_rows(last.ptr(), 0, last.ptr(), &m.head_norm, n)?;
        let logits = gpu.scratch::<f32>(n * self.vocab)?;
        s.linear(logits.ptr(), last.ptr(), &m.head, n, d, self.vocab, false)?;
        enqueue_sampling(gpu, shape, at, ring, results, logits.ptr(), self.vocab)
    }
}
