//! The dataflow runtime end to end: every family on 1, 2 and 4 ranks gives exactly the outputs
//! of the reference path (`--verify`); prefix reuse (through snapshots for recurrent families)
//! and preemption keep them exact; `--verify` really catches a wrong read; two processes equal
//! threads. Every run also asserts that each rank ends with every block, slot and snapshot free
//! (the runtime fails the run otherwise).

use crate::common::{assert_clean_failure, kvflow, records_in, repo, FIXTURES};
use kvflow::graph::{Graph, Overrides};
use kvflow::runtime::{self, RunOptions};
use kvflow_operators::rank::TestSwitches;
use parking_lot::Mutex;
use serde_json::Value;
use std::path::Path;

/// Runs that start several worker threads go one at a time (CI has 2 cores).
pub static HEAVY: Mutex<()> = Mutex::new(());

/// Runs the kvflow binary holding [`HEAVY`] (its run starts several worker threads).
pub fn kvflow_heavy(args: &[&str]) -> std::process::Output {
    let _one_at_a_time = HEAVY.lock();
    kvflow(args)
}

/// The ranks that served at least one request (work really spread over ranks).
pub fn ranks_used(out: &Path) -> std::collections::BTreeSet<u64> {
    records_in(out).iter().filter_map(|r| r["rank"].as_u64()).collect()
}

/// The pool of [`write_graph`]'s graphs.
pub const ONE_POOL: &str = "[[pool]]\nname = \"main\"\nranks = 2\n";

/// A graph over the repository's fixtures and traces, written into `dir`, with one 2-rank pool.
pub fn write_graph(dir: &Path, model: &str, trace: &str, extra_workload: &str, budget: &str) -> std::path::PathBuf {
    write_graph_with(dir, model, trace, extra_workload, budget, ONE_POOL)
}

/// [`write_graph`] with `pools` (TOML: one or more `[[pool]]` tables) as the graph's pools.
pub fn write_graph_with(
    dir: &Path,
    model: &str,
    trace: &str,
    extra_workload: &str,
    budget: &str,
    pools: &str,
) -> std::path::PathBuf {
    let r = repo();
    let text = format!(
        r#"
[model]
path = "{model}"

[memory]
budget_bytes = "{budget}"
block_size = 16

[scheduler]
max_running = 16
max_batched_tokens = 256
chunk_tokens = 64

{pools}

[workload]
trace = "{trace}"
format = "mooncake"
block_tokens = 16
max_output_tokens = 12
seed = 3
{extra_workload}

[report]
out = "{out}"
"#,
        model = r.join("fixtures").join(model).display(),
        trace = r.join("traces").join(trace).display(),
        out = dir.join("out").display(),
    );
    let path = dir.join("graph.toml");
    std::fs::write(&path, text).unwrap();
    path
}

pub fn run_graph(path: &Path, overrides: Overrides, switches: TestSwitches) -> Value {
    let _one_at_a_time = HEAVY.lock();
    let graph = Graph::load_overridden(path, &kvflow::graph::ComponentNames::builtin(), &overrides).unwrap();
    let opts = RunOptions { verify: true, switches, ..Default::default() };
    let outcome = runtime::run(&graph, &opts, &Default::default()).unwrap_or_else(|e| panic!("{e:#}"));
    outcome.report.expect("process 0 writes the report")
}

pub fn assert_exact(report: &Value, what: &str) {
    assert_eq!(report["failed"], 0, "{what}: failed requests: {report}");
    assert_eq!(report["completed"], report["requests"], "{what}");
    assert!(report["verify"]["checked"].as_u64().unwrap() > 0, "{what}: nothing verified");
    assert_eq!(report["verify"]["mismatched"], 0, "{what}: {}", report["verify"]);
}

