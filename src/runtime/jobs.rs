//! What a run is made of, before it starts: the model, the workload's requests (synthesised from
//! the trace) and one job per pool (its memory layout, scheduler, router, executor, experts and
//! offload).

use super::memory::plan_memory;
use super::offload;
use super::options::RunOptions;
use super::pool::{ExpertParallelJob, PoolJob};
use crate::graph::{Graph, PoolConfig, WorkloadMode};
use crate::registry::Registry;
use crate::trace::{read_trace, synthesize, SynthOptions, TraceFormat};
use crate::workload::{select, ArrivalMode, Selection};
use anyhow::{anyhow, bail, Context, Result};
use kvflow_kernels::models::{self, Model};
use std::sync::Arc;

/// Loads the graph's model: a simulated graph's (every pool's executor `sim`) from its config
/// alone — its shapes, no weights — so it need not fit this machine nor have a checkpoint.
pub fn load_model(graph: &Graph) -> Result<Arc<Model>> {
    let simulated = !graph.pools.is_empty() && graph.pools.iter().all(|p| p.executor == super::simulated::SIM);
    let load = if simulated { models::load_shapes } else { models::load };
    let model = load(&graph.model).with_context(|| format!("cannot load model {}", graph.model.display()))?;
    Ok(Arc::new(model))
}

/// The workload's requests, with the note when the trace is shorter than asked.
pub fn load_workload(graph: &Graph, vocab_size: usize) -> Result<Selection> {
    let w = &graph.workload;
    let trace = w
        .trace
        .as_ref()
        .ok_or_else(|| anyhow!("{}: workload.trace is not set (or pass --trace)", graph.path.display()))?;
    let format: TraceFormat = w.format.parse().map_err(|e| anyhow!("workload.format: {e}"))?;
    let mut records = read_trace(trace, format)?;
    // Only the requests the run replays are synthesised, each prompt up front (4 bytes a
    // token): they must fit the machine.
    if let Some(limit) = w.limit {
        records.truncate(w.warmup.saturating_add(limit));
    }
    let tokens: u128 = records.iter().map(|r| crate::trace::scaled_len(r.input_len, w.block_tokens) as u128).sum();
    if let Some(available) = models::available_memory() {
        if tokens * 4 > available / 2 {
            bail!(
                "{}: the trace's prompts come to {tokens} tokens at workload.block_tokens = {} ({}), more than half \
                 the {} this machine has available; use --limit or a smaller block_tokens",
                trace.display(),
                w.block_tokens,
                models::human_bytes(tokens * 4),
                models::human_bytes(available)
            );
        }
    }
    let requests = synthesize(
        &records,
        &SynthOptions {
            block_tokens: w.block_tokens,
            seed: w.seed,
            vocab_size,
            max_output_tokens: w.max_output_tokens,
        },
    )
    .map_err(|e| anyhow!("{}: {e}", trace.display()))?;
    let selection = select(requests, w.warmup, w.limit);
    if selection.measured == 0 {
        bail!(
            "{}: nothing to measure: the trace has {} request(s) and workload.warmup (or --warmup) {} takes them all",
            trace.display(),
            records.len(),
            w.warmup
        );
    }
    Ok(selection)
}

/// How the workload releases its requests.
pub fn arrival_mode(graph: &Graph) -> ArrivalMode {
    match graph.workload.mode {
        WorkloadMode::Timestamps { time_scale } => ArrivalMode::Timestamps { time_scale },
        WorkloadMode::Concurrency(n) => ArrivalMode::Concurrency(n),
        WorkloadMode::Rate { per_second } => ArrivalMode::Rate { per_second, seed: graph.workload.seed },
    }
}

/// An expert-parallel pool's model: its MoE layers (each a dispatch and a combine) and, with the
/// MTP drafter, its draft passes after them; `None` without expert parallelism.
pub(crate) fn expert_parallel_job(
    graph: &Graph,
    pool: &PoolConfig,
    model: &Model,
) -> Result<Option<ExpertParallelJob>> {
    if !pool.expert_parallel {
        return Ok(None);
    }
    let moe_layers: Vec<usize> = model.moe_layers().into_iter().map(|(layer, _)| layer).collect();
    if moe_layers.is_empty() {
        return Err(anyhow!(
            "{}: pool `{}`: expert_parallel = true needs a MoE model; model_type {} has no MoE layer",
            graph.path.display(),
            pool.name,
            model.model_type
        ));
    }
    let mtp_drafts = pool.scheduler.spec.filter(|s| s.drafter.runs_in_executor()).map_or(0, |s| s.draft_tokens);
    let draft_passes = kvflow_operators::executor::draft_passes(model, true, mtp_drafts);
    if pool.executor == "cuda" && pool.hosts.len() > 1 {
        return Err(anyhow!(
            "{}: pool `{}`: a cuda pool with expert_parallel = true exchanges its rows in device memory, so its \
             ranks run in one process; it names {} hosts",
            graph.path.display(),
            pool.name,
            pool.hosts.len()
        ));
    }
    let mtp_layer = model.num_layers();
    let spec_width = pool.verification_width();
    let simulated = pool.executor == super::simulated::SIM;
    Ok(Some(ExpertParallelJob {
        checkpoint: graph.model.clone(),
        simulated,
        moe_layers,
        draft_passes,
        mtp_layer,
        spec_width,
    }))
}

