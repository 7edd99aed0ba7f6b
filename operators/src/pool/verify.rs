//! `verify(t)`: applies the *sampled* completions (DESIGN §4) — every step's tokens, and on a step
//! that fed drafts, the decision which of them hold — as step `t`'s launched signal passes on its
//! way to `propose(t)` and the feedback edge. It never waits for one: it applies what the rank's
//! executor has ready (a synchronous executor: step `t`'s own; an asynchronous one: older steps'),
//! and whatever lands later is applied at the next signal, or by `schedule` when the rank wakes.
//!
//! Verification: the executor scored every draft (`Sampled::checks`); the drafts that hold are
//! the leading run it kept, and when one was rejected the sequence's next launch sets its state
//! slot back to the copy kept after its last token that held (`Rank::verify_drafts`,
//! `StateOp::Rewind`).
//!
//! Time held: a capability on *sampled* for every step of this rank still in flight, from its
//! signal until its completion is applied, so `emit` sees step `t`'s frontier pass only once step
//! `t` has completed; nothing downstream of *sampled* feeds back into the step loop. Its outputs:
//! - the signal, unchanged, to `propose(t)` (or the feedback edge);
//! - *sampled*, to `emit`: the requests that ended (finished, failed, cancelled), each at the step
//!   whose completion ended it;
//! - *saved*, to `save`: offload save jobs, each given only once the step that wrote its blocks
//!   has completed (no capability of its own).
//!
//! Guarantees carried: rejected drafts leave no trace in recurrent state (DESIGN §10); only
//! `Launched(t)` gates `t + 1` (it passes the signal on whether or not step `t` completed).

use crate::messages::{Event, LoopSignal};
use crate::offload::SaveJob;
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

pub struct VerifyOutputs<'scope> {
    pub signals: StreamVec<'scope, u64, LoopSignal>,
    /// The requests that ended, each at the step whose completion ended it.
    pub sampled: StreamVec<'scope, u64, Event>,
    /// Offload save jobs of completed steps (for the `save` operator).
    pub saved: StreamVec<'scope, u64, SaveJob>,
}

pub fn verify<'scope>(
    signals: StreamVec<'scope, u64, LoopSignal>,
    rank: Rc<RefCell<Rank>>,
    hold_at: Option<u64>,
) -> VerifyOutputs<'scope> {
    let mut builder = OperatorBuilder::new("verify".to_string(), signals.scope());
    let mut input = builder.new_input(signals, Pipeline);
    let (signal_out, signals) = builder.new_output();
    let (sampled_out, sampled) = builder.new_output();
    let (saved_out, saved) = builder.new_output();
    let mut signal_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<LoopSignal>>>::from(signal_out);
    let mut sampled_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<Event>>>::from(sampled_out);
    let mut saved_out = OutputBuilder::<_, CapacityContainerBuilder<Vec<SaveJob>>>::from(saved_out);
    builder.build(move |_caps| {
        // Capabilities on the sampled output, per step in flight on this rank.
        let mut in_flight: BTreeMap<u64, Capability<u64>> = BTreeMap::new();
        let mut held = Vec::new(); // test switch: capabilities kept forever
        move |_frontiers| {
            let mut signal_session = signal_out.activate();
            let mut sampled_session = sampled_out.activate();
            let mut saved_session = saved_out.activate();
            input.for_each_stamp(|stamp, data| {
                let Some(signal_cap) = stamp.retain_least(0) else { return };
                let Some(sampled_cap) = stamp.retain_least(1) else { return };
                let Some(saved_cap) = stamp.retain_least(2) else { return };
                let t = *signal_cap.time();
                let mut rank = rank.borrow_mut();
                rank.poll();
                emit_ended(&mut rank, &mut in_flight, &sampled_cap, &mut sampled_session);
                saved_session.session(&saved_cap).give_iterator(rank.take_save_jobs().into_iter());
                if rank.is_in_flight(t) {
                    in_flight.insert(t, sampled_cap);
                }
                signal_session.session(&signal_cap).give_iterator(data.flat_map(|d| d.drain(..)));
                if hold_at == Some(t) {
                    held.push(signal_cap);
                }
            });
        }
    });
    VerifyOutputs { signals, sampled, saved }
}

/// Emits the requests that ended, each at the step whose completion ended it, and lets go of the
/// capabilities of steps no longer in flight.
fn emit_ended(
    rank: &mut Rank,
    in_flight: &mut BTreeMap<u64, Capability<u64>>,
    now: &Capability<u64>,
    out: &mut OutputBuilderSession<'_, u64, CapacityContainerBuilder<Vec<Event>>>,
) {
    for (step, event) in rank.take_events() {
        let cap = in_flight.get(&step).unwrap_or(now);
        out.session(cap).give(event);
    }
    in_flight.retain(|&s, _| rank.is_in_flight(s));
}
