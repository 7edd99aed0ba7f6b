//! A batch of requests on one cuda executor, driven as a rank drives it (for `kvflow bench
//! device` and `kvflow bench speed`): every prompt prefilled in one step, then decode steps
//! launched without waiting, two in flight, each feeding the token the one before samples
//! (with deferred output, straight from the device's ring). Batches of several shapes can take
//! turns on one executor ([`Turns`]): the model is uploaded once.

use crate::bench::Lcg;
use anyhow::{anyhow, Result};
use kvflow_kernels::cpu::sampling::{RequestSampling, Sampler};
use kvflow_kernels::models::Model;
use kvflow_operators::executor::{CudaExecutor, CudaSettings, Executor, ExecutorContext};
use kvflow_operators::policy::memory::MemoryLayout;
use kvflow_operators::step::{SeqKey, SeqSlice, SeqStep, StateOp, StepCompletion, StepLaunch};
use std::sync::Arc;
use std::time::Instant;

/// Paged KV block size of the benches.
const BS: usize = 16;

/// The batch's requests: what each step's sequences are built from.
struct Requests {
    keys: Vec<SeqKey>,
    prompts: Vec<Vec<u32>>,
    tables: Vec<Vec<u32>>,
    /// Each sequence's state slot (families with recurrent state).
    slots: Option<Vec<u32>>,
    /// How every sequence picks its tokens; sequence i draws as request `REQUEST_IDS + i`.
    sampling: RequestSampling,
}

/// The request id of the batch's first sequence (the next ones follow).
pub const REQUEST_IDS: u64 = 100;

impl Requests {
    fn seq<'a>(&'a self, i: usize, known: &'a [u32], deferred: Option<u64>, start_pos: usize) -> SeqStep<'a> {
        self.chunk(i, known, deferred, start_pos, true)
    }

    /// Sequence `i`'s step over `known` from `start_pos`, sampling at its end or not.
    fn chunk<'a>(
        &'a self,
        i: usize,
        known: &'a [u32],
        deferred: Option<u64>,
        start_pos: usize,
        sample: bool,
    ) -> SeqStep<'a> {
        SeqStep {
            sampler: Sampler::new(self.sampling, REQUEST_IDS + i as u64),
            next_prompt_token: None,
            key: self.keys[i],
            known,
            deferred,
            drafts: &[],
            start_pos,
            block_table: &self.tables[i],
            slot: self.slots.as_ref().map(|s| s[i] as _),
            prompt_len: self.prompts[i].len(),
            sample,
        }
    }
}

pub struct CudaBatch {
    pub ex: CudaExecutor,
    reqs: Requests,
    /// Each sequence's latest token, and how many decode steps followed its prefill.
    last: Vec<u32>,
    decoded: usize,
    max_decode: usize,
    step: u64,
    /// Every sample taken so far, in completion order: (sequence, token, logits row hash).
    pub samples: Vec<(u32, Option<u32>, u64)>,
    /// The host's time in the executor's `launch` calls so far (seconds).
    pub launch_seconds: f64,
}

/// An executor that batches of several shapes take turns on (`CudaBatch::on`, then
/// `CudaBatch::done`), with the step and the sequences' generation the next batch goes on from.
pub struct Turns {
    ex: CudaExecutor,
    step: u64,
    generation: u32,
}

impl Turns {
    /// An executor with room for the largest of `shapes`, each `(batch, prompt_len, max_decode)`.
    pub fn new(model: &Arc<Model>, settings: &CudaSettings, shapes: &[(usize, usize, usize)]) -> Result<Self> {
        let (keeps_kv, keeps_state) = (model.needs_blocks(), model.needs_slots());
        let blocks = shapes.iter().map(|&(b, p, d)| b * per_sequence(p, d)).max().unwrap_or(0);
        let slots = shapes.iter().map(|&(b, _, _)| b).max().unwrap_or(0);
        let layout = MemoryLayout {
            block_size: BS,
            blocks: if keeps_kv { blocks } else { 0 },
            slots: if keeps_state { slots } else { 0 },
            snapshots: 0,
            keeps_kv,
            keeps_state,
            prefix_keyed_by_prompt_len: false,
            verify_rows: 0,
        };
        let ctx = ExecutorContext::standalone("bench", model.clone(), layout);
        let ex = CudaExecutor::new(&ctx, settings).map_err(|e| anyhow!(e))?;
        Ok(Turns { ex, step: 0, generation: 0 })
    }
}

