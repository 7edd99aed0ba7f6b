//! The first phase of `kvflow run` ([`super::run`]): every check that can refuse the run before
//! anything starts, then the model, the workload and one job per pool. A refused run leaves
//! nothing behind: the report folder is made only once every check has passed.

use super::checks::{check_cuda_pools, pools_of_run};
use super::jobs::{arrival_mode, load_model, load_workload, pool_job};
use super::links;
use super::offload;
use super::options::{RunOptions, DEFAULT_MAX_WAIT};
use super::pool::PoolJob;
use super::verify;
use crate::graph::{Graph, PoolConfig};
use crate::registry::Registry;
use crate::workload::Selection;
use anyhow::{anyhow, bail, Result};
use kvflow_kernels::models::Model;
use std::sync::Arc;

/// A run ready to start.
pub struct Prepared<'g> {
    /// The pools this process runs.
    pub pools: Vec<&'g PoolConfig>,
    pub model: Arc<Model>,
    /// The workload's requests (none when a front end releases them).
    pub selection: Selection,
    /// The longest request (prompt + output tokens) rank memory is planned for.
    pub largest: usize,
    /// One per pool, in the order of `pools`.
    pub jobs: Vec<PoolJob>,
    /// Whether this process runs pools new requests enter: it drives the workload and writes
    /// the report. One running only decode pools serves the handoffs that come to it.
    pub drives: bool,
    /// The offload tier's store, shared by the pools (its faults go in the report).
    pub store: Option<offload::RunStore>,
}

/// The checks of a run that need neither its model nor its workload (`kvflow compare` makes
/// them for every graph before it runs the first): the pools it runs, that its report folder
/// can be made (nothing is made yet), what the runtime does not take. The pools, and whether
/// this process drives the workload.
pub fn check_run<'g>(graph: &'g Graph, opts: &RunOptions) -> Result<(Vec<&'g PoolConfig>, bool)> {
    let pools = pools_of_run(graph, opts)?;
    let drives = pools.iter().any(|p| links::Wiring::entry_kind(graph, &pools, p).is_some());
    if drives {
        check_report_dir_can_be_made(&graph.report_dir)
            .map_err(|why| anyhow!("{}: report.out (or --out): {why}", graph.path.display()))?;
    }
    if !graph.workload.ignore_eos && opts.front_end.is_none() {
        bail!(
            "{}: workload.ignore_eos = false is not supported yet: outputs follow the trace's lengths",
            graph.path.display()
        );
    }
    Ok((pools, drives))
}

/// Whether `dir` can become the report folder, making nothing: an existing one must be a
/// writable folder ([`crate::report::check_output_dir`]), else its nearest existing parent
/// must be a folder.
fn check_report_dir_can_be_made(dir: &std::path::Path) -> Result<(), String> {
    if dir.exists() {
        return crate::report::check_output_dir(dir);
    }
    let parent = dir.ancestors().skip(1).find(|a| a.exists());
    match parent {
        Some(p) if !p.as_os_str().is_empty() && !p.is_dir() => {
            Err(format!("cannot create {}: {} is not a folder", dir.display(), p.display()))
        }
        _ => Ok(()),
    }
}

/// Checks the run, loads the model and the workload, and makes each pool's job; then the report
/// folder.
pub fn prepare<'g>(graph: &'g Graph, opts: &RunOptions, registry: &Registry) -> Result<Prepared<'g>> {
    let (pools, drives) = check_run(graph, opts)?;
    let model = load_model(graph)?;
    check_cuda_pools(graph, &model)?;
    let selection = match &opts.front_end {
        Some(_) => Selection { requests: Vec::new(), warmup: 0, measured: 0, note: None },
        None => load_workload(graph, model.vocab_size)?,
    };
    // Refuses sampling the graph cannot run or `--verify` cannot replay (each request's own
    // sampling travels with it from its release).
    verify::sampling_of_requests(graph, &selection.requests, opts.verify)?;
    let max_wait = opts.max_wait.unwrap_or(DEFAULT_MAX_WAIT);
    if let Some(why) = crate::workload::longest_wait_over(&selection, &arrival_mode(graph), max_wait) {
        bail!("{}: {why}", graph.path.display());
    }
    let largest = largest_request(graph, opts, &model, &selection);
    let store = offload::open_store(graph)?;
    let jobs: Vec<PoolJob> = pools
        .iter()
        .map(|p| pool_job(graph, p, &model, largest, opts, registry, store.as_ref()))
        .collect::<Result<_>>()?;
    if opts.cluster.is_some() && jobs.len() > 1 {
        bail!(
            "{}: a run spread over processes runs one pool; the graph has {} ({}): choose one with --pool",
            graph.path.display(),
            jobs.len(),
            jobs.iter().map(|j| j.name.as_str()).collect::<Vec<_>>().join(", ")
        );
    }
    if drives {
        crate::report::check_output_dir(&graph.report_dir)
            .map_err(|why| anyhow!("{}: report.out (or --out): {why}", graph.path.display()))?;
    }
    Ok(Prepared { pools, model, selection, largest, jobs, drives, store })
}

/// The longest request rank memory is planned for. Requests longer than the model's context are
/// refused at release; memory is sized for the rest (with a front end: for the longest request
/// it takes).
fn largest_request(graph: &Graph, opts: &RunOptions, model: &Model, selection: &Selection) -> usize {
    match &opts.front_end {
        Some(front_end) => front_end.max_context(graph, model),
        None => selection
            .requests
            .iter()
            .map(|r| r.prompt.len().saturating_add(r.max_output_tokens))
            .filter(|&len| model.max_positions.is_none_or(|max| len <= max)) // the others are refused
            .max()
            .unwrap_or(1),
    }
}
