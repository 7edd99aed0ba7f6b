//! `kvflow compare`: the same trace and seed through each graph in turn, then the reports'
//! figures side by side (and, with --plot, every run on each chart).

use super::run::{checked_graph, plot_runs, run_checked, RunFlags};
use anyhow::Result;
use kvflow::signals::Interrupts;
use serde_json::Value;
use std::path::PathBuf;

/// The table's rows: a label and the report keys leading to its figure.
const ROWS: &[(&str, &[&str])] = &[
    ("requests", &["requests"]),
    ("completed", &["completed"]),
    ("failed", &["failed"]),
    ("TTFT p50 ms", &["ttft_ms", "p50"]),
    ("TTFT p99 ms", &["ttft_ms", "p99"]),
    ("2nd token p50 ms", &["second_token_ms", "p50"]),
    ("TPOT p50 ms", &["tpot_ms", "p50"]),
    ("TPOT p99 ms", &["tpot_ms", "p99"]),
    ("queue p50 ms", &["queue_ms", "p50"]),
    ("transfer after T0 p50 ms", &["ttft_split_ms", "transfer", "p50"]),
    ("transfer overlapped p50 ms", &["transfer_overlapped_ms", "p50"]),
    ("e2e p50 ms", &["e2e_ms", "p50"]),
    ("output tokens/s", &["output_tokens_per_s"]),
    ("goodput req/s", &["goodput_rps"]),
    ("prefix hit rate", &["prefix_hit_rate"]),
    ("handoffs", &["handoff", "count"]),
    ("handoff bytes", &["handoff", "bytes"]),
    ("verify mismatched", &["verify", "mismatched"]),
];

/// `kvflow compare`: every graph checked with its overrides (a refused one refuses the
/// comparison before any runs), then each in turn, then the figures side by side; the worst exit
/// status.
pub fn compare(graphs: &[PathBuf], flags: &RunFlags, interrupts: &Interrupts) -> Result<i32> {
    let mut names: Vec<String> = Vec::new();
    let mut checked = Vec::new();
    for (i, path) in graphs.iter().enumerate() {
        let mut name = path.file_stem().map_or("graph".into(), |s| s.to_string_lossy().into_owned());
        if names.contains(&name) {
            name = format!("{name}-{}", i + 1); // two graphs of one name get their own reports
        }
        let mut flags = flags.clone();
        flags.out = flags.out.as_ref().map(|dir| dir.join(&name));
        checked.push(checked_graph(path, &flags, interrupts)?);
        names.push(name);
    }
    let mut columns: Vec<(String, Value)> = Vec::new();
    let mut out_dirs = Vec::new();
    let mut worst = 0;
    for ((path, (graph, opts)), name) in graphs.iter().zip(&checked).zip(names) {
        eprintln!("== {}", path.display());
        let (code, report, out_dir) = run_checked(graph, opts, interrupts)?;
        out_dirs.push(out_dir);
        worst = worst.max(code);
        columns.push((name, report.unwrap_or_default()));
        if interrupts.exit_status().is_some() {
            break;
        }
    }
    print_table(&columns);
    if flags.plot {
        let out = flags.out.clone().unwrap_or_else(|| PathBuf::from("out/compare"));
        plot_runs(&out_dirs, &out)?;
    }
    Ok(worst)
}

/// One column a run (named), one row a figure of `ROWS`, on standard output.
fn print_table(columns: &[(String, Value)]) {
    let width = columns.iter().map(|(n, _)| n.len()).max().unwrap_or(8).max(10);
    let mut header = format!("{:<18}", "");
    for (name, _) in columns {
        header.push_str(&format!(" {name:>width$}"));
    }
    println!("{header}");
    for (label, path) in ROWS {
        let mut line = format!("{label:<18}");
        for (_, report) in columns {
            line.push_str(&format!(" {:>width$}", figure(report, path)));
        }
        println!("{line}");
    }
}

/// The figure at `path` in a report: whole numbers without decimals, others with two, "-" when
/// the report has none.
fn figure(report: &Value, path: &[&str]) -> String {
    let mut v = report;
    for k in path {
        v = &v[*k];
    }
    match v {
        Value::Number(n) => {
            n.as_f64().map_or(n.to_string(), |f| if f.fract() == 0.0 { format!("{f:.0}") } else { format!("{f:.2}") })
        }
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}
