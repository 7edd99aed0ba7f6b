//! Test-only switches, each removing or breaking exactly one mechanism so a test can show that
//! the check guarding it fails (see docs/design.md §5). All off by default; no production path
//! sets them.

/// The switches of one run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TestSwitches {
    /// Router `kv-aware`: a rank leaves out of its reports every cache event whose number is a
    /// multiple of this (events lost on the way: the gap must be seen and repaired by a resync).
    pub drop_cache_event_every: Option<u64>,
    /// Requests whose id is a multiple of this read their KV through a block table with its
    /// first two entries swapped on every decode step (to show `--verify` catches a wrong read).
    pub swap_block_table_every: Option<u64>,
    /// Cancels request `id` through the pool's cancellation path as soon as the rank holding it
    /// sees it in `stage` ("queued", "prefilling" or "decoding"): deterministic cancellation
    /// points for tests.
    pub cancel_at_stage: Vec<(u64, String)>,
    /// `(operator, rank, step)`: that operator on that rank keeps a capability for that step
    /// forever, to show the stall watchdog names exactly it.
    pub hold_capability: Option<(String, usize, u64)>,
    /// `align` plans from the reports it has instead of waiting for the frontier to pass the
    /// step (removes the collective-alignment mechanism).
    pub align_without_waiting: bool,
    /// `(rank, step)`: that rank's forward sleeps (for an hour) inside step `step`, to show the
    /// stall watchdog notices a worker stuck inside an operator.
    pub stuck_in_forward: Option<(usize, u64)>,
    /// When this request finishes, its rank forgets its KV blocks instead of releasing them (a
    /// missing release), to show the accounting check catches a leak at park time and at the end
    /// of the run.
    pub leak_blocks_of: Option<u64>,
    /// Completions reach the sequence in the slab slot they name whatever its generation, and in
    /// any order (removes the generation check: a late token of a preempted or cancelled
    /// request lands in whatever holds its slot now).
    pub accept_stale_completions: bool,
    /// A prefill pool's handoff leaves out the state slot (removes the all-or-nothing half of
    /// the handoff type: the consumer must refuse it, never run on a zeroed state).
    pub handoff_without_state: bool,
    /// A prefill pool feeds T0 itself and exports the state after it (instead of at the prompt
    /// boundary), so the consumer applies T0 to a state that already holds it (removes "T0
    /// exactly once").
    pub export_state_after_t0: bool,
    /// A decode pool's inbox delivers every copy of a handoff to a rank (removes its
    /// exactly-once take: a duplicate delivery runs the request a second time).
    pub deliver_duplicate_handoffs: bool,
    /// A prefill pool frees a handed-off request's blocks and slot as soon as the handoff is
    /// sent, not when the consumer's ack comes (removes "producer frees after ack": the
    /// consumer reads blocks in place that may already hold another request's KV).
    pub free_before_ack: bool,
    /// A prefill pool's handoff reads the state slot its request got when first admitted, not
    /// the one it holds when the handoff is built (removes "current slot": a request that was
    /// preempted and came back in another slot hands off whatever the old slot holds now).
    pub export_admission_slot: bool,
    /// `(rank, step, moe)`: that rank's `dispatch` at that MoE layer (its index among the
    /// model's MoE layers) sends nothing at that step and keeps its capability forever (a rank
    /// withholding its part of an exchange: the watchdog must name it).
    pub withhold_dispatch: Option<(usize, u64, usize)>,
    /// `(rank, step, moe)`: that rank's `experts` at that MoE layer computes and sends nothing at
    /// that step and lets it pass (removes the results: `combine` must fail the requests that
    /// lose them, never add a silent zero).
    pub send_no_expert_results: Option<(usize, u64, usize)>,
    /// Offload saves give their blocks back when they are handed to the save thread, before it
    /// has read them (removes save fencing's hold: the next prefill may overwrite them first).
    pub release_saves_early: bool,
    /// The save thread waits this long before it reads a save's blocks (a slow store).
    pub slow_saves_ms: u64,
    /// The load thread waits this long before each load (a slow store).
    pub slow_loads_ms: u64,
    /// A prefix loaded from the offload store is written into its blocks but not published in
    /// the rank's prefix cache (removes "restored prefixes published": the next request with
    /// the same prefix loads it again instead of hitting in HBM).
    pub skip_publishing_restored: bool,
    /// A verification that rejects drafts leaves the recurrent and conv state as after every
    /// draft instead of after the last accepted token (removes the rollback).
    pub keep_rejected_state: bool,
    /// The drafter is handed a chunk's sampled token only when the chunk verifies drafts
    /// (removes "drafter inputs explicit": a producer, which never verifies, makes no drafts
    /// from T0 and its handoffs carry none).
    pub drafter_successors_only_when_verifying: bool,
    /// Dynamic q-bucketing rounds a request's draft width up to a bucket past what the
    /// scheduler fixed for it — the room left in the step's token budget and the outputs the
    /// request has left (removes "scheduled width").
    pub widen_draft_buckets: bool,
    /// A rank whose step samples nothing (only middle prompt chunks: nothing to draft from)
    /// skips the step's draft passes: its `dispatch[mtp.c]` sends nothing and never lets the
    /// step pass (removes "collective alignment" for draft passes — the seed's hang: peers
    /// wait in the draft exchanges for a rank that never joins them).
    pub skip_draft_passes_without_samples: bool,
}

impl TestSwitches {
    /// The expert-exchange switches of `rank` at MoE layer `moe`.
    pub fn exchange_switches(&self, rank: usize, moe: usize) -> ExchangeSwitches {
        let at = |s: Option<(usize, u64, usize)>| s.filter(|&(r, _, m)| r == rank && m == moe).map(|(_, t, _)| t);
        ExchangeSwitches {
            withhold_dispatch_at: at(self.withhold_dispatch),
            send_no_results_at: at(self.send_no_expert_results),
            skip_draft_without_samples: self.skip_draft_passes_without_samples,
        }
    }

    /// The step at which `operator` on `rank` must hold its capability, if any.
    pub fn hold_at(&self, operator: &str, rank: usize) -> Option<u64> {
        self.hold_capability.as_ref().filter(|(o, r, _)| o == operator && *r == rank).map(|(_, _, t)| *t)
    }
}

/// Test switches of the expert exchanges (see `TestSwitches`).
#[derive(Clone, Copy, Debug, Default)]
pub struct ExchangeSwitches {
    /// `dispatch` at this step sends nothing and keeps its capability forever.
    pub withhold_dispatch_at: Option<u64>,
    /// `experts` at this step computes nothing and sends nothing, and lets the step pass.
    pub send_no_results_at: Option<u64>,
    /// A draft pass's `dispatch` on a rank whose step samples nothing sends nothing and keeps
    /// its capability forever.
    pub skip_draft_without_samples: bool,
}
