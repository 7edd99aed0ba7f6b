//! One pool as one timely computation: its ranks are timely workers (threads of this process, or
//! processes of a cluster), each building the per-pool graph of DESIGN §4 ([`build_pool_graph`])
//! and parking when idle. A run starts several pools side by side ([`start_pool`] returns at
//! once) and joins them when the workload is done; a pool spread over processes then gathers
//! every rank's end-of-run result on worker 0 in one last dataflow.
//!
//! ```text
//! ingress ─▶ admit ─(wake, broadcast)─▶ schedule(t) ─▶ align(t) ─▶ forward(t) ─▶ verify(t) ─┬▶ emit(t) ─▶ collector
//!              ▲ ▲ └─ wake loop (t+1) ─┘     ▲        (broadcast)                           │ (sampled: held per step in flight)
//!              │ └── feedback: Launched / Waiting / Parked / Ended (t+1) ◀── propose(t) ◀───┘
//!              └── RankWaker (completions landing on this rank)
//! ```
//!
//! `propose(t)` is built in pools with `[speculative]`; without it `verify(t)` feeds the feedback
//! edge. With `expert_parallel = true`, `forward(t)` is followed per MoE layer ℓ of the model by
//! `dispatch[ℓ] ─(exchange)▶ experts[ℓ] ─(exchange)▶ combine[ℓ]` — then, with the MTP drafter, by
//! the same three per draft pass (`dispatch[mtp.c]`) — and the last `combine` feeds `verify(t)`
//! (`kvflow_operators::experts`). With `[offload]`, `save(t)` consumes `verify`'s *saved* output
//! (jobs of completed steps) and hands them to the rank's save thread, and `load(t)` `forward`'s
//! *loads* output (jobs of requests admitted at `t`) to the rank's load thread.

use crate::runtime::watchdog::Watch;
use anyhow::{anyhow, Result};
use kvflow_kernels::models::Model;
use kvflow_operators::admit::{admit, Ingress, IngressRouting, Pending};
use kvflow_operators::align::{align, CacheEventRoute, Collectives, RoutingKeys};
use kvflow_operators::emit::{emit, EventSink};
use kvflow_operators::executor::{ExecutorContext, ExecutorKind, ExpertPlacement, Unavailable};
use kvflow_operators::experts::{moe_layer, MoeLayer};
use kvflow_operators::forward::forward;
use kvflow_operators::load::load;
use kvflow_operators::messages::{Event, LoopSignal, StepPlan};
use kvflow_operators::policy::kv_index::{KvIndex, SharedKvIndex};
use kvflow_operators::policy::memory::MemoryLayout;
use kvflow_operators::policy::router::{Router, RouterContext, RouterFactory};
use kvflow_operators::policy::scheduler::SchedulerConfig;
use kvflow_operators::propose::propose;
use kvflow_operators::rank::{OffloadSetup, Rank, RankStats, RemotePrefill, TestSwitches};
use kvflow_operators::save::save;
use kvflow_operators::schedule::schedule;
use kvflow_operators::transfer::{EventRelay, HandoffInbox, HandoffSink, TransferCounters};
use kvflow_operators::verify::verify;
use kvflow_operators::wake::RankWaker;
use parking_lot::Mutex;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use timely::dataflow::operators::vec::Map;
use timely::dataflow::operators::{ConnectLoop, Feedback};
use timely::dataflow::{Scope, StreamVec};

/// Where this process sits in a pool spread over several processes.
#[derive(Clone, Debug)]
pub struct ClusterPlace {
    pub process: usize,
    pub processes: usize,
    /// `host:port` of every process, in process order.
    pub addresses: Vec<String>,
    /// How long to wait for every process to connect before giving up (zero: wait for ever,
    /// saying so every 10 s).
    pub connect_timeout: std::time::Duration,
}

