//! `align(t)`: gathers every rank's report for step `t` (a broadcast exchange) and, once the
//! frontier has passed `t` — every rank has reported — derives `StepPlan(t)`, the same on every
//! rank: the reports in rank order, each admission of `t` routed to a rank by the pool's router
//! (every rank runs the same router over the same inputs, so all agree), and whether the pool
//! parks.
//!
//! Holds a capability for `t` from the first report of `t` until the plan is emitted.
//!
//! Guarantee carried: collective alignment (DESIGN §5) — no rank acts on step `t` before it holds
//! the complete set of reports, and every rank derives the same plan from it, so any collective
//! a forward runs is a pure function of the plan and no rank can be one short.

use crate::messages::{RankReport, StepPlan};
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

pub fn align<'scope>(
    reports: StreamVec<'scope, u64, RankReport>,
    ranks: usize,
    mut router: Box<dyn Router>,
    keys: RoutingKeys,
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
                            let plan = derive_plan(t, got, router.as_mut(), keys);
                            output.session(&cap).give(plan);
                        }
                    }
                    return;
                }
                while let Some((&t, _)) = stash.first_key_value() {
                    if frontier.frontier().less_equal(&t) {
                        break;
                    }
                    let (cap, mut got) = stash.remove(&t).expect("first key");
                    got.sort_by_key(|r| r.rank);
                    assert_eq!(got.len(), ranks, "step {t}: {} reports for {ranks} ranks", got.len());
                    let plan = derive_plan(t, got, router.as_mut(), keys);
                    output.session(&cap).give(plan);
                    if hold_at == Some(t) {
                        held.push(cap);
                    }
                }
            }
        },
    )
}

/// `StepPlan(t)` from the complete, rank-ordered reports of `t`.
pub fn derive_plan(step: u64, mut ranks: Vec<RankReport>, router: &mut dyn Router, keys: RoutingKeys) -> StepPlan {
    // (With a partial set of reports — only under the test switch — ranks are missing here.)
    let admissions: Vec<_> = ranks.iter_mut().flat_map(|r| std::mem::take(&mut r.admissions)).collect();
    let cancels: Vec<u64> = ranks.iter_mut().flat_map(|r| std::mem::take(&mut r.cancels)).collect();
    let mut load: Vec<usize> = ranks.iter().map(|r| r.outstanding_tokens).collect();
    let mut routed = Vec::with_capacity(admissions.len());
    for a in admissions {
        let seed = if keys.keyed_by_prompt_len { a.prompt.len() as u64 } else { 0 };
        let hashes = block_hashes(&a.prompt, keys.block_size, seed);
        let rank = router.route(&RouteRequest { id: a.id, prompt: &a.prompt, block_hashes: &hashes }, &load);
        let rank = rank.min(ranks.len() - 1);
        load[rank] += a.prompt.len() + a.max_output_tokens;
        routed.push((a, rank));
    }
    let park = routed.is_empty() && cancels.is_empty() && ranks.iter().all(RankReport::idle);
    StepPlan { step, ranks, routed, cancels, park }
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
            admissions: vec![],
            cancels: vec![],
        }
    }

    fn plan(reports: Vec<RankReport>) -> StepPlan {
        derive_plan(7, reports, &mut RoundRobin::default(), RoutingKeys { block_size: 4, keyed_by_prompt_len: false })
    }

    #[test]
    fn the_pool_parks_only_when_no_rank_has_work_and_nothing_was_admitted() {
        assert!(plan(vec![report(0), report(1)]).park);
        // Each fact that means work, alone, keeps the pool running.
        let mut with_work = Vec::new();
        for flip in 0..5 {
            let mut r = vec![report(0), report(1)];
            match flip {
                0 => r[1].scheduled_tokens = 1,
                1 => r[1].waiting = 1,
                2 => r[0].running = 1,
                3 => r[0].cancels.push(4),
                _ => r[0].admissions.push(Admission { id: 1, prompt: vec![1], max_output_tokens: 1, warmup: false }),
            }
            with_work.push(plan(r).park);
        }
        assert_eq!(with_work, vec![false; 5]);
        // Facts that are not work do not move the decision.
        let mut r = vec![report(0), report(1)];
        r[0].outstanding_tokens = 99;
        r[1].scheduled_seqs = 0;
        assert!(plan(r).park);
    }

    #[test]
    fn every_admission_is_routed_once_and_reports_keep_rank_order() {
        let mut r = vec![report(0), report(1), report(2)];
        r[0].admissions = (0..5)
            .map(|id| Admission { id, prompt: vec![1, 2, 3, 4, 5], max_output_tokens: 2, warmup: false })
            .collect();
        let p = plan(r);
        assert_eq!(p.routed.iter().map(|(a, _)| a.id).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        assert_eq!(p.routed.iter().map(|(_, r)| *r).collect::<Vec<_>>(), vec![0, 1, 2, 0, 1]);
        assert!(p.ranks.iter().all(|r| r.admissions.is_empty()));
        assert_eq!(p.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), vec![0, 1, 2]);
    }
}
