//! `kvflow run`: loads the model and the workload a graph names, sizes each pool's rank memory,
//! starts every pool of the run (each its own timely computation: threads, or processes of a
//! cluster), drives the workload into them (or lets a front end, `kvflow serve`'s, release the
//! requests), watches them for stalls, checks every rank's accounting, runs `--verify`, and
//! writes `report.json` and `requests.jsonl`.
//!
//! [`run`] is three phases: `prepare` (every check, the model, the workload, a job per pool),
//! `start` (the pools, what releases their requests, what watches them) and `finish` (join,
//! check, verify, report).

mod checks;
mod cluster;
pub mod collector;
pub mod dot;
pub mod driver;
pub mod entry;
mod finish;
pub mod front;
mod hostfile;
mod jobs;
mod kv_usage;
mod links;
mod memory;
mod offload;
mod options;
mod peers;
pub(crate) mod pool;
mod prepare;
mod report;
mod serve;
mod simulated;
mod start;
pub(crate) mod starting;
mod verify;
mod watchdog;

pub use checks::{pick_named_pools, pick_pools};
pub use cluster::ClusterPlace;
pub use front::{FrontEnd, FrontEndJob, PoolGauges};
pub use jobs::{load_model, load_workload};
pub use kvflow_operators::pool::{build_pool_graph, PoolParts, PoolStreams};
pub use memory::plan_memory;
pub use options::{
    RunOptions, RunOutcome, DEFAULT_MAX_WAIT, EXIT_ACCOUNTING, EXIT_FAILED_REQUESTS, EXIT_OK, EXIT_STALL,
    EXIT_VERIFY_MISMATCH, PROCESS_LOST,
};
pub use pool::ExpertParallelJob;
pub use prepare::check_run;

use crate::graph::Graph;
use crate::registry::Registry;
use anyhow::Result;
use std::time::Instant;

/// Runs a graph's pools over its workload: prepare, start, finish. A process that does not
/// drive the workload runs its part instead: decode pools serving handoffs from other processes,
/// or its ranks of a pool spread over processes.
pub fn run(graph: &Graph, opts: &RunOptions, registry: &Registry) -> Result<RunOutcome> {
    let started = Instant::now();
    let prepared = prepare::prepare(graph, opts, registry)?;
    if !prepared.drives {
        return serve::serve_handoffs(graph, opts, &prepared.pools, prepared.jobs, &prepared.model);
    }
    if let Some(place) = opts.cluster.as_ref().filter(|c| c.process != 0) {
        // Another process drives the workload and writes the report; this one runs its ranks.
        return serve::run_beside_driver(graph, opts, place, &prepared.pools, prepared.jobs, &prepared.model);
    }
    let running = start::start(graph, opts, prepared)?;
    finish::finish(graph, opts, running, started)
}
