//! The MTP drafter on a cuda rank (DESIGN §10, the CPU executor's `mtp.rs` on the device). A
//! step's forward also writes every row's final-normed hidden state into a buffer its record
//! owns; once the forward has completed — its samples, and so each verification's kept prefix,
//! are known on the host — the rank enqueues the drafter's passes on its stream: pass 0 over
//! each sequence's positions whose successor token is now known (the next token fed, the last
//! token that holds, or for a prompt chunk that ends before the prompt does, the prompt's next
//! token), then passes 1..k chaining the layer on its own output, each draft read from the ring
//! slot the previous pass sampled into (the host never waits for a draft). The step completes
//! when the passes have, its drafts in `Sampled::drafts`; a producer's exports are read after
//! them, so the MTP layer's KV travels with the rest. Passes are planned one at a time
//! (`DraftChains`): under expert parallelism with a MoE MTP layer, `cuda_experts.rs` enqueues
//! each as an exchange of the MTP layer's experts, after the step's last MoE block.
//!
//! Which time it holds: the step's, from its forward's completion to its own.
//! Which guarantee it carries: none of its own — drafts only propose, and the next step's
//! verification keeps what the target agrees with. Chained positions write MTP KV past the last
//! token that holds; the next step's pass 0 writes them again before an MTP row reads them
//! (passes are enqueued in step order: completions are taken oldest first).

use crate::step::{Sampled, StepLaunch};
use kvflow_kernels::cuda::PinnedPool;
use kvflow_kernels::cuda::{
    CudaError, DeviceBuf, DeviceKv, DeviceModel, Gpu, PinnedBuf, RowsOnDevice, StepRows, FROM_RING, RESULT_WORDS,
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
#[derive(Default)]
pub(super) struct MtpPasses {
    metas: Vec<PinnedBuf<u32>>,
    /// Per pass: its sampling rows' results.
    results: Vec<PinnedBuf<u32>>,
    /// Per pass: (index into the step's `Sampled`, its row of the pass's results).
    reads: Vec<Vec<(usize, usize)>>,
    /// Expert parallel: a pass lost an expert result, so the step proposes no draft (drafts
    /// only propose: no request fails).
    pub(super) lost: bool,
}

/// A draft chain in progress: its sequence's `Sampled`, its sequence in the plan, the position
/// its next row writes, and where the previous pass left its draft (ring slot) and hidden row.
struct Chain {
    sampled: usize,
    seq: usize,
    at: usize,
    slot: u32,
    row: usize,
}

/// The drafting of a step whose samples are known, pass by pass: pass 0 over each sequence's
/// positions whose successor is known, then passes chaining the layer on its own output.
pub(super) struct DraftChains {
    chains: Vec<Chain>,
    /// Passes planned so far.
    planned: usize,
    k: usize,
}

/// One pass to enqueue: its rows, its input hidden rows (copies enqueued), and which
/// sequence's draft each of its sampling rows is.
pub(super) struct PlannedPass {
    pub(super) rows: StepRows,
    pub(super) hidden_in: DeviceBuf<f32>,
    reads: Vec<(usize, usize)>,
}

impl DraftChains {
    /// The drafting of `k` passes.
    pub(super) fn new(k: usize) -> DraftChains {
        DraftChains { chains: Vec::new(), planned: 0, k }
    }

    /// The next pass of `plan`'s step, which sampled `sampled`, its hidden input copied on the
    /// stream from the forward's rows (pass 0) or `previous` (the last pass's output); `slot`
    /// gives ring slots. `None`: no pass is left (`k` planned, or no chain goes on).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn next_pass(
        &mut self,
        plan: &MtpPlan,
        gpu: &Gpu,
        d: usize,
        bs: usize,
        sampled: &[Sampled],
        previous: Option<&DeviceBuf<f32>>,
        slot: &mut dyn FnMut() -> u32,
    ) -> Result<Option<PlannedPass>, CudaError> {
        if self.planned >= self.k {
            return Ok(None);
        }
        self.planned += 1;
        let mut rows = StepRows::default();
        if self.planned == 1 {
            let mut sources = Vec::new(); // (first hidden row of the step, rows)
            let mut proposing = 0;
            for (i, s) in plan.seqs.iter().enumerate() {
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
                    self.chains.push(Chain { sampled: j, seq: i, at, slot, row: rows.rows() - 1 });
                }
            }
            if rows.rows() == 0 {
                return Ok(None);
            }
            let hidden_in = gpu.scratch::<f32>(rows.rows() * d)?;
            let mut cursor = 0;
            for (from, n) in sources {
                gpu.copy_on_device(hidden_in.at(cursor * d), plan.hidden.at(from * d), n * d * 4)?;
                cursor += n;
            }
            return Ok(Some(self.planned_pass(rows, hidden_in)));
        }
        // each draft chained on the previous one; a chain stops where its step's blocks end
        self.chains.retain(|c| plan.seqs[c.seq].table.len() * bs > c.at);
        let Some(previous) = previous.filter(|_| !self.chains.is_empty()) else {
            self.chains.clear();
            return Ok(None);
        };
        let hidden_in = gpu.scratch::<f32>(self.chains.len() * d)?;
        for (i, c) in self.chains.iter_mut().enumerate() {
            let seq = &plan.seqs[c.seq];
            let next = slot();
            rows.push_seq_sampling(&[FROM_RING | c.slot], c.at, &seq.table, bs, &[next]);
            rows.prompt_len(seq.prompt_len);
            c.slot = next;
            gpu.copy_on_device(hidden_in.at(i * d), previous.at(c.row * d), d * 4)?;
            c.row = i;
            c.at += 1;
        }
        Ok(Some(self.planned_pass(rows, hidden_in)))
    }

    fn planned_pass(&self, rows: StepRows, hidden_in: DeviceBuf<f32>) -> PlannedPass {
        let reads = self.chains.iter().enumerate().map(|(i, c)| (c.sampled, i)).collect();
        PlannedPass { rows, hidden_in, reads }
    }
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
        let mut passes = MtpPasses::default();
        let mut chains = DraftChains::new(k);
        let mut previous = None;
        while let Some(pass) =
            chains.next_pass(self, gpu, model.hidden, kv.block_size, sampled, previous.as_ref(), slot)?
        {
            let (at, meta_dev) = passes.stage(gpu, &pass.rows, pinned)?;
            let hidden_out = gpu.scratch::<f32>(pass.rows.rows() * model.hidden)?;
            let results = gpu.scratch::<u32>(pass.rows.sampled().max(1) * RESULT_WORDS)?;
            let (rows, hidden_in) = (&pass.rows, pass.hidden_in.ptr());
            model.enqueue_mtp_pass(gpu, kv, rows, at, hidden_in, hidden_out.ptr(), ring, results.ptr())?;
            drop(meta_dev); // (freed in stream order, after the pass)
            passes.read_back(gpu, &pass, results.ptr(), pinned)?;
            previous = Some(hidden_out);
        }
        Ok(passes)
    }
}