/// How often a process waiting for its peers says so.
const CONNECT_NOTICE: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs `start` (which connects the cluster's processes and then starts the workers) on a
/// thread of its own, so a peer that never connects is reported — every 10 s, and as an error
/// after the place's timeout — instead of blocking the run in silence.
fn connect_then<T: Send + 'static>(
    pool: &str,
    place: &ClusterPlace,
    start: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("kvflow-connect".into())
        .spawn(move || {
            let _ = tx.send(start());
        })
        .map_err(|e| anyhow!("pool {pool}: cannot start the connecting thread: {e}"))?;
    let waited = std::time::Instant::now();
    let peers: Vec<String> = (0..place.processes)
        .filter(|&p| p != place.process)
        .map(|p| format!("process {p} at {}", place.addresses[p]))
        .collect();
    loop {
        match rx.recv_timeout(CONNECT_NOTICE) {
            Ok(started) => return started.map_err(|e| anyhow!("cannot start pool {pool}: {e}")),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(anyhow!("pool {pool}: the connecting thread ended without starting the pool"))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        let secs = waited.elapsed().as_secs();
        let what = format!(
            "pool {pool}: process {} (listening on {}) has waited {secs} s for its peers to connect: {}",
            place.process,
            place.addresses[place.process],
            peers.join(", ")
        );
        if !place.connect_timeout.is_zero() && waited.elapsed() >= place.connect_timeout {
            return Err(anyhow!(
                "{what}; giving up after {} s (--stall-timeout). Is every process started, with the same \
                 hostfile, and can it reach these addresses?",
                place.connect_timeout.as_secs()
            ));
        }
        eprintln!("{what}");
    }
}

/// Everything one pool needs to run.
pub struct PoolJob {
    pub name: String,
    pub ranks: usize,
    pub model: Arc<Model>,
    pub layout: MemoryLayout,
    pub scheduler: SchedulerConfig,
    pub router: RouterFactory,
    pub executor: Arc<dyn ExecutorKind>,
    pub executor_settings: toml::Table,
    pub cluster: Option<ClusterPlace>,
    pub switches: TestSwitches,
    /// What its ranks hand off to, or take handoffs from (P/D).
    pub handoff: PoolHandoff,
    /// `expert_parallel = true`: each rank loads its own experts from the checkpoint.
    pub experts: Option<ExpertParallelJob>,
    /// `[offload]`: the store its ranks save full prompt chunks to.
    pub offload: Option<OffloadSetup>,
    /// Router `kv-aware`: every rank reports its cache events in its step reports, and the
    /// process that drives the pool starts the routing index (worker 0's `align` feeds it, the
    /// ingress asks it).
    pub routing_index: bool,
    /// A process of a spread pool that does not drive the workload: what its own links moved,
    /// sent to the driving process's report with its ranks' results.
    pub links_here: Option<LinkFigures>,
    /// Where rank r publishes its memory and queues each step (`gauges[r]`; empty: nowhere).
    pub gauges: Vec<Arc<kvflow_operators::rank::RankGauges>>,
}

/// What one process's tcp links moved: bytes that crossed a socket, and the transfer engine's
/// counters (`TransferCounters::snapshot`).
#[derive(Clone, Default)]
pub struct LinkFigures {
    pub socket_bytes: Arc<std::sync::atomic::AtomicU64>,
    pub counters: Arc<TransferCounters>,
}

impl LinkFigures {
    fn read(&self) -> LinkTotals {
        let mut counters = [0; 8];
        for (slot, (_, value)) in counters.iter_mut().zip(self.counters.snapshot()) {
            *slot = value;
        }
        LinkTotals { socket_bytes: self.socket_bytes.load(std::sync::atomic::Ordering::Relaxed), counters }
    }
}

/// What some processes' links moved, summed: socket bytes, and the transfer counters in
/// `TransferCounters::snapshot` order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LinkTotals {
    pub socket_bytes: u64,
    pub counters: [u64; 8],
}

impl LinkTotals {
    pub fn add(&mut self, other: &LinkTotals) {
        self.socket_bytes += other.socket_bytes;
        for (sum, v) in self.counters.iter_mut().zip(other.counters) {
            *sum += v;
        }
    }
}

