//! Pools across hosts. `kvflow launch` starts a graph's processes on this machine: a decode pool
//! reached over tcp in its own process, a pool that lists its hosts as one process each. Two
//! network namespaces stand in for two hosts (`ip netns` and a veth pair, which the test creates
//! and removes; without CAP_NET_ADMIN it skips, saying why): the prefill pool runs in one, the
//! decode pool in the other, the handoff crosses between them over tcp, and the outputs are
//! exact; when the decode host's process is killed, the requests it owed fail with a cause
//! naming it and nothing stays held on the prefill host. A pool spread over the two hosts
//! (`hosts`) runs exact with work on both, and when one host's process is killed the other fails
//! every request the pool held with a cause naming that process, and writes its report. A
//! prefill pool spread over the two hosts hands off from each to a decode pool in a process of its
//! own; losing the second host fails the requests it held or had handed off, naming it.

use crate::common::{first_line_after, kill_and_reap, records, report, stderr_lines};
use crate::processes::DECODE_LISTENING;
use crate::runtime::{write_graph_with, HEAVY};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const TCP_1P1D: &str = "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n\
    [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n\n\
    [[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"tcp\"\nendpoint = \"ENDPOINT\"\n";

/// `kvflow launch` of `pools` over `limit` requests with `--verify` in `dir`: it succeeds and
/// every request completes exactly. Returns launch's stderr.
fn launch_exact(dir: &std::path::Path, pools: &str, limit: u64) -> String {
    let workload = format!("mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = {limit}");
    let graph = write_graph_with(dir, "hf/llama", "mooncake_conversation_head.jsonl", &workload, "32 MiB", pools);
    let out: Output = Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .args(["launch", &graph.to_string_lossy(), "--", "--verify"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stderr}");
    let r = report(dir);
    assert_eq!((r["completed"].as_u64(), r["verify"]["mismatched"].as_u64()), (Some(limit), Some(0)), "{r}");
    stderr
}

/// `N` distinct loopback `host:port`s free now (all held while picked, so none repeats; a
/// process the test then starts binds its fixed port, never one the kernel picks, which could be
/// one of these).
fn free_ports<const N: usize>() -> [String; N] {
    let held: Vec<std::net::TcpListener> =
        (0..N).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    std::array::from_fn(|i| held[i].local_addr().unwrap().to_string())
}

#[test]
fn launch_starts_a_pd_graphs_processes_and_the_decode_pool_runs_in_its_own() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let stderr = launch_exact(dir.path(), &TCP_1P1D.replace("ENDPOINT", "127.0.0.1:0"), 10);
    let r = report(dir.path());
    // The decode work ran in the other process: the driving one took no handoff.
    assert_eq!(r["handoff"]["received"], 0, "{}", r["handoff"]);
    assert!(
        stderr.contains("[decode] decode pool `decode`: took 10 handoff(s); every block and slot is free"),
        "{stderr}"
    );
}

#[test]
fn launch_runs_a_pool_over_the_hosts_it_lists() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let [a, b] = free_ports();
    let pools = format!("[[pool]]\nname = \"main\"\nranks = 2\nrouter = \"round-robin\"\nhosts = [\"{a}\", \"{b}\"]\n");
    launch_exact(dir.path(), &pools, 8);
    // Rank 1 is process 1's only worker: requests served there ran in the other process.
    let on_rank_1 = records(dir.path()).iter().filter(|x| x["rank"] == 1).count();
    assert_eq!(on_rank_1, 4, "round robin over two ranks in two processes");
}

/// Two network namespaces joined by a veth pair, removed on drop.
pub struct TwoHosts {
    pub names: [String; 2],
    pub addresses: [String; 2],
}

