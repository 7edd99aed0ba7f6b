//! `emit(t)`: collects every rank's events on worker 0 (an exchange to worker 0) and hands them
//! to the run's collector. It consumes `verify`'s *sampled* output: each request that ended
//! (finished, failed or cancelled) arrives at the step whose completion ended it, carrying when
//! its first and last tokens became known on its rank; events cross ranks only then (and events a
//! decode pool in another process sent back through a prefill rank, at the step that rank
//! drained them: `transfer::relay`; and a streaming request's tokens, `Event::Tokens`, at the
//! step that sampled them — `kvflow serve` asks for them). Holds no
//! capability; nothing it receives flows back into the step loop (DESIGN §4: completions must
//! not gate a step).

use crate::messages::Event;
use timely::dataflow::channels::pact::Exchange;
use timely::dataflow::operators::generic::operator::Operator;
use timely::dataflow::StreamVec;

/// Receives the events of a pool (on worker 0 only).
pub trait EventSink: 'static {
    fn events(&mut self, step: u64, events: Vec<Event>);
}

pub fn emit<'scope>(events: StreamVec<'scope, u64, Event>, mut sink: Option<Box<dyn EventSink>>) {
    events.sink(Exchange::new(|_e: &Event| 0u64), "emit", move |(input, _frontier)| {
        input.for_each_stamp(|stamp, data| {
            let step = stamp.least().copied().unwrap_or_default();
            let got: Vec<Event> = data.flat_map(|d| d.drain(..)).collect();
            if let Some(s) = sink.as_mut() {
                s.events(step, got);
            }
        });
    });
}
