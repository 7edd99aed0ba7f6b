//! Pools in separate OS processes (`--pools`): a decode pool's process binds (port 0), prints
//! the address it listens on, and serves; the prefill pool's process connects there over tcp,
//! replays the workload, gets every request's tokens back over the link and writes the report.
//! The outputs are exact; the decode work really ran in the other process (this one took no
//! handoff); and when that process is killed, every request it owed ends failed with a named
//! cause, at once, and nothing is left held on this side.

use crate::common::{first_line_after, kill_and_reap, records, report, stderr_lines};
use crate::runtime::{write_graph_with, HEAVY};
use parking_lot::Mutex;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const TCP_1P1D: &str = "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n\
    [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n\n\
    [[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"tcp\"\nendpoint = \"127.0.0.1:0\"\n";

/// What a decode pool's process prints before the address it listens on.
pub const DECODE_LISTENING: &str = "decode pool `decode` listening on ";

/// A decode pool's process, with the address it printed and its stderr as it comes.
pub struct DecodeProcess {
    pub child: Child,
    pub addr: String,
    pub stderr: Arc<Mutex<String>>,
}

fn start_decode(graph: &std::path::Path) -> DecodeProcess {
    start_decode_with(graph, &["--stall-timeout", "30"])
}

/// `kvflow run GRAPH --pools decode ARGS…`, once it has printed where it listens.
pub fn start_decode_with(graph: &std::path::Path, args: &[&str]) -> DecodeProcess {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .args(["run", &graph.to_string_lossy(), "--pools", "decode"])
        .args(args)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = Arc::new(Mutex::new(String::new()));
    let sink = stderr.clone();
    let lines = stderr_lines(&mut child, move |line| sink.lock().push_str(&format!("{line}\n")));
    let addr = first_line_after(&lines, DECODE_LISTENING, Duration::from_secs(60)).unwrap_or_else(|| {
        kill_and_reap(&mut child);
        panic!("the decode process printed no address: {}", stderr.lock())
    });
    DecodeProcess { child, addr, stderr }
}

fn prefill(graph: &std::path::Path, addr: &str) -> std::process::Output {
    let endpoint = format!("decode={addr}");
    Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .args(["run", &graph.to_string_lossy(), "--pools", "prefill", "--endpoint", &endpoint, "--verify"])
        .output()
        .unwrap()
}

#[test]
fn a_prefill_and_a_decode_pool_in_two_processes_give_the_reference_outputs() {
    let _one_at_a_time = HEAVY.lock();
    for model in ["hf/llama", "hf/qwen3_next"] {
        let dir = tempfile::tempdir().unwrap();
        let workload = "mode = \"concurrency\"\nconcurrency = 6\nwarmup = 2\nlimit = 12";
        let graph =
            write_graph_with(dir.path(), model, "mooncake_conversation_head.jsonl", workload, "32 MiB", TCP_1P1D);
        let mut decode = start_decode(&graph);
        let out = prefill(&graph, &decode.addr);
        let status = decode.child.wait().unwrap();
        let decode_log = decode.stderr.lock().clone();
        assert!(out.status.success(), "{model}: {}\n{decode_log}", String::from_utf8_lossy(&out.stderr));
        assert!(status.success(), "{model}: the decode process: {decode_log}");
        let r = report(dir.path());
        assert_eq!(r["completed"], 12, "{model}: {r}");
        assert_eq!(r["verify"]["checked"], 14, "{model}: warmup too");
        assert_eq!(r["verify"]["mismatched"], 0, "{model}");
        assert!(r["accounting_errors"].as_array().unwrap().is_empty(), "{model}");
        let h = &r["handoff"];
        assert_eq!(h["count"], 14, "{model}: {h}");
        assert!(h["socket_bytes"].as_u64().unwrap() >= h["bytes"].as_u64().unwrap(), "{model}: {h}");
        // The decode work ran in the other process: this one took no handoff, that one took all.
        assert_eq!(h["received"], 0, "{model}: {h}");
        assert!(decode_log.contains("took 14 handoff(s); every block and slot is free"), "{model}: {decode_log}");
        for rec in records(dir.path()) {
            assert_eq!(rec["pools"], serde_json::json!(["prefill", "decode"]), "{model}: {rec}");
            assert!(rec["transfer_ms"].as_f64().is_some(), "{model}: the split has the transfer: {rec}");
        }
    }
}

