//! Data-parallel attention with expert-parallel MoE (DESIGN §4): every MoE family is exact with
//! its experts split over 1, 2, 4 and 8 ranks, aggregated and disaggregated; each rank holds only
//! its own experts and really exchanges rows; a skewed load and a nearly full rank keep the pool
//! moving; a withheld exchange is named by the watchdog; a missing expert result fails its
//! request instead of adding a silent zero; the seed's regression configuration runs through.

use crate::common::{records, repo};
use crate::runtime::{assert_exact, ranks_used, run_graph, write_graph_with, HEAVY};
use kvflow::graph::{Graph, Overrides};
use kvflow::runtime::{self, RunOptions};
use kvflow_kernels::models::{load, load_expert_shard};
use kvflow_operators::policy::router::{RouteRequest, Router};
use kvflow_operators::rank::TestSwitches;
use serde_json::Value;
use std::path::{Path, PathBuf};

const MOE_FAMILIES: [&str; 4] = ["hf/deepseek_v3", "hf/deepseek_v32", "hf/qwen3_next", "hf/kimi_linear"];

/// Small prefill chunks (steps with only middle chunks occur on some ranks while others decode).
const WORKLOAD: &str = "mode = \"concurrency\"\nconcurrency = 8\nwarmup = 2\nlimit = 8";

fn ep_pool(name: &str, role: &str, ranks: usize, router: &str) -> String {
    format!(
        "[[pool]]\nname = \"{name}\"\nrole = \"{role}\"\nranks = {ranks}\nexpert_parallel = true\n\
         admission = \"reserve\"\nrouter = \"{router}\"\n[pool.scheduler]\nchunk_tokens = 16\n"
    )
}

fn pd_pools(ranks: usize) -> String {
    format!(
        "{}\n{}\n[[link]]\nfrom = \"prefill\"\nto = \"decode\"\n",
        ep_pool("prefill", "prefill", ranks, "least-outstanding"),
        ep_pool("decode", "decode", ranks, "least-outstanding")
    )
}

/// Every rank of every pool holds exactly its own share of the experts, and (with more than one
/// rank) sent rows to the others.
fn assert_expert_shares(report: &Value, model: &str, ranks: usize, what: &str) {
    let dir = repo().join("fixtures").join(model);
    let whole = load(&dir).unwrap().expert_bytes() as u64;
    let stats = report["rank_stats"].as_array().unwrap();
    assert!(!stats.is_empty(), "{what}: no rank_stats");
    for s in stats {
        let rank = s["rank"].as_u64().unwrap() as usize;
        let share = load_expert_shard(&dir, rank, ranks).unwrap().expert_bytes() as u64;
        assert_eq!(s["expert_bytes"].as_u64(), Some(share), "{what}: rank {rank}: {s}");
        if ranks > 1 {
            assert!(share < whole, "{what}: rank {rank} holds every expert");
            assert!(s["exchange_bytes"].as_u64().unwrap() > 0, "{what}: rank {rank} exchanged nothing: {s}");
        }
    }
}

#[test]
/// (One rank exchanges nothing; the families' reference tests cover it.)
fn every_moe_family_is_exact_with_its_experts_over_2_4_and_8_ranks() {
    for model in MOE_FAMILIES {
        for ranks in [2, 4, 8] {
            let dir = tempfile::tempdir().unwrap();
            let pools = ep_pool("main", "aggregated", ranks, "least-outstanding");
            let graph =
                write_graph_with(dir.path(), model, "mooncake_conversation_head.jsonl", WORKLOAD, "32 MiB", &pools);
            let report = run_graph(&graph, Overrides::default(), TestSwitches::default());
            let what = format!("{model} aggregated on {ranks} expert-parallel ranks");
            assert_exact(&report, &what);
            assert_expert_shares(&report, model, ranks, &what);
        }
    }
}

#[test]
fn every_moe_family_is_exact_disaggregated_with_expert_parallel_pools_of_2_and_8_ranks() {
    for model in MOE_FAMILIES {
        for ranks in [2, 8] {
            let dir = tempfile::tempdir().unwrap();
            let graph = write_graph_with(
                dir.path(),
                model,
                "mooncake_conversation_head.jsonl",
                WORKLOAD,
                "32 MiB",
                &pd_pools(ranks),
            );
            let report = run_graph(&graph, Overrides::default(), TestSwitches::default());
            let what = format!("{model} 1P1D on {ranks}+{ranks} expert-parallel ranks");
            assert_exact(&report, &what);
            assert!(report["handoff"]["count"].as_u64().unwrap() > 0, "{what}: nothing was handed off");
            assert_expert_shares(&report, model, ranks, &what);
        }
    }
}

