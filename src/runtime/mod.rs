//! `kvflow run`: loads the model and the workload a graph names, sizes each rank's memory, runs
//! the pool on timely (threads, or processes of a cluster), checks every rank's accounting, runs
//! `--verify`, and writes `report.json` and `requests.jsonl`.

pub(crate) mod collector;
pub(crate) mod driver;
mod memory;
pub(crate) mod pool;
mod verify;
mod watchdog;

pub use memory::plan_memory;
pub use pool::ClusterPlace;

use crate::graph::{Graph, PoolConfig, PoolRole, WorkloadMode};
use crate::registry::Registry;
use crate::report::{build_report, write_outputs, Slo};
use crate::trace::{read_trace, synthesize, SynthOptions, TraceFormat};
use crate::workload::{select, ArrivalMode, Selection};
use anyhow::{anyhow, bail, Context, Result};
use collector::Collector;
use driver::{CancelPlan, DriverJob};
use kvflow_kernels::models::{self, Model};
use kvflow_operators::policy::scheduler::SchedulerConfig;
use kvflow_operators::rank::TestSwitches;
use pool::{run_pool, PoolJob};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Exit status: all good.
pub const EXIT_OK: i32 = 0;
/// Exit status: `--verify` found mismatches.
pub const EXIT_VERIFY_MISMATCH: i32 = 1;
/// Exit status: some requests failed.
pub const EXIT_FAILED_REQUESTS: i32 = 2;
/// Exit status: the pool stalled.
pub const EXIT_STALL: i32 = 3;

/// How to run a graph, beyond the graph itself.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// The pool to run (default: the graph's only pool).
    pub pool: Option<String>,
    pub cluster: Option<ClusterPlace>,
    pub verify: bool,
    pub show_progress: bool,
    pub switches: TestSwitches,
    /// Set to stop the run as if by Ctrl-C (the CLI's signal handler sets it).
    pub interrupt: Option<Arc<AtomicBool>>,
    /// How long in-flight requests may finish after an interrupt before they are cancelled.
    pub grace: Option<Duration>,
    /// With requests pending, how long no capability may change before the run is declared
    /// stalled (default 60 s).
    pub stall_timeout: Option<Duration>,
}

/// What a run produced.
pub struct RunOutcome {
    /// `report.json`'s content (process 0 only).
    pub report: Option<Value>,
    pub out_dir: PathBuf,
    pub exit_code: i32,
    /// Set when the trace was too short for what was asked.
    pub note: Option<String>,
}

fn pick_pool<'g>(graph: &'g Graph, name: Option<&str>) -> Result<&'g PoolConfig> {
    let pool = match name {
        Some(n) => graph.pool(n).map_err(|e| anyhow!("{e}"))?,
        None if graph.pools.len() == 1 => &graph.pools[0],
        None => bail!(
            "{}: the graph has {} pools ({}); choose one with --pool",
            graph.path.display(),
            graph.pools.len(),
            graph.pools.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ")
        ),
    };
    if pool.role != PoolRole::Aggregated {
        bail!(
            "{}: pool `{}` has role {}: prefill/decode pools need the transfer engine and handoff, which this \
             version does not have yet; run an aggregated pool",
            graph.path.display(),
            pool.name,
            pool.role
        );
    }
    Ok(pool)
}

/// The workload's requests, with the note when the trace is shorter than asked.
pub fn load_workload(graph: &Graph, vocab_size: usize) -> Result<Selection> {
    let w = &graph.workload;
    let trace = w
        .trace
        .as_ref()
        .ok_or_else(|| anyhow!("{}: workload.trace is not set (or pass --trace)", graph.path.display()))?;
    let format: TraceFormat = w.format.parse().map_err(|e| anyhow!("workload.format: {e}"))?;
    let records = read_trace(trace, format)?;
    let requests = synthesize(
        &records,
        &SynthOptions {
            block_tokens: w.block_tokens,
            seed: w.seed,
            vocab_size,
            max_output_tokens: w.max_output_tokens,
        },
    )?;
    Ok(select(requests, w.warmup, w.limit))
}

