//! The runtime for asynchronous work: an executor that completes steps later gives exactly the
//! reference outputs and still decodes one token per step; several pools share one run and one
//! report; the accounting check catches a leak when the pool parks and at the end; a completion
//! for an older generation of a request is dropped and counted (and, without that check, corrupts
//! another request's output); any rank wakes its parked pool.

use crate::common::{records, report};
use crate::common::{repo, FIXTURES};
use crate::runtime::{assert_exact, kvflow_heavy, ranks_used, run_graph, write_graph_with};
use kvflow::graph::Overrides;
use kvflow_operators::rank::TestSwitches;
use serde_json::Value;
use std::path::Path;

/// One pool of `ranks` ranks on `executor`, with its settings table (if any).
pub(crate) fn pool(ranks: usize, executor: &str, settings: &str) -> String {
    let table = if settings.is_empty() { String::new() } else { format!("[pool.executor_settings]\n{settings}\n") };
    format!("[[pool]]\nname = \"main\"\nranks = {ranks}\nexecutor = \"{executor}\"\n{table}")
}

/// A graph in `dir` of `model` on `pools` over 10 requests of the head trace (and 2 of warm-up)
/// at concurrency 8.
fn ten_requests_on(dir: &Path, model: &str, pools: &str) -> std::path::PathBuf {
    let workload = "mode = \"concurrency\"\nconcurrency = 8\nwarmup = 2\nlimit = 10";
    write_graph_with(dir, model, "mooncake_conversation_head.jsonl", workload, "64 MiB", pools)
}

#[test]
fn a_deferred_executor_gives_the_reference_outputs_on_every_family() {
    for model in FIXTURES {
        for settings in ["delay_steps = 1", "delay_steps = 3\njitter_steps = 2\nseed = 5"] {
            let dir = tempfile::tempdir().unwrap();
            let graph = ten_requests_on(dir.path(), model, &pool(2, "cpu-deferred", settings));
            let what = format!("{model} on cpu-deferred ({})", settings.replace('\n', ", "));
            let report = run_graph(&graph, Overrides::default(), TestSwitches::default());
            assert_exact(&report, &what);
            assert_eq!(report["verify"]["checked"], 12, "{what}");
            assert_eq!(ranks_used(&dir.path().join("out")), [0, 1].into(), "{what}: work spreads over both ranks");
        }
    }
}

#[test]
fn decoding_with_a_deferred_executor_takes_one_step_per_token() {
    let mut launched = Vec::new();
    for (executor, settings) in [("cpu", ""), ("cpu-deferred", "delay_steps = 1"), ("cpu-deferred", "delay_steps = 3")]
    {
        let dir = tempfile::tempdir().unwrap();
        let graph = write_graph_with(
            dir.path(),
            "hf/llama",
            "mooncake_conversation_head.jsonl",
            "mode = \"concurrency\"\nconcurrency = 1\nlimit = 1",
            "64 MiB",
            &pool(1, executor, settings),
        );
        let overrides = Overrides { max_output_tokens: Some(24), ..Default::default() };
        let report = run_graph(&graph, overrides, TestSwitches::default());
        assert_exact(&report, executor);
        let line = &records(dir.path())[0];
        let (prompt, output) = (line["input_len"].as_u64().unwrap(), line["output_tokens"].as_array().unwrap().len());
        // The prompt in chunks of 64 (the last one samples the first token), then one decode per
        // further token: a step per token, never every other step.
        let expected = prompt.div_ceil(64) + output as u64 - 1;
        let steps = report["launched_steps"][0].as_u64().unwrap();
        assert_eq!(
            steps, expected,
            "{executor} {settings}: launched steps for {prompt} prompt and {output} output tokens"
        );
        // Around them only the pool's own steps: the first wake, the park once all is launched
        // (flushing the executor), the wake when the last tokens land, the ending step — and on a
        // loaded machine, where the executor thread can land a token after the pool parked, a
        // park and wake more (seen: 6 on CI's 2 cores). Empty steps between tokens would be ~20.
        let all = report["steps"][0].as_u64().unwrap();
        assert!(all - steps <= 8, "{executor} {settings}: {all} steps for {steps} launches: the pool ran empty steps");
        launched.push(steps);
    }
    assert!(launched.windows(2).all(|w| w[0] == w[1]), "{launched:?}");
}

