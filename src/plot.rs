//! `kvflow plot REPORT_DIR...` (and `--plot` on `run` and `compare`): PNG charts of one or several
//! runs, each run a labelled line — TTFT and TPOT CDFs, output tokens/s over time, and each pool's
//! KV use over time. They are drawn from `requests.jsonl` and `report.json` (its `kv_usage`
//! timeline, sampled from the ranks' gauges while the run went), with plotters and a bundled font
//! (DejaVu Sans, assets/fonts), so a machine without fonts draws the same picture.

use crate::report::RequestRecord;
use anyhow::{anyhow, bail, Context, Result};
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// Every PNG is this size.
pub const WIDTH: u32 = 960;
pub const HEIGHT: u32 = 540;

/// One run, as the charts read it.
pub struct RunData {
    pub label: String,
    pub records: Vec<RequestRecord>,
    /// `(seconds since the run started, [(pool, share of its KV blocks held)])`.
    pub kv_usage: Vec<(f64, Vec<(String, f64)>)>,
}

/// The fields of a `requests.jsonl` line the charts read: a line without one is from a report
/// `kvflow plot` does not know (its defaults would draw empty charts).
const RECORD_FIELDS: [&str; 6] = ["warmup", "arrival_ms", "ttft_ms", "tpot_ms", "output_tokens", "error"];

/// Reads a report folder (`report.json` and `requests.jsonl`); the label is the folder's name.
/// A folder whose files lack what the charts read is an error naming the file and the fields.
pub fn read_run(dir: &Path) -> Result<RunData> {
    let lines = std::fs::read_to_string(dir.join("requests.jsonl"))
        .with_context(|| format!("{}: no requests.jsonl (is it a report folder?)", dir.display()))?;
    let mut records = Vec::new();
    for (i, line) in lines.lines().enumerate() {
        let at = || format!("{}/requests.jsonl:{}", dir.display(), i + 1);
        let value: serde_json::Value = serde_json::from_str(line).with_context(at)?;
        let missing: Vec<&str> = RECORD_FIELDS.into_iter().filter(|f| value.get(f).is_none()).collect();
        if !missing.is_empty() {
            bail!("{}: not a request record kvflow plot knows: no `{}`", at(), missing.join("`, `"));
        }
        records.push(serde_json::from_value::<RequestRecord>(value).with_context(at)?);
    }
    if records.is_empty() {
        bail!("{}/requests.jsonl: no request records: nothing to plot", dir.display());
    }
    let report_path = dir.join("report.json");
    let report: serde_json::Value = std::fs::read_to_string(&report_path)
        .with_context(|| format!("{}: cannot read it (the KV chart draws its `kv_usage`)", report_path.display()))
        .and_then(|t| serde_json::from_str(&t).with_context(|| format!("{}: not JSON", report_path.display())))?;
    let samples = report["kv_usage"].as_array().ok_or_else(|| {
        anyhow!(
            "{}: no `kv_usage` list (a report kvflow plot does not know: it draws the KV chart from it)",
            report_path.display()
        )
    })?;
    let kv_usage = samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let t = s["t_s"].as_f64();
            let pools = s["pools"].as_object().and_then(|pools| {
                pools.iter().map(|(k, v)| Some((k.clone(), v.as_f64()?))).collect::<Option<Vec<_>>>()
            });
            match (t, pools) {
                (Some(t), Some(pools)) => Ok((t, pools)),
                _ => Err(anyhow!(
                    "{}: `kv_usage[{i}]` is not {{\"t_s\": seconds, \"pools\": {{pool: share}}}}",
                    report_path.display()
                )),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let label = dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned());
    Ok(RunData { label, records, kv_usage })
}

