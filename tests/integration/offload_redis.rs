//! The shared offload tier on a real Redis (`[offload] store = "redis"`), started by each test on
//! loopback (`LocalRedis`; skipped, saying so, only where redis-server is not installed): every
//! family exact with it on one pool and on 1P1D, a second process loading what the first saved,
//! namespaces kept apart by the model's config, and a store restarted, killed or slower than the
//! save rate mid-run — the run always finishes exact, with every block back and each fault counted.
//! Across two hosts (network namespaces, as `hosts.rs` makes them), a prompt prefilled on one is
//! loaded on the other from the store on the first.
//! The store's own guarantees (torn writes, leases, restarts, timeouts) are tested beside it in
//! kvflow-operators (`offload::redis_store::tests`).

use crate::common::{kvflow, FIXTURES};
use crate::hosts::TwoHosts;
use crate::runtime::{assert_exact, run_graph, write_graph_with, HEAVY};
use kvflow::graph::Overrides;
use kvflow_operators::offload::LocalRedis;
use kvflow_operators::rank::TestSwitches;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A multiple of the recurrent families' snapshot interval (4 blocks of 16).
const CHUNK: usize = 64;

const ONE_POOL: &str = "[[pool]]\nname = \"main\"\nranks = 2\n";
const ONE_P_ONE_D: &str = "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n\
                           [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n\n\
                           [[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"inproc\"\n";

/// A graph of `pools` over `model` whose offload tier is the Redis at `url`.
fn redis_graph(dir: &Path, model: &str, pools: &str, url: &str, workload: &str, extra: &str) -> PathBuf {
    let pools = format!("{pools}\n[offload]\nstore = \"redis\"\nurl = \"{url}\"\nchunk_tokens = {CHUNK}\n{extra}");
    write_graph_with(dir, model, "mooncake_conversation_head.jsonl", workload, "16 MiB", &pools)
}

/// `kvflow run graph --verify` in a process of its own; its report.
fn run_process(graph: &Path) -> Value {
    report_after(graph, kvflow(&["run", &graph.to_string_lossy(), "--verify"]))
}

