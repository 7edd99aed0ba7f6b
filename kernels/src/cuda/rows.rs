//! A step's rows as the kernels read them: [`StepRows`] built on the host (tokens, positions,
//! sequences, block tables, sampling rows, state slots, prompt lengths), packed into one array
//! whose parts sit at the same offsets in every step of a [`StepShape`], and where each part lands
//! on the device ([`RowsOnDevice`]).

use crate::cpu::sampling::Sampler;

/// The high bit of a fed token: the rest is a slot of the sampled-token ring.
pub const FROM_RING: u32 = 0x8000_0000;

/// u32 words of one sampled row in a step's results: token, finite flag, hash low, hash high.
pub const RESULT_WORDS: usize = 4;

/// u32 words of one sampled row's draw (`sample_drawn` in `kernels/cuda/model.cu`): temperature
/// (f32 bits), top-k, top-p (f32 bits), then the key's seed, request id and position (u64 each,
/// low word first), then the draft the row checks ([`NO_DRAFT`]: none). Temperature 0: greedy.
pub const DRAW_WORDS: usize = 10;

/// A sampling row that checks no draft.
pub const NO_DRAFT: u32 = u32::MAX;

/// The draw words of a greedy row that checks no draft.
const GREEDY_DRAW: [u32; DRAW_WORDS] = [0, 0, 0, 0, 0, 0, 0, 0, 0, NO_DRAFT];

/// A step's rows as the kernels read them (host side; uploaded as one array).
#[derive(Clone, Debug, Default)]
pub struct StepRows {
    /// Per row: a token id, or `FROM_RING | slot`.
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    /// Per row: the sequence it belongs to.
    pub seqs: Vec<u32>,
    /// Per row: the cache row its own key and value go to.
    pub write_rows: Vec<u32>,
    /// Every sequence's block table, one after another.
    pub tables: Vec<u32>,
    /// Per sequence: where its table starts in `tables`.
    pub table_at: Vec<u32>,
    /// Rows that sample, and the ring slot each one's token goes to.
    pub logit_rows: Vec<u32>,
    pub ring_slots: Vec<u32>,
    /// Per sampling row: how it draws ([`DRAW_WORDS`] words).
    pub draws: Vec<u32>,
    /// Per sequence: its first row (its rows are contiguous, in position order) and its state
    /// slot ([`NO_SLOT`]: none).
    pub row_at: Vec<u32>,
    pub slots: Vec<u32>,
    /// Per sequence: the first row of the device state's kept states its slot's state after
    /// each of its rows goes to (a verification, for a rollback), or [`NO_SLOT`].
    pub keeps: Vec<u32>,
    /// Per sequence: its request's prompt length (DeepSeek-V3.2's indexer ranks a prompt row's
    /// keys in a row as long as the prompt; see `kernels/cuda/indexer.cu`).
    pub prompt_lens: Vec<u32>,
}

/// The sizes a step's launches are built from. Two steps of one shape enqueue the same launches
/// with the same arguments when their rows sit at the same device addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StepShape {
    pub rows: usize,
    pub seqs: usize,
    pub sampled: usize,
    /// The longest index row: attention cuts keys into `index_row / KEY_SPLIT` parts (rounded
    /// up), DeepSeek-V3.2's indexer scores rows this long.
    pub index_row: usize,
    /// Some row draws with a temperature (`sample_drawn`; else every row takes its argmax).
    pub drawn: bool,
}

impl StepShape {
    /// Attention's key parts for this shape.
    pub fn key_parts(&self) -> usize {
        self.index_row.div_ceil(KEY_SPLIT).max(1)
    }
}

/// `paged_attention` (`kernels/cuda/model.cu`) cuts a row's keys into parts of this many, merged
/// by `attention_merge`: a shape's key parts ([`StepShape::key_parts`]).
pub(super) const KEY_SPLIT: usize = 64;

/// A sequence without a state slot.
pub const NO_SLOT: u32 = u32::MAX;

