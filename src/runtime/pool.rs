//! One pool as one timely computation: its ranks are timely workers (threads of this process, or
//! processes of a cluster), each building its rank (executor, offload, part in handoffs) and the
//! per-rank loop of `kvflow_operators::pool` ([`build_pool_graph`]), and parking when idle. A run
//! starts several pools side by side ([`start_pool`] returns at once) and joins them when the
//! workload is done; a pool spread over processes then gathers every rank's end-of-run result on
//! worker 0 in one last dataflow.

use super::cluster::{connect_then, timely_config, ClusterPlace};
use super::peers::Lost;
use super::watchdog::Watch;
use anyhow::{anyhow, Result};
use kvflow_kernels::models::Model;
use kvflow_operators::executor::{Executor, ExecutorContext, ExecutorKind, ExpertPlacement, Unavailable};
use kvflow_operators::offload::SavesBusy;
use kvflow_operators::policy::kv_index::{KvIndex, SharedKvIndex};
use kvflow_operators::policy::memory::MemoryLayout;
use kvflow_operators::policy::router::{RouterContext, RouterFactory};
use kvflow_operators::policy::scheduler::SchedulerConfig;
use kvflow_operators::pool::admit::{Ingress, IngressRouting};
use kvflow_operators::pool::align::{CacheEventRoute, Collectives, RoutingKeys};
use kvflow_operators::pool::emit::EventSink;
use kvflow_operators::pool::wake::RankWaker;
use kvflow_operators::pool::{build_pool_graph, PoolParts};
use kvflow_operators::rank::{OffloadSetup, Rank, RankStats, RemotePrefill, TestSwitches};
use kvflow_operators::transfer::{EventRelay, HandoffInbox, HandoffSink, TransferCounters};
use parking_lot::Mutex;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

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
    /// `expert_parallel = true`: each rank loads its own experts from the checkpoint (a
    /// simulated rank loads nothing and prices its share from the model's shapes).
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
    /// Told when each of its workers here has built its rank (the trace driver waits for it).
    pub starting: Option<Arc<super::starting::Starting>>,
    /// A simulated run: its workers step only when the run's stepper says, one at a time
    /// (`super::simulated`), on the virtual clock.
    pub lockstep: Option<super::simulated::Lockstep>,
    /// Every rank logs its launched steps (`[report] steps`).
    pub log_steps: bool,
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
        let mut counters = [0; kvflow_operators::transfer::faults::TRANSFER_COUNTERS];
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
    pub counters: [u64; kvflow_operators::transfer::faults::TRANSFER_COUNTERS],
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
    /// A simulated pool's: its ranks load nothing, each prices its share from the model's shapes.
    pub simulated: bool,
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
        /// Floats of one block in each layer (what a streamed piece is packed by).
        kv_layers: Vec<usize>,
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
    pub lost: Option<Lost>,
    /// Router `kv-aware`, the driving process: the routing index's last event per rank, and its
    /// resyncs.
    pub routing_index: Option<(std::collections::BTreeMap<u32, u64>, u64)>,
    /// The driving process of a spread pool: what the other processes' links moved.
    pub links_elsewhere: LinkTotals,
}

/// Every rank's counters per pool, or the accounting failures found.
pub fn check_ranks(results: &[PoolResult]) -> (Vec<(String, Vec<RankStats>)>, Vec<String>) {
    let mut stats = Vec::new();
    let mut failures = Vec::new();
    for r in results {
        let mut ok = Vec::new();
        for rank in &r.ranks {
            match rank {
                Ok(s) => ok.push(s.clone()),
                Err(e) => failures.extend(e.lines().map(String::from)),
            }
        }
        stats.push((r.name.clone(), ok));
    }
    (stats, failures)
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
    let config = timely_config(&job.name, job.ranks, job.cluster.as_ref())?;
    let (name, cluster) = (job.name.clone(), job.cluster.clone());
    let routing_index = start_routing_index(&job, ingress.as_deref());
    let workers = Arc::new(WorkerJob::new(job, ingress, sink, routing_index.clone()));
    let run_workers = move || {
        timely::execute(config, move |worker| {
            if let Some(watch) = &watch {
                watch.register(worker);
            }
            workers.run(worker)
        })
    };
    let guards = match &cluster {
        Some(place) => {
            super::peers::watch_for_lost_peers();
            connect_then(&name, place, run_workers)?
        }
        None => run_workers().map_err(|e| anyhow!("cannot start pool {name}: {e}"))?,
    };
    Ok(RunningPool { name, guards, cluster, routing_index })
}

