//! `kvflow run`: loads the model and the workload a graph names, sizes each pool's rank memory,
//! starts every pool of the run (each its own timely computation: threads, or processes of a
//! cluster), drives the workload into them, watches them for stalls, checks every rank's
//! accounting, runs `--verify`, and writes `report.json` and `requests.jsonl`.

mod cluster;
pub mod collector;
pub mod dot;
pub mod driver;
pub mod entry;
pub mod front;
mod hostfile;
mod links;
mod memory;
mod offload;
mod peers;
pub(crate) mod pool;
mod report;
mod serve;
mod verify;
mod watchdog;

pub use cluster::ClusterPlace;
pub use front::{FrontEnd, FrontEndJob, PoolGauges};
pub use kvflow_operators::pool::{build_pool_graph, PoolParts, PoolStreams};
pub use memory::plan_memory;
pub use pool::ExpertParallelJob;

use crate::graph::{Graph, PoolConfig, PoolRole, WorkloadMode};
use crate::registry::Registry;
use crate::report::{build_report, write_outputs, Slo};
use crate::trace::{read_trace, synthesize, SynthOptions, TraceFormat};
use crate::workload::{select, ArrivalMode, Selection};

use anyhow::{anyhow, bail, Context, Result};
use collector::{spawn_collector_thread, Collector, CollectorSink};
use driver::{spawn_driver, CancelPlan, DriverJob};
use entry::{Entries, EntryPool, Placement};
use kvflow_kernels::models::{self, Model};
use kvflow_operators::offload::ObjectStore;
use kvflow_operators::rank::TestSwitches;
use parking_lot::Mutex;
use pool::{check_ranks, start_pool, PoolJob};
use serde_json::json;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use watchdog::{spawn_watchdog, Watch};

/// Exit status: all good.
pub const EXIT_OK: i32 = 0;
/// The failure cause of a request whose pool lost one of its processes (`peers`).
pub const PROCESS_LOST: &str = "process-lost";
/// Exit status: `--verify` found mismatches.
pub const EXIT_VERIFY_MISMATCH: i32 = 1;
/// Exit status: some requests failed.
pub const EXIT_FAILED_REQUESTS: i32 = 2;
/// Exit status: a pool stalled.
pub const EXIT_STALL: i32 = 3;
/// Exit status: an accounting check found memory held by no one (the report names it).
pub const EXIT_ACCOUNTING: i32 = 4;

/// How to run a graph, beyond the graph itself.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Run only this pool (default: every pool of the graph).
    pub pool: Option<String>,
    /// `--pools`: run only these pools of the graph; the others run in other processes, joined
    /// to these over their tcp links.
    pub pools: Option<Vec<String>>,
    /// `--endpoint POOL=HOST:PORT`: where a decode pool listens.
    pub endpoints: std::collections::HashMap<String, String>,
    pub cluster: Option<ClusterPlace>,
    pub verify: bool,
    pub show_progress: bool,
    pub switches: TestSwitches,
    /// Set to stop the run as if by Ctrl-C (the CLI's signal handler sets it).
    pub interrupt: Option<Arc<AtomicBool>>,
    /// How long in-flight requests may finish after an interrupt before they are cancelled.
    pub grace: Option<Duration>,
    /// With requests pending, how long no capability may change before the run is declared
    /// stalled (default 60 s; zero turns the watchdog off).
    pub stall_timeout: Option<Duration>,
    /// The longest gap the workload may leave before a release (default 10 minutes): a longer
    /// one fails the run before it starts.
    pub max_wait: Option<Duration>,
    /// A front end (`kvflow serve`'s HTTP server) that releases the requests, in place of the
    /// workload's trace.
    pub serve: Option<Arc<dyn FrontEnd>>,
}

/// The default of [`RunOptions::max_wait`].
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(600);

/// What a run produced.
pub struct RunOutcome {
    /// `report.json`'s content (process 0 only).
    pub report: Option<serde_json::Value>,
    pub out_dir: PathBuf,
    pub exit_code: i32,
    /// Set when the trace was too short for what was asked.
    pub note: Option<String>,
}

/// The pools this run starts: the one `--pool` names, or every pool of the graph (`kvflow
/// check` asks the same, so it refuses what `run` would).
pub fn pick_pools<'g>(graph: &'g Graph, name: Option<&str>) -> Result<Vec<&'g PoolConfig>> {
    let pools = match name {
        Some(n) => vec![graph.pool(n).map_err(|e| anyhow!("{e}"))?],
        None => graph.pools.iter().collect(),
    };
    if name.is_some() && pools.iter().any(|p| p.role != PoolRole::Aggregated) {
        bail!(
            "{}: --pool runs one aggregated pool; run a prefill or decode pool with --pools NAME[,NAME] (its \
             linked pools in other processes)",
            graph.path.display()
        );
    }
    check_pools(graph, &pools)?;
    Ok(pools)
}

