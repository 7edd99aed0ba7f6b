//! Simulated runs (issue 44): executor `sim` on the virtual clock — reproducible byte for byte,
//! timed by the cost model, run by the engine's own operators (a guarantee switch changes a
//! simulated run as it changes a real one), stalls named at once, and what cannot be simulated yet
//! refused by name.

use crate::asynchronous::pool;
use crate::common::{assert_clean_failure, kvflow, records_in, report_in};
use crate::runtime::{kvflow_heavy, ranks_used, write_graph_with};
use std::path::{Path, PathBuf};

/// 60 requests of the head trace at its own times (sped up), a fifth of them cancelled.
const REPLAY: &str =
    "mode = \"timestamps\"\ntime_scale = 0.3\nwarmup = 2\nlimit = 60\ncancel_fraction = 0.2\ncancel_after_ms = 40";

fn graph(dir: &Path, workload: &str, pools: &str) -> PathBuf {
    write_graph_with(dir, "hf/kimi_linear", "mooncake_conversation_head.jsonl", workload, "64 MiB", pools)
}

pub fn run_ok(graph: &Path, extra: &[&str]) {
    let mut args = vec!["run", graph.to_str().unwrap()];
    args.extend_from_slice(extra);
    let out = kvflow(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn two_simulated_runs_of_one_seed_write_byte_identical_reports_and_another_seed_does_not() {
    let runs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    for (dir, seed) in runs.iter().zip([1, 1, 2]) {
        // 5 ms a step: requests last long enough to be cancelled
        let g = graph(dir.path(), REPLAY, &pool(2, "sim", &format!("seed = {seed}\nstep_overhead_us = 5000")));
        run_ok(&g, &[]);
    }
    let bytes = |dir: &tempfile::TempDir, file: &str| std::fs::read(dir.path().join("out").join(file)).unwrap();
    for file in ["report.json", "requests.jsonl"] {
        assert!(bytes(&runs[0], file) == bytes(&runs[1], file), "{file} differs between two runs of one seed");
    }
    assert!(bytes(&runs[0], "requests.jsonl") != bytes(&runs[2], "requests.jsonl"), "the seed draws the tokens");
    let out = runs[0].path().join("out");
    let r = report_in(&out);
    assert_eq!(r["clock"], "virtual");
    assert!(r["cancelled"].as_u64().unwrap() > 0, "the workload's cancellations ran: {r}");
    assert_eq!(r["failed"], 0);
    assert_eq!(r["completed"].as_u64().unwrap() + r["cancelled"].as_u64().unwrap(), 60);
    assert_eq!(ranks_used(&out).len(), 2, "requests spread over both ranks");
    assert!(r["accounting_errors"].as_array().unwrap().is_empty());
    // Released at the trace's times (scaled): the last arrival is where the trace puts it.
    let last_arrival = records_in(&out).iter().map(|rec| rec["arrival_ms"].as_f64().unwrap()).fold(0.0, f64::max);
    assert!(last_arrival > 1000.0 && r["wall_s"].as_f64().unwrap() * 1e3 >= last_arrival, "{last_arrival} {r}");
}

/// A measured table of 10 ms for every step.
const TEN_MS_STEPS: &str = r#"{"decode_rows": [1, 256], "context": [0, 65536], "decode_seconds": [0.01, 0.01, 0.01, 0.01],
    "prefill_tokens": [1, 4096], "prefill_prefix": [0, 65536], "prefill_seconds": [0.01, 0.01, 0.01, 0.01]}"#;

/// 12 requests at the head trace's times (sped up) on `ranks` simulated ranks priced by
/// [`TEN_MS_STEPS`], written into `dir`: the graph and the table.
fn ten_ms_graph(dir: &Path, ranks: usize) -> (PathBuf, PathBuf) {
    let table = dir.join("steps.json");
    std::fs::write(&table, TEN_MS_STEPS).unwrap();
    let workload = "mode = \"timestamps\"\ntime_scale = 0.3\nlimit = 12";
    (graph(dir, workload, &pool(ranks, "sim", &format!("table = {:?}", table.display().to_string()))), table)
}

/// A measured table of one time per step: every step takes it, one after another on the
/// simulated device, so a decoding request gets a token per step — as long as the clock waits
/// for every worker to finish what an instant holds (two ranks: each step aligns them).
#[test]
fn a_measured_table_times_every_step_on_the_discrete_event_rule() {
    let dir = tempfile::tempdir().unwrap();
    let (g, table) = ten_ms_graph(dir.path(), 2);
    run_ok(&g, &[]);
    let r = report_in(&dir.path().join("out"));
    assert_eq!(r["completed"], 12, "{r}");
    let tpot = r["tpot_ms"]["p50"].as_f64().unwrap();
    assert!((10.0..10.5).contains(&tpot), "a token per 10 ms step: TPOT p50 {tpot}");
    let ttft = r["ttft_ms"]["p50"].as_f64().unwrap();
    assert!(ttft >= 10.0, "the first token comes after at least one step: {ttft}");
    // Without the discrete-event rule (the clock moves after every pass, busy or not), what an
    // instant still had to do happens later: the same steps no longer give a token per step.
    let out = kvflow(&["run", g.to_str().unwrap(), "--test-switch", "advance-clock-while-busy"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let drifted = report_in(&dir.path().join("out"));
    let (tpot, first) = (drifted["tpot_ms"]["p50"].as_f64().unwrap(), drifted["ttft_ms"]["p50"].as_f64().unwrap());
    assert!(
        !(10.0..10.5).contains(&tpot) || (first - ttft).abs() >= 10.0,
        "without the rule the timing drifts: TPOT p50 {tpot}, TTFT p50 {first} against {ttft}"
    );
    // A table that cannot price steps is refused, naming the setting.
    let json = TEN_MS_STEPS.replace("\"decode_seconds\": [0.01, 0.01, 0.01, 0.01]", "\"decode_seconds\": [0.01]");
    std::fs::write(&table, json).unwrap();
    let out = kvflow(&["run", g.to_str().unwrap()]);
    assert_clean_failure(&out, &["executor_settings.table", "`decode_seconds` holds 1 times for a grid of 4 points"]);
}

/// A rank keeps at most two steps in flight on a GPU executor and on the simulated one standing
/// for it (one running, one behind it); without the bound (a test switch) it launches as far
/// ahead as its scheduler allows — on an H100 that blocked its thread in launches.
#[test]
fn a_rank_keeps_at_most_two_steps_in_flight_on_a_simulated_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let (g, _) = ten_ms_graph(dir.path(), 1);
    let text = std::fs::read_to_string(&g).unwrap().replace("[report]\n", "[report]\nsteps = true\n");
    std::fs::write(&g, text).unwrap();
    // The most steps launched and not yet done at any launch, the launching one included.
    let most_in_flight = |extra: &[&str]| {
        run_ok(&g, extra);
        let log = std::fs::read_to_string(dir.path().join("out").join("steps.jsonl")).unwrap();
        let steps: Vec<(f64, f64)> = log
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .map(|e| (e["launched_ms"].as_f64().unwrap(), e["done_ms"].as_f64().unwrap()))
            .collect();
        assert!(steps.len() > 20, "{} steps", steps.len());
        (0..steps.len()).map(|k| 1 + steps[..k].iter().filter(|(_, done)| *done > steps[k].0).count()).max().unwrap()
    };
    let held_back = || report_in(&dir.path().join("out"))["steps_held_back"][0].as_u64().unwrap();
    assert_eq!(most_in_flight(&[]), 2);
    assert!(held_back() > 0, "the rank held steps back");
    let unbounded = most_in_flight(&["--test-switch", "unbounded-steps-in-flight"]);
    assert!(unbounded > 2, "without the bound: {unbounded} in flight at most");
    assert_eq!(held_back(), 0);
}

/// The simulator runs the engine's operators, not a model of them: the accounting switch that
/// makes a real run fail its end-of-run check makes a simulated one fail it the same way.
#[test]
fn a_guarantee_switch_changes_a_simulated_run_as_it_changes_a_real_one() {
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nlimit = 8";
    for executor in ["sim", "cpu"] {
        let dir = tempfile::tempdir().unwrap();
        let g = graph(dir.path(), workload, &pool(1, executor, ""));
        let g = g.to_str().unwrap();
        let clean = kvflow_heavy(&["run", g]);
        assert!(clean.status.success(), "{executor}: {}", String::from_utf8_lossy(&clean.stderr));
        let leaky = kvflow_heavy(&["run", g, "--test-switch", "leak-blocks-of=0"]);
        let stderr = String::from_utf8_lossy(&leaky.stderr);
        assert_eq!(leaky.status.code(), Some(4), "{executor}: {stderr}");
        assert!(stderr.contains("leaked by request 0"), "{executor}: {stderr}");
        let r = report_in(&dir.path().join("out"));
        assert!(!r["accounting_errors"].as_array().unwrap().is_empty(), "{executor}");
    }
}

/// One prefill and one decode pool of `executor`, joined by a link of `backend` at `bandwidth`.
fn one_p_one_d(executor: &str, backend: &str, bandwidth: &str) -> String {
    let pool =
        |name: &str| format!("[[pool]]\nname = \"{name}\"\nrole = \"{name}\"\nranks = 1\nexecutor = \"{executor}\"\n");
    format!(
        "{}{}[[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"{backend}\"\nbandwidth = \"{bandwidth}\"\n",
        pool("prefill"),
        pool("decode")
    )
}

/// P/D under simulation: the engine's own handoff path (export, link, inbox, take, ack) with
/// `sim` links whose transfers take the virtual clock's time for their bytes at the link's
/// bandwidth — a link ten times slower moves each handoff about ten times longer — and the
/// all-or-nothing state rule refuses a handoff without its state half as in a real run.
#[test]
fn a_simulated_disaggregated_run_moves_its_handoffs_at_the_links_bandwidth() {
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nlimit = 12";
    let mut mean_ms = Vec::new();
    for bandwidth in ["50 MB/s", "5 MB/s"] {
        let dir = tempfile::tempdir().unwrap();
        let g = graph(dir.path(), workload, &one_p_one_d("sim", "sim", bandwidth));
        run_ok(&g, &[]);
        let r = report_in(&dir.path().join("out"));
        assert_eq!(r["completed"], 12, "{r}");
        assert_eq!(r["handoff"]["backend"], "sim");
        assert_eq!(r["handoff"]["count"], 12, "every request handed off: {r}");
        assert!(r["handoff"]["bytes"].as_u64().unwrap() > 0, "the handoffs' sizes are counted: {r}");
        assert!(r["accounting_errors"].as_array().unwrap().is_empty(), "{r}");
        mean_ms.push(r["handoff"]["mean_ms"].as_f64().unwrap());
    }
    assert!(mean_ms[0] > 0.0 && mean_ms[1] > 8.0 * mean_ms[0], "a handoff takes its bytes' time: {mean_ms:?}");
    // The same refusal as a real run's (tests/integration/disaggregated.rs), from the same code.
    let dir = tempfile::tempdir().unwrap();
    let g = graph(dir.path(), workload, &one_p_one_d("sim", "sim", "50 MB/s"));
    let out = kvflow(&["run", g.to_str().unwrap(), "--test-switch", "handoff-without-state"]);
    assert!(!out.status.success(), "the requests fail");
    let r = report_in(&dir.path().join("out"));
    assert_eq!(r["completed"], 0, "{r}");
    for rec in records_in(&dir.path().join("out")) {
        assert_eq!(rec["failure"], "handoff", "{rec}");
        assert!(rec["error"].as_str().unwrap().contains("all-or-nothing"), "{rec}");
    }
    // A simulated run's links are `sim` links, and a `sim` link runs only in a simulated run.
    let g = graph(dir.path(), workload, &one_p_one_d("sim", "inproc", "50 MB/s"));
    assert_clean_failure(&kvflow(&["run", g.to_str().unwrap()]), &["link prefill → decode", "backend = \"sim\""]);
    let g = graph(dir.path(), workload, &one_p_one_d("cpu", "sim", "50 MB/s"));
    assert_clean_failure(
        &kvflow(&["run", g.to_str().unwrap()]),
        &["backend \"sim\" links run only in a simulated run"],
    );
}

/// A pool that can never end (a capability held forever) stalls a simulated run: nothing is
/// due, so the stepper names it at once instead of waiting for the watchdog's timeout.
#[test]
fn a_simulated_run_that_can_never_end_is_named_as_stalled_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let g = graph(dir.path(), "mode = \"concurrency\"\nconcurrency = 2\nlimit = 4", &pool(1, "sim", ""));
    let started = std::time::Instant::now();
    let out = kvflow(&["run", g.to_str().unwrap(), "--test-switch", "hold-capability=forward:0:3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("simulated run stalled") && stderr.contains("main"), "{stderr}");
    assert!(started.elapsed().as_secs() < 30, "named at once, not after a timeout");
    assert_eq!(report_in(&dir.path().join("out"))["stalled"], true);
}

#[test]
fn what_a_simulated_run_cannot_do_yet_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let mixed = format!("{}\n[[pool]]\nname = \"other\"\nranks = 1\nexecutor = \"cpu\"\n", pool(1, "sim", ""));
    let g = graph(dir.path(), "limit = 4", &mixed);
    assert_clean_failure(&kvflow(&["run", g.to_str().unwrap()]), &["pool `other`", "\"cpu\"", "every pool's executor"]);
    let g = graph(dir.path(), "limit = 4", &pool(1, "sim", ""));
    assert_clean_failure(&kvflow(&["run", g.to_str().unwrap(), "--verify"]), &["--verify", "computes no tokens"]);
    let g = graph(dir.path(), "limit = 4", &pool(1, "sim", "draft_acceptance = 2.0"));
    assert_clean_failure(&kvflow(&["run", g.to_str().unwrap()]), &["executor_settings.draft_acceptance"]);
}

/// `kvflow plan` sweeps a simulated graph and ranks its configurations by goodput per GPU: the
/// table is printed best first, plan.json holds it, and the best configuration beats the worst.
#[test]
fn kvflow_plan_ranks_configurations_by_goodput_per_gpu_and_draws_them() {
    let dir = tempfile::tempdir().unwrap();
    let bundled = crate::common::repo().join("graphs/sim-aggregated.toml");
    let out = dir.path().join("plan");
    let (g, o) = (bundled.to_str().unwrap(), out.to_str().unwrap());
    let flags = ["--sweep-ranks", "1,4", "--sweep-chunk-tokens", "64", "--limit", "60", "--out", o, "--plot"];
    let mut args = vec!["plan", g];
    args.extend_from_slice(&flags);
    let run = kvflow_heavy(&args);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.lines().next().is_some_and(|l| l.contains("goodput/GPU")), "{stdout}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(out.join("plan.json")).unwrap()).unwrap();
    assert_eq!(rows.len(), 2, "one row a configuration");
    let per_gpu = |r: &serde_json::Value| r["goodput_per_gpu"].as_f64().unwrap();
    assert!(per_gpu(&rows[0]) > per_gpu(&rows[1]), "best first, and it beats the worst: {rows:?}");
    assert!(rows.iter().all(|r| r["completed"] == 60), "{rows:?}");
    assert!(out.join("plan.png").exists() && out.join("ranks4-chunk64").join("report.json").exists());
    // A P/D graph's prefill and decode pools sweep apart, each configuration's pools as named.
    let pd = crate::common::repo().join("graphs/sim-pd.toml");
    let flags = ["--sweep-prefill-ranks", "1,2", "--sweep-decode-ranks", "1", "--sweep-chunk-tokens", "64"];
    let mut args = vec!["plan", pd.to_str().unwrap(), "--limit", "40", "--out", o];
    args.extend_from_slice(&flags);
    let run = kvflow_heavy(&args);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(out.join("plan.json")).unwrap()).unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (layout, prefill) in [("2P1D", 2), ("1P1D", 1)] {
        let r = report_in(&out.join(format!("{layout}-chunk64")));
        assert_eq!(r["pools"]["prefill"]["ranks"], prefill, "{layout}");
        assert_eq!(r["pools"]["decode"]["ranks"], 1, "{layout}");
        assert_eq!(r["completed"], 40, "{layout}");
        assert!(rows.iter().any(|row| row["ranks"]["prefill"] == prefill && row["gpus"] == prefill + 1), "{rows:?}");
    }
    // A graph that is not simulated is refused.
    let real = crate::common::repo().join("graphs/quickstart.toml");
    assert_clean_failure(&kvflow(&["plan", real.to_str().unwrap()]), &["every pool's executor must be \"sim\""]);
}

/// Expert parallelism under simulation: the engine's own dispatch, experts and combine operators
/// move every MoE layer's rows between the ranks (each rank sends some and prices its share of
/// the experts), and an exchange takes its bytes' time on the experts' link — a link a million
/// times slower makes every token slower, while the requests, the accounting and the rows moved
/// stay the same.
#[test]
fn a_simulated_expert_parallel_pool_exchanges_its_rows_and_pays_for_their_bytes() {
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nlimit = 8";
    let mut tpot = Vec::new();
    let mut rows = Vec::new();
    for gbps in ["1000", "0.001"] {
        let dir = tempfile::tempdir().unwrap();
        let settings = format!("expert_link_gbps = {gbps}\nexpert_link_latency_us = 0.001");
        let pools =
            pool(2, "sim", &settings).replace("executor = \"sim\"", "executor = \"sim\"\nexpert_parallel = true");
        let g = graph(dir.path(), workload, &pools);
        run_ok(&g, &[]);
        let r = report_in(&dir.path().join("out"));
        assert_eq!(r["completed"], 8, "{r}");
        assert!(r["accounting_errors"].as_array().unwrap().is_empty(), "{r}");
        let stats = r["rank_stats"].as_array().unwrap();
        assert_eq!(stats.len(), 2);
        for s in stats {
            assert!(s["exchange_bytes"].as_u64().unwrap() > 0, "every rank sent rows to the other: {s}");
            assert!(s["expert_bytes"].as_u64().unwrap() > 0, "every rank prices its share: {s}");
        }
        rows.push(stats.iter().map(|s| s["expert_rows"].as_u64().unwrap()).sum::<u64>());
        tpot.push(r["tpot_ms"]["p50"].as_f64().unwrap());
    }
    assert_eq!(rows[0], rows[1], "the same rows moved: {rows:?}");
    assert!(tpot[1] > 10.0 * tpot[0], "an exchange takes its bytes' time: TPOT p50 {tpot:?}");
}

/// A simulated run needs only the model's config: a folder holding `config.json` and no weights
/// runs (the same run as on the whole checkpoint, byte for byte), while a real run of it fails
/// naming what is missing.
#[test]
fn a_simulated_run_needs_only_the_models_config() {
    let dir = tempfile::tempdir().unwrap();
    let config_only = dir.path().join("config-only");
    std::fs::create_dir_all(&config_only).unwrap();
    let fixture = crate::common::repo().join("fixtures/hf/kimi_linear/config.json");
    std::fs::copy(fixture, config_only.join("config.json")).unwrap();
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nlimit = 8";
    let g = graph(dir.path(), workload, &pool(1, "sim", ""));
    run_ok(&g, &[]);
    let whole = std::fs::read(dir.path().join("out/requests.jsonl")).unwrap();
    let text = std::fs::read_to_string(&g).unwrap();
    let model_line = text.lines().find(|l| l.starts_with("path = ")).unwrap().to_string();
    let shapes = text.replace(&model_line, &format!("path = {:?}", config_only.display().to_string()));
    std::fs::write(&g, shapes).unwrap();
    run_ok(&g, &[]);
    assert!(whole == std::fs::read(dir.path().join("out/requests.jsonl")).unwrap(), "the same run");
    let real = std::fs::read_to_string(&g).unwrap().replace("executor = \"sim\"", "executor = \"cpu\"");
    std::fs::write(&g, real).unwrap();
    assert_clean_failure(&kvflow(&["run", g.to_str().unwrap()]), &["cannot load model", "config-only"]);
}

/// `store = "sim"`: the engine's own offload tier (which chunks are saved, the blocks a save
/// pins, the lookup at admission, the request waiting for its load, the restored prefix) over a
/// store of sized chunks whose saves and loads take the virtual clock's time for their bytes at
/// the store's rates. A load a thousand times slower delays the requests that wait for it; a
/// slow save keeps its place among the saves in flight until its end, so more chunks go unsaved
/// for `max_pending_saves`. Two runs give the same records byte for byte, and a store that is not
/// simulated is refused in a simulated run, as the sim store is in a real one.
#[test]
fn a_simulated_offload_store_moves_its_chunks_at_its_rates_on_the_virtual_clock() {
    // graphs/offload.toml's tier: little KV memory, so prefixes leave HBM while the store holds them
    let workload = "mode = \"concurrency\"\nconcurrency = 16\nlimit = 200\nwarmup = 8";
    let offload = "[offload]\nchunk_tokens = 32\ncapacity_bytes = \"256 MiB\"\nmax_pending_saves = 8\nstore = \"sim\"";
    let run = |rates: &str| {
        let dir = tempfile::tempdir().unwrap();
        let pools = format!("{}\n{offload}\n{rates}\n", pool(2, "sim", ""));
        let g = write_graph_with(
            dir.path(),
            "hf/llama",
            "mooncake_conversation_first5min.jsonl",
            workload,
            "4 MiB",
            &pools,
        );
        run_ok(&g, &[]);
        let out = dir.path().join("out");
        let r = report_in(&out);
        assert_eq!(r["completed"], 200, "{r}");
        assert!(r["accounting_errors"].as_array().unwrap().is_empty(), "{r}");
        let slowest = records_in(&out).iter().map(|rec| rec["ttft_ms"].as_f64().unwrap_or(0.0)).fold(0.0, f64::max);
        (r, std::fs::read(out.join("requests.jsonl")).unwrap(), slowest)
    };
    let (r, records, slowest) = run("save_gbps = 20.0\nload_gbps = 20.0\nlatency_us = 20.0");
    let o = &r["offload"];
    assert!(o["saved_chunks"].as_u64().unwrap() > 10, "chunks saved: {o}");
    assert!(o["loaded_chunks"].as_u64().unwrap() > 0 && o["offload_hit_tokens"].as_u64().unwrap() > 0, "{o}");
    assert_eq!(o["failed_loads"], 0, "{o}");
    for (what, ops) in [("saved", "saved_chunks"), ("loaded", "loads")] {
        // each save and each load takes the latency, then its bytes at 20 GB/s
        let (bytes, ops) = (o[format!("{what}_bytes")].as_f64().unwrap(), o[ops].as_f64().unwrap());
        let expected = bytes / (ops * 20e-6 + bytes / 20e9) / 1e9;
        let measured = o[if what == "saved" { "save_gb_per_s" } else { "load_gb_per_s" }].as_f64().unwrap();
        assert!(
            (measured / expected - 1.0).abs() < 0.01,
            "{what} at the store's rate: {measured} GB/s, not {expected}"
        );
    }
    assert_eq!(run("save_gbps = 20.0\nload_gbps = 20.0\nlatency_us = 20.0").1, records, "one seed, one run");
    let (_, _, slowest_loading) = run("save_gbps = 20.0\nload_gbps = 0.002\nlatency_us = 20.0");
    // a request waits for its load: at 2 MB/s a load of the fast run's mean size takes this long
    let one_load_ms = o["loaded_bytes"].as_f64().unwrap() / o["loads"].as_f64().unwrap() / 2e6 * 1e3;
    assert!(
        slowest_loading > 0.9 * one_load_ms && slowest_loading > 5.0 * slowest,
        "slow loads delay their requests: {slowest_loading} vs {slowest} ms (a load: {one_load_ms} ms)"
    );
    let (slow_saves, _, _) = run("save_gbps = 0.002\nload_gbps = 20.0\nlatency_us = 20.0");
    let unsaved = |r: &serde_json::Value| r["offload"]["pending_limit_saves"].as_u64().unwrap();
    assert!(unsaved(&slow_saves) > unsaved(&r), "slow saves hold their places: {}", slow_saves["offload"]);
    // Each store runs on its own clock only.
    let dir = tempfile::tempdir().unwrap();
    for (executor, store, refusal) in
        [("sim", "memory", &["offload.store is \"memory\"", "store = \"sim\""][..]), ("cpu", "sim", &["simulated run"])]
    {
        let pools = format!("{}\n[offload]\nchunk_tokens = 32\nstore = \"{store}\"\n", pool(1, executor, ""));
        let g = write_graph_with(
            dir.path(),
            "hf/llama",
            "mooncake_conversation_first5min.jsonl",
            "limit = 4",
            "4 MiB",
            &pools,
        );
        assert_clean_failure(&kvflow(&["run", g.to_str().unwrap()]), refusal);
    }
}

/// A measured table's costs beyond the grids: steps beside a rank's simulated saves run slower
/// by what calibrate measured for their device reads, and a prefill over several prompts pays
/// what splitting its tokens cost where measured.
#[test]
fn a_measured_table_prices_the_steps_beside_saves_and_the_prompts_of_a_prefill() {
    let workload = "mode = \"concurrency\"\nconcurrency = 16\nlimit = 100\nwarmup = 8";
    let offload = "[offload]\nchunk_tokens = 32\ncapacity_bytes = \"256 MiB\"\nstore = \"sim\"\nsave_gbps = 0.0005";
    let grids = r#""decode_rows": [1, 256], "context": [0, 65536], "decode_seconds": [0.01, 0.01, 0.01, 0.01],
        "prefill_tokens": [1, 4096], "prefill_prefix": [0, 65536], "prefill_seconds": [0.01, 0.01, 0.01, 0.01]"#;
    let run = |extra: &str, tier: &str| {
        let dir = tempfile::tempdir().unwrap();
        let table = dir.path().join("steps.json");
        std::fs::write(&table, format!("{{{grids}{extra}}}")).unwrap();
        let settings = format!("table = {:?}", table.display().to_string());
        let pools = format!("{}\n{tier}\n", pool(2, "sim", &settings));
        let g = write_graph_with(
            dir.path(),
            "hf/llama",
            "mooncake_conversation_first5min.jsonl",
            workload,
            "64 MiB",
            &pools,
        );
        run_ok(&g, &[]);
        let r = report_in(&dir.path().join("out"));
        assert_eq!(r["completed"], 100, "{r}");
        (r["tpot_ms"]["p50"].as_f64().unwrap(), r["wall_s"].as_f64().unwrap())
    };
    let (alone, _) = run("", offload);
    assert!((10.0..10.5).contains(&alone), "a token per 10 ms step: TPOT p50 {alone}");
    // the saves read the device the whole time (their rate is the read rate): steps 3x slower
    // while they run (plenty of KV memory: the blocks they pin hold no step back)
    let reads = r#", "save_reads": {"read_bytes_per_s": 0.5e6, "step_slowdown": 3.0}"#;
    let (beside, _) = run(reads, offload);
    assert!(beside > 1.2 * alone, "steps beside saves are slower: TPOT p50 {beside} against {alone} ms");
    assert_eq!(run(reads, "").0, alone, "no saves, nothing slower");
    // two prompts in a prefill step: 40 ms more (and 40 ms more a prompt beyond)
    let (_, one) = run("", "");
    let split = r#", "prefill_split": {"prompts": [1, 2], "seconds": [0.01, 0.05, 0.01, 0.05]}"#;
    let (_, several) = run(split, "");
    assert!(several > one + 0.2, "prefills of several prompts cost more: the run took {several} s against {one} s");
}
