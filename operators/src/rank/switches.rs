//! Test-only switches, each removing or breaking exactly one mechanism so a test can show that
//! the check guarding it fails (see docs/design.md §5). All off by default; no production path
//! sets them. The command line sets them with `--test-switch NAME[=ARG]`, NAME being the field's
//! name with dashes (`TestSwitches::set` parses one).

use thiserror::Error;

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
    /// A CPU prefill rank's handoffs name its blocks in place, read through its cache lock,
    /// instead of carrying the copy the step that completed the prompt made (removes "handoffs
    /// own their bytes": a transfer waits for each of the producer's later steps, and reads
    /// whatever the blocks hold when it gets to them).
    pub read_handoffs_in_place: bool,
    /// A tcp consumer takes a streamed handoff whose pieces did not all arrive, reading the
    /// missing blocks as zeros, instead of refusing it so that it is sent again whole (removes
    /// "a streamed handoff is all or nothing": the request decodes from a partial prompt).
    pub accept_missing_pieces: bool,
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
    /// A rank that can run nothing gives back the prefixes its waiting requests loaded from the
    /// offload store but does not decide its step again (removes "freed memory is used": nothing
    /// wakes a parked rank, so it stalls with the memory free).
    pub no_reschedule_after_giving_back_prefixes: bool,
    /// A rank launches as far ahead as its scheduler allows, whatever its executor's bound
    /// (removes the bound on steps in flight).
    pub unbounded_steps_in_flight: bool,
    /// A decode pool's tcp listener registers any number of producer links (removes the refusal
    /// of a producer beyond the links the graph declares: it is served beside the others).
    pub serve_any_producer: bool,
    /// A decode pool in a process of its own never counts a vanished producer link as lost
    /// (removes peer loss: it waits for the stall timeout, and its requests are not cancelled).
    pub keep_vanished_producers: bool,
    /// A prefill pool's rank drops this request as it arrives: its end goes to the collector,
    /// but no abort to the decode rank that sent it there, which then waits for a handoff that
    /// never comes (provokes a pool waiting on a request the run already saw end).
    pub prefill_drops_silently: Option<u64>,
    /// The stall watchdog does not look at what a pool's ranks hold or await (removes its check
    /// of a pool waiting on a request that already ended, or on anything once the workload
    /// driver is done).
    pub watchdog_ignores_what_pools_await: bool,
    /// A decode rank that finds a handoff aborted or missing keeps the prefix blocks it reserved
    /// for that request (removes their release: they stay reserved for good, and the accounting
    /// check must name them).
    pub handoff_keeps_reserved_prefix_on_abort: bool,
    /// Each rank takes this many milliseconds more to build its executor (provokes a slow start:
    /// a large model loading).
    pub slow_rank_build_ms: u64,
    /// The trace driver releases requests without waiting for the ranks to be built (removes
    /// the wait: the first requests queue behind the start-up and their TTFT counts it).
    pub release_before_ranks_are_built: bool,
    /// Streamed pieces leave when their step completes even on an executor that exports at
    /// launch (removes layer-wise streaming: the chunk that samples T0 then goes with the handoff).
    pub pieces_at_completion: bool,
    /// Pieces sent at launch go without their layers' marks (removes the wait for the forward:
    /// the link reads blocks the step is still writing — on a GPU, `--verify` sees it; emulated
    /// kernels have run when the step is enqueued).
    pub unmarked_pieces: bool,
    /// A simulated run's clock moves to the next event after every pass over the workers, busy
    /// or not (removes the discrete-event rule: work still to do at an instant happens later).
    pub advance_clock_while_busy: bool,
}

