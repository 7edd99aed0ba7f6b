//! `forward(t)`: runs this rank's batch of step `t` on its executor, as `StepPlan(t)` says
//! (a rank with nothing scheduled runs the plan's empty step; on the CPU executor that computes
//! nothing). Queues the admissions the plan routed to this rank for the next step.
//!
//! Emits `Launched` (or `Parked`, when the plan parks the pool) on the feedback edge, which
//! delivers it to `schedule(t + 1)` and `admit`; and the step's events (requests finished, failed
//! or cancelled) to `emit`. The CPU executor is synchronous, so the batch is
//! launched and sampled within this call; holds no capability past it.
//!
//! Guarantee carried: only `Launched(t)` gates `t + 1` (DESIGN §4).

use crate::messages::{Event, LoopSignal, StepPlan};
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
    pub events: StreamVec<'scope, u64, Event>,
}

pub fn forward<'scope>(
    plans: StreamVec<'scope, u64, StepPlan>,
    rank: Rc<RefCell<Rank>>,
    hold_at: Option<u64>,
) -> ForwardOutputs<'scope> {
    let mut builder = OperatorBuilder::new("forward".to_string(), plans.scope());
    let mut input = builder.new_input(plans, Pipeline);
    let (signal_out, signals) = builder.new_output();
    let (event_out, events) = builder.new_output();
    let mut signal_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<LoopSignal>>>::from(signal_out);
    let mut event_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<Event>>>::from(event_out);
    builder.build(move |_caps| {
        let mut held = Vec::new(); // test switch: capabilities kept forever
        move |_frontiers| {
            let mut signal_session = signal_out.activate();
            let mut event_session = event_out.activate();
            input.for_each_stamp(|stamp, data| {
                let Some(signal_cap) = stamp.retain_least(0) else { return };
                let event_cap = stamp.retain_least(1).expect("same stamp");
                for plans in data {
                    for plan in plans.drain(..) {
                        let mut rank = rank.borrow_mut();
                        let mut events = rank.execute();
                        for (admission, r) in plan.routed.iter() {
                            if *r == rank.index {
                                rank.admit(admission.clone());
                            }
                        }
                        events.extend(rank.cancel(&plan.cancels));
                        event_session.session(&event_cap).give_iterator(events.into_iter());
                        let signal = if plan.park { LoopSignal::Parked } else { LoopSignal::Launched };
                        signal_session.session(&signal_cap).give(signal);
                    }
                }
                if hold_at == Some(*signal_cap.time()) {
                    held.push(signal_cap);
                }
            });
        }
    });
    ForwardOutputs { signals, events }
}
