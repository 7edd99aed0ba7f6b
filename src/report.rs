//! What a run reports: one record per request (`requests.jsonl`, written as each request ends)
//! and the summary (`report.json`, schema 1), folded from those same records as they end
//! ([`RunSummary`]: counters, sums and histograms, nothing kept per request), so that every figure
//! can be checked against the per-request lines.
//!
//! Latencies are milliseconds from the request's release by the workload driver: TTFT to its
//! first token, TPOT the mean gap between later tokens, end-to-end to its last token, queueing to
//! its first scheduled chunk. Percentiles use the nearest-rank method over measured requests that
//! completed, read from an HDR histogram of microseconds at 3 significant digits (within 0.1% of
//! the exact value); means are exact. Throughput and goodput divide by the measured window: first
//! measured release to last measured completion.

use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
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
    /// Arrival → its second token, the first decoded from T0 (in P/D, on the decode pool after
    /// the handoff: TTFT's T0 leaves from the prefill pool, the transfer shows here).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub second_token_ms: Option<f64>,
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
    /// Of a streamed handoff's transfer, the part that moved while its prefill ran (not part of
    /// TTFT's sum: `transfer_ms` is what was left after T0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transfer_overlapped_ms: Option<f64>,
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

/// What `--verify` found: over the whole run, and per pool (a request counts in every pool it
/// passed through).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct VerifySummary {
    pub checked: usize,
    pub mismatched: usize,
    pub mismatched_ids: Vec<u64>,
    /// The same figures over the requests that passed through each pool.
    #[serde(skip)]
    pub by_pool: BTreeMap<String, VerifySummary>,
}

impl VerifySummary {
    /// Counts one request checked: it `matched` the reference or not.
    pub fn note(&mut self, id: u64, pools: &[String], matched: bool) {
        let count = |s: &mut VerifySummary| {
            s.checked += 1;
            if !matched {
                s.mismatched += 1;
                s.mismatched_ids.push(id);
            }
        };
        count(self);
        for (i, pool) in pools.iter().enumerate() {
            if !pools[..i].contains(pool) {
                count(self.by_pool.entry(pool.clone()).or_default());
            }
        }
    }

    /// The part of the summary about the requests that passed through `pool`.
    pub fn restricted_to(&self, pool: &str) -> VerifySummary {
        self.by_pool.get(pool).cloned().unwrap_or_default()
    }
}

/// The largest latency a [`Latency`] tells apart (2^36 µs, about 19 hours); longer ones count
/// as this long in the percentiles (the mean and the maximum stay exact).
const LATENCY_HIGHEST_US: u64 = 1 << 36;

/// One latency's distribution in memory that does not grow with the requests: an HDR histogram
/// of microseconds at 3 significant digits (so a percentile is within 0.1% of the nearest-rank
/// value it stands for), and the exact count, sum, minimum and maximum.
#[derive(Clone, Debug)]
pub struct Latency {
    histogram: Histogram<u32>,
    sum_ms: f64,
    min_ms: f64,
    max_ms: f64,
}

impl Default for Latency {
    fn default() -> Latency {
        Latency {
            histogram: Histogram::new_with_bounds(1, LATENCY_HIGHEST_US, 3).expect("valid histogram bounds"),
            sum_ms: 0.0,
            min_ms: f64::INFINITY,
            max_ms: f64::NEG_INFINITY,
        }
    }
}

impl Latency {
    /// Counts one value in milliseconds (a value that is not a number is left out).
    pub fn record(&mut self, ms: f64) {
        if !ms.is_finite() {
            return;
        }
        self.histogram.saturating_record((ms * 1000.0).round().max(0.0) as u64);
        self.sum_ms += ms;
        self.min_ms = self.min_ms.min(ms);
        self.max_ms = self.max_ms.max(ms);
    }

    pub fn count(&self) -> u64 {
        self.histogram.len()
    }

    /// The nearest-rank `p`th percentile (ms), within the histogram's precision and never outside
    /// the values seen; `None` when empty.
    pub fn percentile(&self, p: f64) -> Option<f64> {
        if self.count() == 0 {
            return None;
        }
        let us = self.histogram.median_equivalent(self.histogram.value_at_quantile(p / 100.0));
        Some((us as f64 / 1000.0).clamp(self.min_ms, self.max_ms))
    }

    pub fn mean(&self) -> Option<f64> {
        (self.count() > 0).then(|| self.sum_ms / self.count() as f64)
    }

