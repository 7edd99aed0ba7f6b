//! Conditional disaggregation on a decode rank (DESIGN §8, `[pool.disaggregation]`): a new
//! request is routed to a decode rank first (the decode pool's router weighs load and the prefix
//! each rank holds); that rank prefills it itself, or has a linked prefill pool do it and hand it
//! back to this very rank — remote only when the prompt's uncached length here exceeds
//! `remote_prefill_min_tokens` and the prefill pool's queue is under `max_prefill_queue` (the
//! rule of Dynamo's and llm-d's deciders). While a remote prefill is out the rank counts it in
//! flight (its pool neither parks nor ends); the handoff, a failure of the prefill, or a cancel
//! settles it.

use super::handoff_state::{RemotePrefill, RemotePrefills, CANCELLED_REMEMBERED};
use super::recent_set::RecentSet;
use super::Rank;
use crate::messages::{Admission, AdmissionKind, BackTo};
use crate::policy::sequence::Sequence;
use crate::transfer::pick_link;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Leaves a prefill pool's queue (once).
pub fn leave_queue(queue: &AtomicUsize) {
    let _ = queue.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
}

impl Rank {
    /// Makes this decode rank decide where its new requests are prefilled.
    pub fn with_remote_prefill(mut self, remote: RemotePrefill) -> Self {
        self.remote_prefill = Some(RemotePrefills {
            setup: remote,
            awaiting: HashMap::new(),
            cancelled: RecentSet::new(CANCELLED_REMEMBERED),
        });
        self
    }

    /// Remote prefills this rank asked for and has not received or seen fail.
    pub fn awaiting_prefills(&self) -> usize {
        self.remote_prefill.as_ref().map_or(0, |r| r.awaiting.len())
    }

    /// A new request at this decode rank: prefill it here (returns its sequence) or send it to
    /// a linked prefill pool (returns `None`; its handoff comes back to this rank).
    pub(super) fn decide(&mut self, a: Admission) -> Option<Sequence> {
        let seq = Sequence::new(a.id, a.prompt.clone(), a.max_output_tokens, a.warmup);
        let Some(remote) = self.remote_prefill.as_ref().map(|r| &r.setup).filter(|r| !r.targets.is_empty()) else {
            self.stats.local_prefills += 1;
            return Some(seq);
        };
        let cached = if self.scheduler.config.prefix_cache { self.memory.cached_prompt_tokens(&seq) } else { 0 };
        let uncached = seq.prompt_len - cached;
        let pick = pick_link(a.id, remote.targets.len());
        let target = &remote.targets[pick];
        let queued = target.queue.load(Ordering::SeqCst);
        let rule = remote.rule;
        let go_remote = uncached > rule.remote_prefill_min_tokens
            && rule.max_prefill_queue.is_none_or(|max| queued < max)
            && !target.ingress.is_closed();
        if !go_remote {
            self.stats.local_prefills += 1;
            return Some(seq);
        }
        target.queue.fetch_add(1, Ordering::SeqCst);
        let (link, rank) = (target.link, self.index as u32);
        // The prefix this rank holds stays held for the handoff, and is not sent.
        let skip_tokens = (self.memory.reserve_prefix(&seq) * self.memory.layout.block_size) as u32;
        let back_to = BackTo { link, rank, skip_tokens };
        let remote = self.remote_prefill.as_mut().expect("checked above");
        let target = &remote.setup.targets[pick];
        // (the prefill pool's own index, if any, says what its ranks hold)
        target.ingress.push(Admission {
            kind: AdmissionKind::PrefillOnly { back_to: Some(back_to) },
            cached: Vec::new(),
            ..a
        });
        remote.awaiting.insert(a.id, pick);
        self.stats.remote_prefills += 1;
        None
    }

    /// A cancel for a request this rank does not hold: if it waits for its remote prefill, the
    /// prefill pool is told (it reports the cancel, or the handoff, arriving, is refused here).
    /// Also how it hears that the prefill failed (the prefill pool reported that).
    pub(super) fn cancel_remote_prefill(&mut self, id: u64) {
        let Some(remote) = self.remote_prefill.as_mut() else { return };
        let Some(pick) = remote.awaiting.remove(&id) else { return };
        remote.cancelled.insert(id);
        self.memory.release_reserved(id);
        if let Some(target) = self.remote_prefill.as_ref().and_then(|r| r.setup.targets.get(pick)) {
            target.ingress.cancel(id);
        }
    }
}
