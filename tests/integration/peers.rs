//! Peers at a decode endpoint, and signals, tried as a hostile user would, with the `kvflow`
//! binary on loopback: a second producer at a decode endpoint already served is refused at once
//! with the reason on both sides; a producer with the wrong deployment token is refused and the
//! decode side logs it by address, never the token; a producer SIGKILLed midway is lost at once
//! (its requests cancelled and named, exit 2) rather than waited on for the stall timeout.
//! SIGTERM and SIGHUP end `serve`, `run` and `launch` with a drain and a report in under 10 s;
//! `launch` passes the signal on to its processes (none is left running) and reports a process
//! killed by a signal as such. Each mechanism that can be switched off is, to show the failure.

use crate::common::{
    kill_and_reap, one_llama_rank_to_serve, records, report, report_in, rest_of_stderr, stderr_lines, wait_within,
    wait_within_or_kill, Served,
};
use crate::processes::{start_decode_with, DecodeProcess, TCP_1P1D};
use crate::runtime::{write_graph_with, HEAVY};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Requests in flight for several seconds: the decode side always holds some.
const BUSY: &str = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 40";
/// A workload that outlasts any signal a test sends it, however fast the machine (the signal ends it).
const OUTLASTING: &str = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 400";

/// `kvflow run GRAPH --pools prefill --endpoint decode=ADDR ARGS…`, its stderr piped.
fn start_producer(graph: &Path, addr: &str, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .args(["run", &graph.to_string_lossy(), "--pools", "prefill", "--endpoint", &format!("decode={addr}")])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits up to `limit` for the child (killing it if it still runs then): how it ended by itself,
/// if it did, and its stderr.
fn end_within(child: &mut Child, limit: Duration) -> (Option<ExitStatus>, String) {
    let status = wait_within_or_kill(child, limit);
    (status, rest_of_stderr(child))
}

fn signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) on the pid of a child of this test (or of its launch), still running.
    assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0, "kill({pid}, {signal})");
}

/// Whether process `pid` still runs (a zombie counts as ended).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| stat.rsplit(") ").next().is_some_and(|rest| !rest.starts_with('Z')))
        .unwrap_or(false)
}

/// A P/D graph over tcp in `dir` whose decode side is started with `decode_args`; the decode
/// process once it listens.
fn decode_side(dir: &Path, pools_extra: &str, decode_args: &[&str]) -> (std::path::PathBuf, DecodeProcess) {
    let pools = format!("{TCP_1P1D}{pools_extra}");
    let graph = write_graph_with(dir, "hf/llama", "mooncake_conversation_head.jsonl", BUSY, "32 MiB", &pools);
    let decode = start_decode_with(&graph, decode_args);
    (graph, decode)
}

/// A second producer process at a decode endpoint whose graph declares one: refused at once,
/// the reason on both sides, the decode side naming the peer's address; the first producer's
/// run goes on exact. With `serve-any-producer` (no refusal) the second is taken and does not
/// end: it hangs beside the first.
#[test]
fn a_second_producer_is_refused_at_once_with_the_reason_on_both_sides() {
    let _one_at_a_time = HEAVY.lock();
    for refusing in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let switch: &[&str] = if refusing { &[] } else { &["--test-switch", "serve-any-producer"] };
        let (graph, mut decode) = decode_side(dir.path(), "", &[&["--stall-timeout", "30"], switch].concat());
        // (120 requests: the first run must outlast the second producer's start on a loaded machine,
        // or the decode side has ended and the second finds no listener)
        let mut first = start_producer(&graph, &decode.addr, &["--verify", "--limit", "120"]);
        std::thread::sleep(Duration::from_secs(2)); // the first has registered
                                                    // "At once": the second producer's patience (its stall timeout) is 600 s, so one that
                                                    // retried for it would still run at the limit; the limit leaves a loaded 2-core machine
                                                    // time to start a process (10 s did not, once, in CI).
        let limit = Duration::from_secs(if refusing { 60 } else { 20 });
        let started = Instant::now();
        let mut second = start_producer(&graph, &decode.addr, &["--limit", "200", "--stall-timeout", "600"]);
        let (ended, second_log) = end_within(&mut second, limit);
        if !refusing {
            assert!(ended.is_none(), "without the refusal the second producer is taken and runs on: {second_log}");
            assert!(!second_log.contains("refused"), "{second_log}");
            for child in [&mut first, &mut decode.child] {
                kill_and_reap(child);
            }
            continue;
        }
        let status = ended.unwrap_or_else(|| {
            panic!(
                "the second producer still runs after {limit:?}: {second_log}\ndecode side: {}",
                decode.stderr.lock()
            )
        });
        assert_eq!(status.code(), Some(1), "{second_log}");
        assert!(started.elapsed() < limit);
        // `[transfer] connections` (2 by default) from the one prefill process the graph declares.
        for needle in ["refused the registration", "already serves the 2 producer connection(s)"] {
            assert!(second_log.contains(needle), "the producer says why ({needle}): {second_log}");
        }
        let out = first.wait_with_output().unwrap();
        let status = decode.child.wait().unwrap();
        let decode_log = decode.stderr.lock().clone();
        assert!(out.status.success(), "the first run goes on: {}", String::from_utf8_lossy(&out.stderr));
        assert!(status.success(), "{decode_log}");
        assert!(decode_log.contains("refused a producer connecting from 127.0.0.1:"), "{decode_log}");
        assert!(decode_log.contains("already serves the 2 producer connection(s)"), "{decode_log}");
        let r = report(dir.path());
        assert_eq!((r["completed"].as_u64(), r["verify"]["mismatched"].as_u64()), (Some(120), Some(0)), "{r}");
    }
}

