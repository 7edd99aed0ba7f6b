//! The `kvflow` command line: the command tree (clap) and the hand-off of each subcommand to
//! its body (src/cli/ for the command line's own, the library for the rest).

mod cli;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use cli::bench::BenchCommand;
use cli::generate::GenerateArgs;
use cli::run::{RunArgs, RunFlags};
use std::io::IsTerminal;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "kvflow", version, about = "LLM serving on timely dataflow")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Greedy generation for a JSONL file of prompts, as one continuous batch on one CPU executor.
    #[command(allow_negative_numbers = true)]
    Generate(GenerateArgs),
    /// Runs a graph: its pool serves the workload's trace; writes report.json and requests.jsonl.
    Run(Box<RunArgs>),
    /// Writes the seeded model of a TOML model spec as a checkpoint folder (config.json and
    /// model.safetensors in f32, under the family's tensor names — a DeepSeek spec with
    /// num_nextn_predict_layers = 1 includes its MTP layer).
    SeedCheckpoint {
        /// The TOML model spec.
        spec: PathBuf,
        /// The checkpoint folder to write (created if missing).
        out: PathBuf,
    },
    /// Replays the same trace and seed through each graph (aggregated against P/D, say) and
    /// prints TTFT, TPOT, queueing, throughput and goodput side by side; every report is written
    /// (with --out DIR, into DIR/<graph name>).
    #[command(allow_negative_numbers = true)]
    Compare {
        /// Two or more graph files.
        #[arg(required = true, num_args = 2..)]
        graphs: Vec<PathBuf>,
        #[command(flatten)]
        flags: Box<RunFlags>,
    },
    /// Sweeps a simulated graph (every pool's executor "sim") over ranks per pool and prefill
    /// chunk sizes, and prints each configuration's goodput per GPU under the SLO, best first
    /// (plan.json, and plan.png with --plot, in the report folder).
    #[command(allow_negative_numbers = true)]
    Plan(Box<cli::plan::PlanArgs>),
    /// Starts every process of a graph on this machine (a decode pool reached over tcp in its own
    /// process, a pool listing several hosts as one process each) and waits for the run; the same
    /// run flags (after `--`) go to every process.
    Launch {
        /// The graph file (TOML).
        graph: PathBuf,
        /// Flags for `kvflow run`, given to every process: `kvflow launch g.toml -- --verify`.
        #[arg(last = true)]
        run_flags: Vec<String>,
    },
    /// Validates a graph and prints the operator graph the runtime would build.
    Check {
        graph: PathBuf,
        /// Print the operator graph as Graphviz DOT.
        #[arg(long)]
        dot: bool,
    },
    /// Serves a graph over HTTP as an OpenAI-compatible API (/v1/completions,
    /// /v1/chat/completions, /v1/models, /health, /metrics) until SIGTERM or Ctrl-C, which drain
    /// it; then writes report.json and requests.jsonl.
    Serve(Box<kvflow::server::command::ServeArgs>),
    /// Draws charts of one or more runs' reports (each run a labelled line): TTFT and TPOT CDFs,
    /// output tokens/s and KV use over time, as PNGs.
    Plot {
        /// Report folders (each holding report.json and requests.jsonl).
        #[arg(required = true)]
        reports: Vec<PathBuf>,
        /// Where the PNGs go (default: the report folder, or out/plots for several).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Benchmarks that print figures beside a baseline measured in the same run.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal()) // no colour codes in a log file
        .init();
    match run() {
        Ok(0) => {}
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            std::process::exit(1);
        }
    }
}

/// An error and its causes, each once: a cause whose text its parent's message already shows
/// (an OS error a library message quotes, say) is not printed again.
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

/// Runs the subcommand of the command line; its exit status.
fn run() -> Result<i32> {
    kvflow_kernels::cpu::simd::check_cpu_supports_build().map_err(anyhow::Error::msg)?;
    match Cli::parse().command {
        Command::SeedCheckpoint { spec, out } => {
            let names = kvflow_kernels::models::write_seeded_checkpoint(&spec, &out)
                .with_context(|| format!("cannot write the seeded checkpoint of {}", spec.display()))?;
            println!("{}: {} tensors written", out.display(), names.len());
            Ok(0)
        }
        Command::Generate(args) => cli::generate::run(args),
        Command::Run(args) => cli::run::run(*args),
        Command::Serve(args) => {
            let interrupts = kvflow::signals::watch().context("cannot set up SIGINT/SIGTERM handling")?;
            kvflow::server::command::serve(*args, &interrupts)
        }
        Command::Plot { reports, out } => {
            let out =
                out.unwrap_or_else(|| if reports.len() == 1 { reports[0].clone() } else { PathBuf::from("out/plots") });
            cli::run::plot_runs(&reports, &out)?;
            Ok(0)
        }
        Command::Compare { graphs, flags } => {
            let interrupts = kvflow::signals::watch().context("cannot set up SIGINT/SIGTERM handling")?;
            cli::compare::compare(&graphs, &flags, &interrupts)
        }
        Command::Plan(args) => {
            let interrupts = kvflow::signals::watch().context("cannot set up SIGINT/SIGTERM handling")?;
            cli::plan::plan(*args, &interrupts)
        }
        Command::Launch { graph, run_flags } => {
            let registry = kvflow::registry::Registry::default();
            let loaded = kvflow::graph::Graph::load_with(&graph, &registry.names())?;
            kvflow::launch::launch(&loaded, &graph, &run_flags)
        }
        Command::Check { graph, dot } => {
            cli::check::run(&graph, dot)?;
            Ok(0)
        }
        Command::Bench { what } => {
            cli::bench::run(what)?;
            Ok(0)
        }
    }
}
