//! What refuses a run before anything starts: which pools it runs (`--pool`, `--pools`), how a
//! pool spreads over processes, the `--endpoint`s, the rank memory against the machine's, and the
//! `cuda` pools against the model and the driver.

use super::cluster::ClusterPlace;
use super::links;
use super::options::RunOptions;
use crate::graph::{Graph, PoolConfig, PoolRole};
use anyhow::{anyhow, bail, Result};
use kvflow_kernels::models::{self, Model};

/// The pools this process runs, once every check of them passed: which the options pick, how
/// they spread over processes, the endpoints named, and the rank memory they take.
pub fn pools_of_run<'g>(graph: &'g Graph, opts: &RunOptions) -> Result<Vec<&'g PoolConfig>> {
    let pools = match &opts.pools {
        Some(names) => pick_named_pools(graph, names)?,
        None => pick_pools(graph, opts.pool.as_deref())?,
    };
    check_processes(graph, &pools, opts.cluster.as_ref())?;
    check_machine(graph, &pools, opts.cluster.as_ref().map_or(1, |c| c.processes))?;
    check_endpoints(graph, opts)?;
    Ok(pools)
}

/// The pools this run starts: the one `--pool` names, or every pool of the graph (`kvflow
/// check` asks the same, so it refuses what `run` would).
pub fn pick_pools<'g>(graph: &'g Graph, name: Option<&str>) -> Result<Vec<&'g PoolConfig>> {
    let pools = match name {
        Some(n) => vec![graph.pool(n).map_err(|e| anyhow!("{e}"))?],
        None => graph.pools.iter().collect(),
    };
    if name.is_some() && pools.iter().any(|p| p.role != PoolRole::Aggregated) {
        bail!(
            "{}: --pool runs one aggregated pool; run a prefill or decode pool with --pools NAME[,NAME] (its \
             linked pools in other processes)",
            graph.path.display()
        );
    }
    check_pools(graph, &pools)?;
    Ok(pools)
}

/// The pools `--pools` names, each once, checked as [`pick_pools`] checks them.
pub fn pick_named_pools<'g>(graph: &'g Graph, names: &[String]) -> Result<Vec<&'g PoolConfig>> {
    let mut pools: Vec<&PoolConfig> = Vec::new();
    for name in names {
        let pool = graph.pool(name).map_err(|e| anyhow!("--pools: {e}"))?;
        if pools.iter().any(|p| p.name == pool.name) {
            bail!("--pools names pool `{name}` twice");
        }
        pools.push(pool);
    }
    if pools.is_empty() {
        bail!("--pools: name at least one pool of {}", graph.path.display());
    }
    check_pools(graph, &pools)?;
    Ok(pools)
}

/// What no run of these pools takes yet.
fn check_pools(graph: &Graph, pools: &[&PoolConfig]) -> Result<()> {
    if let Some(pool) = links::pool_with_disaggregation_rule(graph).filter(|_| pools.len() < graph.pools.len()) {
        bail!(
            "{}: pool `{}`: [pool.disaggregation] (a decode rank deciding where to prefill) runs its prefill and \
             decode pools in one process; run them all (no --pool or --pools), or leave it out",
            graph.path.display(),
            pool.name
        );
    }
    if graph.faults.any() && !graph.is_disaggregated() {
        bail!(
            "{}: [faults]: faults strike the transfer engine, and this graph has no [[link]]s (a prefill and a \
             decode pool joined by a link)",
            graph.path.display()
        );
    }
    if graph.faults.corrupt > 0.0 {
        if let Some(link) = graph.links.iter().find(|l| l.backend != crate::graph::TransferBackend::Tcp) {
            bail!(
                "{}: [faults] corrupt: link {} → {} is {}, which moves no bytes to damage (and checksums \
                 none); corruption applies to tcp links",
                graph.path.display(),
                link.from,
                link.to,
                link.backend
            );
        }
    }
    Ok(())
}