/// An expert-parallel pool's model: where each rank loads its share of the experts from, and
/// the model's MoE layers (each a dispatch and a combine).
#[derive(Clone, Debug)]
pub struct ExpertParallelJob {
    pub checkpoint: std::path::PathBuf,
    pub moe_layers: Vec<usize>,
    /// The MTP drafter's passes after them (each an exchange of the MTP layer's experts), and
    /// the MTP layer's index.
    pub draft_passes: usize,
    pub mtp_layer: usize,
    /// Rows per request of a decode step: 1 + `draft_tokens` with drafting, 1 without — and
    /// on a prefill pool, which never verifies.
    pub spec_width: usize,
}

/// A pool's part in handoffs.
#[derive(Clone, Default)]
pub enum PoolHandoff {
    /// An aggregated pool.
    #[default]
    None,
    /// A prefill pool: finished prefills go to `sink`; `queue` counts the prefills decode ranks
    /// asked for and it has not handed off.
    /// With `relay`, the remote decode pool's events for its requests come back through the
    /// ranks that handed them off (a process of a prefill pool spread over processes).
    Out {
        sink: Arc<dyn HandoffSink>,
        fingerprint: u64,
        queue: Arc<std::sync::atomic::AtomicUsize>,
        relay: Option<Arc<EventRelay>>,
    },
    /// A decode pool: handoffs arrive in this inbox; with `[pool.disaggregation]` its ranks
    /// decide where new requests are prefilled.
    In(Arc<HandoffInbox>, Option<RemotePrefill>),
}

/// What the pool's ranks of this process hand back when it ends: per rank, its counters, or why
/// its end-of-run check failed.
pub struct PoolResult {
    pub name: String,
    pub ranks: Vec<Result<RankStats, String>>,
    /// A pool spread over processes that lost one (its ranks here were dropped: no counters).
    pub lost: Option<super::peers::Lost>,
    /// Router `kv-aware`, the driving process: the routing index's last event per rank, and its
    /// resyncs.
    pub routing_index: Option<(std::collections::BTreeMap<u32, u64>, u64)>,
    /// The driving process of a spread pool: what the other processes' links moved.
    pub links_elsewhere: LinkTotals,
}

/// What a worker hands back when its pool ends: its rank's result, or on worker 0 of a pool
/// spread over processes every rank's (`all_ranks`) and what the other processes' links moved.
struct RankResults {
    all_ranks: bool,
    ranks: Vec<Result<RankStats, String>>,
    links_elsewhere: LinkTotals,
}

/// A pool spread over processes: every rank's end-of-run result crosses to worker 0 in one last
/// dataflow (the processes are still connected then), so the driving process reports the ranks
/// of every process. Each worker keeps its own too, for its process's end-of-run check.
fn gather_on_worker_0(
    worker: &mut timely::worker::Worker,
    index: usize,
    own: Result<RankStats, String>,
    links: Option<LinkTotals>,
) -> RankResults {
    use timely::dataflow::channels::pact::Exchange;
    use timely::dataflow::operators::generic::operator::Operator;
    use timely::dataflow::operators::ToStream;
    type Ended = (usize, Result<RankStats, String>, Option<LinkTotals>);
    let gathered: Rc<RefCell<Vec<Ended>>> = Rc::default();
    let into = gathered.clone();
    worker.dataflow::<u64, _, _>(|scope| {
        vec![(index, own.clone(), links)].to_stream(scope).container::<Vec<Ended>>().sink(
            Exchange::new(|_: &Ended| 0u64),
            "gather",
            move |(input, _frontier)| {
                input.for_each_stamp(|_, data| into.borrow_mut().extend(data.flat_map(|d| d.drain(..))));
            },
        );
    });
    while worker.has_dataflows() {
        worker.step_or_park(None);
    }
    if index != 0 {
        return RankResults { all_ranks: false, ranks: vec![own], links_elsewhere: LinkTotals::default() };
    }
    let mut all = gathered.take();
    all.sort_by_key(|(rank, ..)| *rank);
    let mut links_elsewhere = LinkTotals::default();
    for figures in all.iter().filter_map(|(_, _, links)| links.as_ref()) {
        links_elsewhere.add(figures);
    }
    RankResults { all_ranks: true, ranks: all.into_iter().map(|(_, r, _)| r).collect(), links_elsewhere }
}

/// A pool whose workers are running.
pub struct RunningPool {
    name: String,
    guards: timely::communication::WorkerGuards<RankResults>,
    cluster: Option<ClusterPlace>,
    routing_index: Option<SharedKvIndex>,
}

