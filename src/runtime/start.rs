//! The second phase of `kvflow run` ([`super::run`]): the collector, the handoff links, every
//! pool (each with its ingress, its links, its sink into the collector and its watch), what
//! releases the requests (the trace driver, or the front end handed to the run), the KV usage
//! sampler, the stall watchdog, and a joiner per pool that fails what a pool still held when it
//! ended.

use super::collector::{spawn_collector_thread, Collector, CollectorSink, EventBatch, SharedCollector};
use super::driver::{spawn_driver, CancelPlan, DriverJob};
use super::entry::{Entries, EntryPool, Placement};
use super::front::{FrontEndJob, PoolGauges};
use super::jobs::{arrival_mode, pools_executor};
use super::kv_usage::spawn_kv_sampler;
use super::links::{self, Wiring};
use super::options::{RunOptions, EXIT_STALL, PROCESS_LOST};
use super::pool::{start_pool, PoolResult, RunningPool};
use super::prepare::Prepared;
use super::simulated::{lockstep, spawn_stepper, AppliedSink, SimReleases, StepperJob};
use super::watchdog::{spawn_watchdog, Awaited, Watch};
use crate::graph::{Graph, OffloadStore, PoolRole};
use crate::report::write_report;
use anyhow::{bail, Result};
use kvflow_kernels::models::Model;
use kvflow_operators::policy::memory::MemoryLayout;
use kvflow_operators::pool::admit::Ingress;
use kvflow_operators::pool::emit::EventSink;
use kvflow_operators::sim::clock::VirtualClock;
use kvflow_operators::transfer::{HandoffInbox, TcpConsumer, TcpLink, TransferCounters};
use parking_lot::Mutex;
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// A run whose pools are running: what the last phase joins and reports.
pub struct Running {
    pub model: Arc<Model>,
    /// Per pool run: name, ranks, memory layout, executor.
    pub layouts: Vec<(String, usize, MemoryLayout, String)>,
    pub note: Option<String>,
    pub collector: SharedCollector,
    pub threads: RunThreads,
    pub kv_sampler: JoinHandle<Vec<serde_json::Value>>,
    pub interrupted: Arc<AtomicBool>,
    pub links: LinksOfRun,
    pub store: Option<Arc<dyn kvflow_operators::offload::ObjectStore>>,
    /// A simulated run's virtual clock.
    pub clock: Option<Arc<VirtualClock>>,
}

/// The threads of a running run that end with it.
pub struct RunThreads {
    pub collector: JoinHandle<()>,
    /// Each pool's joiner: its result once it has ended.
    pub joiners: Vec<JoinHandle<PoolResult>>,
    /// The trace driver's or the front end's thread.
    pub releaser: JoinHandle<()>,
    pub watchdog: Option<JoinHandle<()>>,
    /// Set once the pools are joined: the watchdog and the KV sampler stop.
    pub finished: Arc<AtomicBool>,
}

/// What the run's handoff links leave for its end: the tcp listeners (they live until the run is
/// over), the links to decode pools in other processes, the decode pools' inboxes (empty at the
/// end), and what the links moved.
pub struct LinksOfRun {
    pub _listeners: Vec<(String, TcpConsumer)>,
    pub remote_links: Vec<Arc<TcpLink>>,
    pub inboxes: Vec<(String, Arc<HandoffInbox>)>,
    pub socket_bytes: Arc<AtomicU64>,
    pub counters: Arc<TransferCounters>,
}

/// The pools of this process, started.
struct StartedPools {
    /// Per pool: its role, the ranks of this process, the pool.
    running: Vec<(PoolRole, Range<usize>, RunningPool)>,
    /// The pools new requests enter.
    entries: Vec<EntryPool>,
    watches: Vec<(String, Watch)>,
    gauges: PoolGauges,
    /// This process's ranks still building their executors.
    starting: Arc<super::starting::Starting>,
    /// A simulated run: what its stepper steps the pools' workers with.
    stepper: Option<StepperJob>,
}

