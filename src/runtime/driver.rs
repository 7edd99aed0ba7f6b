//! The workload driver of process 0: releases the workload's requests (`workload::drive` decides
//! when) into the entry pools ([`Entries::release`], the way a front end releases its requests
//! too), cancels a seeded fraction of them a while after their release, and on an interrupt
//! (Ctrl-C) stops releasing, lets what is in flight finish for a grace period, cancels the rest,
//! and closes every ingress so the pools end.

pub use super::entry::{EntryPool, Placement, EXCEEDS_CONTEXT};

use super::collector::SharedCollector;
use super::entry::{Entries, Release};
use crate::trace::Request;
use crate::workload::{drive, ArrivalMode, Selection};
use kvflow_kernels::hash;
use parking_lot::Mutex;
use std::collections::BinaryHeap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Cancellations waiting for their time: `(due µs since the driver started, request id)`,
/// earliest first.
type DueCancels = Arc<Mutex<BinaryHeap<std::cmp::Reverse<(u128, u64)>>>>;

/// Which requests the workload cancels, and when.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CancelPlan {
    pub fraction: f64,
    pub after_ms: f64,
    pub seed: u64,
}

impl CancelPlan {
    /// Whether request `id` is one the workload cancels (a seeded draw, the same every run).
    pub fn picks(&self, id: u64) -> bool {
        if self.fraction <= 0.0 {
            return false;
        }
        let draw = hash::mix(hash::mix(hash::EMPTY, self.seed ^ 0xCA9CE1), id);
        ((draw >> 11) as f64 / (1u64 << 53) as f64) < self.fraction
    }
}

/// Everything the driver needs.
pub struct DriverJob {
    /// The pools new requests enter (at least one).
    pub pools: Vec<EntryPool>,
    /// This process's ranks still building their executors: nothing is released before them.
    pub starting: Arc<super::starting::Starting>,
    pub placement: Placement,
    pub selection: Selection,
    pub mode: ArrivalMode,
    pub collector: SharedCollector,
    pub completions: Receiver<u64>,
    pub cancel: CancelPlan,
    /// Set by Ctrl-C.
    pub interrupted: Arc<AtomicBool>,
    /// How long in-flight requests may run on after an interrupt before they are cancelled.
    pub grace: Duration,
    /// The model's context (prompt + output tokens), when it has one: a longer request is
    /// refused at release, with its cause, and never enters a pool.
    pub max_context: Option<usize>,
    /// `[sampling]`: how requests pick tokens unless their trace line says otherwise.
    pub sampling: kvflow_kernels::cpu::sampling::RequestSampling,
}

/// Runs the driver on its own thread; it closes every ingress when done.
pub fn spawn_driver(job: DriverJob) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name("kvflow-driver".into()).spawn(move || run(job))
}

fn run(job: DriverJob) {
    let DriverJob {
        pools,
        starting,
        placement,
        mut selection,
        mode,
        collector,
        completions,
        cancel,
        interrupted,
        grace,
        max_context,
        sampling,
    } = job;
    let entries = Arc::new(Entries::new(pools, placement, collector, max_context));
    let waited = starting.wait(&interrupted);
    tracing::debug!("every rank built its executor after {:.1} s: releasing the workload", waited.as_secs_f64());
    let (warmup, epoch) = (selection.warmup, Instant::now());
    let due: DueCancels = Default::default();
    let canceller_done = Arc::new(AtomicBool::new(false));
    let canceller = (cancel.fraction > 0.0).then(|| spawn_canceller(&entries, &due, epoch, &canceller_done));
    drive(
        &mut selection,
        &mode,
        |req: Request| {
            let id = req.id;
            // Its cancellation is due a while after this moment.
            let cancel_at = epoch.elapsed().as_micros() + (cancel.after_ms * 1000.0) as u128;
            let released = entries.release(|_| Ok::<_, Infallible>(Release::of_trace(req, warmup, sampling)));
            let entered = released.unwrap_or_else(|never| match never {});
            if entered && cancel.picks(id) {
                due.lock().push(std::cmp::Reverse((cancel_at, id)));
            }
        },
        &completions,
        &interrupted,
    );
    canceller_done.store(true, Ordering::SeqCst);
    if let Some(c) = canceller {
        let _ = c.join();
    }
    if interrupted.load(Ordering::SeqCst) {
        drain(&entries, &completions, grace);
    }
    entries.close();
}

/// Cancels each request of `due` at its time, until `done`.
fn spawn_canceller(entries: &Arc<Entries>, due: &DueCancels, epoch: Instant, done: &Arc<AtomicBool>) -> JoinHandle<()> {
    let (entries, due, done) = (entries.clone(), due.clone(), done.clone());
    std::thread::spawn(move || {
        while !done.load(Ordering::SeqCst) {
            let now = epoch.elapsed().as_micros();
            let mut heap = due.lock();
            while heap.peek().is_some_and(|std::cmp::Reverse((t, _))| *t <= now) {
                let Some(std::cmp::Reverse((_, id))) = heap.pop() else { break };
                entries.cancel(id);
            }
            drop(heap);
            std::thread::sleep(Duration::from_millis(1));
        }
    })
}

/// After an interrupt nothing more is released: what is in flight may finish within the grace
/// period, then the rest is cancelled and the driver waits (a grace period more) for the pools
/// to confirm.
fn drain(entries: &Entries, completions: &Receiver<u64>, grace: Duration) {
    let collector = entries.collector();
    collector.lock().interrupted_now();
    let deadline = Instant::now() + grace;
    while !collector.lock().in_flight().is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match completions.recv_timeout(left.min(Duration::from_millis(50))) {
            Ok(_) | Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    let rest = collector.lock().in_flight();
    if !rest.is_empty() {
        eprintln!("interrupted: cancelling {} request(s) still in flight after the grace period", rest.len());
    }
    for &id in &rest {
        entries.cancel(id);
    }
    let confirm_by = Instant::now() + grace;
    while !collector.lock().in_flight().is_empty() && Instant::now() < confirm_by {
        let _ = completions.recv_timeout(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cancelled_fraction_is_seeded_and_near_its_target() {
        let plan = CancelPlan { fraction: 0.3, after_ms: 0.0, seed: 5 };
        let picked: Vec<u64> = (0..2000).filter(|&id| plan.picks(id)).collect();
        assert!((picked.len() as f64 / 2000.0 - 0.3).abs() < 0.05, "{}", picked.len());
        assert_eq!(picked, (0..2000).filter(|&id| plan.picks(id)).collect::<Vec<_>>());
        assert!(!(0..100).any(|id| CancelPlan { fraction: 0.0, ..plan }.picks(id)));
    }
}