impl RunningPool {
    /// Waits for the pool's workers to end. A pool spread over processes whose join panics has
    /// lost a process (`peers`).
    pub fn join(self) -> PoolResult {
        let RunningPool { name, guards, cluster, routing_index } = self;
        let joined = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| guards.join()));
        match joined {
            Ok(results) => {
                let results: Vec<RankResults> = results
                    .into_iter()
                    .map(|r| {
                        r.unwrap_or_else(|e| RankResults {
                            all_ranks: false,
                            ranks: vec![Err(format!("pool {name}: worker failed: {e}"))],
                            links_elsewhere: LinkTotals::default(),
                        })
                    })
                    .collect();
                // Worker 0 of a spread pool gathered every process's ranks: those are reported.
                let (ranks, links_elsewhere) = match results.iter().position(|r| r.all_ranks) {
                    Some(at) => {
                        let all = results.into_iter().nth(at).expect("found");
                        (all.ranks, all.links_elsewhere)
                    }
                    None => (results.into_iter().flat_map(|r| r.ranks).collect(), LinkTotals::default()),
                };
                let routing_index = routing_index.map(|i| {
                    let i = i.lock();
                    (i.applied(), i.resyncs)
                });
                PoolResult { name, ranks, lost: None, routing_index, links_elsewhere }
            }
            Err(_) => {
                let lost = super::peers::lost(&name, cluster.as_ref());
                tracing::error!("{}", lost.message);
                PoolResult {
                    name,
                    ranks: Vec::new(),
                    lost: Some(lost),
                    routing_index: None,
                    links_elsewhere: LinkTotals::default(),
                }
            }
        }
    }
}