/// Every switch `TestSwitches::set` knows: its name and the argument it takes ("" for none).
pub const SWITCHES: &[(&str, &str)] = &[
    ("drop-cache-event-every", "N"),
    ("swap-block-table-every", "N"),
    ("cancel-at-stage", "ID:STAGE,…"),
    ("hold-capability", "OPERATOR:RANK:STEP"),
    ("align-without-waiting", ""),
    ("stuck-in-forward", "RANK:STEP"),
    ("leak-blocks-of", "ID"),
    ("accept-stale-completions", ""),
    ("handoff-without-state", ""),
    ("export-state-after-t0", ""),
    ("deliver-duplicate-handoffs", ""),
    ("free-before-ack", ""),
    ("read-handoffs-in-place", ""),
    ("accept-missing-pieces", ""),
    ("export-admission-slot", ""),
    ("withhold-dispatch", "RANK:STEP:MOE"),
    ("send-no-expert-results", "RANK:STEP:MOE"),
    ("release-saves-early", ""),
    ("slow-saves-ms", "MS"),
    ("slow-loads-ms", "MS"),
    ("skip-publishing-restored", ""),
    ("keep-rejected-state", ""),
    ("drafter-successors-only-when-verifying", ""),
    ("widen-draft-buckets", ""),
    ("skip-draft-passes-without-samples", ""),
    ("no-reschedule-after-giving-back-prefixes", ""),
    ("unbounded-steps-in-flight", ""),
    ("serve-any-producer", ""),
    ("keep-vanished-producers", ""),
    ("prefill-drops-silently", "ID"),
    ("watchdog-ignores-what-pools-await", ""),
    ("handoff-keeps-reserved-prefix-on-abort", ""),
    ("slow-rank-build-ms", "MS"),
    ("release-before-ranks-are-built", ""),
    ("pieces-at-completion", ""),
    ("unmarked-pieces", ""),
    ("advance-clock-while-busy", ""),
];

/// The stages `cancel-at-stage` accepts, as written on the command line.
const CANCEL_STAGES: [&str; 4] = ["queued", "prefilling", "in-transfer", "decoding"];