#[test]
fn a_decode_process_that_dies_fails_what_it_owed_at_once_and_frees_this_side() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    // Arrivals spread over a few seconds, so the decode process dies in the middle of them.
    let workload = "mode = \"timestamps\"\ntime_scale = 0.6\nwarmup = 0\nlimit = 30";
    let graph =
        write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB", TCP_1P1D);
    let mut decode = start_decode(&graph);
    let endpoint = format!("decode={}", decode.addr);
    let started = Instant::now();
    let producer = Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .args(["run", &graph.to_string_lossy(), "--pools", "prefill", "--endpoint", &endpoint, "--verify"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    kill_midway(&mut decode.child, producer, Duration::from_millis(1500));
    assert!(started.elapsed() < Duration::from_secs(120), "no wait for a timeout");
    assert_lost_peer(dir.path(), 30, "handoff", "decode pool decode");
}

/// SIGKILLs `victim` (no goodbye on any link) `after` into the run, then waits for `survivor`,
/// which must end with failed requests and nothing else (exit status 2); its stderr.
pub fn kill_midway(victim: &mut Child, survivor: Child, after: Duration) -> String {
    std::thread::sleep(after);
    victim.kill().unwrap();
    let _ = victim.wait();
    let out = survivor.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "failed requests, nothing else: {stderr}");
    stderr
}

/// The report of a run of `requests` that lost a peer process midway: nothing left held, what
/// completed is exact, some completed and the rest failed with `failure`, each naming `peer`.
pub fn assert_lost_peer(dir: &std::path::Path, requests: u64, failure: &str, peer: &str) {
    let r = report(dir);
    assert!(r["accounting_errors"].as_array().unwrap().is_empty(), "{}", r["accounting_errors"]);
    assert_eq!(r["verify"]["mismatched"], 0, "what completed is exact");
    assert!(r["failed"].as_u64().unwrap() > 0 && r["completed"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["failed"].as_u64().unwrap() + r["completed"].as_u64().unwrap(), requests);
    for rec in records(dir).iter().filter(|x| !x["error"].is_null()) {
        assert_eq!(rec["failure"], failure, "{rec}");
        assert!(rec["error"].as_str().unwrap().contains(peer), "names the peer: {rec}");
    }
}

#[test]
fn pools_and_endpoint_flags_that_cannot_work_are_clear_errors() {
    use crate::common::{assert_clean_failure, kvflow};
    let dir = tempfile::tempdir().unwrap();
    let workload = "mode = \"concurrency\"\nconcurrency = 2\nlimit = 2";
    let tcp =
        write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB", TCP_1P1D);
    let g = tcp.to_string_lossy().to_string();
    let cases: [(&[&str], &[&str]); 4] = [
        (&["--pools", "prefill"], &["decode pool `decode` runs in another process", "--endpoint decode=HOST:PORT"]),
        (&["--pools", "nope"], &["--pools", "no pool named `nope`"]),
        (&["--pools", "prefill", "--endpoint", "decod=127.0.0.1:9"], &["no decode pool `decod`", "decode"]),
        (&["--pools", "prefill", "--endpoint", "decode"], &["expected POOL=HOST:PORT"]),
    ];
    for (flags, needles) in cases {
        let mut args = vec!["run", g.as_str()];
        args.extend_from_slice(flags);
        assert_clean_failure(&kvflow(&args), needles);
    }
    // An inproc link cannot cross processes.
    let inproc = tcp.with_file_name("inproc.toml");
    let text = std::fs::read_to_string(&tcp).unwrap().replace("backend = \"tcp\"\nendpoint = \"127.0.0.1:0\"\n", "");
    std::fs::write(&inproc, text).unwrap();
    let out = kvflow(&["run", &inproc.to_string_lossy(), "--pools", "prefill"]);
    assert_clean_failure(&out, &["is not in this process (--pools)", "backend = \"tcp\""]);
}