/// The KV blocks a sequence of `prompt_len` tokens and `max_decode` decode steps takes.
fn per_sequence(prompt_len: usize, max_decode: usize) -> usize {
    (prompt_len + max_decode + 1).div_ceil(BS)
}

impl CudaBatch {
    /// `batch` seeded prompts of `prompt_len` tokens with room for `max_decode` decode steps.
    pub fn new(
        model: &Arc<Model>,
        settings: &CudaSettings,
        batch: usize,
        prompt_len: usize,
        max_decode: usize,
    ) -> Result<Self> {
        let turns = Turns::new(model, settings, &[(batch, prompt_len, max_decode)])?;
        Self::on(turns, model, batch, prompt_len, max_decode)
    }

    /// [`new`](Self::new) on an executor taken in turns (built with room for this shape): its
    /// sequences are a generation of their own, its steps go on from the last batch's.
    pub fn on(turns: Turns, model: &Arc<Model>, batch: usize, prompt_len: usize, max_decode: usize) -> Result<Self> {
        let Turns { ex, step, generation } = turns;
        let per_seq = per_sequence(prompt_len, max_decode);
        let (keeps_kv, keeps_state) = (model.needs_blocks(), model.needs_slots());
        let mut rng = Lcg(3);
        let prompts = (0..batch)
            .map(|_| (0..prompt_len).map(|_| (rng.draw() % model.vocab_size as u64) as u32).collect())
            .collect();
        let table =
            |s: usize| if keeps_kv { (s * per_seq..(s + 1) * per_seq).map(|b| b as u32).collect() } else { vec![] };
        let reqs = Requests {
            keys: (0..batch as u32).map(|i| SeqKey { index: i, generation }).collect(),
            prompts,
            tables: (0..batch).map(table).collect(),
            slots: keeps_state.then(|| (0..batch as u32).collect()),
            sampling: RequestSampling::default(),
        };
        Ok(CudaBatch {
            ex,
            reqs,
            last: vec![0; batch],
            decoded: 0,
            max_decode,
            step,
            samples: Vec::new(),
            launch_seconds: 0.0,
        })
    }

    /// Gives the executor back for the next batch's turn.
    pub fn done(self) -> Turns {
        let generation = self.reqs.keys.first().map_or(0, |k| k.generation) + 1;
        Turns { ex: self.ex, step: self.step, generation }
    }

    /// Has every sequence pick its tokens by `sampling` (greedy until this is called).
    pub fn sample_by(&mut self, sampling: RequestSampling) {
        self.reqs.sampling = sampling;
    }

    /// Sequence `i`'s prompt.
    pub fn prompt(&self, i: usize) -> &[u32] {
        &self.reqs.prompts[i]
    }