/// One pool's job: its memory layout for the model and workload, its scheduler, router and
/// executor.
pub fn pool_job(
    graph: &Graph,
    pool: &PoolConfig,
    model: &Arc<Model>,
    largest_request: usize,
    opts: &RunOptions,
    registry: &Registry,
    store: Option<&offload::RunStore>,
) -> Result<PoolJob> {
    let layout = plan_memory(model, &pool.memory, &pool.scheduler, largest_request, pool.verifies())
        .with_context(|| format!("{}: pool `{}`", graph.path.display(), pool.name))?;
    let scheduler = pool.scheduler;
    let named = |what: &str, name: &str, known: Vec<String>| {
        anyhow!(
            "{}: pool `{}`: {what} {name:?} is not registered (known: {})",
            graph.path.display(),
            pool.name,
            known.join(", ")
        )
    };
    let router =
        registry.routers.get(&pool.router).ok_or_else(|| named("router", &pool.router, registry.routers.names()))?;
    let executor = registry
        .executors
        .get(&pool.executor)
        .ok_or_else(|| named("executor", &pool.executor, registry.executors.names()))?;
    let executor_settings = pool.executor_settings.clone();
    executor.check(&executor_settings).map_err(|e| anyhow!("{}: pool `{}`: {e}", graph.path.display(), pool.name))?;
    if pool.scheduler.spec.is_some_and(|s| s.drafter.runs_in_executor()) && model.mtp().is_none() {
        return Err(anyhow!(
            "{}: speculative.drafter = \"mtp\": the model {} holds no MTP layer (a DeepSeek checkpoint's \
             `model.layers.{{num_hidden_layers}}.eh_proj`, `.enorm`, `.hnorm`, `.shared_head` tensors, with \
             num_nextn_predict_layers >= 1); use drafter = \"ngram\"",
            graph.path.display(),
            graph.model.display()
        ));
    }
    let experts = expert_parallel_job(graph, pool, model)?;
    Ok(PoolJob {
        name: pool.name.clone(),
        ranks: pool.ranks,
        model: model.clone(),
        layout,
        scheduler,
        router,
        executor,
        executor_settings,
        cluster: opts.cluster.clone(),
        switches: opts.switches.clone(),
        handoff: Default::default(),
        experts,
        routing_index: pool.router == kvflow_operators::policy::router::KV_AWARE,
        links_here: None,
        gauges: (0..pool.ranks).map(|_| Default::default()).collect(),
        starting: None,
        lockstep: None,
        log_steps: graph.report_steps,
        offload: match (store, &graph.offload) {
            (Some(store), Some(config)) => Some(offload::setup(graph, pool, model, &layout, config, store)?),
            _ => None,
        },
    })
}

/// The executor pool `name` runs.
pub fn pools_executor(graph: &Graph, name: &str) -> String {
    graph.pools.iter().find(|p| p.name == name).map(|p| p.executor.clone()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expert_parallel_pool_with_the_mtp_drafter_plans_its_draft_passes_and_spec_width() {
        // A producer never verifies: its idle ranks keep width 1; a decode pool's keep 1 + k.
        // Both run k draft passes (the MTP layer's experts), the same on every rank.
        let dir = tempfile::tempdir().unwrap();
        let spec =
            "model_type = \"deepseek_v3\"\nseed = 3\nvocab_size = 64\nhidden_size = 16\nintermediate_size = 32\n\
                    moe_intermediate_size = 8\nnum_hidden_layers = 2\nnum_attention_heads = 2\nkv_lora_rank = 8\n\
                    qk_nope_head_dim = 4\nqk_rope_head_dim = 4\nv_head_dim = 4\nn_routed_experts = 4\n\
                    num_experts_per_tok = 2\nfirst_k_dense_replace = 1\nnum_nextn_predict_layers = 1\n";
        std::fs::write(dir.path().join("model.toml"), spec).unwrap();
        let graph = "[model]\npath = \"model.toml\"\n\n[[pool]]\nname = \"p\"\nrole = \"prefill\"\nranks = 2\n\
                     expert_parallel = true\n\n[[pool]]\nname = \"d\"\nrole = \"decode\"\nranks = 2\n\
                     expert_parallel = true\n\n[[link]]\nfrom = \"p\"\nto = \"d\"\n\n[speculative]\ndrafter = \"mtp\"\n\
                     draft_tokens = 3\n";
        std::fs::write(dir.path().join("graph.toml"), graph).unwrap();
        let graph = Graph::load(&dir.path().join("graph.toml")).unwrap();
        let model = load_model(&graph).unwrap();
        let jobs: Vec<ExpertParallelJob> =
            graph.pools.iter().map(|p| expert_parallel_job(&graph, p, &model).unwrap().unwrap()).collect();
        assert_eq!((jobs[0].spec_width, jobs[0].draft_passes, jobs[0].mtp_layer), (1, 3, 2), "the producer");
        assert_eq!((jobs[1].spec_width, jobs[1].draft_passes), (4, 3), "the consumer");
        assert_eq!(crate::runtime::pool::collectives(Some(&jobs[1])).spec_width, 4);
    }
}
