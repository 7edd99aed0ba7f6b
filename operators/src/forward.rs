//! `forward(t)`: launches this rank's batch of step `t` on its executor, as `StepPlan(t)` says
//! (a rank with nothing scheduled launches nothing, and flushes its executor if it still has
//! steps in flight), then queues the admissions the plan routed to this rank and frees the
//! requests it cancels.
//!
//! Two completions (DESIGN §4), on these outputs:
//! - *launched*, on the feedback edge: `Launched` as soon as the batch is launched (or `Waiting`
//!   / `Parked` / `Ended` when the plan says the pool idles, parks or ends), delivered to
//!   `schedule(t + 1)` and `admit` — all the next step needs;
//! - *sampled*, to `emit`: the requests that ended (finished, failed, cancelled), each at the
//!   step whose completion ended it. This output holds a capability for every step of this rank
//!   still in flight, from its launch until its completion is applied, so whatever consumes it
//!   sees step `t`'s frontier pass only once step `t` has completed. Nothing downstream of it
//!   feeds back into the step loop;
//! - *stages* (expert parallelism only, instead of *launched*): the signal and the plan's
//!   exchange decision, along the rank's MoE chain (below);
//! - *saved*, to `save`: offload save jobs, each given only once the step that wrote its blocks
//!   has completed (holds no capability of its own);
//! - *loads*, to `load`: offload load jobs of the requests admitted at this step whose prefix the
//!   store holds further than the rank's cache (no capability of its own either).
//!
//! Whenever the pool idles — it parks (nothing held, nothing in flight) or waits on steps in
//! flight — every rank checks its accounting.
//!
//! With expert parallelism (`crate::experts`) the launch runs to the first MoE layer's routing and
//! the signal travels on, through each MoE layer's dispatch, experts and combine, to the
//! feedback edge: `t + 1` is scheduled once the whole step has launched on this rank.
//!
//! Guarantee carried: only `Launched(t)` gates `t + 1` (DESIGN §4).

use crate::messages::{Event, LoopSignal, StageToken, StepPlan};
use crate::offload::{LoadJob, SaveJob};
use crate::rank::Rank;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use timely::container::CapacityContainerBuilder;
use timely::dataflow::channels::pact::Pipeline;
use timely::dataflow::operators::generic::builder_rc::OperatorBuilder;
use timely::dataflow::operators::generic::{OutputBuilder, OutputBuilderSession};
use timely::dataflow::operators::Capability;
use timely::dataflow::StreamVec;

pub struct ForwardOutputs<'scope> {
    pub signals: StreamVec<'scope, u64, LoopSignal>,
    pub sampled: StreamVec<'scope, u64, Event>,
    /// With expert parallelism the step runs on through the MoE layers (`crate::experts`): the
    /// signal rides on the token they pass along, and `signals` stays empty.
    pub stages: StreamVec<'scope, u64, StageToken>,
    /// *saved*: offload save jobs, each given once the step that wrote its blocks has completed
    /// (for the `save` operator).
    pub saved: StreamVec<'scope, u64, SaveJob>,
    /// *loads*: offload load jobs of requests admitted at the step (for the `load` operator).
    pub loads: StreamVec<'scope, u64, LoadJob>,
}

