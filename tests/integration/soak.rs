//! Soak: a server (`kvflow serve`) and a trace replay (`kvflow run`) that serve many requests hold
//! what is in flight, not what they served. Each serves a warm-up, then N more requests at
//! concurrency 16, and the process's resident memory (`/proc/PID/status` VmRSS) and open file
//! descriptors (`/proc/PID/fd`) are read after the warm-up and at the end: the memory may grow by
//! at most [`RSS_GROWTH_BOUND_KB`] and the descriptors not at all, with no request failing.
//!
//! The bound detects the leaks this replaced — every request's record kept until the run ended,
//! and one prefix-cache index entry per distinct prompt block ever served — at the CI size of
//! 1,500 requests: before, the server grew by 3.9 MB over them and the replay by about 2.7 KB a
//! request (benches/results/2026-12-04-soak.txt). The router's prefix affinity
//! (`LeastOutstanding`) then still grew, about 0.45 KB a request in the replay, whose prompts
//! share no block; it is now sized to the pool's KV blocks (here its floor, 4096 hashes), and a
//! rank's per-step figures are kept in memory of a fixed size (`rank::step_summary`).
//! `KVFLOW_SOAK_REQUESTS=3000` runs the longer measurement.
//!
//! Both runs use the tiny llama fixture with a 4 MiB KV budget, which the warm-up's distinct
//! prompts cycle through entirely, so the KV pool's pages are all touched before the first reading.

use crate::common::{fixture, repo, report_in, Served};
use crate::runtime::HEAVY;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How much the resident memory may grow between the warm-up's end and the last request's.
const RSS_GROWTH_BOUND_KB: u64 = 1536;
const CONCURRENCY: usize = 16;
const PROMPT_TOKENS: usize = 128;
const OUTPUT_TOKENS: usize = 4;

/// Requests after the warm-up: `KVFLOW_SOAK_REQUESTS`, else 1,500 (about 30 s in CI).
fn requests() -> usize {
    std::env::var("KVFLOW_SOAK_REQUESTS").ok().and_then(|n| n.parse().ok()).unwrap_or(1500)
}

const WARMUP: usize = 300;

/// A field of `/proc/PID/status` in kB (`None` once the process has exited).
fn status_kb(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The server's memory and open descriptors once the connections of the last load have closed
/// (the server closes each after its answer, a moment after the client has read it).
fn settled_reading(pid: u32) -> (u64, usize) {
    std::thread::sleep(Duration::from_millis(500));
    (status_kb(pid, "VmRSS").expect("the server runs"), open_fds(pid).expect("the server runs"))
}

/// How many descriptors the process has open (`None` once it has exited).
fn open_fds(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

/// A distinct prompt for request `n`: no two share a block, so the prefix cache keeps taking
/// fresh blocks and evicting old ones.
fn prompt(n: usize) -> Vec<u32> {
    (0..PROMPT_TOKENS).map(|i| 3 + ((n * 131 + i * 7 + n / 97) % 250) as u32).collect()
}

/// Sends requests `first..first + count` at [`CONCURRENCY`], each on its own connection;
/// returns the answers that were not 200, with their status and body.
fn load(served: &Served, first: usize, count: usize) -> Vec<(usize, u16, String)> {
    let next = AtomicUsize::new(first);
    let failed = parking_lot::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..CONCURRENCY {
            scope.spawn(|| loop {
                let n = next.fetch_add(1, Ordering::SeqCst);
                if n >= first + count {
                    break;
                }
                let body = serde_json::json!({"prompt": prompt(n), "max_tokens": OUTPUT_TOKENS});
                let (status, text) = served.request("POST", "/v1/completions", &body.to_string());
                if status != 200 {
                    failed.lock().push((n, status, text));
                }
            });
        }
    });
    failed.into_inner()
}

/// The tiny llama fixture on one CPU rank, with a KV budget the warm-up fills.
fn graph_head() -> String {
    format!(
        "[model]\npath = \"{}\"\n\n[memory]\nbudget_bytes = \"4 MiB\"\n\n[scheduler]\nmax_running = {CONCURRENCY}\n\n\
         [[pool]]\nname = \"main\"\nrole = \"aggregated\"\nranks = 1\nexecutor = \"cpu\"\n",
        fixture("hf/llama").display()
    )
}

