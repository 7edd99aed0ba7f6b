//! `forward(t)`: launches this rank's batch of step `t` on its executor, as `StepPlan(t)` says
//! (a rank with nothing scheduled launches nothing, and flushes its executor if it still has
//! steps in flight), then queues the admissions the plan routed to this rank and frees the
//! requests it cancels; a rank the plan names in `resync` (its cache events came with a gap)
//! sends its whole cache with its next report.
//!
//! Its outputs:
//! - *launched*, on to `verify(t)` (and from there the feedback edge): `Launched` as soon as the
//!   batch is launched (or `Waiting` / `Parked` / `Ended` when the plan says the pool idles,
//!   parks or ends) — all `schedule(t + 1)` needs. The *sampled* completion is `verify`'s: the
//!   rank's executor queues it, and `verify(t)` applies what is ready when the signal passes;
//! - *stages* (expert parallelism only, instead of *launched*): the signal and the plan's
//!   exchange decision, along the rank's MoE chain (below);
//! - *loads*, to `load`: offload load jobs of the requests admitted at this step whose prefix the
//!   store holds further than the rank's cache (holds no capability of its own).
//!
//! Whenever the pool idles — it parks (nothing held, nothing in flight) or waits on steps in
//! flight — every rank checks its accounting.
//!
//! With expert parallelism (`crate::pool::experts`) the launch runs to the first MoE layer's routing and
//! the signal travels on, through each MoE layer's dispatch, experts and combine, to `verify`:
//! `t + 1` is scheduled once the whole step has launched on this rank.
//!
//! Guarantee carried: only `Launched(t)` gates `t + 1` (DESIGN §4).

use crate::messages::{LoopSignal, StageToken, StepPlan};
use crate::offload::LoadJob;
use crate::rank::Rank;
use std::cell::RefCell;
use std::rc::Rc;
use timely::container::CapacityContainerBuilder;
use timely::dataflow::channels::pact::Pipeline;
use timely::dataflow::operators::generic::builder_rc::OperatorBuilder;
use timely::dataflow::operators::generic::OutputBuilder;
use timely::dataflow::StreamVec;

pub struct ForwardOutputs<'scope> {
    pub signals: StreamVec<'scope, u64, LoopSignal>,
    /// With expert parallelism the step runs on through the MoE layers (`crate::pool::experts`): the
    /// signal rides on the token they pass along, and `signals` stays empty.
    pub stages: StreamVec<'scope, u64, StageToken>,
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
    let (stage_out, stages) = builder.new_output();
    let (loads_out, loads) = builder.new_output();
    let mut signal_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<LoopSignal>>>::from(signal_out);
    let mut stage_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<StageToken>>>::from(stage_out);
    let mut loads_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<LoadJob>>>::from(loads_out);
    builder.build(move |_caps| {
        let mut held = Vec::new(); // test switch: capabilities kept forever
        move |_frontiers| {
            let mut signal_session = signal_out.activate();
            let mut stage_session = stage_out.activate();
            let mut loads_session = loads_out.activate();
            input.for_each_stamp(|stamp, data| {
                let Some(signal_cap) = stamp.retain_least(0) else { return };
                let Some(stage_cap) = stamp.retain_least(1) else { return };
                let Some(loads_cap) = stamp.retain_least(2) else { return };
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
                        if plan.resync.contains(&rank.index) {
                            rank.owe_cache_snapshot();
                        }
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
                let jobs = rank.borrow_mut().take_load_jobs();
                loads_session.session(&loads_cap).give_iterator(jobs.into_iter());
                if hold_at == Some(t) {
                    held.push(if expert_parallel { stage_cap } else { signal_cap });
                }
            });
        }
    });
    ForwardOutputs { signals, stages, loads }
}
