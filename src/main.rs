//! The `kvflow` command line.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use kvflow::bench::model::{self as bench_model, ModelBenchArgs};
use kvflow::generate::{generate, read_prompts, write_jsonl, GenerateOptions};
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
    /// Benchmarks that print figures beside a baseline measured in the same run.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
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
        Command::Bench { what: BenchCommand::Model { model, batch, context, decode_steps } } => {
            bench_model::run(&ModelBenchArgs { model, batch, context, decode_steps })?;
        }
    }
    Ok(())
}