/// Device addresses of an uploaded [`StepRows`].
#[derive(Clone, Copy, Debug, Default)]
pub struct RowsOnDevice {
    pub(super) tokens: u64,
    pub(super) positions: u64,
    pub(super) seqs: u64,
    pub(super) write_rows: u64,
    pub(super) tables: u64,
    pub(super) table_at: u64,
    pub(super) logit_rows: u64,
    pub(super) ring_slots: u64,
    pub(super) draws: u64,
    pub(super) row_at: u64,
    pub(super) slots: u64,
    pub(super) keeps: u64,
    pub(super) prompt_lens: u64,
}

impl StepRows {
    /// Adds a sequence: its fed tokens (ring-encoded where in flight) from `start_pos`, its block
    /// table, and the ring slot of its sample if it samples. Its prompt is taken to end with
    /// these tokens unless [`StepRows::prompt_len`] says otherwise (a prompt fed in chunks).
    pub fn push_seq(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        table: &[u32],
        block_size: usize,
        sample: Option<u32>,
    ) -> &mut Self {
        self.push_seq_sampling(tokens, start_pos, table, block_size, sample.as_slice())
    }

    /// [`StepRows::push_seq`] whose last `ring_slots.len()` rows each sample (a sequence that
    /// verifies drafts: the row after its last known token and after each draft), in row order.
    pub fn push_seq_sampling(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        table: &[u32],
        block_size: usize,
        ring_slots: &[u32],
    ) -> &mut Self {
        let seq = self.table_at.len() as u32;
        self.table_at.push(self.tables.len() as u32);
        self.tables.extend_from_slice(table);
        self.row_at.push(self.tokens.len() as u32);
        self.slots.push(NO_SLOT);
        self.keeps.push(NO_SLOT);
        self.prompt_lens.push((start_pos + tokens.len()) as u32);
        for (i, &t) in tokens.iter().enumerate() {
            let pos = start_pos + i;
            self.tokens.push(t);
            self.positions.push(pos as u32);
            self.seqs.push(seq);
            // A family without paged KV has no table: nothing is written.
            let row = table.get(pos / block_size).map_or(0, |b| b * block_size as u32 + (pos % block_size) as u32);
            self.write_rows.push(row);
        }
        let end = self.tokens.len() as u32;
        for (k, &slot) in ring_slots.iter().enumerate() {
            self.logit_rows.push(end - (ring_slots.len() - k) as u32);
            self.ring_slots.push(slot);
            self.draws.extend_from_slice(&GREEDY_DRAW);
        }
        self
    }

    /// Has the sampling row pushed last draw with `sampler`'s parameters and key, for the token
    /// at `position` (nothing changes for a greedy sampler).
    pub fn drawn_by(&mut self, sampler: &Sampler, position: usize) -> &mut Self {
        let rows = self.sampled();
        self.row_drawn_by(rows.saturating_sub(1), sampler, position)
    }

    /// Has sampling row `row` draw with `sampler`'s parameters and key, for the token at
    /// `position` (nothing changes for a greedy sampler).
    pub fn row_drawn_by(&mut self, row: usize, sampler: &Sampler, position: usize) -> &mut Self {
        let (params, at) = (sampler.sampling.params, row * DRAW_WORDS);
        if sampler.is_greedy() || at >= self.draws.len() {
            return self;
        }
        let (seed, request, position) = (sampler.sampling.seed, sampler.request_id, position as u64);
        let words = [
            params.temperature.to_bits(),
            params.top_k.min(u32::MAX as usize) as u32,
            params.top_p.to_bits(),
            seed as u32,
            (seed >> 32) as u32,
            request as u32,
            (request >> 32) as u32,
            position as u32,
            (position >> 32) as u32,
        ];
        self.draws[at..at + DRAW_WORDS - 1].copy_from_slice(&words);
        self
    }

    /// Has sampling row `row` check `draft` (the speculative-sampling rule when it draws; a
    /// greedy row's check is its argmax, made on the host).
    pub fn row_checks_draft(&mut self, row: usize, draft: u32) -> &mut Self {
        if let Some(word) = self.draws.get_mut(row * DRAW_WORDS + DRAW_WORDS - 1) {
            *word = draft;
        }
        self
    }

