//! The MTP drafter on a cuda rank (DESIGN §10, the CPU executor's `mtp.rs` on the device). A
//! step's forward also writes every row's final-normed hidden state into a buffer its record
//! owns; once the forward has completed — its samples, and so each verification's kept prefix,
//! are known on the host — the rank enqueues the drafter's passes on its stream: pass 0 over
//! each sequence's positions whose successor token is now known (the next token fed, the last
//! token that holds, or for a prompt chunk that ends before the prompt does, the prompt's next
//! token), then passes 1..k chaining the layer on its own output, each draft read from the ring
//! slot the previous pass sampled into (the host never waits for a draft). The step completes
//! when the passes have, its drafts in `Sampled::drafts`; a producer's exports are read after
//! them, so the MTP layer's KV travels with the rest.
//!
//! Which time it holds: the step's, from its forward's completion to its own.
//! Which guarantee it carries: none of its own — drafts only propose, and the next step's
//! verification keeps what the target agrees with. Chained positions write MTP KV past the last
//! token that holds; the next step's pass 0 writes them again before an MTP row reads them
//! (passes are enqueued in step order: completions are taken oldest first).

use super::pinned_pool::PinnedPool;
use crate::step::{Sampled, StepLaunch};
use kvflow_kernels::cuda::{
    CudaError, DeviceBuf, DeviceKv, DeviceModel, Gpu, PinnedBuf, StepRows, FROM_RING, RESULT_WORDS,
};

/// One sequence of a step, as the drafter needs it once the step's samples are known.
struct PlannedSeq {
    /// The words fed (ring-encoded where in flight), drafts last.
    fed: Vec<u32>,
    drafts: usize,
    start_pos: usize,
    table: Vec<u32>,
    prompt_len: usize,
    next_prompt_token: Option<u32>,
    samples: bool,
    /// Its first row in the step.
    first_row: usize,
}

/// A step's drafting, planned at launch.
pub(super) struct MtpPlan {
    seqs: Vec<PlannedSeq>,
    /// Every row's final-normed hidden state, written by the forward.
    pub(super) hidden: DeviceBuf<f32>,
}

/// A step's drafting enqueued: what the GPU reads and writes until it is done, and where each
/// sampling sequence's drafts land in `results`, pass by pass.
pub(super) struct MtpPasses {
    metas: Vec<PinnedBuf<u32>>,
    /// Per pass: its sampling rows' results.
    results: Vec<PinnedBuf<u32>>,
    /// Per pass: (index into the step's `Sampled`, its row of the pass's results).
    reads: Vec<Vec<(usize, usize)>>,
}

/// A draft chain in progress: its sequence's `Sampled`, its table, the position its next row
/// writes, and where the previous pass left its draft (ring slot) and hidden row.
struct Chain<'a> {
    sampled: usize,
    seq: &'a PlannedSeq,
    at: usize,
    slot: u32,
    row: usize,
}

impl MtpPlan {
    /// The plan of `launch`, whose rows are `rows`, its hidden states to be written into `hidden`.
    pub(super) fn of(launch: &StepLaunch<'_>, rows: &StepRows, hidden: DeviceBuf<f32>) -> Self {
        let seqs = launch
            .seqs()
            .enumerate()
            .map(|(i, s)| {
                let first_row = rows.row_at[i] as usize;
                PlannedSeq {
                    fed: rows.tokens[first_row..first_row + rows.seq_rows(i)].to_vec(),
                    drafts: s.drafts.len(),
                    start_pos: s.start_pos,
                    table: s.block_table.to_vec(),
                    prompt_len: s.prompt_len,
                    next_prompt_token: s.next_prompt_token,
                    samples: s.sample,
                    first_row,
                }
            })
            .collect();
        MtpPlan { seqs, hidden }
    }