/// Where the pools' events go: the collector thread, or (a simulated run) the collector itself,
/// on the stepper's thread.
#[derive(Clone, Copy)]
struct Sinks<'a> {
    batches: &'a Sender<EventBatch>,
    collector: &'a SharedCollector,
    clock: Option<&'a Arc<VirtualClock>>,
}

impl Sinks<'_> {
    fn of(&self, pool: &str) -> Box<dyn EventSink + Send> {
        match self.clock {
            Some(_) => Box::new(AppliedSink { pool: pool.into(), collector: self.collector.clone() }),
            None => Box::new(CollectorSink { pool: pool.into(), batches: self.batches.clone() }),
        }
    }
}

/// Starts everything: the pools, what releases their requests, and what watches them.
pub fn start(graph: &Graph, opts: &RunOptions, prepared: Prepared<'_>) -> Result<Running> {
    let Prepared { pools, model, selection, largest, jobs, store, .. } = prepared;
    let store = store.map(|s| s.store);
    let clock = super::simulated::is_simulated(graph, &pools, opts)?.then(VirtualClock::new);
    if clock.is_none() && graph.offload.as_ref().is_some_and(|o| matches!(o.store, OffloadStore::Sim(_))) {
        bail!(
            "{}: offload.store: store = \"sim\" holds a simulated run's chunks (every pool's executor \"sim\"); \
             use \"memory\", \"disk\" or \"redis\"",
            graph.path.display()
        );
    }
    let layouts = jobs.iter().map(|j| (j.name.clone(), j.ranks, j.layout, pools_executor(graph, &j.name))).collect();
    let note = selection.note.clone();
    if let Some(n) = &note {
        tracing::warn!("{n}");
        eprintln!("note: {n}");
    }
    let (tx, rx) = std::sync::mpsc::channel();
    // A front end's requests are not known ahead: until it stops taking them, they have not all
    // ended (the watchdog waits on an idle pool only once they have).
    let total = if opts.front_end.is_some() { usize::MAX } else { selection.requests.len() };
    let collector = Collector::new(total, tx, opts.show_progress && opts.front_end.is_none());
    if clock.is_some() {
        collector.lock().on_virtual_clock();
    }
    super::report::report_as_requests_end(graph, opts, &model, &collector)?;
    let (batches, collector_thread) = spawn_collector_thread(collector.clone())?;
    let mut wiring = wire(graph, opts, &pools, &model, &batches, clock.as_ref())?;
    // New requests enter the entry pools; the pools downstream of them close once every entry
    // pool has ended (cancels reach them through the entry pools' ranks, or directly).
    let decode_first = links::decode_first(graph, &pools);
    let upstream = if decode_first { PoolRole::Decode } else { PoolRole::Prefill };
    let downstream = wiring.downstream_ingresses(graph, &pools);
    let also_cancel = if decode_first { Vec::new() } else { downstream.clone() };
    let sinks = Sinks { batches: &batches, collector: &collector, clock: clock.as_ref() };
    let mut started = start_pools(graph, opts, &pools, jobs, &mut wiring, sinks, &also_cancel)?;
    drop(batches);
    let ingresses = wiring.ingress.clone();
    let links = LinksOfRun {
        _listeners: std::mem::take(&mut wiring.listeners),
        remote_links: std::mem::take(&mut wiring.remote_links),
        inboxes: std::mem::take(&mut wiring.inboxes),
        socket_bytes: wiring.socket_bytes.clone(),
        counters: wiring.counters.clone(),
    };
    let interrupted = opts.interrupt.clone().unwrap_or_default();
    let sampled_gauges = started.gauges.clone();
    let watched_pools: HashMap<_, _> =
        started.gauges.iter().map(|(name, g)| (name.clone(), (g.clone(), ingresses[name].clone()))).collect();
    let releasing = Releasing {
        entries: started.entries,
        gauges: started.gauges,
        starting: started.starting,
        selection,
        largest,
        completions: rx,
    };
    let finished = Arc::new(AtomicBool::new(false));
    let (releaser, kv_sampler) = match started.stepper.take() {
        Some(mut job) => {
            job.advance_while_busy = opts.switches.advance_clock_while_busy;
            // The stepper releases the workload and samples the KV usage on the virtual clock.
            let releases = sim_releases(graph, &model, &collector, releasing);
            let on_stall = stall_exit(&collector, &graph.report_dir);
            (std::thread::spawn(|| {}), spawn_stepper(job, releases, sampled_gauges, Box::new(on_stall))?)
        }
        None => {
            let releaser = start_releasing(graph, opts, &model, &collector, &interrupted, releasing)?;
            let run_start_ms = collector.lock().start_ms();
            (releaser, spawn_kv_sampler(sampled_gauges, run_start_ms, finished.clone())?)
        }
    };
    // Pools whose computation has ended (their joiner says so).
    let ended_pools: Arc<Mutex<HashSet<String>>> = Arc::default();
    // What the watchdog reads of each pool beside timely's logs (test switch: nothing).
    let awaited = (!opts.switches.watchdog_ignores_what_pools_await).then(|| Awaited {
        pools: watched_pools,
        collector: collector.clone(),
        ended_pools: ended_pools.clone(),
    });
    let watched = (started.watches, awaited);
    // A simulated run's stepper names a stall itself, at once.
    let watchdog = match clock {
        Some(_) => None,
        None => start_watchdog(graph, opts, watched, &collector, &ended_pools, &finished)?,
    };
    let ends = PoolEnds { upstream, downstream, remote_links: links.remote_links.clone(), ended_pools };
    let joiners = join_in_background(started.running, &collector, ends);
    Ok(Running {
        model,
        layouts,
        note,
        collector,
        threads: RunThreads { collector: collector_thread, joiners, releaser, watchdog, finished },
        kv_sampler,
        interrupted,
        links,
        store,
        clock,
    })
}

