//! The MTP drafter's passes, run by the CPU executor after a step's forward and sampling (DESIGN
//! §10). Pass 0: for each sequence, the MTP layer runs over every position the step fed whose
//! successor token is now known — the next token fed, the token sampled (or the last draft kept),
//! or, for a prompt chunk that ends before the prompt does, the prompt's next token — writing its
//! own layer of the paged cache; a sequence that sampled gets its first draft. Passes 1..k chain
//! the layer on its own output for the next drafts, handed back with the sampled token
//! (`Sampled::drafts`). Drafts only propose: the next step's verification keeps what the target
//! agrees with, so outputs never depend on them.
//!
//! With expert parallelism every rank runs all `k` passes at every step (each a dispatch, experts
//! and combine of the MTP layer's MoE block), rows or not: the draft passes are part of the step's
//! collectives, so a rank with only a middle prompt chunk, or nothing to draft, still joins them.
//!
//! Chained positions write MTP KV past the last accepted token; the next step's pass 0 writes
//! those positions again from the target's hidden states before any MTP row reads them.

use super::owned_step::OwnedStep;
use crate::step::Sampled;
use kvflow_kernels::cpu::sampling::finite_argmax;
use kvflow_kernels::models::mtp::{MtpActs, MtpOutput};
use kvflow_kernels::models::{LogitsWanted, Model, ModelCache, SeqInput};

/// One sequence's part of pass 0: the successor tokens of its positions from `start_pos`, their
/// hidden rows, and which of the step's `Sampled` (if any) it proposes for.
struct MtpRows {
    seq: usize,
    successors: Vec<u32>,
    start_pos: usize,
    hidden: Vec<f32>,
    proposes: Option<usize>,
}

/// A chained draft in progress: the part it continues, the position its row writes, the draft
/// it feeds and the hidden row it feeds back.
struct Chain {
    part: usize,
    at: usize,
    draft: u32,
    hidden: Vec<f32>,
}

/// The drafting of one step, pass by pass.
pub(super) struct MtpDrafting {
    k: usize,
    parts: Vec<MtpRows>,
    chains: Vec<Chain>,
    /// The pass to run next.
    pass: usize,
}

impl MtpDrafting {
    /// The drafting of `step`, whose forward gave `out_hidden` (every row's final-normed hidden
    /// state) and whose sampling gave `sampled`; `k` drafts at most.
    pub(super) fn new(step: &OwnedStep, out_hidden: &[f32], sampled: &[Sampled], d: usize, k: usize) -> Self {
        let mut parts = Vec::new();
        let mut first_row = 0;
        for (i, s) in step.seqs.iter().enumerate() {
            let fed = &step.tokens[s.tokens.clone()];
            let here = first_row;
            first_row += fed.len();
            let proposes = sampled.iter().position(|x| x.seq == s.key);
            let Some(successors) = successors(fed, s.drafts, proposes.map(|j| &sampled[j]), s.next_prompt_token) else {
                continue;
            };
            let hidden = out_hidden[here * d..(here + successors.len()) * d].to_vec();
            parts.push(MtpRows { seq: i, successors, start_pos: s.start_pos, hidden, proposes });
        }
        MtpDrafting { k, parts, chains: Vec::new(), pass: 0 }
    }

    /// Passes every rank runs (expert parallel): `k`.
    pub(super) fn passes(&self) -> usize {
        self.k
    }

    /// Starts the next pass: its rows through the MTP layer up to its experts.
    pub(super) fn begin_pass(&mut self, model: &Model, step: &OwnedStep, cache: &mut ModelCache) -> MtpActs {
        let mtp = model.mtp().expect("drafting runs on a model with an MTP layer");
        let bs = cache.kv.block_size();
        let table = |seq: usize| &step.tables[step.seqs[seq].table.clone()];
        if self.pass == 0 {
            let batch: Vec<SeqInput> = self
                .parts
                .iter()
                .map(|p| SeqInput {
                    tokens: &p.successors,
                    start_pos: p.start_pos,
                    block_table: table(p.seq),
                    slot: None,
                    prompt_len: step.seqs[p.seq].prompt_len,
                    logits: if p.proposes.is_some() { LogitsWanted::Last } else { LogitsWanted::None },
                })
                .collect();
            let hidden: Vec<f32> = self.parts.iter().flat_map(|p| p.hidden.iter().copied()).collect();
            return mtp.begin(model.embeddings(), &batch, &hidden, cache);
        }
        // A chained row writes where the step's blocks reach, or the chain stops.
        let parts = &self.parts;
        self.chains.retain(|c| table(parts[c.part].seq).len() * bs > c.at);
        let tokens: Vec<[u32; 1]> = self.chains.iter().map(|c| [c.draft]).collect();
        let batch: Vec<SeqInput> = self
            .chains
            .iter()
            .zip(&tokens)
            .map(|(c, token)| SeqInput {
                tokens: token,
                start_pos: c.at,
                block_table: table(parts[c.part].seq),
                slot: None,
                prompt_len: step.seqs[parts[c.part].seq].prompt_len,
                logits: LogitsWanted::Last,
            })
            .collect();
        let hidden: Vec<f32> = self.chains.iter().flat_map(|c| c.hidden.iter().copied()).collect();
        mtp.begin(model.embeddings(), &batch, &hidden, cache)
    }

