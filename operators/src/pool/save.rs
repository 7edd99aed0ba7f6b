//! `save(t)`: hands offload save jobs to the rank's save thread. It consumes `verify`'s *saved*
//! output, on which a job appears only once the step that wrote its blocks has completed, and
//! holds no capability: nothing it does flows back into the step loop, and a slow or failing
//! store pins only its own saves' blocks (DESIGN §4, §9).
//!
//! Guarantee carried: save fencing (DESIGN §5) — a save reads its blocks after the forward that
//! wrote them, and they return to the pool only with its completion record (`rank/offload.rs`).

use crate::offload::SaveJob;
use crate::rank::Rank;
use std::cell::RefCell;
use std::rc::Rc;
use timely::dataflow::channels::pact::Pipeline;
use timely::dataflow::operators::generic::operator::Operator;
use timely::dataflow::StreamVec;

pub fn save<'scope>(saved: StreamVec<'scope, u64, SaveJob>, rank: Rc<RefCell<Rank>>) {
    saved.sink(Pipeline, "save", move |(input, _frontier)| {
        input.for_each(|_, data| {
            let jobs: Vec<SaveJob> = std::mem::take(data);
            if !jobs.is_empty() {
                rank.borrow_mut().submit_saves(jobs);
            }
        });
    });
}