impl TwoHosts {
    /// `None` (with the reason) where this machine does not let the test create them.
    fn create() -> Result<TwoHosts, String> {
        static CREATED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = CREATED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let tag = (std::process::id() % 1000) * 10 + n % 10;
        let names = [format!("kvf{tag}a"), format!("kvf{tag}b")];
        let subnet = 10 + (tag % 200);
        let addresses = [format!("10.213.{subnet}.1"), format!("10.213.{subnet}.2")];
        let hosts = TwoHosts { names: names.clone(), addresses };
        let (veth_a, veth_b) = (format!("kv{tag}va"), format!("kv{tag}vb"));
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), names[0].clone()],
            vec!["netns".into(), "add".into(), names[1].clone()],
            vec![
                "link".into(),
                "add".into(),
                veth_a.clone(),
                "netns".into(),
                names[0].clone(),
                "type".into(),
                "veth".into(),
                "peer".into(),
                "name".into(),
                veth_b.clone(),
                "netns".into(),
                names[1].clone(),
            ],
        ];
        for args in steps {
            ip(&args)?;
        }
        for (i, veth) in [veth_a, veth_b].iter().enumerate() {
            let ns = &hosts.names[i];
            ip(&[
                "-n".into(),
                ns.clone(),
                "addr".into(),
                "add".into(),
                format!("{}/24", hosts.addresses[i]),
                "dev".into(),
                veth.clone(),
            ])?;
            ip(&["-n".into(), ns.clone(), "link".into(), "set".into(), veth.clone(), "up".into()])?;
            ip(&["-n".into(), ns.clone(), "link".into(), "set".into(), "lo".into(), "up".into()])?;
        }
        Ok(hosts)
    }

    /// The two hosts, or `None` after saying why this machine cannot make them.
    pub fn create_or_skip() -> Option<TwoHosts> {
        TwoHosts::create()
            .map_err(|why| println!("skipped: cannot create network namespaces here (needs CAP_NET_ADMIN): {why}"))
            .ok()
    }

    /// `kvflow ARGS` run inside namespace `host`.
    pub fn kvflow(&self, host: usize, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.names[host], env!("CARGO_BIN_EXE_kvflow")]).args(args);
        c
    }

    /// Process `process` of spread pool `pool`, on host `process`, its stderr piped.
    fn start_process(&self, graph: &std::path::Path, pool: &str, process: usize, verify: bool) -> std::process::Child {
        let g = graph.to_string_lossy().to_string();
        let index = process.to_string();
        let mut args = vec!["run", g.as_str(), "--pools", pool, "--process", index.as_str()];
        if verify {
            args.push("--verify");
        }
        self.kvflow(process, &args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

fn ip(args: &[String]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// The decode pool's process on `host`, once it listens, and a receiver of its later stderr
/// lines.
fn start_decode_on(
    hosts: &TwoHosts,
    host: usize,
    graph: &std::path::Path,
    stall_timeout: &str,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    let mut child = hosts
        .kvflow(host, &["run", &graph.to_string_lossy(), "--pools", "decode", "--stall-timeout", stall_timeout])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = stderr_lines(&mut child, |line| eprintln!("[decode host] {line}"));
    let address = first_line_after(&lines, DECODE_LISTENING, Duration::from_secs(60)).unwrap_or_else(|| {
        kill_and_reap(&mut child);
        panic!("the decode host's process never listened")
    });
    assert!(address.contains(&hosts.addresses[host]), "it listens on host {host}'s address: {address}");
    (child, lines)
}

/// The decode pool's process on host 1, once it listens.
fn start_decode(hosts: &TwoHosts, graph: &std::path::Path) -> std::process::Child {
    start_decode_on(hosts, 1, graph, "30").0
}

#[test]
fn a_pd_graph_across_two_network_namespaces_hands_off_over_tcp_and_survives_losing_a_host() {
    let _one_at_a_time = HEAVY.lock();
    let Some(hosts) = TwoHosts::create_or_skip() else { return };
    let endpoint = format!("{}:7461", hosts.addresses[1]);
    let pools = TCP_1P1D.replace("ENDPOINT", &endpoint);

    // Whole run: exact, and the decode work crossed to the other host.
    let dir = tempfile::tempdir().unwrap();
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 10";
    let graph =
        write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools);
    let mut decode = start_decode(&hosts, &graph);
    let out = hosts.kvflow(0, &["run", &graph.to_string_lossy(), "--pools", "prefill", "--verify"]).output().unwrap();
    let decode_status = decode.wait().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(decode_status.success());
    let r = report(dir.path());
    assert_eq!((r["completed"].as_u64(), r["verify"]["mismatched"].as_u64()), (Some(10), Some(0)), "{r}");
    let h = &r["handoff"];
    assert_eq!(h["count"], 10, "{h}");
    assert_eq!(h["received"], 0, "the decode pool ran on the other host: {h}");
    assert!(h["socket_bytes"].as_u64().unwrap() >= h["bytes"].as_u64().unwrap(), "{h}");

    // The decode host's process is killed mid-run.
    let dir = tempfile::tempdir().unwrap();
    let workload = "mode = \"timestamps\"\ntime_scale = 0.6\nwarmup = 0\nlimit = 30";
    let graph =
        write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools);
    let mut decode = start_decode(&hosts, &graph);
    let started = Instant::now();
    let producer = hosts
        .kvflow(0, &["run", &graph.to_string_lossy(), "--pools", "prefill", "--verify"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    crate::processes::kill_midway(&mut decode, producer, Duration::from_millis(1500));
    assert!(started.elapsed() < Duration::from_secs(120), "no wait for a timeout");
    crate::processes::assert_lost_peer(dir.path(), 30, "handoff", "decode pool decode");
}

#[test]
fn a_pool_spread_over_two_network_namespaces_runs_exact_and_names_the_process_it_loses() {
    let _one_at_a_time = HEAVY.lock();
    let Some(hosts) = TwoHosts::create_or_skip() else { return };
    let pools = format!(
        "[[pool]]\nname = \"main\"\nranks = 2\nrouter = \"round-robin\"\nhosts = [\"{}:7471\", \"{}:7471\"]\n",
        hosts.addresses[0], hosts.addresses[1]
    );
    let start = |graph: &std::path::Path, host: usize, verify: bool| hosts.start_process(graph, "main", host, verify);

    let dir = tempfile::tempdir().unwrap();
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 8";
    let graph =
        write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools);
    let other = start(&graph, 1, false);
    let driver = start(&graph, 0, true).wait_with_output().unwrap();
    let other = other.wait_with_output().unwrap();
    assert!(driver.status.success(), "{}", String::from_utf8_lossy(&driver.stderr));
    assert!(other.status.success(), "{}", String::from_utf8_lossy(&other.stderr));
    let r = report(dir.path());
    assert_eq!((r["completed"].as_u64(), r["verify"]["mismatched"].as_u64()), (Some(8), Some(0)), "{r}");
    let on_rank_1 = records(dir.path()).iter().filter(|x| x["rank"] == 1).count();
    assert_eq!(on_rank_1, 4, "rank 1 (the other host's worker) served its share");
    let tokens: Vec<u64> =
        r["rank_stats"].as_array().unwrap().iter().map(|s| s["forward_tokens"].as_u64().unwrap()).collect();
    assert!(tokens.len() == 2 && tokens[1] > 0, "both hosts' ranks are in the report: {tokens:?}");

    // Router kv-aware over the two hosts: rank 1's cache events cross to the index on host 0.
    let dir = tempfile::tempdir().unwrap();
    let aware = pools.replace("round-robin", "kv-aware");
    let graph =
        write_graph_with(dir.path(), "hf/llama", "mooncake_synthetic_tail500.jsonl", workload, "32 MiB", &aware);
    let other = start(&graph, 1, false);
    let driver = start(&graph, 0, true).wait_with_output().unwrap();
    assert!(other.wait_with_output().unwrap().status.success());
    assert!(driver.status.success(), "{}", String::from_utf8_lossy(&driver.stderr));
    let r = report(dir.path());
    assert_eq!(r["verify"]["mismatched"], 0, "{r}");
    let index = &r["routing_index"]["main"];
    assert!(index["last_event_by_rank"]["1"].as_u64().unwrap_or(0) > 0, "host 1's events reached the index: {index}");

    // Host 1's process is killed mid-run.
    let dir = tempfile::tempdir().unwrap();
    let workload = "mode = \"timestamps\"\ntime_scale = 0.6\nwarmup = 0\nlimit = 30";
    let graph =
        write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools);
    let mut other = start(&graph, 1, false);
    let started = Instant::now();
    let driver = start(&graph, 0, true);
    let stderr = crate::processes::kill_midway(&mut other, driver, Duration::from_millis(2500));
    assert!(started.elapsed() < Duration::from_secs(60), "no wait for the stall watchdog");
    assert!(!stderr.contains("panicked"), "a lost peer is a named error, not a panic: {stderr}");
    let named = format!("process 1 ({}:7471) is gone", hosts.addresses[1]);
    crate::processes::assert_lost_peer(dir.path(), 30, "process-lost", &named);
}

#[test]
fn launch_runs_a_prefill_pool_over_two_processes_beside_its_decode_pool() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let [a, b, decode] = free_ports();
    let stderr = launch_exact(dir.path(), &spread_prefill(&a, &b, &decode), 8);
    let r = report(dir.path());
    // Half the prefills ran in process 1, whose own links handed them off and relayed their
    // decode events (Received and Finished) back through its rank.
    let from_rank_1 = records(dir.path()).iter().filter(|x| x["prefill_rank"] == 1).count();
    assert_eq!(from_rank_1, 4, "round robin over two prefill ranks in two processes");
    assert!(stderr.contains("[prefill/1] process 1: handed off 4 request(s) over its own links and relayed 8 event(s)"));
    // Process 1's ranks and links are in the report: they crossed to process 0 when the pool ended.
    let h = &r["handoff"];
    assert_eq!(h["count"], 8, "{h}");
    assert!(h["socket_bytes"].as_u64().unwrap() >= h["bytes"].as_u64().unwrap(), "{h}");
    let rank_1 = r["rank_stats"].as_array().unwrap().iter().find(|s| s["pool"] == "prefill" && s["rank"] == 1).cloned();
    let rank_1 = rank_1.expect("rank 1 of the prefill pool is in rank_stats");
    assert_eq!((rank_1["handoffs_out"].as_u64(), rank_1["relayed_events"].as_u64()), (Some(4), Some(8)), "{rank_1}");
    assert!(stderr.contains("[decode] decode pool `decode`: took 8 handoff(s); every block and slot is free"));
}