#[test]
fn a_server_holds_what_is_in_flight_not_what_it_served() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let graph = dir.path().join("soak.toml");
    std::fs::write(&graph, graph_head() + "\n[serve]\nmax_requests = 64\nmax_context = 512\n").unwrap();
    let out = dir.path().join("out");
    let served = Served::start(&graph, &out, &[]);
    let pid = served.pid();
    let n = requests();
    let warm = load(&served, 0, WARMUP);
    assert!(warm.is_empty(), "warm-up failures: {warm:?}");
    let (rss_before, fds_before) = settled_reading(pid);
    let started = Instant::now();
    let failed = load(&served, WARMUP, n);
    let took = started.elapsed();
    let (rss_after, fds_after) = settled_reading(pid);
    let (code, stderr) = served.stop();
    println!(
        "soak serve: {n} requests after a warm-up of {WARMUP}, concurrency {CONCURRENCY}, in {:.1} s: \
         VmRSS {rss_before} -> {rss_after} kB ({:+} kB), open fds {fds_before} -> {fds_after}, errors {}",
        took.as_secs_f64(),
        rss_after as i64 - rss_before as i64,
        failed.len()
    );
    assert!(failed.is_empty(), "{} requests failed, the first: {:?}", failed.len(), &failed[..1]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(fds_after, fds_before, "open file descriptors changed");
    assert!(
        rss_after <= rss_before + RSS_GROWTH_BOUND_KB,
        "VmRSS grew {} kB over {n} requests (bound {RSS_GROWTH_BOUND_KB} kB)",
        rss_after - rss_before
    );
    let report = report_in(&out);
    assert_eq!(report["completed"].as_u64(), Some((WARMUP + n) as u64), "{report}");
    let lines = std::fs::read_to_string(out.join("requests.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), WARMUP + n, "every request's line, written as it ended");
}

/// A Mooncake trace of `count` requests, none sharing a block with another.
fn write_trace(path: &Path, count: usize) {
    let blocks = PROMPT_TOKENS / 16;
    let lines: Vec<String> = (0..count)
        .map(|i| {
            let ids: Vec<usize> = (i * blocks..(i + 1) * blocks).collect();
            let input = PROMPT_TOKENS * 512 / 16;
            let output = OUTPUT_TOKENS * 512 / 16;
            format!(
                "{{\"timestamp\": {i}, \"input_length\": {input}, \"output_length\": {output}, \"hash_ids\": {ids:?}}}"
            )
        })
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

#[test]
fn a_trace_replay_holds_what_is_in_flight_not_what_it_served() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let n = requests();
    let trace = dir.path().join("long.jsonl");
    write_trace(&trace, WARMUP + n);
    let graph = dir.path().join("replay.toml");
    let workload = format!(
        "\n[workload]\ntrace = \"{}\"\nformat = \"mooncake\"\nmode = \"concurrency\"\nconcurrency = {CONCURRENCY}\n\
         warmup = {WARMUP}\nblock_tokens = 16\nseed = 1\n",
        trace.display()
    );
    std::fs::write(&graph, graph_head() + &workload).unwrap();
    let out = dir.path().join("out");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .current_dir(repo())
        .args(["run", graph.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    // requests.jsonl grows as requests end: it says how far the run is (to within its buffer).
    let ended = || std::fs::read(out.join("requests.jsonl")).map_or(0, |b| b.iter().filter(|&&c| c == b'\n').count());
    let deadline = Instant::now() + Duration::from_secs(600);
    // (VmRSS, open fds, requests ended) every 20 ms while it runs.
    let mut readings = Vec::new();
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the replay did not end within 600 s");
        let done = ended();
        let (Some(rss), Some(fds)) = (status_kb(pid, "VmRSS"), open_fds(pid)) else { break }; // it has exited
        readings.push((rss, fds, done));
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{stderr}");
    // A step's buffers come and go, so each end of the run is read as the least VmRSS over a
    // window of readings: the tenth of the requests after the warm-up, and the tenth before the
    // last ones (still being served). A leak raises that floor; a buffer in use does not.
    let window = |from: usize, to: usize| -> Vec<(u64, usize, usize)> {
        readings.iter().copied().filter(|&(_, _, done)| done >= from && done < to).collect()
    };
    let early = window(WARMUP, WARMUP + n / 10);
    let late = window(WARMUP + n - n / 10 - CONCURRENCY, WARMUP + n - CONCURRENCY);
    assert!(!early.is_empty() && !late.is_empty(), "requests.jsonl grew while the replay ran: {readings:?}");
    let floor = |w: &[(u64, usize, usize)]| w.iter().map(|r| r.0).min().unwrap();
    let (rss_before, rss_after) = (floor(&early), floor(&late));
    let (fds_before, fds_after) = (early[early.len() - 1].1, late[late.len() - 1].1);
    println!(
        "soak replay: {} requests ({WARMUP} warm-up), concurrency {CONCURRENCY}: least VmRSS over requests \
         {WARMUP}..{} ended {rss_before} kB, over {}..{} ended {rss_after} kB ({:+} kB); open fds {fds_before} -> \
         {fds_after}",
        WARMUP + n,
        WARMUP + n / 10,
        WARMUP + n - n / 10 - CONCURRENCY,
        WARMUP + n - CONCURRENCY,
        rss_after as i64 - rss_before as i64
    );
    assert_eq!(fds_after, fds_before, "open file descriptors changed");
    assert!(
        rss_after <= rss_before + RSS_GROWTH_BOUND_KB,
        "VmRSS grew {} kB over {} requests (bound {RSS_GROWTH_BOUND_KB} kB)",
        rss_after - rss_before,
        n - n / 10
    );
    let report = report_in(&out);
    assert_eq!((report["requests"].as_u64(), report["completed"].as_u64()), (Some(n as u64), Some(n as u64)));
}