/// Why a `--test-switch NAME[=ARG]` was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SwitchError {
    #[error("unknown test switch {name:?}; the known ones are: {}", known_switches())]
    Unknown { name: String },
    #[error("test switch {name} takes no argument, got {name}={arg}")]
    UnexpectedArgument { name: String, arg: String },
    #[error("test switch {name} takes an argument: {name}={expected}")]
    MissingArgument { name: String, expected: &'static str },
    #[error("test switch {name}: expected {name}={expected}, got {arg:?}: {why}")]
    BadArgument { name: String, expected: &'static str, arg: String, why: String },
}

/// `NAME` or `NAME=ARG` for every known switch, comma-separated.
fn known_switches() -> String {
    let spell = |&(name, arg): &(&str, &str)| if arg.is_empty() { name.to_string() } else { format!("{name}={arg}") };
    SWITCHES.iter().map(spell).collect::<Vec<_>>().join(", ")
}

impl TestSwitches {
    /// Sets the switch a `NAME[=ARG]` names (what `--test-switch` takes).
    pub fn set_from(&mut self, spec: &str) -> Result<(), SwitchError> {
        match spec.split_once('=') {
            Some((name, arg)) => self.set(name, Some(arg)),
            None => self.set(spec, None),
        }
    }

    /// Sets switch `name` (a field's name with dashes) with its argument. `cancel-at-stage` adds
    /// to the cancellations already set; every other switch replaces its value.
    pub fn set(&mut self, name: &str, arg: Option<&str>) -> Result<(), SwitchError> {
        let Some(&(_, expected)) = SWITCHES.iter().find(|(known, _)| *known == name) else {
            return Err(SwitchError::Unknown { name: name.to_string() });
        };
        let arg = match (arg, expected.is_empty()) {
            (None, true) => return self.turn_on(name),
            (Some(arg), true) => {
                return Err(SwitchError::UnexpectedArgument { name: name.to_string(), arg: arg.to_string() })
            }
            (None, false) => return Err(SwitchError::MissingArgument { name: name.to_string(), expected }),
            (Some(arg), false) => arg,
        };
        let bad =
            |why: String| SwitchError::BadArgument { name: name.to_string(), expected, arg: arg.to_string(), why };
        match name {
            "drop-cache-event-every" => self.drop_cache_event_every = Some(number(arg).map_err(bad)?),
            "swap-block-table-every" => self.swap_block_table_every = Some(number(arg).map_err(bad)?),
            "leak-blocks-of" => self.leak_blocks_of = Some(number(arg).map_err(bad)?),
            "prefill-drops-silently" => self.prefill_drops_silently = Some(number(arg).map_err(bad)?),
            "slow-saves-ms" => self.slow_saves_ms = number(arg).map_err(bad)?,
            "slow-loads-ms" => self.slow_loads_ms = number(arg).map_err(bad)?,
            "slow-rank-build-ms" => self.slow_rank_build_ms = number(arg).map_err(bad)?,
            "cancel-at-stage" => self.cancel_at_stage.extend(cancellations(arg).map_err(bad)?),
            "hold-capability" => {
                let [operator, rank, step] = fields(arg).map_err(bad)?;
                self.hold_capability =
                    Some((operator.to_string(), number(rank).map_err(bad)?, number(step).map_err(bad)?));
            }
            "stuck-in-forward" => {
                let [rank, step] = fields(arg).map_err(bad)?;
                self.stuck_in_forward = Some((number(rank).map_err(bad)?, number(step).map_err(bad)?));
            }
            "withhold-dispatch" => self.withhold_dispatch = Some(rank_step_moe(arg).map_err(bad)?),
            "send-no-expert-results" => self.send_no_expert_results = Some(rank_step_moe(arg).map_err(bad)?),
            _ => unreachable!("every switch of SWITCHES that takes an argument has its arm: {name}"),
        }
        Ok(())
    }

    /// Turns on the switch `name`, one that takes no argument.
    fn turn_on(&mut self, name: &str) -> Result<(), SwitchError> {
        let field = match name {
            "align-without-waiting" => &mut self.align_without_waiting,
            "advance-clock-while-busy" => &mut self.advance_clock_while_busy,
            "accept-stale-completions" => &mut self.accept_stale_completions,
            "handoff-without-state" => &mut self.handoff_without_state,
            "export-state-after-t0" => &mut self.export_state_after_t0,
            "deliver-duplicate-handoffs" => &mut self.deliver_duplicate_handoffs,
            "free-before-ack" => &mut self.free_before_ack,
            "read-handoffs-in-place" => &mut self.read_handoffs_in_place,
            "accept-missing-pieces" => &mut self.accept_missing_pieces,
            "export-admission-slot" => &mut self.export_admission_slot,
            "release-saves-early" => &mut self.release_saves_early,
            "watchdog-ignores-what-pools-await" => &mut self.watchdog_ignores_what_pools_await,
            "skip-publishing-restored" => &mut self.skip_publishing_restored,
            "keep-rejected-state" => &mut self.keep_rejected_state,
            "drafter-successors-only-when-verifying" => &mut self.drafter_successors_only_when_verifying,
            "widen-draft-buckets" => &mut self.widen_draft_buckets,
            "skip-draft-passes-without-samples" => &mut self.skip_draft_passes_without_samples,
            "no-reschedule-after-giving-back-prefixes" => &mut self.no_reschedule_after_giving_back_prefixes,
            "unbounded-steps-in-flight" => &mut self.unbounded_steps_in_flight,
            "serve-any-producer" => &mut self.serve_any_producer,
            "keep-vanished-producers" => &mut self.keep_vanished_producers,
            "handoff-keeps-reserved-prefix-on-abort" => &mut self.handoff_keeps_reserved_prefix_on_abort,
            "release-before-ranks-are-built" => &mut self.release_before_ranks_are_built,
            "pieces-at-completion" => &mut self.pieces_at_completion,
            "unmarked-pieces" => &mut self.unmarked_pieces,
            _ => unreachable!("every switch of SWITCHES without an argument has its arm: {name}"),
        };
        *field = true;
        Ok(())
    }

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

/// A switch argument's number.
fn number<T: std::str::FromStr>(text: &str) -> Result<T, String> {
    text.parse().map_err(|_| format!("{text:?} is not a number"))
}

/// The `N` colon-separated fields of a switch argument.
fn fields<const N: usize>(text: &str) -> Result<[&str; N], String> {
    let parts: Vec<&str> = text.split(':').collect();
    parts.try_into().map_err(|parts: Vec<&str>| format!("{N} parts separated by ':', not {}", parts.len()))
}

/// `RANK:STEP:MOE`.
fn rank_step_moe(text: &str) -> Result<(usize, u64, usize), String> {
    let [rank, step, moe] = fields(text)?;
    Ok((number(rank)?, number(step)?, number(moe)?))
}

/// `ID:STAGE,…`, each stage as `TestSwitches::cancel_at_stage` holds it ("in-transfer" is "in
/// transfer").
fn cancellations(text: &str) -> Result<Vec<(u64, String)>, String> {
    text.split(',')
        .map(|item| {
            let [id, stage] = fields(item)?;
            if !CANCEL_STAGES.contains(&stage) {
                return Err(format!("stage {stage:?} is not queued, prefilling, in-transfer or decoding"));
            }
            Ok((number(id)?, stage.replace('-', " ")))
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An argument of the right form for each switch of `SWITCHES`.
    fn example(form: &str) -> Option<&'static str> {
        match form {
            "" => None,
            "N" | "ID" | "MS" => Some("7"),
            "ID:STAGE,…" => Some("3:decoding,9:in-transfer"),
            "OPERATOR:RANK:STEP" => Some("align:1:6"),
            "RANK:STEP" => Some("1:6"),
            "RANK:STEP:MOE" => Some("1:6:0"),
            other => panic!("no example for {other}"),
        }
    }

    #[test]
    fn every_known_switch_changes_the_switches_and_takes_only_its_own_form() {
        for &(name, form) in SWITCHES {
            let mut switches = TestSwitches::default();
            switches.set(name, example(form)).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_ne!(switches, TestSwitches::default(), "{name} changes nothing");
            let wrong = if form.is_empty() { Some("1") } else { None };
            assert!(TestSwitches::default().set(name, wrong).is_err(), "{name} takes {wrong:?}");
        }
    }

    #[test]
    fn spelled_as_on_the_command_line() {
        let mut switches = TestSwitches::default();
        switches.set_from("hold-capability=map:1:6").unwrap();
        switches.set_from("align-without-waiting").unwrap();
        switches.set_from("leak-blocks-of=7").unwrap();
        switches.set_from("cancel-at-stage=3:decoding").unwrap();
        switches.set_from("cancel-at-stage=4:in-transfer,5:queued").unwrap();
        switches.set_from("withhold-dispatch=1:6:1").unwrap();
        switches.set_from("slow-saves-ms=10").unwrap();
        assert_eq!(
            switches,
            TestSwitches {
                hold_capability: Some(("map".into(), 1, 6)),
                align_without_waiting: true,
                leak_blocks_of: Some(7),
                cancel_at_stage: vec![(3, "decoding".into()), (4, "in transfer".into()), (5, "queued".into())],
                withhold_dispatch: Some((1, 6, 1)),
                slow_saves_ms: 10,
                ..Default::default()
            }
        );
    }

    #[test]
    fn a_refusal_names_the_switch_and_what_it_takes() {
        let unknown = TestSwitches::default().set_from("hold-capabilty=map:1:6").unwrap_err().to_string();
        assert!(unknown.contains("\"hold-capabilty\""), "{unknown}");
        assert!(unknown.contains("hold-capability=OPERATOR:RANK:STEP"), "{unknown}");
        assert!(unknown.contains("align-without-waiting,"), "{unknown}");
        let bad = TestSwitches::default().set_from("hold-capability=map:x:6").unwrap_err().to_string();
        assert_eq!(bad, "test switch hold-capability: expected hold-capability=OPERATOR:RANK:STEP, got \"map:x:6\": \"x\" is not a number");
        let short = TestSwitches::default().set_from("stuck-in-forward=1").unwrap_err().to_string();
        assert!(short.contains("2 parts separated by ':', not 1"), "{short}");
        let stage = TestSwitches::default().set_from("cancel-at-stage=1:later").unwrap_err().to_string();
        assert!(stage.contains("stage \"later\" is not queued"), "{stage}");
        let missing = TestSwitches::default().set_from("leak-blocks-of").unwrap_err().to_string();
        assert_eq!(missing, "test switch leak-blocks-of takes an argument: leak-blocks-of=ID");
        let extra = TestSwitches::default().set_from("free-before-ack=1").unwrap_err().to_string();
        assert_eq!(extra, "test switch free-before-ack takes no argument, got free-before-ack=1");
    }
}
