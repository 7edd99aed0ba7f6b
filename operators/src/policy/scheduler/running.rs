//! Booking the running requests' work for a step, oldest first: first every decode (one token,
//! or the last token and its drafts), then the prefill chunks. When a chunk finds no blocks, the
//! youngest running request is preempted (it gives its memory back and recomputes later) until
//! the chunk fits or the request itself was the youngest.

use super::{
    book,
    draft::{draft_into, drafts_next},
    RankMemory, Scheduler, Sequence, Sequences, StepDecision,
};

impl Scheduler {
    /// Books the decodes of the running requests (those with exactly one token left to feed),
    /// oldest first, while `budget` lasts. Returns the requests with more than one token left
    /// (prefilling), in the same order, for [`Scheduler::book_prefill_chunks`].
    pub(super) fn book_decodes(
        &mut self,
        seqs: &mut Sequences,
        mem: &mut RankMemory,
        t: u64,
        budget: &mut usize,
        out: &mut StepDecision,
    ) -> Vec<usize> {
        let mut prefilling = Vec::new();
        let mut i = 0;
        while *budget > 0 {
            let Some(&index) = self.running.get(i) else { break };
            i += 1;
            let seq = seqs.get_mut(index);
            let remaining = seq.remaining();
            // With a drafter, a decode whose token is still in flight waits for it, so the drafter
            // can propose from it (an executor that completes later would otherwise always have
            // one in flight, and never draft) — unless at its recent acceptance it would draft
            // nothing: then it decodes on with its token in flight, at plain decoding's pace.
            if let Some(spec) = self.config.spec {
                if !seq.pending.is_empty() && seq.computed >= seq.prompt_len && drafts_next(seq, &spec) {
                    continue;
                }
            }
            if remaining != 1 {
                if remaining > 1 {
                    prefilling.push(index);
                }
                continue;
            }
            // The hot path, taken here without a call: a plain decode (no drafts being verified,
            // no drafter) whose token fits the blocks it holds. Everything else books below.
            if self.config.spec.is_none() && seq.spec.drafts.is_empty() && fits_held_blocks(seq, mem) {
                book(out, index, seq, 1, t);
                *budget -= 1;
                continue;
            }
            self.book_running(index, seqs, mem, t, budget, out);
            // Preemptions pop the youngest: what is left to visit may have shrunk.
            i = i.min(self.running.len());
        }
        prefilling
    }

    /// Books the next chunk of each request in `prefilling` that is still running (a decode may
    /// have preempted it), in order, while `budget` lasts.
    pub(super) fn book_prefill_chunks(
        &mut self,
        prefilling: &[usize],
        seqs: &mut Sequences,
        mem: &mut RankMemory,
        t: u64,
        budget: &mut usize,
        out: &mut StepDecision,
    ) {
        for &index in prefilling {
            if *budget == 0 {
                break;
            }
            if self.running.contains(&index) {
                self.book_running(index, seqs, mem, t, budget, out);
            }
        }
    }

    /// Books running request `index`'s chunk: a decode with drafts when speculative decoding
    /// has them, a plain decode when its token fits the blocks it holds, else a chunk of up to
    /// `chunk_tokens` for which blocks are found, preempting the youngest running requests.
    fn book_running(
        &mut self,
        index: usize,
        seqs: &mut Sequences,
        mem: &mut RankMemory,
        t: u64,
        budget: &mut usize,
        out: &mut StepDecision,
    ) {
        let bs = mem.layout.block_size;
        let seq = seqs.get_mut(index);
        let remaining = seq.remaining();
        if !seq.spec.drafts.is_empty() {
            return; // its drafts are being verified: where it goes on is not known yet
        }
        if remaining == 1 && *budget > 1 {
            if let Some(spec) = self.config.spec {
                let fed = draft_into(seq, mem, spec, *budget - 1);
                if fed > 1 {
                    book(out, index, seq, fed, t);
                    *budget -= fed;
                    return;
                }
            }
        }
        // The common case: a decode whose next token fits in the blocks it holds.
        if remaining == 1 && fits_held_blocks(seq, mem) {
            book(out, index, seq, 1, t);
            *budget -= 1;
            return;
        }
        let len = self.chunk_len(seq, *budget, bs);
        loop {
            let seq = seqs.get_mut(index);
            if mem.ensure_blocks(seq, seq.computed + len) {
                book(out, index, seq, len, t);
                *budget -= len;
                return;
            }
            // Out of blocks: the youngest running request gives its memory back.
            let victim = self.running.pop().expect("this request is running");
            *budget += self.preempt(victim, seqs, mem, out);
            if victim == index {
                return;
            }
        }
    }
}

/// Whether `seq`'s next token fits in the blocks it holds (always, for a rank that keeps no KV).
#[inline]
fn fits_held_blocks(seq: &Sequence, mem: &RankMemory) -> bool {
    !mem.layout.keeps_kv || seq.computed < seq.blocks.len() * mem.layout.block_size
}