pub fn forward<'scope>(
    plans: StreamVec<'scope, u64, StepPlan>,
    rank: Rc<RefCell<Rank>>,
    expert_parallel: bool,
    hold_at: Option<u64>,
) -> ForwardOutputs<'scope> {
    let mut builder = OperatorBuilder::new("forward".to_string(), plans.scope());
    let mut input = builder.new_input(plans, Pipeline);
    let (signal_out, signals) = builder.new_output();
    let (sampled_out, sampled) = builder.new_output();
    let (stage_out, stages) = builder.new_output();
    let (saved_out, saved) = builder.new_output();
    let (loads_out, loads) = builder.new_output();
    let mut signal_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<LoopSignal>>>::from(signal_out);
    let mut sampled_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<Event>>>::from(sampled_out);
    let mut stage_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<StageToken>>>::from(stage_out);
    let mut saved_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<SaveJob>>>::from(saved_out);
    let mut loads_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<LoadJob>>>::from(loads_out);
    builder.build(move |_caps| {
        // Capabilities on the sampled output, per step in flight on this rank.
        let mut in_flight: BTreeMap<u64, Capability<u64>> = BTreeMap::new();
        let mut held = Vec::new(); // test switch: capabilities kept forever
        move |_frontiers| {
            let mut signal_session = signal_out.activate();
            let mut sampled_session = sampled_out.activate();
            let mut stage_session = stage_out.activate();
            let mut saved_session = saved_out.activate();
            let mut loads_session = loads_out.activate();
            input.for_each_stamp(|stamp, data| {
                let Some(signal_cap) = stamp.retain_least(0) else { return };
                let Some(sampled_cap) = stamp.retain_least(1) else { return };
                let Some(stage_cap) = stamp.retain_least(2) else { return };
                let Some(saved_cap) = stamp.retain_least(3) else { return };
                let Some(loads_cap) = stamp.retain_least(4) else { return };
                let t = *signal_cap.time();
                for plans in data {
                    for plan in plans.drain(..) {
                        let mut rank = rank.borrow_mut();
                        rank.launch(t);
                        for (admission, r) in &plan.routed {
                            if *r == rank.index {
                                rank.admit(admission.clone());
                            }
                        }
                        if rank.index == 0 {
                            rank.reject_unroutable(&plan.unroutable);
                            rank.defer(&plan.deferred);
                        }
                        rank.cancel(&plan.cancels);
                        let signal = if plan.end {
                            LoopSignal::Ended
                        } else if plan.park {
                            LoopSignal::Parked
                        } else if plan.idle {
                            LoopSignal::Waiting
                        } else {
                            LoopSignal::Launched
                        };
                        if expert_parallel {
                            let exchange = !plan.shape.exchange_layers.is_empty();
                            let token = StageToken { signal, exchange, dispatched: Vec::new() };
                            stage_session.session(&stage_cap).give(token);
                        } else {
                            signal_session.session(&signal_cap).give(signal);
                        }
                        if plan.park {
                            rank.check_accounting(&format!("at park after step {t}"));
                        } else if plan.idle {
                            rank.check_accounting(&format!("while waiting after step {t}"));
                        }
                    }
                }
                let mut rank = rank.borrow_mut();
                emit_ended(&mut rank, &mut in_flight, &sampled_cap, &mut sampled_session);
                // Saves whose step has completed (the completion was applied just now, or at
                // this step's schedule).
                saved_session.session(&saved_cap).give_iterator(rank.take_save_jobs().into_iter());
                loads_session.session(&loads_cap).give_iterator(rank.take_load_jobs().into_iter());
                if rank.is_in_flight(t) {
                    in_flight.insert(t, sampled_cap);
                }
                if hold_at == Some(t) {
                    held.push(if expert_parallel { stage_cap } else { signal_cap });
                }
            });
        }
    });
    ForwardOutputs { signals, sampled, stages, saved, loads }
}

/// Emits the requests that ended, each at the step whose completion ended it, and lets go of the
/// capabilities of steps no longer in flight.
fn emit_ended(
    rank: &mut Rank,
    in_flight: &mut BTreeMap<u64, Capability<u64>>,
    now: &Capability<u64>,
    out: &mut OutputBuilderSession<'_, u64, CapacityContainerBuilder<Vec<Event>>>,
) {
    rank.poll();
    for (step, event) in rank.take_events() {
        let cap = in_flight.get(&step).unwrap_or(now);
        out.session(cap).give(event);
    }
    in_flight.retain(|&s, _| rank.is_in_flight(s));
}
