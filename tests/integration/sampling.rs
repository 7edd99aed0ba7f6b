//! Seeded sampling (`[sampling]`, a trace line's `"sampling"`): each draw is keyed on (seed,
//! request id, position), so a sampled run is exact against the plain reference path under
//! `--verify` in aggregated and P/D graphs (the handoff carries the request's sampling over
//! inproc and tcp); speculative sampling with drafting is refused by `--verify` (its statistical
//! test is `spec.rs::sampled_drafting_keeps_the_target_distribution`).

use crate::common::{assert_clean_failure, kvflow, records_in};
use crate::runtime::{assert_exact, run_graph, write_graph_with};
use kvflow::graph::Overrides;
use kvflow_operators::rank::TestSwitches;
use std::path::Path;

const SAMPLED: &str = "[sampling]\ntemperature = 0.9\ntop_p = 0.95\nseed = 4\n";
const AGGREGATED: &str = "[[pool]]\nname = \"main\"\nranks = 2\n";
const PD: &str = "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n[[pool]]\nname = \"decode\"\n\
                  role = \"decode\"\nranks = 2\n\n[[link]]\nfrom = \"prefill\"\nto = \"decode\"\n";

fn graph(dir: &Path, pools: &str, trace: &str) -> std::path::PathBuf {
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nlimit = 8";
    write_graph_with(dir, "hf/qwen3_next", trace, workload, "16 MiB", pools)
}

fn outputs(out: &Path) -> Vec<Vec<u64>> {
    let mut lines = records_in(out);
    lines.sort_by_key(|r| r["id"].as_u64());
    lines.iter().map(|r| r["output_tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()).collect()
}

fn long_outputs(dir: &Path, name: &str) -> Overrides {
    Overrides { max_output_tokens: Some(24), out: Some(dir.join(name)), ..Default::default() }
}

#[test]
fn seeded_sampling_is_exact_against_the_reference_in_aggregated_and_pd_graphs() {
    let trace = "mooncake_conversation_head.jsonl";
    let tcp = format!("{PD}backend = \"tcp\"\nendpoint = \"127.0.0.1:0\"\n");
    let pd = format!("{PD}backend = \"inproc\"\n");
    for (what, pools) in [("aggregated", AGGREGATED), ("1P2D inproc", &pd[..]), ("1P2D tcp", &tcp[..])] {
        let dir = tempfile::tempdir().unwrap();
        let greedy =
            run_graph(&graph(dir.path(), pools, trace), long_outputs(dir.path(), "greedy"), TestSwitches::default());
        assert_exact(&greedy, &format!("{what} greedy"));
        let sampled_graph = graph(dir.path(), &format!("{pools}\n{SAMPLED}"), trace);
        let sampled = run_graph(&sampled_graph, long_outputs(dir.path(), "sampled"), TestSwitches::default());
        assert_exact(&sampled, &format!("{what} sampled"));
        let (plain, drawn) = (outputs(&dir.path().join("greedy")), outputs(&dir.path().join("sampled")));
        let differ = plain.iter().zip(&drawn).filter(|(a, b)| a != b).count();
        assert!(differ * 2 > plain.len(), "{what}: sampling changed most outputs ({differ} of {})", plain.len());
        let again = run_graph(&sampled_graph, long_outputs(dir.path(), "again"), TestSwitches::default());
        assert_exact(&again, what);
        assert_eq!(outputs(&dir.path().join("again")), drawn, "{what}: the same seed draws the same tokens");
    }
}

#[test]
fn a_trace_line_samples_with_its_own_settings() {
    let dir = tempfile::tempdir().unwrap();
    let head = std::fs::read_to_string(crate::common::repo().join("traces/mooncake_conversation_head.jsonl")).unwrap();
    // Every other request samples; the graph is greedy.
    let lines: Vec<String> = head
        .lines()
        .take(8)
        .enumerate()
        .map(|(i, l)| {
            if i % 2 == 0 {
                l.replacen('{', "{\"sampling\": {\"temperature\": 1.2, \"top_k\": 40}, ", 1)
            } else {
                l.to_string()
            }
        })
        .collect();
    let trace = dir.path().join("mixed.jsonl");
    std::fs::write(&trace, lines.join("\n")).unwrap();
    let g = graph(dir.path(), AGGREGATED, &trace.to_string_lossy());
    let mixed = run_graph(&g, long_outputs(dir.path(), "mixed"), TestSwitches::default());
    assert_exact(&mixed, "per-request sampling");
    let plain_dir = dir.path().join("plain-graph");
    std::fs::create_dir_all(&plain_dir).unwrap();
    let plain = graph(&plain_dir, AGGREGATED, "mooncake_conversation_head.jsonl");
    run_graph(&plain, long_outputs(dir.path(), "plain"), TestSwitches::default());
    let (mixed, plain) = (outputs(&dir.path().join("mixed")), outputs(&dir.path().join("plain")));
    for (i, (m, p)) in mixed.iter().zip(&plain).enumerate() {
        if i % 2 == 1 {
            assert_eq!(m, p, "request {i} has no sampling of its own: greedy");
        }
    }
    assert!((0..8).step_by(2).any(|i| mixed[i] != plain[i]), "the sampled requests drew other tokens");

    // A bad override names the file, the line and the field.
    std::fs::write(&trace, lines[0].replace("\"temperature\": 1.2", "\"temperature\": -1")).unwrap();
    let out = kvflow(&["run", &g.to_string_lossy()]);
    assert_clean_failure(&out, &["mixed.jsonl:1", "sampling", "temperature (0 to 100)"]);
}

#[test]
fn verify_refuses_sampling_with_drafting_and_bad_settings_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let spec = "[speculative]\ndrafter = \"ngram\"\ndraft_tokens = 4\n";
    let g = graph(dir.path(), &format!("{AGGREGATED}\n{SAMPLED}\n{spec}"), "mooncake_conversation_head.jsonl");
    let refused = kvflow(&["run", &g.to_string_lossy(), "--verify"]);
    assert_clean_failure(&refused, &["--verify", "temperature = 0.9", "[speculative]", "no exact reference"]);
    // Without --verify it runs, drafting under speculative sampling, and ends clean.
    let out = kvflow(&["run", &g.to_string_lossy(), "--max-output-tokens", "24"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report = crate::common::report(dir.path());
    assert_eq!(report["failed"], 0);
    assert!(report["spec"]["drafted_tokens"].as_u64().unwrap() > 0, "{}", report["spec"]);

    for (from, to, needles) in [
        ("temperature = 0.9", "temperature = -0.5", vec!["sampling.temperature", "0 (greedy) to 100"]),
        ("top_p = 0.95", "top_p = 0.0", vec!["sampling.top_p", "more than 0"]),
        ("seed = 4", "seed = 4\nmin_p = 0.1", vec!["min_p"]),
    ] {
        let text = std::fs::read_to_string(&g).unwrap().replace(from, to);
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, text).unwrap();
        assert_clean_failure(&kvflow(&["check", &bad.to_string_lossy()]), &needles);
    }
}
