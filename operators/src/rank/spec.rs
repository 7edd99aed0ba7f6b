//! Speculative decoding's side of a rank (DESIGN §10): `verify(t)`'s decision on a step that fed
//! drafts, and `propose(t)`'s drafts for the next one.
//!
//! - Verify: the executor scored every draft (`Sampled::checks`); the drafts that hold are the
//!   leading run it kept (`Sampled::kept_drafts`). They count as computed, the request's recent
//!   acceptance follows them, and when one was rejected the sequence asks its next launch to set
//!   its state slot back to the copy kept after its last token that held (`Sequence::rewind_to`,
//!   launched as `StateOp::Rewind`): rejected drafts leave no trace in recurrent or conv state.
//! - Propose: every sequence that decodes next with nothing in flight gets the drafter's
//!   proposal after its last token (`propose_into`), which the scheduler books at the width it
//!   earns. A producer's request proposes from T0 as T0 lands, for its handoff
//!   (`draft_from_successor`): the handoff leaves then.

use super::Rank;
use crate::policy::scheduler::propose_into;
use crate::step::Sampled;

impl Rank {
    /// `verify`'s decision for the sequence at `index`, whose step fed `drafted` drafts and was
    /// scored as `scored`.
    pub(super) fn verify_drafts(&mut self, index: usize, drafted: usize, scored: &Sampled) {
        let keep_rejected_state = self.switches.keep_rejected_state;
        let seq = self.seqs.get_mut(index);
        let kept = scored.kept_drafts().min(drafted);
        seq.computed += kept;
        seq.spec.draft_acceptance = 0.5 * seq.spec.draft_acceptance + 0.5 * kept as f32 / drafted as f32;
        // The last token that holds was fed at `computed − 1`. With every draft kept the copy
        // equals the slot; it is asked for anyway, so the kept rows go with it.
        if seq.slot.is_some() && (kept == drafted || !keep_rejected_state) {
            seq.spec.rewind_to = Some(seq.computed - 1);
        }
        self.stats.spec.verify_steps += 1;
        self.stats.spec.drafted_tokens += drafted as u64;
        self.stats.spec.accepted_tokens += kept as u64;
    }

    /// `propose(t)`: drafts for every sequence that decodes next with nothing in flight and none
    /// proposed. Returns how many it proposed.
    pub fn propose(&mut self) -> usize {
        let Some(spec) = self.scheduler.config.spec else { return 0 };
        let proposed: usize = self.seqs.iter_mut().map(|seq| propose_into(seq, &spec)).sum();
        self.stats.spec.proposed_tokens += proposed as u64;
        proposed
    }

    /// A producer's request sampled T0: its drafter proposes from it now, for the handoff (the
    /// consumer's first decode verifies them at full width).
    pub(super) fn draft_from_successor(&mut self, index: usize) {
        let Some(spec) = self.scheduler.config.spec else { return };
        let seq = self.seqs.get_mut(index);
        // The consumer decodes outputs − 1 more tokens; its last one is never a draft.
        let room = seq.kind.producer().map_or(0, |p| p.handoff_outputs).saturating_sub(2).min(spec.draft_tokens);
        let mut drafts = std::mem::take(&mut seq.spec.handed_drafts);
        drafts.clear();
        if room > 0 {
            spec.drafter.propose(&seq.tokens, &seq.spec.model_drafts, room, &mut drafts);
        }
        self.stats.spec.handed_off_drafts += drafts.len() as u64;
        seq.spec.handed_drafts = drafts;
    }
}
