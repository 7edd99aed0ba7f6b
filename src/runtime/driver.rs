//! The workload driver of process 0: releases the workload's requests (`workload::drive` decides
//! when) into the ingress of the pool each one goes to ([`PoolChoice`]), cancels a seeded
//! fraction of them a while after their release, and on an interrupt (Ctrl-C) stops releasing,
//! lets what is in flight finish for a grace period, cancels the rest, and closes every ingress
//! so the pools end.

use crate::graph::PoolChoice;
use crate::runtime::collector::SharedCollector;
use crate::trace::Request;
use crate::workload::{drive, ArrivalMode, Selection};
use kvflow_kernels::hash;
use kvflow_kernels::models::check_context;
use kvflow_operators::admit::Ingress;
use kvflow_operators::messages::Admission;
use parking_lot::Mutex;
use std::collections::{BinaryHeap, HashMap};
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

/// Which of the run's entry pools a new request goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub choice: PoolChoice,
    pub seed: u64,
}

impl Placement {
    /// The pool (index into the entry pools) the `nth` request released goes to. A seeded
    /// split deals each run of `pools` consecutive requests out in a seeded order, so the pools
    /// get equal shares whatever the seed, and the same split every run.
    pub fn pick(&self, nth: usize, pools: usize) -> usize {
        match self.choice {
            _ if pools <= 1 => 0,
            PoolChoice::RoundRobin => nth % pools,
            PoolChoice::Seeded => {
                let mut order: Vec<usize> = (0..pools).collect();
                let mut state = hash::mix(hash::mix(hash::EMPTY, self.seed ^ 0x9001), (nth / pools) as u64);
                for i in (1..pools).rev() {
                    state = hash::mix(state, i as u64);
                    order.swap(i, (state % (i as u64 + 1)) as usize);
                }
                order[nth % pools]
            }
        }
    }
}

/// A pool the driver releases requests into.
pub struct EntryPool {
    pub name: String,
    pub ingress: Arc<Ingress>,
    /// Whole requests (aggregated pools) or prefills to hand off (prefill pools).
    pub kind: kvflow_operators::messages::AdmissionKind,
    /// Where else a cancellation goes: the decode pools a handed-off request may have reached.
    pub also_cancel: Vec<Arc<Ingress>>,
}

/// Everything the driver needs.
pub struct DriverJob {
    /// The pools new requests enter (at least one).
    pub pools: Vec<EntryPool>,
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

/// The failure cause of a request longer than the model's context.
pub const EXCEEDS_CONTEXT: &str = "exceeds-context";

/// Runs the driver on its own thread; it closes every ingress when done.
pub fn spawn_driver(job: DriverJob) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("kvflow-driver".into()).spawn(move || run(job))
}

/// The ingress each released request went to, by id (cancellations follow the request).
type Placed = Arc<Mutex<HashMap<u64, (Arc<Ingress>, Vec<Arc<Ingress>>)>>>;

fn run(job: DriverJob) {
    let DriverJob {
        pools,
        placement,
        selection,
        mode,
        collector,
        completions,
        cancel,
        interrupted,
        grace,
        max_context,
        sampling,
    } = job;
    let warmup = selection.warmup;
    let placed: Placed = Default::default();
    let cancel_one = {
        let placed = placed.clone();
        move |id: u64| {
            if let Some((ingress, also)) = placed.lock().get(&id) {
                ingress.cancel(id);
                for other in also {
                    other.cancel(id);
                }
            }
        }
    };
    // Cancellations due: (due time, id), earliest first.
    let due: Arc<Mutex<DueCancels>> = Default::default();
    let epoch = Instant::now();
    let canceller_done = Arc::new(AtomicBool::new(false));
    let canceller = (cancel.fraction > 0.0).then(|| {
        let (due, done, cancel_one) = (due.clone(), canceller_done.clone(), cancel_one.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                let now = epoch.elapsed().as_micros();
                let mut heap = due.lock();
                while heap.peek().is_some_and(|std::cmp::Reverse((t, _))| *t <= now) {
                    let Some(std::cmp::Reverse((_, id))) = heap.pop() else { break };
                    cancel_one(id);
                }
                drop(heap);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    });
    let mut nth = 0;
    drive(
        &selection,
        &mode,
        |req: Request| {
            let is_warmup = (req.id as usize) < warmup;
            let pool = &pools[placement.pick(nth, pools.len())];
            nth += 1;
            collector.lock().released(req.id, &pool.name, &req.prompt, req.max_output_tokens, is_warmup);
            if let Err(why) = check_context(max_context, req.prompt.len(), req.max_output_tokens) {
                collector.lock().refuse(req.id, &pool.name, EXCEEDS_CONTEXT, why);
                return;
            }
            placed.lock().insert(req.id, (pool.ingress.clone(), pool.also_cancel.clone()));
            if cancel.picks(req.id) {
                let at = epoch.elapsed().as_micros() + (cancel.after_ms * 1000.0) as u128;
                due.lock().push(std::cmp::Reverse((at, req.id)));
            }
            let sampling = req.sampling(sampling);
            pool.ingress.push(Admission {
                id: req.id,
                prompt: req.prompt,
                max_output_tokens: req.max_output_tokens,
                warmup: is_warmup,
                kind: pool.kind,
                sampling,
                cached: Vec::new(),
                delivery: Default::default(),
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
        collector.lock().interrupted_now();
        // Nothing more is released. Let what is in flight finish within the grace period, then
        // cancel the rest and wait for the pool to confirm.
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
            cancel_one(id);
        }
        let confirm_by = Instant::now() + grace;
        while !collector.lock().in_flight().is_empty() && Instant::now() < confirm_by {
            let _ = completions.recv_timeout(Duration::from_millis(50));
        }
    }
    for pool in &pools {
        pool.ingress.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seeded_pool_choice_splits_requests_evenly_and_the_same_every_run() {
        let seeded = Placement { choice: PoolChoice::Seeded, seed: 3 };
        for pools in [2, 3] {
            let requests = 333 * pools;
            let picks: Vec<usize> = (0..requests).map(|n| seeded.pick(n, pools)).collect();
            for p in 0..pools {
                assert_eq!(picks.iter().filter(|&&x| x == p).count(), 333, "pool {p} of {pools}");
            }
            assert_eq!(picks, (0..requests).map(|n| seeded.pick(n, pools)).collect::<Vec<_>>(), "the same every run");
            assert_ne!(picks, (0..requests).map(|n| n % pools).collect::<Vec<_>>(), "not plain turns");
            let other = Placement { seed: 4, ..seeded };
            assert_ne!(picks, (0..requests).map(|n| other.pick(n, pools)).collect::<Vec<_>>(), "the seed matters");
        }
        assert_eq!(Placement { choice: PoolChoice::RoundRobin, seed: 3 }.pick(3, 2), 1);
        assert_eq!(seeded.pick(3, 1), 0);
    }

    #[test]
    fn the_cancelled_fraction_is_seeded_and_near_its_target() {
        let plan = CancelPlan { fraction: 0.3, after_ms: 0.0, seed: 5 };
        let picked: Vec<u64> = (0..2000).filter(|&id| plan.picks(id)).collect();
        assert!((picked.len() as f64 / 2000.0 - 0.3).abs() < 0.05, "{}", picked.len());
        assert_eq!(picked, (0..2000).filter(|&id| plan.picks(id)).collect::<Vec<_>>());
        assert!(!(0..100).any(|id| CancelPlan { fraction: 0.0, ..plan }.picks(id)));
    }
}