/// Sends every request to rank 0 unless its id is a multiple of 7 (then by id).
struct Skewed {
    ranks: usize,
}

impl Router for Skewed {
    fn route(&mut self, req: &RouteRequest, _outstanding: &[usize]) -> usize {
        if req.id.is_multiple_of(7) {
            req.id as usize % self.ranks
        } else {
            0
        }
    }
}

fn run_skewed(graph: &Path, switches: TestSwitches) -> Value {
    let _one_at_a_time = HEAVY.lock();
    let mut registry = kvflow::registry::Registry::default();
    registry.routers.register("skewed", |ctx| Box::new(Skewed { ranks: ctx.ranks }));
    let graph = Graph::load_with(graph, &registry.names()).unwrap();
    let opts = RunOptions { verify: true, switches, ..Default::default() };
    let outcome = runtime::run(&graph, &opts, &registry).unwrap_or_else(|e| panic!("{e:#}"));
    outcome.report.expect("a report")
}

fn rank_stat(report: &Value, rank: u64, key: &str) -> u64 {
    let s = report["rank_stats"].as_array().unwrap().iter().find(|s| s["rank"] == rank).unwrap();
    s[key].as_u64().unwrap()
}

#[test]
fn a_skewed_load_leaves_ranks_idle_for_many_steps_and_outputs_stay_identical() {
    let dir = tempfile::tempdir().unwrap();
    let pools = ep_pool("main", "aggregated", 4, "skewed");
    let workload = "mode = \"concurrency\"\nconcurrency = 8\nlimit = 20";
    let graph =
        write_graph_with(dir.path(), "hf/deepseek_v3", "mooncake_conversation_head.jsonl", workload, "64 MiB", &pools);
    let report = run_skewed(&graph, TestSwitches::default());
    assert_exact(&report, "skewed load");
    let lines = records(dir.path());
    let on_zero = lines.iter().filter(|r| r["rank"] == 0).count();
    assert!(on_zero * 4 >= lines.len() * 3, "most requests ran on rank 0: {on_zero} of {}", lines.len());
    for rank in 1..4 {
        let (steps, empty) = (rank_stat(&report, rank, "steps"), rank_stat(&report, rank, "empty_steps"));
        assert!(empty * 2 > steps, "rank {rank} idled most steps: {empty} of {steps}");
        assert!(rank_stat(&report, rank, "expert_rows") > 0, "idle rank {rank} still ran its experts for rank 0");
    }
}

#[test]
fn with_one_rank_nearly_full_the_others_keep_serving_and_nothing_stalls() {
    // Reserve admission: the skewed router prefers rank 0, whose KV holds few requests to their
    // end; the rest go to ranks that can hold them. Nothing is preempted, nothing waits forever.
    let dir = tempfile::tempdir().unwrap();
    let pools = ep_pool("main", "aggregated", 4, "skewed");
    let workload = "mode = \"concurrency\"\nconcurrency = 16\nlimit = 24";
    let graph =
        write_graph_with(dir.path(), "hf/deepseek_v3", "mooncake_conversation_head.jsonl", workload, "3 MiB", &pools);
    let report = run_skewed(&graph, TestSwitches::default());
    assert_exact(&report, "one rank nearly full");
    assert_ne!(report["stalled"], true, "the watchdog never fired");
    assert_eq!(report["preemptions"], 0, "reserve admission never preempts: {}", report["preemptions"]);
    let kv_max = report["utilization"]["kv"]["max"].as_f64().unwrap();
    assert!(kv_max > 0.6, "a rank's memory was nearly full: max KV use {kv_max}");
    let used = ranks_used(&dir.path().join("out"));
    assert!(used.len() >= 3, "the other ranks served: {used:?}");
}

