//! What `kvflow run` is asked ([`RunOptions`], beyond the graph) and what it answers
//! ([`RunOutcome`], with the exit statuses).

use super::cluster::ClusterPlace;
use super::front::FrontEnd;
use kvflow_operators::rank::TestSwitches;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// Exit status: all good.
pub const EXIT_OK: i32 = 0;
/// The failure cause of a request whose pool lost one of its processes (`peers`).
pub const PROCESS_LOST: &str = "process-lost";
/// Exit status: `--verify` found mismatches.
pub const EXIT_VERIFY_MISMATCH: i32 = 1;
/// Exit status: some requests failed.
pub const EXIT_FAILED_REQUESTS: i32 = 2;
/// Exit status: a pool stalled.
pub const EXIT_STALL: i32 = 3;
/// Exit status: an accounting check found memory held by no one (the report names it).
pub const EXIT_ACCOUNTING: i32 = 4;

/// How to run a graph, beyond the graph itself.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Run only this pool (default: every pool of the graph).
    pub pool: Option<String>,
    /// `--pools`: run only these pools of the graph; the others run in other processes, joined
    /// to these over their tcp links.
    pub pools: Option<Vec<String>>,
    /// `--endpoint POOL=HOST:PORT`: where a decode pool listens.
    pub endpoints: std::collections::HashMap<String, String>,
    pub cluster: Option<ClusterPlace>,
    pub verify: bool,
    pub show_progress: bool,
    pub switches: TestSwitches,
    /// Set to stop the run as if by Ctrl-C (the CLI's signal handler sets it).
    pub interrupt: Option<Arc<AtomicBool>>,
    /// How long in-flight requests may finish after an interrupt before they are cancelled.
    pub grace: Option<Duration>,
    /// With requests pending, how long no capability may change before the run is declared
    /// stalled (default 60 s; zero turns the watchdog off).
    pub stall_timeout: Option<Duration>,
    /// The longest gap the workload may leave before a release (default 10 minutes): a longer
    /// one fails the run before it starts.
    pub max_wait: Option<Duration>,
    /// A front end (`kvflow serve`'s HTTP server) that releases the requests, in place of the
    /// workload's trace.
    pub front_end: Option<Arc<dyn FrontEnd>>,
}

/// The default of [`RunOptions::max_wait`].
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(600);

/// What a run produced.
pub struct RunOutcome {
    /// `report.json`'s content (process 0 only).
    pub report: Option<serde_json::Value>,
    pub out_dir: PathBuf,
    pub exit_code: i32,
    /// Set when the trace was too short for what was asked.
    pub note: Option<String>,
}
