//! `/metrics`: the run in Prometheus' text format, from the same records `report.json` is built
//! from (so its counters agree with the report's), the rank gauges every rank updates at each
//! step, and the server's own refusals. Names follow vLLM's (`vllm:…`) where one exists.

use crate::report::{RequestRecord, CANCELLED};
use kvflow_operators::rank::RankGauges;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Latency buckets in seconds (vLLM's TTFT buckets).
const BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];

pub use crate::runtime::front::PoolGauges;

/// What `/metrics` reads beside the records.
pub struct Live<'a> {
    pub in_flight: usize,
    pub pools: &'a PoolGauges,
    /// HTTP answers that refused a request, by status.
    pub refused: &'a BTreeMap<u16, u64>,
    pub draining: bool,
}

struct Out(String);

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &str, value: f64) {
        let labels = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(self.0, "{name}{labels} {value}");
    }

    fn histogram(&mut self, name: &str, help: &str, series: &[(String, Vec<f64>)]) {
        self.family(name, "histogram", help);
        for (labels, seconds) in series {
            let sep = if labels.is_empty() { "" } else { "," };
            for le in BUCKETS {
                let n = seconds.iter().filter(|&&s| s <= le).count();
                self.sample(&format!("{name}_bucket"), &format!("{labels}{sep}le=\"{le}\""), n as f64);
            }
            self.sample(&format!("{name}_bucket"), &format!("{labels}{sep}le=\"+Inf\""), seconds.len() as f64);
            self.sample(&format!("{name}_sum"), labels, seconds.iter().sum());
            self.sample(&format!("{name}_count"), labels, seconds.len() as f64);
        }
    }
}

/// The metrics text.
pub fn render<'r>(records: impl Iterator<Item = &'r RequestRecord>, live: &Live) -> String {
    let records: Vec<&RequestRecord> = records.filter(|r| !r.warmup).collect();
    let ended: Vec<&&RequestRecord> = records.iter().filter(|r| r.ended_ms.is_some()).collect();
    let completed: Vec<&RequestRecord> =
        ended.iter().map(|r| **r).filter(|r| r.error.is_none() && r.done_ms.is_some()).collect();
    let cancelled = ended.iter().filter(|r| r.failure.as_deref() == Some(CANCELLED)).count();
    let failed = ended.len() - completed.len() - cancelled;
    let mut failures: BTreeMap<&str, usize> = BTreeMap::new();
    for r in ended.iter().filter(|r| r.error.is_some() && r.failure.as_deref() != Some(CANCELLED)) {
        *failures.entry(r.failure.as_deref().unwrap_or("unknown")).or_default() += 1;
    }
    let mut o = Out(String::new());
    o.family(
        "kvflow:requests_total",
        "counter",
        "Requests that entered a pool and ended, by outcome (report.json's completed, failed, cancelled).",
    );
    for (outcome, n) in [("completed", completed.len()), ("failed", failed), ("cancelled", cancelled)] {
        o.sample("kvflow:requests_total", &format!("outcome=\"{outcome}\""), n as f64);
    }
    o.family("kvflow:request_failures_total", "counter", "Failed requests by cause (report.json's failures).");
    for (cause, n) in &failures {
        o.sample("kvflow:request_failures_total", &format!("cause=\"{}\"", escape(cause)), *n as f64);
    }
    o.family("kvflow:http_requests_refused_total", "counter", "Requests refused before entering a pool, by HTTP status (400 bad input, 404 unknown model, 429 queue full, 503 draining).");
    for (status, n) in live.refused {
        o.sample("kvflow:http_requests_refused_total", &format!("status=\"{status}\""), *n as f64);
    }
    o.family("vllm:num_requests_running", "gauge", "Requests in flight: entered a pool, not ended.");
    o.sample("vllm:num_requests_running", "", live.in_flight as f64);
    o.family("kvflow:draining", "gauge", "1 while the server drains (after SIGTERM), refusing new requests.");
    o.sample("kvflow:draining", "", f64::from(u8::from(live.draining)));
    let prompt: usize = records.iter().map(|r| r.input_len).sum();
    let cached: usize = records.iter().map(|r| r.cached_tokens).sum();
    let generated: usize = completed.iter().map(|r| r.output_tokens.len()).sum();
    o.family("vllm:prompt_tokens_total", "counter", "Prompt tokens of every request that entered a pool.");
    o.sample("vllm:prompt_tokens_total", "", prompt as f64);
    o.family("vllm:generation_tokens_total", "counter", "Output tokens of completed requests.");
    o.sample("vllm:generation_tokens_total", "", generated as f64);
    o.family("kvflow:prefix_cache_hit_tokens_total", "counter", "Prompt tokens reused from the prefix cache.");
    o.sample("kvflow:prefix_cache_hit_tokens_total", "", cached as f64);
    o.family(
        "vllm:prefix_cache_hit_rate",
        "gauge",
        "Prompt tokens reused from the prefix cache over prompt tokens (report.json's prefix_hit_rate).",
    );
    o.sample("vllm:prefix_cache_hit_rate", "", if prompt > 0 { cached as f64 / prompt as f64 } else { 0.0 });
    let secs = |f: fn(&RequestRecord) -> Option<f64>| -> Vec<(String, Vec<f64>)> {
        vec![(String::new(), completed.iter().filter_map(|r| f(r)).map(|ms| ms / 1000.0).collect())]
    };
    o.histogram("vllm:time_to_first_token_seconds", "Time to first token of completed requests.", &secs(|r| r.ttft_ms));
    o.histogram(
        "vllm:time_per_output_token_seconds",
        "Mean time per output token after the first, per completed request.",
        &secs(|r| r.tpot_ms),
    );
    o.histogram("vllm:e2e_request_latency_seconds", "End-to-end latency of completed requests.", &secs(|r| r.e2e_ms));
    let split: Vec<(String, Vec<f64>)> = [
        ("queue", (|r| r.queue_ms) as fn(&RequestRecord) -> Option<f64>),
        ("prefill", |r| r.prefill_ms),
        ("transfer", |r| r.transfer_ms),
        ("first_decode", |r| r.first_decode_ms),
    ]
    .into_iter()
    .map(|(part, f)| {
        (format!("part=\"{part}\""), completed.iter().filter_map(|r| f(r)).map(|ms| ms / 1000.0).collect())
    })
    .collect();
    o.histogram(
        "kvflow:ttft_split_seconds",
        "Time to first token split as in the P/D report: queue, prefill, transfer (0 when aggregated), first decode.",
        &split,
    );
    let handed: Vec<&&RequestRecord> = records.iter().filter(|r| r.t0_ms.is_some()).collect();
    o.family("kvflow:handoffs_total", "counter", "Requests handed off from a prefill pool to a decode pool.");
    o.sample("kvflow:handoffs_total", "", handed.len() as f64);
    o.family("kvflow:handoff_bytes_total", "counter", "Payload bytes of those handoffs.");
    o.sample("kvflow:handoff_bytes_total", "", handed.iter().map(|r| r.handoff_bytes).sum::<u64>() as f64);
    let handoff_failures: usize = failures
        .iter()
        .filter(|(cause, _)| cause.contains("handoff") || cause.contains("transfer"))
        .map(|(_, n)| n)
        .sum();
    o.family("kvflow:handoff_failures_total", "counter", "Requests failed by their handoff or its transfer.");
    o.sample("kvflow:handoff_failures_total", "", handoff_failures as f64);
    let transfer: Vec<f64> =
        handed.iter().filter_map(|r| r.t0_ms.zip(r.received_ms)).map(|(t0, got)| (got - t0) / 1000.0).collect();
    o.histogram(
        "kvflow:handoff_latency_seconds",
        "From T0 on the prefill rank to the decode rank taking the handoff.",
        &[(String::new(), transfer)],
    );
    gauges(&mut o, live.pools);
    o.0
}

