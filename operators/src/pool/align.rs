//! `align(t)`: gathers every rank's report for step `t` (a broadcast exchange) and, once the
//! frontier has passed `t` — every rank has reported — derives `StepPlan(t)`, the same on every
//! rank: the reports in rank order, each admission of `t` routed to a rank by the pool's router
//! (every rank runs the same router over the same inputs, so all agree; under `admission =
//! "reserve"` only to a rank whose reported capacity holds it, else deferred in order), whether
//! the pool parks, and the step's shape (tokens per rank, idle ranks' dummy rows at the spec
//! width, the layers that exchange, the draft passes every rank joins).
//!
//! Under router `kv-aware` it also takes the ranks' cache events out of the reports, in each
//! rank's order, and shows them to the router before it routes (`Router::observe`: the same on
//! every rank); the worker holding the routing index hands them to it, and a rank whose events
//! came with a gap is named in the plan to send its whole cache (the same on every rank).
//!
//! Holds a capability for `t` from the first report of `t` until the plan is emitted.
//!
//! A set of reports that is not one per rank (a report missing or duplicated: a runtime fault,
//! not a user error) still yields a plan: its admissions fail with the fault named (rank 0
//! reports them), cancellations go through, and no request is left unaccounted — never a panic.
//!
//! Guarantee carried: collective alignment (DESIGN §5) — no rank acts on step `t` before it holds
//! the complete set of reports, and every rank derives the same plan from it, so any collective
//! a forward runs is a pure function of the plan and no rank can be one short.

use crate::messages::{RankReport, StepPlan, StepShape};
use crate::policy::kv_index::{EventOrder, SharedKvIndex};
use crate::policy::prefix_cache::block_hashes;
use crate::policy::router::{RouteRequest, Router};
use std::collections::BTreeMap;
use timely::dataflow::channels::pact::Pipeline;
use timely::dataflow::operators::generic::operator::Operator;
use timely::dataflow::operators::vec::Broadcast;
use timely::dataflow::operators::Capability;
use timely::dataflow::StreamVec;

/// How the router keys prompts (the same way the ranks' prefix caches do).
#[derive(Clone, Copy, Debug)]
pub struct RoutingKeys {
    pub block_size: usize,
    pub keyed_by_prompt_len: bool,
}

/// What a pool's forward does collectively, from its config and model: the plan's shape
/// decisions read it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Collectives {
    /// The model layers with MoE dispatch and combine (empty without expert parallelism).
    pub moe_layers: Vec<usize>,
    /// The scheduler's spec width: rows per request in a decode step (1 + drafts; 1 on a
    /// producer, which never verifies).
    pub spec_width: usize,
    /// The MTP drafter under expert parallelism: the draft passes after the model's MoE layers,
    /// each an exchange of the MTP layer's experts (0 otherwise).
    pub draft_passes: usize,
    /// The MTP layer's index (naming its passes).
    pub mtp_layer: usize,
}

/// Where the ranks' cache events go (router `kv-aware`): every rank keeps their order, and the
/// worker that holds the routing index (worker 0) hands them to it.
pub struct CacheEventRoute {
    pub order: EventOrder,
    pub index: Option<SharedKvIndex>,
}

impl CacheEventRoute {
    /// Takes the events and snapshots out of `reports` (rank-ordered), shows them to the router,
    /// applies them to the index where this worker holds it, and returns the ranks that owe a
    /// snapshot.
    fn take(&mut self, reports: &mut [RankReport], router: &mut dyn Router) -> Vec<usize> {
        let mut index = self.index.as_ref().map(|i| i.lock());
        for r in reports.iter_mut() {
            let (snapshot, events) = self.order.take(r.cache_snapshot.take(), std::mem::take(&mut r.cache_events));
            router.observe(snapshot.as_ref(), &events);
            if let Some(index) = index.as_mut() {
                if let Some(s) = &snapshot {
                    index.resync(s);
                }
                for e in &events {
                    let _ = index.apply(e); // in order: `EventOrder` passed only the next ones
                }
            }
        }
        self.order.owing()
    }
}

