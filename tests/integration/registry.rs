//! Code outside the kvflow crates registers its own router or executor and a graph runs it by
//! name; a route outside the pool fails only those requests; any rank wakes its parked pool.

use crate::common::records;
use crate::runtime::write_graph;
use kvflow::graph::Graph;
use kvflow::registry::Registry;
use kvflow::runtime::{self, RunOptions};
use kvflow_operators::executor::{
    CpuExecutor, CpuStepRunner, Delay, Executor, ExecutorContext, ExecutorKind, SettingError, Settings,
};
use kvflow_operators::policy::router::{RouteRequest, Router, RouterContext};
use kvflow_operators::step::{StepCompletion, StepLaunch};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// [`write_graph`]'s graph of `model` in `dir` with `workload`, its pool's `ranks = 2` line
/// replaced by `pool_lines`.
fn graph_with_pool_lines(dir: &Path, model: &str, workload: &str, pool_lines: &str) -> PathBuf {
    let graph_path = write_graph(dir, model, "mooncake_conversation_head.jsonl", workload, "64 MiB");
    let text = std::fs::read_to_string(&graph_path).unwrap().replace("ranks = 2", pool_lines);
    std::fs::write(&graph_path, text).unwrap();
    graph_path
}

/// Loads the graph at `graph_path` knowing `registry`'s names and runs it with `--verify`.
fn run_verified(graph_path: &Path, registry: &Registry) -> runtime::RunOutcome {
    let graph = Graph::load_with(graph_path, &registry.names()).unwrap();
    runtime::run(&graph, &RunOptions { verify: true, ..Default::default() }, registry).unwrap()
}

/// Sends every request to the last rank.
struct LastRank(usize);

impl Router for LastRank {
    fn route(&mut self, _req: &RouteRequest, _outstanding: &[usize]) -> usize {
        self.0 - 1
    }
}

#[test]
fn a_router_registered_outside_kvflow_runs_from_a_graph() {
    let dir = tempfile::tempdir().unwrap();
    let graph_path = graph_with_pool_lines(
        dir.path(),
        "hf/llama",
        "mode = \"concurrency\"\nconcurrency = 4\nlimit = 8",
        "ranks = 3\nrouter = \"last-rank\"",
    );
    // Without the registration the graph is rejected by name.
    let e = Graph::load(&graph_path).unwrap_err().to_string();
    assert!(e.contains("last-rank") && e.contains("pool.router"), "{e}");
    let mut registry = Registry::default();
    registry.routers.register("last-rank", |ctx: RouterContext| Box::new(LastRank(ctx.ranks)) as Box<dyn Router>);
    let outcome = run_verified(&graph_path, &registry);
    let report = outcome.report.unwrap();
    assert_eq!(report["verify"]["mismatched"], 0);
    let ranks: Vec<Value> = records(dir.path()).iter().map(|r| r["rank"].clone()).collect();
    assert_eq!(ranks.len(), 8);
    assert!(ranks.iter().all(|r| r == 2), "every request ran on the last rank: {ranks:?}");
}

/// Names a rank outside the pool for every other request.
struct Beyond;

impl Router for Beyond {
    fn route(&mut self, req: &RouteRequest, outstanding: &[usize]) -> usize {
        if req.id % 2 == 1 {
            outstanding.len() + 3
        } else {
            0
        }
    }
}

#[test]
fn a_route_outside_the_pool_fails_those_requests_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let graph_path = graph_with_pool_lines(
        dir.path(),
        "hf/llama",
        "mode = \"concurrency\"\nconcurrency = 4\nlimit = 8",
        "ranks = 2\nrouter = \"beyond\"",
    );
    let mut registry = Registry::default();
    registry.routers.register("beyond", |_ctx: RouterContext| Box::new(Beyond) as Box<dyn Router>);
    let outcome = run_verified(&graph_path, &registry);
    assert_eq!(outcome.exit_code, runtime::EXIT_FAILED_REQUESTS);
    let report = outcome.report.unwrap();
    assert_eq!((report["completed"].clone(), report["failed"].clone()), (4.into(), 4.into()));
    assert_eq!(report["failures"]["unroutable"], 4);
    assert_eq!(report["verify"]["mismatched"], 0);
    for r in records(dir.path()) {
        if r["id"].as_u64().unwrap() % 2 == 1 {
            assert!(r["error"].as_str().unwrap().contains("rank 5 of a 2-rank pool"), "{r}");
        } else {
            assert!(r["error"].is_null(), "{r}");
        }
    }
}

