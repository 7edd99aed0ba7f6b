//! One pool as one timely computation: its ranks are timely workers (threads of this process, or
//! processes of a cluster), each building the per-pool graph of DESIGN §4 and parking when idle.
//! Process 0 also runs the workload driver, which releases requests into rank 0's ingress.
//!
//! ```text
//! driver ─▶ ingress ─▶ admit ─(wake, broadcast)─▶ schedule(t) ─▶ align(t) ─▶ forward(t) ─┬▶ emit(t) ─▶ collector
//!                        ▲                            ▲            (broadcast)           │
//!                        └────────── feedback: Launched/Parked (t+1) ◀──────────────────┘
//! ```

use crate::runtime::collector::{spawn_collector_thread, CollectorSink};
use crate::runtime::driver::{spawn_driver, DriverJob};
use crate::runtime::watchdog::Watch;
use anyhow::{anyhow, Result};
use kvflow_kernels::models::Model;
use kvflow_operators::admit::{admit, Ingress};
use kvflow_operators::align::{align, RoutingKeys};
use kvflow_operators::emit::{emit, EventSink};
use kvflow_operators::forward::forward;
use kvflow_operators::messages::LoopSignal;
use kvflow_operators::policy::memory::MemoryLayout;
use kvflow_operators::policy::router::{RouterContext, RouterFactory};
use kvflow_operators::policy::scheduler::SchedulerConfig;
use kvflow_operators::rank::{Executor, Rank, RankStats, TestSwitches};
use kvflow_operators::schedule::schedule;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use timely::dataflow::operators::{ConnectLoop, Feedback};

/// Where this process sits in a pool spread over several processes.
#[derive(Clone, Debug)]
pub struct ClusterPlace {
    pub process: usize,
    pub processes: usize,
    /// `host:port` of every process, in process order.
    pub addresses: Vec<String>,
}

/// Everything one pool needs to run.
pub struct PoolJob {
    pub name: String,
    pub ranks: usize,
    pub model: Arc<Model>,
    pub layout: MemoryLayout,
    pub scheduler: SchedulerConfig,
    pub router: RouterFactory,
    pub cluster: Option<ClusterPlace>,
    pub switches: TestSwitches,
    pub executor: Executor,
}

/// What the pool's ranks hand back when it ends.
pub struct PoolResult {
    /// Per rank of this process: its counters, or why its end-of-run check failed.
    pub ranks: Vec<Result<RankStats, String>>,
}

fn timely_config(job: &PoolJob) -> Result<timely::Config> {
    Ok(match &job.cluster {
        None => timely::Config::process(job.ranks),
        Some(c) => {
            if job.ranks % c.processes != 0 {
                return Err(anyhow!(
                    "pool {}: {} ranks do not split evenly over {} processes",
                    job.name,
                    job.ranks,
                    c.processes
                ));
            }
            timely::Config {
                communication: timely::CommunicationConfig::Cluster {
                    threads: job.ranks / c.processes,
                    process: c.process,
                    addresses: c.addresses.clone(),
                    report: false,
                    zerocopy: false,
                },
                worker: timely::WorkerConfig::default(),
            }
        }
    })
}

/// What the stall watchdog of process 0 needs.
pub struct StallWatch {
    pub timeout: Duration,
    /// Called with the diagnosis; expected to end the process.
    pub on_stall: Box<dyn FnOnce(String) + Send>,
}

/// Runs the pool until the workload is done. On process 0 (or without a cluster) the driver
/// replays the workload into rank 0's ingress and the watchdog watches for stalls.
pub fn run_pool(job: PoolJob, workload: Option<DriverJob>, stall: Option<StallWatch>) -> Result<PoolResult> {
    let config = timely_config(&job)?;
    let ingress = Arc::new(Ingress::default());
    let is_driver = workload.is_some();
    let watch = Watch::default();
    let finished = Arc::new(AtomicBool::new(false));
    let watchdog = match (stall, workload.as_ref()) {
        (Some(stall), Some(w)) => {
            let collector = w.collector.clone();
            let pending = move || collector.lock().expect("collector lock").in_flight().len();
            Some(watch.clone().spawn(stall.timeout, pending, finished.clone(), stall.on_stall))
        }
        _ => None,
    };
    let collector_thread = workload.as_ref().map(|w| spawn_collector_thread(w.collector.clone()));
    let sink_parts = collector_thread.as_ref().map(|(tx, _)| tx.clone());
    let driver = workload.map(|job| spawn_driver(job, ingress.clone()));

    let PoolJob { model, layout, scheduler, router, switches, executor, .. } = job;
    let keys = RoutingKeys { block_size: layout.block_size, keyed_by_prompt_len: layout.prefix_keyed_by_prompt_len };
    let ingress_for_workers = ingress.clone();
    let sink_parts = Mutex::new(sink_parts);
    // Timely's logs are only registered when a watchdog reads them.
    let watch_for_workers = watchdog.is_some().then(|| watch.clone());
    let guards = timely::execute(config, move |worker| {
        if let Some(watch) = &watch_for_workers {
            watch.register(worker);
        }
        let index = worker.index();
        let peers = worker.peers();
        let rank = Rc::new(RefCell::new(
            Rank::new(index, model.clone(), layout, scheduler).with_switches(switches.clone()).with_executor(executor),
        ));
        let pending = Rc::new(RefCell::new(Default::default()));
        let ingress = (index == 0 && is_driver).then(|| ingress_for_workers.clone());
        let sink: Option<Box<dyn EventSink>> = if index == 0 {
            sink_parts
                .lock()
                .expect("sink lock")
                .take()
                .map(|batches| Box::new(CollectorSink { batches }) as Box<dyn EventSink>)
        } else {
            None
        };
        let route = router(RouterContext { ranks: peers, max_batched_tokens: scheduler.max_batched_tokens });
        let rank_for_graph = rank.clone();
        let holds = ["admit", "schedule", "align", "forward"].map(|op| switches.hold_at(op, index));
        let align_without_waiting = switches.align_without_waiting;
        worker.dataflow::<u64, _, _>(move |scope| {
            let (loop_handle, feedback) = scope.feedback::<Vec<LoopSignal>>(1);
            let wakes = admit(feedback.clone(), ingress, pending.clone(), holds[0]);
            let reports = schedule(feedback, wakes, rank_for_graph.clone(), pending, holds[1]);
            let plans = align(reports, peers, route, keys, holds[2], align_without_waiting);
            let out = forward(plans, rank_for_graph, holds[3]);
            out.signals.connect_loop(loop_handle);
            emit(out.events, sink);
        });
        while worker.has_dataflows() {
            worker.step_or_park(None);
        }
        let result = rank.borrow_mut().finish_run();
        result
    })
    .map_err(|e| anyhow!("cannot start pool: {e}"))?;
    let ranks = guards.join().into_iter().map(|r| r.unwrap_or_else(|e| Err(format!("worker failed: {e}")))).collect();
    if let Some((tx, handle)) = collector_thread {
        drop(tx);
        handle.join().map_err(|_| anyhow!("the collector thread panicked"))?;
    }
    finished.store(true, std::sync::atomic::Ordering::SeqCst);
    if let Some(w) = watchdog {
        let _ = w.join();
    }
    if let Some(d) = driver {
        d.join().map_err(|_| anyhow!("the workload driver panicked"))?;
    }
    Ok(PoolResult { ranks })
}