#[test]
fn two_pools_in_one_run_each_serve_part_of_the_trace_and_report_apart() {
    let dir = tempfile::tempdir().unwrap();
    let pools = "[[pool]]\nname = \"a\"\nranks = 2\n\n\
                 [[pool]]\nname = \"b\"\nranks = 1\nexecutor = \"cpu-deferred\"\n\
                 [pool.memory]\nbudget_bytes = \"16 MiB\"\n[pool.scheduler]\nmax_running = 4\n";
    let graph = write_graph_with(
        dir.path(),
        "hf/kimi_linear",
        "mooncake_conversation_head.jsonl",
        "mode = \"concurrency\"\nconcurrency = 8\nlimit = 24\npool_choice = \"seeded\"",
        "64 MiB",
        pools,
    );
    let report = run_graph(&graph, Overrides::default(), TestSwitches::default());
    assert_exact(&report, "two pools");
    assert_eq!(report["requests"], 24);
    let per_pool = report["pools"].as_object().unwrap();
    assert_eq!(per_pool.keys().collect::<Vec<_>>(), ["a", "b"]);
    let (a, b) = (&per_pool["a"], &per_pool["b"]);
    let served = |p: &Value| p["requests"].as_u64().unwrap();
    assert_eq!((served(a), served(b)), (12, 12), "each pool serves half the trace");
    assert_eq!(a["verify"]["checked"].as_u64().unwrap() + b["verify"]["checked"].as_u64().unwrap(), 24);
    assert_eq!((a["ranks"].clone(), b["ranks"].clone()), (2.into(), 1.into()));
    assert_eq!(report["ranks"], 3);
    assert_eq!((a["executor"].as_str(), b["executor"].as_str()), (Some("cpu"), Some("cpu-deferred")));
    let blocks = |p: &Value| p["memory"]["blocks_per_rank"].as_u64().unwrap();
    assert!(blocks(b) < blocks(a), "pool b sizes its memory from its own budget");
    assert_eq!(report["memory"], Value::Null, "the pools' layouts differ: each is under its pool");
    for line in records(dir.path()) {
        let pool = line["pool"].as_str().unwrap().to_string();
        assert!(pool == "a" || pool == "b", "{line}");
        assert_eq!(line["pools"], serde_json::json!([pool]), "{line}");
    }
}

/// A two-request trace whose second request comes 1.5 s after the first: the pool parks between.
fn two_bursts(dir: &Path) -> std::path::PathBuf {
    let trace = dir.join("two_bursts.jsonl");
    let line = |t: u64, h: u64| {
        format!(
            "{{\"timestamp\": {t}, \"input_length\": 1500, \"output_length\": 200, \"hash_ids\": [{h}, {}, {}]}}\n",
            h + 1,
            h + 2
        )
    };
    std::fs::write(&trace, line(0, 0) + &line(1500, 10)).unwrap();
    trace
}

#[test]
fn the_accounting_check_names_a_leaked_block_when_the_pool_parks_and_at_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let trace = two_bursts(dir.path());
    let graph = write_graph_with(
        dir.path(),
        "hf/llama",
        "mooncake_conversation_head.jsonl",
        "time_scale = 1.0",
        "64 MiB",
        &pool(1, "cpu", ""),
    );
    let (g, t) = (graph.to_string_lossy().to_string(), trace.to_string_lossy().to_string());
    let clean = kvflow_heavy(&["run", &g, "--trace", &t]);
    assert!(clean.status.success(), "{}", String::from_utf8_lossy(&clean.stderr));
    let r = report(dir.path());
    assert!(r["accounting_checks"][0].as_u64().unwrap() >= 2, "checked at the park between the bursts and at the end");
    let leaky = kvflow_heavy(&["run", &g, "--trace", &t, "--test-switch", "leak-blocks-of=0"]);
    let stderr = String::from_utf8_lossy(&leaky.stderr);
    assert_eq!(leaky.status.code(), Some(4), "an accounting failure has its own exit status: {stderr}");
    let at_park: Vec<&str> = stderr.lines().filter(|l| l.contains("accounting check at park after step")).collect();
    assert!(!at_park.is_empty(), "caught when the pool parked: {stderr}");
    assert!(at_park[0].contains("KV block") && at_park[0].contains("leaked by request 0"), "{}", at_park[0]);
    assert!(stderr.contains("accounting check at the end of the run"), "and again at the end: {stderr}");
    let r = report(dir.path());
    assert_eq!(r["completed"], 2, "the run went on and the report was written");
    assert!(r["accounting_errors"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e.as_str().unwrap().contains("leaked by request 0")));
}

/// A tight budget (preemption) and requests cancelled while decoding, on an executor three
/// launches behind: tokens of requests that were preempted or cancelled arrive late.
fn late_completions(dir: &Path, extra: &[&str]) -> Value {
    let graph = write_graph_with(
        dir,
        "hf/llama",
        "mooncake_conversation_first5min.jsonl",
        "mode = \"concurrency\"\nconcurrency = 16\nlimit = 60",
        "4 MiB",
        &pool(2, "cpu-deferred", "delay_steps = 3"),
    );
    let g = graph.to_string_lossy().to_string();
    let mut args =
        vec!["run", &g, "--verify", "--test-switch", "cancel-at-stage=3:decoding,9:decoding,17:decoding,30:decoding"];
    args.extend_from_slice(extra);
    let out = kvflow_heavy(&args);
    let r = report(dir);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"), "{}", String::from_utf8_lossy(&out.stderr));
    r
}