/// The pools `--pools` names, each once, checked as [`pick_pools`] checks them.
pub fn pick_named_pools<'g>(graph: &'g Graph, names: &[String]) -> Result<Vec<&'g PoolConfig>> {
    let mut pools: Vec<&PoolConfig> = Vec::new();
    for name in names {
        let pool = graph.pool(name).map_err(|e| anyhow!("--pools: {e}"))?;
        if pools.iter().any(|p| p.name == pool.name) {
            bail!("--pools names pool `{name}` twice");
        }
        pools.push(pool);
    }
    if pools.is_empty() {
        bail!("--pools: name at least one pool of {}", graph.path.display());
    }
    check_pools(graph, &pools)?;
    Ok(pools)
}

/// What no run of these pools takes yet.
fn check_pools(graph: &Graph, pools: &[&PoolConfig]) -> Result<()> {
    if let Some(pool) = links::pool_with_disaggregation_rule(graph).filter(|_| pools.len() < graph.pools.len()) {
        bail!(
            "{}: pool `{}`: [pool.disaggregation] (a decode rank deciding where to prefill) runs its prefill and \
             decode pools in one process; run them all (no --pool or --pools), or leave it out",
            graph.path.display(),
            pool.name
        );
    }
    if graph.faults.any() && !graph.is_disaggregated() {
        bail!(
            "{}: [faults]: faults strike the transfer engine, and this graph has no [[link]]s (a prefill and a \
             decode pool joined by a link)",
            graph.path.display()
        );
    }
    if graph.faults.corrupt > 0.0 {
        if let Some(link) = graph.links.iter().find(|l| l.backend == crate::graph::TransferBackend::Inproc) {
            bail!(
                "{}: [faults] corrupt: link {} → {} is inproc, which moves no bytes to damage (and checksums \
                 none); corruption applies to tcp links",
                graph.path.display(),
                link.from,
                link.to
            );
        }
    }
    Ok(())
}

/// The workload's requests, with the note when the trace is shorter than asked.
pub fn load_workload(graph: &Graph, vocab_size: usize) -> Result<Selection> {
    let w = &graph.workload;
    let trace = w
        .trace
        .as_ref()
        .ok_or_else(|| anyhow!("{}: workload.trace is not set (or pass --trace)", graph.path.display()))?;
    let format: TraceFormat = w.format.parse().map_err(|e| anyhow!("workload.format: {e}"))?;
    let mut records = read_trace(trace, format)?;
    // Only the requests the run replays are synthesised, each prompt up front (4 bytes a
    // token): they must fit the machine.
    if let Some(limit) = w.limit {
        records.truncate(w.warmup.saturating_add(limit));
    }
    let tokens: u128 = records.iter().map(|r| crate::trace::scaled_len(r.input_len, w.block_tokens) as u128).sum();
    if let Some(available) = models::available_memory() {
        if tokens * 4 > available / 2 {
            bail!(
                "{}: the trace's prompts come to {tokens} tokens at workload.block_tokens = {} ({}), more than half \
                 the {} this machine has available; use --limit or a smaller block_tokens",
                trace.display(),
                w.block_tokens,
                models::human_bytes(tokens * 4),
                models::human_bytes(available)
            );
        }
    }
    let requests = synthesize(
        &records,
        &SynthOptions {
            block_tokens: w.block_tokens,
            seed: w.seed,
            vocab_size,
            max_output_tokens: w.max_output_tokens,
        },
    )
    .map_err(|e| anyhow!("{}: {e}", trace.display()))?;
    let selection = select(requests, w.warmup, w.limit);
    if selection.measured == 0 {
        bail!(
            "{}: nothing to measure: the trace has {} request(s) and workload.warmup (or --warmup) {} takes them all",
            trace.display(),
            records.len(),
            w.warmup
        );
    }
    Ok(selection)
}

