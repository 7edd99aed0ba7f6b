//! `propose(t)`: the drafter's turn (DESIGN §4, §10), after `verify(t)` has applied what step `t`
//! sampled and before the signal reaches `schedule(t + 1)` over the feedback edge. Every sequence
//! that decodes next with nothing in flight and no proposal gets the drafter's proposal after its
//! last token (`Rank::propose`: prompt lookup over its tokens, or the drafts the executor's MTP
//! pass made when it sampled that token); the scheduler books as many as the width the request
//! earns allows. Built in pools with `[speculative]`.
//!
//! With expert parallelism and the `mtp` drafter the MTP layer's passes are collectives, so they
//! run inside the step, as operators of their own before `verify` (`crate::pool::experts`,
//! `dispatch/experts/combine[mtp.c]`); what they propose is picked up here.
//!
//! Completions that land after `verify(t)` (an asynchronous executor's, or one that woke a
//! waiting pool) are applied at `schedule`, which proposes for them there (`Rank::schedule`), so a
//! request never decodes without drafts only because of where its token landed.
//!
//! Time held: none beyond the signal it passes on. It carries no guarantee of DESIGN §5 by
//! itself: a proposal is made only from tokens the rank holds, never from one in flight, and
//! outputs never depend on it (`verify` keeps only what the target agrees with).

use crate::messages::LoopSignal;
use crate::rank::Rank;
use std::cell::RefCell;
use std::rc::Rc;
use timely::container::CapacityContainerBuilder;
use timely::dataflow::channels::pact::Pipeline;
use timely::dataflow::operators::generic::builder_rc::OperatorBuilder;
use timely::dataflow::operators::generic::OutputBuilder;
use timely::dataflow::StreamVec;

pub fn propose<'scope>(
    signals: StreamVec<'scope, u64, LoopSignal>,
    rank: Rc<RefCell<Rank>>,
    hold_at: Option<u64>,
) -> StreamVec<'scope, u64, LoopSignal> {
    let mut builder = OperatorBuilder::new("propose".to_string(), signals.scope());
    let mut input = builder.new_input(signals, Pipeline);
    let (output, signals) = builder.new_output();
    let mut output = OutputBuilder::<_, CapacityContainerBuilder<Vec<LoopSignal>>>::from(output);
    builder.build(move |_caps| {
        let mut held = Vec::new(); // test switch: capabilities kept forever
        move |_frontiers| {
            let mut out = output.activate();
            input.for_each_stamp(|stamp, data| {
                let Some(cap) = stamp.retain_least(0) else { return };
                rank.borrow_mut().propose();
                out.session(&cap).give_iterator(data.flat_map(|d| d.drain(..)));
                if hold_at == Some(*cap.time()) {
                    held.push(cap);
                }
            });
        }
    });
    signals
}