#[allow(clippy::too_many_arguments)]
pub fn align<'scope>(
    reports: StreamVec<'scope, u64, RankReport>,
    ranks: usize,
    mut router: Box<dyn Router>,
    keys: RoutingKeys,
    collectives: Collectives,
    mut cache_events: Option<CacheEventRoute>,
    hold_at: Option<u64>,
    without_waiting: bool,
) -> StreamVec<'scope, u64, StepPlan> {
    reports.broadcast().unary_frontier::<timely::container::CapacityContainerBuilder<Vec<StepPlan>>, _, _, _>(
        Pipeline,
        "align",
        move |_cap, _info| {
            let mut stash: BTreeMap<u64, (Capability<u64>, Vec<RankReport>)> = BTreeMap::new();
            let mut held = Vec::new(); // test switch: capabilities kept forever
            let mut planned_partially = std::collections::BTreeSet::new();
            move |(input, frontier), output| {
                input.for_each_stamp(|stamp, data| {
                    let Some(cap) = stamp.retain_least(output.output_index()) else { return };
                    let entry = stash.entry(*cap.time()).or_insert_with(|| (cap, Vec::new()));
                    entry.1.extend(data.flat_map(|d| d.drain(..)));
                });
                if without_waiting {
                    // Test switch: the frontier wait removed. Plan from whatever reports have
                    // arrived for each step, once; later reports for that step are dropped.
                    for (t, (cap, got)) in std::mem::take(&mut stash) {
                        if planned_partially.insert(t) {
                            let mut got = got;
                            got.sort_by_key(|r| r.rank);
                            let plan = derive_plan(t, got, router.as_mut(), keys, &collectives);
                            output.session(&cap).give(plan);
                        }
                    }
                    return;
                }
                while let Some((&t, _)) = stash.first_key_value() {
                    if frontier.frontier().less_equal(&t) {
                        break;
                    }
                    let Some((cap, mut got)) = stash.remove(&t) else { break };
                    got.sort_by_key(|r| r.rank);
                    let resync = cache_events.as_mut().map(|c| c.take(&mut got, router.as_mut())).unwrap_or_default();
                    let mut plan = match complete_set(t, &got, ranks) {
                        Ok(()) => derive_plan(t, got, router.as_mut(), keys, &collectives),
                        Err(fault) => faulted_plan(t, got, fault, &collectives),
                    };
                    plan.resync = resync;
                    output.session(&cap).give(plan);
                    if hold_at == Some(t) {
                        held.push(cap);
                    }
                }
            }
        },
    )
}

/// Whether `got` (rank-ordered) holds exactly one report per rank.
fn complete_set(t: u64, got: &[RankReport], ranks: usize) -> Result<(), String> {
    let indices: Vec<usize> = got.iter().map(|r| r.rank).collect();
    if indices != (0..ranks).collect::<Vec<_>>() {
        return Err(format!("step {t}: align got reports from ranks {indices:?} of a {ranks}-rank pool"));
    }
    Ok(())
}

/// The plan of a step whose reports are not one per rank: nothing new is admitted — those
/// requests fail with the fault — cancellations go through, and the pool neither parks nor ends
/// on it (it cannot tell that every rank is idle).
fn faulted_plan(step: u64, mut ranks: Vec<RankReport>, fault: String, collectives: &Collectives) -> StepPlan {
    tracing::error!("{fault}");
    eprintln!("runtime fault: {fault}");
    let unroutable =
        ranks.iter_mut().flat_map(|r| std::mem::take(&mut r.admissions)).map(|a| (a, fault.clone())).collect();
    let cancels = ranks.iter_mut().flat_map(|r| std::mem::take(&mut r.cancels)).collect();
    // Which ranks run cannot be told: every MoE layer keeps its exchange (a rank that launched
    // nothing sends nothing through it).
    let shape = StepShape {
        tokens_per_rank: tokens_per_rank(&ranks),
        idle_dummy_rows: idle_dummy_rows(collectives, true),
        exchange_layers: collectives.moe_layers.clone(),
        draft_passes: draft_passes(collectives, true),
    };
    StepPlan {
        step,
        ranks,
        routed: Vec::new(),
        unroutable,
        cancels,
        deferred: Vec::new(),
        idle: false,
        park: false,
        end: false,
        shape,
        resync: Vec::new(),
    }
}

