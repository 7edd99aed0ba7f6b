//! A rank's offload thread: jobs go in on a channel, each becomes a completion record that the
//! thread pushes on a queue and announces with the rank's waker. The rank drains the queue when
//! it runs (`schedule`, `poll`): a completion never gates a step and never arrives through the
//! dataflow (DESIGN §4). The save and load threads are both one of these.

use crate::pool::wake::RankWaker;
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
    pub returns: Arc<Returns<D>>,
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
        Ok(Worker { jobs: Some(tx), thread: Some(thread), returns })
    }

    /// Hands a job to the thread; `false` if the thread is gone (the caller drops the job).
    pub fn submit(&self, job: J) -> bool {
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
