//! What one forward step computes: for each sequence, the tokens fed this step (a prefill chunk or
//! one decode token), where they start, the sequence's block table, and which logits to return.
//! Batch metadata is passed explicitly to every layer, never through a global.

use crate::kv::SlotId;
use std::ops::Range;

/// Which positions of a sequence's step need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    None,
    /// The last token fed (a decode step, or the chunk that ends a prompt).
    Last,
    /// Every token fed (verification of drafts, tests).
    All,
}

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; earlier positions are already in the cache.
    pub start_pos: usize,
    /// Blocks covering positions `0..start_pos + tokens.len()` (empty for families without KV).
    pub block_table: &'a [u32],
    /// The request's state slot (families with recurrent state; `None` otherwise).
    pub slot: Option<SlotId>,
    /// Length of the request's original prompt. DeepSeek-V3.2's indexer ranks a prompt row's keys
    /// in a row padded to this length, as transformers' prefill does (its top-k tie order depends
    /// on the padding); other families ignore it.
    pub prompt_len: usize,
    pub logits: LogitsWanted,
}

impl SeqInput<'_> {
    pub fn end_pos(&self) -> usize {
        self.start_pos + self.tokens.len()
    }
}

/// Logits of one step: rows of `vocab` floats, and which rows belong to which sequence.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    pub vocab: usize,
    pub logits: Vec<f32>,
    /// For sequence `i` of the batch, its rows of `logits` (position order).
    pub rows: Vec<Range<usize>>,
    /// Only when asked for ([`crate::models::Model::finish_step_keeping_hidden`]): every row's
    /// final-normed hidden state `[rows × hidden]`, in batch order (what an MTP drafter reads).
    pub hidden: Vec<f32>,
}

/// Which rows of a step want logits: per sequence its range in the wanted list, and the wanted
/// rows' indices in the step.
pub(crate) fn wanted_rows(batch: &[SeqInput]) -> (Vec<Range<usize>>, Vec<usize>) {
    let mut wanted = Vec::new();
    let mut rows = Vec::with_capacity(batch.len());
    let mut first_row = 0;
    for s in batch {
        let start = wanted.len();
        match s.logits {
            LogitsWanted::None => {}
            LogitsWanted::Last => wanted.push(first_row + s.tokens.len() - 1),
            LogitsWanted::All => wanted.extend(first_row..first_row + s.tokens.len()),
        }
        rows.push(start..wanted.len());
        first_row += s.tokens.len();
    }
    (rows, wanted)
}

impl ForwardOutput {
    /// The logits rows of sequence `i`.
    pub fn seq(&self, i: usize) -> impl Iterator<Item = &[f32]> {
        self.rows[i].clone().map(move |r| &self.logits[r * self.vocab..(r + 1) * self.vocab])
    }

    /// The last logits row of sequence `i`, if it asked for any.
    pub fn last(&self, i: usize) -> Option<&[f32]> {
        self.seq(i).last()
    }
}

/// Per-row facts every layer needs, computed once per step.
pub struct BatchLayout {
    /// Rows (tokens) in the step.
    pub rows: usize,
    /// Token position of each row.
    pub positions: Vec<usize>,
    /// Which sequence each row belongs to.
    pub seq_of_row: Vec<usize>,
    /// Per sequence, the cache row of every position `0..end_pos` (empty without paged KV).
    pub cache_rows: Vec<Vec<usize>>,
    /// Per sequence, its state slot.
    pub slots: Vec<Option<SlotId>>,
    /// Per sequence, its original prompt length.
    pub prompt_lens: Vec<usize>,
}

impl BatchLayout {
    pub fn new(batch: &[SeqInput], block_size: usize, paged: bool) -> Self {
        let mut positions = Vec::new();
        let mut seq_of_row = Vec::new();
        let mut cache_rows = Vec::with_capacity(batch.len());
        for (i, s) in batch.iter().enumerate() {
            positions.extend(s.start_pos..s.end_pos());
            seq_of_row.extend(std::iter::repeat_n(i, s.tokens.len()));
            cache_rows.push(if paged {
                (0..s.end_pos()).map(|p| s.block_table[p / block_size] as usize * block_size + p % block_size).collect()
            } else {
                Vec::new()
            });
        }
        BatchLayout {
            rows: positions.len(),
            positions,
            seq_of_row,
            cache_rows,
            slots: batch.iter().map(|s| s.slot).collect(),
            prompt_lens: batch.iter().map(|s| s.prompt_len).collect(),
        }
    }

    /// The cache row where row `r` writes its own key/value.
    pub fn write_row(&self, r: usize) -> usize {
        self.cache_rows[self.seq_of_row[r]][self.positions[r]]
    }

    /// The state slot of row `r`'s sequence (families with recurrent state always have one).
    pub fn slot(&self, r: usize) -> SlotId {
        self.slots[self.seq_of_row[r]].expect("a family with recurrent state needs a slot for every sequence")
    }

    /// The cache rows row `r` attends to: positions `max(0, p + 1 − window) ..= p`.
    pub fn visible_rows(&self, r: usize, window: Option<usize>) -> &[usize] {
        let p = self.positions[r];
        let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
        &self.cache_rows[self.seq_of_row[r]][lo..=p]
    }
}