impl MtpPasses {
    /// Stages `rows`' metadata (pinned, held with the passes) and copies it to the device:
    /// where the rows sit there, and the device copy, which lives while the pass's kernels run.
    pub(super) fn stage(
        &mut self,
        gpu: &Gpu,
        rows: &StepRows,
        pinned: &mut PinnedPool<u32>,
    ) -> Result<(RowsOnDevice, DeviceBuf<u32>), CudaError> {
        let mut meta = pinned.take(gpu, rows.words())?;
        let meta_dev = gpu.scratch::<u32>(rows.words().max(1))?;
        let at = rows.pack(meta.as_mut_slice(), meta_dev.ptr());
        gpu.copy_to_device(meta_dev.ptr(), &meta, rows.words())?;
        self.metas.push(meta);
        Ok((at, meta_dev))
    }

    /// Copies `pass`'s results (at `results` on the device) back to pinned memory once its
    /// kernels have written them.
    pub(super) fn read_back(
        &mut self,
        gpu: &Gpu,
        pass: &PlannedPass,
        results: u64,
        pinned: &mut PinnedPool<u32>,
    ) -> Result<(), CudaError> {
        let n = pass.rows.sampled();
        let mut back = pinned.take(gpu, n * RESULT_WORDS)?;
        if n > 0 {
            gpu.copy_to_host(&mut back, results, n * RESULT_WORDS)?;
        }
        self.results.push(back);
        self.reads.push(pass.reads.clone());
        Ok(())
    }

    /// Once the passes are done: each sequence's drafts, in order, up to its first row that
    /// held a NaN or an infinity.
    pub(super) fn drafts_into(&self, sampled: &mut [Sampled]) {
        if self.lost {
            return;
        }
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
