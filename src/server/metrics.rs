//! `/metrics`: the run in Prometheus' text format: counters and histograms kept as the requests
//! are released, hand off and end ([`MetricsTally`], fed by the collector from the same records
//! `report.json` is folded from, so its counters agree with the report's), the rank gauges every
//! rank updates at each step, and the server's own refusals. Rendering costs the same whatever
//! the number of requests served. Names follow vLLM's (`vllm:…`) where one exists.

use crate::report::{Buckets, MetricsTally, BUCKETS};
use kvflow_operators::rank::RankGauges;
use std::collections::BTreeMap;
use std::fmt::Write;

pub use crate::runtime::front::PoolGauges;

/// What `/metrics` reads beside the tally.
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

    fn histogram(&mut self, name: &str, help: &str, series: &[(String, Buckets)]) {
        self.family(name, "histogram", help);
        for (labels, b) in series {
            let sep = if labels.is_empty() { "" } else { "," };
            let mut below = 0;
            for (le, n) in BUCKETS.iter().zip(b.counts) {
                below += n;
                self.sample(&format!("{name}_bucket"), &format!("{labels}{sep}le=\"{le}\""), below as f64);
            }
            self.sample(&format!("{name}_bucket"), &format!("{labels}{sep}le=\"+Inf\""), b.count as f64);
            self.sample(&format!("{name}_sum"), labels, b.sum);
            self.sample(&format!("{name}_count"), labels, b.count as f64);
        }
    }
}

/// The metrics text.
pub fn render(tally: &MetricsTally, live: &Live) -> String {
    let mut o = Out(String::new());
    o.family(
        "kvflow:requests_total",
        "counter",
        "Requests that entered a pool and ended, by outcome (report.json's completed, failed, cancelled).",
    );
    for (outcome, n) in [("completed", tally.completed), ("failed", tally.failed), ("cancelled", tally.cancelled)] {
        o.sample("kvflow:requests_total", &format!("outcome=\"{outcome}\""), n as f64);
    }
    o.family("kvflow:request_failures_total", "counter", "Failed requests by cause (report.json's failures).");
    for (cause, n) in &tally.failures {
        o.sample("kvflow:request_failures_total", &format!("cause=\"{}\"", escape(cause)), *n as f64);
    }
    o.family("kvflow:http_requests_refused_total", "counter", "Requests refused before entering a pool, by HTTP status (400 bad input, 401 missing or wrong API key, 404 unknown model, 408 body too slow, 413 body too large, 429 queue full, 503 draining).");
    for (status, n) in live.refused {
        o.sample("kvflow:http_requests_refused_total", &format!("status=\"{status}\""), *n as f64);
    }
    o.family("vllm:num_requests_running", "gauge", "Requests in flight: entered a pool, not ended.");
    o.sample("vllm:num_requests_running", "", live.in_flight as f64);
    o.family("kvflow:draining", "gauge", "1 while the server drains (after SIGTERM), refusing new requests.");
    o.sample("kvflow:draining", "", f64::from(u8::from(live.draining)));
    let (prompt, cached) = (tally.prompt_tokens, tally.cached_tokens);
    o.family("vllm:prompt_tokens_total", "counter", "Prompt tokens of every request that entered a pool.");
    o.sample("vllm:prompt_tokens_total", "", prompt as f64);
    o.family("vllm:generation_tokens_total", "counter", "Output tokens of completed requests.");
    o.sample("vllm:generation_tokens_total", "", tally.generated_tokens as f64);
    o.family("kvflow:prefix_cache_hit_tokens_total", "counter", "Prompt tokens reused from the prefix cache.");
    o.sample("kvflow:prefix_cache_hit_tokens_total", "", cached as f64);
    o.family(
        "vllm:prefix_cache_hit_rate",
        "gauge",
        "Prompt tokens reused from the prefix cache over prompt tokens (report.json's prefix_hit_rate).",
    );
    o.sample("vllm:prefix_cache_hit_rate", "", if prompt > 0 { cached as f64 / prompt as f64 } else { 0.0 });
    let one = |b: &Buckets| vec![(String::new(), b.clone())];
    o.histogram("vllm:time_to_first_token_seconds", "Time to first token of completed requests.", &one(&tally.ttft));
    o.histogram(
        "vllm:time_per_output_token_seconds",
        "Mean time per output token after the first, per completed request.",
        &one(&tally.tpot),
    );
    o.histogram("vllm:e2e_request_latency_seconds", "End-to-end latency of completed requests.", &one(&tally.e2e));
    let split: Vec<(String, Buckets)> = ["queue", "prefill", "transfer", "first_decode"]
        .into_iter()
        .zip(&tally.split)
        .map(|(part, b)| (format!("part=\"{part}\""), b.clone()))
        .collect();
    o.histogram(
        "kvflow:ttft_split_seconds",
        "Time to first token split as in the P/D report: queue, prefill, transfer (0 when aggregated), first decode.",
        &split,
    );
    o.family("kvflow:handoffs_total", "counter", "Requests handed off from a prefill pool to a decode pool.");
    o.sample("kvflow:handoffs_total", "", tally.handoffs as f64);
    o.family("kvflow:handoff_bytes_total", "counter", "Payload bytes of those handoffs.");
    o.sample("kvflow:handoff_bytes_total", "", tally.handoff_bytes as f64);
    let handoff_failures: u64 = tally
        .failures
        .iter()
        .filter(|(cause, _)| cause.contains("handoff") || cause.contains("transfer"))
        .map(|(_, n)| n)
        .sum();
    o.family("kvflow:handoff_failures_total", "counter", "Requests failed by their handoff or its transfer.");
    o.sample("kvflow:handoff_failures_total", "", handoff_failures as f64);
    o.histogram(
        "kvflow:handoff_latency_seconds",
        "From T0 on the prefill rank to the decode rank taking the handoff.",
        &one(&tally.handoff_latency),
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
