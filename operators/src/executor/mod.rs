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
//!   (`cuda.rs`; families mha, mla, gdn, hybrid_gdn and hybrid_kda; the MTP drafter's passes in
//!   `cuda_mtp.rs`).
//! - `null`: no math, every sampled token is 0 (only for measuring coordination; `delay_steps`
//!   as above).
//! - `sim`: no math either: a step takes the time a cost model gives it on the run's virtual
//!   clock, and its tokens are a seeded draw (`sim.rs`; a simulated run, issue 44).

mod contract;
mod cpu;
mod cuda;
mod cuda_mtp;
mod cuda_padding;
mod cuda_settings;
mod deferred;
mod gate;
mod mtp;
pub use mtp::draft_passes;
mod null;
mod owned_step;
mod settings;
mod sim;
mod sim_experts;
pub use sim::{SimExecutor, StepCost};

pub use contract::{Executor, ExecutorContext, ExecutorKind, ExpertParallel, ExpertPlacement};
pub use cpu::{CpuExecutor, CpuStepRunner};
pub use cuda::CudaExecutor;
pub use cuda_settings::CudaSettings;
pub use deferred::DeferredExecutor;
pub use gate::{CompletionGate, Delay};
pub use null::NullExecutor;
pub use owned_step::OwnedStep;
pub use settings::{SettingError, Settings};

use crate::step::{StepCompletion, StepLaunch};
use std::sync::Arc;

/// Executors by name. kvflow registers `cpu`, `cpu-deferred`, `null`, `cuda` and `sim`.
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
        r.register("sim", sim::SimKind);
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
