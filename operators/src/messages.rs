//! Records that travel between the operators of a pool. Those that cross ranks (and processes,
//! in cluster mode) are serde types: timely exchanges need it even within one process.

use serde::{Deserialize, Serialize};

/// A request entering a pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Admission {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_output_tokens: usize,
    pub warmup: bool,
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
    pub admissions: Vec<Admission>,
}

impl RankReport {
    /// Whether the rank has nothing scheduled, running or waiting.
    pub fn idle(&self) -> bool {
        self.scheduled_tokens == 0 && self.waiting == 0 && self.running == 0
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
    /// No rank has work and nothing was admitted: the pool parks after this step.
    pub park: bool,
}

impl StepPlan {
    /// Whether rank `r` has nothing to run at this step (it runs the plan's empty step).
    pub fn is_idle_rank(&self, r: usize) -> bool {
        self.ranks[r].scheduled_tokens == 0
    }
}

/// What `forward(t)` tells the next step through the feedback edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LoopSignal {
    /// Step `t` launched: its batch structure is known, so `t + 1` may be scheduled.
    Launched,
    /// The pool parked after `t`: nothing runs until `admit` wakes it.
    Parked,
}

/// What happened to a request, reported by the rank that runs it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// Its first chunk ran (queueing ended), with the prompt tokens reused from the prefix cache.
    Started { id: u64, rank: usize, cached_tokens: usize },
    /// It produced output token number `index`.
    Token { id: u64, index: usize, token: u32 },
    /// It produced all its tokens.
    Finished { id: u64, rank: usize, logits_hash: u64, preemptions: usize, cached_tokens: usize },
    /// It cannot run.
    Failed { id: u64, rank: usize, cause: String, message: String },
}

impl Event {
    pub fn id(&self) -> u64 {
        match self {
            Event::Started { id, .. }
            | Event::Token { id, .. }
            | Event::Finished { id, .. }
            | Event::Failed { id, .. } => *id,
        }
    }
}