/// A producer presenting the wrong deployment token is refused at once (it does not try again
/// for its patience), and the decode side logs the refusal with the peer's address and never
/// either token.
#[test]
fn a_wrong_token_is_refused_at_once_and_logged_by_address_never_the_token() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let (graph, mut decode) =
        decode_side(dir.path(), "\n[transfer]\ndeployment_token = \"right-7f3a9\"\n", &["--stall-timeout", "30"]);
    let wrong = graph.with_file_name("wrong.toml");
    std::fs::write(&wrong, std::fs::read_to_string(&graph).unwrap().replace("right-7f3a9", "wrong-91c2e")).unwrap();
    let started = Instant::now();
    let mut producer = start_producer(&wrong, &decode.addr, &[]);
    let (status, producer_log) = end_within(&mut producer, Duration::from_secs(10));
    let decode_log = decode.stderr.lock().clone();
    kill_and_reap(&mut decode.child);
    assert_eq!(status.and_then(|s| s.code()), Some(1), "refused at once: {producer_log}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(producer_log.contains("refused the registration: decode pool decode refused the deployment token"));
    assert!(decode_log.contains("refused a producer connecting from 127.0.0.1:"), "{decode_log}");
    assert!(decode_log.contains("refused the deployment token"), "{decode_log}");
    for token in ["right-7f3a9", "wrong-91c2e"] {
        assert!(!decode_log.contains(token) && !producer_log.contains(token), "a token is never logged");
    }
}

