//! The workload driver of process 0: releases the workload's requests into the pool's ingress
//! (`workload::drive` decides when), cancels a seeded fraction of them a while after their
//! release, and on an interrupt (Ctrl-C) stops releasing, lets what is in flight finish for a
//! grace period, cancels the rest, and closes the ingress so the pool ends.

use crate::runtime::collector::SharedCollector;
use crate::trace::Request;
use crate::workload::{drive, ArrivalMode, Selection};
use kvflow_kernels::hash;
use kvflow_operators::admit::Ingress;
use kvflow_operators::messages::Admission;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Cancellations waiting for their time: `(due µs since the driver started, request id)`,
/// earliest first.
type DueCancels = BinaryHeap<std::cmp::Reverse<(u128, u64)>>;

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
    pub selection: Selection,
    pub mode: ArrivalMode,
    pub collector: SharedCollector,
    pub completions: Receiver<u64>,
    pub cancel: CancelPlan,
    /// Set by Ctrl-C.
    pub interrupted: Arc<AtomicBool>,
    /// How long in-flight requests may run on after an interrupt before they are cancelled.
    pub grace: Duration,
}

/// Runs the driver on its own thread; it closes the ingress when done.
pub fn spawn_driver(job: DriverJob, ingress: Arc<Ingress>) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("kvflow-driver".into())
        .spawn(move || run(job, ingress))
        .expect("spawn the workload driver")
}

fn run(job: DriverJob, ingress: Arc<Ingress>) {
    let DriverJob { selection, mode, collector, completions, cancel, interrupted, grace } = job;
    let warmup = selection.warmup;
    // Cancellations due: (due time, id), earliest first.
    let due: Arc<std::sync::Mutex<DueCancels>> = Default::default();
    let epoch = Instant::now();
    let canceller_done = Arc::new(AtomicBool::new(false));
    let canceller = (cancel.fraction > 0.0).then(|| {
        let (due, ingress, done) = (due.clone(), ingress.clone(), canceller_done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                let now = epoch.elapsed().as_micros();
                let mut heap = due.lock().expect("cancel queue");
                while heap.peek().is_some_and(|std::cmp::Reverse((t, _))| *t <= now) {
                    let std::cmp::Reverse((_, id)) = heap.pop().expect("peeked");
                    ingress.cancel(id);
                }
                drop(heap);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    });
    drive(
        &selection,
        &mode,
        |req: Request| {
            let is_warmup = (req.id as usize) < warmup;
            collector.lock().expect("collector lock").released(req.id, &req.prompt, req.max_output_tokens, is_warmup);
            if cancel.picks(req.id) {
                let at = epoch.elapsed().as_micros() + (cancel.after_ms * 1000.0) as u128;
                due.lock().expect("cancel queue").push(std::cmp::Reverse((at, req.id)));
            }
            ingress.push(Admission {
                id: req.id,
                prompt: req.prompt,
                max_output_tokens: req.max_output_tokens,
                warmup: is_warmup,
            });
        },
        &completions,
        &interrupted,
    );
    canceller_done.store(true, Ordering::SeqCst);
    if let Some(c) = canceller {
        let _ = c.join();
    }
    if interrupted.load(Ordering::SeqCst) {
        // Nothing more is released. Let what is in flight finish within the grace period, then
        // cancel the rest and wait for the pool to confirm.
        let deadline = Instant::now() + grace;
        while !collector.lock().expect("collector lock").in_flight().is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match completions.recv_timeout(left.min(Duration::from_millis(50))) {
                Ok(_) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let rest = collector.lock().expect("collector lock").in_flight();
        if !rest.is_empty() {
            eprintln!("interrupted: cancelling {} request(s) still in flight after the grace period", rest.len());
        }
        for id in &rest {
            ingress.cancel(*id);
        }
        let confirm_by = Instant::now() + grace;
        while !collector.lock().expect("collector lock").in_flight().is_empty() && Instant::now() < confirm_by {
            let _ = completions.recv_timeout(Duration::from_millis(50));
        }
    }
    ingress.close();
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
