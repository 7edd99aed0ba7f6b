//! The `kv_usage` timeline of report.json: each pool's share of KV blocks held, sampled on the
//! wall clock by a thread of its own ([`spawn_kv_sampler`]), or by a simulated run's stepper on
//! its virtual clock ([`KvSamples::take`]).

use super::front::PoolGauges;
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Samples every pool's share of KV blocks held (its ranks' gauges) until `finished`, for the
/// report's `kv_usage` timeline (`kvflow plot` draws it): every 100 ms, halving the samples kept
/// (and doubling the interval) whenever they pass 2,000. A sample is kept as its numbers (a time
/// and one share per pool, tens of bytes) and written as JSON only at the end: a server samples
/// for as long as it runs.
pub fn spawn_kv_sampler(
    pools: PoolGauges,
    run_start_ms: f64,
    finished: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<Vec<serde_json::Value>>> {
    std::thread::Builder::new().name("kvflow-kv-sampler".into()).spawn(move || {
        let mut samples = KvSamples::default();
        while !finished.load(Ordering::SeqCst) {
            samples.take((kvflow_operators::messages::wall_ms() - run_start_ms) / 1000.0, &pools);
            std::thread::sleep(samples.interval);
        }
        samples.json(&pools)
    })
}

/// The `kv_usage` timeline: each pool's share of KV blocks held, sampled every `interval`
/// (which doubles, halving the samples kept, whenever they pass 2,000).
pub struct KvSamples {
    pub interval: Duration,
    samples: Vec<(f64, Box<[f64]>)>,
}

impl Default for KvSamples {
    fn default() -> Self {
        KvSamples { interval: Duration::from_millis(100), samples: Vec::new() }
    }
}

impl KvSamples {
    /// Samples every pool's share now, `t_s` seconds into the run.
    pub fn take(&mut self, t_s: f64, pools: &PoolGauges) {
        let shares = pools
            .iter()
            .map(|(_, ranks)| {
                let (used, total) =
                    ranks.iter().map(|g| g.get()).fold((0, 0), |(u, t), g| (u + g.used_blocks, t + g.total_blocks));
                if total > 0 {
                    used as f64 / total as f64
                } else {
                    0.0
                }
            })
            .collect();
        self.samples.push((t_s, shares));
        if self.samples.len() > 2000 {
            self.samples = std::mem::take(&mut self.samples).into_iter().step_by(2).collect();
            self.interval *= 2;
        }
    }

    /// The timeline as report.json holds it.
    pub fn json(self, pools: &PoolGauges) -> Vec<serde_json::Value> {
        self.samples
            .into_iter()
            .map(|(t_s, shares)| {
                let shares: serde_json::Map<String, serde_json::Value> =
                    pools.iter().zip(shares.iter()).map(|((name, _), share)| (name.clone(), json!(share))).collect();
                json!({"t_s": t_s, "pools": shares})
            })
            .collect()
    }
}