/// A pool that lists several processes runs only as one of them (`--process`). A pool spread
/// over processes is an aggregated pool, or a prefill pool whose links reach decode pools in
/// other processes over tcp (each of its processes opens its own links; the events coming back
/// go through its ranks to the driving process).
fn check_processes(graph: &Graph, pools: &[&PoolConfig], cluster: Option<&ClusterPlace>) -> Result<()> {
    if cluster.is_none() {
        if let Some(p) = pools.iter().find(|p| p.hosts.len() > 1) {
            bail!(
                "{}: pool `{}` lists {} processes (hosts): run each with `kvflow run {} --pools {} --process I`, \
                 or all of them on this machine with `kvflow launch {}`",
                graph.path.display(),
                p.name,
                p.hosts.len(),
                graph.path.display(),
                p.name,
                graph.path.display()
            );
        }
        return Ok(());
    }
    for p in pools {
        match p.role {
            PoolRole::Aggregated => {}
            PoolRole::Prefill => {
                let out = graph.links_from(&p.name);
                let here = |to: &str| pools.iter().any(|q| q.name == to);
                if let Some(l) = out.iter().find(|l| l.backend != crate::graph::TransferBackend::Tcp || here(&l.to)) {
                    bail!(
                        "{}: prefill pool `{}` is spread over processes, so each of them hands off over its own \
                         links: link {} → {} must be backend = \"tcp\", to a decode pool run in a process of its \
                         own (`--pools {}` here, `--pools {}` there)",
                        graph.path.display(),
                        p.name,
                        l.from,
                        l.to,
                        p.name,
                        l.to
                    );
                }
            }
            PoolRole::Decode => bail!(
                "{}: decode pool `{}` cannot be spread over processes: a handoff lands in the memory of the one \
                 process its link reaches; spread its prefill pool instead, or give it more ranks in one process",
                graph.path.display(),
                p.name
            ),
        }
    }
    Ok(())
}

/// Checks the rank memory this process is asked to hold (every pool's budgets together, a
/// simulated pool's aside) against what the machine has, before anything is allocated. (Each pool's rank count is
/// bounded by the graph's rules.)
fn check_machine(graph: &Graph, pools: &[&PoolConfig], processes: usize) -> Result<()> {
    let Some(available) = models::available_memory() else { return Ok(()) };
    let mut total: u128 = 0;
    let mut parts = Vec::new();
    // A simulated rank holds no KV or state: its blocks are only counted.
    for pool in pools.iter().filter(|p| p.executor != super::simulated::SIM) {
        let here = (pool.ranks / processes.max(1)).max(1) as u128;
        let bytes = here * pool.memory.budget_bytes as u128;
        total += bytes;
        parts.push(format!("pool `{}`: {here} rank(s) × {} bytes", pool.name, pool.memory.budget_bytes));
    }
    if total > available {
        bail!(
            "{}: memory.budget_bytes: this process would hold {} of rank memory ({}), more than the {} this \
             machine has available (MemAvailable); lower memory.budget_bytes or the ranks",
            graph.path.display(),
            models::human_bytes(total),
            parts.join(", "),
            models::human_bytes(available)
        );
    }
    Ok(())
}

/// Every `--endpoint POOL=…` names a decode pool of the graph.
fn check_endpoints(graph: &Graph, opts: &RunOptions) -> Result<()> {
    for name in opts.endpoints.keys() {
        if !graph.pools.iter().any(|p| &p.name == name && p.role == PoolRole::Decode) {
            let decode: Vec<&str> =
                graph.pools.iter().filter(|p| p.role == PoolRole::Decode).map(|p| p.name.as_str()).collect();
            bail!(
                "--endpoint {name}=…: {} has no decode pool `{name}` (its decode pools: {})",
                graph.path.display(),
                if decode.is_empty() { "none".to_string() } else { decode.join(", ") }
            );
        }
    }
    Ok(())
}

/// A `cuda` pool that cannot start is refused before the run: a model of another family, drafts
/// for a model with recurrent state, or no driver on this machine (unless the pool emulates the
/// kernels).
pub fn check_cuda_pools(graph: &Graph, model: &Model) -> Result<()> {
    for pool in graph.pools.iter().filter(|p| p.executor == "cuda") {
        let settings = kvflow_operators::executor::CudaSettings::read(&pool.executor_settings)
            .map_err(|e| anyhow!("{}: pool {}: {e}", graph.path.display(), pool.name))?;
        if let Some(why) = kvflow_kernels::cuda::unsupported(model) {
            bail!("{}: pool {}: {why}", graph.path.display(), pool.name);
        }
        if settings.emulate {
            continue;
        }
        let visible = kvflow_kernels::cuda::visible_gpus().map_err(|e| {
            anyhow!(
                "{}: pool {}: executor `cuda`: {e} (`emulate = true` in [pool.executor_settings] runs the kernels on \
                 the CPU instead)",
                graph.path.display(),
                pool.name
            )
        })?;
        if visible == 0 {
            bail!("{}: pool {}: executor `cuda`: the driver shows no GPU", graph.path.display(), pool.name);
        }
        if let Some(asked) = settings.gpus.iter().flatten().find(|&&g| g >= visible) {
            bail!(
                "{}: pool {}: executor_settings.gpus names GPU {asked}, and this machine has {visible} visible \
                 (CUDA_VISIBLE_DEVICES)",
                graph.path.display(),
                pool.name
            );
        }
    }
    Ok(())
}
