//! KV-aware routing: the index's bench runs end to end and checks every decision against a scan
//! of every rank's cache (the index's own property tests are in
//! kvflow_operators::policy::kv_index).

#[test]
fn the_router_bench_checks_every_decision_against_a_scan() {
    let out = crate::common::kvflow(&["bench", "router", "--ranks", "4", "--blocks", "5000", "--decisions", "100"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    for needle in ["index        4 ranks", "per decision", "index_over_scan=", "every decision equals the scan"] {
        assert!(stdout.contains(needle), "{needle}: {stdout}");
    }
}

/// `router = "kv-aware"` alone starts the index: the ranks report their prefix caches into it,
/// rank 0 attaches each admission's cached prefixes, and every rank routes on them — the run
/// stays exact and finds prefixes, on four ranks.
#[test]
fn a_kv_aware_pool_runs_exact_and_reuses_prefixes() {
    let dir = tempfile::tempdir().unwrap();
    let pools = "[[pool]]\nname = \"main\"\nranks = 4\nrouter = \"kv-aware\"\n";
    let graph = crate::runtime::write_graph_with(
        dir.path(),
        "hf/llama",
        "mooncake_conversation_first5min.jsonl",
        "mode = \"concurrency\"\nconcurrency = 8\nlimit = 60",
        "16 MiB",
        pools,
    );
    let report = crate::runtime::run_graph(&graph, Default::default(), Default::default());
    crate::runtime::assert_exact(&report, "kv-aware");
    let hits = report["prefix_hit_rate"].as_f64().unwrap();
    assert!(hits > 0.0, "no prefix reused under kv-aware routing: {report}");
}