/// Decision: the tokens each rank runs at `t` — read from each report's `scheduled_tokens`.
pub fn tokens_per_rank(ranks: &[RankReport]) -> Vec<usize> {
    ranks.iter().map(|r| r.scheduled_tokens).collect()
}

/// Decision: what an idle rank keeps for the collectives of `t` — read from whether the pool
/// has collectives (MoE layers exchanging) and whether some rank runs tokens at `t`; its width
/// is the scheduler's spec width.
pub fn idle_dummy_rows(collectives: &Collectives, some_rank_runs: bool) -> Option<usize> {
    (!collectives.moe_layers.is_empty() && some_rank_runs).then_some(collectives.spec_width.max(1))
}

/// Decision: the draft passes every rank joins at `t` — read from the pool's draft passes and
/// whether some rank runs tokens at `t`. A rank with only a middle prompt chunk, or with nothing
/// to draft, joins them all the same (DESIGN §5, collective alignment).
pub fn draft_passes(collectives: &Collectives, some_rank_runs: bool) -> usize {
    if some_rank_runs {
        collectives.draft_passes
    } else {
        0
    }
}

/// Decision: the layers whose dispatch and combine exchange rows at `t` — every MoE layer when
/// some rank runs tokens at `t`, none otherwise.
pub fn exchange_layers(collectives: &Collectives, some_rank_runs: bool) -> Vec<usize> {
    if some_rank_runs {
        collectives.moe_layers.clone()
    } else {
        Vec::new()
    }
}