    /// `{"p50", "p90", "p99", "mean"}` in ms, as [`summary`] gives them (`null`s when empty).
    pub fn json(&self) -> Value {
        json!({"p50": self.percentile(50.0), "p90": self.percentile(90.0), "p99": self.percentile(99.0), "mean": self.mean()})
    }
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

/// The figures of `report.json` over a set of requests (the run's, or one pool's), folded in one
/// ended request at a time: counters, sums and [`Latency`] histograms, nothing per request.
#[derive(Clone, Debug)]
pub struct Tally {
    measured: usize,
    completed: usize,
    cancelled: usize,
    warmup_completed: usize,
    ttft: Latency,
    second_token: Latency,
    tpot: Latency,
    e2e: Latency,
    queue: Latency,
    prefill: Latency,
    transfer: Latency,
    first_decode: Latency,
    transfer_overlapped: Latency,
    output_tokens: usize,
    good: usize,
    prompt_tokens: usize,
    cached: usize,
    preemptions: usize,
    failures: BTreeMap<String, usize>,
    /// The measured window: first measured release to last measured completion (ms).
    window_start: f64,
    window_end: f64,
}

impl Default for Tally {
    fn default() -> Tally {
        Tally {
            measured: 0,
            completed: 0,
            cancelled: 0,
            warmup_completed: 0,
            ttft: Latency::default(),
            second_token: Latency::default(),
            tpot: Latency::default(),
            e2e: Latency::default(),
            queue: Latency::default(),
            prefill: Latency::default(),
            transfer: Latency::default(),
            first_decode: Latency::default(),
            transfer_overlapped: Latency::default(),
            output_tokens: 0,
            good: 0,
            prompt_tokens: 0,
            cached: 0,
            preemptions: 0,
            failures: BTreeMap::new(),
            window_start: f64::INFINITY,
            window_end: f64::NEG_INFINITY,
        }
    }
}

impl Tally {
    /// Folds in one request (ended, or never ended when the run stopped).
    pub fn add(&mut self, r: &RequestRecord, slo: &Slo) {
        let completed = r.error.is_none() && r.done_ms.is_some();
        if r.warmup {
            self.warmup_completed += usize::from(completed);
            return;
        }
        self.measured += 1;
        self.prompt_tokens += r.input_len;
        self.cached += r.cached_tokens;
        self.preemptions += r.preemptions;
        self.window_start = self.window_start.min(r.arrival_ms);
        if r.failure.as_deref() == Some(CANCELLED) {
            self.cancelled += 1;
        } else if r.error.is_some() {
            *self.failures.entry(r.failure.clone().unwrap_or_else(|| "unknown".into())).or_default() += 1;
        }
        if !completed {
            return;
        }
        self.completed += 1;
        self.window_end = self.window_end.max(r.done_ms.unwrap_or(f64::NEG_INFINITY));
        self.output_tokens += r.output_tokens.len();
        self.good += usize::from(meets(r, slo));
        let latencies = [
            (&mut self.ttft, r.ttft_ms),
            (&mut self.second_token, r.second_token_ms),
            (&mut self.tpot, r.tpot_ms),
            (&mut self.e2e, r.e2e_ms),
            (&mut self.queue, r.queue_ms),
            (&mut self.prefill, r.prefill_ms),
            (&mut self.transfer, r.transfer_ms),
            (&mut self.first_decode, r.first_decode_ms),
            (&mut self.transfer_overlapped, r.transfer_overlapped_ms),
        ];
        for (latency, value) in latencies {
            if let Some(ms) = value {
                latency.record(ms);
            }
        }
    }