/// Writes the charts of `runs` into `out`; returns the files written.
pub fn plot(runs: &[RunData], out: &Path) -> Result<Vec<PathBuf>> {
    if runs.is_empty() {
        bail!("nothing to plot");
    }
    register_font();
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let cdf = |f: fn(&RequestRecord) -> Option<f64>| -> Vec<(String, Vec<(f64, f64)>)> {
        runs.iter()
            .map(|r| {
                let mut v: Vec<f64> =
                    r.records.iter().filter(|x| x.error.is_none() && !x.warmup).filter_map(f).collect();
                v.sort_by(f64::total_cmp);
                let n = v.len().max(1) as f64;
                (r.label.clone(), v.iter().enumerate().map(|(i, &x)| (x, (i + 1) as f64 / n)).collect())
            })
            .collect()
    };
    let mut written = Vec::new();
    let mut draw = |name: &str, title: &str, x: &str, y: &str, series: Vec<(String, Vec<(f64, f64)>)>| -> Result<()> {
        let path = out.join(name);
        chart(&path, title, x, y, &series).with_context(|| format!("cannot draw {}", path.display()))?;
        written.push(path);
        Ok(())
    };
    draw("ttft_cdf.png", "Time to first token (CDF)", "TTFT (ms)", "share of requests", cdf(|r| r.ttft_ms))?;
    draw("tpot_cdf.png", "Time per output token (CDF)", "TPOT (ms)", "share of requests", cdf(|r| r.tpot_ms))?;
    let throughput = runs.iter().map(|r| (r.label.clone(), tokens_per_second(&r.records))).collect();
    draw("throughput.png", "Output tokens/s over time", "time (s)", "tokens/s", throughput)?;
    let kv = runs
        .iter()
        .flat_map(|r| {
            let pools: Vec<String> =
                r.kv_usage.first().map(|(_, p)| p.iter().map(|(n, _)| n.clone()).collect()).unwrap_or_default();
            pools.into_iter().map(move |pool| {
                let line = r
                    .kv_usage
                    .iter()
                    .filter_map(|(t, p)| p.iter().find(|(n, _)| *n == pool).map(|(_, share)| (*t, 100.0 * share)))
                    .collect();
                (format!("{} / {pool}", r.label), line)
            })
        })
        .collect();
    draw("kv_usage.png", "KV blocks held over time", "time (s)", "% of the pool's blocks", kv)?;
    Ok(written)
}

/// Output tokens/s in time bins: each completed request's tokens spread evenly from its first
/// token to its last.
fn tokens_per_second(records: &[RequestRecord]) -> Vec<(f64, f64)> {
    let spans: Vec<(f64, f64, f64)> = records
        .iter()
        .filter(|r| r.error.is_none())
        .filter_map(|r| {
            let first = r.arrival_ms + r.ttft_ms?;
            let last = r.done_ms.unwrap_or(first).max(first);
            Some((first / 1000.0, last / 1000.0, r.output_tokens.len() as f64))
        })
        .collect();
    let end = spans.iter().map(|s| s.1).fold(0.0, f64::max);
    if end <= 0.0 {
        return Vec::new();
    }
    let width = (end / 60.0).max(0.05);
    let bins = (end / width).ceil() as usize + 1;
    let mut tokens = vec![0.0; bins];
    for (a, b, n) in spans {
        if b - a < 1e-9 {
            tokens[(a / width) as usize] += n;
            continue;
        }
        for (i, slot) in tokens.iter_mut().enumerate() {
            let (lo, hi) = (i as f64 * width, (i + 1) as f64 * width);
            let overlap = (b.min(hi) - a.max(lo)).max(0.0);
            *slot += n * overlap / (b - a);
        }
    }
    tokens.iter().enumerate().map(|(i, n)| ((i as f64 + 0.5) * width, n / width)).collect()
}

/// One chart of lines (a series each) into `path`.
pub fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<()> {
    register_font();
    chart(path, title, x_label, y_label, series).with_context(|| format!("cannot draw {}", path.display()))
}

fn chart(path: &Path, title: &str, x_label: &str, y_label: &str, series: &[(String, Vec<(f64, f64)>)]) -> Result<()> {
    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let points = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x_max, mut y_max) = (0.0f64, 0.0f64);
    for &(x, y) in points {
        x_max = x_max.max(x);
        y_max = y_max.max(y);
    }
    let (x_max, y_max) = (if x_max > 0.0 { x_max * 1.05 } else { 1.0 }, if y_max > 0.0 { y_max * 1.05 } else { 1.0 });
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (i, (label, line)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba().stroke_width(2);
        chart
            .draw_series(LineSeries::new(line.iter().copied(), color))
            .map_err(|e| anyhow!("{e}"))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
    }
    if !series.is_empty() {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
    }
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let bytes: &'static [u8] = include_bytes!("../assets/fonts/DejaVuSans.ttf");
        if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_err() {
            tracing::error!("the bundled font could not be read: charts will have no text");
        }
    });
}
