//! Operability: cancellation at every stage frees everything at once and leaves the other
//! requests' outputs unchanged; a workload can cancel a seeded fraction; Ctrl-C ends a replay
//! within its grace period with a valid partial report.

use crate::common::repo;
use crate::runtime::write_graph;
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

fn records(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("out/requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn report(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("out/report.json")).unwrap()).unwrap()
}

fn run_cli(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kvflow")).args(args).output().unwrap()
}

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
        let out = run_cli(&[
            "run",
            &graph.to_string_lossy(),
            "--ranks",
            "1",
            "--verify",
            "--test-cancel-at-stage",
            "7:queued,0:prefilling,1:decoding",
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
    let out = run_cli(&["run", &graph.to_string_lossy(), "--verify"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r = report(dir.path());
    let cancelled = r["cancelled"].as_u64().unwrap();
    assert!(cancelled > 0, "some requests must be cancelled: {r}");
    assert_eq!(r["completed"].as_u64().unwrap() + cancelled, 30);
    assert_eq!(r["verify"]["mismatched"], 0);
}

#[test]
fn ctrl_c_ends_a_replay_within_the_grace_period_with_a_partial_report() {
    let dir = tempfile::tempdir().unwrap();
    // The whole head trace at trace speed: 72 s; we interrupt it after 3 s.
    let graph = write_graph(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", "time_scale = 1.0", "64 MiB");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .args(["run", &graph.to_string_lossy(), "--grace-period", "2"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let sent = Instant::now();
    let status = std::process::Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(sent.elapsed() < Duration::from_secs(20), "still running 20 s after SIGINT");
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = sent.elapsed();
    assert!(took < Duration::from_secs(2 + 5), "exited {took:?} after SIGINT; grace period 2 s");
    assert!(status.code().is_some(), "ended by a signal, not by itself");
    let r = report(dir.path());
    assert_eq!(r["interrupted"], true);
    assert_eq!(r["schema"], 1);
    let completed = r["completed"].as_u64().unwrap();
    assert!(completed > 0 && completed < 200, "a partial report: {completed} completed");
    let lines = records(dir.path());
    assert!(lines.iter().all(|l| l["id"].is_u64()));
    let _ = repo();
}