#[test]
fn any_rank_wakes_its_parked_pool() {
    // Every request on the last of three ranks, one at a time, on an executor two launches
    // behind: when that rank has only steps in flight it flushes, the pool parks, and the
    // completion that lands on rank 2 wakes it.
    let dir = tempfile::tempdir().unwrap();
    let graph_path = graph_with_pool_lines(
        dir.path(),
        "hf/qwen3_next",
        "mode = \"concurrency\"\nconcurrency = 1\nlimit = 4",
        "ranks = 3\nrouter = \"last-rank\"\nexecutor = \"cpu-deferred\"\n[pool.executor_settings]\ndelay_steps = 2",
    );
    let mut registry = Registry::default();
    registry.routers.register("last-rank", |ctx: RouterContext| Box::new(LastRank(ctx.ranks)) as Box<dyn Router>);
    let outcome = run_verified(&graph_path, &registry);
    let report = outcome.report.unwrap();
    assert_eq!(report["completed"], 4, "{report}");
    assert_eq!(report["verify"]["mismatched"], 0);
    let wakes: Vec<u64> = report["pool_wakes"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert!(wakes[0] > 0, "rank 0 wakes the pool for new requests: {wakes:?}");
    assert_eq!(wakes[1], 0, "rank 1 holds nothing: {wakes:?}");
    assert!(wakes[2] > 0, "rank 2 wakes the pool when its completions land: {wakes:?}");
}

/// An executor from outside kvflow: kvflow's CPU executor, counting what it is asked to launch.
struct Counting(std::sync::Arc<std::sync::atomic::AtomicU64>);

struct CountingExecutor {
    inner: CpuExecutor,
    launches: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl ExecutorKind for Counting {
    fn check(&self, settings: &toml::Table) -> Result<(), SettingError> {
        Settings::new(settings, &[]).map(|_| ())
    }

    fn build(&self, _settings: &toml::Table, ctx: ExecutorContext) -> Result<Box<dyn Executor>, String> {
        let inner = CpuExecutor::new(CpuStepRunner::new(&ctx), Delay::default());
        Ok(Box::new(CountingExecutor { inner, launches: self.0.clone() }))
    }
}

impl Executor for CountingExecutor {
    fn phases(&self) -> usize {
        self.inner.phases()
    }

    fn launch(&mut self, step: &StepLaunch<'_>, phase: usize) {
        self.launches.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.launch(step, phase);
    }

    fn poll(&mut self, out: &mut Vec<StepCompletion>) {
        self.inner.poll(out);
    }

    fn flush(&mut self) {
        self.inner.flush();
    }
}

#[test]
fn an_executor_registered_outside_kvflow_runs_from_a_graph() {
    let dir = tempfile::tempdir().unwrap();
    let graph_path = graph_with_pool_lines(
        dir.path(),
        "hf/kimi_linear",
        "mode = \"concurrency\"\nconcurrency = 4\nlimit = 8",
        "ranks = 2\nexecutor = \"counting\"",
    );
    let e = Graph::load(&graph_path).unwrap_err().to_string();
    assert!(e.contains("counting") && e.contains("pool.executor"), "{e}");
    let launches = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut registry = Registry::default();
    registry.executors.register("counting", Counting(launches.clone()));
    let outcome = run_verified(&graph_path, &registry);
    let report = outcome.report.unwrap();
    assert_eq!((report["completed"].clone(), report["verify"]["mismatched"].clone()), (8.into(), 0.into()));
    let launched: u64 = report["launched_steps"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).sum();
    assert!(launched > 0);
    assert_eq!(launches.load(std::sync::atomic::Ordering::SeqCst), launched, "every launch went through it");
}