    /// Enqueues the `k` passes after the step's forward, which sampled `sampled`; `slot` gives
    /// ring slots. Waits for nothing.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn enqueue(
        &self,
        gpu: &Gpu,
        model: &DeviceModel,
        kv: &DeviceKv,
        ring: u64,
        sampled: &[Sampled],
        k: usize,
        slot: &mut dyn FnMut() -> u32,
        pinned: &mut PinnedPool<u32>,
    ) -> Result<MtpPasses, CudaError> {
        let d = model.hidden;
        let bs = kv.block_size;
        let mut passes = MtpPasses { metas: Vec::new(), results: Vec::new(), reads: Vec::new() };
        // pass 0
        let mut rows = StepRows::default();
        let mut sources = Vec::new(); // (first hidden row of the step, rows)
        let mut chains = Vec::new();
        let mut proposing = 0;
        for s in &self.seqs {
            let proposes = s.samples.then(|| {
                proposing += 1;
                proposing - 1
            });
            let sampled = proposes.map(|j| &sampled[j]);
            let Some(successors) = super::mtp::successors(&s.fed, s.drafts, sampled, s.next_prompt_token) else {
                continue;
            };
            let slots: Vec<u32> = proposes.iter().map(|_| slot()).collect();
            rows.push_seq_sampling(&successors, s.start_pos, &s.table, bs, &slots);
            rows.prompt_len(s.prompt_len);
            sources.push((s.first_row, successors.len()));
            if let (Some(j), Some(&slot)) = (proposes, slots.first()) {
                let at = s.start_pos + successors.len();
                chains.push(Chain { sampled: j, seq: s, at, slot, row: rows.rows() - 1 });
            }
        }
        if rows.rows() == 0 {
            return Ok(passes);
        }
        let hidden_in = gpu.scratch::<f32>(rows.rows() * d)?;
        let mut cursor = 0;
        for (from, n) in sources {
            gpu.copy_on_device(hidden_in.at(cursor * d), self.hidden.at(from * d), n * d * 4)?;
            cursor += n;
        }
        let mut hidden_out = passes.pass(gpu, model, kv, ring, &rows, &hidden_in, pinned)?;
        passes.reads.push(chains.iter().enumerate().map(|(i, c)| (c.sampled, i)).collect());
        // passes 1..k, each draft chained on the previous one; a chain stops where its step's
        // blocks end
        for _ in 1..k {
            chains.retain(|c| c.seq.table.len() * bs > c.at);
            if chains.is_empty() {
                break;
            }
            let mut rows = StepRows::default();
            let hidden_in = gpu.scratch::<f32>(chains.len() * d)?;
            for (i, c) in chains.iter_mut().enumerate() {
                c.slot = {
                    let next = slot();
                    rows.push_seq_sampling(&[FROM_RING | c.slot], c.at, &c.seq.table, bs, &[next]);
                    rows.prompt_len(c.seq.prompt_len);
                    next
                };
                gpu.copy_on_device(hidden_in.at(i * d), hidden_out.at(c.row * d), d * 4)?;
                c.row = i;
                c.at += 1;
            }
            hidden_out = passes.pass(gpu, model, kv, ring, &rows, &hidden_in, pinned)?;
            passes.reads.push(chains.iter().enumerate().map(|(i, c)| (c.sampled, i)).collect());
        }
        Ok(passes)
    }
}

impl MtpPasses {
    /// Enqueues one pass over `rows` fed `hidden_in`, its results copied back to pinned memory;
    /// returns its output hidden rows.
    #[allow(clippy::too_many_arguments)]
    fn pass(
        &mut self,
        gpu: &Gpu,
        model: &DeviceModel,
        kv: &DeviceKv,
        ring: u64,
        rows: &StepRows,
        hidden_in: &DeviceBuf<f32>,
        pinned: &mut PinnedPool<u32>,
    ) -> Result<DeviceBuf<f32>, CudaError> {
        let mut meta = pinned.take(gpu, rows.words())?;
        let meta_dev = gpu.scratch::<u32>(rows.words().max(1))?;
        let at = rows.pack(meta.as_mut_slice(), meta_dev.ptr());
        gpu.copy_to_device(meta_dev.ptr(), &meta, rows.words())?;
        let hidden_out = gpu.scratch::<f32>(rows.rows() * model.hidden)?;
        let n = rows.sampled();
        let results = gpu.scratch::<u32>(n.max(1) * RESULT_WORDS)?;
        model.enqueue_mtp_pass(gpu, kv, rows, at, hidden_in.ptr(), hidden_out.ptr(), ring, results.ptr())?;
        let mut back = pinned.take(gpu, n * RESULT_WORDS)?;
        if n > 0 {
            gpu.copy_to_host(&mut back, results.ptr(), n * RESULT_WORDS)?;
        }
        self.metas.push(meta);
        self.results.push(back);
        Ok(hidden_out)
    }

    /// Once the passes are done: each sequence's drafts, in order, up to its first row that
    /// held a NaN or an infinity.
    pub(super) fn drafts_into(&self, sampled: &mut [Sampled]) {
        let mut alive = vec![true; sampled.len()];
        for (pass, results) in self.reads.iter().zip(&self.results) {
            let words = results.as_slice();
            let mut read = vec![false; sampled.len()];
            for &(j, row) in pass {
                let r = &words[row * RESULT_WORDS..(row + 1) * RESULT_WORDS];
                read[j] = true;
                if alive[j] && r[1] != 0 {
                    sampled[j].drafts.push(r[0]);
                } else {
                    alive[j] = false;
                }
            }
            // a chain that stopped drafts no more
            alive.iter_mut().zip(&read).for_each(|(a, r)| *a &= *r);
        }
    }

    /// The pinned buffers, for reuse.
    pub(super) fn give_back(self, pinned: &mut PinnedPool<u32>) {
        self.metas.into_iter().chain(self.results).for_each(|b| pinned.give_back(Some(b)));
    }
}