fn timely_config(job: &PoolJob) -> Result<timely::Config> {
    Ok(match &job.cluster {
        None => timely::Config::process(job.ranks),
        Some(c) => {
            if !job.ranks.is_multiple_of(c.processes) {
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

/// The operators of one rank's pool graph and what they share.
pub struct PoolParts {
    pub rank: Rc<RefCell<Rank>>,
    pub waker: Arc<RankWaker>,
    /// Rank 0 (of the process that drives the workload) only.
    pub ingress: Option<Arc<Ingress>>,
    pub router: Box<dyn Router>,
    pub keys: RoutingKeys,
    /// The MoE layers that exchange (expert parallelism) and the spec width.
    pub collectives: Collectives,
    /// Whether its ranks use an offload store (`save` and `load` operators after `forward`).
    pub offload: bool,
    pub ranks: usize,
    /// Worker 0 only.
    pub sink: Option<Box<dyn EventSink>>,
    /// Router `kv-aware`: the order of the ranks' cache events (every worker), and the routing
    /// index they go into (worker 0 of the process driving the pool).
    pub cache_events: Option<CacheEventRoute>,
    pub switches: TestSwitches,
}

/// Streams of a built pool graph that more operators may consume.
pub struct PoolStreams<'scope> {
    pub plans: StreamVec<'scope, u64, StepPlan>,
    /// Requests that ended, each at the step whose completion ended it.
    pub sampled: StreamVec<'scope, u64, Event>,
}

/// Builds the per-pool graph of DESIGN §4 on one rank. The same function builds what runs and
/// what `kvflow check --dot` draws.
pub fn build_pool_graph(scope: Scope<'_, u64>, parts: PoolParts) -> PoolStreams<'_> {
    let PoolParts { rank, waker, ingress, router, keys, collectives, offload, ranks, sink, cache_events, switches } =
        parts;
    let index = rank.borrow().index;
    let hold = |op: &str| switches.hold_at(op, index);
    let pending: Pending = Rc::new(RefCell::new(Default::default()));
    let (signal_loop, feedback) = scope.feedback::<Vec<LoopSignal>>(1);
    let (wake_loop, woken) = scope.feedback::<Vec<u64>>(1);
    let wakes = admit(feedback.clone(), woken, ingress, pending.clone(), waker, hold("admit"));
    wakes.clone().connect_loop(wake_loop);
    let reports = schedule(feedback, wakes, rank.clone(), pending, hold("schedule"));
    let plans = align(
        reports,
        ranks,
        router,
        keys,
        collectives.clone(),
        cache_events,
        hold("align"),
        switches.align_without_waiting,
    );
    let expert_parallel = !collectives.moe_layers.is_empty();
    let out = forward(plans.clone(), rank.clone(), expert_parallel, hold("forward"));
    let launched = if expert_parallel {
        // forward(t), then dispatch → experts → combine per MoE layer, then per draft pass of
        // the MTP drafter, the last to verify.
        let mut stages = out.stages;
        let count = collectives.moe_layers.len();
        let passes = (0..collectives.draft_passes).map(|c| (count + c, collectives.mtp_layer, Some(c)));
        let layers = collectives.moe_layers.iter().enumerate().map(|(moe, &layer)| (moe, layer, None));
        for (moe, layer, draft_pass) in layers.chain(passes) {
            let at = MoeLayer { moe, layer, draft_pass };
            stages = moe_layer(stages, rank.clone(), at, switches.exchange_switches(index, moe));
        }
        stages.map(|token| token.signal)
    } else {
        out.signals
    };
    let verified = verify(launched, rank.clone(), hold("verify"));
    if rank.borrow().scheduler.config.spec.is_some() {
        propose(verified.signals, rank.clone(), hold("propose")).connect_loop(signal_loop);
    } else {
        verified.signals.connect_loop(signal_loop);
    }
    emit(verified.sampled.clone(), sink);
    if offload {
        save(verified.saved, rank.clone());
        load(out.loads, rank);
    }
    PoolStreams { plans, sampled: verified.sampled }
}

/// What a pool's forward does collectively: its MoE layers' exchanges and its draft passes.
pub fn collectives(experts: Option<&ExpertParallelJob>) -> Collectives {
    Collectives {
        moe_layers: experts.map(|e| e.moe_layers.clone()).unwrap_or_default(),
        spec_width: experts.map_or(1, |e| e.spec_width),
        draft_passes: experts.map_or(0, |e| e.draft_passes),
        mtp_layer: experts.map_or(0, |e| e.mtp_layer),
    }
}

/// Starts the pool's workers and returns at once. `ingress` feeds rank 0 (the process that
/// drives the workload has it); `sink` receives every event of the pool on worker 0; `watch`
/// registers timely's logs for the stall watchdog.
pub fn start_pool(
    job: PoolJob,
    ingress: Option<Arc<Ingress>>,
    sink: Option<Box<dyn EventSink + Send>>,
    watch: Option<Watch>,
) -> Result<RunningPool> {
    let config = timely_config(&job)?;
    let job_cluster = job.cluster.clone();
    let PoolJob {
        name,
        model,
        layout,
        scheduler,
        router,
        executor,
        executor_settings,
        switches,
        handoff,
        experts,
        offload,
        routing_index,
        links_here,
        gauges,
        ..
    } = job;
    let collectives = collectives(experts.as_ref());
    let reports_cache_events = routing_index;
    // The index lives in the process that drives the pool (its ingress asks it); every rank's
    // events reach it through the reports.
    let drives = job_cluster.as_ref().is_none_or(|c| c.process == 0);
    let routing_index: Option<SharedKvIndex> =
        (routing_index && drives).then(|| Arc::new(parking_lot::Mutex::new(KvIndex::start())));
    let routing_index_here = routing_index.clone();
    let keys = RoutingKeys { block_size: layout.block_size, keyed_by_prompt_len: layout.prefix_keyed_by_prompt_len };
    if let (Some(index), Some(ingress)) = (&routing_index, &ingress) {
        ingress.route_with(IngressRouting {
            index: index.clone(),
            block_size: keys.block_size,
            keyed_by_prompt_len: keys.keyed_by_prompt_len,
        });
    }
    let sink = Mutex::new(sink);
    let pool = name.clone();
    let cluster = job_cluster;
    let spread = cluster.is_some();
    let processes = cluster.as_ref().map_or(1, |c| c.processes);
    let run_workers = move || {
        timely::execute(config, move |worker| {
            if let Some(watch) = &watch {
                watch.register(worker);
            }
            let (index, peers) = (worker.index(), worker.peers());
            let waker = Arc::new(RankWaker::default());
            // An expert-parallel rank holds only its own experts.
            let rank_model = match &experts {
                None => Ok(model.clone()),
                Some(e) => kvflow_kernels::models::load_expert_shard(&e.checkpoint, index, peers)
                    .map(Arc::new)
                    .map_err(|err| format!("loading rank {index}'s experts from {}: {err}", e.checkpoint.display())),
            };
            let placement = experts.as_ref().map(|_| ExpertPlacement { rank: index, ranks: peers });
            let expert_bytes = rank_model.as_ref().map_or(0, |m| m.expert_bytes() as u64);
            let exec = rank_model.and_then(|model| {
                let ctx = ExecutorContext {
                    pool: pool.clone(),
                    rank: index,
                    model,
                    layout,
                    waker: waker.clone(),
                    experts: placement,
                    mtp_drafts: scheduler.spec.filter(|s| s.drafter.runs_in_executor()).map_or(0, |s| s.draft_tokens),
                };
                executor.build(&executor_settings, ctx)
            });
            let exec = exec.unwrap_or_else(|reason| {
                tracing::error!(pool = %pool, rank = index, "executor: {reason}");
                Box::new(Unavailable::new(reason))
            });
            let mut rank =
                Rank::new(index, &pool, layout, scheduler, exec, waker.clone()).with_switches(switches.clone());
            if let Some(setup) = &offload {
                rank = rank.with_offload(setup.clone());
            }
            if reports_cache_events {
                rank = rank.reporting_cache_events();
            }
            if let Some(g) = gauges.get(index) {
                rank = rank.with_gauges(g.clone());
            }
            rank.stats.expert_bytes = expert_bytes;
            let rank = match &handoff {
                PoolHandoff::None => rank,
                PoolHandoff::Out { sink, fingerprint, queue, relay } => {
                    let rank = rank.with_handoff_out(sink.clone(), *fingerprint, queue.clone());
                    match relay {
                        Some(relay) => rank.with_event_relay(relay.clone()),
                        None => rank,
                    }
                }
                PoolHandoff::In(inbox, None) => rank.with_handoff_in(inbox.clone()),
                PoolHandoff::In(inbox, Some(remote)) => {
                    rank.with_handoff_in(inbox.clone()).with_remote_prefill(remote.clone())
                }
            };
            let rank = Rc::new(RefCell::new(rank));
            let sink = if index == 0 { sink.lock().take() } else { None };
            let parts = PoolParts {
                rank: rank.clone(),
                waker,
                ingress: if index == 0 { ingress.clone() } else { None },
                router: router(RouterContext {
                    ranks: peers,
                    max_batched_tokens: scheduler.max_batched_tokens,
                    block_size: layout.block_size,
                }),
                keys,
                collectives: collectives.clone(),
                offload: offload.is_some(),
                ranks: peers,
                sink: sink.map(|s| s as Box<dyn EventSink>),
                cache_events: reports_cache_events.then(|| CacheEventRoute {
                    order: Default::default(),
                    index: if index == 0 { routing_index.clone() } else { None },
                }),
                switches: switches.clone(),
            };
            worker.dataflow::<u64, _, _>(move |scope| {
                build_pool_graph(scope, parts);
            });
            while worker.has_dataflows() {
                worker.step_or_park(None);
            }
            let result = rank.borrow_mut().finish_run();
            if spread {
                // One worker per process says what the process's links moved.
                let first_here = index % (peers / processes) == 0;
                let links = links_here.as_ref().filter(|_| first_here).map(LinkFigures::read);
                gather_on_worker_0(worker, index, result, links)
            } else {
                RankResults { all_ranks: false, ranks: vec![result], links_elsewhere: LinkTotals::default() }
            }
        })
    };
    let guards = match &cluster {
        Some(place) => {
            super::peers::watch_for_lost_peers();
            connect_then(&name, place, run_workers)?
        }
        None => run_workers().map_err(|e| anyhow!("cannot start pool {name}: {e}"))?,
    };
    Ok(RunningPool { name, guards, cluster, routing_index: routing_index_here })
}