#[test]
fn a_late_completion_for_an_older_generation_is_dropped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let r = late_completions(dir.path(), &[]);
    assert!(r["stale_completions"].as_u64().unwrap() > 0, "late tokens were dropped and counted: {r}");
    assert_eq!(r["cancelled"], 4);
    assert_eq!(r["stale_releases"], 0, "no pinned id was released for an older generation");
    assert_eq!(r["failed"], 0, "{r}");
    assert_eq!(r["verify"]["mismatched"], 0, "{}", r["verify"]);
    // Without the generation check, the late tokens land in whatever holds the slot now.
    let r = late_completions(dir.path(), &["--test-switch", "accept-stale-completions"]);
    let harmed = r["verify"]["mismatched"].as_u64().unwrap() + r["failed"].as_u64().unwrap();
    assert!(harmed > 0, "without the check some request must come out wrong: {r}");
}

#[test]
fn a_graph_of_pools_is_checked_key_by_key() {
    let dir = tempfile::tempdir().unwrap();
    for (pools, needles) in [
        (
            pool(1, "cpu-deferred", "delay_step = 1"),
            vec!["pool.executor_settings.delay_step", "unknown key", "`delay_steps`"],
        ),
        (pool(1, "cpu", "delay_steps = 1"), vec!["pool.executor_settings.delay_steps", "takes no settings"]),
        (pool(1, "cpu-deferred", "delay_steps = -2"), vec!["pool.executor_settings.delay_steps", "at least 0"]),
        (
            format!("{}[pool.scheduler]\nchunk_tokens = 999\n", pool(1, "cpu", "")),
            vec!["pool.scheduler.chunk_tokens", "larger than pool.scheduler.max_batched_tokens (256)"],
        ),
        (format!("{}[pool.memory]\nbudget = 3\n", pool(1, "cpu", "")), vec!["pool.memory.budget", "unknown field"]),
    ] {
        let graph = write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", "", "64 MiB", &pools);
        let out = kvflow_heavy(&["check", &graph.to_string_lossy()]);
        crate::common::assert_clean_failure(&out, &needles);
    }
    let graph = write_graph_with(
        dir.path(),
        "hf/llama",
        "mooncake_conversation_head.jsonl",
        "pool_choice = \"random\"",
        "64 MiB",
        &pool(1, "cpu", ""),
    );
    crate::common::assert_clean_failure(
        &kvflow_heavy(&["check", &graph.to_string_lossy()]),
        &["workload.pool_choice", "`seeded`, `round-robin`"],
    );
    let _ = repo();
}

/// The whole matrix: every fixture × 1, 2 and 4 ranks × `cpu` and `cpu-deferred` at delays 0, 1
/// and 3 with jitter; prints one line per run. Not part of the default run (about 84 runs):
/// `cargo test --test integration -- --ignored --nocapture full_verify_matrix`.
#[test]
#[ignore]
fn full_verify_matrix() {
    let executors = [
        ("cpu", ""),
        ("cpu-deferred", "delay_steps = 0"),
        ("cpu-deferred", "delay_steps = 1"),
        ("cpu-deferred", "delay_steps = 3\njitter_steps = 2\nseed = 7"),
    ];
    println!(
        "{:<20} {:>5}  {:<42} {:>7} {:>10} {:>6} {:>8}",
        "model", "ranks", "executor", "checked", "mismatched", "stale", "launched"
    );
    let mut bad = Vec::new();
    for model in FIXTURES {
        for ranks in [1, 2, 4] {
            for (executor, settings) in executors {
                let dir = tempfile::tempdir().unwrap();
                let graph = ten_requests_on(dir.path(), model, &pool(ranks, executor, settings));
                let r = run_graph(&graph, Overrides::default(), TestSwitches::default());
                let name = format!("{executor} {}", settings.replace('\n', ", "));
                let launched: u64 = r["launched_steps"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).sum();
                println!(
                    "{model:<20} {ranks:>5}  {name:<42} {:>7} {:>10} {:>6} {launched:>8}",
                    r["verify"]["checked"], r["verify"]["mismatched"], r["stale_completions"]
                );
                if r["verify"]["mismatched"] != 0 || r["failed"] != 0 || r["verify"]["checked"] != 12 {
                    bad.push(format!("{model} {ranks} {name}"));
                }
            }
        }
    }
    assert!(bad.is_empty(), "{bad:?}");
}