/// Checks the rank memory this process is asked to hold (every pool's budgets together)
/// against what the machine has, before anything is allocated. (Each pool's rank count is
/// bounded by the graph's rules.)
/// A pool that lists several processes runs only as one of them (`--process`). A pool spread
/// over processes is an aggregated pool, or a prefill pool whose links reach decode pools in
/// other processes over tcp (each of its processes opens its own links; the events coming back
/// go through its ranks to the driving process).
fn check_processes(graph: &Graph, pools: &[&PoolConfig], cluster: Option<&ClusterPlace>) -> Result<()> {
    if cluster.is_none() {
        if let Some(p) = pools.iter().find(|p| p.hosts.len() > 1) {
            bail!(
                "{}: pool `{}` lists {} processes (hosts): run each with `kvflow run {} --pools {} --process I`, \
                 or all of them on this machine with `kvflow launch {}`",
                graph.path.display(),
                p.name,
                p.hosts.len(),
                graph.path.display(),
                p.name,
                graph.path.display()
            );
        }
        return Ok(());
    }
    for p in pools {
        match p.role {
            PoolRole::Aggregated => {}
            PoolRole::Prefill => {
                let out = graph.links_from(&p.name);
                let here = |to: &str| pools.iter().any(|q| q.name == to);
                if let Some(l) = out.iter().find(|l| l.backend != crate::graph::TransferBackend::Tcp || here(&l.to)) {
                    bail!(
                        "{}: prefill pool `{}` is spread over processes, so each of them hands off over its own \
                         links: link {} → {} must be backend = \"tcp\", to a decode pool run in a process of its \
                         own (`--pools {}` here, `--pools {}` there)",
                        graph.path.display(),
                        p.name,
                        l.from,
                        l.to,
                        p.name,
                        l.to
                    );
                }
            }
            PoolRole::Decode => bail!(
                "{}: decode pool `{}` cannot be spread over processes: a handoff lands in the memory of the one \
                 process its link reaches; spread its prefill pool instead, or give it more ranks in one process",
                graph.path.display(),
                p.name
            ),
        }
    }
    Ok(())
}

fn check_machine(graph: &Graph, pools: &[&PoolConfig], processes: usize) -> Result<()> {
    let Some(available) = models::available_memory() else { return Ok(()) };
    let mut total: u128 = 0;
    let mut parts = Vec::new();
    for pool in pools {
        let here = (pool.ranks / processes.max(1)).max(1) as u128;
        let bytes = here * pool.memory.budget_bytes as u128;
        total += bytes;
        parts.push(format!("pool `{}`: {here} rank(s) × {} bytes", pool.name, pool.memory.budget_bytes));
    }
    if total > available {
        bail!(
            "{}: memory.budget_bytes: this process would hold {} of rank memory ({}), more than the {} this \
             machine has available (MemAvailable); lower memory.budget_bytes or the ranks",
            graph.path.display(),
            models::human_bytes(total),
            parts.join(", "),
            models::human_bytes(available)
        );
    }
    Ok(())
}

fn arrival_mode(graph: &Graph) -> ArrivalMode {
    match graph.workload.mode {
        WorkloadMode::Timestamps { time_scale } => ArrivalMode::Timestamps { time_scale },
        WorkloadMode::Concurrency(n) => ArrivalMode::Concurrency(n),
        WorkloadMode::Rate { per_second } => ArrivalMode::Rate { per_second, seed: graph.workload.seed },
    }
}

/// Loads the graph's model.
/// A `cuda` pool that cannot start is refused before the run: a model of another family, or no
/// driver on this machine (unless the pool emulates the kernels).
fn check_cuda_pools(graph: &Graph, model: &Model) -> Result<()> {
    for pool in graph.pools.iter().filter(|p| p.executor == "cuda") {
        let settings = kvflow_operators::executor::CudaSettings::read(&pool.executor_settings)
            .map_err(|e| anyhow!("{}: pool {}: {e}", graph.path.display(), pool.name))?;
        if let Some(why) = kvflow_kernels::cuda::unsupported(model) {
            bail!("{}: pool {}: {why}", graph.path.display(), pool.name);
        }
        if settings.emulate {
            continue;
        }
        let visible = kvflow_kernels::cuda::visible_gpus().map_err(|e| {
            anyhow!(
                "{}: pool {}: executor `cuda`: {e} (`emulate = true` in [pool.executor_settings] runs the kernels on \
                 the CPU instead)",
                graph.path.display(),
                pool.name
            )
        })?;
        if visible == 0 {
            bail!("{}: pool {}: executor `cuda`: the driver shows no GPU", graph.path.display(), pool.name);
        }
        if let Some(asked) = settings.gpus.iter().flatten().find(|&&g| g >= visible) {
            bail!(
                "{}: pool {}: executor_settings.gpus names GPU {asked}, and this machine has {visible} visible \
                 (CUDA_VISIBLE_DEVICES)",
                graph.path.display(),
                pool.name
            );
        }
    }
    Ok(())
}

