//! The run's offload store (`[offload]`, DESIGN §9) and each pool's part in it: the namespace its
//! chunks are keyed under, checked against the pool's layout before the run.

use crate::graph::{Graph, OffloadConfig, OffloadStore, PoolConfig, RedisStoreConfig};
use anyhow::{anyhow, Result};
use kvflow_kernels::models::Model;
use kvflow_operators::offload::{
    DiskStore, MemoryStore, Namespace, ObjectStore, RedisConfig, RedisStore, SimulatedStore,
};
use kvflow_operators::policy::memory::MemoryLayout;
use kvflow_operators::rank::OffloadSetup;
use std::sync::Arc;
use std::time::Duration;

/// The run's store, shared by every pool and rank; a simulated one with its rates.
#[derive(Clone)]
pub struct RunStore {
    pub store: Arc<dyn ObjectStore>,
    pub simulated: Option<Arc<SimulatedStore>>,
}

/// Opens the graph's store.
pub fn open_store(graph: &Graph) -> Result<Option<RunStore>> {
    let Some(config) = &graph.offload else { return Ok(None) };
    let store: Arc<dyn ObjectStore> = match &config.store {
        OffloadStore::Memory { capacity_bytes } => Arc::new(MemoryStore::new(*capacity_bytes)),
        OffloadStore::Disk { path } => {
            Arc::new(DiskStore::open(path).map_err(|e| anyhow!("{}: offload.path: {e}", graph.path.display()))?)
        }
        OffloadStore::Redis(redis) => Arc::new(open_redis(graph, redis)?),
        OffloadStore::Sim(sim) => {
            let store = Arc::new(MemoryStore::new(sim.capacity_bytes));
            let simulated = Arc::new(SimulatedStore {
                store: store.clone(),
                save_bytes_per_s: sim.save_gbps * 1e9,
                load_bytes_per_s: sim.load_gbps * 1e9,
                latency_ns: (sim.latency_us * 1e3).round() as u64,
            });
            return Ok(Some(RunStore { store, simulated: Some(simulated) }));
        }
    };
    Ok(Some(RunStore { store, simulated: None }))
}

/// Connects to the graph's Redis store, with the password from the environment variable the
/// graph names. A server that is not up yet is no error (saves drop and loads miss until it is).
fn open_redis(graph: &Graph, config: &RedisStoreConfig) -> Result<RedisStore> {
    let password = match &config.password_env {
        Some(name) => Some(std::env::var(name).map_err(|_| {
            anyhow!(
                "{}: offload.password_env: the environment variable `{name}` is not set (or not UTF-8); it should \
                 hold the Redis password",
                graph.path.display()
            )
        })?),
        None => None,
    };
    RedisStore::open(RedisConfig {
        url: config.url.clone(),
        password,
        lease: Duration::from_millis(config.lease_ms),
        timeout: Duration::from_millis(config.timeout_ms),
    })
    .map_err(|e| anyhow!("{}: offload.url: {e}", graph.path.display()))
}

/// The namespace of a pool's chunks: everything that changes their bytes.
pub fn namespace(model: &Model, layout: &MemoryLayout, chunk_tokens: usize) -> Namespace {
    let facts = [
        ("model_type", model.model_type.clone()),
        ("weights", format!("{:016x}", model.weights_fingerprint())),
        ("config", format!("{:016x}", model.config_fingerprint)),
        ("layout", format!("{:016x}", model.layout_fingerprint(layout.block_size))),
        ("block_size", layout.block_size.to_string()),
        ("chunk_tokens", chunk_tokens.to_string()),
        ("dtype", "f32".to_string()),
        ("layer_split", "whole".to_string()),
        ("keyed_by_prompt_len", layout.prefix_keyed_by_prompt_len.to_string()),
    ];
    let facts: Vec<(&str, &str)> = facts.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Namespace::of(&facts)
}

/// A pool's offload setup. A model with recurrent state saves a chunk only with the state at its
/// end, so its chunks must end where prefill chunks stop: at snapshot boundaries, which need the
/// prefix cache.
pub fn setup(
    graph: &Graph,
    pool: &PoolConfig,
    model: &Model,
    layout: &MemoryLayout,
    config: &OffloadConfig,
    store: &RunStore,
) -> Result<OffloadSetup> {
    if layout.keeps_state {
        let every = pool.scheduler.snapshot_interval_blocks * layout.block_size;
        if !pool.scheduler.prefix_cache || !config.chunk_tokens.is_multiple_of(every) {
            return Err(anyhow!(
                "{}: offload.chunk_tokens: pool `{}` serves {} (recurrent state), whose saved chunks carry the state \
                 at their end: chunk_tokens ({}) must be a multiple of memory.snapshot_interval_blocks × \
                 memory.block_size ({every}), with scheduler.prefix_cache on",
                graph.path.display(),
                pool.name,
                model.model_type,
                config.chunk_tokens
            ));
        }
    }
    if let Some(context) = model.max_positions.filter(|&context| config.chunk_tokens > context) {
        // No prompt can fill a chunk: the tier would run and save nothing.
        return Err(anyhow!(
            "{}: offload.chunk_tokens: {} tokens per chunk is more than the context of pool `{}`'s model ({context} \
             positions): no prompt could ever fill a chunk, so nothing would be saved",
            graph.path.display(),
            config.chunk_tokens,
            pool.name
        ));
    }
    let per_block = super::links::consumer_layout(model, pool);
    Ok(OffloadSetup {
        store: store.store.clone(),
        simulated: store.simulated.clone(),
        namespace: namespace(model, layout, config.chunk_tokens),
        chunk_tokens: config.chunk_tokens,
        max_retries: config.max_retries,
        max_pending_saves: config.max_pending_saves,
        chunk_kv_floats: per_block.floats_per_block * config.chunk_tokens / layout.block_size,
        state_floats: if layout.keeps_state { per_block.state_floats } else { 0 },
    })
}
