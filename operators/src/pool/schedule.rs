//! `schedule(t)`: decides each rank's batch for step `t` and reports it.
//!
//! Triggered at `t` by `Launched(t − 1)` from the feedback edge (step `t − 1` launched: its batch
//! structure is known, which is all `t` needs — deferred output: step `t − 1`'s tokens may still
//! be in flight) or by a wake record of some rank's `admit`. A wake at `t` comes from another
//! rank that already saw the pool idle after `t − 1`; it is acted on only once this rank's own
//! `forward(t − 1)` has run (its `Parked`/`Waiting` signal arrived), holding the wake's
//! capability until then, so no rank decides step `t` before it has launched step `t − 1`.
//! Otherwise it holds a capability for `t` only while emitting the report. Rank 0's report
//! carries the requests `admit` drained, and whether the workload is done. Completions (sampled
//! tokens, finished requests) never reach this operator through a gating edge: the rank polls
//! its executor's completion queue when it runs.
//! A rank holding as many steps in flight as its executor keeps (`Executor::max_in_flight`)
//! decides nothing for `t` — no edge waits for it: the pool idles, and the next completion's
//! wake-up schedules again.
//!
//! Guarantee carried: only what the next step needs gates it (DESIGN §4).

use crate::messages::{LoopSignal, RankReport};
use crate::pool::admit::Pending;
use crate::rank::Rank;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use timely::dataflow::channels::pact::Pipeline;
use timely::dataflow::operators::generic::builder_rc::OperatorBuilder;
use timely::dataflow::operators::generic::OutputBuilder;
use timely::dataflow::operators::Capability;
use timely::dataflow::StreamVec;

pub fn schedule<'scope>(
    feedback: StreamVec<'scope, u64, LoopSignal>,
    wakes: StreamVec<'scope, u64, u64>,
    rank: Rc<RefCell<Rank>>,
    pending: Pending,
    hold_at: Option<u64>,
) -> StreamVec<'scope, u64, RankReport> {
    let mut builder = OperatorBuilder::new("schedule".to_string(), feedback.scope());
    let mut launched = builder.new_input(feedback, Pipeline);
    let mut woken = builder.new_input(wakes, Pipeline);
    let (output, reports) = builder.new_output();
    let mut output = OutputBuilder::<_, timely::container::CapacityContainerBuilder<Vec<RankReport>>>::from(output);
    builder.build(move |_caps| {
        let mut last_scheduled: Option<u64> = None;
        // The latest `t` at which this rank's forward said the pool idles after `t − 1`.
        let mut idle_at: Option<u64> = None;
        // Wakes waiting for that, by step.
        let mut early_wakes: BTreeMap<u64, Capability<u64>> = BTreeMap::new();
        let mut held = Vec::new(); // test switch: capabilities kept forever
        move |_frontiers| {
            let mut out = output.activate();
            let mut triggers = Vec::new();
            launched.for_each_stamp(|stamp, data| {
                let Some(&t) = stamp.least() else { return };
                let mut launched_here = false;
                for signal in data.flat_map(|d| d.drain(..)) {
                    match signal {
                        LoopSignal::Launched => launched_here = true,
                        LoopSignal::Waiting | LoopSignal::Parked => idle_at = Some(idle_at.map_or(t, |i| i.max(t))),
                        LoopSignal::Ended => {}
                    }
                }
                if let (true, Some(cap)) = (launched_here, stamp.retain_least(0)) {
                    triggers.push(cap);
                }
            });
            woken.for_each_stamp(|stamp, data| {
                data.for_each(|d| d.clear());
                if let Some(cap) = stamp.retain_least(0) {
                    early_wakes.entry(*cap.time()).or_insert(cap);
                }
            });
            while let Some(entry) = early_wakes.first_entry() {
                let t = *entry.key();
                if t > 0 && idle_at.is_none_or(|i| i < t) {
                    break; // this rank's forward(t − 1) has not run yet
                }
                triggers.push(entry.remove());
            }
            triggers.sort_by_key(|c| *c.time());
            for cap in triggers {
                let t = *cap.time();
                if last_scheduled.is_some_and(|l| l >= t) {
                    continue;
                }
                last_scheduled = Some(t);
                let mut report = rank.borrow_mut().schedule(t);
                let mut pending = pending.borrow_mut();
                report.admissions.append(&mut pending.admissions);
                report.cancels.append(&mut pending.cancels);
                report.closing = pending.closed;
                out.session(&cap).give(report);
                if hold_at == Some(t) {
                    held.push(cap);
                }
            }
        }
    });
    reports
}