    /// The `report.json` object (schema 1) of these requests; `extra` fields are merged in at
    /// the top level.
    pub fn report(&self, slo: &Slo, verify: &VerifySummary, extra: Value) -> Value {
        let window_s =
            if self.window_end > self.window_start { (self.window_end - self.window_start) / 1000.0 } else { 0.0 };
        let per_s = |n: f64| if window_s > 0.0 { n / window_s } else { 0.0 };
        let mut report = json!({
            "schema": 1,
            "requests": self.measured,
            "completed": self.completed,
            "failed": self.measured - self.completed - self.cancelled,
            "cancelled": self.cancelled,
            "warmup_completed": self.warmup_completed,
            "ttft_ms": self.ttft.json(),
            "second_token_ms": self.second_token.json(),
            "tpot_ms": self.tpot.json(),
            "e2e_ms": self.e2e.json(),
            "queue_ms": self.queue.json(),
            "ttft_split_ms": {
                "queue": self.queue.json(),
                "prefill": self.prefill.json(),
                "transfer": self.transfer.json(),
                "first_decode": self.first_decode.json(),
            },
            // A streamed handoff's transfer while its prefill ran (outside TTFT's sum).
            "transfer_overlapped_ms": self.transfer_overlapped.json(),
            "output_tokens_per_s": per_s(self.output_tokens as f64),
            "goodput_rps": per_s(self.good as f64),
            "prefix_hit_rate": if self.prompt_tokens > 0 { self.cached as f64 / self.prompt_tokens as f64 } else { 0.0 },
            "preemptions": self.preemptions,
            "failures": self.failures,
            "verify": {"checked": verify.checked, "mismatched": verify.mismatched, "mismatched_ids": verify.mismatched_ids},
            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
            "measured_window_s": window_s,
        });
        if let (Some(obj), Value::Object(more)) = (report.as_object_mut(), extra) {
            obj.extend(more);
        }
        report
    }
}

/// What the handoffs of a P/D run moved, per request (warmup included): those with T0 from a
/// prefill pool, their transfer times (T0 sampled → the decode rank took it) and bytes, and the
/// requests failed by a handoff.
#[derive(Clone, Debug, Default)]
pub struct HandoffTally {
    pub moved: usize,
    pub transfer: Latency,
    pub seconds: f64,
    pub bytes: u64,
    pub failed: usize,
}

impl HandoffTally {
    fn add(&mut self, r: &RequestRecord) {
        if r.failure.as_deref().is_some_and(|c| c.starts_with("handoff")) {
            self.failed += 1;
        }
        let Some(t0) = r.t0_ms else { return };
        self.moved += 1;
        if let Some(received) = r.received_ms {
            let ms = (received - t0).max(0.0);
            self.transfer.record(ms);
            self.seconds += ms / 1000.0;
            self.bytes += r.handoff_bytes;
        }
    }
}

/// A run's figures as its requests end: the run's [`Tally`], one per pool, the handoffs, and the
/// warmup requests that failed (they set the exit status). Its memory does not grow with the
/// requests served.
#[derive(Clone, Debug, Default)]
pub struct RunSummary {
    pub slo: Slo,
    pub total: Tally,
    pub pools: BTreeMap<String, Tally>,
    pub handoff: HandoffTally,
    pub warmup_failed: usize,
}

impl RunSummary {
    pub fn new(slo: Slo) -> RunSummary {
        RunSummary { slo, ..Default::default() }
    }

    /// The summary of `records` (each folded in once).
    pub fn of(records: &[RequestRecord], slo: Slo) -> RunSummary {
        let mut s = RunSummary::new(slo);
        for r in records {
            s.add(r);
        }
        s
    }

    /// Folds in one request: into the run's figures and those of every pool it passed through.
    pub fn add(&mut self, r: &RequestRecord) {
        self.total.add(r, &self.slo);
        for (i, pool) in r.pools.iter().enumerate() {
            if !r.pools[..i].contains(pool) {
                self.pools.entry(pool.clone()).or_default().add(r, &self.slo);
            }
        }
        self.handoff.add(r);
        if r.warmup && r.error.is_some() && r.failure.as_deref() != Some(CANCELLED) {
            self.warmup_failed += 1;
        }
    }

    /// The run's `report.json` object (schema 1); `extra` fields are merged in at the top level.
    pub fn report(&self, verify: &VerifySummary, extra: Value) -> Value {
        self.total.report(&self.slo, verify, extra)
    }

    /// One pool's figures, in the same shape (empty when no request passed through it).
    pub fn pool_report(&self, pool: &str, verify: &VerifySummary, extra: Value) -> Value {
        match self.pools.get(pool) {
            Some(tally) => tally.report(&self.slo, verify, extra),
            None => Tally::default().report(&self.slo, verify, extra),
        }
    }
}

/// Latency buckets in seconds (vLLM's TTFT buckets).
pub const BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];

/// One histogram series: counts per bucket of [`BUCKETS`] (the last for values past them), the
/// sum and the count, kept as values come.
#[derive(Clone, Debug, Default)]
pub struct Buckets {
    pub counts: [u64; BUCKETS.len() + 1],
    pub sum: f64,
    pub count: u64,
}

impl Buckets {
    fn observe(&mut self, seconds: f64) {
        let at = BUCKETS.iter().position(|&le| seconds <= le).unwrap_or(BUCKETS.len());
        self.counts[at] += 1;
        self.sum += seconds;
        self.count += 1;
    }

    fn observe_ms(&mut self, ms: Option<f64>) {
        if let Some(ms) = ms {
            self.observe(ms / 1000.0);
        }
    }
}

