//! `admit`: wakes a parked pool, from any rank. Rank 0 also drains the pool's ingress (requests
//! and cancellations released by the workload driver) for its `schedule` to report. Under router
//! `kv-aware` the ingress attaches each request's cached prefixes per rank as it is pushed, on
//! the pushing thread (the driver's, or a link's for a handoff), so no step waits on the index.
//!
//! Consumes the feedback stream (`Launched`/`Waiting`/`Parked`/`Ended` of step `t`, delivered at
//! `t + 1`) and the wake loop (every wake record, delivered one step later). Holds a capability
//! only while the pool idles: from the start (time 0) and from each `Waiting(t)` or `Parked(t)`
//! (at `t + 1`, retained from that signal) until the pool resumes. When idle and something needs
//! it — the ingress has work (rank 0), the workload is done after a park (rank 0: the pool must
//! run its ending step), or something raised the rank's [`RankWaker`] (a completion landed on
//! this rank) — it emits a wake record at its capability's time; the record is broadcast to every rank's
//! `schedule`, so every rank resumes at the same step, and through the wake loop to every
//! `admit`, which then lets go of its own capability. It never holds a capability while the pool
//! runs, so it never holds back `align`.
//!
//! Guarantees carried: parking (DESIGN §4) — an idle pool runs no empty steps, yet every rank
//! learns of new work at the same step (admissions ride on `align`'s broadcast through rank 0's
//! report, never on this operator's timestamps) — and any rank can wake its pool.

use crate::messages::{Admission, LoopSignal};
use crate::policy::kv_index::SharedKvIndex;
use crate::pool::wake::RankWaker;
use parking_lot::Mutex;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use timely::dataflow::channels::pact::Pipeline;
use timely::dataflow::operators::generic::builder_rc::OperatorBuilder;
use timely::dataflow::operators::generic::OutputBuilder;
use timely::dataflow::operators::vec::Broadcast;
use timely::dataflow::operators::Capability;
use timely::dataflow::StreamVec;
use timely::progress::Antichain;

/// Where the workload driver hands requests (and cancellations) to a pool.
#[derive(Default)]
pub struct Ingress {
    queue: Mutex<VecDeque<Admission>>,
    routing: Mutex<Option<IngressRouting>>,
    cancels: Mutex<Vec<u64>>,
    waker: Mutex<Option<Arc<RankWaker>>>,
    closed: AtomicBool,
}

/// What the ingress needs to ask the KV-aware routing index about a request's prompt.
#[derive(Clone)]
pub struct IngressRouting {
    pub index: SharedKvIndex,
    pub block_size: usize,
    /// The pool's prefix keys are seeded by the prompt's length (families without paged KV).
    pub keyed_by_prompt_len: bool,
}

impl Ingress {
    /// Asks `routing`'s index, for every request pushed from now on, how much of its prompt each
    /// rank holds (router `kv-aware`).
    pub fn route_with(&self, routing: IngressRouting) {
        *self.routing.lock() = Some(routing);
    }

    /// Queues a request and wakes rank 0's `admit`. Under router `kv-aware` it first attaches
    /// each rank's cached prefix of the prompt as the index reports it now: the question is
    /// asked here, on the pushing thread, so no step of the pool ever waits for the index.
    pub fn push(&self, mut a: Admission) {
        let routing = self.routing.lock().clone();
        if let Some(r) = routing {
            let seed = if r.keyed_by_prompt_len { a.prompt.len() as u64 } else { 0 };
            let hashes = crate::policy::prefix_cache::block_hashes(&a.prompt, r.block_size, seed);
            // the index is held only to send the question; its answer is awaited outside it
            let answer = r.index.lock().ask(&hashes);
            a.cached = answer.recv().unwrap_or_default();
        }
        self.queue.lock().push_back(a);
        self.wake();
    }

    /// Asks the pool to cancel a released request, wherever it is.
    pub fn cancel(&self, id: u64) {
        self.cancels.lock().push(id);
        self.wake();
    }

    /// No more requests will come: the pool ends once it is idle.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.wake();
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    fn wake(&self) {
        if let Some(w) = self.waker.lock().as_ref() {
            w.activate();
        }
    }

