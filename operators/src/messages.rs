//! Records that travel between the operators of a pool. Those that cross ranks (and processes,
//! in cluster mode) are serde types: timely exchanges need it even within one process.

use kvflow_kernels::cpu::sampling::RequestSampling;
use serde::{Deserialize, Serialize};

pub use crate::request::{BackTo, Delivery, TokenTimes};

/// A request entering a pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Admission {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_output_tokens: usize,
    pub warmup: bool,
    pub kind: AdmissionKind,
    /// How it picks its tokens (greedy, or seeded sampling keyed on its id).
    pub sampling: RequestSampling,
    /// Each rank's cached prefix of its prompt per tier, as the KV-aware routing index reported
    /// it to the admitting rank (router `kv-aware`; empty otherwise): every rank routes on these.
    #[serde(default)]
    pub cached: Vec<crate::policy::kv_index::PrefixLen>,
    /// What a served request asks beyond its tokens (trace replay: nothing).
    #[serde(default)]
    pub delivery: Delivery,
}

/// What a pool does with an admitted request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdmissionKind {
    /// Serve it whole (an aggregated pool).
    #[default]
    Whole,
    /// Prefill it, sample T0, and hand it off to a decode pool (a prefill pool): back to the
    /// decode rank that asked for it, or (`None`: it entered here) to one its links pick.
    PrefillOnly { back_to: Option<BackTo> },
    /// It arrives as a handoff (in the pool's inbox): continue from T0 (a decode pool), on
    /// `rank` when a decode rank chose the remote prefill itself.
    Handoff { rank: Option<u32> },
    /// A new request at a decode pool with `[pool.disaggregation]`: the rank the router picks
    /// prefills it locally or has a linked prefill pool do it (DESIGN §8).
    Decide,
}

/// What one rank scheduled for step `t`, broadcast to every rank by `align`. Rank 0 also carries
/// the requests admitted at `t`, so every rank learns of them at the same step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankReport {
    pub rank: usize,
    /// Tokens this rank runs at `t` (prefill chunks and decodes).
    pub scheduled_tokens: usize,
    /// Sequences in this rank's batch at `t`.
    pub scheduled_seqs: usize,
    /// Tokens this rank still has to compute, outputs to come included (the router's load).
    pub outstanding_tokens: usize,
    pub waiting: usize,
    pub running: usize,
    /// Steps it launched whose completion it has not applied.
    pub in_flight: usize,
    pub admissions: Vec<Admission>,
    /// Requests to cancel (rank 0 carries them, like admissions).
    pub cancels: Vec<u64>,
    /// Rank 0: the ingress is closed and everything it received has been reported.
    pub closing: bool,
    /// With `admission = "reserve"`: what the rank can still promise new requests.
    pub capacity: Option<Capacity>,
    /// Router `kv-aware`: the rank's cache events since its last report, and its whole cache
    /// when the plan asked for it (after a gap); worker 0's `align` hands them to the index.
    #[serde(default)]
    pub cache_events: Vec<crate::policy::kv_index::CacheEvent>,
    #[serde(default)]
    pub cache_snapshot: Option<crate::policy::kv_index::CacheSnapshot>,
}

/// What a rank under `admission = "reserve"` can still hold to the end for new requests: its free
/// KV blocks and state slots less what the requests it holds will still need (each to its last
/// output token), and its totals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub blocks: usize,
    pub slots: usize,
    pub total_blocks: usize,
    /// Tokens per block (0: the model keeps no paged KV).
    pub block_size: usize,
    /// Whether a request needs a state slot.
    pub needs_slot: bool,
}

impl Capacity {
    /// Blocks a request of `tokens` tokens (prompt and outputs) needs to its end.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        if self.block_size == 0 {
            0
        } else {
            tokens.div_ceil(self.block_size)
        }
    }

    /// Whether a request of `tokens` tokens fits now.
    pub fn holds(&self, tokens: usize) -> bool {
        self.blocks_for(tokens) <= self.blocks && (!self.needs_slot || self.slots > 0)
    }

    /// Books a request of `tokens` tokens.
    pub fn take(&mut self, tokens: usize) {
        self.blocks = self.blocks.saturating_sub(self.blocks_for(tokens));
        if self.needs_slot {
            self.slots = self.slots.saturating_sub(1);
        }
    }
}

impl RankReport {
    /// Whether the rank holds no request and has nothing in flight.
    pub fn idle(&self) -> bool {
        self.scheduled_tokens == 0 && self.waiting == 0 && self.running == 0 && self.in_flight == 0
    }
}

