//! The raw layer of graph loading: serde structs mirroring the file as written, unknown keys
//! rejected (`deny_unknown_fields`). Every value keeps its span so validation can name its line;
//! every field is optional so defaults and "missing" messages are ours.

use serde::Deserialize;
use toml::Spanned;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGraph {
    #[serde(default)]
    pub(super) model: RawModel,
    #[serde(default)]
    pub(super) memory: RawMemory,
    #[serde(default)]
    pub(super) scheduler: RawScheduler,
    #[serde(default)]
    pub(super) pool: Vec<Spanned<RawPool>>,
    #[serde(default)]
    pub(super) link: Vec<Spanned<RawLink>>,
    /// Spanned so a `[transfer]` table in a graph without links can be named at its header.
    pub(super) transfer: Option<Spanned<RawTransfer>>,
    #[serde(default)]
    pub(super) faults: RawFaults,
    pub(super) offload: Option<Spanned<RawOffload>>,
    pub(super) speculative: Option<Spanned<RawSpeculative>>,
    #[serde(default)]
    pub(super) sampling: RawSampling,
    #[serde(default)]
    pub(super) workload: RawWorkload,
    #[serde(default)]
    pub(super) slo: RawSlo,
    #[serde(default)]
    pub(super) report: RawReport,
    #[serde(default)]
    pub(super) serve: RawServe,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServe {
    pub(super) model_name: Option<Spanned<String>>,
    pub(super) max_requests: Option<Spanned<usize>>,
    pub(super) max_tokens: Option<Spanned<usize>>,
    pub(super) max_context: Option<Spanned<usize>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawModel {
    pub(super) path: Option<Spanned<String>>,
}

#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMemory {
    /// An integer, or a string with a unit; interpreted during validation.
    pub(super) budget_bytes: Option<Spanned<toml::Value>>,
    pub(super) block_size: Option<Spanned<usize>>,
    pub(super) snapshot_fraction: Option<Spanned<f64>>,
    pub(super) snapshot_interval_blocks: Option<Spanned<usize>>,
}

#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawScheduler {
    pub(super) max_running: Option<Spanned<usize>>,
    pub(super) max_batched_tokens: Option<Spanned<usize>>,
    pub(super) chunk_tokens: Option<Spanned<usize>>,
    pub(super) prefix_cache: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPool {
    pub(super) name: Option<Spanned<String>>,
    pub(super) role: Option<Spanned<String>>,
    pub(super) ranks: Option<Spanned<usize>>,
    pub(super) executor: Option<Spanned<String>>,
    /// The executor's own settings; which keys it takes is the executor's business.
    pub(super) executor_settings: Option<Spanned<toml::Table>>,
    pub(super) router: Option<Spanned<String>>,
    pub(super) expert_parallel: Option<Spanned<bool>>,
    pub(super) hosts: Option<Spanned<Vec<String>>>,
    pub(super) admission: Option<Spanned<String>>,
    /// This pool's own `[pool.memory]` and `[pool.scheduler]`: keys set here override the
    /// graph's top-level tables.
    pub(super) memory: Option<RawMemory>,
    pub(super) scheduler: Option<RawScheduler>,
    /// `[pool.disaggregation]`: decode pools only; spanned so another role's can be named at its
    /// header.
    pub(super) disaggregation: Option<Spanned<RawDisaggregation>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDisaggregation {
    pub(super) remote_prefill_min_tokens: Option<Spanned<usize>>,
    pub(super) max_prefill_queue: Option<Spanned<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLink {
    pub(super) from: Option<Spanned<String>>,
    pub(super) to: Option<Spanned<String>>,
    pub(super) backend: Option<Spanned<String>>,
    pub(super) endpoint: Option<Spanned<String>>,
    pub(super) bandwidth: Option<Spanned<String>>,
    pub(super) stream_min_tokens: Option<Spanned<usize>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTransfer {
    pub(super) deployment_token: Option<Spanned<String>>,
    pub(super) checksum: Option<bool>,
    pub(super) connections: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOffload {
    pub(super) store: Option<Spanned<String>>,
    pub(super) chunk_tokens: Option<Spanned<usize>>,
    /// An integer, or a string with a unit.
    pub(super) capacity_bytes: Option<Spanned<toml::Value>>,
    pub(super) path: Option<Spanned<String>>,
    pub(super) max_retries: Option<Spanned<usize>>,
    pub(super) max_pending_saves: Option<Spanned<usize>>,
    pub(super) url: Option<Spanned<String>>,
    pub(super) password_env: Option<Spanned<String>>,
    pub(super) lease_ms: Option<Spanned<u64>>,
    pub(super) timeout_ms: Option<Spanned<u64>>,
    pub(super) save_gbps: Option<Spanned<f64>>,
    pub(super) load_gbps: Option<Spanned<f64>>,
    pub(super) latency_us: Option<Spanned<f64>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSpeculative {
    pub(super) drafter: Option<Spanned<String>>,
    pub(super) draft_tokens: Option<Spanned<usize>>,
    pub(super) ngram_min: Option<Spanned<usize>>,
    pub(super) ngram_max: Option<Spanned<usize>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSampling {
    pub(super) temperature: Option<Spanned<f64>>,
    pub(super) top_k: Option<Spanned<usize>>,
    pub(super) top_p: Option<Spanned<f64>>,
    pub(super) seed: Option<u64>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFaults {
    pub(super) seed: Option<u64>,
    pub(super) drop_connection: Option<Spanned<f64>>,
    pub(super) delay_ms: Option<Spanned<f64>>,
    pub(super) delay_probability: Option<Spanned<f64>>,
    pub(super) corrupt: Option<Spanned<f64>>,
    pub(super) duplicate_completion: Option<Spanned<f64>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWorkload {
    pub(super) trace: Option<Spanned<String>>,
    pub(super) format: Option<Spanned<String>>,
    pub(super) mode: Option<Spanned<String>>,
    pub(super) time_scale: Option<Spanned<f64>>,
    pub(super) concurrency: Option<Spanned<usize>>,
    pub(super) rate: Option<Spanned<f64>>,
    pub(super) warmup: Option<usize>,
    pub(super) limit: Option<Spanned<usize>>,
    pub(super) block_tokens: Option<Spanned<usize>>,
    pub(super) max_output_tokens: Option<Spanned<usize>>,
    pub(super) seed: Option<u64>,
    pub(super) ignore_eos: Option<bool>,
    pub(super) cancel_fraction: Option<Spanned<f64>>,
    pub(super) cancel_after_ms: Option<Spanned<f64>>,
    pub(super) pool_choice: Option<Spanned<String>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSlo {
    pub(super) ttft_ms: Option<Spanned<f64>>,
    pub(super) tpot_ms: Option<Spanned<f64>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReport {
    pub(super) out: Option<Spanned<String>>,
    pub(super) steps: Option<bool>,
}
