//! Charts: `kvflow run --plot`, `kvflow compare --plot` and `kvflow plot` write PNGs that decode
//! as PNG of the size `kvflow::plot` draws, one per chart, and `plot` names a folder that is not a
//! report.

use crate::common::{kvflow, repo};
use crate::runtime::HEAVY;
use std::path::Path;

const CHARTS: [&str; 4] = ["ttft_cdf.png", "tpot_cdf.png", "throughput.png", "kv_usage.png"];

/// Each chart in `dir` decodes as a PNG of WIDTH × HEIGHT with more than one colour in it.
fn assert_charts(dir: &Path) {
    for name in CHARTS {
        let file = std::fs::File::open(dir.join(name)).unwrap_or_else(|e| panic!("{}/{name}: {e}", dir.display()));
        let mut reader = png::Decoder::new(std::io::BufReader::new(file)).read_info().expect("a PNG");
        let mut pixels = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut pixels).expect("its pixels decode");
        assert_eq!((info.width, info.height), (kvflow::plot::WIDTH, kvflow::plot::HEIGHT), "{name}");
        let first = &pixels[..3];
        assert!(pixels.chunks(3).any(|p| p != first), "{name} is blank");
    }
}

#[test]
fn run_compare_and_plot_write_charts_that_decode_as_png() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    let graph = repo().join("graphs/aggregated-2.toml");
    let out = kvflow(&["run", graph.to_str().unwrap(), "--limit", "6", "--out", one.to_str().unwrap(), "--plot"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_charts(&one);
    let report = crate::common::report_in(&one);
    assert!(report["kv_usage"].as_array().is_some_and(|s| !s.is_empty()), "the KV timeline is sampled");
    let pd = repo().join("graphs/pd-1p1d.toml");
    let cmp = dir.path().join("cmp");
    let args = [
        "compare",
        graph.to_str().unwrap(),
        pd.to_str().unwrap(),
        "--limit",
        "6",
        "--out",
        cmp.to_str().unwrap(),
        "--plot",
    ];
    let out = kvflow(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_charts(&cmp);
    let both = dir.path().join("both");
    std::fs::rename(cmp.join("pd-1p1d"), &two).unwrap();
    let out = kvflow(&["plot", one.to_str().unwrap(), two.to_str().unwrap(), "--out", both.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_charts(&both);
    let out = kvflow(&["plot", dir.path().to_str().unwrap()]);
    crate::common::assert_clean_failure(&out, &["no requests.jsonl"]);
}

#[test]
fn plot_refuses_a_folder_whose_report_it_does_not_know() {
    let dir = tempfile::tempdir().unwrap();
    // Another tool's lines: JSON objects without the fields the charts read.
    let foreign = dir.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("requests.jsonl"), "{\"latency\": 1.5}\n").unwrap();
    std::fs::write(foreign.join("report.json"), "{}").unwrap();
    let out = kvflow(&["plot", foreign.to_str().unwrap(), "--out", dir.path().join("charts").to_str().unwrap()]);
    crate::common::assert_clean_failure(
        &out,
        &["requests.jsonl:1", "`warmup`, `arrival_ms`, `ttft_ms`, `tpot_ms`, `output_tokens`, `error`"],
    );
    // Records it knows, beside a report.json without the KV timeline.
    let record = "{\"id\": 0, \"warmup\": false, \"arrival_ms\": 0.0, \"ttft_ms\": 5.0, \"tpot_ms\": 1.0, \
                  \"output_tokens\": [1, 2], \"error\": null}\n";
    std::fs::write(foreign.join("requests.jsonl"), record).unwrap();
    let out = kvflow(&["plot", foreign.to_str().unwrap(), "--out", dir.path().join("charts").to_str().unwrap()]);
    crate::common::assert_clean_failure(&out, &["report.json", "no `kv_usage`"]);
    std::fs::remove_file(foreign.join("report.json")).unwrap();
    let out = kvflow(&["plot", foreign.to_str().unwrap(), "--out", dir.path().join("charts").to_str().unwrap()]);
    crate::common::assert_clean_failure(&out, &["report.json", "cannot read it"]);
    std::fs::write(foreign.join("requests.jsonl"), "").unwrap();
    let out = kvflow(&["plot", foreign.to_str().unwrap()]);
    crate::common::assert_clean_failure(&out, &["no request records"]);
    assert!(!dir.path().join("charts").exists(), "no charts drawn");
}