fn stall_graph(dir: &Path) -> PathBuf {
    let pools = ep_pool("main", "aggregated", 4, "least-outstanding");
    let workload = "mode = \"concurrency\"\nconcurrency = 8\nlimit = 30";
    write_graph_with(dir, "hf/kimi_linear", "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools)
}

#[test]
fn a_rank_withholding_its_dispatch_is_named_by_the_watchdog() {
    let dir = tempfile::tempdir().unwrap();
    let graph = stall_graph(dir.path());
    let _one_at_a_time = HEAVY.lock();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .args(["run", &graph.to_string_lossy(), "--stall-timeout", "2", "--test-switch", "withhold-dispatch=1:6:1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "a stall exits with status 3: {stderr}");
    // MoE layer 1 of kimi_linear is model layer 2.
    let expected = "holding the pool back: operator `dispatch[2]` on rank 1 holds step 6 ";
    assert!(stderr.contains(expected), "expected {expected:?} in:\n{stderr}");
    assert_eq!(stderr.matches("holding the pool back").count(), 1, "exactly one culprit:\n{stderr}");
}

#[test]
fn a_rank_that_lets_time_pass_without_its_results_fails_the_requests_that_lost_them() {
    let dir = tempfile::tempdir().unwrap();
    let graph = stall_graph(dir.path());
    let switches = TestSwitches { send_no_expert_results: Some((1, 6, 0)), ..Default::default() };
    let report = run_graph(&graph, Overrides::default(), switches);
    let lines = records(dir.path());
    let failed: Vec<&Value> = lines.iter().filter(|r| !r["failure"].is_null()).collect();
    assert!(!failed.is_empty(), "requests whose tokens met rank 1's experts at step 6 fail");
    for r in &failed {
        assert_eq!(r["failure"], "expert-combine", "{r}");
        let error = r["error"].as_str().unwrap();
        assert!(error.contains("step 6") && error.contains("on rank 1") && error.contains("no result"), "{error}");
    }
    assert_eq!(report["completed"].as_u64().unwrap() + failed.len() as u64, 30, "every request ends");
    assert_eq!(report["verify"]["mismatched"], 0, "no request completed with a silent zero");
    assert_ne!(report["stalled"], true, "the watchdog never fired");
}

#[test]
fn the_regression_configuration_completes_its_warmup_and_every_request() {
    // graphs/regress-1p1d-dpa8.toml at reduced size: 8 + 8 expert-parallel ranks, concurrency 128,
    // 142 warmup requests (the seed's hang sent as many and got none back).
    let dir = tempfile::tempdir().unwrap();
    let overrides = Overrides { limit: Some(40), out: Some(dir.path().join("out")), ..Default::default() };
    let report = run_graph(&repo().join("graphs/regress-1p1d-dpa8.toml"), overrides, TestSwitches::default());
    assert_exact(&report, "regression configuration");
    assert_ne!(report["stalled"], true, "the watchdog never fired");
    assert_eq!(report["verify"]["checked"], 182, "warmup requests are verified too");
    assert_eq!(report["rank_stats"].as_array().unwrap().len(), 16);
    assert_expert_shares(&report, "hf/kimi_linear", 8, "regression configuration");
}

#[test]
fn check_dot_draws_dispatch_experts_and_combine_for_every_moe_layer() {
    let graph = repo().join("graphs/regress-1p1d-dpa8.toml");
    let out = crate::common::kvflow(&["check", &graph.to_string_lossy(), "--dot"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let dot = String::from_utf8_lossy(&out.stdout);
    // kimi_linear: layer 0 dense, layers 1..=3 MoE; both pools are expert parallel.
    for layer in 1..=3 {
        for op in ["dispatch", "experts", "combine"] {
            let label = format!("{op}[{layer}](t)");
            assert_eq!(dot.matches(&label).count(), 2, "{label} once per pool in:\n{dot}");
        }
    }
    assert_eq!(dot.matches("label=\"ExpertRows\"").count(), 2 * 3 * 2, "two exchanges per MoE layer per pool");
    assert!(!dot.contains("dispatch[0]"), "the dense layer exchanges nothing");
}

#[test]
fn bad_expert_parallel_settings_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "hf/deepseek_v3",
            "expert_parallel = true\nexecutor = \"null\"",
            vec!["pool.expert_parallel", "\"cpu\", \"cuda\" and \"sim\" executors", "\"null\""],
        ),
        ("hf/deepseek_v3", "admission = \"maybe\"", vec!["pool.admission", "`maybe`", "`optimistic`, `reserve`"]),
        ("hf/llama", "expert_parallel = true", vec!["pool `main`", "needs a MoE model", "llama"]),
    ];
    for (model, keys, needles) in cases {
        let pools = format!("[[pool]]\nname = \"main\"\nranks = 2\n{keys}\n");
        let graph =
            write_graph_with(dir.path(), model, "mooncake_conversation_head.jsonl", "limit = 2", "32 MiB", &pools);
        let out = crate::common::kvflow(&["run", &graph.to_string_lossy()]);
        crate::common::assert_clean_failure(&out, &needles);
    }
}
