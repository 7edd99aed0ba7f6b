//! The `kvflow` command line.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use kvflow::bench::model::{self as bench_model, ModelBenchArgs};
use kvflow::generate::{generate, read_prompts, write_jsonl, GenerateOptions};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Parser)]
#[command(name = "kvflow", version, about = "LLM serving on timely dataflow")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Greedy generation for a JSONL file of prompts, as one continuous batch on one CPU executor.
    Generate {
        /// Hugging Face checkpoint folder, or a TOML model spec (seeded random weights).
        #[arg(long)]
        model: PathBuf,
        /// JSONL, one {"prompt": [token ids]} per line.
        #[arg(long)]
        prompts: PathBuf,
        /// Greedy tokens per prompt (end-of-sequence does not stop generation).
        #[arg(long)]
        max_new_tokens: usize,
        /// Prefill chunk size in tokens.
        #[arg(long, default_value_t = 64)]
        chunk_tokens: usize,
        /// Also print the first K decode logits vectors (the logits that chose tokens[1..=K]).
        #[arg(long, default_value_t = 0)]
        decode_logits: usize,
        /// Paged KV block size in tokens.
        #[arg(long, default_value_t = 16)]
        block_size: usize,
        /// Write the JSONL here instead of standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Runs a graph: its pool serves the workload's trace; writes report.json and requests.jsonl.
    Run(Box<RunArgs>),
    /// Validates a graph and prints the operator graph the runtime would build.
    Check {
        graph: PathBuf,
        /// Print the operator graph as Graphviz DOT.
        #[arg(long)]
        dot: bool,
    },
    /// Benchmarks that print figures beside a baseline measured in the same run.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
}

#[derive(clap::Args)]
struct RunArgs {
    /// The graph file (TOML).
    graph: PathBuf,
    /// Checkpoint folder or model spec (overrides model.path).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    trace: Option<PathBuf>,
    /// mooncake | azure | vidur
    #[arg(long)]
    format: Option<String>,
    /// Measured requests (after the warmup ones).
    #[arg(long)]
    limit: Option<usize>,
    #[arg(long)]
    warmup: Option<usize>,
    /// Tokens per 512-token trace block.
    #[arg(long)]
    block_tokens: Option<usize>,
    #[arg(long)]
    max_output_tokens: Option<usize>,
    /// Closed loop with this many requests in flight (switches the workload to concurrency mode).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Ranks of every pool.
    #[arg(long)]
    ranks: Option<usize>,
    /// Output folder.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Re-run every request alone on the reference path and compare tokens and logits bits.
    #[arg(long)]
    verify: bool,
    /// Run only this pool of the graph (default: every pool).
    #[arg(long)]
    pool: Option<String>,
    /// After Ctrl-C, seconds in-flight requests may finish before they are cancelled.
    #[arg(long, default_value_t = 10.0)]
    grace_period: f64,
    /// Seconds without any progress, with requests pending, before the run is declared stalled
    /// (it prints which operator on which rank holds which step, and exits with status 3).
    #[arg(long, default_value_t = 60.0)]
    stall_timeout: f64,
    /// Test only: `OPERATOR:RANK:STEP` makes that operator keep a capability for that step.
    #[arg(long, hide = true)]
    test_hold_capability: Option<String>,
    /// Test only: `align` does not wait for every rank's report (removes collective alignment).
    #[arg(long, hide = true)]
    test_align_without_waiting: bool,
    /// Test only: `RANK:STEP` makes that rank's forward sleep inside that step.
    #[arg(long, hide = true)]
    test_stuck_in_forward: Option<String>,
    /// This process's index in a pool spread over several processes (with --processes, --hostfile).
    #[arg(long, requires_all = ["processes", "hostfile"])]
    process: Option<usize>,
    #[arg(long)]
    processes: Option<usize>,
    /// One host:port per line, one line per process.
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// Test only: requests whose id is a multiple of N read KV through a block table with two
    /// entries swapped (shows that --verify catches it).
    #[arg(long, hide = true)]
    test_swap_block_table_every: Option<u64>,
    /// Test only: `ID:STAGE,…` cancels request ID once its rank sees it queued, prefilling or
    /// decoding.
    #[arg(long, hide = true)]
    test_cancel_at_stage: Option<String>,
    /// Test only: when request ID finishes, its rank forgets its KV blocks instead of releasing
    /// them (the accounting check must catch it).
    #[arg(long, hide = true)]
    test_leak_blocks_of: Option<u64>,
    /// Test only: completions reach whatever holds the slab slot they name, whatever its
    /// generation (removes the generation check).
    #[arg(long, hide = true)]
    test_accept_stale_completions: bool,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Coordination cost per step: scheduling policy CPU time, and the pool's wall time per step
    /// (no-math executor) against a bare timely loop.
    Step {
        #[arg(long, default_value_t = 8)]
        ranks: usize,
        /// Running sequences per rank.
        #[arg(long, default_value_t = 256)]
        seqs: usize,
        /// Output tokens per request in the pool run (≈ steps measured).
        #[arg(long, default_value_t = 200)]
        steps: usize,
    },
    /// Prefill/decode tokens/s and GFLOP/s of one executor thread against two GEMM baselines.
    Model {
        /// Checkpoint folder or TOML model spec (default: a seeded mha model, hidden 1024).
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value_t = 64)]
        batch: usize,
        #[arg(long, default_value_t = 512)]
        context: usize,
        #[arg(long, default_value_t = 8)]
        decode_steps: usize,
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn parse_cancel_at_stage(text: Option<&str>) -> Result<Vec<(u64, String)>> {
    let Some(text) = text else { return Ok(Vec::new()) };
    text.split(',')
        .map(|item| {
            let (id, stage) = item.split_once(':').ok_or_else(|| anyhow::anyhow!("expected ID:STAGE, got {item:?}"))?;
            if !["queued", "prefilling", "decoding"].contains(&stage) {
                anyhow::bail!("stage {stage:?} is not queued, prefilling or decoding");
            }
            Ok((id.parse()?, stage.to_string()))
        })
        .collect()
}

