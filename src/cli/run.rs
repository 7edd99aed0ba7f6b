//! `kvflow run`: the flags a run takes (shared with `kvflow compare`) and the run of one graph —
//! load it with the flags' overrides, place this process in a cluster, run the pools, print the
//! report's summary line.

use anyhow::{Context, Result};
use kvflow::flags;
use kvflow::graph::{Graph, Overrides};
use kvflow::runtime::{self, ClusterPlace, RunOptions};
use kvflow::signals::Interrupts;
use kvflow_operators::rank::TestSwitches;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(clap::Args)]
#[command(allow_negative_numbers = true)] // so `--stall-timeout -1` reaches the flag's own check
pub struct RunArgs {
    /// The graph file (TOML).
    pub graph: PathBuf,
    #[command(flatten)]
    pub flags: RunFlags,
}

/// What `run` and `compare` take beside the graphs.
#[derive(clap::Args, Clone)]
pub struct RunFlags {
    /// Checkpoint folder or model spec (overrides model.path).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// mooncake | azure | vidur
    #[arg(long)]
    pub format: Option<String>,
    /// Measured requests (after the warmup ones).
    #[arg(long, value_parser = flags::count)]
    pub limit: Option<usize>,
    #[arg(long, value_parser = flags::count_or_zero)]
    pub warmup: Option<usize>,
    /// Tokens per 512-token trace block.
    #[arg(long, value_parser = flags::count)]
    pub block_tokens: Option<usize>,
    #[arg(long, value_parser = flags::count)]
    pub max_output_tokens: Option<usize>,
    /// Closed loop with this many requests in flight (switches the workload to concurrency mode).
    #[arg(long, value_parser = flags::count)]
    pub concurrency: Option<usize>,
    /// Ranks of every pool.
    #[arg(long, value_parser = flags::count)]
    pub ranks: Option<usize>,
    /// Output folder.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Re-run every request alone on the reference path and compare tokens and logits bits.
    #[arg(long)]
    pub verify: bool,
    /// Also draw the run's charts (TTFT and TPOT CDFs, throughput and KV use over time) as PNGs
    /// beside its report (compare: every run on each chart, into --out or out/compare).
    #[arg(long)]
    pub plot: bool,
    /// Run only this pool of the graph (default: every pool).
    #[arg(long)]
    pub pool: Option<String>,
    /// Run only these pools of a P/D graph (comma-separated); the others run in other processes,
    /// joined to these over their tcp links. The process running the prefill pools replays the
    /// workload and writes the report; one running only decode pools serves their handoffs.
    #[arg(long, value_delimiter = ',', conflicts_with = "pool")]
    pub pools: Option<Vec<String>>,
    /// `POOL=HOST:PORT`: where decode pool POOL listens — bound there when it runs in this process,
    /// reached there when it runs in another (whose process prints the address). Repeatable.
    #[arg(long = "endpoint", value_parser = parse_endpoint_flag)]
    pub endpoints: Vec<(String, String)>,
    /// After SIGINT (Ctrl-C) or SIGTERM, seconds in-flight requests may finish before they are
    /// cancelled (0: cancel them at once).
    #[arg(long, default_value = "10", value_parser = flags::seconds)]
    pub grace_period: Duration,
    /// Seconds without any progress, with requests pending, before the run is declared stalled
    /// (it prints which operator on which rank holds which step, and exits with status 3);
    /// 0 turns the stall watchdog off.
    #[arg(long, default_value = "60", value_parser = flags::seconds)]
    pub stall_timeout: Duration,
    /// The longest gap the workload may leave before its next request (after time_scale); a
    /// longer one fails the run before it starts, naming the request. Waits over 10 s are
    /// printed as they happen.
    #[arg(long, default_value = "600", value_parser = flags::seconds)]
    pub max_wait: Duration,
    /// This process's index in a pool spread over several processes: of the pool's `hosts` in
    /// the graph, or with --processes and --hostfile.
    #[arg(long)]
    pub process: Option<usize>,
    #[arg(long, value_parser = flags::count, requires_all = ["process", "hostfile"])]
    pub processes: Option<usize>,
    /// One host:port per line, one line per process.
    #[arg(long)]
    pub hostfile: Option<PathBuf>,
    /// Test only: `NAME[=ARG]` sets one of the test switches, each removing or breaking one
    /// mechanism so a test can show the check guarding it fails (operators/src/rank/switches.rs;
    /// NAME is the `TestSwitches` field's name with dashes: `--test-switch leak-blocks-of=7`).
    /// Repeatable.
    #[arg(long = "test-switch", hide = true, value_name = "NAME[=ARG]", value_parser = check_test_switch)]
    pub test_switches: Vec<String>,
}

/// `kvflow run GRAPH`: runs it, draws its charts when asked; the run's exit status.
pub fn run(args: RunArgs) -> Result<i32> {
    // Before any other thread starts: every thread inherits the blocked signals.
    let interrupts = kvflow::signals::watch().context("cannot set up SIGINT/SIGTERM handling")?;
    let RunArgs { graph, flags } = args;
    let plot = flags.plot;
    let (code, _, out_dir) = run_graph(&graph, flags, &interrupts)?;
    if plot {
        plot_runs(std::slice::from_ref(&out_dir), &out_dir)?;
    }
    Ok(code)
}

