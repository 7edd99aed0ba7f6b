//! `kvflow bench`: the benchmarks' flags and the hand-off to each (src/bench/); every bench
//! prints its figures beside a baseline measured in the same run.

use anyhow::Result;
use kvflow::bench;
use kvflow::flags;
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Coordination cost per step: scheduling policy CPU time, and the pool's wall time per step
    /// (no-math executor) against a bare timely loop.
    Step {
        #[arg(long, default_value_t = 8, value_parser = flags::count)]
        ranks: usize,
        /// Running sequences per rank.
        #[arg(long, default_value_t = 256, value_parser = flags::count)]
        seqs: usize,
        /// Output tokens per request in the pool run (≈ steps measured).
        #[arg(long, default_value_t = 200, value_parser = flags::count)]
        steps: usize,
        /// Measure align and the MoE exchanges of an expert-parallel pool instead (cpu executor,
        /// a seeded MoE model), beside the same pool on 1 rank.
        #[arg(long)]
        expert_parallel: bool,
    },
    /// Decode tokens/s with n-gram drafting beside the same repetitive workload without it, with
    /// the acceptance rate and mean accepted length.
    Spec {
        /// A checkpoint folder, a llama GGUF file or a TOML model spec.
        #[arg(long, default_value = "fixtures/hf/llama")]
        model: PathBuf,
        #[arg(long, default_value_t = 32, value_parser = flags::count)]
        requests: usize,
        /// Output tokens per request.
        #[arg(long, default_value_t = 128, value_parser = flags::count)]
        outputs: usize,
        /// Drafts a decode carries (1 to 16).
        #[arg(long, default_value_t = 4, value_parser = flags::count)]
        draft_tokens: usize,
        /// Rounds; each figure is their median.
        #[arg(long, default_value_t = 3, value_parser = flags::count)]
        rounds: usize,
        /// The pool's executor: cpu, or cuda (deferred output and CUDA graphs, as
        /// graphs/cuda-aggregated.toml).
        #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
        executor: String,
        /// The cuda pool's weights: float32 or bfloat16.
        #[arg(long, default_value = "float32", value_parser = ["float32", "bfloat16"])]
        dtype: String,
        /// The cuda pool's kernels on the CPU instead (a check of the bench itself).
        #[arg(long)]
        emulate: bool,
        /// The KV pool's bytes (as [memory] budget_bytes: "64 MiB", "4 GiB").
        #[arg(long, default_value = "64 MiB")]
        kv_budget: String,
    },
    /// `kvflow serve` on SmolLM2 over loopback: requests/s and TTFT p50/p99 at each concurrency,
    /// beside llama-cpp-python's server on the same GGUF when it is installed.
    Serve {
        /// The SmolLM2 GGUF (default: $KVFLOW_SMOLLM2, else where tools/fetch_smollm2.sh caches it).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Requests per concurrency level.
        #[arg(long, default_value_t = 32, value_parser = flags::count)]
        requests: usize,
        /// Clients sending at once, each a closed loop (comma-separated levels).
        #[arg(long, value_delimiter = ',', default_value = "1,8,32", value_parser = flags::count)]
        concurrency: Vec<usize>,
        /// Output tokens per request at most (requests also stop at end-of-sequence).
        #[arg(long, default_value_t = 32, value_parser = flags::count)]
        max_tokens: usize,
    },
    /// Offload chunk objects saved to and loaded from the memory and disk stores (GB/s), beside
    /// memcpy and plain file writes and reads of the same bytes; with `--store redis`, through the
    /// shared Redis store beside redis-benchmark SET and GET of the same value size.
    Offload {
        /// `local` (the memory and disk stores) or `redis`.
        #[arg(long, default_value = "local", value_parser = ["local", "redis"])]
        store: String,
        /// With `--store redis`: the server (default: a redis-server the bench starts on loopback).
        #[arg(long)]
        url: Option<String>,
        /// With `--store redis`: threads saving and loading at once (and redis-benchmark's -c).
        #[arg(long, default_value_t = 1, value_parser = flags::count)]
        clients: usize,
        /// Bytes of KV per chunk (at most 1 GiB, and 4 GiB for all of a round's chunks).
        #[arg(long, default_value = "4 MiB", value_parser = bench::offload::chunk_bytes)]
        chunk_bytes: usize,
        /// Chunks per round.
        #[arg(long, default_value_t = 64, value_parser = flags::count)]
        chunks: usize,
        /// Rounds; each figure is their median.
        #[arg(long, default_value_t = 5, value_parser = flags::count)]
        rounds: usize,
        /// Folder for the disk store (default: a temporary folder).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// The KV-aware routing index: cost per applied cache event and per routing decision, beside
    /// a brute-force scan of every rank's cache for the same decisions.
    Router {
        #[arg(long, default_value_t = 8, value_parser = flags::count)]
        ranks: usize,
        /// Cached blocks over all ranks and tiers.
        #[arg(long, default_value_t = 100_000, value_parser = flags::count)]
        blocks: usize,
        /// Blocks of each request's chain of hashes.
        #[arg(long, default_value_t = 64, value_parser = flags::count)]
        chain: usize,
        #[arg(long, default_value_t = 500, value_parser = flags::count)]
        decisions: usize,
    },
    /// Handoffs over tcp on loopback (GB/s) against a plain TCP stream of the same bytes.
    Transfer {
        /// Tokens of the request each handoff moves.
        #[arg(long, default_value_t = 4096, value_parser = flags::count)]
        tokens: usize,
        /// Bytes to move (each measurement moves as many).
        #[arg(long, default_value = "1 GiB", value_parser = parse_bytes)]
        bytes: u64,
        /// Tcp connections of the link (a graph's `[transfer] connections`, 1 to 16).
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=16))]
        connections: u64,
        /// Rounds; each figure is their median.
        #[arg(long, default_value_t = 5, value_parser = flags::count)]
        rounds: usize,
    },
    /// The CUDA executor on one GPU: parity with the fixtures and the CPU executor, batch
    /// invariance, pack/unpack against a device-to-device copy, decode with deferred output on
    /// and off. Exits non-zero when a check fails.
    Device {
        /// The folder holding the llama, qwen3 and deepseek_v3 fixtures.
        #[arg(long, default_value = "fixtures/hf")]
        fixtures: PathBuf,
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// Run the kernels on the CPU instead (the checks without a GPU; slow, and its speed
        /// figures say nothing of a GPU's).
        #[arg(long)]
        emulate: bool,
        /// Writes the pack bench's block list here (one per line), for a baseline elsewhere.
        #[arg(long)]
        blocks_out: Option<PathBuf>,
        /// transformers' own bf16-vs-f32 logits gap per family (benches/device/
        /// transformers_bf16_gap.py): the bf16 check allows max(5e-2, twice that gap).
        #[arg(long, default_value = "benches/results/2026-12-03-h200-transformers-bf16-gap.json")]
        bf16_gap: PathBuf,
        /// Sets a kernel tuning constant for this run (repeatable); None changes a value's bits.
        #[arg(long = "tune", value_name = "NAME=VALUE", long_help = tuning_help())]
        tune: Vec<String>,
    },
    /// The tensor-core kernels' own checks alone (a row's attention and a product's elements
    /// the same bits however the work is cut, near float64), the part of `bench device` a kernel
    /// variant set by --tune needs first. Exits non-zero when a check fails.
    Kernels {
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// Run the kernels on the CPU instead.
        #[arg(long)]
        emulate: bool,
        /// Sets a kernel tuning constant for this run (repeatable): see `bench speed --tune`.
        #[arg(long = "tune", value_name = "NAME=VALUE")]
        tune: Vec<String>,
    },
    /// The cuda executor's prefill and decode speed on one GPU at each shape, beside the anchors
    /// benches/device/transformers_speed.py measured in the same device run (transformers eager,
    /// static cache + compiled decode step, the products alone through cuBLAS, SDPA prefill,
    /// flash-linear-attention) and beside the decode step's lower bound from the copy and matrix
    /// rates, then each step's device time kernel by kernel.
    Speed {
        /// A checkpoint folder, a llama GGUF file or a TOML model spec.
        #[arg(long)]
        model: PathBuf,
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// Sequences of the one shape measured (without --shapes).
        #[arg(long, default_value_t = 64, value_parser = flags::count)]
        batch: usize,
        /// Prompt tokens per request of the one shape measured (without --shapes).
        #[arg(long, default_value_t = 256, value_parser = flags::count)]
        prompt: usize,
        /// Shapes to measure one after the other, each BATCHxPROMPT (batch × prompt tokens,
        /// comma-separated: 64x256,1x256,16x4096,1x32768), each on a KV pool sized for it;
        /// replaces --batch and --prompt.
        #[arg(long, value_delimiter = ',', value_parser = bench::speed::Shape::parse, conflicts_with_all = ["batch", "prompt"])]
        shapes: Vec<bench::speed::Shape>,
        /// Decode steps per timed round (three rounds; each figure is their median).
        #[arg(long, default_value_t = 16, value_parser = flags::count)]
        steps: usize,
        /// The anchors' figures by shape (JSON written by benches/device/transformers_speed.py).
        #[arg(long)]
        baseline: Option<PathBuf>,
        /// Run the kernels on the CPU instead (a check of the bench itself; its figures say
        /// nothing of a GPU's).
        #[arg(long)]
        emulate: bool,
        /// The products' weights: float32, bfloat16 or both (one after the other).
        #[arg(long, default_value = "both", value_parser = ["float32", "bfloat16", "both"])]
        dtype: String,
        /// Sets a kernel tuning constant for this run (repeatable); None changes a value's bits.
        #[arg(long = "tune", value_name = "NAME=VALUE", long_help = tuning_help())]
        tune: Vec<String>,
    },
    /// The step table a simulated run prices steps with (executor "sim", executor_settings.table):
    /// decode steps over rows × context and prefill chunks over tokens × cached prefix, measured
    /// on the GPU with the cuda executor as a rank drives it, with the host's launch and the
    /// engine's own time a step, written as JSON.
    Calibrate {
        /// A checkpoint folder, a llama GGUF file or a TOML model spec.
        #[arg(long)]
        model: PathBuf,
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        /// The products' weights and the KV cache: float32 or bfloat16.
        #[arg(long, default_value = "bfloat16", value_parser = ["float32", "bfloat16"])]
        dtype: String,
        /// Tokens of the prefill chunks (increasing).
        #[arg(long, value_delimiter = ',', default_value = "16,64,256,1024,4096", value_parser = flags::count)]
        prefill: Vec<usize>,
        /// Positions cached before a prefill chunk (increasing, from 0).
        #[arg(long, value_delimiter = ',', default_value = "0,1024,4096,16384")]
        prefix: Vec<usize>,
        /// Prompts a prefill point without a prefix is also split among (increasing, from 1):
        /// what a step's prompt count costs apart from its tokens.
        #[arg(long, value_delimiter = ',', default_value = "1,4", value_parser = flags::count)]
        prompts: Vec<usize>,
        /// Decode rows of the decode points (increasing).
        #[arg(long, value_delimiter = ',', default_value = "1,4,16,64", value_parser = flags::count)]
        rows: Vec<usize>,
        /// Context per decode row (increasing).
        #[arg(long, value_delimiter = ',', default_value = "256,1024,4096", value_parser = flags::count)]
        context: Vec<usize>,
        /// Decode steps timed at each point.
        #[arg(long, default_value_t = 32, value_parser = flags::count)]
        steps: usize,
        /// Idle gaps (ms, increasing from 0) a prefill is timed after, for the device's wake-up:
        /// reach past the longest gap the runs it prices will have (past the last, its cost holds).
        #[arg(long, value_delimiter = ',', default_value = "0,2,10,50,200,700,1500")]
        idle_gaps: Vec<usize>,
        /// Where the table goes.
        #[arg(long, default_value = "calibration.json")]
        out: PathBuf,
        /// Run the kernels on the CPU instead (a check of the bench itself).
        #[arg(long)]
        emulate: bool,
    },
    /// Prefill/decode tokens/s and GFLOP/s of one executor thread against two GEMM baselines.
    Model {
        /// Checkpoint folder or TOML model spec (default: a seeded mha model, hidden 1024).
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, default_value_t = 64, value_parser = flags::count)]
        batch: usize,
        #[arg(long, default_value_t = 512, value_parser = flags::count)]
        context: usize,
        #[arg(long, default_value_t = 8, value_parser = flags::count)]
        decode_steps: usize,
    },
}

