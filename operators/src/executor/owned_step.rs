//! A step's launch copied out of the rank's state (`OwnedStep`): what an executor that runs a
//! step later, or in phases, keeps of it — flat token and block-table buffers, one range each
//! per sequence.

use crate::step::{KvExport, KvImport, SeqKey, StateOp, StepLaunch};
use kvflow_kernels::cpu::sampling::Sampler;
use kvflow_kernels::kv::SlotId;
use kvflow_kernels::models::{LogitsWanted, SeqInput};
use std::ops::Range;

/// One sequence of an [`OwnedStep`]: ranges into its flat token and block-table buffers.
#[derive(Clone, Debug)]
pub(super) struct OwnedSeq {
    pub(super) key: SeqKey,
    pub(super) tokens: Range<usize>,
    /// The step whose sample fills the last token of `tokens`.
    pub(super) deferred: Option<u64>,
    pub(super) start_pos: usize,
    pub(super) table: Range<usize>,
    pub(super) slot: Option<SlotId>,
    pub(super) prompt_len: usize,
    pub(super) sample: bool,
    /// Drafts at the end of `tokens`, to verify.
    pub(super) drafts: usize,
    pub(super) sampler: Sampler,
    pub(super) next_prompt_token: Option<u32>,
}

/// A launch copied out of the rank's state, so it can run after the rank has moved on.
#[derive(Clone, Debug)]
pub struct OwnedStep {
    pub(super) step: u64,
    pub(super) before: Vec<StateOp>,
    pub(super) after: Vec<StateOp>,
    pub(super) seqs: Vec<OwnedSeq>,
    pub(super) tokens: Vec<u32>,
    pub(super) tables: Vec<u32>,
    pub(super) applied_through: Option<u64>,
    pub(super) imports: Vec<KvImport>,
    pub(super) exports: Vec<KvExport>,
}

impl OwnedStep {
    pub fn copy_of(launch: &StepLaunch<'_>) -> Self {
        let (mut tokens, mut tables) = (Vec::new(), Vec::new());
        let seqs = launch
            .seqs()
            .map(|s| {
                let t0 = tokens.len();
                tokens.extend_from_slice(s.known);
                if s.deferred.is_some() {
                    tokens.push(u32::MAX); // resolved when the step runs
                }
                tokens.extend_from_slice(s.drafts);
                let b0 = tables.len();
                tables.extend_from_slice(s.block_table);
                OwnedSeq {
                    key: s.key,
                    tokens: t0..tokens.len(),
                    deferred: s.deferred,
                    start_pos: s.start_pos,
                    table: b0..tables.len(),
                    slot: s.slot,
                    prompt_len: s.prompt_len,
                    sample: s.sample,
                    drafts: s.drafts.len(),
                    sampler: s.sampler,
                    next_prompt_token: s.next_prompt_token,
                }
            })
            .collect();
        OwnedStep {
            step: launch.step,
            before: launch.before.to_vec(),
            after: launch.after.to_vec(),
            seqs,
            tokens,
            tables,
            applied_through: launch.applied_through,
            imports: launch.imports.to_vec(),
            exports: launch.exports.to_vec(),
        }
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    /// The model's view of the batch.
    pub(super) fn batch(&self) -> Vec<SeqInput<'_>> {
        self.seqs
            .iter()
            .map(|s| SeqInput {
                tokens: &self.tokens[s.tokens.clone()],
                start_pos: s.start_pos,
                block_table: &self.tables[s.table.clone()],
                slot: s.slot,
                prompt_len: s.prompt_len,
                logits: match (s.sample, s.drafts) {
                    (false, _) => LogitsWanted::None,
                    (true, 0) => LogitsWanted::Last,
                    (true, _) => LogitsWanted::All, // a row after the last known token and each draft
                },
            })
            .collect()
    }
}
