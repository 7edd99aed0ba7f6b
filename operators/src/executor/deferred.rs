//! `cpu-deferred`: the CPU reference math on a thread of its own, completing each step after the
//! rank's next `delay_steps` launches (plus seeded jitter), or — once the rank has nothing more to
//! launch and flushes — as soon as it is computed, waking the rank's pool if it is parked. It
//! exercises everything an asynchronous executor (a GPU stream) asks of the runtime: the rank
//! schedules step t+1 before step t's tokens are known and names them by (sequence, step).

use super::cpu::{CpuStepRunner, OwnedStep};
use super::gate::{CompletionGate, Delay};
use super::{Executor, ExecutorContext};
use crate::step::{ExecutorError, StepCompletion, StepLaunch};
use crate::wake::RankWaker;
use std::collections::VecDeque;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;

enum Job {
    Phase { phase: usize, step: Option<OwnedStep> },
    Flush,
}

pub struct DeferredExecutor {
    jobs: Option<Sender<Job>>,
    done: Receiver<StepCompletion>,
    phases: usize,
    /// Steps launched whose completion has not been polled, oldest first.
    outstanding: VecDeque<u64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DeferredExecutor {
    pub fn spawn(
        runner: CpuStepRunner,
        delay: Delay,
        waker: Arc<RankWaker>,
        ctx: &ExecutorContext,
    ) -> Result<Self, String> {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let (outbox, done) = mpsc::channel();
        let phases = runner.phases();
        let thread = std::thread::Builder::new()
            .name(format!("kvflow-{}-rank{}-executor", ctx.pool, ctx.rank))
            .spawn(move || run(runner, CompletionGate::new(delay), inbox, outbox, waker))
            .map_err(|e| format!("cannot start the executor thread: {e}"))?;
        Ok(DeferredExecutor { jobs: Some(jobs), done, phases, outstanding: VecDeque::new(), thread: Some(thread) })
    }

    fn send(&mut self, job: Job) {
        // A send fails only when the thread is gone; `poll` reports its steps as failed then.
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
    }
}

fn run(
    mut runner: CpuStepRunner,
    mut gate: CompletionGate,
    inbox: Receiver<Job>,
    outbox: Sender<StepCompletion>,
    waker: Arc<RankWaker>,
) {
    let mut launch = 0;
    let mut ready = Vec::new();
    for job in inbox {
        match job {
            Job::Phase { phase, step } => {
                if phase == 0 {
                    launch = gate.launched();
                }
                if let Some(done) = runner.run_phase(phase, step) {
                    gate.hold(launch, done);
                }
            }
            Job::Flush => gate.flush(),
        }
        let flushing = gate.is_flushing();
        if gate.release(&mut ready) > 0 {
            for c in ready.drain(..) {
                if outbox.send(c).is_err() {
                    return; // the rank is gone
                }
            }
            if flushing {
                waker.wake();
            }
        }
    }
}

impl Executor for DeferredExecutor {
    fn phases(&self) -> usize {
        self.phases
    }

    fn launch(&mut self, step: &StepLaunch<'_>, phase: usize) {
        let owned = (phase == 0).then(|| {
            self.outstanding.push_back(step.step);
            OwnedStep::copy_of(step)
        });
        self.send(Job::Phase { phase, step: owned });
    }

    fn poll(&mut self, out: &mut Vec<StepCompletion>) {
        loop {
            match self.done.try_recv() {
                Ok(c) => {
                    self.outstanding.retain(|&s| s != c.step);
                    out.push(c);
                }
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Disconnected) => {
                    // The thread ended (it panicked): every step it held fails, once.
                    for step in self.outstanding.drain(..) {
                        let result = Err(ExecutorError::Stopped("the executor thread ended".into()));
                        out.push(StepCompletion { step, result });
                    }
                    return;
                }
            }
        }
    }

    fn flush(&mut self) {
        self.send(Job::Flush);
    }
}

impl Drop for DeferredExecutor {
    fn drop(&mut self) {
        self.jobs = None; // ends the thread's loop
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
