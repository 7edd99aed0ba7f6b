//! `--verify` (DESIGN §11): every request, warmup included, is run again on the reference path —
//! `kvflow generate` on that one request: no pools, no prefix cache, no transfer — and its tokens
//! and the hash of the bit patterns of its logits at every sampled position are compared with the
//! run's. Exact, because the executor is batch-invariant. Touches no report counter. Each request
//! is checked as it ends ([`Verifier`]), so none is held until the end of the run.
//!
//! The reference is the plain path of the executor the run used: the CPU reference math, or —
//! for a graph whose pools run `cuda` — the CUDA executor's own plain path on the first pool's
//! GPU (one request alone on the device, the host waiting for each step).

use crate::generate::{generate, GenerateOptions};
use crate::report::{RequestRecord, VerifySummary};
use anyhow::Result;
use kvflow_kernels::cpu::sampling::{RequestSampling, Sampler};
use kvflow_kernels::cuda::{DeviceModel, PlainRunner};
use kvflow_kernels::models::Model;
use std::collections::HashMap;
use std::sync::Arc;

/// Which plain path a run is checked against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reference {
    Cpu,
    Cuda { settings: kvflow_operators::executor::CudaSettings, block_size: usize },
}

/// The reference of a graph's run: `cuda` when its pools run `cuda`; a graph that mixes `cuda`
/// with another executor has none (the two compute different bits).
pub fn reference_for(graph: &crate::graph::Graph) -> Result<Reference> {
    let cuda: Vec<_> = graph.pools.iter().filter(|p| p.executor == "cuda").collect();
    if cuda.is_empty() {
        return Ok(Reference::Cpu);
    }
    if cuda.len() != graph.pools.len() {
        anyhow::bail!(
            "--verify compares a run with one executor's plain path, and this graph mixes `cuda` pools with others \
             (their logits differ in the last bits); run --verify on a graph whose pools all use one executor"
        );
    }
    let settings = kvflow_operators::executor::CudaSettings::read(&cuda[0].executor_settings)
        .map_err(|e| anyhow::anyhow!("pool {}: {e}", cuda[0].name))?;
    Ok(Reference::Cuda { settings, block_size: graph.memory.block_size })
}

/// How each request picks its tokens (by id), checked against what the graph runs: `--verify` has
/// an exact reference (on either executor) for greedy runs and for seeded sampling without
/// drafting — speculative sampling keeps the target distribution but not the plain path's draws,
/// so with drafting it is refused (the statistical test
/// `tests/integration/spec.rs::sampled_drafting_keeps_the_target_distribution` stands in).
pub fn sampling_of_requests(
    graph: &crate::graph::Graph,
    requests: &[crate::trace::Request],
    verify: bool,
) -> Result<HashMap<u64, RequestSampling>> {
    let sampling: HashMap<u64, RequestSampling> = requests.iter().map(|r| (r.id, r.sampling(graph.sampling))).collect();
    let Some(sampled) = requests.iter().find(|r| !sampling[&r.id].params.is_greedy()) else { return Ok(sampling) };
    let source = if sampled.sampling.is_some() {
        format!("request {} (trace line {}) samples with its own \"sampling\"", sampled.id, sampled.trace_line)
    } else {
        format!("[sampling] temperature = {}", graph.sampling.params.temperature)
    };
    if verify && graph.scheduler.spec.is_some() {
        anyhow::bail!(
            "{}: --verify: {source} and [speculative] drafts: speculative sampling keeps the target's distribution \
             but not the plain path's draws, so there is no exact reference to compare with; verify the same graph \
             without [speculative] (seeded sampling is exact there) or with temperature = 0",
            graph.path.display()
        );
    }
    Ok(sampling)
}

/// What `--verify` needs of one completed request: its prompt and outputs, the hash of its
/// logits, how it sampled, and the pools it passed through (the report counts per pool).
pub struct VerifyItem {
    pub id: u64,
    pub pools: Vec<String>,
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    pub logits_hash: u64,
    pub sampling: RequestSampling,
}

impl VerifyItem {
    pub fn of(r: &RequestRecord, sampling: RequestSampling) -> VerifyItem {
        VerifyItem {
            id: r.id,
            pools: r.pools.clone(),
            prompt: r.prompt_tokens.clone(),
            output: r.output_tokens.clone(),
            logits_hash: r.logits_hash,
            sampling,
        }
    }
}