/// The plan of step `t`: the same on every rank, derived from the complete set of reports.
#[derive(Clone, Debug, PartialEq)]
pub struct StepPlan {
    pub step: u64,
    /// One report per rank, indexed by rank (admissions moved into `routed`).
    pub ranks: Vec<RankReport>,
    /// Every admission of `t` and the rank the router chose for it.
    pub routed: Vec<(Admission, usize)>,
    /// Admissions the router could not place (it named a rank outside the pool), with why:
    /// rank 0 fails them.
    pub unroutable: Vec<(Admission, String)>,
    /// Requests cancelled at `t`: whichever rank holds one frees it.
    pub cancels: Vec<u64>,
    /// `admission = "reserve"`: admissions no rank can hold to their end yet; rank 0 reports them
    /// again at its next step (in order, before newer ones).
    pub deferred: Vec<Admission>,
    /// No rank launches anything and nothing was admitted or cancelled: the pool stops stepping
    /// after this step until something wakes it. With steps in flight (or requests held that wait
    /// on them) it *waits* — the completion that lands on some rank wakes it; otherwise it parks.
    pub idle: bool,
    /// Idle with no request held and nothing in flight on any rank: the pool parks (and every
    /// rank checks its accounting); only a new admission wakes it.
    pub park: bool,
    /// Parked, and the workload is done (rank 0's ingress is closed): the pool ends.
    pub end: bool,
    /// The per-step decisions beyond the batch that every rank must agree on.
    pub shape: StepShape,
    /// Ranks whose cache events arrived with a gap: each sends its whole cache in its next report.
    pub resync: Vec<usize>,
}

/// Decisions of `StepPlan(t)` that fix what every rank's forward does collectively (DESIGN §4;
/// each reads the one fact it names, §5 "named conditions").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Tokens each rank runs at `t`, by rank (what `DPMetadata` all-reduces elsewhere).
    pub tokens_per_rank: Vec<usize>,
    /// The batch an idle rank keeps at `t` so its collectives match its peers': the scheduler's
    /// spec width in rows (1 + drafts per request; 1 without speculative decoding, q = 1 on a
    /// producer). `None` when nothing is collective at `t`. An idle rank here sends nothing and
    /// lets time pass, so the CPU executor runs no dummy; a GPU backend replaying captured
    /// graphs runs this shape.
    pub idle_dummy_rows: Option<usize>,
    /// The model layers whose dispatch and combine exchange rows at `t`.
    pub exchange_layers: Vec<usize>,
    /// The MTP drafter's passes every rank joins at `t` (their exchanges follow the MoE layers').
    pub draft_passes: usize,
}

/// What `forward(t)` tells the next step through the feedback edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LoopSignal {
    /// Step `t` launched: its batch structure is known, so `t + 1` may be scheduled.
    Launched,
    /// Nothing could run after `t`, but steps are in flight: the pool waits until the completion
    /// that lands on some rank wakes it (through that rank's `admit`).
    Waiting,
    /// The pool parked after `t`: no request held, nothing in flight; it runs again when rank 0's
    /// `admit` has new work.
    Parked,
    /// The pool ended after `t`: every operator lets go of its capabilities.
    Ended,
}

/// Milliseconds since the Unix epoch: the clock every process of a run shares (the driver stamps
/// releases with it, ranks stamp tokens with it), so latencies hold across processes of a host.
/// On the thread that steps a simulated run, the virtual time instead (`crate::sim::clock`).
pub fn wall_ms() -> f64 {
    if let Some(clock) = crate::sim::clock::VirtualClock::current() {
        return clock.now_ms();
    }
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// How a request ended, reported once by the rank that ran it (events cross ranks only at the
/// end of a request, so a busy pool exchanges almost nothing per step beyond its plan).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// It produced all its tokens.
    Finished {
        id: u64,
        rank: usize,
        tokens: Vec<u32>,
        token_times: TokenTimes,
        /// When its first chunk ran (queueing ended).
        started_ms: f64,
        /// Prompt tokens reused from the prefix cache at its first admission.
        cached_tokens: usize,
        logits_hash: u64,
        preemptions: usize,
    },
    /// Its prefill finished and it moved on, to the decode pool `to` (not an end: that pool
    /// reports the end).
    HandedOff { id: u64, rank: usize, to: String, started_ms: f64, t0_ms: f64, bytes: u64, preemptions: usize },
    /// A decode rank took its handoff (`wall_ms`): the end of its transfer; `overlapped_ms` of
    /// it moved ahead in pieces while the prefill ran (`Handoff::overlapped_ms`).
    Received {
        id: u64,
        rank: usize,
        taken_ms: f64,
        #[serde(default)]
        overlapped_ms: f64,
    },
    /// A streaming request's output tokens from `offset` on (not an end: its end event carries
    /// every output token again). Sent at the step that sampled them; a P/D request's T0 comes
    /// from the prefill pool and again, with the rest, from the decode pool, so a reader orders
    /// by `offset` and takes each token once.
    Tokens { id: u64, rank: usize, offset: usize, tokens: Vec<u32> },
    /// It cannot run (or was cancelled), with whatever it produced before.
    Failed {
        id: u64,
        rank: usize,
        cause: String,
        message: String,
        tokens: Vec<u32>,
        token_times: TokenTimes,
        started_ms: Option<f64>,
    },
}

