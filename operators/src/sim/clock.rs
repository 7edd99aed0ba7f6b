//! The virtual clock of a simulated run: a time that moves only when the run can do nothing more
//! at the current instant (the discrete-event rule), and the queue of what becomes due later (a
//! step's completion, a request's arrival).
//!
//! The clock does not decide when nothing more can happen: the stepper that runs every worker of
//! the run on one thread does (`src/runtime/simulated.rs`), and then calls
//! [`VirtualClock::fire_next`], which moves the time to the earliest event and runs every event
//! due then, in the order of their keys. Events at one instant run in `(order, seq)` order:
//! `order` is the caller's (a rank, a request), `seq` the order they were queued in — on one
//! thread, so a run is reproducible from its seed.
//!
//! The thread that steps the run enters the clock ([`VirtualClock::enter`]); there
//! `crate::messages::wall_ms` reads the virtual time, so every time a rank stamps (tokens, steps)
//! and the collector records is virtual, and nothing else changes.

use parking_lot::Mutex;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Something that becomes due at a virtual instant.
pub type Event = Box<dyn FnOnce() + Send>;

/// The clock: the time (nanoseconds since the run began) and the events still due.
#[derive(Default)]
pub struct VirtualClock {
    state: Mutex<ClockState>,
}

#[derive(Default)]
struct ClockState {
    now_ns: u64,
    /// Due events by `(at, order, seq)`.
    due: BTreeMap<(u64, u64, u64), Event>,
    next_seq: u64,
    fired: u64,
}

thread_local! {
    static ENTERED: RefCell<Option<Arc<VirtualClock>>> = const { RefCell::new(None) };
}

/// While held, [`VirtualClock::current`] on this thread is the entered clock.
pub struct Entered {
    previous: Option<Arc<VirtualClock>>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        let previous = self.previous.take();
        ENTERED.with(|c| *c.borrow_mut() = previous);
    }
}

impl VirtualClock {
    pub fn new() -> Arc<Self> {
        Arc::new(VirtualClock::default())
    }

    /// Makes this the clock of the calling thread until the guard drops.
    pub fn enter(self: &Arc<Self>) -> Entered {
        let previous = ENTERED.with(|c| c.borrow_mut().replace(self.clone()));
        Entered { previous }
    }

    /// The clock the calling thread entered, if any.
    pub fn current() -> Option<Arc<VirtualClock>> {
        ENTERED.with(|c| c.borrow().clone())
    }

    pub fn now_ns(&self) -> u64 {
        self.state.lock().now_ns
    }

    pub fn now_ms(&self) -> f64 {
        self.now_ns() as f64 / 1e6
    }

    /// Queues `event` for virtual time `at_ns` (now, if that has passed), ordered by `order`
    /// among the events of its instant.
    pub fn at(&self, at_ns: u64, order: u64, event: Event) {
        let mut s = self.state.lock();
        let at = at_ns.max(s.now_ns);
        let seq = s.next_seq;
        s.next_seq += 1;
        s.due.insert((at, order, seq), event);
    }

    /// When the earliest queued event is due.
    pub fn next_due_ns(&self) -> Option<u64> {
        self.state.lock().due.keys().next().map(|k| k.0)
    }

    /// Moves the time to the earliest queued event and runs every event due then, in order;
    /// `false` when nothing is queued (the time stays).
    pub fn fire_next(&self) -> bool {
        let batch: Vec<Event> = {
            let mut s = self.state.lock();
            let Some(&(at, ..)) = s.due.keys().next() else { return false };
            s.now_ns = at;
            let later = s.due.split_off(&(at + 1, 0, 0));
            let batch = std::mem::replace(&mut s.due, later);
            s.fired += batch.len() as u64;
            batch.into_values().collect()
        };
        // Run outside the lock: an event may queue another (at this instant or later).
        for event in batch {
            event();
        }
        true
    }

    /// Events run so far.
    pub fn fired(&self) -> u64 {
        self.state.lock().fired
    }

    /// Events still queued.
    pub fn queued(&self) -> usize {
        self.state.lock().due.len()
    }
}

/// Nanoseconds from seconds (rounded up, at least 1: a cost never takes no time).
pub fn ns_of_seconds(seconds: f64) -> u64 {
    if seconds.is_finite() && seconds > 0.0 {
        ((seconds * 1e9).ceil() as u64).max(1)
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_run_at_their_instant_in_order_and_the_time_moves_only_when_fired() {
        let clock = VirtualClock::new();
        let seen: Arc<Mutex<Vec<(u64, &str)>>> = Arc::default();
        let log = |name: &'static str| {
            let (seen, clock2) = (seen.clone(), clock.clone());
            Box::new(move || seen.lock().push((clock2.now_ns(), name))) as Event
        };
        clock.at(50, 2, log("b"));
        clock.at(50, 1, log("a"));
        clock.at(20, 9, log("first"));
        assert_eq!(clock.now_ns(), 0);
        assert!(clock.fire_next());
        assert_eq!(*seen.lock(), [(20, "first")]);
        // an event queued for a past instant runs at the current one
        clock.at(5, 0, log("late"));
        assert!(clock.fire_next());
        assert!(clock.fire_next());
        assert_eq!(*seen.lock(), [(20, "first"), (20, "late"), (50, "a"), (50, "b")]);
        assert!(!clock.fire_next());
        assert_eq!((clock.now_ns(), clock.fired(), clock.queued()), (50, 4, 0));
    }

    #[test]
    fn only_the_thread_that_entered_reads_the_clock() {
        let clock = VirtualClock::new();
        assert!(VirtualClock::current().is_none());
        {
            let _in = clock.enter();
            assert!(VirtualClock::current().is_some_and(|c| Arc::ptr_eq(&c, &clock)));
            assert!(std::thread::spawn(|| VirtualClock::current().is_none()).join().unwrap());
        }
        assert!(VirtualClock::current().is_none());
    }
}
