//! `cpu-deferred`: the CPU reference math on a thread of its own. The rank launches and moves
//! on; the thread computes each step while the rank schedules and launches the next ones. A step
//! completes after the rank's next `delay_steps` launches (plus seeded jitter): at that launch
//! the step's completion is handed over, waiting for the thread if it is still computing (the
//! device being the bottleneck bounds how far the rank runs ahead, as a GPU stream's would). Once
//! the rank has nothing more to launch and flushes, each completion is handed over as soon as it
//! is computed, and once the thread has handed back everything launched before the flush it wakes
//! the rank (its pool is parked then). It exercises everything an
//! asynchronous executor asks of the runtime: the rank schedules step t+1 before step t's tokens
//! are known and names them by (sequence, step).

use super::contract::{Executor, ExecutorContext};
use super::cpu::CpuStepRunner;
use super::gate::{CompletionGate, Delay};
use super::owned_step::OwnedStep;
use crate::pool::wake::RankWaker;
use crate::step::{ExecutorError, StepCompletion, StepLaunch};
use std::collections::VecDeque;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;

enum Job {
    Phase {
        phase: usize,
        step: Option<Box<OwnedStep>>,
    },
    /// Every step launched before this is handed back: wake the rank.
    Flush,
}

pub struct DeferredExecutor {
    jobs: Option<Sender<Job>>,
    done: Receiver<StepCompletion>,
    phases: usize,
    gate: CompletionGate,
    /// Steps launched whose completion the thread has not handed back: (step, due launch count).
    computing: VecDeque<(u64, u64)>,
    /// The rank has nothing more to launch: hand every completion over as soon as it arrives.
    flushing: bool,
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
            .spawn(move || run(runner, inbox, outbox, waker))
            .map_err(|e| format!("cannot start the executor thread: {e}"))?;
        Ok(DeferredExecutor {
            jobs: Some(jobs),
            done,
            phases,
            gate: CompletionGate::new(delay),
            computing: VecDeque::new(),
            flushing: false,
            thread: Some(thread),
        })
    }

    /// Moves a completion from the thread into the gate.
    fn receive(&mut self, c: StepCompletion) {
        match self.computing.iter().position(|&(s, _)| s == c.step) {
            Some(i) => {
                let (_, due) = self.computing.remove(i).expect("found");
                self.gate.hold(due, c);
            }
            None => tracing::error!(step = c.step, "the executor thread completed a step it was not given"),
        }
    }

    /// The thread is gone: every step it held fails, once.
    fn thread_gone(&mut self) {
        for (step, due) in std::mem::take(&mut self.computing) {
            let result = Err(ExecutorError::Stopped("the executor thread ended".into()));
            self.gate.hold(due, StepCompletion::of(step, result));
        }
    }

    /// Waits for the thread to hand back every step due by now.
    fn wait_for_due(&mut self) {
        while let Some(&(_, due)) = self.computing.front() {
            if due > self.gate.launches() {
                return;
            }
            match self.done.recv() {
                Ok(c) => self.receive(c),
                Err(_) => return self.thread_gone(),
            }
        }
    }
}

/// Wakes the rank when the thread ends, however it ends (a panic included): the rank's next poll
/// then finds the channel closed and fails what the thread held.
struct WakeOnExit(Arc<RankWaker>);

impl Drop for WakeOnExit {
    fn drop(&mut self) {
        self.0.wake();
    }
}

fn run(mut runner: CpuStepRunner, inbox: Receiver<Job>, outbox: Sender<StepCompletion>, waker: Arc<RankWaker>) {
    let _wake_on_exit = WakeOnExit(waker.clone());
    for job in inbox {
        match job {
            Job::Phase { phase, step } => {
                if let Some(done) = runner.run_phase(phase, step.map(|s| *s)) {
                    if outbox.send(done).is_err() {
                        return; // the rank is gone
                    }
                }
            }
            Job::Flush => waker.wake(),
        }
    }
}

impl Executor for DeferredExecutor {
    fn phases(&self) -> usize {
        self.phases
    }

    fn launch(&mut self, step: &StepLaunch<'_>, phase: usize) {
        self.flushing = false;
        let owned = (phase == 0).then(|| {
            let due = self.gate.launched();
            self.computing.push_back((step.step, due));
            Box::new(OwnedStep::copy_of(step))
        });
        // A send fails only when the thread is gone; its steps fail then.
        let sent = self.jobs.as_ref().is_some_and(|jobs| jobs.send(Job::Phase { phase, step: owned }).is_ok());
        if !sent {
            return self.thread_gone();
        }
        if phase + 1 == self.phases {
            self.wait_for_due();
        }
    }

    fn poll(&mut self, out: &mut Vec<StepCompletion>) {
        loop {
            match self.done.try_recv() {
                Ok(c) => self.receive(c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.thread_gone();
                    break;
                }
            }
        }
        if self.flushing {
            self.gate.flush();
        }
        self.gate.release(out);
    }

    fn flush(&mut self) {
        if self.flushing {
            return;
        }
        // What the thread already handed back is released at the next poll; for what it is
        // still computing, it wakes the rank once it has handed all of it back.
        self.flushing = true;
        if let (false, Some(jobs)) = (self.computing.is_empty(), &self.jobs) {
            let _ = jobs.send(Job::Flush);
        }
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
