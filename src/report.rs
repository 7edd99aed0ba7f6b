//! What a run reports: one record per request (`requests.jsonl`) and the summary
//! (`report.json`, schema 1), computed from the records alone so that every figure can be
//! checked against the per-request lines.
//!
//! Latencies are milliseconds from the request's release by the workload driver: TTFT to its
//! first token, TPOT the mean gap between later tokens, end-to-end to its last token, queueing to
//! its first scheduled chunk. Percentiles use the nearest-rank method over measured requests that
//! completed. Throughput and goodput divide by the measured window: first measured release to
//! last measured completion.

use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// One request's outcome, as `requests.jsonl` prints it (and `kvflow plot` reads it back).
#[derive(Clone, Debug, Default, PartialEq, Serialize, serde::Deserialize)]
#[serde(default)]
pub struct RequestRecord {
    pub id: u64,
    pub warmup: bool,
    pub arrival_ms: f64,
    pub input_len: usize,
    pub output_len: usize,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub queue_ms: Option<f64>,
    /// The pool it entered.
    pub pool: String,
    /// Every pool it passed through, in order.
    pub pools: Vec<String>,
    /// Its rank in the last pool it ran in.
    pub rank: Option<usize>,
    pub cached_tokens: usize,
    pub preemptions: usize,
    pub prompt_tokens: Vec<u32>,
    pub output_tokens: Vec<u32>,
    pub error: Option<String>,
    /// Failure cause (`does-not-fit`, …) when `error` is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// Handed off (P/D): when its prefill's first chunk ran and when T0 became known (ms since
    /// the run started), and the bytes its handoff moved.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_started_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub t0_ms: Option<f64>,
    #[serde(skip_serializing_if = "is_zero")]
    pub handoff_bytes: u64,
    /// The prefill rank that handed it off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_rank: Option<usize>,
    /// Preemptions on the prefill side of a handoff (`preemptions` counts both sides).
    #[serde(skip)]
    pub prefill_preemptions: usize,
    /// When a decode rank took its handoff (ms since the run started).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub received_ms: Option<f64>,
    /// Where the time to its first two tokens went (completed requests): `queue_ms` above
    /// (arrival → first prefill chunk), then these. TTFT (to T0) is queue + prefill; a P/D
    /// handoff adds transfer (T0 sampled → the decode rank took it) before the first decode
    /// (T0 in hand → the token decoded from it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_decode_ms: Option<f64>,
    /// When the run learnt that it ended — finished, failed or cancelled (ms since the run
    /// started).
    pub ended_ms: Option<f64>,
    /// Hash of the logits' bit patterns at every sampled position (compared by `--verify`).
    #[serde(skip)]
    pub logits_hash: u64,
    /// When the last token came (ms since the run started).
    #[serde(skip)]
    pub done_ms: Option<f64>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The failure cause of a cancelled request (counted as `cancelled`, not `failed`).
pub const CANCELLED: &str = "cancelled";

/// Targets that make a request count as good.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

/// What `--verify` found.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct VerifySummary {
    pub checked: usize,
    pub mismatched: usize,
    pub mismatched_ids: Vec<u64>,
    /// Every request it checked.
    #[serde(skip)]
    pub checked_ids: Vec<u64>,
}

impl VerifySummary {
    /// The part of the summary about `records` (one pool's).
    pub fn restricted_to(&self, records: &[&RequestRecord]) -> VerifySummary {
        let ids: std::collections::HashSet<u64> = records.iter().map(|r| r.id).collect();
        let keep = |v: &[u64]| v.iter().copied().filter(|i| ids.contains(i)).collect::<Vec<_>>();
        let (checked_ids, mismatched_ids) = (keep(&self.checked_ids), keep(&self.mismatched_ids));
        VerifySummary { checked: checked_ids.len(), mismatched: mismatched_ids.len(), mismatched_ids, checked_ids }
    }
}

