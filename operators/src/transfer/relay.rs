//! The way back for a prefill pool spread over processes (DESIGN §8, §11). A decode pool in a
//! process of its own sends each request's events back over the tcp link its handoff came by —
//! in a process of the prefill pool that may not be the one driving the workload. There the link
//! hands them to the [`EventRelay`], which queues each on the rank that sent the request's handoff
//! and wakes it; that rank emits them at its next step, and `emit`'s exchange carries them to
//! worker 0 of the driving process, like its own events.
//!
//! A rank that handed a request off this way stays in flight until the request's end (finished
//! or failed) has come back, so its pool — and this process's links — outlive the last request.

use crate::messages::Event;
use crate::pool::emit::EventSink;
use crate::pool::wake::RankWaker;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// One rank's queue of relayed events.
pub struct RelayQueue {
    events: Mutex<Vec<Event>>,
    waker: Arc<RankWaker>,
}

impl RelayQueue {
    /// Every event relayed to this rank since the last call.
    pub fn drain(&self) -> Vec<Event> {
        std::mem::take(&mut *self.events.lock())
    }
}

/// The events of a remote decode pool, routed to the ranks of this process that handed their
/// requests off.
#[derive(Default)]
pub struct EventRelay {
    /// The rank queue of each request handed off and not ended yet.
    routes: Mutex<HashMap<u64, Arc<RelayQueue>>>,
}

impl EventRelay {
    /// A queue for the rank `waker` wakes.
    pub fn queue(waker: Arc<RankWaker>) -> Arc<RelayQueue> {
        Arc::new(RelayQueue { events: Mutex::new(Vec::new()), waker })
    }

    /// `request`'s events go to `queue` (said before its handoff is sent, so none can come first).
    pub fn expect(&self, request: u64, queue: &Arc<RelayQueue>) {
        self.routes.lock().insert(request, queue.clone());
    }

    /// Nothing more is awaited for `request` (its handoff was refused, or it was cancelled).
    pub fn forget(&self, request: u64) {
        self.routes.lock().remove(&request);
    }

    /// Requests whose end has not come back.
    pub fn awaited(&self) -> usize {
        self.routes.lock().len()
    }

    /// Where a link to the remote decode pool hands the events coming back.
    pub fn sink(self: &Arc<Self>) -> Box<dyn EventSink + Send> {
        Box::new(RelaySink { relay: self.clone() })
    }
}

struct RelaySink {
    relay: Arc<EventRelay>,
}

impl EventSink for RelaySink {
    fn events(&mut self, _step: u64, events: Vec<Event>) {
        let mut woken: Vec<Arc<RelayQueue>> = Vec::new();
        {
            let mut routes = self.relay.routes.lock();
            for e in events {
                let id = e.id();
                let ends = matches!(e, Event::Finished { .. } | Event::Failed { .. });
                let queue = if ends { routes.remove(&id) } else { routes.get(&id).cloned() };
                let Some(queue) = queue else {
                    // Cancelled here after its handoff: the rank reported its end already.
                    tracing::debug!(request = id, "a relayed event of a request no rank awaits: dropped");
                    continue;
                };
                queue.events.lock().push(e);
                if !woken.iter().any(|q| Arc::ptr_eq(q, &queue)) {
                    woken.push(queue);
                }
            }
        }
        for queue in woken {
            queue.waker.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finished(id: u64) -> Event {
        Event::Finished {
            id,
            rank: 0,
            tokens: vec![1],
            token_times: Default::default(),
            started_ms: 0.0,
            cached_tokens: 0,
            logits_hash: 0,
            preemptions: 0,
        }
    }

    #[test]
    fn events_reach_the_rank_that_handed_the_request_off_and_an_end_closes_the_route() {
        let relay = Arc::new(EventRelay::default());
        let (a, b) = (EventRelay::queue(Default::default()), EventRelay::queue(Default::default()));
        relay.expect(1, &a);
        relay.expect(2, &b);
        relay.expect(3, &a);
        relay.forget(3);
        let mut sink = relay.sink();
        sink.events(
            0,
            vec![Event::Received { id: 1, rank: 0, taken_ms: 0.0, overlapped_ms: 0.0 }, finished(2), finished(3)],
        );
        assert!(a.waker.take() && b.waker.take(), "both ranks woken");
        assert_eq!(a.drain().iter().map(Event::id).collect::<Vec<_>>(), [1]);
        assert_eq!(b.drain().iter().map(Event::id).collect::<Vec<_>>(), [2]);
        assert_eq!(relay.awaited(), 1, "request 1 has not ended; 2 ended, 3 was forgotten");
        sink.events(0, vec![finished(1)]);
        assert_eq!(relay.awaited(), 0);
        assert_eq!(a.drain().len(), 1);
    }
}
