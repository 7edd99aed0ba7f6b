//! Counters a rank keeps over a run, reported per pool.

/// Counters of one rank.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankStats {
    /// The rank these are the counters of.
    pub rank: usize,
    /// Steps of the pool's clock this rank took part in.
    pub steps: u64,
    /// Of those, steps in which it launched nothing.
    pub empty_steps: u64,
    /// Of those, steps in which it decided nothing because its executor held as many steps in
    /// flight as it keeps.
    pub steps_held_back: u64,
    /// Steps it launched on its executor.
    pub launched_steps: u64,
    pub forward_tokens: u64,
    pub preemptions: u64,
    pub prefix_lookups: u64,
    pub prefix_hit_blocks: u64,
    /// Sampled tokens dropped because their sequence had moved to a newer generation
    /// (preempted or cancelled while the step was in flight).
    pub stale_completions: u64,
    /// Handoffs this rank sent (a prefill pool), their payload bytes, and handoffs it took (a
    /// decode pool).
    pub handoffs_out: u64,
    pub handoff_bytes: u64,
    /// Bytes a handoff did not send because the decode rank already held those blocks.
    pub handoff_saved_bytes: u64,
    /// Pieces of handoffs sent ahead while their prefill ran, and their bytes (a part of
    /// `handoff_bytes`).
    pub pieces_out: u64,
    pub streamed_bytes: u64,
    /// Of those, pieces sent as their step launched, read layer by layer as the forward wrote
    /// them (a cuda rank).
    pub pieces_at_launch: u64,
    /// Streamed handoffs whose request ended before T0 (its pieces dropped at the consumer).
    pub streams_dropped: u64,
    pub handoffs_in: u64,
    /// Events of a decode pool in another process that came back through this rank (a prefill
    /// pool spread over processes, `transfer::relay`).
    pub relayed_events: u64,
    /// A decode rank's new requests (`[pool.disaggregation]`) prefilled here, and by a prefill
    /// pool.
    pub local_prefills: u64,
    pub remote_prefills: u64,
    /// Acks for a transfer this rank was not awaiting (duplicates, or an older generation):
    /// dropped.
    pub stale_acks: u64,
    /// Releases of held ids that named an older generation (dropped; always 0 unless something is
    /// wrong).
    pub stale_releases: u64,
    /// Completions for a step or sequence the rank never launched or no longer knows.
    pub unknown_completions: u64,
    /// Expert parallel: bytes of routed-expert weights this rank holds (its own share; every
    /// expert without expert parallelism), bytes it sent to other ranks through dispatch and
    /// combine, and (row, expert) pairs its experts computed.
    pub expert_bytes: u64,
    pub exchange_bytes: u64,
    pub expert_rows: u64,
    /// Of `exchange_bytes`, the floats that crossed in host memory (0 on cuda ranks: their
    /// rows move device to device).
    pub exchange_host_bytes: u64,
    /// The offload tier's counters.
    pub offload: super::OffloadStats,
    /// Router `kv-aware`: cache events this rank reported to the routing index (device and
    /// offload tier), and resyncs after a gap.
    pub index_events: u64,
    pub index_offload_events: u64,
    pub index_resyncs: u64,
    /// Times this rank woke its parked pool (new work on rank 0, a completion on any rank).
    pub pool_wakes: u64,
    /// Times the accounting check ran (each time the pool parked with nothing in flight, and at
    /// the end of the run).
    pub accounting_checks: u64,
    /// When its steps ran (`wall_ms`), kept as much as measuring step cost in steady state
    /// needs (a fixed size however many steps run).
    pub step_times: StepTimes,
    /// Sampled at every step with work: fraction of KV blocks, state slots and snapshots in use,
    /// and the batch (sequences, tokens), as distributions of a fixed size.
    pub utilization: Utilization,
    /// Speculative decoding: verification steps, drafts fed and drafts kept.
    pub spec: SpecStats,
    /// Every launched step, when the run asked for them (`[report] steps`); else `None`.
    #[serde(default)]
    pub steps_log: Option<Vec<StepEntry>>,
}

/// One launched step (`[report] steps`, written to `steps.jsonl`): its shape, when it launched
/// and when its completion was applied (`wall_ms`, virtual in a simulated run).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepEntry {
    pub step: u64,
    pub launched_ms: f64,
    /// `None`: never completed (the run ended with it in flight).
    pub done_ms: Option<f64>,
    #[serde(flatten)]
    pub shape: crate::sim::StepShape,
}

pub use super::step_summary::{Distribution, StepTimes, Utilization, STEADY_SKIP};

/// A rank's speculative decoding.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SpecStats {
    /// Drafts `propose` made (the scheduler books as many as each request's width allows).
    pub proposed_tokens: u64,
    pub verify_steps: u64,
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
    /// A producer: drafts made from T0 and sent with handoffs.
    pub handed_off_drafts: u64,
    /// A consumer: handed-off requests' first decodes, and the drafts they fed.
    pub first_decodes: u64,
    pub first_decode_drafts: u64,
    /// Expert parallel with the MTP drafter: steps whose draft passes this rank joined with
    /// nothing sampled (only middle prompt chunks), as its peers drafted.
    pub draft_passes_without_samples: u64,
}

/// A rank's memory and queues as its last `schedule` left them, read from other threads
/// (`kvflow serve`'s `/metrics`, the stall watchdog). Relaxed stores once a step; nothing reads
/// them back.
#[derive(Debug, Default)]
pub struct RankGauges {
    values: [std::sync::atomic::AtomicUsize; 6],
    /// The requests the rank holds or awaits (a remote prefill, a relayed end), by id: the
    /// stall watchdog names those the run already saw end.
    awaited: parking_lot::Mutex<Vec<u64>>,
}

/// One reading of [`RankGauges`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GaugeValues {
    pub used_blocks: usize,
    pub total_blocks: usize,
    pub used_slots: usize,
    pub total_slots: usize,
    pub waiting: usize,
    pub running: usize,
}

impl RankGauges {
    pub fn get(&self) -> GaugeValues {
        let [used_blocks, total_blocks, used_slots, total_slots, waiting, running] =
            self.values.each_ref().map(|v| v.load(std::sync::atomic::Ordering::Relaxed));
        GaugeValues { used_blocks, total_blocks, used_slots, total_slots, waiting, running }
    }

    /// The requests the rank held or awaited at its last `schedule`.
    pub fn awaited(&self) -> Vec<u64> {
        self.awaited.lock().clone()
    }

    /// Replaces the requests the rank holds or awaits (the list's memory is reused).
    pub fn set_awaited(&self, ids: impl Iterator<Item = u64>) {
        let mut awaited = self.awaited.lock();
        awaited.clear();
        awaited.extend(ids);
    }

    pub fn set(&self, g: GaugeValues) {
        let new = [g.used_blocks, g.total_blocks, g.used_slots, g.total_slots, g.waiting, g.running];
        for (slot, value) in self.values.iter().zip(new) {
            slot.store(value, std::sync::atomic::Ordering::Relaxed);
        }
    }
}
