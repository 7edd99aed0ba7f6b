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

/// `router = "kv-aware"` alone starts the index: every rank reports its prefix cache into it,
/// each admission carries the cached prefixes per rank, and every rank routes on them. On a
/// trace that reuses heavily the run stays exact and finds far more prefixes than round-robin,
/// and every one of the four ranks reported events.
#[test]
fn a_kv_aware_pool_runs_exact_and_reuses_more_prefixes_than_round_robin() {
    let run = |router: &str| {
        let pools = format!("[[pool]]\nname = \"main\"\nranks = 4\nrouter = \"{router}\"\n");
        run_on_heavy_reuse(&pools, 80, Default::default(), router)
    };
    let (aware, blind) = (run("kv-aware"), run("round-robin"));
    let hits = |r: &serde_json::Value| r["prefix_hit_rate"].as_f64().unwrap();
    assert!(hits(&aware) > 1.5 * hits(&blind), "kv-aware {} against round-robin {}", hits(&aware), hits(&blind));
    for rank in aware["rank_stats"].as_array().unwrap() {
        assert!(rank["index_events"].as_u64().unwrap() > 0, "every rank reports its cache: {rank}");
        assert_eq!(rank["index_resyncs"], 0, "no gap: {rank}");
    }
    let index = &aware["routing_index"]["main"];
    assert_eq!(index["resyncs"], 0, "{index}");
    for rank in 0..4 {
        assert!(index["last_event_by_rank"][rank.to_string()].as_u64().unwrap() > 0, "rank {rank}'s events: {index}");
    }
    assert!(
        blind["rank_stats"].as_array().unwrap().iter().all(|r| r["index_events"] == 0),
        "no index without kv-aware"
    );
}

/// With an offload tier, the ranks also report the chunks the store holds (tier 1) and, once
/// the store evicts them, that it no longer does.
#[test]
fn the_offload_tier_reports_its_chunks_to_the_routing_index() {
    let dir = tempfile::tempdir().unwrap();
    let pools = "[[pool]]\nname = \"main\"\nranks = 2\nrouter = \"kv-aware\"\n\n\
                 [offload]\nstore = \"memory\"\ncapacity_bytes = 660000\nchunk_tokens = 32\n";
    let graph = crate::runtime::write_graph_with(
        dir.path(),
        "hf/llama",
        "mooncake_synthetic_tail500.jsonl",
        "mode = \"concurrency\"\nconcurrency = 8\nlimit = 40",
        "3 MiB",
        pools,
    );
    let report = crate::runtime::run_graph(&graph, Default::default(), Default::default());
    crate::runtime::assert_exact(&report, "kv-aware with offload");
    let offload_events: u64 =
        report["rank_stats"].as_array().unwrap().iter().map(|r| r["index_offload_events"].as_u64().unwrap()).sum();
    assert!(offload_events > 0, "{}", report["rank_stats"]);
    assert!(report["offload"]["saved_chunks"].as_u64().unwrap() > 0, "{}", report["offload"]);
}

/// P/D with `kv-aware` on both pools: the prefill pool routes on its ranks' prefixes, and each
/// handoff enters the decode pool through its ingress, so decode ranks are scored by load and by
/// the prefix they already hold — which the handoff then does not send. Against round-robin on
/// both, far more handoff bytes are saved, and both runs are exact.
#[test]
fn kv_aware_pd_pools_score_decode_ranks_by_the_prefix_they_hold() {
    let run = |router: &str| {
        let pools = format!(
            "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 2\nrouter = \"{router}\"\n\n\
             [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 2\nrouter = \"{router}\"\n\n\
             [[link]]\nfrom = \"prefill\"\nto = \"decode\"\n"
        );
        run_on_heavy_reuse(&pools, 60, Default::default(), router)
    };
    let (aware, blind) = (run("kv-aware"), run("round-robin"));
    let saved = |r: &serde_json::Value| r["handoff"]["saved_bytes"].as_u64().unwrap();
    assert!(saved(&aware) > 4 * saved(&blind).max(1), "{} against {}", aware["handoff"], blind["handoff"]);
    let decode_events: u64 = aware["rank_stats"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["pool"] == "decode")
        .map(|r| r["index_events"].as_u64().unwrap())
        .sum();
    assert!(decode_events > 0, "the decode pool's ranks report to its own index");
}

/// Events lost on the way (a test switch drops every seventh a rank reports) are seen as a gap
/// by every rank's `align` alike; the plan names the rank, its next report carries its whole
/// cache, and the index resyncs from it and goes on following every rank — the run stays exact.
#[test]
fn lost_cache_events_are_repaired_by_a_resync_through_the_plan() {
    let pools = "[[pool]]\nname = \"main\"\nranks = 4\nrouter = \"kv-aware\"\n";
    let switches = kvflow_operators::rank::TestSwitches { drop_cache_event_every: Some(7), ..Default::default() };
    let report = run_on_heavy_reuse(pools, 80, switches, "kv-aware losing events");
    let index = &report["routing_index"]["main"];
    assert!(index["resyncs"].as_u64().unwrap() > 0, "{index}");
    let sent: u64 = report["rank_stats"].as_array().unwrap().iter().map(|r| r["index_resyncs"].as_u64().unwrap()).sum();
    assert_eq!(sent, index["resyncs"].as_u64().unwrap(), "one snapshot per resync: {}", report["rank_stats"]);
    for rank in 0..4 {
        assert!(index["last_event_by_rank"][rank.to_string()].as_u64().unwrap() > 0, "rank {rank} followed: {index}");
    }
}

/// Runs `pools` on the first `limit` requests of the heavy-reuse trace (concurrency 8, 16 MiB of
/// KV per rank) and checks the run is exact.
fn run_on_heavy_reuse(
    pools: &str,
    limit: usize,
    switches: kvflow_operators::rank::TestSwitches,
    what: &str,
) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let graph = crate::runtime::write_graph_with(
        dir.path(),
        "hf/llama",
        "mooncake_synthetic_tail500.jsonl",
        &format!("mode = \"concurrency\"\nconcurrency = 8\nlimit = {limit}"),
        "16 MiB",
        pools,
    );
    let report = crate::runtime::run_graph(&graph, Default::default(), switches);
    crate::runtime::assert_exact(&report, what);
    report
}
