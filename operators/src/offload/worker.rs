//! A rank's offload thread: jobs go in on a channel, each becomes a completion record that the
//! thread pushes on a queue and announces with the rank's waker. The rank drains the queue when
//! it runs (`schedule`, `poll`): a completion never gates a step and never arrives through the
//! dataflow (DESIGN §4). The save and load threads are both one of these.
//!
//! In a simulated run (`store = "sim"`) the worker has no thread: a job handed over is given
//! its end on the virtual clock at once, and at that instant (a clock event) its work is done
//! and its record pushed, so the rank sees it — and the store changes — when a real thread's
//! would have.

use crate::pool::wake::RankWaker;
use crate::sim::clock::VirtualClock;
use parking_lot::Mutex;
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

/// Completion records a thread hands back.
pub struct Returns<D> {
    done: Mutex<Vec<D>>,
}

impl<D> Default for Returns<D> {
    fn default() -> Self {
        Returns { done: Mutex::new(Vec::new()) }
    }
}

impl<D> Returns<D> {
    pub fn take(&self) -> Vec<D> {
        std::mem::take(&mut *self.done.lock())
    }

    fn push(&self, d: D) {
        self.done.lock().push(d);
    }
}

pub struct Worker<J, D> {
    jobs: Option<Sender<J>>,
    thread: Option<std::thread::JoinHandle<()>>,
    clocked: Option<Clocked<J, D>>,
    pub returns: Arc<Returns<D>>,
}

/// A simulated worker's work: a job handed over at a virtual instant gives when it ends, and
/// what it does then (which makes its record).
pub type Finish<D> = Box<dyn FnOnce() -> D + Send>;
type ClockedWork<J, D> = Box<dyn FnMut(J, u64) -> (u64, Finish<D>) + Send>;

/// A worker on a simulated run's virtual clock.
struct Clocked<J, D> {
    clock: Arc<VirtualClock>,
    waker: Arc<RankWaker>,
    /// Orders its records among the clock's events of one instant (the rank's index).
    order: u64,
    work: Mutex<ClockedWork<J, D>>,
}

impl<J: Send + 'static, D: Send + 'static> Worker<J, D> {
    /// Starts thread `name`, which runs `work` on each job in order. A job is dropped (with
    /// what it pins) before the rank is woken for its record.
    pub fn spawn(
        name: String,
        waker: Arc<RankWaker>,
        mut work: impl FnMut(J) -> D + Send + 'static,
    ) -> Result<Self, String> {
        let (tx, rx) = channel::<J>();
        let returns = Arc::new(Returns::default());
        let back = returns.clone();
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                for job in rx {
                    back.push(work(job));
                    waker.wake();
                }
            })
            .map_err(|e| format!("cannot start thread {name}: {e}"))?;
        Ok(Worker { jobs: Some(tx), thread: Some(thread), clocked: None, returns })
    }

    /// A worker on `clock`: `work` takes a job and the virtual instant it was handed over, and
    /// gives the instant the work ends and what it does then; its record is pushed and the rank
    /// woken at that instant (events of one instant ordered by `order`).
    pub fn clocked(
        clock: Arc<VirtualClock>,
        waker: Arc<RankWaker>,
        order: u64,
        work: impl FnMut(J, u64) -> (u64, Finish<D>) + Send + 'static,
    ) -> Self {
        let clocked = Clocked { clock, waker, order, work: Mutex::new(Box::new(work)) };
        Worker { jobs: None, thread: None, clocked: Some(clocked), returns: Arc::new(Returns::default()) }
    }

    /// Hands a job to the thread; `false` if the thread is gone (the caller drops the job).
    pub fn submit(&self, job: J) -> bool {
        if let Some(c) = &self.clocked {
            let now = c.clock.now_ns();
            let (end, finish) = (c.work.lock())(job, now);
            let (back, waker) = (self.returns.clone(), c.waker.clone());
            c.clock.at(
                end,
                c.order,
                Box::new(move || {
                    back.push(finish());
                    waker.wake();
                }),
            );
            return true;
        }
        self.jobs.as_ref().is_some_and(|j| j.send(job).is_ok())
    }
}

impl<J, D> Drop for Worker<J, D> {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