/// A prefill pool of two ranks over processes at `a` and `b` (round robin), and a decode pool
/// listening on `decode` in a process of its own.
fn spread_prefill(a: &str, b: &str, decode: &str) -> String {
    format!(
        "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 2\nrouter = \"round-robin\"\n\
         hosts = [\"{a}\", \"{b}\"]\n\n\
         [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n\n\
         [[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"tcp\"\nendpoint = \"{decode}\"\n"
    )
}

#[test]
fn a_prefill_pool_over_two_network_namespaces_hands_off_from_each_and_names_the_process_it_loses() {
    let _one_at_a_time = HEAVY.lock();
    let Some(hosts) = TwoHosts::create_or_skip() else { return };
    // Host 0: prefill process 0 (driving) and the decode pool; host 1: prefill process 1, whose
    // handoffs and relayed events cross the veth pair.
    let (a, b) = (&hosts.addresses[0], &hosts.addresses[1]);
    let pools = spread_prefill(&format!("{a}:7481"), &format!("{b}:7481"), &format!("{a}:7462"));
    let start =
        |graph: &std::path::Path, process: usize, verify: bool| hosts.start_process(graph, "prefill", process, verify);

    let dir = tempfile::tempdir().unwrap();
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 10";
    let graph =
        write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools);
    let (mut decode, decode_lines) = start_decode_on(&hosts, 0, &graph, "30");
    let other = start(&graph, 1, false);
    let driver = start(&graph, 0, true).wait_with_output().unwrap();
    let other = other.wait_with_output().unwrap();
    assert!(decode.wait().unwrap().success());
    let other_stderr = String::from_utf8_lossy(&other.stderr);
    assert!(driver.status.success(), "{}", String::from_utf8_lossy(&driver.stderr));
    assert!(other.status.success(), "{other_stderr}");
    let r = report(dir.path());
    assert_eq!((r["completed"].as_u64(), r["verify"]["mismatched"].as_u64()), (Some(10), Some(0)), "{r}");
    let from_host_1 = records(dir.path()).iter().filter(|x| x["prefill_rank"] == 1).count();
    assert_eq!(from_host_1, 5, "host 1's rank prefilled its share");
    let h = &r["handoff"];
    assert_eq!(h["count"], 10, "{h}");
    assert!(h["socket_bytes"].as_u64().unwrap() >= h["bytes"].as_u64().unwrap(), "both hosts' links: {h}");
    assert!(other_stderr.contains("process 1: handed off 5 request(s) over its own links"), "{other_stderr}");
    let took: Vec<String> = decode_lines.try_iter().filter(|l| l.contains("took")).collect();
    assert_eq!(took, ["decode pool `decode`: took 10 handoff(s); every block and slot is free"]);

    // Host 1's process is killed mid-run: its requests fail naming it, including those it had
    // handed off (their events came back through it); the decode pool counts its links lost,
    // cancels what it held of them, frees it and exits 2.
    let dir = tempfile::tempdir().unwrap();
    let workload = "mode = \"timestamps\"\ntime_scale = 0.6\nwarmup = 0\nlimit = 30";
    let graph =
        write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools);
    let (mut decode, decode_lines) = start_decode_on(&hosts, 0, &graph, "3");
    let mut other = start(&graph, 1, false);
    let started = Instant::now();
    let driver = start(&graph, 0, true);
    let stderr = crate::processes::kill_midway(&mut other, driver, Duration::from_millis(2500));
    assert!(started.elapsed() < Duration::from_secs(60), "no wait for the stall watchdog");
    assert!(!stderr.contains("panicked"), "{stderr}");
    // The decode side lost a producer: exit 2, the producer named by its address on host 1.
    assert_eq!(decode.wait().unwrap().code(), Some(2));
    let named = format!("process 1 ({b}:7481) is gone");
    crate::processes::assert_lost_peer(dir.path(), 30, "process-lost", &named);
    let lines: Vec<String> = decode_lines.try_iter().collect();
    assert!(
        lines.iter().any(|l| l.contains(&format!("the producer link from {b}:")) && l.contains("is lost")),
        "{lines:?}"
    );
    assert!(lines.iter().any(|l| l.contains("every block and slot is free")), "{lines:?}");
}
