//! `admit`: drains the pool's ingress (requests released by the workload driver) on rank 0, and
//! wakes a parked pool.
//!
//! Consumes the feedback stream (`Launched`/`Parked` of step `t`, delivered at `t + 1`). Holds
//! one capability, on rank 0 only, at the next step at which the pool could need waking: `t + 2`
//! after seeing `Launched(t)` (so it never holds back `align(t + 1)`), `t + 1` after
//! `Parked(t)`. When parked and a request is waiting it emits a wake record at that time,
//! broadcast to every rank's `schedule`, so every rank resumes at the same step. Once the driver
//! closes the ingress and the pool is parked, it drops its capability and the dataflow ends.
//!
//! Guarantee carried: parking (DESIGN §4) — an idle pool runs no empty steps, yet every rank
//! learns of new work at the same step. Admitted requests ride on `align`'s broadcast (through
//! rank 0's report), never on this operator's own timestamps.

use crate::messages::{Admission, LoopSignal};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use timely::dataflow::channels::pact::Pipeline;
use timely::dataflow::operators::generic::builder_rc::OperatorBuilder;
use timely::dataflow::operators::generic::OutputBuilder;
use timely::dataflow::operators::vec::Broadcast;
use timely::dataflow::StreamVec;
use timely::scheduling::SyncActivator;

/// Where the workload driver hands requests (and cancellations) to a pool.
#[derive(Default)]
pub struct Ingress {
    queue: Mutex<VecDeque<Admission>>,
    cancels: Mutex<Vec<u64>>,
    activator: Mutex<Option<SyncActivator>>,
    closed: AtomicBool,
}

impl Ingress {
    /// Queues a request and wakes rank 0's `admit`.
    pub fn push(&self, a: Admission) {
        self.queue.lock().expect("ingress lock").push_back(a);
        self.wake();
    }

    /// Asks the pool to cancel a released request, wherever it is.
    pub fn cancel(&self, id: u64) {
        self.cancels.lock().expect("ingress lock").push(id);
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
        if let Some(a) = self.activator.lock().expect("ingress lock").as_ref() {
            // The worker may have finished; nothing to wake then.
            let _ = a.activate();
        }
    }

    fn drain(&self, into: &mut PendingWork) {
        into.admissions.extend(self.queue.lock().expect("ingress lock").drain(..));
        into.cancels.append(&mut self.cancels.lock().expect("ingress lock"));
    }
}

/// What `admit` drained, waiting for rank 0's `schedule` to put it in its report.
#[derive(Debug, Default)]
pub struct PendingWork {
    pub admissions: Vec<Admission>,
    pub cancels: Vec<u64>,
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
    ingress: Option<Arc<Ingress>>,
    pending: Pending,
    hold_at: Option<u64>,
) -> StreamVec<'scope, u64, u64> {
    let scope = feedback.scope();
    let mut builder = OperatorBuilder::new("admit".to_string(), scope);
    let info = builder.operator_info();
    let mut input = builder.new_input(feedback, Pipeline);
    let (output, wakes) = builder.new_output();
    let mut output = OutputBuilder::<_, timely::container::CapacityContainerBuilder<Vec<u64>>>::from(output);
    if let Some(ingress) = &ingress {
        *ingress.activator.lock().expect("ingress lock") =
            Some(scope.worker().sync_activator_for(info.address.to_vec()));
    }
    builder.build(move |mut caps| {
        let mut cap = caps.pop();
        if ingress.is_none() {
            cap = None; // only rank 0 can wake the pool
        }
        let mut parked = true; // nothing runs before the first request
        let mut held = Vec::new(); // test switch: capabilities kept forever
        move |_frontiers| {
            input.for_each_stamp(|stamp, data| {
                let Some(&t) = stamp.least() else { return };
                for signals in data {
                    for signal in signals.drain(..) {
                        match signal {
                            LoopSignal::Launched => {
                                parked = false;
                                if let Some(c) = cap.as_mut() {
                                    if *c.time() < t + 1 {
                                        c.downgrade(&(t + 1));
                                    }
                                }
                            }
                            LoopSignal::Parked => parked = true,
                        }
                    }
                }
            });
            if let (Some(c), Some(t)) = (cap.as_ref(), hold_at) {
                if *c.time() == t && held.is_empty() {
                    held.push(c.clone());
                }
            }
            let Some(ingress) = &ingress else { return };
            ingress.drain(&mut pending.borrow_mut());
            if parked && cap.is_some() {
                if !pending.borrow().is_empty() {
                    let c = cap.as_mut().expect("checked");
                    let t = *c.time();
                    output.activate().session(&*c).give(t);
                    c.downgrade(&(t + 1));
                    parked = false;
                } else if ingress.is_closed() {
                    cap = None;
                }
            }
        }
    });
    wakes.broadcast()
}