/// Nearest-rank percentiles and mean of `values` (`null`s when empty).
pub fn summary(values: &[f64]) -> Value {
    if values.is_empty() {
        return json!({"p50": null, "p90": null, "p99": null, "mean": null});
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let pct = |p: f64| v[((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    json!({"p50": pct(50.0), "p90": pct(90.0), "p99": pct(99.0), "mean": v.iter().sum::<f64>() / v.len() as f64})
}

fn meets(r: &RequestRecord, slo: &Slo) -> bool {
    let ttft_ok = match (slo.ttft_ms, r.ttft_ms) {
        (Some(target), Some(v)) => v <= target,
        (Some(_), None) => false,
        (None, _) => true,
    };
    // A one-token request has no TPOT: it cannot miss that target.
    let tpot_ok = match (slo.tpot_ms, r.tpot_ms) {
        (Some(target), Some(v)) => v <= target,
        _ => true,
    };
    ttft_ok && tpot_ok
}

/// The `report.json` object (schema 1). `extra` fields are merged in at the top level.
pub fn build_report(records: &[RequestRecord], slo: &Slo, verify: &VerifySummary, extra: Value) -> Value {
    summarize(&records.iter().collect::<Vec<_>>(), slo, verify, extra)
}

/// [`build_report`]'s figures over any subset of the records (a pool's).
pub fn summarize(records: &[&RequestRecord], slo: &Slo, verify: &VerifySummary, extra: Value) -> Value {
    let measured: Vec<&RequestRecord> = records.iter().copied().filter(|r| !r.warmup).collect();
    let completed: Vec<&RequestRecord> =
        measured.iter().copied().filter(|r| r.error.is_none() && r.done_ms.is_some()).collect();
    let cancelled = measured.iter().filter(|r| r.failure.as_deref() == Some(CANCELLED)).count();
    let failed = measured.len() - completed.len() - cancelled;
    let collect =
        |f: fn(&RequestRecord) -> Option<f64>| -> Vec<f64> { completed.iter().filter_map(|r| f(r)).collect() };
    let window_start = measured.iter().map(|r| r.arrival_ms).fold(f64::INFINITY, f64::min);
    let window_end = completed.iter().filter_map(|r| r.done_ms).fold(f64::NEG_INFINITY, f64::max);
    let window_s = if window_end > window_start { (window_end - window_start) / 1000.0 } else { 0.0 };
    let per_s = |n: f64| if window_s > 0.0 { n / window_s } else { 0.0 };
    let output_tokens: usize = completed.iter().map(|r| r.output_tokens.len()).sum();
    let good = completed.iter().filter(|r| meets(r, slo)).count();
    let prompt_tokens: usize = measured.iter().map(|r| r.input_len).sum();
    let cached: usize = measured.iter().map(|r| r.cached_tokens).sum();
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    for r in measured.iter().filter(|r| r.error.is_some() && r.failure.as_deref() != Some(CANCELLED)) {
        *failures.entry(r.failure.clone().unwrap_or_else(|| "unknown".into())).or_default() += 1;
    }
    let mut report = json!({
        "schema": 1,
        "requests": measured.len(),
        "completed": completed.len(),
        "failed": failed,
        "cancelled": cancelled,
        "warmup_completed": records.iter().filter(|r| r.warmup && r.error.is_none() && r.done_ms.is_some()).count(),
        "ttft_ms": summary(&collect(|r| r.ttft_ms)),
        "tpot_ms": summary(&collect(|r| r.tpot_ms)),
        "e2e_ms": summary(&collect(|r| r.e2e_ms)),
        "queue_ms": summary(&collect(|r| r.queue_ms)),
        "ttft_split_ms": {
            "queue": summary(&collect(|r| r.queue_ms)),
            "prefill": summary(&collect(|r| r.prefill_ms)),
            "transfer": summary(&collect(|r| r.transfer_ms)),
            "first_decode": summary(&collect(|r| r.first_decode_ms)),
        },
        "output_tokens_per_s": per_s(output_tokens as f64),
        "goodput_rps": per_s(good as f64),
        "prefix_hit_rate": if prompt_tokens > 0 { cached as f64 / prompt_tokens as f64 } else { 0.0 },
        "preemptions": measured.iter().map(|r| r.preemptions).sum::<usize>(),
        "failures": failures,
        "verify": {"checked": verify.checked, "mismatched": verify.mismatched, "mismatched_ids": verify.mismatched_ids},
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "measured_window_s": window_s,
    });
    if let (Some(obj), Value::Object(more)) = (report.as_object_mut(), extra) {
        obj.extend(more);
    }
    report
}

/// Writes `report.json` and `requests.jsonl` into `dir` (created if missing).
/// Makes sure `dir` can take `report.json` and `requests.jsonl` — before the run, so an
/// unwritable `--out` is found before any work rather than after all of it.
pub fn check_output_dir(dir: &Path) -> Result<(), String> {
    if dir.exists() && !dir.is_dir() {
        return Err(format!("{} exists and is not a folder", dir.display()));
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    for name in ["report.json", "requests.jsonl"] {
        let path = dir.join(name);
        if path.is_dir() {
            return Err(format!("{} is a folder; the run writes a file there", path.display()));
        }
    }
    let probe = dir.join(".kvflow-write-check");
    std::fs::write(&probe, b"").map_err(|e| format!("cannot write into {}: {e}", dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

pub fn write_outputs(dir: &Path, report: &Value, records: &[RequestRecord]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("report.json"), serde_json::to_string_pretty(report)? + "\n")?;
    let mut out = std::io::BufWriter::new(std::fs::File::create(dir.join("requests.jsonl"))?);
    for r in records {
        serde_json::to_writer(&mut out, r)?;
        out.write_all(b"\n")?;
    }
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(id: u64, arrival: f64, ttft: f64, tpot: Option<f64>, tokens: usize, done: f64) -> RequestRecord {
        RequestRecord {
            id,
            arrival_ms: arrival,
            ttft_ms: Some(ttft),
            tpot_ms: tpot,
            e2e_ms: Some(done - arrival),
            output_tokens: vec![1; tokens],
            output_len: tokens,
            input_len: 10,
            done_ms: Some(done),
            ..Default::default()
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let s = summary(&(1..=100).map(f64::from).collect::<Vec<_>>());
        assert_eq!(s["p50"], 50.0);
        assert_eq!(s["p99"], 99.0);
        assert_eq!(s["mean"], 50.5);
        assert!(summary(&[]).get("p50").unwrap().is_null());
    }

    #[test]
    fn warmup_is_not_measured_and_failures_count_by_cause() {
        let mut records = vec![done(0, 0.0, 5.0, None, 1, 10.0), done(1, 0.0, 5.0, Some(1.0), 4, 1000.0)];
        records[0].warmup = true;
        records.push(RequestRecord {
            id: 2,
            error: Some("no".into()),
            failure: Some("does-not-fit".into()),
            ..Default::default()
        });
        let r = build_report(&records, &Slo::default(), &VerifySummary::default(), json!({}));
        assert_eq!(r["requests"], 2);
        assert_eq!(r["completed"], 1);
        assert_eq!(r["failed"], 1);
        assert_eq!(r["warmup_completed"], 1);
        assert_eq!(r["failures"]["does-not-fit"], 1);
        assert_eq!(r["output_tokens_per_s"], 4.0);
    }

    #[test]
    fn goodput_counts_only_requests_within_both_targets() {
        let records = vec![
            done(0, 0.0, 5.0, Some(1.0), 3, 1000.0),
            done(1, 0.0, 50.0, Some(1.0), 3, 1000.0),
            done(2, 0.0, 5.0, Some(9.0), 3, 1000.0),
        ];
        let slo = Slo { ttft_ms: Some(10.0), tpot_ms: Some(2.0) };
        let r = build_report(&records, &slo, &VerifySummary::default(), json!({}));
        assert_eq!(r["goodput_rps"], 1.0);
    }
}
