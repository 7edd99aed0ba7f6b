//! The `kvflow` command line.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use kvflow::bench::model::{self as bench_model, ModelBenchArgs};
use kvflow::flags;
use kvflow::generate::{generate, read_prompts, write_jsonl, GenerateOptions};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

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
    Generate {
        /// Hugging Face checkpoint folder, a llama GGUF file (`.gguf`), or a TOML model spec (seeded random weights).
        #[arg(long)]
        model: PathBuf,
        /// JSONL, one {"prompt": [token ids]} per line.
        #[arg(long)]
        prompts: PathBuf,
        /// Greedy tokens per prompt (end-of-sequence does not stop generation; prompt plus
        /// output must fit the model's context).
        #[arg(long, value_parser = flags::count_or_zero)]
        max_new_tokens: usize,
        /// Prefill chunk size in tokens.
        #[arg(long, default_value_t = 64, value_parser = flags::count)]
        chunk_tokens: usize,
        /// Also print the first K decode logits vectors (the logits that chose tokens[1..=K]).
        #[arg(long, default_value_t = 0, value_parser = flags::count_or_zero)]
        decode_logits: usize,
        /// Paged KV block size in tokens.
        #[arg(long, default_value_t = 16, value_parser = flags::count)]
        block_size: usize,
        /// Write the JSONL here instead of standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
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

#[derive(clap::Args)]
#[command(allow_negative_numbers = true)] // so `--stall-timeout -1` reaches the flag's own check
struct RunArgs {
    /// The graph file (TOML).
    graph: PathBuf,
    #[command(flatten)]
    flags: RunFlags,
}

/// What `run` and `compare` take beside the graphs.
#[derive(clap::Args, Clone)]
struct RunFlags {
    /// Checkpoint folder or model spec (overrides model.path).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    trace: Option<PathBuf>,
    /// mooncake | azure | vidur
    #[arg(long)]
    format: Option<String>,
    /// Measured requests (after the warmup ones).
    #[arg(long, value_parser = flags::count)]
    limit: Option<usize>,
    #[arg(long, value_parser = flags::count_or_zero)]
    warmup: Option<usize>,
    /// Tokens per 512-token trace block.
    #[arg(long, value_parser = flags::count)]
    block_tokens: Option<usize>,
    #[arg(long, value_parser = flags::count)]
    max_output_tokens: Option<usize>,
    /// Closed loop with this many requests in flight (switches the workload to concurrency mode).
    #[arg(long, value_parser = flags::count)]
    concurrency: Option<usize>,
    /// Ranks of every pool.
    #[arg(long, value_parser = flags::count)]
    ranks: Option<usize>,
    /// Output folder.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Re-run every request alone on the reference path and compare tokens and logits bits.
    #[arg(long)]
    verify: bool,
    /// Also draw the run's charts (TTFT and TPOT CDFs, throughput and KV use over time) as PNGs
    /// beside its report (compare: every run on each chart, into --out or out/compare).
    #[arg(long)]
    plot: bool,
    /// Run only this pool of the graph (default: every pool).
    #[arg(long)]
    pool: Option<String>,
    /// Run only these pools of a P/D graph (comma-separated); the others run in other processes,
    /// joined to these over their tcp links. The process running the prefill pools replays the
    /// workload and writes the report; one running only decode pools serves their handoffs.
    #[arg(long, value_delimiter = ',', conflicts_with = "pool")]
    pools: Option<Vec<String>>,
    /// `POOL=HOST:PORT`: where decode pool POOL listens — bound there when it runs in this process,
    /// reached there when it runs in another (whose process prints the address). Repeatable.
    #[arg(long = "endpoint", value_parser = parse_endpoint_flag)]
    endpoints: Vec<(String, String)>,
    /// After SIGINT (Ctrl-C) or SIGTERM, seconds in-flight requests may finish before they are
    /// cancelled (0: cancel them at once).
    #[arg(long, default_value = "10", value_parser = flags::seconds)]
    grace_period: Duration,
    /// Seconds without any progress, with requests pending, before the run is declared stalled
    /// (it prints which operator on which rank holds which step, and exits with status 3);
    /// 0 turns the stall watchdog off.
    #[arg(long, default_value = "60", value_parser = flags::seconds)]
    stall_timeout: Duration,
    /// The longest gap the workload may leave before its next request (after time_scale); a
    /// longer one fails the run before it starts, naming the request. Waits over 10 s are
    /// printed as they happen.
    #[arg(long, default_value = "600", value_parser = flags::seconds)]
    max_wait: Duration,
    /// Test only: `OPERATOR:RANK:STEP` makes that operator keep a capability for that step.
    #[arg(long, hide = true)]
    test_hold_capability: Option<String>,
    /// Test only: `align` does not wait for every rank's report (removes collective alignment).
    #[arg(long, hide = true)]
    test_align_without_waiting: bool,
    /// Test only: `RANK:STEP` makes that rank's forward sleep inside that step.
    #[arg(long, hide = true)]
    test_stuck_in_forward: Option<String>,
    /// Test only: `RANK:STEP:MOE` makes that rank's dispatch at that MoE layer send nothing at
    /// that step and keep its capability.
    #[arg(long, hide = true)]
    test_withhold_dispatch: Option<String>,
    /// Test only: `RANK:STEP:MOE` makes that rank's experts at that MoE layer send no results at
    /// that step and let it pass.
    #[arg(long, hide = true)]
    test_send_no_expert_results: Option<String>,
    /// Test only: offload saves give their blocks back before the save has read them.
    #[arg(long, hide = true)]
    test_release_saves_early: bool,
    /// Test only: the save thread waits this many ms before reading a save's blocks.
    #[arg(long, hide = true, default_value_t = 0)]
    test_slow_saves_ms: u64,
    /// Test only: the load thread waits this many ms before each load.
    #[arg(long, hide = true, default_value_t = 0)]
    test_slow_loads_ms: u64,
    /// Test only: prefixes loaded from the offload store are not published in the prefix cache.
    #[arg(long, hide = true)]
    test_skip_publishing_restored: bool,
    /// Test only: a verification that rejects drafts keeps the recurrent state after every draft.
    #[arg(long, hide = true)]
    test_keep_rejected_state: bool,
    /// Test only: the drafter gets a chunk's sampled token only when the chunk verifies drafts.
    #[arg(long, hide = true)]
    test_drafter_successors_only_when_verifying: bool,
    /// Test only: ranks leave every Nth cache event out of their reports (router kv-aware).
    #[arg(long, hide = true)]
    test_drop_cache_event_every: Option<u64>,
    /// Test only: draft-width bucketing rounds up past the width the scheduler fixed.
    #[arg(long, hide = true)]
    test_widen_draft_buckets: bool,
    /// Test only: a rank whose step samples nothing skips the step's draft passes.
    #[arg(long, hide = true)]
    test_skip_draft_passes_without_samples: bool,
    /// This process's index in a pool spread over several processes: of the pool's `hosts` in
    /// the graph, or with --processes and --hostfile.
    #[arg(long)]
    process: Option<usize>,
    #[arg(long, value_parser = flags::count, requires_all = ["process", "hostfile"])]
    processes: Option<usize>,
    /// One host:port per line, one line per process.
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// Test only: requests whose id is a multiple of N read KV through a block table with two
    /// entries swapped (shows that --verify catches it).
    #[arg(long, hide = true)]
    test_swap_block_table_every: Option<u64>,
    /// Test only: `ID:STAGE,…` cancels request ID once its rank sees it queued, prefilling,
    /// in transfer (a prefill pool's, awaiting the ack) or decoding.
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
    /// Test only: prefill pools hand off without the state slot (the consumer must refuse it).
    #[arg(long, hide = true)]
    test_handoff_without_state: bool,
    /// Test only: prefill pools export the state after feeding T0 (T0 is then applied twice).
    #[arg(long, hide = true)]
    test_export_state_after_t0: bool,
    /// Test only: a decode pool's inbox delivers every copy of a handoff (no exactly-once take).
    #[arg(long, hide = true)]
    test_deliver_duplicate_handoffs: bool,
    /// Test only: prefill pools free a handed-off request's memory when they send the handoff,
    /// not when the consumer's ack comes.
    #[arg(long, hide = true)]
    test_free_before_ack: bool,
    /// Test only: prefill pools hand off the state slot a request was first admitted with, not
    /// the one it holds at T0.
    #[arg(long, hide = true)]
    test_export_admission_slot: bool,
}

#[derive(Subcommand)]
enum BenchCommand {
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
        model: std::path::PathBuf,
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
    /// memcpy and plain file writes and reads of the same bytes.
    Offload {
        /// Bytes of KV per chunk.
        #[arg(long, default_value = "4 MiB", value_parser = parse_bytes)]
        chunk_bytes: u64,
        /// Chunks per round.
        #[arg(long, default_value_t = 64, value_parser = flags::count)]
        chunks: usize,
        /// Rounds; each figure is their median.
        #[arg(long, default_value_t = 5, value_parser = flags::count)]
        rounds: usize,
        /// Folder for the disk store (default: a temporary folder).
        #[arg(long)]
        dir: Option<std::path::PathBuf>,
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
    },
    /// The cuda executor's prefill and decode tokens/s on one GPU beside transformers' (measured
    /// in the same device run by benches/device/speed.sh) and beside the step's lower bound
    /// from the copy and matrix rates, then the decode step's device time kernel by kernel.
    Speed {
        /// A checkpoint folder, a llama GGUF file or a TOML model spec.
        #[arg(long)]
        model: PathBuf,
        #[arg(long, default_value_t = 0)]
        gpu: usize,
        #[arg(long, default_value_t = 64, value_parser = flags::count)]
        batch: usize,
        /// Prompt tokens per request.
        #[arg(long, default_value_t = 256, value_parser = flags::count)]
        prompt: usize,
        /// Decode steps per timed round (three rounds; each figure is their median).
        #[arg(long, default_value_t = 16, value_parser = flags::count)]
        steps: usize,
        /// transformers' figures (JSON written by benches/device/transformers_speed.py).
        #[arg(long)]
        baseline: Option<PathBuf>,
        /// Run the kernels on the CPU instead (a check of the bench itself; its figures say
        /// nothing of a GPU's).
        #[arg(long)]
        emulate: bool,
        /// The products' weights: float32, bfloat16 or both (one after the other).
        #[arg(long, default_value = "both", value_parser = ["float32", "bfloat16", "both"])]
        dtype: String,
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

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal()) // no colour codes in a log file
        .init();
    if let Err(e) = run() {
        eprintln!("error: {}", error_chain(&e));
        std::process::exit(1);
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

fn parse_bytes(text: &str) -> Result<u64, String> {
    kvflow::graph::parse_byte_size(text)
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

/// A test switch's `RANK:STEP:MOE`.
fn rank_step_moe(text: Option<&str>) -> Result<Option<(usize, u64, usize)>> {
    let Some(text) = text else { return Ok(None) };
    let parts: Vec<&str> = text.split(':').collect();
    let [rank, step, moe] = parts[..] else { anyhow::bail!("expected RANK:STEP:MOE, got {text:?}") };
    Ok(Some((rank.parse()?, step.parse()?, moe.parse()?)))
}

fn parse_cancel_at_stage(text: Option<&str>) -> Result<Vec<(u64, String)>> {
    let Some(text) = text else { return Ok(Vec::new()) };
    text.split(',')
        .map(|item| {
            let (id, stage) = item.split_once(':').ok_or_else(|| anyhow::anyhow!("expected ID:STAGE, got {item:?}"))?;
            if !["queued", "prefilling", "in-transfer", "decoding"].contains(&stage) {
                anyhow::bail!("stage {stage:?} is not queued, prefilling, in-transfer or decoding");
            }
            Ok((id.parse()?, stage.replace('-', " ")))
        })
        .collect()
}

fn run_graph(
    graph_path: &std::path::Path,
    args: RunFlags,
    interrupts: &kvflow::signals::Interrupts,
) -> Result<(i32, Option<serde_json::Value>, PathBuf)> {
    use kvflow::graph::{Graph, Overrides};
    use kvflow::runtime::{self, ClusterPlace, RunOptions};
    let registry = kvflow::registry::Registry::default();
    let graph = Graph::load_overridden(
        graph_path,
        &registry.names(),
        &Overrides {
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
        },
    )?;
    let cluster = match (args.process, args.processes, args.hostfile) {
        (Some(process), Some(processes), Some(hostfile)) => {
            let mut place = ClusterPlace::from_hostfile(&hostfile, process, processes)?;
            place.connect_timeout = args.stall_timeout; // a peer that never connects is a stall too
            Some(place)
        }
        (Some(process), None, None) => {
            let mut place = ClusterPlace::from_graph(&graph, args.pools.as_deref(), args.pool.as_deref(), process)?;
            place.connect_timeout = args.stall_timeout;
            Some(place)
        }
        (None, None, None) => None,
        _ => anyhow::bail!("--processes and --hostfile go together, with --process"),
    };
    let opts = RunOptions {
        interrupt: Some(interrupts.flag.clone()),
        grace: Some(args.grace_period),
        stall_timeout: Some(args.stall_timeout),
        max_wait: Some(args.max_wait),
        serve: None,
        pool: args.pool,
        pools: args.pools,
        endpoints: args.endpoints.into_iter().collect(),
        cluster,
        verify: args.verify,
        show_progress: true,
        switches: kvflow_operators::rank::TestSwitches {
            drop_cache_event_every: args.test_drop_cache_event_every,
            swap_block_table_every: args.test_swap_block_table_every,
            leak_blocks_of: args.test_leak_blocks_of,
            accept_stale_completions: args.test_accept_stale_completions,
            handoff_without_state: args.test_handoff_without_state,
            export_state_after_t0: args.test_export_state_after_t0,
            deliver_duplicate_handoffs: args.test_deliver_duplicate_handoffs,
            free_before_ack: args.test_free_before_ack,
            export_admission_slot: args.test_export_admission_slot,
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
            withhold_dispatch: rank_step_moe(args.test_withhold_dispatch.as_deref())?,
            send_no_expert_results: rank_step_moe(args.test_send_no_expert_results.as_deref())?,
            release_saves_early: args.test_release_saves_early,
            slow_saves_ms: args.test_slow_saves_ms,
            slow_loads_ms: args.test_slow_loads_ms,
            skip_publishing_restored: args.test_skip_publishing_restored,
            keep_rejected_state: args.test_keep_rejected_state,
            drafter_successors_only_when_verifying: args.test_drafter_successors_only_when_verifying,
            widen_draft_buckets: args.test_widen_draft_buckets,
            skip_draft_passes_without_samples: args.test_skip_draft_passes_without_samples,
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
    // An interrupted run did not serve its workload: 130 (SIGINT) or 143 (SIGTERM).
    Ok((interrupts.exit_status().unwrap_or(outcome.exit_code), outcome.report, outcome.out_dir))
}

/// Draws the charts of the runs reported in `dirs` into `out` and names the files.
fn plot_runs(dirs: &[PathBuf], out: &std::path::Path) -> Result<()> {
    let runs = dirs.iter().map(|d| kvflow::plot::read_run(d)).collect::<Result<Vec<_>>>()?;
    for file in kvflow::plot::plot(&runs, out)? {
        eprintln!("wrote {}", file.display());
    }
    Ok(())
}

/// `kvflow compare`: each graph in turn, then the figures side by side.
fn compare(graphs: &[PathBuf], flags: &RunFlags, interrupts: &kvflow::signals::Interrupts) -> Result<i32> {
    let mut columns = Vec::new();
    let mut out_dirs = Vec::new();
    let mut worst = 0;
    for (i, path) in graphs.iter().enumerate() {
        let mut name = path.file_stem().map_or("graph".into(), |s| s.to_string_lossy().into_owned());
        if columns.iter().any(|(n, _): &(String, serde_json::Value)| *n == name) {
            name = format!("{name}-{}", i + 1); // two graphs of one name get their own reports
        }
        let mut flags = flags.clone();
        flags.out = flags.out.as_ref().map(|dir| dir.join(&name));
        eprintln!("== {}", path.display());
        let (code, report, out_dir) = run_graph(path, flags, interrupts)?;
        out_dirs.push(out_dir);
        worst = worst.max(code);
        columns.push((name, report.unwrap_or_default()));
        if interrupts.exit_status().is_some() {
            break;
        }
    }
    let figure =
        |r: &serde_json::Value, path: &[&str]| -> String {
            let mut v = r;
            for k in path {
                v = &v[*k];
            }
            match v {
                serde_json::Value::Number(n) => n.as_f64().map_or(n.to_string(), |f| {
                    if f.fract() == 0.0 {
                        format!("{f:.0}")
                    } else {
                        format!("{f:.2}")
                    }
                }),
                serde_json::Value::Null => "-".into(),
                other => other.to_string(),
            }
        };
    let rows: &[(&str, &[&str])] = &[
        ("requests", &["requests"]),
        ("completed", &["completed"]),
        ("failed", &["failed"]),
        ("TTFT p50 ms", &["ttft_ms", "p50"]),
        ("TTFT p99 ms", &["ttft_ms", "p99"]),
        ("TPOT p50 ms", &["tpot_ms", "p50"]),
        ("TPOT p99 ms", &["tpot_ms", "p99"]),
        ("queue p50 ms", &["queue_ms", "p50"]),
        ("e2e p50 ms", &["e2e_ms", "p50"]),
        ("output tokens/s", &["output_tokens_per_s"]),
        ("goodput req/s", &["goodput_rps"]),
        ("prefix hit rate", &["prefix_hit_rate"]),
        ("handoffs", &["handoff", "count"]),
        ("handoff bytes", &["handoff", "bytes"]),
        ("verify mismatched", &["verify", "mismatched"]),
    ];
    let width = columns.iter().map(|(n, _)| n.len()).max().unwrap_or(8).max(10);
    let mut header = format!("{:<18}", "");
    for (name, _) in &columns {
        header.push_str(&format!(" {name:>width$}"));
    }
    println!("{header}");
    for (label, path) in rows {
        let mut line = format!("{label:<18}");
        for (_, report) in &columns {
            line.push_str(&format!(" {:>width$}", figure(report, path)));
        }
        println!("{line}");
    }
    if flags.plot {
        let out = flags.out.clone().unwrap_or_else(|| PathBuf::from("out/compare"));
        plot_runs(&out_dirs, &out)?;
    }
    Ok(worst)
}

fn run() -> Result<()> {
    kvflow_kernels::cpu::simd::check_cpu_supports_build().map_err(anyhow::Error::msg)?;
    match Cli::parse().command {
        Command::SeedCheckpoint { spec, out } => {
            let names = kvflow_kernels::models::write_seeded_checkpoint(&spec, &out)
                .with_context(|| format!("cannot write the seeded checkpoint of {}", spec.display()))?;
            println!("{}: {} tensors written", out.display(), names.len());
        }
        Command::Generate { model, prompts, max_new_tokens, chunk_tokens, decode_logits, block_size, out } => {
            // The output file first: an unwritable --out is found before any work.
            let mut sink: Box<dyn std::io::Write> = match &out {
                Some(path) => Box::new(std::io::BufWriter::new(
                    std::fs::File::create(path).with_context(|| format!("--out: cannot create {}", path.display()))?,
                )),
                None => Box::new(std::io::stdout().lock()),
            };
            let model = kvflow_kernels::models::load(&model)
                .with_context(|| format!("cannot load model {}", model.display()))?;
            let prompts = read_prompts(&prompts, &model)?;
            let opts = GenerateOptions {
                max_new_tokens,
                chunk_tokens,
                decode_logits,
                block_size,
                show_progress: true,
                ..Default::default()
            };
            let results = generate(&model, &prompts, &opts)?;
            write_jsonl(&mut sink, &results)?;
            let refused: Vec<&str> = results.iter().filter_map(|r| r.error.as_deref()).collect();
            if !refused.is_empty() {
                for why in &refused {
                    eprintln!("error: {why}");
                }
                eprintln!(
                    "{} of {} prompts have no output (their lines carry \"error\")",
                    refused.len(),
                    results.len()
                );
                std::process::exit(2);
            }
        }
        Command::Run(args) => {
            // Before any other thread starts: every thread inherits the blocked signals.
            let interrupts = kvflow::signals::watch().context("cannot set up SIGINT/SIGTERM handling")?;
            let RunArgs { graph, flags } = *args;
            let plot = flags.plot;
            let (code, _, out_dir) = run_graph(&graph, flags, &interrupts)?;
            if plot {
                plot_runs(std::slice::from_ref(&out_dir), &out_dir)?;
            }
            if code != 0 {
                std::process::exit(code);
            }
        }
        Command::Serve(args) => {
            let interrupts = kvflow::signals::watch().context("cannot set up SIGINT/SIGTERM handling")?;
            let code = kvflow::server::command::serve(*args, &interrupts)?;
            if code != 0 {
                std::process::exit(code);
            }
        }
        Command::Plot { reports, out } => {
            let out =
                out.unwrap_or_else(|| if reports.len() == 1 { reports[0].clone() } else { PathBuf::from("out/plots") });
            plot_runs(&reports, &out)?;
        }
        Command::Compare { graphs, flags } => {
            let interrupts = kvflow::signals::watch().context("cannot set up SIGINT/SIGTERM handling")?;
            let code = compare(&graphs, &flags, &interrupts)?;
            if code != 0 {
                std::process::exit(code);
            }
        }
        Command::Launch { graph, run_flags } => {
            let registry = kvflow::registry::Registry::default();
            let loaded = kvflow::graph::Graph::load_with(&graph, &registry.names())?;
            let code = kvflow::launch::launch(&loaded, &graph, &run_flags)?;
            if code != 0 {
                std::process::exit(code);
            }
        }
        Command::Check { graph, dot } => {
            let registry = kvflow::registry::Registry::default();
            let graph = kvflow::graph::Graph::load_with(&graph, &registry.names())?;
            kvflow::runtime::pick_pools(&graph, None)?; // what `run` would refuse, `check` refuses
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
        Command::Bench { what: BenchCommand::Step { ranks, seqs, steps, expert_parallel: true } } => {
            kvflow::bench::experts::run(ranks, seqs, steps)?;
        }
        Command::Bench { what: BenchCommand::Step { ranks, seqs, steps, expert_parallel: false } } => {
            kvflow::bench::step::run(&kvflow::bench::step::StepBenchArgs { ranks, seqs, steps })?;
        }
        Command::Bench { what: BenchCommand::Spec { model, requests, outputs, draft_tokens, rounds } } => {
            kvflow::bench::spec::run(&kvflow::bench::spec::SpecBenchArgs {
                model,
                requests,
                outputs,
                draft_tokens,
                rounds,
            })?;
        }
        Command::Bench { what: BenchCommand::Serve { model, requests, concurrency, max_tokens } } => {
            kvflow::bench::serve::run(&kvflow::bench::serve::ServeBenchArgs {
                model,
                requests,
                concurrency,
                max_tokens,
            })?;
        }
        Command::Bench { what: BenchCommand::Offload { chunk_bytes, chunks, rounds, dir } } => {
            let chunk_bytes = usize::try_from(chunk_bytes).context("--chunk-bytes is too large")?;
            kvflow::bench::offload::run(&kvflow::bench::offload::OffloadBenchArgs {
                chunk_bytes,
                chunks,
                rounds,
                dir,
            })?;
        }
        Command::Bench { what: BenchCommand::Router { ranks, blocks, chain, decisions } } => {
            kvflow::bench::router::run(&kvflow::bench::router::RouterBenchArgs { ranks, blocks, chain, decisions })?;
        }
        Command::Bench { what: BenchCommand::Transfer { tokens, bytes, connections, rounds } } => {
            let connections = connections as usize;
            kvflow::bench::transfer::run(&kvflow::bench::transfer::TransferBenchArgs {
                tokens,
                bytes,
                connections,
                rounds,
            })?;
        }
        Command::Bench { what: BenchCommand::Device { fixtures, gpu, emulate, blocks_out, bf16_gap } } => {
            kvflow::bench::device::run(&kvflow::bench::device::DeviceBenchArgs {
                fixtures,
                gpu,
                emulate,
                blocks_out,
                bf16_gap,
            })?;
        }
        Command::Bench { what: BenchCommand::Speed { model, gpu, batch, prompt, steps, baseline, emulate, dtype } } => {
            use kvflow_kernels::cuda::Dtype;
            let dtypes = match dtype.as_str() {
                "both" => vec![Dtype::Float32, Dtype::Bfloat16],
                one => Dtype::parse(one).into_iter().collect(),
            };
            kvflow::bench::speed::run(&kvflow::bench::speed::SpeedBenchArgs {
                model,
                gpu,
                batch,
                prompt,
                steps,
                baseline,
                emulate,
                dtypes,
            })?;
        }
        Command::Bench { what: BenchCommand::Model { model, batch, context, decode_steps } } => {
            bench_model::run(&ModelBenchArgs { model, batch, context, decode_steps })?;
        }
    }
    Ok(())
}
