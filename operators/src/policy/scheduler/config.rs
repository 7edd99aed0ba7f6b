//! The knobs of the scheduling policy: the batch limits, prefix reuse, and when a waiting
//! request may start (`AdmissionPolicy`); speculative decoding's are in `draft`.

use super::SpecConfig;

/// The knobs of the policy (one per pool: the graph's `[scheduler]` table, with the pool's own
/// `[pool.scheduler]` over it, and `memory.snapshot_interval_blocks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_running: usize,
    pub max_batched_tokens: usize,
    pub chunk_tokens: usize,
    pub prefix_cache: bool,
    pub snapshot_interval_blocks: usize,
    /// When a waiting request may start (a pool's `admission`).
    pub admission: AdmissionPolicy,
    /// Speculative decoding (`[speculative]`): decodes carry drafts to verify.
    pub spec: Option<SpecConfig>,
}

/// When a rank starts a waiting request (a pool's `admission` key).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AdmissionPolicy {
    /// Start it once its first chunk fits; when memory runs out later, the youngest running
    /// request is preempted and recomputed (the default).
    #[default]
    Optimistic,
    /// Start it only when the rank's KV blocks and slots can hold it to its end (prompt and every
    /// output token), counting what the requests it already runs will still need: no request
    /// is ever preempted, and the router sends work only to ranks that can hold it.
    Reserve,
}

impl AdmissionPolicy {
    pub const NAMES: &'static [&'static str] = &["optimistic", "reserve"];

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "optimistic" => Some(AdmissionPolicy::Optimistic),
            "reserve" => Some(AdmissionPolicy::Reserve),
            _ => None,
        }
    }
}
