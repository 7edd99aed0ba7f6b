//! `--verify` (DESIGN §11): every request, warmup included, is run again on the reference path —
//! `kvflow generate` on that one request: no pools, no prefix cache, no transfer — and its tokens
//! and the hash of the bit patterns of its logits at every sampled position are compared with the
//! run's. Exact, because the executor is batch-invariant. Touches no report counter.
//!
//! The reference is the plain path of the executor the run used: the CPU reference math, or —
//! for a graph whose pools run `cuda` — the CUDA executor's own plain path on the first pool's
//! GPU (one request alone on the device, the host waiting for each step).

use crate::generate::{generate, GenerateOptions};
use crate::report::{RequestRecord, VerifySummary};
use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use kvflow_kernels::cpu::sampling::RequestSampling;
use kvflow_kernels::cuda::{DeviceModel, PlainRunner};
use kvflow_kernels::models::Model;
use std::collections::HashMap;

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

/// How each request picks its tokens (by id), checked against what the graph runs: sampling with
/// temperature runs on the cpu executors, and `--verify` has an exact reference for greedy runs
/// and for seeded sampling without drafting — speculative sampling keeps the target
/// distribution but not the plain path's draws, so with drafting it is refused (the statistical
/// test `tests/integration/spec.rs::sampled_drafting_keeps_the_target_distribution` stands in).
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
    if let Some(pool) = graph.pools.iter().find(|p| p.executor == "cuda") {
        anyhow::bail!(
            "{}: {source}, but pool `{}` runs \"cuda\", which picks greedily; sampling with temperature runs on the \
             cpu executors for now",
            graph.path.display(),
            pool.name
        );
    }
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

pub fn verify(
    model: &Model,
    reference: Reference,
    records: &[RequestRecord],
    sampling: &HashMap<u64, RequestSampling>,
    chunk_tokens: usize,
    show_progress: bool,
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
    let bar = if show_progress { ProgressBar::new(records.len() as u64) } else { ProgressBar::hidden() };
    bar.set_style(ProgressStyle::with_template("verify {bar:30} {pos}/{len}").expect("valid template"));
    for r in records {
        bar.inc(1);
        if r.error.is_some() || r.output_tokens.is_empty() {
            continue;
        }
        let (tokens, logits_hash) = match (&runner, &device) {
            (Some(runner), Some((_, _, block_size))) => {
                let g = runner.generate(&r.prompt_tokens, r.output_tokens.len(), chunk_tokens, *block_size)?;
                (g.tokens, g.logits_hash)
            }
            _ => {
                let opts = GenerateOptions {
                    max_new_tokens: r.output_tokens.len(),
                    chunk_tokens,
                    sampling: sampling.get(&r.id).copied().unwrap_or_default(),
                    first_request_id: r.id,
                    ..Default::default()
                };
                let reference = generate(model, std::slice::from_ref(&r.prompt_tokens), &opts)?.remove(0);
                (reference.tokens, reference.logits_hash)
            }
        };
        summary.checked += 1;
        if tokens != r.output_tokens || logits_hash != r.logits_hash {
            summary.mismatched += 1;
            summary.mismatched_ids.push(r.id);
        }
        summary.checked_ids.push(r.id);
    }
    bar.finish_and_clear();
    Ok(summary)
}