/// The handoff links of the run; the events of a decode pool in another process go to the
/// collector.
fn wire(
    graph: &Graph,
    opts: &RunOptions,
    pools: &[&crate::graph::PoolConfig],
    model: &Model,
    batches: &Sender<EventBatch>,
    clock: Option<&Arc<VirtualClock>>,
) -> Result<Wiring> {
    let stall_timeout = opts.stall_timeout.unwrap_or(Duration::from_secs(60));
    let remote_events = |to: &str| -> Box<dyn EventSink + Send> {
        Box::new(CollectorSink { pool: to.into(), batches: batches.clone() })
    };
    let wire_options = links::WireOptions {
        endpoints: &opts.endpoints,
        remote_events: &remote_events,
        patience: if stall_timeout.is_zero() { Duration::from_secs(3600) } else { stall_timeout },
        deliver_duplicates: opts.switches.deliver_duplicate_handoffs,
        accept_missing_pieces: opts.switches.accept_missing_pieces,
        serve_any_producer: opts.switches.serve_any_producer,
        relay: None,
        clock: clock.cloned(),
    };
    links::wire(graph, pools, model, &wire_options)
}

/// Starts every pool, each with its ingress, its handoff links, its sink into the collector
/// and its watch. New requests enter the aggregated pools, or the decode pools (a run of some
/// pools: the prefill pools).
fn start_pools(
    graph: &Graph,
    opts: &RunOptions,
    pools: &[&crate::graph::PoolConfig],
    jobs: Vec<super::pool::PoolJob>,
    wiring: &mut Wiring,
    sinks: Sinks<'_>,
    also_cancel: &[Arc<Ingress>],
) -> Result<StartedPools> {
    let mut started = StartedPools {
        running: Vec::new(),
        entries: Vec::new(),
        watches: Vec::new(),
        gauges: Vec::new(),
        starting: Arc::default(),
        stepper: None,
    };
    let lockstep = sinks.clock.map(|clock| {
        let (lockstep, stepper) =
            lockstep(clock.clone(), &jobs.iter().map(|j| (j.name.clone(), j.ranks)).collect::<Vec<_>>());
        started.stepper = Some(stepper);
        lockstep
    });
    for (mut job, pool) in jobs.into_iter().zip(pools) {
        let name = job.name.clone();
        started.gauges.push((name.clone(), job.gauges.clone()));
        let ingress = wiring.ingress[&name].clone();
        job.handoff = wiring.handoff.remove(&name).unwrap_or_default();
        let watch = Watch::default();
        let sink = sinks.of(&name);
        // The ranks of this process: rank r of a spread pool runs in process r / ranks-per-process.
        let here = 0..job.ranks / opts.cluster.as_ref().map_or(1, |c| c.processes);
        // (test switch: the driver does not wait for them)
        let running = match &lockstep {
            Some(lockstep) => {
                job.lockstep = Some(lockstep.clone());
                start_pool(job, Some(ingress.clone()), Some(sink), None)?
            }
            None => {
                if !opts.switches.release_before_ranks_are_built {
                    started.starting.expect(here.len());
                    job.starting = Some(started.starting.clone());
                }
                start_pool(job, Some(ingress.clone()), Some(sink), Some(watch.clone()))?
            }
        };
        started.running.push((pool.role, here, running));
        if let Some(kind) = Wiring::entry_kind(graph, pools, pool) {
            started.entries.push(EntryPool { name: name.clone(), ingress, kind, also_cancel: also_cancel.to_vec() });
        }
        started.watches.push((name, watch));
    }
    Ok(started)
}

