//! Operability: cancellation at every stage frees everything at once and leaves the other
//! requests' outputs unchanged; a workload can cancel a seeded fraction; Ctrl-C ends a replay
//! within its grace period with a valid partial report; a replay releases nothing before every
//! rank has built its executor, so start-up is not counted in any request's latency.

use crate::common::{kvflow, records, repo, report, wait_within_or_kill};
use crate::runtime::write_graph;
use std::path::Path;
use std::time::{Duration, Instant};

#[test]
fn cancelling_at_each_stage_frees_everything_and_leaves_the_others_exact() {
    for model in ["hf/llama", "hf/kimi_linear"] {
        let dir = tempfile::tempdir().unwrap();
        // Two running sequences per rank and small chunks: later requests queue, prompts take
        // several steps to prefill.
        let graph = write_graph(
            dir.path(),
            model,
            "mooncake_conversation_head.jsonl",
            "mode = \"concurrency\"\nconcurrency = 8\nlimit = 12",
            "64 MiB",
        );
        let text = std::fs::read_to_string(&graph)
            .unwrap()
            .replace("max_running = 16", "max_running = 2")
            .replace("chunk_tokens = 64", "chunk_tokens = 16");
        std::fs::write(&graph, text).unwrap();
        let out = kvflow(&[
            "run",
            &graph.to_string_lossy(),
            "--ranks",
            "1",
            "--verify",
            "--test-switch",
            "cancel-at-stage=7:queued,0:prefilling,1:decoding",
        ]);
        assert!(out.status.success(), "{model}: {}", String::from_utf8_lossy(&out.stderr));
        let errors: Vec<(u64, String)> = records(dir.path())
            .iter()
            .filter(|r| !r["error"].is_null())
            .map(|r| (r["id"].as_u64().unwrap(), r["error"].as_str().unwrap().to_string()))
            .collect();
        assert_eq!(
            errors,
            vec![
                (0, "cancelled while prefilling".into()),
                (1, "cancelled while decoding".into()),
                (7, "cancelled while queued".into())
            ],
            "{model}"
        );
        let r = report(dir.path());
        assert_eq!(r["cancelled"], 3, "{model}");
        assert_eq!(r["failed"], 0, "{model}");
        assert_eq!(r["verify"]["checked"], 9, "{model}: the other requests are verified");
        assert_eq!(r["verify"]["mismatched"], 0, "{model}");
        // The run itself asserts that every block, slot and snapshot is free at the end.
    }
}

