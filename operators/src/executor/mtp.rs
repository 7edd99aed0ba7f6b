//! The MTP drafter's pass, run by the CPU executor after a step's forward and sampling (DESIGN
//! §10): for each sequence, the MTP layer runs over every position the step fed whose successor
//! token is now known — the next token fed, the token sampled (or the last draft kept), or, for a
//! prompt chunk that ends before the prompt does, the prompt's next token — writing its own layer
//! of the paged cache; a sequence that sampled then chains the layer on its own output for up to
//! `k` drafts, handed back with the sampled token (`Sampled::drafts`). Drafts only propose: the
//! next step's verification keeps what the target agrees with, so outputs never depend on them.
//!
//! Chained positions write MTP KV past the last accepted token; the next step's pass writes those
//! positions again from the target's hidden states before any MTP row reads them.

use super::cpu::OwnedStep;
use crate::step::Sampled;
use kvflow_kernels::cpu::sampling::finite_argmax;
use kvflow_kernels::models::{LogitsWanted, Model, ModelCache, SeqInput};

/// One sequence's part of the pass: the successor tokens of its positions from `start_pos`, and
/// which of `sampled` (if any) it proposes for.
struct MtpRows {
    seq: usize,
    successors: Vec<u32>,
    start_pos: usize,
    /// Rows of the step's hidden state, `first..first + successors.len()`.
    first_row: usize,
    proposes: Option<usize>,
}

/// Runs the MTP pass over `step` (its forward gave `out_hidden`, every row's final-normed hidden
/// state) and puts up to `k` drafts into each sampling sequence's `Sampled::drafts`.
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
    let mut parts = Vec::new();
    let mut first_row = 0;
    for (i, s) in step.seqs.iter().enumerate() {
        let fed = &step.tokens[s.tokens.clone()];
        let rows = fed.len();
        let here = first_row;
        first_row += rows;
        let proposes = sampled.iter().position(|x| x.seq == s.key);
        // The tokens that now hold at the fed positions, then the one after the last of them.
        let (valid, next) = match proposes.map(|j| &sampled[j]) {
            Some(x) => {
                let kept = x.accepted.len().min(s.drafts);
                let last = x.accepted.last().map_or(x.token, |&(t, _)| t);
                (rows - s.drafts + kept, last)
            }
            None => (rows, s.next_prompt_token),
        };
        let mut successors: Vec<u32> = fed[1..valid].to_vec();
        if let Some(next) = next {
            successors.push(next);
        } else if proposes.is_some() {
            continue; // a non-finite sample: the request fails, nothing to draft
        }
        if successors.is_empty() {
            continue;
        }
        parts.push(MtpRows { seq: i, successors, start_pos: s.start_pos, first_row: here, proposes });
    }
    if parts.is_empty() {
        return;
    }
    let batch: Vec<SeqInput> = parts
        .iter()
        .map(|p| {
            let s = &step.seqs[p.seq];
            SeqInput {
                tokens: &p.successors,
                start_pos: p.start_pos,
                block_table: &step.tables[s.table.clone()],
                slot: None,
                prompt_len: s.prompt_len,
                logits: if p.proposes.is_some() && k > 0 { LogitsWanted::Last } else { LogitsWanted::None },
            }
        })
        .collect();
    let mut hidden = Vec::with_capacity(parts.iter().map(|p| p.successors.len()).sum::<usize>() * d);
    for p in &parts {
        hidden.extend_from_slice(&out_hidden[p.first_row * d..(p.first_row + p.successors.len()) * d]);
    }
    let first = mtp.forward(model.embeddings(), &batch, &hidden, cache);
    // Chains: (part, next position, last draft, its hidden row)
    let mut chains: Vec<(usize, usize, u32, Vec<f32>)> = Vec::new();
    let mut row = 0;
    for (b, p) in parts.iter().enumerate() {
        row += p.successors.len();
        let Some(j) = p.proposes.filter(|_| k > 0) else { continue };
        let Some(draft) = first.logits.last(b).and_then(finite_argmax) else { continue };
        sampled[j].drafts.push(draft);
        let at = p.start_pos + p.successors.len(); // the position after the last one run
        chains.push((b, at, draft, first.hidden[(row - 1) * d..row * d].to_vec()));
    }
    for _ in 1..k {
        // Only where the step's blocks cover the position the chained row writes.
        chains.retain(|(b, at, _, _)| {
            let s = &step.seqs[parts[*b].seq];
            step.tables[s.table.clone()].len() * cache.kv.block_size() > *at
        });
        if chains.is_empty() {
            break;
        }
        let tokens: Vec<[u32; 1]> = chains.iter().map(|c| [c.2]).collect();
        let batch: Vec<SeqInput> = chains
            .iter()
            .zip(&tokens)
            .map(|((b, at, _, _), token)| {
                let s = &step.seqs[parts[*b].seq];
                SeqInput {
                    tokens: token,
                    start_pos: *at,
                    block_table: &step.tables[s.table.clone()],
                    slot: None,
                    prompt_len: s.prompt_len,
                    logits: LogitsWanted::Last,
                }
            })
            .collect();
        let hidden: Vec<f32> = chains.iter().flat_map(|c| c.3.iter().copied()).collect();
        let next = mtp.forward(model.embeddings(), &batch, &hidden, cache);
        let mut still = Vec::with_capacity(chains.len());
        for (c, (b, at, _, _)) in chains.into_iter().enumerate() {
            let Some(draft) = next.logits.last(c).and_then(finite_argmax) else { continue };
            let j = parts[b].proposes.expect("chains are proposing sequences");
            sampled[j].drafts.push(draft);
            still.push((b, at + 1, draft, next.hidden[c * d..(c + 1) * d].to_vec()));
        }
        chains = still;
    }
}