fn arrival_mode(graph: &Graph) -> ArrivalMode {
    match graph.workload.mode {
        WorkloadMode::Timestamps { time_scale } => ArrivalMode::Timestamps { time_scale },
        WorkloadMode::Concurrency(n) => ArrivalMode::Concurrency(n),
        WorkloadMode::Rate { per_second } => ArrivalMode::Rate { per_second, seed: graph.workload.seed },
    }
}

/// Loads the graph's model.
pub fn load_model(graph: &Graph) -> Result<Arc<Model>> {
    let model = models::load(&graph.model).with_context(|| format!("cannot load model {}", graph.model.display()))?;
    Ok(Arc::new(model))
}

/// Runs a graph's pool over its workload.
pub fn run(graph: &Graph, opts: &RunOptions, registry: &Registry) -> Result<RunOutcome> {
    let started = Instant::now();
    let pool = pick_pool(graph, opts.pool.as_deref())?;
    if !graph.workload.ignore_eos {
        bail!(
            "{}: workload.ignore_eos = false is not supported yet: outputs follow the trace's lengths",
            graph.path.display()
        );
    }
    let model = load_model(graph)?;
    let selection = load_workload(graph, model.vocab_size)?;
    let largest = selection.requests.iter().map(|r| r.prompt.len() + r.max_output_tokens).max().unwrap_or(1);
    let layout = plan_memory(&model, &graph.memory, &graph.scheduler, largest)?;
    let router = registry.routers.get(&pool.router).ok_or_else(|| {
        anyhow!(
            "{}: pool `{}`: router {:?} is not registered ({})",
            graph.path.display(),
            pool.name,
            pool.router,
            registry.routers.names().join(", ")
        )
    })?;
    let executor = registry.executor(&pool.executor).ok_or_else(|| {
        anyhow!("{}: pool `{}`: executor {:?} is not registered", graph.path.display(), pool.name, pool.executor)
    })?;
    let scheduler = SchedulerConfig {
        max_running: graph.scheduler.max_running,
        max_batched_tokens: graph.scheduler.max_batched_tokens,
        chunk_tokens: graph.scheduler.chunk_tokens,
        prefix_cache: graph.scheduler.prefix_cache,
        snapshot_interval_blocks: graph.memory.snapshot_interval_blocks,
    };
    let job = PoolJob {
        name: pool.name.clone(),
        ranks: pool.ranks,
        model: model.clone(),
        layout,
        scheduler,
        router,
        cluster: opts.cluster.clone(),
        switches: opts.switches.clone(),
        executor,
    };
    let is_driver = opts.cluster.as_ref().is_none_or(|c| c.process == 0);
    if !is_driver {
        let result = run_pool(job, None, None)?;
        check_ranks(&result.ranks)?;
        return Ok(RunOutcome { report: None, out_dir: graph.report_dir.clone(), exit_code: EXIT_OK, note: None });
    }
    let note = selection.note.clone();
    if let Some(n) = &note {
        tracing::warn!("{n}");
        eprintln!("note: {n}");
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let collector = Collector::new(&pool.name, selection.requests.len(), tx, opts.show_progress);
    let interrupted = opts.interrupt.clone().unwrap_or_default();
    let driver = DriverJob {
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
    };
    let stall = {
        let (collector, dir, slo) = (
            collector.clone(),
            graph.report_dir.clone(),
            Slo { ttft_ms: graph.slo.ttft_ms, tpot_ms: graph.slo.tpot_ms },
        );
        pool::StallWatch {
            timeout: opts.stall_timeout.unwrap_or(Duration::from_secs(60)),
            on_stall: Box::new(move |diagnosis: String| {
                eprintln!("{diagnosis}");
                // Keep what completed: a partial report, marked stalled.
                let records = collector.lock().map(|mut c| c.finish()).unwrap_or_default();
                let report =
                    build_report(&records, &slo, &Default::default(), json!({"stalled": true, "stall": diagnosis}));
                if let Err(e) = write_outputs(&dir, &report, &records) {
                    eprintln!("cannot write the partial report: {e}");
                }
                std::process::exit(EXIT_STALL);
            }),
        }
    };
    let result = run_pool(job, Some(driver), Some(stall))?;
    let stats = check_ranks(&result.ranks)?;
    let records = collector.lock().expect("collector lock").finish();
    let verify = if opts.verify {
        verify::verify(&model, &records, graph.scheduler.chunk_tokens, opts.show_progress)?
    } else {
        Default::default()
    };
    let slo = Slo { ttft_ms: graph.slo.ttft_ms, tpot_ms: graph.slo.tpot_ms };
    let extra = json!({
        "pool": pool.name,
        "ranks": pool.ranks,
        "model": graph.model.display().to_string(),
        "family": model.family.to_string(),
        "trace": graph.workload.trace.as_ref().map(|t| t.display().to_string()),
        "mode": graph.workload.mode.name(),
        "note": note,
        "interrupted": interrupted.load(std::sync::atomic::Ordering::SeqCst),
        "wall_s": started.elapsed().as_secs_f64(),
        "memory": {"blocks_per_rank": layout.blocks, "block_size": layout.block_size, "slots_per_rank": layout.slots, "snapshots_per_rank": layout.snapshots},
        "utilization": utilization(&stats),
        "steps": stats.iter().map(|s| s.steps).collect::<Vec<_>>(),
        "empty_steps": stats.iter().map(|s| s.empty_steps).collect::<Vec<_>>(),
    });
    let report = build_report(&records, &slo, &verify, extra);
    write_outputs(&graph.report_dir, &report, &records)
        .with_context(|| format!("cannot write the report into {}", graph.report_dir.display()))?;
    // Failed requests, warmup ones included; cancelled ones are not failures.
    let warmup_failed = records
        .iter()
        .filter(|r| r.warmup && r.error.is_some() && r.failure.as_deref() != Some(crate::report::CANCELLED))
        .count();
    let failed = report["failed"].as_u64().unwrap_or(0) + warmup_failed as u64;
    let exit_code = if verify.mismatched > 0 {
        EXIT_VERIFY_MISMATCH
    } else if failed > 0 {
        EXIT_FAILED_REQUESTS
    } else {
        EXIT_OK
    };
    Ok(RunOutcome { report: Some(report), out_dir: graph.report_dir.clone(), exit_code, note })
}

fn check_ranks(
    ranks: &[Result<kvflow_operators::rank::RankStats, String>],
) -> Result<Vec<kvflow_operators::rank::RankStats>> {
    let mut stats = Vec::new();
    for r in ranks {
        match r {
            Ok(s) => stats.push(s.clone()),
            Err(e) => bail!("end-of-run check failed: {e}"),
        }
    }
    Ok(stats)
}

/// KV, slot and snapshot utilization and batch size over the run, per pool: the per-step samples
/// of every rank of this process pooled together.
fn utilization(stats: &[kvflow_operators::rank::RankStats]) -> Value {
    let pooled = |f: &dyn Fn(&kvflow_operators::rank::UtilizationSamples) -> Vec<f64>| -> Value {
        let all: Vec<f64> = stats.iter().flat_map(|s| f(&s.samples)).collect();
        let mut v = crate::report::summary(&all);
        v["max"] = json!(all.iter().copied().fold(0.0f64, f64::max));
        v
    };
    json!({
        "ranks_sampled": stats.len(),
        "steps_sampled": stats.iter().map(|s| s.samples.kv.len()).sum::<usize>(),
        "kv": pooled(&|s| s.kv.iter().map(|&x| x as f64).collect()),
        "slots": pooled(&|s| s.slots.iter().map(|&x| x as f64).collect()),
        "snapshots": pooled(&|s| s.snapshots.iter().map(|&x| x as f64).collect()),
        "batch_seqs": pooled(&|s| s.batch_seqs.iter().map(|&x| x as f64).collect()),
        "batch_tokens": pooled(&|s| s.batch_tokens.iter().map(|&x| x as f64).collect()),
    })
}
