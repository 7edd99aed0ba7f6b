//! `load(t)`: hands offload load jobs to the rank's load thread. It consumes `forward`'s *loads*
//! output — the jobs of requests admitted at step `t` whose prefix the store holds further than
//! the rank's cache; each such request waits in its rank's `loading` stage, holding the blocks the
//! chunks will be written into. `load` holds no capability: a load's completion comes back on
//! the rank's queue (its waker fires), never through the dataflow, so a slow store holds back no
//! step (DESIGN §4, §9).
//!
//! Guarantee carried, with `rank/load.rs`: restored prefixes published (DESIGN §5) — a completed
//! load (every chunk, or none) is written in and published by the step that admits its request.

use crate::offload::LoadJob;
use crate::rank::Rank;
use std::cell::RefCell;
use std::rc::Rc;
use timely::dataflow::channels::pact::Pipeline;
use timely::dataflow::operators::generic::operator::Operator;
use timely::dataflow::StreamVec;

pub fn load<'scope>(loads: StreamVec<'scope, u64, LoadJob>, rank: Rc<RefCell<Rank>>) {
    loads.sink(Pipeline, "load", move |(input, _frontier)| {
        input.for_each(|_, data| {
            let jobs: Vec<LoadJob> = std::mem::take(data);
            if !jobs.is_empty() {
                rank.borrow_mut().submit_loads(jobs);
            }
        });
    });
}