/// `--verify`'s checker: a thread that runs each completed request on the reference path as the
/// collector hands it over, so no record waits for the end of the run. On the CPU reference it
/// checks while the run goes on, at a lower priority than the ranks; the CUDA reference (which
/// takes the first pool's GPU) starts once the pools have ended, and its requests wait until then.
pub struct Verifier {
    items: std::sync::mpsc::Sender<VerifyItem>,
    /// For the CUDA reference: whether to check at all, sent once the pools have ended.
    go: Option<std::sync::mpsc::Sender<bool>>,
    thread: std::thread::JoinHandle<Result<VerifySummary>>,
}

impl Verifier {
    pub fn spawn(model: Arc<Model>, reference: Reference, chunk_tokens: usize) -> Result<Verifier> {
        let (items, queue) = std::sync::mpsc::channel::<VerifyItem>();
        let (go, wait) = std::sync::mpsc::channel::<bool>();
        let deferred = matches!(reference, Reference::Cuda { .. });
        let thread = std::thread::Builder::new().name("kvflow-verify".into()).spawn(move || {
            if deferred && !wait.recv().unwrap_or(false) {
                return Ok(VerifySummary::default());
            }
            if !deferred {
                // SAFETY: setpriority(2) on the calling thread (who = 0 is this thread on Linux);
                // it changes nothing but its scheduling priority, and a failure leaves it as is.
                unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) };
            }
            check_all(&model, reference, queue, chunk_tokens)
        })?;
        Ok(Verifier { items, go: deferred.then_some(go), thread })
    }

    /// Hands a completed request over to be checked.
    pub fn check(&self, item: VerifyItem) {
        // The thread ends only when `finish` drops the sender, or on an error `finish` reports.
        let _ = self.items.send(item);
    }

    /// Waits until every request handed over has been checked; `keep` false (the end-of-run check
    /// failed) skips what is left and reports nothing.
    pub fn finish(self, keep: bool) -> Result<VerifySummary> {
        let Verifier { items, go, thread } = self;
        drop(items);
        if let Some(go) = go {
            let _ = go.send(keep);
        }
        let summary = thread.join().map_err(|_| anyhow::anyhow!("the --verify thread panicked"))??;
        Ok(if keep { summary } else { VerifySummary::default() })
    }
}

/// Checks every request that comes on `queue` until its sender is gone.
fn check_all(
    model: &Model,
    reference: Reference,
    queue: std::sync::mpsc::Receiver<VerifyItem>,
    chunk_tokens: usize,
) -> Result<VerifySummary> {
    let device = match reference {
        Reference::Cpu => None,
        Reference::Cuda { settings, block_size } => {
            let g = settings.open(0)?;
            let m = DeviceModel::upload_as(&g, model, settings.dtype)?;
            Some((g, m, block_size))
        }
    };
    let runner = match &device {
        Some((g, m, _)) => Some(PlainRunner::new(g, m)?),
        None => None,
    };
    let mut summary = VerifySummary::default();
    for r in queue {
        let (tokens, logits_hash) = match (&runner, &device) {
            (Some(runner), Some((_, _, block_size))) => {
                let sampler = Sampler::new(r.sampling, r.id);
                let g = runner.generate_by(&r.prompt, r.output.len(), chunk_tokens, *block_size, &sampler)?;
                (g.tokens, g.logits_hash)
            }
            _ => {
                let opts = GenerateOptions {
                    max_new_tokens: r.output.len(),
                    chunk_tokens,
                    sampling: r.sampling,
                    first_request_id: r.id,
                    ..Default::default()
                };
                let reference = generate(model, std::slice::from_ref(&r.prompt), &opts)?.remove(0);
                (reference.tokens, reference.logits_hash)
            }
        };
        summary.note(r.id, &r.pools, tokens == r.output && logits_hash == r.logits_hash);
    }
    // Requests end in any order; the report lists mismatches by id.
    summary.mismatched_ids.sort_unstable();
    for pool in summary.by_pool.values_mut() {
        pool.mismatched_ids.sort_unstable();
    }
    Ok(summary)
}