/// The report of `graph`'s run, which ended with `out`.
fn report_after(graph: &Path, out: std::process::Output) -> Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(graph.parent().unwrap().join("out/report.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn offload_of<'a>(report: &'a Value, pool: Option<&str>) -> &'a Value {
    match pool {
        Some(p) => &report["pools"][p]["offload"],
        None => &report["offload"],
    }
}

#[test]
fn every_family_is_exact_over_redis_and_a_second_process_loads_what_the_first_saved() {
    let Some(server) = LocalRedis::start_or_skip(&[]) else { return };
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nlimit = 8";
    for (pools, saver) in [(ONE_POOL, None), (ONE_P_ONE_D, Some("prefill"))] {
        for model in FIXTURES {
            let what = format!("{model} on {}", saver.map_or("one pool", |_| "1P1D"));
            server.flush();
            let dir = tempfile::tempdir().unwrap();
            let graph = redis_graph(dir.path(), model, pools, &server.url(), workload, "");
            let first = run_graph(&graph, Overrides::default(), TestSwitches::default());
            assert_exact(&first, &what);
            let o = offload_of(&first, saver);
            assert!(o["saved_chunks"].as_u64().unwrap() > 0, "{what}: {o}");
            // Another process, its KV memory empty, its index of the store read from the log.
            let second = run_process(&graph);
            assert_exact(&second, &format!("{what}, second process"));
            let o = offload_of(&second, saver);
            assert!(o["offload_hit_tokens"].as_u64().unwrap() >= CHUNK as u64, "{what}: {o}");
            assert_eq!(o["failed_loads"], 0, "{what}: {o}");
            assert_eq!(second["accounting_errors"].as_array().unwrap().len(), 0, "{what}");
            assert_eq!(second["offload"]["store_faults"]["missing"], 0, "{what}: {}", second["offload"]);
        }
    }
}

#[test]
fn a_prompt_prefilled_on_one_host_is_loaded_on_another_from_the_store_they_share() {
    let _one_at_a_time = HEAVY.lock();
    let Some(hosts) = TwoHosts::create_or_skip() else { return };
    // The store runs on host A, listening on its address with a password (a server reachable
    // from other hosts needs one: without it Redis answers only loopback); host B reaches it over
    // the veth.
    let launcher = ["ip", "netns", "exec", hosts.names[0].as_str()];
    let Some(server) = LocalRedis::start_on_or_skip(&launcher, &hosts.addresses[0], &["--requirepass", "kv-hosts"])
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nlimit = 8";
    let extra = "password_env = \"KVFLOW_TEST_REDIS_PASSWORD\"\n";
    let graph = redis_graph(dir.path(), "hf/llama", ONE_POOL, &server.url(), workload, extra);
    let run_on = |host: usize| {
        let mut run = hosts.kvflow(host, &["run", &graph.to_string_lossy(), "--verify"]);
        let out = run.env("KVFLOW_TEST_REDIS_PASSWORD", "kv-hosts").output().unwrap();
        report_after(&graph, out)
    };
    let a = run_on(0);
    assert_exact(&a, "host A");
    assert!(a["offload"]["saved_chunks"].as_u64().unwrap() > 0, "{}", a["offload"]);
    let b = run_on(1);
    assert_exact(&b, "host B");
    let o = &b["offload"];
    assert!(o["offload_hit_tokens"].as_u64().unwrap() >= CHUNK as u64, "host B loaded what host A prefilled: {o}");
    assert_eq!((o["failed_loads"].as_u64(), o["store_faults"]["missing"].as_u64()), (Some(0), Some(0)), "{o}");
}

#[test]
fn graphs_whose_models_differ_only_in_rope_scaling_never_read_each_others_chunks() {
    let Some(server) = LocalRedis::start_or_skip(&[]) else { return };
    let dir = tempfile::tempdir().unwrap();
    // The llama fixture again, with linear RoPE scaling: the same weights, other keys.
    let scaled = dir.path().join("llama-rope-linear-2");
    std::fs::create_dir_all(&scaled).unwrap();
    let fixture = crate::common::repo().join("fixtures/hf/llama");
    std::fs::copy(fixture.join("model.safetensors"), scaled.join("model.safetensors")).unwrap();
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap()).unwrap();
    config["rope_parameters"] = serde_json::json!({"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0});
    std::fs::write(scaled.join("config.json"), config.to_string()).unwrap();
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nlimit = 8";
    let plain_dir = dir.path().join("plain");
    std::fs::create_dir_all(&plain_dir).unwrap();
    let plain = redis_graph(&plain_dir, "hf/llama", ONE_POOL, &server.url(), workload, "");
    let first = run_graph(&plain, Overrides::default(), TestSwitches::default());
    assert_exact(&first, "plain rope");
    assert!(first["offload"]["saved_chunks"].as_u64().unwrap() > 0);
    let scaled_dir = dir.path().join("scaled");
    std::fs::create_dir_all(&scaled_dir).unwrap();
    // (an absolute model path is used as it is)
    let other = redis_graph(&scaled_dir, &scaled.to_string_lossy(), ONE_POOL, &server.url(), workload, "");
    let scaled_run = run_graph(&other, Overrides::default(), TestSwitches::default());
    assert_exact(&scaled_run, "linear rope");
    assert_eq!(scaled_run["offload"]["offload_hit_tokens"], 0, "{}", scaled_run["offload"]);
    assert_eq!(scaled_run["offload"]["loads"], 0, "the other namespace is not even looked up");
    let again = run_graph(&plain, Overrides::default(), TestSwitches::default());
    assert_exact(&again, "plain rope again");
    assert!(again["offload"]["offload_hit_tokens"].as_u64().unwrap() > 0, "{}", again["offload"]);
}

/// A Mooncake trace of `n` requests `gap_ms` apart, sharing their first 4 of 6 hash ids.
fn spread_trace(dir: &Path, n: u64, gap_ms: u64) -> PathBuf {
    let lines: Vec<String> = (0..n)
        .map(|i| {
            format!(
                "{{\"timestamp\": {}, \"input_length\": 3072, \"output_length\": 100, \"hash_ids\": [1, 2, 3, 4, {}, {}]}}",
                i * gap_ms,
                100 + 2 * i,
                101 + 2 * i
            )
        })
        .collect();
    let path = dir.join("trace.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// Runs a graph of requests spread over about 2.4 s against a store that `disturb` acts on once
/// it holds a few chunks; the run's report.
fn run_disturbed(server: &mut LocalRedis, disturb: impl FnOnce(&mut LocalRedis) + Send) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let trace = spread_trace(dir.path(), 16, 150);
    let pools = format!(
        "[[pool]]\nname = \"main\"\nranks = 1\n\n[offload]\nstore = \"redis\"\nurl = \"{}\"\nchunk_tokens = 32\n\
         timeout_ms = 300\n",
        server.url()
    );
    let workload = "mode = \"timestamps\"\ntime_scale = 1.0";
    let graph = write_graph_with(dir.path(), "hf/llama", &trace.to_string_lossy(), workload, "8 MiB", &pools);
    std::thread::scope(|s| {
        s.spawn(|| {
            let started = std::time::Instant::now();
            // (each chunk is two keys, beside the log and the epoch token)
            while server.keys() < 8 && started.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(10));
            }
            disturb(server);
        });
        run_graph(&graph, Overrides::default(), TestSwitches::default())
    })
}

#[test]
fn a_store_restarted_mid_run_is_trusted_for_nothing_and_the_run_finishes_exact() {
    let Some(mut server) = LocalRedis::start_or_skip(&[]) else { return };
    let report = run_disturbed(&mut server, |s| s.restart().unwrap());
    assert_exact(&report, "restarted store");
    assert_eq!(report["accounting_errors"].as_array().unwrap().len(), 0);
    let o = &report["offload"];
    assert!(o["store_faults"]["restarts"].as_u64().unwrap() >= 1, "{o}");
    assert!(o["saved_chunks"].as_u64().unwrap() > 0, "{o}");
}

#[test]
fn a_store_killed_mid_run_drops_saves_and_the_run_finishes_exact_counting_them() {
    let Some(mut server) = LocalRedis::start_or_skip(&[]) else { return };
    let report = run_disturbed(&mut server, |s| s.kill());
    assert_exact(&report, "killed store");
    assert_eq!(report["accounting_errors"].as_array().unwrap().len(), 0);
    let o = &report["offload"];
    assert!(o["saved_chunks"].as_u64().unwrap() > 0, "saves before the kill: {o}");
    assert!(o["dropped_saves"].as_u64().unwrap() > 0, "saves after it are dropped: {o}");
    assert!(o["store_faults"]["down"].as_u64().unwrap() >= 1, "and counted as the store being down: {o}");
}

#[test]
fn saves_beyond_max_pending_saves_are_dropped_and_counted() {
    let Some(server) = LocalRedis::start_or_skip(&[]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let workload = "mode = \"concurrency\"\nconcurrency = 8\nlimit = 16";
    let graph = redis_graph(dir.path(), "hf/llama", ONE_POOL, &server.url(), workload, "max_pending_saves = 1\n");
    let slow = TestSwitches { slow_saves_ms: 50, ..Default::default() };
    let report = run_graph(&graph, Overrides::default(), slow);
    assert_exact(&report, "one pending save");
    assert_eq!(report["accounting_errors"].as_array().unwrap().len(), 0);
    let o = &report["offload"];
    assert!(o["pending_limit_saves"].as_u64().unwrap() > 0, "{o}");
    assert!(o["saved_chunks"].as_u64().unwrap() > 0, "{o}");
    // The same run without the bound saves every chunk it completes.
    let unbounded = redis_graph(dir.path(), "hf/llama", ONE_POOL, &server.url(), workload, "");
    let report = run_graph(&unbounded, Overrides::default(), TestSwitches { slow_saves_ms: 50, ..Default::default() });
    assert_eq!(report["offload"]["pending_limit_saves"], 0, "{}", report["offload"]);
}

#[test]
fn a_password_comes_from_the_variable_the_graph_names_and_a_wrong_one_is_refused_before_serving() {
    let Some(server) = LocalRedis::start_or_skip(&["--requirepass", "kv-secret"]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nlimit = 6";
    let extra = "password_env = \"KVFLOW_TEST_REDIS_PASSWORD\"\n";
    let graph = redis_graph(dir.path(), "hf/llama", ONE_POOL, &server.url(), workload, extra);
    let run = |password: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvflow"));
        cmd.args(["run", &graph.to_string_lossy(), "--verify"]).env_remove("KVFLOW_TEST_REDIS_PASSWORD");
        if let Some(p) = password {
            cmd.env("KVFLOW_TEST_REDIS_PASSWORD", p);
        }
        cmd.output().unwrap()
    };
    let out = run(None);
    let stderr = crate::common::assert_clean_failure(&out, &["offload.password_env", "KVFLOW_TEST_REDIS_PASSWORD"]);
    assert!(stderr.contains("not set"), "{stderr}");
    let out = run(Some("not-the-pass-42"));
    let stderr = crate::common::assert_clean_failure(&out, &["offload.url", &server.url(), "refused"]);
    assert!(!stderr.contains("not-the-pass-42") && !stderr.contains("kv-secret"), "no password is shown: {stderr}");
    let out = run(Some("kv-secret"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("out/report.json")).unwrap()).unwrap();
    assert_exact(&report, "with the password");
    assert!(report["offload"]["saved_chunks"].as_u64().unwrap() > 0, "{}", report["offload"]);
}

#[test]
fn the_routing_index_learns_of_chunks_another_process_published() {
    let Some(server) = LocalRedis::start_or_skip(&[]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let pools = "[[pool]]\nname = \"main\"\nranks = 2\nrouter = \"kv-aware\"\n";
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nlimit = 12";
    let graph = redis_graph(dir.path(), "hf/qwen3", pools, &server.url(), workload, "");
    let first = run_graph(&graph, Overrides::default(), TestSwitches::default());
    assert_exact(&first, "the publishing run");
    let published = first["offload"]["saved_chunks"].as_u64().unwrap();
    assert!(published > 2, "{}", first["offload"]);
    // Another process serving one request: its ranks hear of every chunk the first published.
    let second = run_graph(&graph, Overrides { limit: Some(1), ..Default::default() }, TestSwitches::default());
    assert_exact(&second, "the second run");
    assert_eq!(second["offload"]["saved_chunks"], 0, "it saved nothing itself: {}", second["offload"]);
    for rank in second["rank_stats"].as_array().unwrap() {
        // (an offload-tier event per chunk; the rank that served nothing heard of them all too)
        let events = rank["index_offload_events"].as_u64().unwrap();
        assert!(
            events >= published,
            "rank {}: {events} offload-tier events, {published} chunks published",
            rank["rank"]
        );
    }
}
