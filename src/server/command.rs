//! The `kvflow serve` command: loads the graph and the model's text side, binds the address,
//! and runs the graph with the HTTP server in place of the trace driver until SIGTERM or Ctrl-C.

use super::Serving;
use crate::graph::{Graph, Overrides};
use crate::runtime::{self, RunOptions};
use crate::text::TextModel;
use anyhow::{anyhow, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args, Clone, Debug)]
#[command(allow_negative_numbers = true)]
pub struct ServeArgs {
    /// The graph file (TOML): its pools serve the requests.
    pub graph: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: the kernel picks; the bound address is printed once listening).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Checkpoint folder, GGUF file or model spec (overrides model.path).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Ranks of every pool.
    #[arg(long, value_parser = crate::flags::count)]
    pub ranks: Option<usize>,
    /// Where report.json and requests.jsonl go when the server stops.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// After SIGTERM or Ctrl-C, seconds in-flight requests may finish before they are cancelled.
    #[arg(long, default_value = "10", value_parser = crate::flags::seconds)]
    pub grace_period: Duration,
    /// Seconds without progress, with requests pending, before a pool is declared stalled (0: off).
    #[arg(long, default_value = "60", value_parser = crate::flags::seconds)]
    pub stall_timeout: Duration,
    /// Test only: `NAME[=ARG]` sets one of the test switches, as `kvflow run --test-switch` does.
    #[arg(long = "test-switch", hide = true, value_name = "NAME[=ARG]")]
    pub test_switches: Vec<String>,
}

/// The text side of the model at `path`, if it has one: a GGUF file, or a folder with
/// `tokenizer.json` (a model spec, or a folder without one, serves token ids only).
pub fn text_of(path: &Path) -> Result<Option<TextModel>> {
    let is_gguf = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if !is_gguf && !path.join("tokenizer.json").is_file() {
        return Ok(None);
    }
    Ok(Some(TextModel::load(path)?))
}

/// Runs `kvflow serve`; returns the exit status.
pub fn serve(args: ServeArgs, interrupts: &crate::signals::Interrupts) -> Result<i32> {
    let registry = crate::registry::Registry::default();
    let overrides =
        Overrides { model: args.model.clone(), ranks: args.ranks, out: args.out.clone(), ..Default::default() };
    let graph = Graph::load_overridden(&args.graph, &registry.names(), &overrides)?;
    let text =
        text_of(&graph.model).with_context(|| format!("cannot load the tokenizer of {}", graph.model.display()))?;
    if text.is_none() {
        eprintln!("note: {} has no tokenizer: /v1/completions takes token ids; chat is refused", graph.model.display());
    }
    let address = format!("{}:{}", args.host, args.port);
    let listener =
        std::net::TcpListener::bind(&address).map_err(|e| anyhow!("--host/--port: cannot listen on {address}: {e}"))?;
    let mut switches = kvflow_operators::rank::TestSwitches::default();
    for spec in &args.test_switches {
        switches.set_from(spec).map_err(|e| anyhow!("--test-switch: {e}"))?;
    }
    let opts = RunOptions {
        switches,
        interrupt: Some(interrupts.flag.clone()),
        grace: Some(args.grace_period),
        stall_timeout: Some(args.stall_timeout),
        show_progress: false,
        front_end: Some(Arc::new(Serving { listener, text: text.map(Arc::new) })),
        ..Default::default()
    };
    let outcome = runtime::run(&graph, &opts, &registry)?;
    if let Some(report) = &outcome.report {
        eprintln!(
            "served {} requests: {} completed, {} failed, {} cancelled; report in {}",
            report["requests"],
            report["completed"],
            report["failed"],
            report["cancelled"],
            outcome.out_dir.display()
        );
    }
    // A drained server did its job: its status is the run's, not the signal's.
    Ok(outcome.exit_code)
}