/// What the releasing thread takes.
struct Releasing {
    entries: Vec<EntryPool>,
    gauges: PoolGauges,
    starting: Arc<super::starting::Starting>,
    selection: crate::workload::Selection,
    largest: usize,
    completions: Receiver<u64>,
}

/// Starts what releases the requests: the front end handed to the run, or the trace driver.
fn start_releasing(
    graph: &Graph,
    opts: &RunOptions,
    model: &Model,
    collector: &SharedCollector,
    interrupted: &Arc<AtomicBool>,
    releasing: Releasing,
) -> Result<JoinHandle<()>> {
    let Releasing { entries, gauges, starting, selection, largest, completions } = releasing;
    let placement = Placement { choice: graph.workload.pool_choice, seed: graph.workload.seed };
    let grace = opts.grace.unwrap_or(Duration::from_secs(10));
    Ok(match &opts.front_end {
        Some(front_end) => front_end.spawn(FrontEndJob {
            graph,
            model,
            entries: Arc::new(Entries::new(entries, placement, collector.clone(), None)),
            interrupted: interrupted.clone(),
            grace,
            max_context: largest,
            gauges,
        })?,
        None => spawn_driver(DriverJob {
            pools: entries,
            starting,
            placement,
            selection,
            mode: arrival_mode(graph),
            collector: collector.clone(),
            completions,
            cancel: CancelPlan {
                fraction: graph.workload.cancel_fraction,
                after_ms: graph.workload.cancel_after_ms,
                seed: graph.workload.seed,
            },
            interrupted: interrupted.clone(),
            grace,
            max_context: model.max_positions,
            sampling: graph.sampling,
        })?,
    })
}

/// A simulated run's releases: the trace driver's rules, on the virtual clock.
fn sim_releases(graph: &Graph, model: &Model, collector: &SharedCollector, releasing: Releasing) -> SimReleases {
    let Releasing { entries, selection, completions, .. } = releasing;
    let placement = Placement { choice: graph.workload.pool_choice, seed: graph.workload.seed };
    SimReleases {
        entries: Arc::new(Entries::new(entries, placement, collector.clone(), model.max_positions)),
        selection,
        mode: arrival_mode(graph),
        cancel: CancelPlan {
            fraction: graph.workload.cancel_fraction,
            after_ms: graph.workload.cancel_after_ms,
            seed: graph.workload.seed,
        },
        sampling: graph.sampling,
        completions,
    }
}