/// A producer SIGKILLed midway: its links close without their close frame and never come back.
/// The decode side counts it lost within seconds, cancels the requests it handed off that are
/// still there, names them (and those that ended after it went, unheard) and the producer's
/// address, frees everything and exits 2. With
/// `keep-vanished-producers` (no peer loss) it waits out the stall timeout and exits 0, as
/// before.
#[test]
fn a_producer_killed_midway_is_lost_at_once_and_its_requests_are_named() {
    let _one_at_a_time = HEAVY.lock();
    for losing in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let stall = if losing { "30" } else { "10" };
        let switch: &[&str] = if losing { &[] } else { &["--test-switch", "keep-vanished-producers"] };
        // Prompts of 16 tokens and outputs of 1,000: the decode side holds the requests in
        // flight whenever the producer dies.
        let trace = dir.path().join("long-outputs.jsonl");
        let line = |k: usize| {
            format!("{{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 32000, \"hash_ids\": [{k}]}}\n")
        };
        std::fs::write(&trace, (0..40).map(line).collect::<String>()).unwrap();
        let graph = write_graph_with(dir.path(), "hf/llama", &trace.to_string_lossy(), BUSY, "32 MiB", TCP_1P1D);
        let mut decode = start_decode_with(&graph, &[&["--stall-timeout", stall], switch].concat());
        let mut producer = start_producer(&graph, &decode.addr, &["--max-output-tokens", "1000"]);
        std::thread::sleep(Duration::from_secs(5));
        kill_and_reap(&mut producer);
        let killed = Instant::now();
        let status = wait_within(&mut decode.child, Duration::from_secs(60)).expect("the decode side ends");
        let took = killed.elapsed();
        let log = decode.stderr.lock().clone();
        if !losing {
            assert_eq!(status.code(), Some(0), "{log}");
            // (The stall clock starts at the last look that found the link open, up to 0.1 s
            // before the kill.)
            assert!(took >= Duration::from_secs(9), "without peer loss it waits out the stall timeout: {took:?}");
            continue;
        }
        assert!(took < Duration::from_secs(6), "lost at once, not after the stall timeout: {took:?}\n{log}");
        assert_eq!(status.code(), Some(2), "{log}");
        assert!(log.contains("the producer link from 127.0.0.1:") && log.contains("is lost"), "{log}");
        // Each of its `[transfer] connections` is a link of its own, each lost and named.
        let named: Vec<&str> = log.lines().filter(|l| l.contains("lost the producer link from 127.0.0.1:")).collect();
        assert_eq!(named.len(), 2, "{log}");
        let count =
            |line: &str| -> u64 { line.split(": ").nth(2).and_then(|n| n.split(' ').next()?.parse().ok()).unwrap() };
        assert!(named.iter().all(|l| l.contains("failure = \"producer-lost\"")), "{named:?}");
        let failed: u64 = named.iter().map(|l| count(l)).sum();
        assert!(failed > 0, "some requests were there when it went: {named:?}");
        assert!(log.contains("every block and slot is free"), "{log}");
        // The decode side's report names them too, with their cause.
        let served = std::fs::read_to_string(dir.path().join("out/served-decode.json")).unwrap();
        let served: serde_json::Value = serde_json::from_str(&served).unwrap();
        let lost = served["producers_lost"].as_array().unwrap();
        assert!(lost.iter().all(|l| l["failure"] == "producer-lost"), "{served}");
        assert!(lost.iter().all(|l| l["address"].as_str().unwrap().starts_with("127.0.0.1:")), "{served}");
        let listed: usize = lost.iter().map(|l| l["requests"].as_array().unwrap().len()).sum();
        assert_eq!(listed as u64, failed, "{served}");
    }
}

/// `kvflow launch` of a P/D graph over tcp: its driving process, with `run_flags`; launch's
/// stderr comes line by line to the returned receiver, and the pids it started to the map.
struct Launched {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    pids: std::collections::HashMap<String, u32>,
    log: String,
}

impl Launched {
    fn start(graph: &Path, run_flags: &[&str]) -> Launched {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvflow"))
            .args(["launch", &graph.to_string_lossy(), "--"])
            .args(run_flags)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = stderr_lines(&mut child, |_| {});
        Launched { child, lines, pids: Default::default(), log: String::new() }
    }

    /// Reads launch's output until both processes were started (their pids noted).
    fn until_started(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.pids.len() < 2 {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).unwrap_or_else(|_| panic!("not started: {}", self.log));
            if let Some((label, pid)) = line.strip_prefix("launch: started ").and_then(|r| r.split_once(" (pid ")) {
                self.pids.insert(label.to_string(), pid.trim_end_matches(')').parse().unwrap());
            }
            self.log.push_str(&(line + "\n"));
        }
    }

    /// Waits for launch to end within `limit`: its status and the whole of its output.
    fn end_within(mut self, limit: Duration) -> (ExitStatus, String) {
        let status = wait_within_or_kill(&mut self.child, limit)
            .unwrap_or_else(|| panic!("launch still runs after {limit:?}: {}", self.log));
        std::thread::sleep(Duration::from_millis(200)); // the rest of its output
        self.log.extend(self.lines.try_iter().map(|l| l + "\n"));
        (status, self.log)
    }
}

/// SIGTERM to `kvflow launch` reaches every process it started: the driving one drains and
/// writes its report, the decode process ends once its producer has closed, and launch exits
/// with the driving process's 143, all within 10 s, leaving no process running.
#[test]
fn sigterm_to_launch_drains_every_process_and_writes_the_report_within_10_s() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let graph =
        write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", OUTLASTING, "32 MiB", TCP_1P1D);
    let mut launched = Launched::start(&graph, &["--grace-period", "3"]);
    launched.until_started();
    std::thread::sleep(Duration::from_secs(3)); // requests in flight on both sides
    let pids = launched.pids.clone();
    let sent = Instant::now();
    signal(launched.child.id(), libc::SIGTERM);
    let (status, log) = launched.end_within(Duration::from_secs(30));
    let took = sent.elapsed();
    assert!(took < Duration::from_secs(10), "launch took {took:?} after SIGTERM: {log}");
    assert_eq!(status.code(), Some(143), "the driving process's status: {log}");
    for (label, pid) in &pids {
        assert!(!running(*pid), "the process of {label} (pid {pid}) still runs after launch ended: {log}");
    }
    assert!(log.contains("SIGTERM passed on to 2 process(es)"), "{log}");
    let r = report(dir.path());
    assert_eq!(r["interrupted"], true, "{r}");
    assert!(r["completed"].as_u64().unwrap() > 0, "{r}");
    assert!(r["accounting_errors"].as_array().unwrap().is_empty(), "{r}");
    assert!(records(dir.path()).iter().all(|l| l["id"].is_u64()));
    assert!(log.contains("[decode] decode pool `decode`: took"), "the decode process drained: {log}");
}

