//! P/D disaggregation, in one process over `inproc` links: a prefill pool samples T0 and hands
//! the prompt's KV and state to a decode pool, which continues from T0. On every family the
//! outputs are bit-identical to the reference path (`--verify`), every request really passed
//! through both pools, and every block and slot is free on both sides at the end.

use crate::common::records;
use crate::common::FIXTURES;
use crate::runtime::{assert_exact, run_graph, write_graph_with};
use kvflow::graph::Overrides;
use serde_json::Value;

const ONE_P_ONE_D: &str = "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n\
    [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n\n\
    [[link]]\nfrom = \"prefill\"\nto = \"decode\"\n";

fn run_pd(model: &str, pools: &str, executor: &str) -> (tempfile::TempDir, Value) {
    run_pd_on(model, pools, executor, "mode = \"concurrency\"\nconcurrency = 6\nwarmup = 2\nlimit = 12")
}

fn run_pd_on(model: &str, pools: &str, executor: &str, workload: &str) -> (tempfile::TempDir, Value) {
    let dir = tempfile::tempdir().unwrap();
    let pools = pools.replace("ranks = 1\n", &format!("ranks = 1\n{executor}"));
    let graph = write_graph_with(dir.path(), model, "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools);
    let report = run_graph(&graph, Overrides::default(), Default::default());
    (dir, report)
}

#[test]
fn one_prefill_and_one_decode_pool_give_the_reference_outputs_on_every_family() {
    for model in FIXTURES {
        // The deferred executor (completions a step late) on a plain and a recurrent family; the
        // aggregated test of asynchronous.rs runs it on every family.
        let deferred = matches!(model, "hf/llama" | "hf/kimi_linear");
        for executor in ["", "executor = \"cpu-deferred\"\n"].into_iter().take(if deferred { 2 } else { 1 }) {
            let what = format!("{model} 1P1D {executor}");
            let (dir, report) = run_pd(model, ONE_P_ONE_D, executor);
            assert_exact(&report, &what);
            assert!(report["accounting_errors"].as_array().unwrap().is_empty(), "{what}: {report}");
            let handed = report["handoff"]["count"].as_u64().unwrap();
            assert_eq!(
                handed,
                report["requests"].as_u64().unwrap() + 2,
                "{what}: every request (warmup too) handed off"
            );
            assert_eq!(report["handoff"]["received"].as_u64().unwrap(), handed, "{what}");
            assert!(report["handoff"]["bytes"].as_u64().unwrap() > 0, "{what}");
            for r in records(dir.path()) {
                assert_eq!(r["pools"], serde_json::json!(["prefill", "decode"]), "{what}: {r}");
                assert!(r["t0_ms"].as_f64().is_some(), "{what}: T0 came from the prefill pool");
            }
        }
    }
}

fn run_pd_with(model: &str, switches: kvflow_operators::rank::TestSwitches) -> (tempfile::TempDir, Value) {
    let dir = tempfile::tempdir().unwrap();
    let graph = write_graph_with(
        dir.path(),
        model,
        "mooncake_conversation_head.jsonl",
        "mode = \"concurrency\"\nconcurrency = 6\nwarmup = 0\nlimit = 8",
        "32 MiB",
        ONE_P_ONE_D,
    );
    let report = run_graph(&graph, Overrides::default(), switches);
    (dir, report)
}

/// All-or-nothing state: a handoff without its state slot is refused by a consumer whose model
/// has recurrent state (each request fails, naming why) — never run on a zeroed state.
#[test]
fn a_handoff_without_its_state_half_is_refused_on_recurrent_families() {
    let switches = kvflow_operators::rank::TestSwitches { handoff_without_state: true, ..Default::default() };
    for model in ["hf/qwen3_next", "hf/kimi_linear"] {
        let (dir, report) = run_pd_with(model, switches.clone());
        assert_eq!(report["completed"], 0, "{model}: {report}");
        assert!(report["accounting_errors"].as_array().unwrap().is_empty(), "{model}: {report}");
        for r in records(dir.path()) {
            assert_eq!(r["failure"], "handoff", "{model}: {r}");
            assert!(r["error"].as_str().unwrap().contains("all-or-nothing"), "{model}: {r}");
        }
    }
    // A model without recurrent state has no state half: the switch changes nothing.
    let (_, report) = run_pd_with("hf/llama", switches);
    assert_exact(&report, "llama without a state half");
}

/// T0 exactly once: when the producer exports the state after feeding T0 itself (test switch),
/// the consumer applies T0 a second time — outputs change on exactly the families with
/// recurrent state; attention-only families recompute T0's KV row and stay exact.
#[test]
fn state_taken_after_t0_breaks_exactly_the_recurrent_families() {
    let switches = kvflow_operators::rank::TestSwitches { export_state_after_t0: true, ..Default::default() };
    for model in FIXTURES {
        let recurrent = kvflow_kernels::models::load(&crate::common::fixture(model)).unwrap().needs_slots();
        let (_, report) = run_pd_with(model, switches.clone());
        assert_only_recurrent_families_break(&report, model, recurrent, "T0 applied twice");
    }
}

/// With a switch on: nothing failed, and outputs mismatch exactly when the family keeps
/// recurrent state (`broken` says what the switch broke).
fn assert_only_recurrent_families_break(report: &Value, model: &str, recurrent: bool, broken: &str) {
    assert_eq!(report["failed"], 0, "{model}: {report}");
    let mismatched = report["verify"]["mismatched"].as_u64().unwrap();
    if recurrent {
        assert!(mismatched > 0, "{model}: {broken} must change the output");
    } else {
        assert_eq!(mismatched, 0, "{model}: attention-only families are unaffected");
    }
}

/// Current slot: the handoff reads the state slot its request holds when the step that samples
/// T0 runs. A prefill pool short of blocks preempts requests mid-prompt; one that comes back may
/// get another slot. Reading the slot it was first admitted with instead (the switch) hands off
/// what that slot holds now — another request's state — so recurrent families mismatch; an
/// attention-only family has no slot and stays exact. (qwen3_next_gdn keeps no paged KV, so
/// nothing preempts it and its slot never moves.)
#[test]
fn a_handoff_of_the_admission_time_slot_breaks_requests_that_moved() {
    let pools = |budget: &str| {
        format!(
            "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n[pool.memory]\nbudget_bytes = \"{budget}\"\n\
             [pool.scheduler]\nmax_batched_tokens = 512\nchunk_tokens = 32\n\n\
             [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n\n\
             [[link]]\nfrom = \"prefill\"\nto = \"decode\"\n"
        )
    };
    // Budgets that hold the longest prompt but not the 16 in flight together.
    for (model, budget) in [("hf/qwen3_next", "1250 KiB"), ("hf/kimi_linear", "1250 KiB"), ("hf/llama", "3 MiB")] {
        let recurrent = kvflow_kernels::models::load(&crate::common::fixture(model)).unwrap().needs_slots();
        let dir = tempfile::tempdir().unwrap();
        let workload = "mode = \"concurrency\"\nconcurrency = 16\nwarmup = 0\nlimit = 32";
        let graph =
            write_graph_with(dir.path(), model, "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools(budget));
        let with = run_graph(&graph, Overrides::default(), Default::default());
        assert_exact(&with, &format!("{model}, the slot held at T0"));
        assert!(with["pools"]["prefill"]["preemptions"].as_u64().unwrap() > 0, "{model}: nothing was preempted");
        let switches = kvflow_operators::rank::TestSwitches { export_admission_slot: true, ..Default::default() };
        // Which requests come back to another slot depends on timing: a run in which none did
        // shows nothing, so a recurrent family gets up to 4 runs to show the break.
        let mut without = run_graph(&graph, Overrides::default(), switches.clone());
        for _ in 1..4 {
            if !recurrent || without["verify"]["mismatched"].as_u64().unwrap() > 0 {
                break;
            }
            without = run_graph(&graph, Overrides::default(), switches.clone());
        }
        assert_only_recurrent_families_break(&without, model, recurrent, "a stale slot handed off");
        assert!(without["accounting_errors"].as_array().unwrap().is_empty(), "{model}: {without}");
    }
}

fn tcp_pools(endpoint: &str) -> String {
    format!("{ONE_P_ONE_D}backend = \"tcp\"\nendpoint = \"{endpoint}\"\n")
}

/// Over a `tcp` link on loopback (port 0: the kernel picks; IPv6 too where the host has it) the
/// outputs are the reference ones, and the handoff bytes really crossed a socket.
#[test]
fn a_tcp_link_on_loopback_gives_the_reference_outputs_and_its_bytes_cross_a_socket() {
    let mut endpoints = vec!["127.0.0.1:0"];
    if std::net::TcpListener::bind("[::1]:0").is_ok() {
        endpoints.push("[::1]:0");
    }
    for model in ["hf/llama", "hf/kimi_linear"] {
        for endpoint in &endpoints {
            let what = format!("{model} over tcp {endpoint}");
            let (dir, report) = run_pd(model, &tcp_pools(endpoint), "");
            assert_exact(&report, &what);
            let h = &report["handoff"];
            assert_eq!(h["backend"], "tcp", "{what}");
            assert!(h["socket_bytes"].as_u64().unwrap() >= h["bytes"].as_u64().unwrap(), "{what}: {h}");
            assert!(h["bytes"].as_u64().unwrap() > 0, "{what}");
            assert!(records(dir.path()).iter().all(|r| r["pools"] == serde_json::json!(["prefill", "decode"])));
        }
    }
}

/// Listener readiness: a decode pool whose endpoint cannot be bound fails the run before any
/// producer registers, naming the endpoint.
#[test]
fn a_bind_failure_is_a_clear_error_naming_the_endpoint() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let graph = write_graph_with(
        dir.path(),
        "hf/llama",
        "mooncake_conversation_head.jsonl",
        "mode = \"concurrency\"\nconcurrency = 2\nlimit = 2",
        "32 MiB",
        &tcp_pools(&endpoint),
    );
    let out = crate::common::kvflow(&["run", &graph.to_string_lossy()]);
    crate::common::assert_clean_failure(&out, &["cannot listen on", &endpoint, "decode"]);
}

/// `kvflow compare` replays the same workload through an aggregated and a disaggregated graph,
/// prints their figures side by side and writes both reports.
#[test]
fn compare_prints_aggregated_and_disaggregated_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let (agg_dir, pd_dir) = (dir.path().join("agg"), dir.path().join("pd"));
    std::fs::create_dir_all(&agg_dir).unwrap();
    std::fs::create_dir_all(&pd_dir).unwrap();
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nlimit = 6";
    let agg = write_graph_with(
        &agg_dir,
        "hf/llama",
        "mooncake_conversation_head.jsonl",
        workload,
        "32 MiB",
        crate::runtime::ONE_POOL,
    );
    let pd = write_graph_with(&pd_dir, "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB", ONE_P_ONE_D);
    let out_dir = dir.path().join("out");
    let out = crate::common::kvflow(&[
        "compare",
        &agg.to_string_lossy(),
        &pd.to_string_lossy(),
        "--out",
        &out_dir.to_string_lossy(),
        "--verify",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for row in ["TTFT p50 ms", "TPOT p50 ms", "queue p50 ms", "output tokens/s", "goodput req/s", "handoffs"] {
        assert!(stdout.contains(row), "{row}: {stdout}");
    }
    let mismatched = stdout.lines().find(|l| l.starts_with("verify mismatched")).unwrap();
    assert_eq!(mismatched.split_whitespace().filter(|w| *w == "0").count(), 2, "{stdout}");
    for name in ["graph", "graph-2"] {
        assert!(out_dir.join(name).join("report.json").exists(), "{name}'s report");
    }
}

/// `[pool.disaggregation]` on the decode pool: new requests enter it, and the decode rank the
/// router picks prefills a short prompt itself and has the prefill pool do a long one.
fn conditional(rule: &str) -> String {
    ONE_P_ONE_D.replace("[[link]]", &format!("[pool.disaggregation]\n{rule}\n\n[[link]]"))
}

#[test]
fn conditional_disaggregation_prefills_both_ways_and_stays_exact() {
    for model in FIXTURES {
        let what = format!("{model} with remote_prefill_min_tokens = 100");
        let (dir, report) = run_pd(model, &conditional("remote_prefill_min_tokens = 100"), "");
        assert_exact(&report, &what);
        assert!(report["accounting_errors"].as_array().unwrap().is_empty(), "{what}");
        let h = &report["handoff"];
        let (local, remote) = (h["local_prefills"].as_u64().unwrap(), h["remote_prefills"].as_u64().unwrap());
        assert!(local > 0 && remote > 0, "{what}: both kinds of prefill: {h}");
        assert_eq!(local + remote, 14, "{what}: every request (warmup too) decided once");
        assert_eq!(h["count"].as_u64().unwrap(), remote, "{what}: only remote prefills hand off");
        let (mut saw_local, mut saw_remote) = (0, 0);
        for r in records(dir.path()) {
            assert_eq!(r["pool"], "decode", "{what}: new requests enter the decode pool: {r}");
            if r["pools"] == serde_json::json!(["prefill", "decode"]) {
                saw_remote += 1;
                assert!(r["input_len"].as_u64().unwrap() > 100, "{what}: only long prompts go remote: {r}");
            } else {
                assert_eq!(r["pools"], serde_json::json!(["decode"]), "{what}: {r}");
                saw_local += 1;
            }
        }
        assert!(saw_local > 0 && saw_remote > 0, "{what}");
    }
}

#[test]
fn decode_side_prefix_reuse_sends_fewer_bytes_with_the_same_outputs() {
    for model in ["hf/llama", "hf/deepseek_v32"] {
        // Every prefill remote either way (the default rule); the decode rank keeps the prefix
        // it already holds and the producer leaves it out — unless the decode pool keeps no
        // prefix cache.
        // Turns of the trace's conversations share their history; two at a time, so a later
        // turn often finds an earlier one's blocks on the decode rank.
        let workload = "mode = \"concurrency\"\nconcurrency = 2\nwarmup = 0\nlimit = 30";
        let no_cache = ONE_P_ONE_D.replace(
            "role = \"decode\"\nranks = 1\n",
            "role = \"decode\"\nranks = 1\n[pool.scheduler]\nprefix_cache = false\n",
        );
        assert_ne!(no_cache, ONE_P_ONE_D);
        let (_a, plain) = run_pd_on(model, &no_cache, "", workload);
        let (_b, reuse) = run_pd_on(model, ONE_P_ONE_D, "", workload);
        for (r, what) in [(&plain, "plain"), (&reuse, "reuse")] {
            assert_exact(r, &format!("{model} {what}"));
            assert!(r["accounting_errors"].as_array().unwrap().is_empty(), "{model} {what}");
        }
        let (p, q) = (&plain["handoff"], &reuse["handoff"]);
        assert_eq!(p["count"], q["count"], "{model}: every request handed off both times");
        assert_eq!(q["local_prefills"], 0, "{model}");
        let saved = q["saved_bytes"].as_u64().unwrap();
        assert!(saved > 0, "{model}: the shared prefixes were not sent: {q}");
        assert_eq!(
            q["bytes"].as_u64().unwrap() + saved,
            p["bytes"].as_u64().unwrap(),
            "{model}: what was not sent is exactly what was saved"
        );
    }
}

/// A link's rate (`bandwidth`): over `inproc` and over `tcp`, every handoff reaches the decode
/// rank no sooner than its bytes take at that rate, after T0 (less the bucket's credit, the
/// burst an idle link allows) — and the outputs stay exact.
#[test]
fn a_link_rate_holds_each_handoff_back_for_its_bytes_at_that_rate() {
    const BYTES_PER_S: f64 = 2e6;
    for backend in ["inproc", "tcp"] {
        let pools = ONE_P_ONE_D.replace(
            "to = \"decode\"\n",
            &format!("to = \"decode\"\nbackend = \"{backend}\"\nbandwidth = \"2 MB/s\"\n"),
        );
        let workload = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 8";
        let (dir, report) = run_pd_on("hf/llama", &pools, "", workload);
        assert_exact(&report, &format!("1P1D over {backend} at 2 MB/s"));
        let mut checked = 0;
        for r in records(dir.path()) {
            let (bytes, transfer) = (r["handoff_bytes"].as_f64().unwrap(), r["transfer_ms"].as_f64().unwrap());
            let credit_ms = kvflow_operators::transfer::rate::CREDIT.as_secs_f64() * 1e3;
            let least = bytes / BYTES_PER_S * 1e3 - credit_ms;
            assert!(least > 5.0, "{backend}: a handoff of {bytes} bytes takes at least 5 ms at 2 MB/s");
            assert!(transfer >= least, "{backend}: {bytes} bytes arrived after {transfer:.1} ms, under {least:.1} ms");
            checked += 1;
        }
        assert_eq!(checked, 8, "{backend}");
    }
}

/// Streamed handoffs (`stream_min_tokens`): every family's prompts leave chunk by chunk while
/// they prefill, the handoff at T0 carrying the rest and the state — exact over `inproc`; over
/// `tcp` at a link rate the consumer staged the pieces before T0, and part of each transfer
/// overlapped the prefill, so what was left after T0 is less than the whole.
#[test]
fn a_streamed_handoff_sends_completed_chunks_ahead_and_stays_exact_on_every_family() {
    let streamed = |backend: &str, rate: &str| {
        ONE_P_ONE_D.replace(
            "to = \"decode\"\n",
            &format!("to = \"decode\"\nbackend = \"{backend}\"\nstream_min_tokens = 1\n{rate}"),
        )
    };
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 8";
    for model in FIXTURES {
        let (_dir, report) = run_pd_on(model, &streamed("inproc", ""), "", workload);
        let what = format!("{model} 1P1D streamed over inproc");
        assert_exact(&report, &what);
        assert!(report["accounting_errors"].as_array().unwrap().is_empty(), "{what}: {report}");
        let h = &report["handoff"];
        let (pieces, streamed_bytes, bytes) =
            (h["pieces"].as_u64().unwrap(), h["streamed_bytes"].as_u64().unwrap(), h["bytes"].as_u64().unwrap());
        if model == "hf/qwen3_next_gdn" {
            // Recurrent state only, no KV blocks: its handoff is the state, at T0.
            assert_eq!(pieces, 0, "{what}: {h}");
            continue;
        }
        assert!(pieces >= 8, "{what}: every handoff streamed some of its blocks: {h}");
        assert!(streamed_bytes > 0 && streamed_bytes < bytes, "{what}: the rest went with T0: {h}");
    }
    for model in ["hf/llama", "hf/kimi_linear"] {
        let (dir, report) = run_pd_on(model, &streamed("tcp", "bandwidth = \"4 MB/s\"\n"), "", workload);
        let what = format!("{model} 1P1D streamed over tcp at 4 MB/s");
        assert_exact(&report, &what);
        let h = &report["handoff"];
        assert!(h["pieces_staged"].as_u64().unwrap() > 0, "{what}: {h}");
        assert_eq!(h["refused_for_pieces"], 0, "{what}: no piece was lost: {h}");
        let overlapped =
            records(dir.path()).iter().filter(|r| r["transfer_overlapped_ms"].as_f64() > Some(0.0)).count();
        assert!(overlapped > 0, "{what}: some transfer moved while its prefill ran");
    }
}

/// P and D of different block sizes: the prefill pool's blocks of 8 or 32 tokens become the
/// decode pool's blocks of 16 at its inbox (`transfer::reblock`) — exact on every family over
/// inproc, and over tcp (streamed too); the decode rank's held prefix (requests share their
/// first blocks) is skipped in the producer's blocks it covers. KV of another element type is
/// refused before the run, naming both.
#[test]
fn a_prefill_pool_of_other_block_sizes_hands_off_exactly_and_another_dtype_is_refused() {
    let with_blocks = |bs: usize, link: &str| {
        ONE_P_ONE_D
            .replacen("ranks = 1\n", &format!("ranks = 1\n[pool.memory]\nblock_size = {bs}\n"), 1)
            .replace("to = \"decode\"\n", &format!("to = \"decode\"\n{link}"))
    };
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 8";
    for model in FIXTURES {
        for bs in [8, 32] {
            let (_dir, report) = run_pd_on(model, &with_blocks(bs, ""), "", workload);
            let what = format!("{model}: prefill blocks of {bs}, decode blocks of 16, inproc");
            assert_exact(&report, &what);
            assert!(report["accounting_errors"].as_array().unwrap().is_empty(), "{what}: {report}");
            assert_eq!(report["handoff"]["received"], 8, "{what}");
        }
    }
    for link in ["backend = \"tcp\"\n", "backend = \"tcp\"\nstream_min_tokens = 1\n"] {
        for bs in [8, 32] {
            let (_dir, report) = run_pd_on("hf/llama", &with_blocks(bs, link), "", workload);
            assert_exact(&report, &format!("hf/llama: prefill blocks of {bs}, decode blocks of 16, {link}"));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let bf16 = "executor = \"cuda\"\n[pool.executor_settings]\nemulate = true\ndtype = \"bfloat16\"\n\n[[link]]";
    let pools = ONE_P_ONE_D.replace("\n[[link]]", &format!("\n{bf16}"));
    let graph =
        write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools);
    let g = kvflow::graph::Graph::load(&graph).unwrap();
    let e = format!("{:#}", kvflow::runtime::run(&g, &Default::default(), &Default::default()).err().expect("refused"));
    assert!(e.contains("float32") && e.contains("bfloat16") && e.contains("`decode`"), "{e}");
}

/// A streaming prefill rank short of blocks preempts requests mid-prompt, after some of their
/// pieces left: each starts its stream over under a new transfer (the consumer drops the old
/// pieces), and every output stays exact — over inproc and tcp.
#[test]
fn a_streaming_request_preempted_mid_prompt_streams_again_and_stays_exact() {
    for backend in ["inproc", "tcp"] {
        let pools = format!(
            "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n[pool.memory]\nbudget_bytes = \"3 MiB\"\n\
             [pool.scheduler]\nmax_batched_tokens = 512\nchunk_tokens = 32\n\n\
             [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n\n\
             [[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"{backend}\"\nstream_min_tokens = 1\n"
        );
        let dir = tempfile::tempdir().unwrap();
        let workload = "mode = \"concurrency\"\nconcurrency = 16\nwarmup = 0\nlimit = 32";
        let graph =
            write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools);
        let report = run_graph(&graph, Overrides::default(), Default::default());
        let what = format!("streamed over {backend}, preempted mid-prompt");
        assert_exact(&report, &what);
        assert!(report["pools"]["prefill"]["preemptions"].as_u64().unwrap() > 0, "{what}: nothing was preempted");
        let h = &report["handoff"];
        assert!(h["pieces"].as_u64().unwrap() > 0, "{what}: {h}");
        assert!(h["streams_dropped"].as_u64().unwrap() > 0, "{what}: a preempted stream started over: {h}");
        assert!(report["accounting_errors"].as_array().unwrap().is_empty(), "{what}: {report}");
    }
}