impl Event {
    pub fn id(&self) -> u64 {
        match self {
            Event::Finished { id, .. }
            | Event::Failed { id, .. }
            | Event::HandedOff { id, .. }
            | Event::Received { id, .. }
            | Event::Tokens { id, .. } => *id,
        }
    }
}

/// Rows of one rank's step crossing to another at a MoE layer (expert parallel, DESIGN §4): at
/// dispatch, token rows a rank sends to the rank owning some of their experts; at combine, those
/// experts' outputs coming back. Timely carries the addressing and the (row, expert) list; the
/// floats are a [`Payload`] only executors read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertRows {
    /// Which MoE layer (its index among the model's MoE layers).
    pub moe: usize,
    pub from: usize,
    pub to: usize,
    /// One entry per (token row, expert), ascending: the row's index in the batch of the rank
    /// whose token it is (the sender at dispatch, the receiver at combine).
    pub pairs: Vec<(u32, u32)>,
    /// `pairs.len()` rows of the model's hidden size: the token's normed input at dispatch, the
    /// expert's output at combine.
    pub payload: Payload,
}

/// The floats an expert exchange moves: in the message (host memory), or rows in a rank's
/// device memory that the receiver copies device to device on its own stream after the sender's
/// event — timely then carries the pairs, the counts and the event, never the floats. Device rows
/// stay in their process (a pool that exchanges them runs on one device).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Payload {
    Host(Vec<f32>),
    #[serde(skip)]
    Device(kvflow_kernels::cuda::DeviceRows),
    /// A simulated exchange (executor `sim`): no floats, the bytes they would be and the virtual
    /// instant they are at the receiver.
    Simulated {
        bytes: usize,
        at_ns: u64,
    },
}

impl Payload {
    /// Bytes the payload moves.
    pub fn bytes(&self) -> usize {
        match self {
            Payload::Host(v) => std::mem::size_of_val(&v[..]),
            Payload::Device(rows) => rows.bytes(),
            Payload::Simulated { bytes, .. } => *bytes,
        }
    }

    /// The floats of a host payload (none for device rows).
    pub fn host(&self) -> &[f32] {
        match self {
            Payload::Host(v) => v,
            Payload::Device(_) | Payload::Simulated { .. } => &[],
        }
    }
}

impl ExpertRows {
    /// The result message `from` sends back for `self`'s rows: the same pairs, `payload` holding
    /// their experts' outputs.
    pub fn reply(&self, from: usize, payload: Payload) -> ExpertRows {
        ExpertRows { moe: self.moe, from, to: self.from, pairs: self.pairs.clone(), payload }
    }

    /// Bytes this message moves between ranks: its payload and its (row, expert) list.
    pub fn bytes(&self) -> usize {
        self.payload.bytes() + std::mem::size_of_val(&self.pairs[..])
    }
}

/// A (row, expert) pair a rank dispatched at a MoE layer: what `combine` must get a result for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertPair {
    pub row: u32,
    pub expert: u32,
    /// The rank that owns the expert.
    pub owner: usize,
}

/// What passes along one rank's expert-parallel chain at step `t`, from `forward` through each
/// MoE layer's `dispatch` and `combine` (a pipeline: it never leaves the rank).
#[derive(Clone, Debug, PartialEq)]
pub struct StageToken {
    /// What the last `combine` tells the next step (the feedback edge).
    pub signal: LoopSignal,
    /// `StepPlan(t)`: whether the MoE layers exchange at `t` (some rank has tokens).
    pub exchange: bool,
    /// Set by `dispatch`: the (row, expert) pairs this rank sent at the current layer, with the
    /// rank owning each expert — what `combine` must get back.
    pub dispatched: Vec<ExpertPair>,
}
