//! Speculative decoding in the schedule: which drafts a decode carries (`propose_into` fills a
//! sequence's proposal; `draft_into` books it at the width its recent acceptance earns, with
//! blocks for every position), and which chunks the drafter needs the sampled token of.

use super::{RankMemory, Scheduler, Sequence, Sequences, StepDecision};

/// Speculative decoding: a decoding sequence with nothing in flight feeds its last token and up
/// to `draft_tokens` drafts, which the step verifies (the width is fixed here, when the blocks
/// for it are reserved; nothing later may widen it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecConfig {
    pub draft_tokens: usize,
    pub drafter: crate::policy::drafter::Drafter,
    /// Test switch `widen_draft_buckets`: bucketing rounds a request's width up to a bucket,
    /// past what the scheduler fixed for it (removes "scheduled width").
    pub widen_buckets: bool,
}

impl SpecConfig {
    /// The widths a decode may draft at: powers of two up to `draft_tokens`, and it (for 4:
    /// 1, 2, 4).
    pub fn buckets(&self) -> impl Iterator<Item = usize> + '_ {
        (0..).map(|i| 1usize << i).take_while(|&w| w < self.draft_tokens).chain([self.draft_tokens])
    }

    /// Dynamic width from recent acceptance (`recent`: the share of its drafts a request's last
    /// verifications kept): the largest bucket within `limit` (what the request can still use)
    /// that is at most about what it would keep — 0 when it keeps next to nothing. Never more
    /// than `limit`: bucketing only shrinks.
    pub fn width(&self, recent: f32, limit: usize) -> usize {
        let want = (recent * self.draft_tokens as f32).ceil() as usize;
        if recent * (self.draft_tokens as f32) < 0.5 {
            return 0;
        }
        if self.widen_buckets {
            return self.buckets().find(|&w| w >= want.min(limit).max(1)).unwrap_or(self.draft_tokens);
        }
        self.buckets().filter(|&w| w <= want.max(1).min(limit)).max().unwrap_or(0)
    }
}

impl Scheduler {
    /// Marks the chunks whose sampled token the drafter needs as soon as it is known: with
    /// drafting on, a prefill-only request's chunk that samples T0 (`Chunk::drafter_successors`).
    pub fn mark_drafter_successors(&self, seqs: &Sequences, out: &mut StepDecision) {
        if self.config.spec.is_none() {
            return;
        }
        for c in &mut out.chunks {
            c.drafter_successors = c.sample && seqs.get(c.seq).kind.is_producer();
        }
    }
}

/// Drafts a decode may still feed: up to `spec.draft_tokens`, within the outputs it has left
/// (its last output is never a draft) and not counting tokens in flight.
fn draft_limit(seq: &Sequence, spec: &SpecConfig) -> usize {
    let outputs_left = seq.max_output_tokens.saturating_sub(seq.output_len() + seq.pending.len());
    spec.draft_tokens.min(outputs_left.saturating_sub(1))
}

/// Whether `seq`'s next decode would draft at its recent acceptance (else it decodes plainly,
/// and need not wait for a token in flight for the drafter to see it).
pub(super) fn drafts_next(seq: &Sequence, spec: &SpecConfig) -> bool {
    spec.width(seq.spec.draft_acceptance, draft_limit(seq, spec)) > 0
}

/// A decode that drafted nothing for keeping next to nothing: hope returns slowly, so it tries
/// again.
fn hope(seq: &mut Sequence) {
    seq.spec.draft_acceptance = (seq.spec.draft_acceptance + 0.05).min(1.0);
}

/// `propose(t)` for one sequence: when it decodes next with nothing in flight and has nothing
/// proposed, the drafter's proposal after its last token (`draft_limit` tokens at most) goes
/// into `seq.proposed`, for the scheduler to book at the width it earns. Returns how many.
pub fn propose_into(seq: &mut Sequence, spec: &SpecConfig) -> usize {
    let decodes = seq.computed >= seq.prompt_len && !seq.kind.is_producer() && !seq.kind.awaits_import();
    let idle = seq.pending.is_empty() && seq.spec.drafts.is_empty() && seq.spec.proposed.is_empty();
    if !decodes || !idle || seq.remaining() != 1 || seq.finished() {
        return 0;
    }
    let limit = draft_limit(seq, spec);
    if limit > 0 {
        spec.drafter.propose(&seq.tokens, &seq.spec.model_drafts, limit, &mut seq.spec.proposed);
    }
    seq.spec.proposed.len()
}

/// A decode with nothing in flight: books the drafts `propose` made for it at the width its
/// recent acceptance earns (`SpecConfig::width`, within `spec.draft_tokens`, the outputs it has
/// left and `room` tokens of the step's budget — the proposal's first ones: a shorter proposal
/// is its prefix) and reserves blocks for the last token and all of them. Returns the tokens the
/// chunk feeds (1 when it drafts nothing: no blocks for them, or no proposal); the drafts are in
/// `seq.drafts`.
pub(super) fn draft_into(seq: &mut Sequence, mem: &mut RankMemory, spec: SpecConfig, room: usize) -> usize {
    let limit = draft_limit(seq, &spec).min(room);
    let mut drafts = std::mem::take(&mut seq.spec.proposed);
    if !seq.pending.is_empty() || seq.computed < seq.prompt_len {
        if !seq.pending.is_empty() && !drafts_next(seq, &spec) {
            hope(seq); // a decode with its token in flight, not drafting (see `drafts_next`)
        }
        return 1;
    }
    if seq.kind.awaits_import() {
        // A handed-off request's first decode: T0 and the producer's drafts made from it, at
        // full width (the drafter that made them saw what this rank's may not: with MTP, the
        // producer's last hidden state).
        drafts = std::mem::take(&mut seq.spec.handed_drafts);
        drafts.truncate(limit);
        if !drafts.is_empty() && !mem.ensure_blocks(seq, seq.computed + 1 + drafts.len()) {
            drafts.clear();
        }
        seq.spec.drafts = drafts;
        return 1 + seq.spec.drafts.len();
    }
    let width = spec.width(seq.spec.draft_acceptance, limit);
    if width == 0 {
        hope(seq);
        return 1;
    }
    drafts.truncate(width);
    // Blocks for every position the chunk writes; without them it decodes plainly (a draft never
    // preempts anyone).
    if drafts.is_empty() || !mem.ensure_blocks(seq, seq.computed + 1 + drafts.len()) {
        drafts.clear();
    }
    seq.spec.drafts = drafts;
    1 + seq.spec.drafts.len()
}
