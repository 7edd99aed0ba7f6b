//! One step of the model on the device, enqueued on the rank's stream and never waited for:
//! embeddings (a token still in flight is read from the sampled-token ring the step before
//! wrote), then per layer `h += mixer(norm(h)); h += ffn(norm(h))` as the CPU decoder computes
//! it, then the final norm, the LM head on the rows that sample, and sampling on the device
//! (greedy, or seeded draws) into the ring and a results buffer. Activations are stream-ordered
//! allocations, freed (in stream order) as soon as the step is enqueued.

use super::error::CudaError;
use super::gpu::{DeviceBuf, Event, Gpu};
use super::kv::DeviceKv;
use super::launch::Arg;
use super::model::{DevFfn, DevLayer, DevMixer, DeviceModel};
use super::parts::Step;
use super::rows::{RowsOnDevice, StepRows, StepShape, RESULT_WORDS};
use super::state::DeviceState;

impl Step<'_> {
    /// One decoder layer over the step's rows: `h += mixer(norm(h)); h += ffn(norm(h))`, with `x`
    /// (and `x_bf16`, where a bf16 product reads it) as the normed rows.
    pub(crate) fn layer(&self, layer: &DevLayer, h: u64, x: u64, x_bf16: u64, hidden: usize) -> Result<(), CudaError> {
        let ffn_bf16 = self.attend(layer, h, x, x_bf16, hidden)?;
        match &layer.ffn {
            DevFfn::Dense(m) => self.mlp(h, x, ffn_bf16, m, self.rows, hidden, true),
            DevFfn::Moe(m) => self.moe(h, x, m, hidden),
        }
    }

    /// A layer up to its FFN: `h += mixer(norm(h))`, then the FFN's input `norm(h)` into `x`
    /// (and rounded into `x_bf16` when a dense bf16 FFN reads it: returned, else 0).
    pub(crate) fn attend(
        &self,
        layer: &DevLayer,
        h: u64,
        x: u64,
        x_bf16: u64,
        hidden: usize,
    ) -> Result<u64, CudaError> {
        let t = self.rows;
        let rounded_for = |bf16: bool| if bf16 { x_bf16 } else { 0 };
        let mixer_bf16 = rounded_for(matches!(&layer.mixer, DevMixer::Gqa(a) if a.qkv.w.is_bf16()));
        self.norm_rows(x, mixer_bf16, h, &layer.input_norm, t)?;
        match &layer.mixer {
            DevMixer::Gqa(a) => self.gqa(h, x, mixer_bf16, a, layer.kv_layer, hidden)?,
            DevMixer::Mla(a) => self.mla(h, x, a, layer.kv_layer, hidden)?,
            DevMixer::Gdn(g) => self.gdn(h, x, g, layer.state_offset, hidden)?,
            DevMixer::Kda(k) => self.kda(h, x, k, layer.state_offset, hidden)?,
        }
        let ffn_bf16 = rounded_for(matches!(&layer.ffn, DevFfn::Dense(m) if m.gate_up.w.is_bf16()));
        self.norm_rows(x, ffn_bf16, h, &layer.post_norm, t)?;
        Ok(ffn_bf16)
    }
}

