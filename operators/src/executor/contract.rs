//! The contract between a rank and its executor: the `Executor` trait (a step launched in
//! phases, completed later), expert parallelism's hooks, what an executor is built from
//! (`ExecutorContext`), and an executor kind that the registry builds by name.

use super::settings::SettingError;
use crate::messages::{ExpertPair, ExpertRows};
use crate::policy::memory::MemoryLayout;
use crate::pool::wake::RankWaker;
use crate::step::{Exported, StepCompletion, StepLaunch};
use kvflow_kernels::models::Model;
use std::sync::Arc;

/// Runs one rank's steps.
pub trait Executor {
    /// How many phases a step has (launched in order, `0..phases()`).
    fn phases(&self) -> usize;
    /// Launches phase `phase` of `step`: enqueues the work and returns. Every phase of a step is
    /// given the same launch.
    fn launch(&mut self, step: &StepLaunch<'_>, phase: usize);
    /// Moves the completions that are ready into `out`, oldest first; never blocks.
    fn poll(&mut self, out: &mut Vec<StepCompletion>);
    /// The rank has nothing more to launch: complete what is in flight as soon as it is computed,
    /// and wake the rank when it is.
    fn flush(&mut self);
    /// Whether it hands back the exports marked [`KvExport::at_launch`] as it launches their
    /// step ([`Executor::take_launched_exports`]), each layer readable once the forward wrote
    /// it; otherwise they come with the step's completion like every export.
    ///
    /// [`KvExport::at_launch`]: crate::step::KvExport::at_launch
    fn exports_at_launch(&self) -> bool {
        false
    }
    /// The `at_launch` exports of the steps launched since it was last asked, each with its
    /// index among its step's exports (its completion still lists every export).
    fn take_launched_exports(&mut self, _out: &mut Vec<(usize, Exported)>) {}
    /// The most steps its rank keeps launched and not completed (`None`: no bound). A GPU's
    /// launch queue holds only so many kernels: a rank that launched tens of steps ahead found
    /// its thread blocked in a launch until the device had run the queue, taking no completion
    /// and no new request meanwhile, and a request that arrived then waited behind every step
    /// already launched.
    fn max_in_flight(&self) -> Option<usize> {
        None
    }
    /// Its side of expert parallelism, if it has one (a pool with `expert_parallel = true`
    /// needs it).
    fn expert_parallel(&mut self) -> Option<&mut dyn ExpertParallel> {
        None
    }
}

/// An executor's side of expert parallelism (DESIGN §4). The `dispatch`, `experts` and
/// `combine` operators move the rows between ranks; the executor makes and reads their
/// payloads. With expert parallelism a step's `launch` runs up to its first MoE layer's
/// routing; each [`ExpertParallel::combine`] runs it on to the next, and the last one to its end
/// (then it completes as any step does).
pub trait ExpertParallel {
    /// The rows the step in progress routed at MoE layer `moe`, one message per rank owning
    /// some of their experts, in rank order (none when this rank has no step there).
    fn dispatch(&mut self, moe: usize) -> Vec<ExpertRows>;
    /// Runs this rank's experts of MoE layer `moe` over the rows dispatched to it (`rows` in
    /// sender order); one result message back to each sender. Each expert runs once over all its
    /// rows, and a row's result does not depend on the others.
    fn run_experts(&mut self, moe: usize, rows: &[ExpertRows]) -> Vec<ExpertRows>;
    /// The results for what this rank dispatched at `moe`. The requests of the rows in `missing`
    /// fail (never a silent zero); the rest combine, and the step runs on.
    fn combine(&mut self, moe: usize, results: Vec<ExpertRows>, missing: &[ExpertPair]);
}

/// Where a rank sits in an expert-parallel pool: it holds the experts
/// `kvflow_kernels::models::parts::moe::expert_range(n, rank, ranks)` of each MoE layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertPlacement {
    pub rank: usize,
    pub ranks: usize,
}

/// What an executor factory knows about the rank it builds for.
#[derive(Clone)]
pub struct ExecutorContext {
    pub pool: String,
    pub rank: usize,
    pub model: Arc<Model>,
    pub layout: MemoryLayout,
    pub waker: Arc<RankWaker>,
    /// Set in a pool with `expert_parallel = true` (then `model` holds this rank's experts; a
    /// simulated rank's `model` is the whole model's shapes, its share given by the placement).
    pub experts: Option<ExpertPlacement>,
    /// With the `mtp` drafter: drafts the executor proposes after each sampled token (0: none).
    pub mtp_drafts: usize,
    /// The run's virtual clock, in a simulated run (the `sim` executor needs it).
    pub clock: Option<Arc<crate::sim::clock::VirtualClock>>,
    /// Until when this rank's simulated saves run (a simulated run with `store = "sim"`): a
    /// `sim` executor prices the steps beside them slower.
    pub saves: Option<Arc<crate::offload::SavesBusy>>,
}

impl ExecutorContext {
    /// Rank 0 of a pool called `pool` that nothing wakes (an executor driven outside a pool).
    pub fn standalone(pool: &str, model: Arc<Model>, layout: MemoryLayout) -> Self {
        ExecutorContext {
            pool: pool.to_string(),
            rank: 0,
            model,
            layout,
            waker: Arc::new(RankWaker::default()),
            experts: None,
            mtp_drafts: 0,
            clock: None,
            saves: None,
        }
    }

    /// The model's storage for this rank's layout: paged KV and state slots/snapshots.
    pub fn new_cache(&self) -> kvflow_kernels::models::ModelCache {
        let l = &self.layout;
        self.model.new_cache(l.block_size, if l.keeps_kv { l.blocks } else { 0 }, l.slots, l.snapshots)
    }
}

/// A kind of executor: checks a pool's `executor_settings` table and builds one executor per
/// rank from it.
pub trait ExecutorKind: Send + Sync {
    /// Checks the settings; an error names the key.
    fn check(&self, settings: &toml::Table) -> Result<(), SettingError>;
    /// Builds the executor of one rank.
    fn build(&self, settings: &toml::Table, ctx: ExecutorContext) -> Result<Box<dyn Executor>, String>;
}
