//! The plain path on the device: one step at a time, the host waiting for each (counted). It is
//! what `--verify` compares a `cuda` run with (one request alone, chunked prefill, then one
//! token a step — the CUDA executor's own reference), and what the parity checks read logits
//! from. Never a rank's step path.

use super::error::CudaError;
use super::gpu::{DeviceBuf, Gpu};
use super::kv::DeviceKv;
use super::model::DeviceModel;
use super::rows::{StepRows, NO_SLOT, RESULT_WORDS};
use super::state::DeviceState;
use crate::cpu::sampling::Sampler;
use crate::hash;

/// One sampled row of a plain step.
#[derive(Clone, Debug)]
pub struct PlainSample {
    /// `None`: the row held a NaN or an infinity.
    pub token: Option<u32>,
    pub logits_hash: u64,
    pub logits: Vec<f32>,
}

/// A request generated alone on the device.
#[derive(Clone, Debug, Default)]
pub struct PlainGeneration {
    pub tokens: Vec<u32>,
    /// `hash::chain_row` over every sampled row, as `kvflow generate` chains them.
    pub logits_hash: u64,
    /// Logits of every sampled row, in order (the prompt's last first).
    pub logits: Vec<Vec<f32>>,
    pub error: Option<String>,
}

pub struct PlainRunner<'a> {
    pub gpu: &'a Gpu,
    pub model: &'a DeviceModel,
    ring: DeviceBuf<u32>,
}

impl<'a> PlainRunner<'a> {
    pub fn new(gpu: &'a Gpu, model: &'a DeviceModel) -> Result<Self, CudaError> {
        Ok(PlainRunner { gpu, model, ring: gpu.zeros::<u32>(1 << 16)? })
    }

    /// Runs one step and waits for it: each sampling row's token, hash and logits. Ring slots of
    /// `rows` must be below 65,536.
    pub fn step(&self, kv: &DeviceKv, rows: &StepRows) -> Result<Vec<PlainSample>, CudaError> {
        self.step_in(kv, None, rows)
    }

    /// [`PlainRunner::step`] for a family with recurrent state: the rows' slots are in `state`.
    pub fn step_in(
        &self,
        kv: &DeviceKv,
        state: Option<&DeviceState>,
        rows: &StepRows,
    ) -> Result<Vec<PlainSample>, CudaError> {
        let n = rows.sampled();
        let mut meta = self.gpu.pinned::<u32>(rows.words())?;
        let meta_dev = self.gpu.scratch::<u32>(rows.words())?;
        let at = rows.pack(meta.as_mut_slice(), meta_dev.ptr());
        self.gpu.copy_to_device(meta_dev.ptr(), &meta, rows.words())?;
        let results = self.gpu.scratch::<u32>(n * RESULT_WORDS)?;
        let logits =
            self.model.enqueue_step(self.gpu, kv, state, rows, at, self.ring.ptr(), results.ptr(), 0, true, None)?;
        let mut host_results = self.gpu.pinned::<u32>(n * RESULT_WORDS)?;
        let mut host_logits = self.gpu.pinned::<f32>(n * self.model.vocab)?;
        if let Some(l) = &logits {
            self.gpu.copy_to_host(&mut host_results, results.ptr(), n * RESULT_WORDS)?;
            self.gpu.copy_to_host(&mut host_logits, l.ptr(), n * self.model.vocab)?;
        }
        self.gpu.wait()?;
        let v = self.model.vocab;
        Ok((0..n)
            .map(|i| {
                let r = &host_results.as_slice()[i * RESULT_WORDS..(i + 1) * RESULT_WORDS];
                PlainSample {
                    token: (r[1] != 0).then_some(r[0]),
                    logits_hash: r[2] as u64 | (r[3] as u64) << 32,
                    logits: host_logits.as_slice()[i * v..(i + 1) * v].to_vec(),
                }
            })
            .collect())
    }

    /// Generates `max_new` greedy tokens after `prompt` alone: [`PlainRunner::generate_by`].
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        chunk: usize,
        block_size: usize,
    ) -> Result<PlainGeneration, CudaError> {
        self.generate_by(prompt, max_new, chunk, block_size, &Sampler::default())
    }

    /// Generates `max_new` tokens after `prompt` alone, each picked by `sampler` (greedy, or its
    /// seeded draw): prefill in chunks of `chunk` tokens, then one token a step, on blocks `0..`
    /// of a cache of its own.
    pub fn generate_by(
        &self,
        prompt: &[u32],
        max_new: usize,
        chunk: usize,
        block_size: usize,
        sampler: &Sampler,
    ) -> Result<PlainGeneration, CudaError> {
        let mut out = PlainGeneration { logits_hash: hash::EMPTY, ..Default::default() };
        if prompt.is_empty() || max_new == 0 {
            return Ok(out);
        }
        let blocks = (prompt.len() + max_new).div_ceil(block_size);
        let kv = DeviceKv::new(self.gpu, &self.model.kv_widths, block_size, blocks, self.model.dtype)?;
        let table: Vec<u32> = (0..blocks as u32).collect();
        // One slot of its own, zeroed, when the family keeps recurrent state.
        let state = match self.model.state_width {
            0 => None,
            width => Some(DeviceState::new(self.gpu, width, 1, 0, 0)?),
        };
        let slot = state.as_ref().map(|_| 0);
        let mut fed = 0;
        while fed < prompt.len() {
            let end = (fed + chunk.max(1)).min(prompt.len());
            let mut rows = StepRows::default();
            rows.push_seq(&prompt[fed..end], fed, &table, block_size, (end == prompt.len()).then_some(0));
            rows.in_slot(slot.unwrap_or(NO_SLOT)).prompt_len(prompt.len()).drawn_by(sampler, prompt.len());
            let samples = self.step_in(&kv, state.as_ref(), &rows)?;
            fed = end;
            if let Some(s) = samples.into_iter().next() {
                if !self.take(&mut out, s) {
                    return Ok(out);
                }
            }
        }
        while out.tokens.len() < max_new {
            let pos = prompt.len() + out.tokens.len() - 1;
            let mut rows = StepRows::default();
            rows.push_seq(&[*out.tokens.last().expect("a token was sampled")], pos, &table, block_size, Some(0));
            rows.in_slot(slot.unwrap_or(NO_SLOT)).drawn_by(sampler, pos + 1);
            let s = self.step_in(&kv, state.as_ref(), &rows)?.remove(0);
            if !self.take(&mut out, s) {
                break;
            }
        }
        Ok(out)
    }

    fn take(&self, out: &mut PlainGeneration, s: PlainSample) -> bool {
        match s.token {
            Some(t) => {
                out.logits_hash = hash::chain_row(out.logits_hash, s.logits_hash);
                out.tokens.push(t);
                out.logits.push(s.logits);
                true
            }
            None => {
                out.error = Some(format!("the logits after {} tokens hold NaN or infinite values", out.tokens.len()));
                false
            }
        }
    }
}