/// Router `kv-aware`: the routing index, started in the process that drives the pool (its
/// ingress asks it, and every rank's cache events reach it through the step reports).
fn start_routing_index(job: &PoolJob, ingress: Option<&Ingress>) -> Option<SharedKvIndex> {
    let drives = job.cluster.as_ref().is_none_or(|c| c.process == 0);
    if !(job.routing_index && drives) {
        return None;
    }
    let index: SharedKvIndex = Arc::new(Mutex::new(KvIndex::start()));
    if let Some(ingress) = ingress {
        ingress.route_with(IngressRouting {
            index: index.clone(),
            block_size: job.layout.block_size,
            keyed_by_prompt_len: job.layout.prefix_keyed_by_prompt_len,
        });
    }
    Some(index)
}

/// What every worker of a pool builds its rank and its loop from (shared by the workers).
struct WorkerJob {
    job: PoolJob,
    ingress: Option<Arc<Ingress>>,
    /// Taken by worker 0.
    sink: Mutex<Option<Box<dyn EventSink + Send>>>,
    routing_index: Option<SharedKvIndex>,
    collectives: Collectives,
    keys: RoutingKeys,
}

impl WorkerJob {
    fn new(
        job: PoolJob,
        ingress: Option<Arc<Ingress>>,
        sink: Option<Box<dyn EventSink + Send>>,
        routing_index: Option<SharedKvIndex>,
    ) -> WorkerJob {
        let collectives = collectives(job.experts.as_ref());
        let keys = RoutingKeys {
            block_size: job.layout.block_size,
            keyed_by_prompt_len: job.layout.prefix_keyed_by_prompt_len,
        };
        WorkerJob { job, ingress, sink: Mutex::new(sink), routing_index, collectives, keys }
    }

    /// One worker: builds its rank and the pool graph, steps it until the pool ends, then hands
    /// back its rank's end-of-run result (gathered on worker 0 in a pool spread over processes).
    fn run(&self, worker: &mut timely::worker::Worker) -> RankResults {
        let (index, peers) = (worker.index(), worker.peers());
        // (a simulated run counts what each step schedules, from before the graph is built)
        let stepped = self.job.lockstep.as_ref().map(|l| (l, l.count_schedules(worker)));
        let rank = self.build(worker);
        match stepped {
            Some((lockstep, scheduled)) => lockstep.run(worker, &self.job.name, &scheduled),
            None => {
                while worker.has_dataflows() {
                    worker.step_or_park(None);
                }
            }
        }
        let result = rank.borrow_mut().finish_run();
        match &self.job.cluster {
            Some(cluster) => {
                // One worker per process says what the process's links moved.
                let first_here = index % (peers / cluster.processes) == 0;
                let links = self.job.links_here.as_ref().filter(|_| first_here).map(LinkFigures::read);
                gather_on_worker_0(worker, index, result, links)
            }
            None => RankResults { all_ranks: false, ranks: vec![result], links_elsewhere: LinkTotals::default() },
        }
    }

    /// Builds the worker's rank and its pool graph.
    fn build(&self, worker: &mut timely::worker::Worker) -> Rc<RefCell<Rank>> {
        let (index, peers) = (worker.index(), worker.peers());
        let waker = Arc::new(RankWaker::default());
        let starting = self.job.starting.as_ref().map(|s| s.rank());
        std::thread::sleep(std::time::Duration::from_millis(self.job.switches.slow_rank_build_ms));
        let rank = Rc::new(RefCell::new(self.rank(index, peers, waker.clone())));
        drop(starting);
        let parts = self.parts(rank.clone(), waker, index, peers);
        worker.dataflow::<u64, _, _>(move |scope| {
            build_pool_graph(scope, parts);
        });
        rank
    }