#[test]
fn a_workload_cancels_a_seeded_fraction_of_its_requests() {
    let dir = tempfile::tempdir().unwrap();
    let graph = write_graph(
        dir.path(),
        "hf/qwen3_next",
        "mooncake_conversation_head.jsonl",
        "mode = \"concurrency\"\nconcurrency = 8\nlimit = 30\ncancel_fraction = 0.3\ncancel_after_ms = 2",
        "64 MiB",
    );
    let out = kvflow(&["run", &graph.to_string_lossy(), "--verify"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r = report(dir.path());
    let cancelled = r["cancelled"].as_u64().unwrap();
    assert!(cancelled > 0, "some requests must be cancelled: {r}");
    assert_eq!(r["completed"].as_u64().unwrap() + cancelled, 30);
    assert_eq!(r["verify"]["mismatched"], 0);
}

#[test]
fn ctrl_c_lets_requests_finish_for_the_grace_period_then_cancels_the_rest() {
    interrupt_with("INT", 130);
}

/// SIGTERM (what `timeout`, systemd, docker and Kubernetes send) is handled as Ctrl-C: the grace
/// period, the partial report; the exit status says which signal.
#[test]
fn sigterm_writes_the_partial_report_like_ctrl_c() {
    interrupt_with("TERM", 143);
}

/// Sends SIG`signal` to a run 3 s in and checks the grace period, the report and `exit_status`.
fn interrupt_with(signal: &str, exit_status: i32) {
    let dir = tempfile::tempdir().unwrap();
    // The head trace at trace speed at a quarter of its lengths (prompts of ~1.8k tokens,
    // outputs of ~150): requests are in flight for seconds. We interrupt it after 3 s.
    let graph = write_graph(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", "time_scale = 1.0", "64 MiB");
    let grace_s = 1.5;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .args(["run", &graph.to_string_lossy(), "--grace-period", &grace_s.to_string()])
        .args(["--block-tokens", "128", "--max-output-tokens", "2000"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let sent = Instant::now();
    let status =
        std::process::Command::new("kill").args([&format!("-{signal}"), &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let status = wait_within_or_kill(&mut child, Duration::from_secs(30))
        .unwrap_or_else(|| panic!("still running 30 s after SIG{signal}"));
    let took = sent.elapsed();
    assert!(
        took < Duration::from_secs_f64(grace_s + 5.0),
        "exited {took:?} after SIG{signal}; grace period {grace_s} s"
    );
    assert_eq!(status.code(), Some(exit_status), "an interrupted run exits 128 + the signal, by itself");
    let r = report(dir.path());
    assert_eq!(r["interrupted"], true);
    assert_eq!(r["schema"], 1);
    let interrupted_ms = r["interrupted_ms"].as_f64().expect("when the interrupt came");
    let lines = records(dir.path());
    assert!(lines.iter().all(|l| l["id"].is_u64()));
    // The grace period is honoured: what was still running when it ran out is cancelled then,
    // not at the interrupt.
    let cancelled: Vec<f64> = lines
        .iter()
        .filter(|l| l["failure"] == "cancelled")
        .map(|l| l["ended_ms"].as_f64().expect("an end time"))
        .collect();
    assert!(!cancelled.is_empty(), "some requests outlast the grace period and are cancelled: {r}");
    let grace_ended = interrupted_ms + grace_s * 1000.0;
    for ended in &cancelled {
        assert!(
            *ended >= grace_ended - 100.0,
            "cancelled at {ended} ms, before the grace period ended ({grace_ended} ms)"
        );
    }
    // Nothing is released after the interrupt.
    assert!(lines.iter().all(|l| l["arrival_ms"].as_f64().unwrap() <= interrupted_ms + 100.0));
    let _ = repo();
}

/// A graph for the stall tests: 3 ranks, enough requests to keep running for dozens of steps.
fn stall_graph(dir: &Path) -> std::path::PathBuf {
    write_graph(
        dir,
        "hf/llama",
        "mooncake_conversation_head.jsonl",
        "mode = \"concurrency\"\nconcurrency = 6\nlimit = 30",
        "64 MiB",
    )
}

#[test]
fn the_stall_diagnosis_names_the_operator_rank_and_step_holding_the_pool() {
    // Every operator that can hold the pool back, each on a fixed rank and step.
    for (operator, rank, step) in
        [("admit", 0, 4), ("schedule", 1, 5), ("align", 2, 6), ("forward", 1, 8), ("verify", 2, 7)]
    {
        let dir = tempfile::tempdir().unwrap();
        let graph = stall_graph(dir.path());
        let hold = format!("hold-capability={operator}:{rank}:{step}");
        let started = Instant::now();
        let out =
            kvflow(&["run", &graph.to_string_lossy(), "--ranks", "3", "--stall-timeout", "2", "--test-switch", &hold]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{hold}: a stall exits with status 3: {stderr}");
        assert!(started.elapsed() < Duration::from_secs(30));
        let expected = format!("holding the pool back: operator `{operator}` on rank {rank} holds step {step} ");
        assert!(stderr.contains(&expected), "expected {expected:?} in:\n{stderr}");
        assert_eq!(stderr.matches("holding the pool back").count(), 1, "{hold}: exactly one culprit:\n{stderr}");
        assert_eq!(report(dir.path())["stalled"], true, "{hold}: a partial report is written");
    }
}

#[test]
fn without_collective_alignment_requests_are_lost_and_the_pool_stalls() {
    // Guarantee "collective alignment" (docs/design.md §5): with the frontier wait in `align`,
    // every rank derives the same plan and every request returns; without it, ranks plan from
    // partial reports, disagree on admissions, and requests never return.
    let dir = tempfile::tempdir().unwrap();
    let graph = stall_graph(dir.path());
    let g = graph.to_string_lossy().to_string();
    let with = kvflow(&["run", &g, "--ranks", "3", "--stall-timeout", "5"]);
    assert!(with.status.success(), "{}", String::from_utf8_lossy(&with.stderr));
    assert_eq!(report(dir.path())["completed"], 30);
    let without =
        kvflow(&["run", &g, "--ranks", "3", "--stall-timeout", "3", "--test-switch", "align-without-waiting"]);
    // Which failure comes first is a race between the ranks' plans: the watchdog ends a pool
    // whose ranks wait on each other (status 3), or the run drains and the end-of-run check names
    // the requests a rank still holds (status 4). Either way the run fails and requests are lost.
    let stderr = String::from_utf8_lossy(&without.stderr);
    let r = report(dir.path());
    match without.status.code() {
        Some(3) => assert_eq!(r["stalled"], true, "a stall writes a partial report: {stderr}"),
        Some(4) => assert!(stderr.contains("still held at the end of the run"), "{stderr}"),
        other => panic!("expected a stall (3) or a failed end-of-run check (4), got {other:?}: {stderr}"),
    }
    assert!(r["completed"].as_u64().unwrap() < 30, "requests were lost: {r}");
}

#[test]
fn the_watchdog_notices_a_worker_stuck_inside_an_operator() {
    let dir = tempfile::tempdir().unwrap();
    let graph = stall_graph(dir.path());
    let out = kvflow(&[
        "run",
        &graph.to_string_lossy(),
        "--ranks",
        "3",
        "--stall-timeout",
        "2",
        "--test-switch",
        "stuck-in-forward=2:6",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("rank 2 is stuck inside an operator"), "{stderr}");
}

#[test]
fn a_run_refused_at_its_checks_leaves_no_report_folder() {
    let dir = tempfile::tempdir().unwrap();
    let graph = write_graph(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", "ignore_eos = false", "64 MiB");
    let out = dir.path().join("nested/out");
    let run = kvflow(&["run", &graph.to_string_lossy(), "--out", &out.to_string_lossy()]);
    crate::common::assert_clean_failure(&run, &["ignore_eos = false"]);
    assert!(!dir.path().join("nested").exists(), "a refused run made {}", out.display());
    // Refused later, at its model: a folder that is not a checkpoint.
    let graph = write_graph(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", "limit = 2", "64 MiB");
    let not_a_model = dir.path().join("not-a-model");
    std::fs::create_dir(&not_a_model).unwrap();
    let args =
        ["run", &graph.to_string_lossy(), "--out", &out.to_string_lossy(), "--model", &not_a_model.to_string_lossy()];
    crate::common::assert_clean_failure(&kvflow(&args), &["cannot load model"]);
    assert!(!dir.path().join("nested").exists(), "a refused run made {}", out.display());
}

#[test]
fn compare_checks_every_graph_before_it_runs_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let good = repo().join("graphs/aggregated-2.toml");
    let text = std::fs::read_to_string(&good).unwrap();
    let model_line = text.lines().find(|l| l.starts_with("path = ")).unwrap();
    let bad = dir.path().join("no-model.toml");
    std::fs::write(&bad, text.replace(model_line, "path = \"/nonexistent/kvflow/model\"")).unwrap();
    let cmp = dir.path().join("cmp");
    let args =
        ["compare", &good.to_string_lossy(), &bad.to_string_lossy(), "--limit", "2", "--out", &cmp.to_string_lossy()];
    let started = Instant::now();
    let out = kvflow(&args);
    let stderr =
        crate::common::assert_clean_failure(&out, &["no-model.toml", "model.path", "/nonexistent/kvflow/model"]);
    assert!(!stderr.contains("== "), "a graph ran before the second was checked: {stderr}");
    assert!(!cmp.exists(), "the first graph's report was written: {stderr}");
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn a_replay_releases_nothing_before_every_rank_is_built() {
    // Test switch `slow-rank-build-ms` makes each rank take 1.5 s more to build its executor,
    // as a large model loading would; `release-before-ranks-are-built` removes the driver's wait.
    let slow = 1500.0;
    for wait in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let workload = "mode = \"concurrency\"\nconcurrency = 2\nlimit = 4";
        let graph = write_graph(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB");
        let mut args = vec!["run", graph.to_str().unwrap(), "--test-switch", "slow-rank-build-ms=1500"];
        if !wait {
            args.extend(["--test-switch", "release-before-ranks-are-built"]);
        }
        let out = kvflow(&args);
        assert!(out.status.success(), "wait {wait}: {}", String::from_utf8_lossy(&out.stderr));
        let first_queued = records(dir.path()).iter().map(|r| r["queue_ms"].as_f64().unwrap()).fold(0.0, f64::max);
        // (a prompt of the fixture prefills in milliseconds: queueing past 1.5 s is the start-up)
        assert_eq!(first_queued < slow * 0.9, wait, "wait {wait}: the longest queueing was {first_queued:.0} ms");
    }
}