pub fn load_model(graph: &Graph) -> Result<Arc<Model>> {
    let model = models::load(&graph.model).with_context(|| format!("cannot load model {}", graph.model.display()))?;
    Ok(Arc::new(model))
}

/// One pool's job: its memory layout for the model and workload, its scheduler, router and
/// executor.
/// An expert-parallel pool's model: its MoE layers (each a dispatch and a combine) and, with the
/// MTP drafter, its draft passes after them; `None` without expert parallelism.
pub(crate) fn expert_parallel_job(
    graph: &Graph,
    pool: &PoolConfig,
    model: &Model,
) -> Result<Option<ExpertParallelJob>> {
    if !pool.expert_parallel {
        return Ok(None);
    }
    let moe_layers: Vec<usize> = model.moe_layers().into_iter().map(|(layer, _)| layer).collect();
    if moe_layers.is_empty() {
        return Err(anyhow!(
            "{}: pool `{}`: expert_parallel = true needs a MoE model; model_type {} has no MoE layer",
            graph.path.display(),
            pool.name,
            model.model_type
        ));
    }
    let mtp_drafts = pool.scheduler.spec.filter(|s| s.drafter.runs_in_executor()).map_or(0, |s| s.draft_tokens);
    let draft_passes = kvflow_operators::executor::draft_passes(model, true, mtp_drafts);
    let mtp_layer = model.num_layers();
    let verifies = pool.role != crate::graph::PoolRole::Prefill;
    let spec_width = 1 + pool.scheduler.spec.filter(|_| verifies).map_or(0, |s| s.draft_tokens);
    Ok(Some(ExpertParallelJob { checkpoint: graph.model.clone(), moe_layers, draft_passes, mtp_layer, spec_width }))
}

fn pool_job(
    graph: &Graph,
    pool: &PoolConfig,
    model: &Arc<Model>,
    largest_request: usize,
    opts: &RunOptions,
    registry: &Registry,
    store: Option<&Arc<dyn ObjectStore>>,
) -> Result<PoolJob> {
    let layout = plan_memory(model, &pool.memory, &pool.scheduler, largest_request)
        .with_context(|| format!("{}: pool `{}`", graph.path.display(), pool.name))?;
    let scheduler = pool.scheduler;
    let named = |what: &str, name: &str, known: Vec<String>| {
        anyhow!(
            "{}: pool `{}`: {what} {name:?} is not registered (known: {})",
            graph.path.display(),
            pool.name,
            known.join(", ")
        )
    };
    let router =
        registry.routers.get(&pool.router).ok_or_else(|| named("router", &pool.router, registry.routers.names()))?;
    let executor = registry
        .executors
        .get(&pool.executor)
        .ok_or_else(|| named("executor", &pool.executor, registry.executors.names()))?;
    let executor_settings = pool.executor_settings.clone();
    executor.check(&executor_settings).map_err(|e| anyhow!("{}: pool `{}`: {e}", graph.path.display(), pool.name))?;
    if pool.scheduler.spec.is_some_and(|s| s.drafter.runs_in_executor()) && model.mtp().is_none() {
        return Err(anyhow!(
            "{}: speculative.drafter = \"mtp\": the model {} holds no MTP layer (a DeepSeek checkpoint's \
             `model.layers.{{num_hidden_layers}}.eh_proj`, `.enorm`, `.hnorm`, `.shared_head` tensors, with \
             num_nextn_predict_layers >= 1); use drafter = \"ngram\"",
            graph.path.display(),
            graph.model.display()
        ));
    }
    let experts = expert_parallel_job(graph, pool, model)?;
    Ok(PoolJob {
        name: pool.name.clone(),
        ranks: pool.ranks,
        model: model.clone(),
        layout,
        scheduler,
        router,
        executor,
        executor_settings,
        cluster: opts.cluster.clone(),
        switches: opts.switches.clone(),
        handoff: Default::default(),
        experts,
        routing_index: pool.router == kvflow_operators::policy::router::KV_AWARE,
        links_here: None,
        gauges: (0..pool.ranks).map(|_| Default::default()).collect(),
        offload: match (store, &graph.offload) {
            (Some(store), Some(config)) => Some(offload::setup(graph, pool, model, &layout, config, store.clone())?),
            _ => None,
        },
    })
}

