//! Executors: what runs a rank's steps. A step is *launched* — one phase at a time, phases taken
//! from the model config (a model without expert parallelism is one phase) — and *completes*
//! later with its sampled tokens and their logits hashes ([`StepCompletion`]). The rank polls
//! completions whenever it runs and never waits for one on the step path; an executor that
//! finishes work while its rank's pool is parked wakes it through the [`RankWaker`].
//!
//! Contract: completions arrive in launch order, each exactly once; `flush` asks for everything
//! in flight to complete as soon as it is computed (the rank has nothing more to launch).
//!
//! Built-in executors (chosen by name in a graph's `[[pool]] executor`, from the
//! [`ExecutorRegistry`] that programs embedding kvflow extend):
//! - `cpu`: the reference math on the rank's thread; completes at launch.
//! - `cpu-deferred`: the same math on a thread of its own; a step completes after the rank's next
//!   `delay_steps` launches (default 1, plus a seeded `jitter_steps`, default 0), or as soon as it
//!   is computed once the rank has nothing more to launch. `delay_steps = 0` is synchronous.
//! - `cuda`: the model on the rank's GPU, launched asynchronously and completed by CUDA events
//!   (`cuda.rs`; families mha, mla, gdn, hybrid_gdn and hybrid_kda).
//! - `null`: no math, every sampled token is 0 (only for measuring coordination; `delay_steps`
//!   as above).

mod cpu;
mod cuda;
mod deferred;
mod gate;
mod mtp;
pub use mtp::draft_passes;
mod null;
mod settings;

pub use cpu::{CpuExecutor, CpuStepRunner, OwnedStep};
pub use cuda::{CudaExecutor, CudaSettings};
pub use deferred::DeferredExecutor;
pub use gate::{CompletionGate, Delay};
pub use null::NullExecutor;
pub use settings::{SettingError, Settings};

use crate::messages::{ExpertPair, ExpertRows};
use crate::policy::memory::MemoryLayout;
use crate::step::{StepCompletion, StepLaunch};
use crate::wake::RankWaker;
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
    /// Set in a pool with `expert_parallel = true` (then `model` holds this rank's experts).
    pub experts: Option<ExpertPlacement>,
    /// With the `mtp` drafter: drafts the executor proposes after each sampled token (0: none).
    pub mtp_drafts: usize,
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

/// Executors by name. kvflow registers `cpu`, `cpu-deferred`, `null` and `cuda`.
#[derive(Clone)]
pub struct ExecutorRegistry {
    kinds: Vec<(String, Arc<dyn ExecutorKind>)>,
}

impl Default for ExecutorRegistry {
    fn default() -> Self {
        let mut r = ExecutorRegistry { kinds: Vec::new() };
        r.register("cpu", CpuKind);
        r.register("cpu-deferred", DeferredKind);
        r.register("null", NullKind);
        r.register("cuda", cuda::CudaKind);
        r
    }
}

impl ExecutorRegistry {
    /// Adds (or replaces) the executor called `name`.
    pub fn register(&mut self, name: &str, kind: impl ExecutorKind + 'static) {
        self.kinds.retain(|(n, _)| n != name);
        self.kinds.push((name.to_string(), Arc::new(kind)));
    }

    pub fn names(&self) -> Vec<String> {
        self.kinds.iter().map(|(n, _)| n.clone()).collect()
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn ExecutorKind>> {
        self.kinds.iter().find(|(n, _)| n == name).map(|(_, k)| k.clone())
    }
}

/// Stands in for an executor that could not be built on its rank: every step it is given
/// fails with the reason, so the requests routed there fail with it instead of hanging.
pub struct Unavailable {
    reason: String,
    failed: Vec<StepCompletion>,
}

impl Unavailable {
    pub fn new(reason: String) -> Self {
        Unavailable { reason, failed: Vec::new() }
    }
}

impl Executor for Unavailable {
    fn phases(&self) -> usize {
        1
    }

    fn launch(&mut self, step: &StepLaunch<'_>, _phase: usize) {
        let result = Err(crate::step::ExecutorError::Launch(format!("the executor could not start: {}", self.reason)));
        self.failed.push(StepCompletion::of(step.step, result));
    }

    fn poll(&mut self, out: &mut Vec<StepCompletion>) {
        out.append(&mut self.failed);
    }

    fn flush(&mut self) {}
}

struct CpuKind;

impl ExecutorKind for CpuKind {
    fn check(&self, settings: &toml::Table) -> Result<(), SettingError> {
        Settings::new(settings, &[]).map(|_| ())
    }

    fn build(&self, _settings: &toml::Table, ctx: ExecutorContext) -> Result<Box<dyn Executor>, String> {
        Ok(Box::new(CpuExecutor::new(CpuStepRunner::new(&ctx), Delay::default())))
    }
}

struct DeferredKind;

const DELAY_KEYS: &[&str] = &["delay_steps", "jitter_steps", "seed"];

fn delay_from(settings: &toml::Table, default_steps: u64) -> Result<Delay, SettingError> {
    let s = Settings::new(settings, DELAY_KEYS)?;
    Ok(Delay {
        steps: s.count("delay_steps", default_steps)?,
        jitter_steps: s.count("jitter_steps", 0)?,
        seed: s.count("seed", 0)?,
    })
}

impl ExecutorKind for DeferredKind {
    fn check(&self, settings: &toml::Table) -> Result<(), SettingError> {
        delay_from(settings, 1).map(|_| ())
    }

    fn build(&self, settings: &toml::Table, ctx: ExecutorContext) -> Result<Box<dyn Executor>, String> {
        let delay = delay_from(settings, 1).map_err(|e| e.to_string())?.for_rank(ctx.rank);
        let runner = CpuStepRunner::new(&ctx);
        if delay.is_synchronous() {
            return Ok(Box::new(CpuExecutor::new(runner, delay)));
        }
        Ok(Box::new(DeferredExecutor::spawn(runner, delay, ctx.waker.clone(), &ctx)?))
    }
}

struct NullKind;

impl ExecutorKind for NullKind {
    fn check(&self, settings: &toml::Table) -> Result<(), SettingError> {
        delay_from(settings, 0).map(|_| ())
    }

    fn build(&self, settings: &toml::Table, ctx: ExecutorContext) -> Result<Box<dyn Executor>, String> {
        let delay = delay_from(settings, 0).map_err(|e| e.to_string())?.for_rank(ctx.rank);
        Ok(Box::new(NullExecutor::new(delay)))
    }
}