/// A process of launch killed by a signal is reported as such, not as "exit code 1".
#[test]
fn launch_reports_a_process_killed_by_a_signal_as_such() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    // (40 requests finished within the 2 s before the kill, once the CPU attention was faster)
    let graph =
        write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", OUTLASTING, "32 MiB", TCP_1P1D);
    let mut launched = Launched::start(&graph, &[]);
    launched.until_started();
    std::thread::sleep(Duration::from_secs(2));
    signal(launched.pids["decode"], libc::SIGKILL);
    let (status, log) = launched.end_within(Duration::from_secs(120));
    assert_eq!(status.code(), Some(2), "the driving process failed what the decode process owed: {log}");
    assert!(log.contains("launch: the process of decode ended: killed by signal 9 (SIGKILL)"), "{log}");
}

/// `kvflow serve` with a long stream in flight gets `signal`: the stream ends with `[DONE]`
/// (cancelled after the grace period of 2 s), the report is written, and it exits 0, within
/// 10 s.
fn serve_drains_on(signal_number: i32) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let served = Served::start(&one_llama_rank_to_serve(dir.path(), ""), &out, &["--grace-period", "2"]);
    let body = r#"{"prompt": [1, 2, 3], "max_tokens": 4000, "stream": true}"#;
    let mut reader = BufReader::new(served.send("POST", "/v1/completions", body));
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0, "the stream ended before its first token");
    }
    let sent = Instant::now();
    signal(served.pid(), signal_number);
    let mut rest = String::new();
    let _ = reader.read_to_string(&mut rest);
    let (code, stderr) = served.exits_within(Duration::from_secs(30)).expect("serve ends");
    let took = sent.elapsed();
    assert!(took < Duration::from_secs(10), "serve took {took:?} to drain");
    assert_eq!(code, Some(0), "{stderr}");
    let data: Vec<&str> = rest.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "the stream ends properly: {rest}");
    let r = report_in(&out);
    assert_eq!((r["requests"].as_u64(), r["interrupted"].as_bool()), (Some(1), Some(true)), "{r}");
}

#[test]
fn sigterm_drains_serve_and_writes_its_report_within_10_s() {
    let _one_at_a_time = HEAVY.lock();
    serve_drains_on(libc::SIGTERM);
}

/// SIGHUP (a closed terminal or ssh session) drains `serve` as SIGTERM does (it killed it at
/// once, cutting the stream without `[DONE]` and writing no report).
#[test]
fn sighup_drains_serve_like_sigterm() {
    let _one_at_a_time = HEAVY.lock();
    serve_drains_on(libc::SIGHUP);
}

/// SIGHUP to `kvflow run`: the grace period, the report, exit 129; under 10 s.
#[test]
fn sighup_drains_a_run_and_writes_its_report_within_10_s() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    // The head trace at trace speed (as operability's interrupt tests): requests arrive and
    // run for many seconds, so the signal finds the run busy however fast the machine is.
    let graph = crate::runtime::write_graph(
        dir.path(),
        "hf/llama",
        "mooncake_conversation_head.jsonl",
        "time_scale = 1.0",
        "64 MiB",
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .args(["run", &graph.to_string_lossy(), "--grace-period", "2", "--max-output-tokens", "2000"])
        .args(["--block-tokens", "128"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let sent = Instant::now();
    signal(child.id(), libc::SIGHUP);
    let (status, log) = end_within(&mut child, Duration::from_secs(30));
    let status = status.unwrap_or_else(|| panic!("still running 30 s after SIGHUP: {log}"));
    assert!(sent.elapsed() < Duration::from_secs(10), "{log}");
    assert_eq!(status.code(), Some(129), "128 + SIGHUP: {log}");
    assert!(log.contains("SIGHUP (terminal closed): no more requests"), "{log}");
    let r = report(dir.path());
    assert_eq!(r["interrupted"], true, "{r}");
}