/// The graph at `graph_path` with the overrides of `args`, and how to run it, once every check
/// that needs neither the model nor the workload has passed ([`runtime::check_run`]).
pub fn checked_graph(graph_path: &Path, args: &RunFlags, interrupts: &Interrupts) -> Result<(Graph, RunOptions)> {
    let registry = kvflow::registry::Registry::default();
    let graph = Graph::load_overridden(graph_path, &registry.names(), &args.overrides())?;
    let cluster = cluster_place(&graph, args)?;
    let opts = RunOptions {
        interrupt: Some(interrupts.flag.clone()),
        grace: Some(args.grace_period),
        stall_timeout: Some(args.stall_timeout),
        max_wait: Some(args.max_wait),
        front_end: None,
        pool: args.pool.clone(),
        pools: args.pools.clone(),
        endpoints: args.endpoints.iter().cloned().collect(),
        cluster,
        verify: args.verify,
        show_progress: true,
        switches: test_switches(&args.test_switches)?,
    };
    runtime::check_run(&graph, &opts)?;
    Ok((graph, opts))
}

/// Runs the graph at `graph_path` with `args`: the exit status, the report (when this process
/// wrote one) and the output folder.
pub fn run_graph(
    graph_path: &Path,
    args: RunFlags,
    interrupts: &Interrupts,
) -> Result<(i32, Option<serde_json::Value>, PathBuf)> {
    let (graph, opts) = checked_graph(graph_path, &args, interrupts)?;
    run_checked(&graph, &opts, interrupts)
}

/// Runs a graph [`checked_graph`] gave.
pub fn run_checked(
    graph: &Graph,
    opts: &RunOptions,
    interrupts: &Interrupts,
) -> Result<(i32, Option<serde_json::Value>, PathBuf)> {
    let registry = kvflow::registry::Registry::default();
    let outcome = runtime::run(graph, opts, &registry)?;
    if let Some(report) = &outcome.report {
        print_summary(report, &outcome.out_dir);
    }
    // An interrupted run did not serve its workload: 130 (SIGINT) or 143 (SIGTERM).
    Ok((interrupts.exit_status().unwrap_or(outcome.exit_code), outcome.report, outcome.out_dir))
}

impl RunFlags {
    /// What the flags change in the graph file.
    fn overrides(&self) -> Overrides {
        Overrides {
            model: self.model.clone(),
            trace: self.trace.clone(),
            format: self.format.clone(),
            limit: self.limit,
            warmup: self.warmup,
            block_tokens: self.block_tokens,
            max_output_tokens: self.max_output_tokens,
            concurrency: self.concurrency,
            ranks: self.ranks,
            out: self.out.clone(),
        }
    }
}

/// This process's place in a cluster: from --hostfile, from the graph's hosts, or none.
fn cluster_place(graph: &Graph, flags: &RunFlags) -> Result<Option<ClusterPlace>> {
    let mut place = match (flags.process, flags.processes, &flags.hostfile) {
        (Some(process), Some(processes), Some(hostfile)) => ClusterPlace::from_hostfile(hostfile, process, processes)?,
        (Some(process), None, None) => {
            ClusterPlace::from_graph(graph, flags.pools.as_deref(), flags.pool.as_deref(), process)?
        }
        (None, None, None) => return Ok(None),
        _ => anyhow::bail!("--processes and --hostfile go together, with --process"),
    };
    place.connect_timeout = flags.stall_timeout; // a peer that never connects is a stall too
    Ok(Some(place))
}

/// The test switches the `--test-switch` flags set, in order.
fn test_switches(specs: &[String]) -> Result<TestSwitches> {
    let mut switches = TestSwitches::default();
    for spec in specs {
        switches.set_from(spec)?;
    }
    Ok(switches)
}

/// `--test-switch`'s check when the command line is read: a switch `TestSwitches` knows, with
/// an argument of its form.
fn check_test_switch(spec: &str) -> Result<String, String> {
    TestSwitches::default().set_from(spec).map_err(|e| e.to_string())?;
    Ok(spec.to_string())
}

/// The run's one-line summary on standard error.
fn print_summary(report: &serde_json::Value, out_dir: &Path) {
    let get = |k: &str| report[k].clone();
    eprintln!(
        "{} requests: {} completed, {} failed; output {:.1} tokens/s; TTFT p50 {} ms; verify {}/{} mismatched; report in {}",
        get("requests"),
        get("completed"),
        get("failed"),
        report["output_tokens_per_s"].as_f64().unwrap_or(0.0),
        report["ttft_ms"]["p50"].as_f64().map_or("-".into(), |v| format!("{v:.1}")),
        report["verify"]["mismatched"],
        report["verify"]["checked"],
        out_dir.display()
    );
}

/// Draws the charts of the runs reported in `dirs` into `out` and names the files.
pub fn plot_runs(dirs: &[PathBuf], out: &Path) -> Result<()> {
    let runs = dirs.iter().map(|d| kvflow::plot::read_run(d)).collect::<Result<Vec<_>>>()?;
    for file in kvflow::plot::plot(&runs, out)? {
        eprintln!("wrote {}", file.display());
    }
    Ok(())
}

fn parse_endpoint_flag(text: &str) -> Result<(String, String), String> {
    let (pool, endpoint) = text
        .split_once('=')
        .ok_or_else(|| format!("expected POOL=HOST:PORT (e.g. decode=127.0.0.1:7000), got {text:?}"))?;
    let endpoint: kvflow::graph::Endpoint = endpoint.parse()?;
    if pool.is_empty() {
        return Err(format!("expected POOL=HOST:PORT, got {text:?}: the pool name is empty"));
    }
    Ok((pool.to_string(), endpoint.to_string()))
}
