//! A rank's side of expert parallelism: what `dispatch`, `experts` and `combine` ask of its
//! executor at each MoE layer (see `crate::pool::experts`).

use super::Rank;
use crate::messages::{ExpertPair, ExpertRows, Payload};

impl Rank {
    /// The rows this rank's step in progress routed at MoE layer `moe`, by owning rank.
    pub fn expert_dispatch(&mut self, moe: usize) -> Vec<ExpertRows> {
        match self.executor.expert_parallel() {
            Some(ep) => ep.dispatch(moe),
            None => {
                tracing::error!(pool = %self.pool, rank = self.index, "the executor has no expert-parallel side");
                Vec::new()
            }
        }
    }

    /// Runs this rank's experts of MoE layer `moe` over the rows dispatched to it.
    pub fn run_experts(&mut self, moe: usize, rows: &[ExpertRows]) -> Vec<ExpertRows> {
        let results = self.executor.expert_parallel().map(|ep| ep.run_experts(moe, rows)).unwrap_or_default();
        self.stats.expert_rows += rows.iter().map(|m| m.pairs.len() as u64).sum::<u64>();
        results
    }

    /// Combines MoE layer `moe`'s results into the step in progress (`missing`: pairs that got
    /// none; their requests fail) and runs it on.
    pub fn combine_experts(&mut self, moe: usize, results: Vec<ExpertRows>, missing: &[ExpertPair]) {
        if let Some(ep) = self.executor.expert_parallel() {
            ep.combine(moe, results, missing);
        }
    }

    /// Counts what `sent` moves to other ranks: all its bytes, and the floats in host memory.
    pub fn count_exchange(&mut self, sent: &[ExpertRows]) {
        for m in sent.iter().filter(|m| m.to != self.index) {
            self.stats.exchange_bytes += m.bytes() as u64;
            if let Payload::Host(_) = m.payload {
                self.stats.exchange_host_bytes += m.payload.bytes() as u64;
            }
        }
    }
}