/// What `/metrics` (`src/server/metrics.rs`) counts over the requests (warmup ones left out), kept
/// as they are released, hand off and end — so rendering reads counters, never the requests.
#[derive(Clone, Debug, Default)]
pub struct MetricsTally {
    pub completed: u64,
    pub failed: u64,
    pub cancelled: u64,
    pub failures: BTreeMap<String, u64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub generated_tokens: u64,
    pub ttft: Buckets,
    pub tpot: Buckets,
    pub e2e: Buckets,
    /// queue, prefill, transfer, first decode.
    pub split: [Buckets; 4],
    pub handoffs: u64,
    pub handoff_bytes: u64,
    pub handoff_latency: Buckets,
}

impl MetricsTally {
    /// A request entered (its prompt tokens count from then on).
    pub fn released(&mut self, r: &RequestRecord) {
        if !r.warmup {
            self.prompt_tokens += r.input_len as u64;
        }
    }

    /// A request was handed off from a prefill pool (counted once per request).
    pub fn handed_off(&mut self, warmup: bool, bytes: u64) {
        if !warmup {
            self.handoffs += 1;
            self.handoff_bytes += bytes;
        }
    }

    /// A handed-off request's handoff was taken `ms` after its T0.
    pub fn transferred(&mut self, warmup: bool, ms: f64) {
        if !warmup {
            self.handoff_latency.observe(ms / 1000.0);
        }
    }

    /// A request ended, with its record complete but for a handoff report still to come.
    pub fn ended(&mut self, r: &RequestRecord) {
        if r.warmup {
            return;
        }
        self.cached_tokens += r.cached_tokens as u64;
        if r.error.is_none() && r.done_ms.is_some() {
            self.completed += 1;
            self.generated_tokens += r.output_tokens.len() as u64;
            self.ttft.observe_ms(r.ttft_ms);
            self.tpot.observe_ms(r.tpot_ms);
            self.e2e.observe_ms(r.e2e_ms);
            for (series, ms) in self.split.iter_mut().zip([r.queue_ms, r.prefill_ms, r.transfer_ms, r.first_decode_ms])
            {
                series.observe_ms(ms);
            }
        } else if r.failure.as_deref() == Some(CANCELLED) {
            self.cancelled += 1;
        } else {
            self.failed += 1;
            if r.error.is_some() {
                *self.failures.entry(r.failure.clone().unwrap_or_else(|| "unknown".into())).or_default() += 1;
            }
        }
    }
}

/// The `report.json` object (schema 1) of `records`. `extra` fields are merged in at the top level.
pub fn build_report(records: &[RequestRecord], slo: &Slo, verify: &VerifySummary, extra: Value) -> Value {
    RunSummary::of(records, *slo).report(verify, extra)
}

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

/// Writes `report.json` into `dir` (created if missing); `requests.jsonl` is written as the
/// requests end ([`crate::runtime::records_file::RecordsFile`]).
pub fn write_report(dir: &Path, report: &Value) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("report.json"), serde_json::to_string_pretty(report)? + "\n")
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

    /// Nearest-rank percentiles and mean of `values` (`null`s when empty), exact: the reference
    /// the histograms are checked against.
    fn summary(values: &[f64]) -> Value {
        if values.is_empty() {
            return json!({"p50": null, "p90": null, "p99": null, "mean": null});
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let pct = |p: f64| v[((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        json!({"p50": pct(50.0), "p90": pct(90.0), "p99": pct(99.0), "mean": v.iter().sum::<f64>() / v.len() as f64})
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
    fn histogram_percentiles_are_the_nearest_rank_within_a_thousandth_and_the_mean_is_exact() {
        let values: Vec<f64> = (1..=1000).map(|i| f64::from(i) * 0.731 + 0.0042).collect();
        let mut latency = Latency::default();
        for &v in values.iter().rev() {
            latency.record(v);
        }
        let exact = summary(&values);
        for p in ["p50", "p90", "p99"] {
            let (got, want) = (latency.json()[p].as_f64().unwrap(), exact[p].as_f64().unwrap());
            assert!((got - want).abs() <= want * 1e-3, "{p}: {got} against {want}");
        }
        let mean = exact["mean"].as_f64().unwrap();
        assert!((latency.mean().unwrap() - mean).abs() < 1e-9);
        let top = latency.percentile(100.0).unwrap();
        assert!(top <= values[999] && top >= values[999] * (1.0 - 1e-3), "{top}: never past the largest value");
        assert!(Latency::default().json()["p50"].is_null());
        // A value past the histogram's range still counts, at its top.
        latency.record(1e9);
        assert_eq!(latency.count(), 1001);
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