fn run_graph(args: RunArgs) -> Result<i32> {
    use kvflow::graph::{Graph, Overrides};
    use kvflow::runtime::{self, ClusterPlace, RunOptions};
    let registry = kvflow::registry::Registry::default();
    let mut graph = Graph::load_with(&args.graph, &registry.names())?;
    graph.apply_overrides(&Overrides {
        model: args.model,
        trace: args.trace,
        format: args.format,
        limit: args.limit,
        warmup: args.warmup,
        block_tokens: args.block_tokens,
        max_output_tokens: args.max_output_tokens,
        concurrency: args.concurrency,
        ranks: args.ranks,
        out: args.out,
    })?;
    let cluster = match (args.process, args.processes, args.hostfile) {
        (Some(process), Some(processes), Some(hostfile)) => {
            let text = std::fs::read_to_string(&hostfile)
                .with_context(|| format!("cannot read hostfile {}", hostfile.display()))?;
            let addresses: Vec<String> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from)
                .collect();
            if addresses.len() != processes {
                anyhow::bail!("{}: {} addresses for --processes {processes}", hostfile.display(), addresses.len());
            }
            if process >= processes {
                anyhow::bail!("--process {process} is not below --processes {processes}");
            }
            Some(ClusterPlace { process, processes, addresses })
        }
        (None, None, None) => None,
        _ => anyhow::bail!("--process, --processes and --hostfile go together"),
    };
    // Ctrl-C stops admissions and lets in-flight requests finish within the grace period; a
    // second Ctrl-C ends the process at once.
    let interrupt = Arc::new(AtomicBool::new(false));
    let flag = interrupt.clone();
    ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            eprintln!("interrupted twice: exiting now");
            std::process::exit(130);
        }
        eprintln!("interrupted: no more requests; finishing what is in flight (Ctrl-C again to exit now)");
    })
    .context("cannot install the Ctrl-C handler")?;
    let opts = RunOptions {
        interrupt: Some(interrupt),
        grace: Some(std::time::Duration::from_secs_f64(args.grace_period)),
        stall_timeout: Some(std::time::Duration::from_secs_f64(args.stall_timeout)),
        pool: args.pool,
        cluster,
        verify: args.verify,
        show_progress: true,
        switches: kvflow_operators::rank::TestSwitches {
            swap_block_table_every: args.test_swap_block_table_every,
            leak_blocks_of: args.test_leak_blocks_of,
            accept_stale_completions: args.test_accept_stale_completions,
            cancel_at_stage: parse_cancel_at_stage(args.test_cancel_at_stage.as_deref())?,
            align_without_waiting: args.test_align_without_waiting,
            stuck_in_forward: match args.test_stuck_in_forward.as_deref() {
                None => None,
                Some(text) => {
                    let (rank, step) =
                        text.split_once(':').ok_or_else(|| anyhow::anyhow!("expected RANK:STEP, got {text:?}"))?;
                    Some((rank.parse()?, step.parse()?))
                }
            },
            hold_capability: match args.test_hold_capability.as_deref() {
                None => None,
                Some(text) => {
                    let parts: Vec<&str> = text.split(':').collect();
                    let [op, rank, step] = parts[..] else {
                        anyhow::bail!("expected OPERATOR:RANK:STEP, got {text:?}")
                    };
                    Some((op.to_string(), rank.parse()?, step.parse()?))
                }
            },
        },
    };
    let outcome = runtime::run(&graph, &opts, &registry)?;
    if let Some(report) = &outcome.report {
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
            outcome.out_dir.display()
        );
    }
    Ok(outcome.exit_code)
}