/// Runs a graph's pools over its workload.
pub fn run(graph: &Graph, opts: &RunOptions, registry: &Registry) -> Result<RunOutcome> {
    let started = Instant::now();
    let pools = match &opts.pools {
        Some(names) => pick_named_pools(graph, names)?,
        None => pick_pools(graph, opts.pool.as_deref())?,
    };
    check_processes(graph, &pools, opts.cluster.as_ref())?;
    check_machine(graph, &pools, opts.cluster.as_ref().map_or(1, |c| c.processes))?;
    for name in opts.endpoints.keys() {
        if !graph.pools.iter().any(|p| &p.name == name && p.role == PoolRole::Decode) {
            let decode: Vec<&str> =
                graph.pools.iter().filter(|p| p.role == PoolRole::Decode).map(|p| p.name.as_str()).collect();
            bail!(
                "--endpoint {name}=…: {} has no decode pool `{name}` (its decode pools: {})",
                graph.path.display(),
                if decode.is_empty() { "none".to_string() } else { decode.join(", ") }
            );
        }
    }
    // The process running the pools new requests enter drives the workload and reports; one
    // running only decode pools serves the handoffs that come to it.
    let drives = pools.iter().any(|p| links::Wiring::entry_kind(graph, &pools, p).is_some());
    if drives {
        crate::report::check_output_dir(&graph.report_dir)
            .map_err(|why| anyhow!("{}: report.out (or --out): {why}", graph.path.display()))?;
    }
    if !graph.workload.ignore_eos && opts.serve.is_none() {
        bail!(
            "{}: workload.ignore_eos = false is not supported yet: outputs follow the trace's lengths",
            graph.path.display()
        );
    }
    let model = load_model(graph)?;
    check_cuda_pools(graph, &model)?;
    let selection = match &opts.serve {
        Some(_) => Selection { requests: Vec::new(), warmup: 0, measured: 0, note: None },
        None => load_workload(graph, model.vocab_size)?,
    };
    let sampling = verify::sampling_of_requests(graph, &selection.requests, opts.verify)?;
    let max_wait = opts.max_wait.unwrap_or(DEFAULT_MAX_WAIT);
    if let Some(why) = crate::workload::longest_wait_over(&selection, &arrival_mode(graph), max_wait) {
        bail!("{}: {why}", graph.path.display());
    }
    // Requests longer than the model's context are refused at release; memory is sized for
    // the rest (served: for the longest request the server takes).
    let largest = match &opts.serve {
        Some(front_end) => front_end.max_context(graph, &model),
        None => selection
            .requests
            .iter()
            .map(|r| r.prompt.len().saturating_add(r.max_output_tokens))
            .filter(|&len| model.max_positions.is_none_or(|max| len <= max)) // the others are refused
            .max()
            .unwrap_or(1),
    };
    let store = offload::open_store(graph)?;
    let jobs: Vec<PoolJob> = pools
        .iter()
        .map(|p| pool_job(graph, p, &model, largest, opts, registry, store.as_ref()))
        .collect::<Result<_>>()?;

    if opts.cluster.is_some() && jobs.len() > 1 {
        bail!(
            "{}: a run spread over processes runs one pool; the graph has {} ({}): choose one with --pool",
            graph.path.display(),
            jobs.len(),
            jobs.iter().map(|j| j.name.as_str()).collect::<Vec<_>>().join(", ")
        );
    }
    if !drives {
        return serve::serve_handoffs(graph, opts, &pools, jobs, &model);
    }
    let layouts: Vec<_> =
        jobs.iter().map(|j| (j.name.clone(), j.ranks, j.layout, pools_executor(graph, &j.name))).collect();
    if let Some(place) = opts.cluster.as_ref().filter(|c| c.process != 0) {
        // Another process drives the workload and writes the report; this one runs its ranks.
        return serve::run_beside_driver(graph, opts, place, &pools, jobs, &model);
    }
    let note = selection.note.clone();
    if let Some(n) = &note {
        tracing::warn!("{n}");
        eprintln!("note: {n}");
    }
    let (tx, rx) = std::sync::mpsc::channel();
    // A server's requests are not known ahead: until it stops taking them, they have not all
    // ended (the watchdog waits on an idle pool only once they have).
    let total = if opts.serve.is_some() { usize::MAX } else { selection.requests.len() };
    let collector = Collector::new(total, tx, opts.show_progress && opts.serve.is_none());
    let (batches, collector_thread) = spawn_collector_thread(collector.clone())?;
    // Start every pool, each with its ingress, its handoff links, its sink into the collector
    // and its watch. New requests enter the aggregated pools, or the decode pools (a run of
    // some pools: the prefill pools).
    let stall_timeout = opts.stall_timeout.unwrap_or(Duration::from_secs(60));
    let remote_batches = batches.clone();
    let remote_events = move |to: &str| -> Box<dyn kvflow_operators::emit::EventSink + Send> {
        Box::new(CollectorSink { pool: to.into(), batches: remote_batches.clone() })
    };
    let wire_options = links::WireOptions {
        endpoints: &opts.endpoints,
        remote_events: &remote_events,
        patience: if stall_timeout.is_zero() { Duration::from_secs(3600) } else { stall_timeout },
        deliver_duplicates: opts.switches.deliver_duplicate_handoffs,
        relay: None,
    };
    let mut wiring = links::wire(graph, &pools, &model, &wire_options)?;
    // New requests enter the entry pools; the pools downstream of them close once every entry
    // pool has ended (cancels reach them through the entry pools' ranks, or directly).
    let decode_first = links::decode_first(graph, &pools);
    let upstream = if decode_first { PoolRole::Decode } else { PoolRole::Prefill };
    let downstream = wiring.downstream_ingresses(graph, &pools);
    let also_cancel = if decode_first { Vec::new() } else { downstream.clone() };
    let remote_links = std::mem::take(&mut wiring.remote_links);
    // The listeners live until the run is over; the socket counter goes in the report.
    let (_listeners, socket_bytes) = (std::mem::take(&mut wiring.listeners), wiring.socket_bytes.clone());
    let (transfer_counters, inboxes) = (wiring.counters.clone(), std::mem::take(&mut wiring.inboxes));
    let mut entries = Vec::new();
    let mut watches = Vec::new();
    let mut running = Vec::new();
    let mut gauges = Vec::new();
    for (mut job, pool) in jobs.into_iter().zip(&pools) {
        let name = job.name.clone();
        gauges.push((name.clone(), job.gauges.clone()));
        let ingress = wiring.ingress[&name].clone();
        job.handoff = wiring.handoff.remove(&name).unwrap_or_default();
        let watch = Watch::default();
        let sink = CollectorSink { pool: name.as_str().into(), batches: batches.clone() };
        // The ranks of this process: rank r of a spread pool runs in process r / ranks-per-process.
        let here = 0..job.ranks / opts.cluster.as_ref().map_or(1, |c| c.processes);
        let started = start_pool(job, Some(ingress.clone()), Some(Box::new(sink)), Some(watch.clone()))?;
        running.push((pool.role, here, started));
        if let Some(kind) = links::Wiring::entry_kind(graph, &pools, pool) {
            entries.push(EntryPool { name: name.clone(), ingress, kind, also_cancel: also_cancel.clone() });
        }
        watches.push((name, watch));
    }
    drop(batches);
    let interrupted = opts.interrupt.clone().unwrap_or_default();
    let placement = Placement { choice: graph.workload.pool_choice, seed: graph.workload.seed };
    let sampled_gauges = gauges.clone();
    let driver = match &opts.serve {
        Some(front_end) => front_end.spawn(FrontEndJob {
            graph,
            model: &model,
            entries: Arc::new(Entries::new(entries, placement, collector.clone(), None)),
            interrupted: interrupted.clone(),
            grace: opts.grace.unwrap_or(Duration::from_secs(10)),
            max_context: largest,
            gauges,
        })?,
        None => spawn_driver(DriverJob {
            pools: entries,
            placement,
            selection,
            mode: arrival_mode(graph),
            collector: collector.clone(),
            completions: rx,
            cancel: CancelPlan {
                fraction: graph.workload.cancel_fraction,
                after_ms: graph.workload.cancel_after_ms,
                seed: graph.workload.seed,
            },
            interrupted: interrupted.clone(),
            grace: opts.grace.unwrap_or(Duration::from_secs(10)),
            max_context: model.max_positions,
            sampling: graph.sampling,
        })?,
    };
    let slo = Slo { ttft_ms: graph.slo.ttft_ms, tpot_ms: graph.slo.tpot_ms };
    let finished = Arc::new(AtomicBool::new(false));
    let run_start_ms = collector.lock().start_ms();
    let kv_sampler = spawn_kv_sampler(sampled_gauges, run_start_ms, finished.clone())?;
    // Pools whose computation has ended (their joiner says so).
    let ended_pools: Arc<Mutex<std::collections::HashSet<String>>> = Arc::default();
    if stall_timeout.is_zero() {
        eprintln!("stall watchdog off (--stall-timeout 0)");
    }
    let watchdog = if stall_timeout.is_zero() {
        drop(watches);
        None
    } else {
        let (pending_in, stalled_collector, dir) = (collector.clone(), collector.clone(), graph.report_dir.clone());
        let ended = ended_pools.clone();
        Some(spawn_watchdog(
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
            finished.clone(),
            move |diagnosis| {
                eprintln!("{diagnosis}");
                // Keep what completed: a partial report, marked stalled.
                let records = stalled_collector.lock().finish();
                let report =
                    build_report(&records, &slo, &Default::default(), json!({"stalled": true, "stall": diagnosis}));
                if let Err(e) = write_outputs(&dir, &report, &records) {
                    eprintln!("cannot write the partial report: {e}");
                }
                std::process::exit(EXIT_STALL);
            },
        )?)
    };
    // Join the pools, each on its own thread: a pool that ends early fails what it still held,
    // so the driver (waiting for those requests) is never left waiting on it.
    // Decode pools take handoffs until every prefill pool has ended (prefill pools take
    // prefills until every decode pool has, with decode-first routing).
    let upstream_left =
        Arc::new(std::sync::atomic::AtomicUsize::new(running.iter().filter(|(role, ..)| *role == upstream).count()));
    let joiners: Vec<_> = running
        .into_iter()
        .map(|(role, here, pool)| {
            let collector = collector.clone();
            let (upstream_left, downstream) = (upstream_left.clone(), downstream.clone());
            let remote_links = remote_links.clone();
            let ended_pools = ended_pools.clone();
            std::thread::spawn(move || {
                let result = pool.join();
                ended_pools.lock().insert(result.name.clone());
                if role == upstream && upstream_left.fetch_sub(1, Ordering::SeqCst) == 1 {
                    for ingress in &downstream {
                        ingress.close();
                    }
                    for link in &remote_links {
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
        .collect();
    let mut results = Vec::new();
    for j in joiners {
        results.push(j.join().map_err(|_| anyhow!("a pool's joiner thread panicked"))?);
    }
    drop(remote_events);
    serve::await_remote_pools(&remote_links);
    collector_thread.join().map_err(|_| anyhow!("the collector thread panicked"))?;
    finished.store(true, Ordering::SeqCst);
    if let Some(w) = watchdog {
        let _ = w.join();
    }
    driver.join().map_err(|_| anyhow!("the workload driver panicked"))?;
    let (stats, mut accounting) = check_ranks(&results);
    accounting.extend(serve::unclaimed_handoffs(&inboxes));
    accounting.extend(serve::remote_failures(&remote_links));
    let (records, interrupted_ms) = {
        let mut c = collector.lock();
        (c.finish(), c.interrupted_ms)
    };
    let verify = if opts.verify && accounting.is_empty() {
        let reference = verify::reference_for(graph)?;
        verify::verify(&model, reference, &records, &sampling, graph.scheduler.chunk_tokens, opts.show_progress)?
    } else {
        Default::default()
    };
    // A spread pool's other processes: what their links moved.
    let mut elsewhere = pool::LinkTotals::default();
    for r in &results {
        elsewhere.add(&r.links_elsewhere);
    }
    let context = report::RunContext {
        graph,
        model: &model,
        note: note.clone(),
        interrupted: interrupted.load(Ordering::SeqCst),
        interrupted_ms,
        grace: opts.grace.unwrap_or(Duration::from_secs(10)),
        wall_s: started.elapsed().as_secs_f64(),
        pools: &layouts,
        stats: &stats,
        accounting: &accounting,
        socket_bytes: socket_bytes.load(Ordering::Relaxed) + elsewhere.socket_bytes,
        transfer: transfer_counters
            .snapshot()
            .iter()
            .zip(elsewhere.counters)
            .map(|(&(name, here), there)| (name, here + there))
            .collect(),
        routing_index: results
            .iter()
            .filter_map(|r| r.routing_index.clone().map(|(last, resyncs)| (r.name.clone(), last, resyncs)))
            .collect(),
    };
    let mut report = report::run_report(&records, &slo, &verify, &context);
    report["kv_usage"] = kv_sampler.join().map_err(|_| anyhow!("the KV sampler panicked"))?.into();
    write_outputs(&graph.report_dir, &report, &records)
        .with_context(|| format!("cannot write the report into {}", graph.report_dir.display()))?;
    if !accounting.is_empty() {
        eprintln!("end-of-run check failed:\n{}", accounting.join("\n"));
    }
    // Failed requests, warmup ones included; cancelled ones are not failures.
    let warmup_failed = records
        .iter()
        .filter(|r| r.warmup && r.error.is_some() && r.failure.as_deref() != Some(crate::report::CANCELLED))
        .count();
    let failed = report["failed"].as_u64().unwrap_or(0) + warmup_failed as u64;
    let exit_code = if !accounting.is_empty() {
        EXIT_ACCOUNTING
    } else if verify.mismatched > 0 {
        EXIT_VERIFY_MISMATCH
    } else if failed > 0 {
        EXIT_FAILED_REQUESTS
    } else {
        EXIT_OK
    };
    Ok(RunOutcome { report: Some(report), out_dir: graph.report_dir.clone(), exit_code, note })
}

/// Samples every pool's share of KV blocks held (its ranks' gauges) until `finished`, for the
/// report's `kv_usage` timeline (`kvflow plot` draws it): every 100 ms, halving the samples kept
/// (and doubling the interval) whenever they pass 2,000.
fn spawn_kv_sampler(
    pools: PoolGauges,
    run_start_ms: f64,
    finished: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<Vec<serde_json::Value>>> {
    std::thread::Builder::new().name("kvflow-kv-sampler".into()).spawn(move || {
        let mut interval = Duration::from_millis(100);
        let mut samples = Vec::new();
        while !finished.load(Ordering::SeqCst) {
            let shares: serde_json::Map<String, serde_json::Value> = pools
                .iter()
                .map(|(name, ranks)| {
                    let (used, total) =
                        ranks.iter().map(|g| g.get()).fold((0, 0), |(u, t), g| (u + g.used_blocks, t + g.total_blocks));
                    (name.clone(), json!(if total > 0 { used as f64 / total as f64 } else { 0.0 }))
                })
                .collect();
            let t_s = (kvflow_operators::messages::wall_ms() - run_start_ms) / 1000.0;
            samples.push(json!({"t_s": t_s, "pools": shares}));
            if samples.len() > 2000 {
                samples = samples.into_iter().step_by(2).collect();
                interval *= 2;
            }
            std::thread::sleep(interval);
        }
        samples
    })
}

fn pools_executor(graph: &Graph, name: &str) -> String {
    graph.pools.iter().find(|p| p.name == name).map(|p| p.executor.clone()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expert_parallel_pool_with_the_mtp_drafter_plans_its_draft_passes_and_spec_width() {
        // A producer never verifies: its idle ranks keep width 1; a decode pool's keep 1 + k.
        // Both run k draft passes (the MTP layer's experts), the same on every rank.
        let dir = tempfile::tempdir().unwrap();
        let spec =
            "model_type = \"deepseek_v3\"\nseed = 3\nvocab_size = 64\nhidden_size = 16\nintermediate_size = 32\n\
                    moe_intermediate_size = 8\nnum_hidden_layers = 2\nnum_attention_heads = 2\nkv_lora_rank = 8\n\
                    qk_nope_head_dim = 4\nqk_rope_head_dim = 4\nv_head_dim = 4\nn_routed_experts = 4\n\
                    num_experts_per_tok = 2\nfirst_k_dense_replace = 1\nnum_nextn_predict_layers = 1\n";
        std::fs::write(dir.path().join("model.toml"), spec).unwrap();
        let graph = "[model]\npath = \"model.toml\"\n\n[[pool]]\nname = \"p\"\nrole = \"prefill\"\nranks = 2\n\
                     expert_parallel = true\n\n[[pool]]\nname = \"d\"\nrole = \"decode\"\nranks = 2\n\
                     expert_parallel = true\n\n[[link]]\nfrom = \"p\"\nto = \"d\"\n\n[speculative]\ndrafter = \"mtp\"\n\
                     draft_tokens = 3\n";
        std::fs::write(dir.path().join("graph.toml"), graph).unwrap();
        let graph = Graph::load(&dir.path().join("graph.toml")).unwrap();
        let model = load_model(&graph).unwrap();
        let jobs: Vec<ExpertParallelJob> =
            graph.pools.iter().map(|p| expert_parallel_job(&graph, p, &model).unwrap().unwrap()).collect();
        assert_eq!((jobs[0].spec_width, jobs[0].draft_passes, jobs[0].mtp_layer), (1, 3, 2), "the producer");
        assert_eq!((jobs[1].spec_width, jobs[1].draft_passes), (4, 3), "the consumer");
        assert_eq!(pool::collectives(Some(&jobs[1])).spec_width, 4);
    }
}
