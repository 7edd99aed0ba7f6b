//! `emit(t)`: collects every rank's events on worker 0 (an exchange to worker 0), where the
//! run's results live. Events cross ranks only when a request ends (finished, failed or
//! cancelled), carrying the times its rank stamped on every token; the collector turns them into
//! records and tells the workload driver which requests completed. Holds no capability;
//! completions never flow back into the step loop (DESIGN §4: they must not gate a step).

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
