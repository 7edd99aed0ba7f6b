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