impl DeviceModel {
    /// Enqueues one step over `rows` (already at `at` on the device) against `kv`: writes each
    /// row's KV into its cache row, and for each sampling row its token (greedy, or drawn) into `ring` at its
    /// slot and `RESULT_WORDS` words into `results`; every row's final-normed hidden state into
    /// `hidden_out` unless it is 0. Returns the sampled rows' logits when
    /// `keep_logits` (checks and tests only). With `marks` ([`LayerMarks::unset`]), records when
    /// each KV layer is written. Waits for nothing.
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
        hidden_out: u64,
        keep_logits: bool,
        marks: Option<&mut Vec<Option<Event>>>,
    ) -> Result<Option<DeviceBuf<f32>>, CudaError> {
        self.enqueue_shaped(gpu, kv, state, rows.shape(), at, ring, results, hidden_out, keep_logits, marks)
    }

    /// [`DeviceModel::enqueue_step`] from the rows' shape alone (what a captured step is built
    /// from): the rows themselves are read on the device at `at`. Unless `hidden_out` is 0, every
    /// row's final-normed hidden state is written there (`rows × hidden`, for the MTP drafter).
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
        hidden_out: u64,
        keep_logits: bool,
        mut marks: Option<&mut Vec<Option<Event>>>,
    ) -> Result<Option<DeviceBuf<f32>>, CudaError> {
        let (t, hidden) = (shape.rows, self.hidden);
        if t == 0 {
            return Ok(None);
        }
        let s = Step { gpu, kv, state, rows: t, seqs: shape.seqs, at, index_row: shape.index_row };
        let h = self.embed_rows(gpu, t, at, ring)?;
        let x = gpu.scratch::<f32>(t * hidden)?;
        // x rounded to bf16 by the norm that writes it, where a bf16 product reads it next
        let x_bf16 = gpu.scratch::<u16>(t * hidden)?;
        for layer in &self.layers {
            s.layer(layer, h.ptr(), x.ptr(), x_bf16.ptr(), hidden)?;
            let writes_kv = matches!(layer.mixer, DevMixer::Gqa(_) | DevMixer::Mla(_));
            if let Some(mark) = marks.as_deref_mut().and_then(|m| m.get_mut(layer.kv_layer)).filter(|_| writes_kv) {
                *mark = Some(gpu.record()?);
            }
        }
        self.enqueue_head(&s, shape, h.ptr(), ring, results, hidden_out, keep_logits)
    }

    /// The embeddings of a step's `t` rows (a token still in flight read from `ring`).
    pub(crate) fn embed_rows(
        &self,
        gpu: &Gpu,
        t: usize,
        at: RowsOnDevice,
        ring: u64,
    ) -> Result<DeviceBuf<f32>, CudaError> {
        let h = gpu.scratch::<f32>(t * self.hidden)?;
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
                Arg::I32(self.hidden as i32),
                Arg::I32(self.vocab as i32),
            ],
        )?;
        Ok(h)
    }

    /// After the layers, over the hidden states `h`: every row's final-normed state into
    /// `hidden_out` unless it is 0, then the final norm, the LM head and sampling of the rows
    /// that sample.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn enqueue_head(
        &self,
        s: &Step<'_>,
        shape: StepShape,
        h: u64,
        ring: u64,
        results: u64,
        hidden_out: u64,
        keep_logits: bool,
    ) -> Result<Option<DeviceBuf<f32>>, CudaError> {
        let (gpu, at, hidden) = (s.gpu, s.at, self.hidden);
        if hidden_out != 0 {
            // every row's final-normed hidden state, for the MTP drafter
            s.norm_rows(hidden_out, 0, h, &self.final_norm, shape.rows)?;
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
            &[Arg::Ptr(last.ptr()), Arg::Ptr(h), Arg::Ptr(at.logit_rows), Arg::I32(hidden as i32)],
        )?;
        let last_bf16 = match self.lm_head.w.is_bf16() {
            true => Some(gpu.scratch::<u16>(n * hidden)?),
            false => None,
        };
        let last_bf16_ptr = last_bf16.as_ref().map_or(0, DeviceBuf::ptr);
        s.norm_rows(last.ptr(), last_bf16_ptr, last.ptr(), &self.final_norm, n)?;
        let logits = gpu.scratch::<f32>(n * self.vocab)?;
        s.linear_rounded(logits.ptr(), last.ptr(), last_bf16_ptr, &self.lm_head, n, hidden, self.vocab, false)?;
        enqueue_sampling(gpu, shape, at, ring, results, logits.ptr(), self.vocab)?;
        Ok(keep_logits.then_some(logits))
    }
}

/// Enqueues the sampling of a step's `shape.sampled` logits rows at `logits`: each row's token
/// into `ring` and its `RESULT_WORDS` into `results` — `sample_greedy`, or `sample_drawn` when some
/// row draws with a temperature (it weighs every logit in doubles, in scratch).
#[allow(clippy::too_many_arguments)]
pub(super) fn enqueue_sampling(
    gpu: &Gpu,
    shape: StepShape,
    at: RowsOnDevice,
    ring: u64,
    results: u64,
    logits: u64,
    vocab: usize,
) -> Result<(), CudaError> {
    let n = shape.sampled;
    let weights = if shape.drawn { Some(gpu.scratch::<f64>(n * vocab)?) } else { None };
    let mut args = vec![Arg::Ptr(results), Arg::Ptr(ring), Arg::Ptr(at.ring_slots), Arg::Ptr(logits)];
    if let Some(w) = &weights {
        args.extend([Arg::Ptr(at.draws), Arg::Ptr(w.ptr())]);
    }
    args.push(Arg::I32(vocab as i32));
    let kernel = if shape.drawn { "sample_drawn" } else { "sample_greedy" };
    gpu.launch(kernel, (n as u32, 1, 1), 256, 0, &args)
}

/// The tokens the device samples from given logits (`rows.sampled()` rows of `vocab`, row
/// after row), as a step samples them: `None` where a row is not all finite. Waits for the
/// device (checks only).
pub fn sample_rows(gpu: &Gpu, rows: &StepRows, logits: &[f32], vocab: usize) -> Result<Vec<Option<u32>>, CudaError> {
    let n = rows.sampled();
    let mut packed = vec![0u32; rows.words()];
    rows.pack(&mut packed, 0);
    let meta = gpu.upload(&packed)?;
    let at = rows.pack(&mut packed, meta.ptr());
    let logits = gpu.upload(logits)?;
    let ring = gpu.zeros::<u32>(rows.ring_slots.iter().max().map_or(1, |&s| s as usize + 1))?;
    let results = gpu.zeros::<u32>(n * RESULT_WORDS)?;
    enqueue_sampling(gpu, rows.shape(), at, ring.ptr(), results.ptr(), logits.ptr(), vocab)?;
    let words = gpu.download(&results, n * RESULT_WORDS)?;
    Ok(words.chunks(RESULT_WORDS).map(|r| (r[1] != 0).then_some(r[0])).collect())
}