/// The stall watchdog (none with `--stall-timeout 0`): with requests pending, a pool whose
/// capabilities stop changing stalls the run, which keeps what completed in a partial report
/// marked stalled and exits with [`EXIT_STALL`].
fn start_watchdog(
    graph: &Graph,
    opts: &RunOptions,
    (watches, awaited): (Vec<(String, Watch)>, Option<Awaited>),
    collector: &SharedCollector,
    ended_pools: &Arc<Mutex<HashSet<String>>>,
    finished: &Arc<AtomicBool>,
) -> Result<Option<JoinHandle<()>>> {
    let stall_timeout = opts.stall_timeout.unwrap_or(Duration::from_secs(60));
    if stall_timeout.is_zero() {
        eprintln!("stall watchdog off (--stall-timeout 0)");
        return Ok(None);
    }
    let (pending_in, stalled_collector, dir) = (collector.clone(), collector.clone(), graph.report_dir.clone());
    let ended = ended_pools.clone();
    let watchdog = spawn_watchdog(
        watches,
        stall_timeout,
        move |pool| {
            let collector = pending_in.lock();
            match pool {
                None => collector.in_flight().len(),
                // every request has ended, yet the pool has not: what it still waits for
                // (an ack, an abort, a remote prefill) is waited on too
                Some(pool) if collector.all_ended() => usize::from(!ended.lock().contains(pool)),
                Some(pool) => collector.in_flight_in(pool),
            }
        },
        awaited,
        finished.clone(),
        stall_exit(&stalled_collector, &dir),
    )?;
    Ok(Some(watchdog))
}

/// What a stalled run does: says why, keeps what completed in a partial report marked stalled,
/// and exits with [`EXIT_STALL`].
fn stall_exit(collector: &SharedCollector, dir: &std::path::Path) -> impl FnOnce(String) + Send + 'static {
    let (collector, dir) = (collector.clone(), dir.to_path_buf());
    move |diagnosis| {
        // Straight to the process's stderr: a test harness's capture would lose it at the exit.
        let _ = writeln!(std::io::stderr(), "{diagnosis}");
        let summary = collector.lock().finish();
        let written = summary.and_then(|s| {
            write_report(&dir, &s.report(&Default::default(), json!({"stalled": true, "stall": diagnosis})))
        });
        if let Err(e) = written {
            eprintln!("cannot write the partial report: {e}");
        }
        std::process::exit(EXIT_STALL);
    }
}

/// What happens as the pools end: once every upstream pool has, the downstream ingresses and the
/// links to other processes close.
struct PoolEnds {
    upstream: PoolRole,
    downstream: Vec<Arc<Ingress>>,
    remote_links: Vec<Arc<TcpLink>>,
    /// Pools whose computation has ended.
    ended_pools: Arc<Mutex<HashSet<String>>>,
}

/// Joins the pools, each on its own thread: a pool that ends early fails what it still held,
/// so the driver (waiting for those requests) is never left waiting on it.
/// Decode pools take handoffs until every prefill pool has ended (prefill pools take
/// prefills until every decode pool has, with decode-first routing).
fn join_in_background(
    running: Vec<(PoolRole, Range<usize>, RunningPool)>,
    collector: &SharedCollector,
    ends: PoolEnds,
) -> Vec<JoinHandle<PoolResult>> {
    let upstream = ends.upstream;
    let upstream_left = Arc::new(AtomicUsize::new(running.iter().filter(|(role, ..)| *role == upstream).count()));
    let ends = Arc::new(ends);
    running
        .into_iter()
        .map(|(role, here, pool)| {
            let (collector, ends, upstream_left) = (collector.clone(), ends.clone(), upstream_left.clone());
            std::thread::spawn(move || {
                let result = pool.join();
                ends.ended_pools.lock().insert(result.name.clone());
                if role == upstream && upstream_left.fetch_sub(1, Ordering::SeqCst) == 1 {
                    for ingress in &ends.downstream {
                        ingress.close();
                    }
                    for link in &ends.remote_links {
                        link.close();
                    }
                }
                let (cause, message) = match &result.lost {
                    Some(lost) => (PROCESS_LOST, lost.message.clone()),
                    None => ("pool-ended", format!("pool {} ended before the request did", result.name)),
                };
                let mut collector = collector.lock();
                collector.fail_open(&result.name, cause, &message);
                if result.lost.is_some() && role == PoolRole::Prefill {
                    collector.fail_relayed(&result.name, here, cause, &message);
                }
                drop(collector);
                result
            })
        })
        .collect()
}