#[test]
/// (One rank is the reference path's own shape; the quickstart and most tests run it.)
fn every_family_on_two_and_four_ranks_matches_the_reference_path() {
    for model in FIXTURES {
        let dir = tempfile::tempdir().unwrap();
        let graph = write_graph(
            dir.path(),
            model,
            "mooncake_conversation_head.jsonl",
            "mode = \"concurrency\"\nconcurrency = 8\nwarmup = 2\nlimit = 10",
            "64 MiB",
        );
        for ranks in [2, 4] {
            let report =
                run_graph(&graph, Overrides { ranks: Some(ranks), ..Default::default() }, TestSwitches::default());
            assert_exact(&report, &format!("{model} on {ranks} ranks"));
            assert_eq!(report["verify"]["checked"], 12, "{model}: warmup requests are verified too");
            // The router keeps requests that share a prefix together while the load allows, so
            // 12 requests need not reach every rank, but they must reach more than one.
            let used = ranks_used(&dir.path().join("out"));
            assert!(used.len() >= ranks.min(2), "{model}: the 12 requests ran on ranks {used:?} of {ranks}");
        }
    }
}

#[test]
fn azure_and_vidur_traces_replay_exactly() {
    for (model, trace, format) in [
        ("hf/kimi_linear", "azure2023_conv_head200.csv", "azure"),
        ("hf/deepseek_v32", "format_samples/vidur_splitwise_conv_head200.csv", "vidur"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let graph =
            write_graph(dir.path(), model, trace, "mode = \"concurrency\"\nconcurrency = 8\nlimit = 20", "64 MiB");
        let overrides = Overrides { format: Some(format.into()), ranks: Some(4), ..Default::default() };
        let report = run_graph(&graph, overrides, TestSwitches::default());
        assert_exact(&report, format);
        assert_eq!(report["requests"], 20);
    }
}

#[test]
fn prefix_reuse_through_snapshots_hits_and_stays_exact() {
    for model in ["hf/kimi_linear", "hf/qwen3_next_gdn", "hf/llama"] {
        let dir = tempfile::tempdir().unwrap();
        let graph = write_graph(
            dir.path(),
            model,
            "mooncake_conversation_first5min.jsonl",
            "mode = \"concurrency\"\nconcurrency = 16\nlimit = 80",
            "64 MiB",
        );
        let report = run_graph(&graph, Overrides::default(), TestSwitches::default());
        assert_exact(&report, model);
        let hit = report["prefix_hit_rate"].as_f64().unwrap();
        assert!(hit > 0.0, "{model}: no prefix-cache hits on the first five minutes");
    }
}

#[test]
fn preemption_under_a_tight_budget_keeps_outputs_exact() {
    for (model, budget) in [("hf/llama", "4 MiB"), ("hf/kimi_linear", "1.2 MiB")] {
        let dir = tempfile::tempdir().unwrap();
        let graph = write_graph(
            dir.path(),
            model,
            "mooncake_conversation_first5min.jsonl",
            "mode = \"concurrency\"\nconcurrency = 16\nlimit = 60",
            budget,
        );
        let report = run_graph(&graph, Overrides::default(), TestSwitches::default());
        assert_exact(&report, model);
        assert!(report["preemptions"].as_u64().unwrap() > 0, "{model}: the budget was meant to force preemption");
    }
}

#[test]
fn verify_catches_a_swapped_block_table_entry_in_exactly_the_affected_requests() {
    let dir = tempfile::tempdir().unwrap();
    let graph = write_graph(
        dir.path(),
        "hf/llama",
        "mooncake_conversation_head.jsonl",
        "mode = \"concurrency\"\nconcurrency = 8\nlimit = 24",
        "64 MiB",
    );
    let every = 3;
    let report = run_graph(
        &graph,
        Overrides::default(),
        TestSwitches { swap_block_table_every: Some(every), ..Default::default() },
    );
    let records = crate::common::records(dir.path());
    // Affected: ids that are multiples of `every` with a decode step that reads ≥ 3 blocks.
    let expected: Vec<u64> = records
        .iter()
        .filter(|r| {
            let (id, input, output) = (
                r["id"].as_u64().unwrap(),
                r["input_len"].as_u64().unwrap(),
                r["output_tokens"].as_array().unwrap().len() as u64,
            );
            id % every == 0 && output >= 2 && input + output - 1 > 2 * 16
        })
        .map(|r| r["id"].as_u64().unwrap())
        .collect();
    let got: Vec<u64> =
        report["verify"]["mismatched_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert!(!expected.is_empty());
    assert_eq!(got, expected, "verify must flag exactly the requests whose reads were swapped");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn two_processes_give_the_outputs_of_the_threaded_run() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let graph = write_graph(
        dir.path(),
        "hf/kimi_linear",
        "mooncake_conversation_head.jsonl",
        "mode = \"concurrency\"\nconcurrency = 8\nlimit = 16",
        "64 MiB",
    );
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, format!("127.0.0.1:{}\n127.0.0.1:{}\n", free_port(), free_port())).unwrap();
    let g = graph.to_string_lossy().to_string();
    let h = hosts.to_string_lossy().to_string();
    let cluster_out = dir.path().join("cluster").to_string_lossy().to_string();
    let threads_out = dir.path().join("threads").to_string_lossy().to_string();
    let second = std::process::Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .args(["run", &g, "--out", &cluster_out, "--process", "1", "--processes", "2", "--hostfile", &h])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let first = kvflow(&["run", &g, "--out", &cluster_out, "--process", "0", "--processes", "2", "--hostfile", &h]);
    let second = second.wait_with_output().unwrap();
    assert!(first.status.success(), "process 0: {}", String::from_utf8_lossy(&first.stderr));
    assert!(second.status.success(), "process 1: {}", String::from_utf8_lossy(&second.stderr));
    let threads = kvflow(&["run", &g, "--out", &threads_out]);
    assert!(threads.status.success(), "{}", String::from_utf8_lossy(&threads.stderr));
    let outputs = |dir: &str| -> Vec<(u64, Value, Value)> {
        records_in(Path::new(dir))
            .into_iter()
            .map(|r| (r["id"].as_u64().unwrap(), r["prompt_tokens"].clone(), r["output_tokens"].clone()))
            .collect()
    };
    let (c, t) = (outputs(&cluster_out), outputs(&threads_out));
    assert_eq!(c.len(), 16);
    assert_eq!(c, t, "the two-process run must produce the threaded run's outputs");
    // Rank 0 lives in process 0 and rank 1 in process 1: both must have served requests.
    assert_eq!(ranks_used(Path::new(&cluster_out)), [0, 1].into(), "work must spread over both processes");
}

#[test]
fn run_and_check_report_bad_input_by_name() {
    let dir = tempfile::tempdir().unwrap();
    // A budget too small for the largest request names the key.
    let graph = write_graph(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", "limit = 4", "100 KiB");
    assert_clean_failure(&kvflow(&["run", &graph.to_string_lossy()]), &["memory.budget_bytes", "largest request"]);
    // A malformed trace line names the file and line.
    let trace = dir.path().join("bad.jsonl");
    std::fs::write(&trace, "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\n{\"timestamp\": 5, \"input_length\": -1}\n").unwrap();
    let graph = write_graph(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", "", "64 MiB");
    assert_clean_failure(
        &kvflow(&["run", &graph.to_string_lossy(), "--trace", &trace.to_string_lossy()]),
        &["bad.jsonl:2", "input_length"],
    );
    // An unknown key in the graph names the key and line.
    let text =
        std::fs::read_to_string(&graph).unwrap().replace("chunk_tokens = 64", "chunk_tokens = 64\nchunk_tokenz = 3");
    std::fs::write(&graph, text).unwrap();
    assert_clean_failure(&kvflow(&["check", &graph.to_string_lossy()]), &["graph.toml:", "chunk_tokenz"]);
}

#[test]
fn check_prints_the_operator_graph() {
    let out = kvflow(&["check", &repo().join("graphs/quickstart.toml").to_string_lossy(), "--dot"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let dot = String::from_utf8_lossy(&out.stdout);
    for needle in ["digraph", "cluster_main", "align(t)", "forward(t)", "launched: LoopSignal", "sampled: Event"] {
        assert!(dot.contains(needle), "missing {needle}: {dot}");
    }
    // Every graph the repository ships is valid; the two-pool one draws both pools. The SmolLM2
    // graph names its model in `${KVFLOW_CACHE:-~/.cache/kvflow}`: it is checked against the
    // copy the tests fetch for themselves.
    for entry in std::fs::read_dir(repo().join("graphs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let mut check = std::process::Command::new(env!("CARGO_BIN_EXE_kvflow"));
            check.args(["check", &path.to_string_lossy(), "--dot"]);
            if path.ends_with("smollm2.toml") {
                let Some(gguf) = crate::gguf::smollm2() else { continue };
                check.env("KVFLOW_CACHE", gguf.parent().and_then(|p| p.parent()).unwrap());
            }
            let out = check.output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{}: {stderr}", path.display());
        }
    }
    let out = kvflow(&["check", &repo().join("graphs/two-pools.toml").to_string_lossy(), "--dot"]);
    let dot = String::from_utf8_lossy(&out.stdout);
    assert!(
        dot.contains("cluster_sync") && dot.contains("cluster_async") && dot.contains("executor: cpu-deferred"),
        "{dot}"
    );
}

#[test]
fn the_dot_picture_is_drawn_from_the_dataflow_the_runtime_builds() {
    use kvflow::runtime::dot::{render, Extension};
    use timely::dataflow::channels::pact::Pipeline;
    use timely::dataflow::operators::generic::operator::Operator;
    let registry = kvflow::registry::Registry::default();
    let graph = Graph::load_with(&repo().join("graphs/quickstart.toml"), &registry.names()).unwrap();
    let plain = render(&graph, &registry, None).unwrap();
    assert!(!plain.contains("probe"), "{plain}");
    // An operator added to the pool's graph shows up, with the edge that feeds it.
    let probe: Extension = std::sync::Arc::new(|streams: &kvflow::runtime::PoolStreams| {
        streams.sampled.clone().sink(Pipeline, "probe", |(input, _frontier)| input.for_each_stamp(|_, _| {}));
    });
    let extended = render(&graph, &registry, Some(probe)).unwrap();
    let node = |name: &str, dot: &str| {
        dot.lines()
            .find(|l| l.contains(&format!("label=\"{name}")) && l.contains('['))
            .map(|l| l.split_whitespace().next().unwrap().to_string())
    };
    let (verify, probe) =
        (node("verify(t)", &extended).unwrap(), node("probe", &extended).expect("the probe is drawn"));
    assert!(extended.contains(&format!("{verify} -> {probe} [label=\"sampled: Event\"]")), "{extended}");
    assert_eq!(extended.lines().count(), plain.lines().count() + 2, "one node and one edge more");
}

#[test]
fn the_dot_picture_of_a_pd_graph_shows_requests_entering_the_decode_pool() {
    use kvflow::runtime::dot::render;
    let registry = kvflow::registry::Registry::default();
    let graph = Graph::load_with(&repo().join("graphs/pd-1p1d.toml"), &registry.names()).unwrap();
    let dot = render(&graph, &registry, None).unwrap();
    let edges = |label: &str| -> Vec<String> {
        dot.lines().filter(|l| l.contains(&format!("label=\"{label}"))).map(|l| l.trim().to_string()).collect()
    };
    let entering = edges("requests (ingress)");
    assert!(entering.len() == 1 && entering[0].starts_with("workload -> \"decode/"), "{dot}");
    let asked = edges("remote prefill");
    assert!(asked.len() == 1 && asked[0].starts_with("\"decode/") && asked[0].contains("-> \"prefill/"), "{dot}");
    let handed = edges("handoff (inproc)");
    assert!(handed.len() == 1 && handed[0].starts_with("\"prefill/") && handed[0].contains("-> \"decode/"), "{dot}");
}