fn gauges(o: &mut Out, pools: &PoolGauges) {
    type Read = fn(&RankGauges) -> usize;
    let rows: [(&str, &str, Read); 6] = [
        ("kvflow:kv_blocks_used", "Paged KV blocks held, per rank.", |g| g.get().used_blocks),
        ("kvflow:kv_blocks_total", "Paged KV blocks of the rank's memory.", |g| g.get().total_blocks),
        ("kvflow:state_slots_used", "Recurrent state slots held, per rank.", |g| g.get().used_slots),
        ("kvflow:state_slots_total", "Recurrent state slots of the rank's memory.", |g| g.get().total_slots),
        ("vllm:num_requests_waiting", "Requests queued on a rank, not yet running.", |g| g.get().waiting),
        ("kvflow:num_requests_on_rank", "Requests running on a rank.", |g| g.get().running),
    ];
    for (name, help, read) in rows {
        o.family(name, "gauge", help);
        for (pool, ranks) in pools {
            for (rank, g) in ranks.iter().enumerate() {
                o.sample(name, &format!("pool=\"{}\",rank=\"{rank}\"", escape(pool)), read(g) as f64);
            }
        }
    }
    o.family("vllm:kv_cache_usage_perc", "gauge", "Share of the pool's KV blocks held, per pool.");
    for (pool, ranks) in pools {
        let (used, total) = ranks.iter().fold((0, 0), |(u, t), g| (u + g.get().used_blocks, t + g.get().total_blocks));
        let share = if total > 0 { used as f64 / total as f64 } else { 0.0 };
        o.sample("vllm:kv_cache_usage_perc", &format!("pool=\"{}\"", escape(pool)), share);
    }
}

fn escape(text: &str) -> String {
    text.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}