    /// Ends the pass begun last: each proposing row's draft goes into `sampled` and chains on.
    pub(super) fn end_pass(&mut self, out: MtpOutput, sampled: &mut [Sampled], d: usize) {
        let mut chains = Vec::new();
        if self.pass == 0 {
            let mut row = 0;
            for (b, p) in self.parts.iter().enumerate() {
                row += p.successors.len();
                let Some(j) = p.proposes else { continue };
                let Some(draft) = out.logits.last(b).and_then(finite_argmax) else { continue };
                sampled[j].drafts.push(draft);
                let at = p.start_pos + p.successors.len(); // the position after the last one run
                chains.push(Chain { part: b, at, draft, hidden: out.hidden[(row - 1) * d..row * d].to_vec() });
            }
        } else {
            for (c, chain) in self.chains.drain(..).enumerate() {
                let Some(draft) = out.logits.last(c).and_then(finite_argmax) else { continue };
                let j = self.parts[chain.part].proposes.expect("chains are proposing sequences");
                sampled[j].drafts.push(draft);
                let hidden = out.hidden[c * d..(c + 1) * d].to_vec();
                chains.push(Chain { part: chain.part, at: chain.at + 1, draft, hidden });
            }
        }
        self.chains = chains;
        self.pass += 1;
    }

    /// Whether a later pass has rows on this rank (without expert parallelism, the passes stop
    /// when none has).
    fn has_work(&self) -> bool {
        if self.pass == 0 {
            !self.parts.is_empty()
        } else {
            !self.chains.is_empty()
        }
    }
}

/// The successor tokens of a sequence's fed positions, which the MTP layer runs over: the tokens
/// that hold at the fed positions after the first, then the one after the last of them — the
/// drafts that hold by the rule `verify` applies to the same scores (`kept_drafts`: the layer must
/// run on what holds, in this step) and the last token that holds, or for a sequence that did not
/// sample, the prompt's next token. `None`: nothing to run (a non-finite sample, or no successor).
pub(super) fn successors(
    fed: &[u32],
    drafts: usize,
    sampled: Option<&Sampled>,
    next_prompt_token: Option<u32>,
) -> Option<Vec<u32>> {
    let (valid, next) = match sampled {
        Some(x) => (fed.len() - drafts + x.kept_drafts().min(drafts), x.last_verified()),
        None => (fed.len(), next_prompt_token),
    };
    let mut successors = fed[1..valid].to_vec();
    match next {
        Some(next) => successors.push(next),
        None if sampled.is_some() => return None,
        None => {}
    }
    (!successors.is_empty()).then_some(successors)
}

/// Every pass of `step`'s drafting on this rank alone (no expert parallelism).
pub(super) fn propose(
    model: &Model,
    cache: &mut ModelCache,
    step: &OwnedStep,
    out_hidden: &[f32],
    sampled: &mut [Sampled],
    k: usize,
) {
    let Some(mtp) = model.mtp() else { return };
    let d = model.hidden_size;
    let mut drafting = MtpDrafting::new(step, out_hidden, sampled, d, k);
    while drafting.pass < drafting.passes() && drafting.has_work() {
        let acts = drafting.begin_pass(model, step, cache);
        let out = mtp.finish_local(acts);
        drafting.end_pass(out, sampled, d);
    }
}

/// The draft passes an expert-parallel rank runs after its model's MoE layers: `mtp_drafts` when
/// the model's MTP layer is a MoE block (its experts spread over the ranks), else 0 (a dense MTP
/// layer drafts on each rank alone, after sampling).
pub fn draft_passes(model: &Model, expert_parallel: bool, mtp_drafts: usize) -> usize {
    let moe = model.mtp().is_some_and(|m| m.num_experts() > 0);
    if expert_parallel && moe {
        mtp_drafts
    } else {
        0
    }
}

/// Expert parallel: a step's sampling, done before its draft passes, and the pass in progress.
pub(super) struct Drafting {
    pub(super) sampled: Vec<Sampled>,
    pub(super) mtp: MtpDrafting,
    pub(super) acts: Option<MtpActs>,
    /// A draft pass lost an expert result: its drafts are dropped (they only propose, so no
    /// request fails).
    pub(super) lost: bool,
}

impl Drafting {
    pub(super) fn into_sampled(mut self) -> Vec<Sampled> {
        if self.lost {
            self.sampled.iter_mut().for_each(|s| s.drafts.clear());
        }
        self.sampled
    }
}

/// The rows the draft pass in progress routed, and the MTP layer's expert count.
pub(super) fn routed<'a>(
    model: &'a Model,
    drafting: Option<&'a Drafting>,
) -> Option<(kvflow_kernels::models::RoutedRows<'a>, usize)> {
    let mtp = model.mtp()?;
    let acts = drafting?.acts.as_ref()?;
    Some((mtp.routed(acts, model.num_layers())?, mtp.num_experts()))
}
