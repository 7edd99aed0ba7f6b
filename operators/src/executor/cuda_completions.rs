//! A cuda rank's completions: `poll` takes each step in flight whose event has passed, oldest
//! first, never waiting (a step with the MTP drafter goes on to its draft passes once its forward
//! is done), and a launch or poll that held the rank's thread past [`STALL`] is reported — with
//! deferred output neither waits for the device, so one that did stalled every step behind it.
//! Which time it holds: none (it reads the executor's steps in flight).
//! Which guarantee it carries: completions in launch order, each once.

use super::CudaExecutor;
use crate::step::{ExecutorError, StepCompletion};
use std::time::{Duration, Instant};

/// A launch or poll longer than this on the rank's thread is reported.
const STALL: Duration = Duration::from_millis(20);

impl CudaExecutor {
    pub(super) fn poll_steps(&mut self, out: &mut Vec<StepCompletion>) {
        self.release_served();
        while let Some(front) = self.in_flight.front() {
            let done = match &front.event {
                None => Ok(true),
                Some(e) => self.gpu.done(e),
            };
            match done {
                Ok(false) => break,
                Ok(true) => {
                    let mut f = self.in_flight.pop_front().expect("front exists");
                    if f.error.is_none() && f.mtp.is_some() && f.passes.is_none() {
                        // the forward is done: the draft passes next, then the step completes
                        match self.enqueue_drafting(&mut f) {
                            Ok(()) => {
                                self.in_flight.push_front(f);
                                continue;
                            }
                            Err(e) => f.error = Some(e),
                        }
                    }
                    out.push(self.complete(f));
                }
                Err(e) => {
                    let mut f = self.in_flight.pop_front().expect("front exists");
                    f.error = Some(ExecutorError::Launch(e.to_string()));
                    out.push(self.complete(f));
                }
            }
        }
    }

    /// Reports a launch or poll that held the rank's thread past [`STALL`]: with deferred output
    /// neither waits for the device, so one that did stalls every step behind it (and the
    /// tokens of those in flight are handed on at once when it returns).
    pub(super) fn note_stall(&self, what: &str, step: u64, started: Instant) {
        let took = started.elapsed();
        if let Some(rank) = self.watch_stalls.as_ref().filter(|_| took >= STALL) {
            tracing::warn!(
                "cuda, {rank}: {what} {step} held the rank's thread {:.1} ms with {} steps in flight",
                took.as_secs_f64() * 1e3,
                self.in_flight.len()
            );
        }
    }
}