    /// Moves what was released into `into`; `into.closed` once nothing more will come.
    fn drain(&self, into: &mut PendingWork) {
        let closed = self.is_closed(); // read first: whatever was pushed before closing is drained
        into.admissions.extend(self.queue.lock().drain(..));
        into.cancels.append(&mut self.cancels.lock());
        into.closed = closed;
    }
}

/// What `admit` drained, waiting for rank 0's `schedule` to put it in its report.
#[derive(Debug, Default)]
pub struct PendingWork {
    pub admissions: Vec<Admission>,
    pub cancels: Vec<u64>,
    /// The ingress is closed (everything released before has been drained).
    pub closed: bool,
}

impl PendingWork {
    pub fn is_empty(&self) -> bool {
        self.admissions.is_empty() && self.cancels.is_empty()
    }
}

/// Shared between rank 0's `admit` and `schedule` (same worker).
pub type Pending = Rc<RefCell<PendingWork>>;

/// Builds `admit`. `ingress` is `Some` on rank 0 only. Returns the wake stream, broadcast.
pub fn admit<'scope>(
    feedback: StreamVec<'scope, u64, LoopSignal>,
    wake_loop: StreamVec<'scope, u64, u64>,
    ingress: Option<Arc<Ingress>>,
    pending: Pending,
    waker: Arc<RankWaker>,
    hold_at: Option<u64>,
) -> StreamVec<'scope, u64, u64> {
    let scope = feedback.scope();
    let mut builder = OperatorBuilder::new("admit".to_string(), scope);
    let info = builder.operator_info();
    let mut signals = builder.new_input(feedback, Pipeline);
    // The wake loop only tells this operator to let go of a capability: no connection to its
    // output, so the loop adds nothing to what holds the pool's steps back.
    let mut woken = builder.new_input_connection(wake_loop, Pipeline, []);
    let (output, wakes) = builder.new_output_connection([(0, Antichain::from_elem(Default::default()))]);
    let mut output = OutputBuilder::<_, timely::container::CapacityContainerBuilder<Vec<u64>>>::from(output);
    waker.set_activator(scope.worker().sync_activator_for(info.address.to_vec()));
    if let Some(ingress) = &ingress {
        *ingress.waker.lock() = Some(waker.clone());
    }
    builder.build(move |mut caps| {
        // Parked from the start: nothing runs before the first request.
        let mut parked: Option<Capability<u64>> = caps.pop();
        let mut parked_for_good = true; // parked (not waiting): only new work wakes the pool
                                        // Every step up to this one has been woken (by some rank).
        let mut woken_through: Option<u64> = None;
        let mut held = Vec::new(); // test switch: capabilities kept forever
        move |_frontiers| {
            woken.for_each_stamp(|_stamp, data| {
                for t in data.flat_map(|d| d.drain(..)) {
                    woken_through = Some(woken_through.map_or(t, |w| w.max(t)));
                }
            });
            signals.for_each_stamp(|stamp, data| {
                let Some(&t) = stamp.least() else { return };
                if hold_at == Some(t) && held.is_empty() {
                    held.extend(stamp.retain_least(0));
                }
                for signal in data.flat_map(|d| d.drain(..)) {
                    match signal {
                        LoopSignal::Launched => {}
                        LoopSignal::Waiting | LoopSignal::Parked => {
                            if woken_through.is_none_or(|w| w < t) {
                                parked = stamp.retain_least(0);
                                parked_for_good = signal == LoopSignal::Parked;
                            }
                        }
                        LoopSignal::Ended => parked = None,
                    }
                }
            });
            // Someone woke the pool at or after the time we hold: let go.
            if parked.as_ref().is_some_and(|c| woken_through.is_some_and(|w| w >= *c.time())) {
                parked = None;
            }
            if let Some(ingress) = &ingress {
                ingress.drain(&mut pending.borrow_mut());
            }
            let Some(cap) = parked.as_ref() else { return };
            let work = pending.borrow();
            let wanted = !work.is_empty() || (work.closed && parked_for_good && ingress.is_some());
            drop(work);
            if wanted || waker.take() {
                let t = *cap.time();
                output.activate().session(cap).give(t);
                waker.woke_pool();
                woken_through = Some(t);
                parked = None;
            }
        }
    });
    wakes.broadcast()
}