/// `StepPlan(t)` from the complete, rank-ordered reports of `t`.
pub fn derive_plan(
    step: u64,
    mut ranks: Vec<RankReport>,
    router: &mut dyn Router,
    keys: RoutingKeys,
    collectives: &Collectives,
) -> StepPlan {
    // (With a partial set of reports — only under the test switch — ranks are missing here.)
    let admissions: Vec<_> = ranks.iter_mut().flat_map(|r| std::mem::take(&mut r.admissions)).collect();
    let cancels: Vec<u64> = ranks.iter_mut().flat_map(|r| std::mem::take(&mut r.cancels)).collect();
    let mut load: Vec<usize> = ranks.iter().map(|r| r.outstanding_tokens).collect();
    // `admission = "reserve"` (every rank reports its capacity): only ranks that can hold a
    // request to its end take it; when none can yet, it waits (deferred), in order.
    let mut capacity: Option<Vec<crate::messages::Capacity>> = ranks.iter().map(|r| r.capacity).collect();
    let mut routed = Vec::with_capacity(admissions.len());
    let mut unroutable = Vec::new();
    let mut deferred = Vec::new();
    for a in admissions {
        let tokens = a.prompt.len() + a.max_output_tokens;
        if let Some(caps) = &capacity {
            let ever = caps.iter().any(|c| c.blocks_for(tokens) <= c.total_blocks);
            if ever && (!deferred.is_empty() || !caps.iter().any(|c| c.holds(tokens))) {
                deferred.push(a);
                continue;
            }
        }
        let seed = if keys.keyed_by_prompt_len { a.prompt.len() as u64 } else { 0 };
        let hashes = block_hashes(&a.prompt, keys.block_size, seed);
        let mut rank = match a.kind {
            // Back to the decode rank that asked for the remote prefill (it may hold the prefix).
            crate::messages::AdmissionKind::Handoff { rank: Some(r) } => r as usize,
            _ => router
                .route(&RouteRequest { id: a.id, prompt: &a.prompt, block_hashes: &hashes, cached: &a.cached }, &load),
        };
        if rank >= load.len() {
            let why = format!("the router chose rank {rank} of a {}-rank pool", load.len());
            unroutable.push((a, why));
            continue;
        }
        if let Some(caps) = capacity.as_mut() {
            let pinned = matches!(a.kind, crate::messages::AdmissionKind::Handoff { rank: Some(_) });
            if !pinned && !caps[rank].holds(tokens) {
                // The router's choice cannot hold it: the least loaded rank that can.
                if let Some(r) = (0..caps.len()).filter(|&r| caps[r].holds(tokens)).min_by_key(|&r| (load[r], r)) {
                    rank = r;
                }
            }
            caps[rank].take(tokens);
        }
        load[rank] += tokens - router.expected_hit_tokens().min(a.prompt.len().saturating_sub(1));
        routed.push((a, rank));
    }
    let launches = ranks.iter().any(|r| r.scheduled_tokens > 0);
    let idle = !launches && routed.is_empty() && unroutable.is_empty() && cancels.is_empty() && deferred.is_empty();
    let park = idle && ranks.iter().all(RankReport::idle);
    let end = park && ranks.first().is_some_and(|r| r.closing);
    let shape = StepShape {
        tokens_per_rank: tokens_per_rank(&ranks),
        idle_dummy_rows: idle_dummy_rows(collectives, launches),
        exchange_layers: exchange_layers(collectives, launches),
        draft_passes: draft_passes(collectives, launches),
    };
    StepPlan { step, ranks, routed, unroutable, cancels, deferred, idle, park, end, shape, resync: Vec::new() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::Admission;
    use crate::policy::router::RoundRobin;

    fn report(rank: usize) -> RankReport {
        RankReport {
            rank,
            scheduled_tokens: 0,
            scheduled_seqs: 0,
            outstanding_tokens: 0,
            waiting: 0,
            running: 0,
            in_flight: 0,
            admissions: vec![],
            cancels: vec![],
            closing: false,
            capacity: None,
            cache_events: Vec::new(),
            cache_snapshot: None,
        }
    }

    fn plan(reports: Vec<RankReport>) -> StepPlan {
        derive_plan(
            7,
            reports,
            &mut RoundRobin::default(),
            RoutingKeys { block_size: 4, keyed_by_prompt_len: false },
            &Collectives::default(),
        )
    }

    #[test]
    fn the_pool_idles_only_when_no_rank_launches_and_nothing_was_admitted_or_cancelled() {
        assert!(plan(vec![report(0), report(1)]).idle);
        // Each fact that means work at this step, alone, keeps the pool running.
        let mut with_work = Vec::new();
        for flip in 0..3 {
            let mut r = vec![report(0), report(1)];
            match flip {
                0 => r[1].scheduled_tokens = 1,
                1 => r[0].cancels.push(4),
                _ => r[0].admissions.push(Admission {
                    id: 1,
                    prompt: vec![1],
                    max_output_tokens: 1,
                    warmup: false,
                    kind: Default::default(),
                    sampling: Default::default(),
                    cached: Vec::new(),
                    delivery: Default::default(),
                }),
            }
            with_work.push(plan(r).idle);
        }
        assert_eq!(with_work, vec![false; 3]);
        // Facts that are not work at this step do not move the decision: requests held but
        // waiting for a completion in flight idle the pool until that completion wakes it.
        let mut r = vec![report(0), report(1)];
        r[0].outstanding_tokens = 99;
        r[1].scheduled_seqs = 0;
        r[1].running = 2;
        r[0].waiting = 1;
        r[1].in_flight = 1;
        r[0].closing = true;
        let p = plan(r);
        assert!(p.idle && !p.park, "it waits: it does not park");
    }

    #[test]
    fn the_pool_parks_only_when_nothing_is_held_or_in_flight_and_ends_only_then() {
        let quiet = || vec![report(0), report(1)];
        let p = plan(quiet());
        assert!(p.park && !p.end);
        for flip in 0..3 {
            let mut r = quiet();
            match flip {
                0 => r[1].in_flight = 1,
                1 => r[0].waiting = 1,
                _ => r[1].running = 1,
            }
            let p = plan(r);
            assert!(p.idle && !p.park && !p.end, "flip {flip}");
        }
        let mut r = quiet();
        r[0].closing = true;
        assert!(plan(r).end, "the workload is done and nothing is held: the pool ends");
        let mut r = quiet();
        r[1].closing = true;
        assert!(!plan(r).end, "only rank 0 knows the ingress");
        let mut r = quiet();
        r[0].closing = true;
        r[1].outstanding_tokens = 3;
        assert!(plan(r).end, "outstanding tokens are a routing figure, not work");
    }

    #[test]
    fn a_route_outside_the_pool_fails_that_request_instead_of_being_clamped() {
        struct Beyond;
        impl Router for Beyond {
            fn route(&mut self, _: &RouteRequest, outstanding: &[usize]) -> usize {
                outstanding.len()
            }
        }
        let mut r = vec![report(0), report(1)];
        r[0].admissions.push(Admission {
            id: 3,
            prompt: vec![1, 2],
            max_output_tokens: 1,
            warmup: false,
            kind: Default::default(),
            sampling: Default::default(),
            cached: Vec::new(),
            delivery: Default::default(),
        });
        let p = derive_plan(
            1,
            r,
            &mut Beyond,
            RoutingKeys { block_size: 4, keyed_by_prompt_len: false },
            &Collectives::default(),
        );
        assert!(p.routed.is_empty());
        assert_eq!(p.unroutable.len(), 1);
        assert!(p.unroutable[0].1.contains("rank 2 of a 2-rank pool"), "{:?}", p.unroutable);
        assert!(!p.idle, "rank 0 must run the step that fails it");
    }

    #[test]
    fn a_missing_report_is_a_named_fault_not_a_panic() {
        assert!(complete_set(4, &[report(0), report(1)], 2).is_ok());
        let e = complete_set(4, &[report(0)], 2).unwrap_err();
        assert!(e.contains("step 4") && e.contains("[0]") && e.contains("2-rank"), "{e}");
        assert!(complete_set(4, &[report(0), report(0)], 2).is_err());
        // The plan of such a step fails its admissions with the fault and keeps its cancels.
        let mut r = report(0);
        r.admissions.push(Admission {
            id: 8,
            prompt: vec![1],
            max_output_tokens: 1,
            warmup: false,
            kind: Default::default(),
            sampling: Default::default(),
            cached: Vec::new(),
            delivery: Default::default(),
        });
        r.cancels.push(3);
        let p = faulted_plan(4, vec![r], e.clone(), &Collectives::default());
        assert_eq!(p.unroutable.len(), 1);
        assert_eq!((p.unroutable[0].0.id, p.unroutable[0].1.as_str()), (8, e.as_str()));
        assert_eq!(p.cancels, vec![3]);
        assert!(p.routed.is_empty() && !p.idle && !p.park && !p.end);
    }

    #[test]
    fn every_admission_is_routed_once_and_reports_keep_rank_order() {
        let mut r = vec![report(0), report(1), report(2)];
        r[0].admissions = (0..5)
            .map(|id| Admission {
                id,
                prompt: vec![1, 2, 3, 4, 5],
                max_output_tokens: 2,
                warmup: false,
                kind: Default::default(),
                sampling: Default::default(),
                cached: Vec::new(),
                delivery: Default::default(),
            })
            .collect();
        let p = plan(r);
        assert_eq!(p.routed.iter().map(|(a, _)| a.id).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert_eq!(p.routed.iter().map(|(_, r)| *r).collect::<Vec<_>>(), vec![0, 1, 2, 0, 1]);
        assert!(p.ranks.iter().all(|r| r.admissions.is_empty()));
        assert_eq!(p.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    /// Every fact a report carries, flipped one at a time (what a shape decision must not read
    /// unless it names it).
    fn flips() -> Vec<(&'static str, RankReport)> {
        let mut all = Vec::new();
        let mut flip = |name: &'static str, f: &dyn Fn(&mut RankReport)| {
            let mut r = report(1);
            f(&mut r);
            all.push((name, r));
        };
        flip("scheduled_seqs", &|r| r.scheduled_seqs = 3);
        flip("outstanding_tokens", &|r| r.outstanding_tokens = 500);
        flip("waiting", &|r| r.waiting = 2);
        flip("running", &|r| r.running = 2);
        flip("in_flight", &|r| r.in_flight = 1);
        flip("cancels", &|r| r.cancels.push(9));
        flip("closing", &|r| r.closing = true);
        flip("capacity", &|r| {
            r.capacity = Some(crate::messages::Capacity {
                blocks: 0,
                slots: 0,
                total_blocks: 4,
                block_size: 16,
                needs_slot: true,
            })
        });
        all
    }

    #[test]
    fn each_shape_decision_reads_the_fact_it_names_and_no_other() {
        let ep = Collectives { moe_layers: vec![1, 2, 3], spec_width: 1, draft_passes: 2, mtp_layer: 4 };
        let keys = RoutingKeys { block_size: 4, keyed_by_prompt_len: false };
        let shape = |r1: RankReport, collectives: &Collectives| {
            let mut r0 = report(0);
            r0.scheduled_tokens = 5; // rank 0 runs tokens; rank 1 is idle
            derive_plan(3, vec![r0, r1], &mut RoundRobin::default(), keys, collectives).shape
        };
        let base = shape(report(1), &ep);
        assert_eq!(base.tokens_per_rank, vec![5, 0]);
        assert_eq!(base.idle_dummy_rows, Some(1), "the idle rank keeps the spec width");
        assert_eq!(base.exchange_layers, vec![1, 2, 3]);
        assert_eq!(base.draft_passes, 2, "some rank runs: every rank joins the draft passes");
        for (name, r1) in flips() {
            assert_eq!(shape(r1, &ep), base, "{name} moved a shape decision");
        }
        // The facts each decision names do move it.
        let mut busy = report(1);
        busy.scheduled_tokens = 2;
        assert_eq!(shape(busy, &ep).tokens_per_rank, vec![5, 2]);
        let wider = Collectives { spec_width: 4, ..ep.clone() };
        assert_eq!(shape(report(1), &wider).idle_dummy_rows, Some(4));
        let dense = shape(report(1), &Collectives::default());
        assert_eq!((dense.idle_dummy_rows, dense.exchange_layers), (None, vec![]), "no MoE exchange, no collective");
        let nobody = derive_plan(3, vec![report(0), report(1)], &mut RoundRobin::default(), keys, &ep).shape;
        assert_eq!((nobody.idle_dummy_rows, nobody.exchange_layers), (None, vec![]), "no rank runs: nothing exchanges");
        assert_eq!(nobody.draft_passes, 0, "no rank runs: no draft pass");
        let no_mtp = Collectives { draft_passes: 0, ..ep.clone() };
        assert_eq!(shape(report(1), &no_mtp).draft_passes, 0);
    }

    #[test]
    fn under_reserve_an_admission_goes_only_to_a_rank_that_can_hold_it_or_waits_in_order() {
        let cap = |blocks| {
            Some(crate::messages::Capacity { blocks, slots: 4, total_blocks: 8, block_size: 4, needs_slot: false })
        };
        let admission = |id, len| Admission {
            id,
            prompt: vec![1; len],
            max_output_tokens: 4,
            warmup: false,
            kind: Default::default(),
            sampling: Default::default(),
            cached: Vec::new(),
            delivery: Default::default(),
        };
        let mut r = vec![report(0), report(1)];
        (r[0].capacity, r[1].capacity) = (cap(1), cap(3));
        // 8 + 4 tokens = 3 blocks: only rank 1 holds it, whatever the router says; the next (3
        // blocks again) fits nowhere now and waits, and the one after it waits behind it.
        r[0].admissions = vec![admission(1, 8), admission(2, 8), admission(3, 1)];
        let keys = RoutingKeys { block_size: 4, keyed_by_prompt_len: false };
        let p = derive_plan(5, r, &mut RoundRobin::default(), keys, &Collectives::default());
        assert_eq!(p.routed.iter().map(|(a, r)| (a.id, *r)).collect::<Vec<_>>(), vec![(1, 1)]);
        assert_eq!(p.deferred.iter().map(|a| a.id).collect::<Vec<_>>(), vec![2, 3]);
        assert!(!p.idle, "deferred work keeps the pool stepping");
        // A request larger than any rank is routed anyway: the rank fails it, naming its size.
        let mut r = vec![report(0), report(1)];
        (r[0].capacity, r[1].capacity) = (cap(8), cap(8));
        r[0].admissions = vec![admission(4, 60)];
        let p = derive_plan(6, r, &mut RoundRobin::default(), keys, &Collectives::default());
        assert_eq!(p.routed.len(), 1);
    }
}
