//! The ranks of this process that are still building their executors (loading weights,
//! compiling kernels, planning memory). The trace driver releases no request before every one
//! of them is built, so a replay's arrivals, queueing and TTFT are measured against running
//! pools, not against start-up. A rank that cannot build its executor counts as built (it fails
//! what it is given); a worker that panics first counts too (its guard drops).

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Default)]
pub struct Starting {
    pending: Mutex<usize>,
    built: Condvar,
}

impl Starting {
    /// `ranks` more ranks are starting in this process.
    pub fn expect(&self, ranks: usize) {
        *self.pending.lock() += ranks;
    }

    /// One starting rank's guard: dropping it says the rank is built.
    pub fn rank(self: &Arc<Self>) -> RankStarting {
        RankStarting(self.clone())
    }

    /// Waits until every expected rank is built or `interrupted` is set, saying what it waits
    /// for every 10 s. Returns how long it waited.
    pub fn wait(&self, interrupted: &AtomicBool) -> Duration {
        let asked = Instant::now();
        let mut said = asked;
        let mut pending = self.pending.lock();
        while *pending > 0 && !interrupted.load(Ordering::SeqCst) {
            self.built.wait_for(&mut pending, Duration::from_millis(200));
            if *pending > 0 && said.elapsed() >= Duration::from_secs(10) {
                said = Instant::now();
                tracing::info!(
                    "releasing no request yet: {} rank(s) still building their executors ({:.0} s)",
                    *pending,
                    asked.elapsed().as_secs_f64()
                );
            }
        }
        asked.elapsed()
    }

    fn built_one(&self) {
        let mut pending = self.pending.lock();
        *pending = pending.saturating_sub(1);
        if *pending == 0 {
            self.built.notify_all();
        }
    }
}

/// A rank still building its executor (dropped once it is built, or its worker ended first).
pub struct RankStarting(Arc<Starting>);

impl Drop for RankStarting {
    fn drop(&mut self) {
        self.0.built_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_for_every_expected_rank_then_returns() {
        let starting = Arc::new(Starting::default());
        starting.expect(2);
        let guards = vec![starting.rank(), starting.rank()];
        let later = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(guards);
        });
        let waited = starting.wait(&AtomicBool::new(false));
        assert!(waited >= Duration::from_millis(50), "{waited:?}: returned before both ranks were built");
        later.join().unwrap();
    }

    #[test]
    fn an_interrupt_ends_the_wait() {
        let starting = Arc::new(Starting::default());
        starting.expect(1);
        let _never = starting.rank();
        assert!(starting.wait(&AtomicBool::new(true)) < Duration::from_secs(1));
    }
}
