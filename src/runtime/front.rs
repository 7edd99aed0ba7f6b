//! Front ends: what releases a run's requests in place of the workload's trace. The runtime
//! defines what one is ([`FrontEnd`]) and hands it, once the pools run, what it needs
//! ([`FrontEndJob`]); `kvflow serve`'s HTTP server is one (`crate::server`), handed to the run in
//! `RunOptions::serve`. A front end releases and cancels requests through the run's
//! [`Entries`], as the trace driver does.

use super::entry::Entries;
use crate::graph::Graph;
use kvflow_kernels::models::Model;
use kvflow_operators::rank::RankGauges;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Every pool's ranks' gauges, by pool name (a front end's metrics read them; the report's KV
/// usage timeline samples them).
pub type PoolGauges = Vec<(String, Vec<Arc<RankGauges>>)>;

/// What a front end is handed when the run's pools have started.
pub struct FrontEndJob<'a> {
    pub graph: &'a Graph,
    pub model: &'a Model,
    /// Where its requests enter the run, and are cancelled; and the collector that records them.
    pub entries: Arc<Entries>,
    /// Set by SIGTERM or Ctrl-C (or a test): stop taking requests, drain.
    pub interrupted: Arc<AtomicBool>,
    /// How long requests in flight may finish after an interrupt before they are cancelled.
    pub grace: Duration,
    /// The longest request it takes ([`FrontEnd::max_context`]): rank memory is planned for it.
    pub max_context: usize,
    pub gauges: PoolGauges,
}

/// A source of requests other than the workload's trace. Its requests are not known ahead: the
/// run takes them until the front end has drained.
pub trait FrontEnd: Send + Sync + std::fmt::Debug {
    /// The longest request (prompt + output tokens) it takes for `graph` on `model`.
    fn max_context(&self, graph: &Graph, model: &Model) -> usize;

    /// Starts taking requests on a thread of its own. The thread ends once the front end has
    /// drained (after an interrupt) and closed every entry pool ([`Entries::close`]).
    fn spawn(&self, job: FrontEndJob<'_>) -> anyhow::Result<JoinHandle<()>>;
}