    /// Rank `index`'s executor (an expert-parallel rank holds only its own experts), and the
    /// bytes of experts it holds; an executor that cannot start becomes [`Unavailable`], which
    /// fails what it is given.
    fn executor(
        &self,
        index: usize,
        peers: usize,
        waker: &Arc<RankWaker>,
        saves: Option<&Arc<SavesBusy>>,
    ) -> (Box<dyn Executor>, u64) {
        let job = &self.job;
        let rank_model = match &job.experts {
            None => Ok(job.model.clone()),
            // A simulated rank prices its share of the experts from the whole model's shapes.
            Some(e) if e.simulated => Ok(job.model.clone()),
            Some(e) => kvflow_kernels::models::load_expert_shard(&e.checkpoint, index, peers)
                .map(Arc::new)
                .map_err(|err| format!("loading rank {index}'s experts from {}: {err}", e.checkpoint.display())),
        };
        let placement = job.experts.as_ref().map(|_| ExpertPlacement { rank: index, ranks: peers });
        let expert_bytes = match &job.experts {
            Some(e) if e.simulated => {
                let range = |n| kvflow_kernels::models::parts::moe::expert_range(n, index, peers).len();
                let (mine, all) = job.model.moe_layers().iter().fold((0, 0), |(m, a), &(_, n)| (m + range(n), a + n));
                (job.model.expert_bytes() * mine).checked_div(all).unwrap_or(0) as u64
            }
            _ => rank_model.as_ref().map_or(0, |m| m.expert_bytes() as u64),
        };
        let exec = rank_model.and_then(|model| {
            let ctx = ExecutorContext {
                pool: job.name.clone(),
                rank: index,
                model,
                layout: job.layout,
                waker: waker.clone(),
                experts: placement,
                mtp_drafts: job.scheduler.spec.filter(|s| s.drafter.runs_in_executor()).map_or(0, |s| s.draft_tokens),
                clock: job.lockstep.as_ref().map(|l| l.clock.clone()),
                saves: saves.cloned(),
            };
            job.executor.build(&job.executor_settings, ctx)
        });
        let exec = exec.unwrap_or_else(|reason| {
            tracing::error!(pool = %job.name, rank = index, "executor: {reason}");
            Box::new(Unavailable::new(reason))
        });
        (exec, expert_bytes)
    }

    /// Rank `index` with its executor, its offload, gauges and part in handoffs.
    fn rank(&self, index: usize, peers: usize, waker: Arc<RankWaker>) -> Rank {
        let job = &self.job;
        // (a simulated store's saves slow the simulated steps beside them)
        let saves = job
            .offload
            .as_ref()
            .and_then(|o| o.simulated.as_ref())
            .map(|s| Arc::new(SavesBusy::new(s.save_bytes_per_s)));
        let (exec, expert_bytes) = self.executor(index, peers, &waker, saves.as_ref());
        let mut rank =
            Rank::new(index, &job.name, job.layout, job.scheduler, exec, waker).with_switches(job.switches.clone());
        if let Some(setup) = &job.offload {
            rank = rank.with_offload(setup.clone(), job.lockstep.as_ref().map(|l| l.clock.clone()), saves);
        }
        if job.log_steps {
            rank = rank.logging_steps();
        }
        if job.routing_index {
            rank = rank.reporting_cache_events();
        }
        if let Some(g) = job.gauges.get(index) {
            rank = rank.with_gauges(g.clone());
        }
        rank.stats.expert_bytes = expert_bytes;
        match &job.handoff {
            PoolHandoff::None => rank,
            PoolHandoff::Out { sink, fingerprint, kv_layers, queue, relay } => {
                let rank = rank.with_handoff_out(sink.clone(), *fingerprint, queue.clone()).with_kv_layers(kv_layers);
                match relay {
                    Some(relay) => rank.with_event_relay(relay.clone()),
                    None => rank,
                }
            }
            PoolHandoff::In(inbox, None) => rank.with_handoff_in(inbox.clone()),
            PoolHandoff::In(inbox, Some(remote)) => {
                rank.with_handoff_in(inbox.clone()).with_remote_prefill(remote.clone())
            }
        }
    }

    /// What rank `index`'s pool graph is built from: worker 0 takes the ingress and the sink.
    fn parts(&self, rank: Rc<RefCell<Rank>>, waker: Arc<RankWaker>, index: usize, peers: usize) -> PoolParts {
        let job = &self.job;
        let sink = if index == 0 { self.sink.lock().take() } else { None };
        PoolParts {
            rank,
            waker,
            ingress: if index == 0 { self.ingress.clone() } else { None },
            router: (job.router)(RouterContext {
                ranks: peers,
                max_batched_tokens: job.scheduler.max_batched_tokens,
                block_size: job.layout.block_size,
                blocks_per_rank: job.layout.blocks,
            }),
            keys: self.keys,
            collectives: self.collectives.clone(),
            offload: job.offload.is_some(),
            ranks: peers,
            sink: sink.map(|s| s as Box<dyn EventSink>),
            cache_events: job.routing_index.then(|| CacheEventRoute {
                order: Default::default(),
                index: if index == 0 { self.routing_index.clone() } else { None },
            }),
            switches: job.switches.clone(),
        }
    }
}