    /// Launches the next step over `seqs` (built from the batch's requests; each samples when
    /// `sampling`).
    fn launch(
        ex: &mut CudaExecutor,
        reqs: &Requests,
        step: u64,
        seqs: &[SeqStep<'_>],
        before: &[StateOp],
        sampling: bool,
    ) {
        let l = StepLaunch {
            step,
            before,
            after: &[],
            applied_through: None,
            sampling: if sampling { &reqs.keys } else { &[] },
            batch: &SeqSlice(seqs),
            imports: &[],
            exports: &[],
        };
        ex.launch(&l, 0);
    }

    /// Takes what has completed (never waits); returns how many steps completed.
    fn take(&mut self, done: &mut Vec<StepCompletion>) -> Result<usize> {
        self.ex.poll(done);
        let n = done.len();
        for c in done.drain(..) {
            for s in c.result.map_err(|e| anyhow!("step {}: {e}", c.step))? {
                self.last[s.seq.index as usize] = s.token.unwrap_or(0);
                self.samples.push((s.seq.index, s.token, s.logits_hash));
            }
        }
        Ok(n)
    }

    /// Prefills every prompt in one step (their slots zeroed first) and waits for its tokens;
    /// returns the seconds from launch to the last token.
    pub fn prefill(&mut self) -> Result<f64> {
        self.prefill_span(0, usize::MAX)
    }

    /// Prefills the first `prefix` tokens of every prompt in one step (their slots zeroed
    /// first), sampling nothing, and waits for it.
    pub fn prefill_prefix(&mut self, prefix: usize) -> Result<()> {
        self.prefill_span(0, prefix).map(|_| ())
    }

    /// Computes every prompt's tokens after the first `prefix` (cached by `prefill_prefix`) in
    /// one step and waits for its tokens; returns the seconds from launch to the last token.
    /// Again and again if asked: each time writes the same positions (a model with recurrent
    /// state runs on from where it was: the same work).
    pub fn prefill_rest(&mut self, prefix: usize) -> Result<f64> {
        self.prefill_span(prefix, usize::MAX)
    }

    /// One step over every prompt's tokens `from..to` (slots zeroed first when `from` is 0;
    /// sampling at the prompt's end only), waited for; the seconds from launch to completion.
    fn prefill_span(&mut self, from: usize, to: usize) -> Result<f64> {
        let t = Instant::now();
        let reqs = &self.reqs;
        let zero: Vec<StateOp> = match from {
            0 => reqs.slots.iter().flatten().map(|&slot| StateOp::Zero { slot: slot as _ }).collect(),
            _ => Vec::new(),
        };
        let whole = to >= reqs.prompts.iter().map(Vec::len).max().unwrap_or(0);
        let seqs: Vec<SeqStep<'_>> = (0..reqs.keys.len())
            .map(|i| {
                let prompt = &reqs.prompts[i];
                reqs.chunk(i, &prompt[from.min(prompt.len())..to.min(prompt.len())], None, from, whole)
            })
            .collect();
        self.step += 1;
        let host = Instant::now();
        Self::launch(&mut self.ex, reqs, self.step, &seqs, &zero, whole);
        self.launch_seconds += host.elapsed().as_secs_f64();
        drop(seqs);
        let mut done = Vec::new();
        while self.take(&mut done)? == 0 {
            std::hint::spin_loop();
        }
        self.decoded = 0;
        Ok(t.elapsed().as_secs_f64())
    }

    /// `steps` decode steps as a rank runs them: launched without waiting, the tokens fed from
    /// the device's ring (`deferred`, two steps in flight) or from the host (each step waits for
    /// the one before). Returns the seconds and the host-device waits they took.
    pub fn decode(&mut self, steps: usize, deferred: bool) -> Result<(f64, u64)> {
        if self.decoded + steps > self.max_decode {
            return Err(anyhow!("{steps} more decode steps than the batch has room for"));
        }
        let waits_before = self.ex.host_waits();
        let t = Instant::now();
        let mut done = Vec::new();
        let in_flight = if deferred { 2 } else { 1 };
        let (mut launched, mut completed) = (0, 0);
        while launched < steps {
            let pos = self.reqs.prompts[0].len() + self.decoded;
            let known: Vec<[u32; 1]> = self.last.iter().map(|&t| [t]).collect();
            let (prev, reqs) = (self.step, &self.reqs);
            let seqs: Vec<SeqStep<'_>> = (0..reqs.keys.len())
                .map(|i| {
                    let fed: &[u32] = if deferred { &[] } else { &known[i] };
                    reqs.seq(i, fed, deferred.then_some(prev), pos)
                })
                .collect();
            self.step += 1;
            let host = Instant::now();
            Self::launch(&mut self.ex, reqs, self.step, &seqs, &[], true);
            self.launch_seconds += host.elapsed().as_secs_f64();
            drop(seqs);
            self.decoded += 1;
            launched += 1;
            loop {
                completed += self.take(&mut done)?;
                if launched - completed < in_flight {
                    break;
                }
            }
        }
        while completed < steps {
            completed += self.take(&mut done)?;
        }
        Ok((t.elapsed().as_secs_f64(), self.ex.host_waits() - waits_before))
    }
}