    /// Gives the sequence pushed last the state slot `slot`.
    pub fn in_slot(&mut self, slot: u32) -> &mut Self {
        if let Some(last) = self.slots.last_mut() {
            *last = slot;
        }
        self
    }

    /// Has sequence `seq` keep its slot's state after each of its rows, from kept row `first`
    /// on (`DeviceState::track_rows`).
    pub fn keeps_states(&mut self, seq: usize, first: u32) -> &mut Self {
        if let Some(k) = self.keeps.get_mut(seq) {
            *k = first;
        }
        self
    }

    /// Gives the sequence pushed last a prompt of `len` tokens.
    pub fn prompt_len(&mut self, len: usize) -> &mut Self {
        if let Some(last) = self.prompt_lens.last_mut() {
            *last = len as u32;
        }
        self
    }

    /// What the host side of [`DeviceModel::enqueue_step`] reads of these rows: every launch's
    /// grid, scalar and scratch size follows from it (the rest is read on the device).
    pub fn shape(&self) -> StepShape {
        StepShape {
            rows: self.rows(),
            seqs: self.num_seqs(),
            sampled: self.sampled(),
            index_row: self.index_row_len(),
            drawn: self.draws.chunks(DRAW_WORDS).any(|d| d[0] != 0),
        }
    }

    /// Words of the packed rows before the tables (fixed by the shape).
    pub fn words_before_tables(&self) -> usize {
        self.words() - self.tables.len()
    }

    /// The longest index row of the step (the indexer's scores per row): max(prompt length,
    /// position + 1) over the rows.
    fn index_row_len(&self) -> usize {
        let seq_len = |r: usize| self.prompt_lens[self.seqs[r] as usize] as usize;
        (0..self.rows()).map(|r| seq_len(r).max(self.positions[r] as usize + 1)).max().unwrap_or(0)
    }

    pub fn rows(&self) -> usize {
        self.tokens.len()
    }

    /// How many rows sequence `seq` has.
    pub fn seq_rows(&self, seq: usize) -> usize {
        let end = self.row_at.get(seq + 1).map_or(self.rows(), |&r| r as usize);
        end - self.row_at[seq] as usize
    }

    pub fn num_seqs(&self) -> usize {
        self.row_at.len()
    }

    pub fn sampled(&self) -> usize {
        self.logit_rows.len()
    }

    /// The parts in the order they are packed: every part's length is fixed by the step's
    /// shape except the tables', which go last, so a captured step (`graph.rs`) finds each part
    /// at the same address in every step of its shape.
    fn parts(&self) -> [&[u32]; 13] {
        [
            &self.tokens,
            &self.positions,
            &self.seqs,
            &self.write_rows,
            &self.table_at,
            &self.logit_rows,
            &self.ring_slots,
            &self.draws,
            &self.row_at,
            &self.slots,
            &self.keeps,
            &self.prompt_lens,
            &self.tables,
        ]
    }

    /// Words the rows take packed.
    pub fn words(&self) -> usize {
        self.parts().iter().map(|p| p.len()).sum()
    }

    /// Packs the rows into `out` (at least [`StepRows::words`] long) and returns where each part
    /// will sit once `out` is copied to device address `base`.
    pub fn pack(&self, out: &mut [u32], base: u64) -> RowsOnDevice {
        let mut at = 0;
        let mut addr = [0u64; 13];
        for (i, part) in self.parts().iter().enumerate() {
            out[at..at + part.len()].copy_from_slice(part);
            addr[i] = base + 4 * at as u64;
            at += part.len();
        }
        RowsOnDevice {
            tokens: addr[0],
            positions: addr[1],
            seqs: addr[2],
            write_rows: addr[3],
            table_at: addr[4],
            logit_rows: addr[5],
            ring_slots: addr[6],
            draws: addr[7],
            row_at: addr[8],
            slots: addr[9],
            keeps: addr[10],
            prompt_lens: addr[11],
            tables: addr[12],
        }
    }
}