/// Runs the bench `what` names.
pub fn run(what: BenchCommand) -> Result<()> {
    match what {
        BenchCommand::Step { ranks, seqs, steps, expert_parallel: true } => bench::experts::run(ranks, seqs, steps),
        BenchCommand::Step { ranks, seqs, steps, expert_parallel: false } => {
            bench::step::run(&bench::step::StepBenchArgs { ranks, seqs, steps })
        }
        BenchCommand::Spec { model, requests, outputs, draft_tokens, rounds, executor, dtype, emulate, kv_budget } => {
            anyhow::ensure!(
                executor == "cuda" || (!emulate && dtype == "float32"),
                "--emulate and --dtype are settings of a cuda pool (--executor cuda)"
            );
            let executor = bench::spec::SpecExecutor { name: executor, dtype, emulate };
            bench::spec::run(&bench::spec::SpecBenchArgs {
                model,
                requests,
                outputs,
                draft_tokens,
                rounds,
                executor,
                kv_budget,
            })
        }
        BenchCommand::Serve { model, requests, concurrency, max_tokens } => {
            bench::serve::run(&bench::serve::ServeBenchArgs { model, requests, concurrency, max_tokens })
        }
        BenchCommand::Offload { store, url, clients, chunk_bytes, chunks, rounds, dir } => {
            if store == "redis" {
                use bench::offload_redis::{run, RedisBenchArgs};
                run(&RedisBenchArgs { chunk_bytes, chunks, rounds, url, clients })
            } else {
                bench::offload::run(&bench::offload::OffloadBenchArgs { chunk_bytes, chunks, rounds, dir })
            }
        }
        BenchCommand::Router { ranks, blocks, chain, decisions } => {
            bench::router::run(&bench::router::RouterBenchArgs { ranks, blocks, chain, decisions })
        }
        BenchCommand::Transfer { tokens, bytes, connections, rounds } => {
            let connections = connections as usize;
            bench::transfer::run(&bench::transfer::TransferBenchArgs { tokens, bytes, connections, rounds })
        }
        BenchCommand::Device { fixtures, gpu, emulate, blocks_out, bf16_gap, tune } => {
            set_tuning(&tune)?;
            bench::device::run(&bench::device::DeviceBenchArgs { fixtures, gpu, emulate, blocks_out, bf16_gap })
        }
        BenchCommand::Kernels { gpu, emulate, tune } => {
            set_tuning(&tune)?;
            bench::kernel_checks::run(gpu, emulate)
        }
        BenchCommand::Speed { model, gpu, batch, prompt, shapes, steps, baseline, emulate, dtype, tune } => {
            set_tuning(&tune)?;
            use kvflow_kernels::cuda::Dtype;
            let dtypes = match dtype.as_str() {
                "both" => vec![Dtype::Float32, Dtype::Bfloat16],
                one => Dtype::parse(one).into_iter().collect(),
            };
            let shapes = if shapes.is_empty() { vec![bench::speed::Shape { batch, prompt }] } else { shapes };
            bench::speed::run(&bench::speed::SpeedBenchArgs { model, gpu, shapes, steps, baseline, emulate, dtypes })
        }
        BenchCommand::Calibrate {
            model,
            gpu,
            dtype,
            prefill,
            prefix,
            prompts,
            rows,
            context,
            steps,
            idle_gaps,
            out,
            emulate,
        } => {
            let dtype = kvflow_kernels::cuda::Dtype::parse(&dtype).ok_or_else(|| anyhow::anyhow!("--dtype {dtype}"))?;
            bench::calibrate::run(&bench::calibrate::CalibrateArgs {
                model,
                gpu,
                dtype,
                prefill,
                prefix,
                prompts,
                rows,
                context,
                steps,
                idle_gaps_ms: idle_gaps,
                out,
                emulate,
            })
        }
        BenchCommand::Model { model, batch, context, decode_steps } => {
            bench::model::run(&bench::model::ModelBenchArgs { model, batch, context, decode_steps })
        }
    }
}

fn parse_bytes(text: &str) -> Result<u64, String> {
    kvflow::graph::parse_byte_size(text)
}

/// `--tune`'s long help: every tuning constant with its range and what it sets
/// (kernels/src/cuda/sources.rs TUNABLES).
fn tuning_help() -> String {
    let mut help = String::from(
        "Sets a kernel tuning constant for this run (repeatable). None changes a value's bits \
         (`bench kernels --tune` checks it). The constants (kernels/src/cuda/sources.rs TUNABLES):",
    );
    for t in kvflow_kernels::cuda::sources::TUNABLES {
        help.push_str(&format!("\n  {} ({}-{}): {}", t.name, t.lo, t.hi, t.what));
    }
    help
}

/// The kernels' tuning constants of `--tune`, printed when any is set.
fn set_tuning(tune: &[String]) -> anyhow::Result<()> {
    if tune.is_empty() {
        return Ok(());
    }
    kvflow_kernels::cuda::sources::set_tuning(tune).map_err(anyhow::Error::msg)?;
    println!("tuning       {}", tune.join(" "));
    Ok(())
}