fn run() -> Result<()> {
    kvflow_kernels::cpu::simd::check_cpu_supports_build().map_err(anyhow::Error::msg)?;
    match Cli::parse().command {
        Command::Generate { model, prompts, max_new_tokens, chunk_tokens, decode_logits, block_size, out } => {
            let model = kvflow_kernels::models::load(&model)
                .with_context(|| format!("cannot load model {}", model.display()))?;
            let prompts = read_prompts(&prompts, &model)?;
            let opts = GenerateOptions { max_new_tokens, chunk_tokens, decode_logits, block_size, show_progress: true };
            let results = generate(&model, &prompts, &opts)?;
            match out {
                Some(path) => {
                    let mut f = std::io::BufWriter::new(
                        std::fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?,
                    );
                    write_jsonl(&mut f, &results)?;
                }
                None => write_jsonl(&mut std::io::stdout().lock(), &results)?,
            }
        }
        Command::Run(args) => {
            let code = run_graph(*args)?;
            if code != 0 {
                std::process::exit(code);
            }
        }
        Command::Check { graph, dot } => {
            let registry = kvflow::registry::Registry::default();
            let graph = kvflow::graph::Graph::load_with(&graph, &registry.names())?;
            if dot {
                print!("{}", kvflow::runtime::dot::render(&graph, &registry, None)?);
            } else {
                println!(
                    "{}: ok — model {}, {} pool(s): {}",
                    graph.path.display(),
                    graph.model.display(),
                    graph.pools.len(),
                    graph
                        .pools
                        .iter()
                        .map(|p| format!("{} ({}, {} ranks)", p.name, p.role, p.ranks))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
        Command::Bench { what: BenchCommand::Step { ranks, seqs, steps } } => {
            kvflow::bench::step::run(&kvflow::bench::step::StepBenchArgs { ranks, seqs, steps })?;
        }
        Command::Bench { what: BenchCommand::Model { model, batch, context, decode_steps } } => {
            bench_model::run(&ModelBenchArgs { model, batch, context, decode_steps })?;
        }
    }
    Ok(())
}
