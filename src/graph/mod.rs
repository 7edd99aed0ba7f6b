//! Graph files: the TOML a user writes to describe what kvflow serves and how (DESIGN §3).
//!
//! A graph file names the model, sizes memory and the scheduler, lists the pools (role, ranks,
//! executor, router) and the links between them (which prefill pools hand off to which decode
//! pools, over which transfer backend), and says which trace to replay, with which SLO and where to
//! write the report.
//! It never wires operators: the runtime builds the per-pool operator graph of DESIGN §4 from it,
//! and `kvflow check --dot` prints the graph it builds so users see the dataflow they run.
//!
//! Loading happens in three layers, each used once:
//! 1. *raw*: serde structs mirroring the file (`#[serde(deny_unknown_fields)]`, every value kept
//!    with its byte span), so an unknown key or a wrong type is a TOML error with a position;
//! 2. *validation*: every value is checked once, defaults are filled in and relative paths are
//!    resolved; each error names the file, the line of the key and the dotted key
//!    (`graphs/x.toml:14: key `scheduler.chunk_tokens`: 4096 is larger than
//!    scheduler.max_batched_tokens (512)`);
//! 3. *use*: [`Graph`] and its parts are plain immutable values. Command-line flags
//!    ([`Overrides`]) are written into the raw layer before validation
//!    ([`Graph::load_overridden`]), so they go through the same checks and stand in for a value
//!    the file lacks or gets wrong.
//!
//! Relative paths in the file (`model.path`, `workload.trace`, `report.out`) resolve against the
//! folder holding the graph file; paths given as overrides are used as given (relative to the
//! working directory). Operators with a choice (executor, router) are chosen by name from the
//! registries [`ComponentNames`].
//!
//! A graph is *aggregated* (every pool prefills and decodes its own requests) or *disaggregated*
//! (prefill pools hand finished prefills off to decode pools over `[[link]]`s; no aggregated pool):
//! a graph with a prefill pool needs a decode pool and the other way round, every prefill pool
//! needs a link out and every decode pool a link in, and aggregated pools cannot be linked. A
//! decode pool without a link in would never see a remote prefill, so it is an error, not an
//! aggregated pool in disguise. New requests enter [`Graph::entry_pools`]: the decode pools of a
//! disaggregated graph (each decides per request whether to prefill remotely), else every pool.
//!
//! A complete aggregated graph file, every key shown (only `[model]` and one `[[pool]]` with a
//! `name` are required; the comments give the defaults):
//!
//! ```toml
//! [model]
//! path = "../fixtures/hf/kimi_linear"   # checkpoint folder, a llama GGUF file, or a TOML model spec (seeded random weights)
//!
//! [memory]
//! budget_bytes = 67108864          # per rank; or with a unit: "64 MiB", "2 GiB", "500 MB" (default "256 MiB")
//! block_size = 16                  # tokens per paged-KV block (default 16)
//! snapshot_fraction = 0.25         # budget share for prefix-state snapshots, 0..0.9 (recurrent only; default 0.25)
//! snapshot_interval_blocks = 4     # snapshot every N blocks (default 4)
//!
//! [scheduler]
//! max_running = 32                 # running sequences per rank (default 64)
//! max_batched_tokens = 256         # tokens per rank per step (default 512)
//! chunk_tokens = 64                # prefill chunk size, at most max_batched_tokens (default 64)
//! prefix_cache = true              # default true
//!
//! [[pool]]
//! name = "main"                    # required; letters, digits, '-' and '_'
//! role = "aggregated"              # aggregated | prefill | decode (default aggregated)
//! ranks = 2                        # default 1
//! executor = "cpu"                 # cpu | cpu-deferred | null, or one registered by a program (default "cpu")
//! router = "least-outstanding"     # a name from the router registry (default "least-outstanding")
//! expert_parallel = false          # MoE experts split over the ranks, dispatch/combine per MoE layer (cpu executor; default false)
//! hosts = ["10.0.0.1:7100", "10.0.0.2:7100"]  # one host:port per process of the pool, in process order: a pool
//!                                  # spread over processes (timely cluster mode); ranks divide evenly over
//!                                  # them; `kvflow run --pools main --process I` runs the I-th (default: one)
//! admission = "optimistic"         # optimistic: admit, preempt by recompute when memory runs out;
//!                                  # reserve: admit only what the rank can hold to its end (default optimistic)
//!
//! [[pool]]                         # a second pool of the same run: its own timely computation
//! name = "second"
//! executor = "cpu-deferred"        # the CPU math on a thread of its own, completing steps later
//! [pool.executor_settings]         # optional; the keys are the executor's own
//! delay_steps = 1                  # cpu-deferred, null: a step completes after this many more launches (default 1; null 0)
//! jitter_steps = 0                 # plus up to this many more, seeded (default 0)
//! seed = 0                         # seeds the jitter (default 0)
//! [pool.memory]                    # optional: any [memory] key, for this pool only
//! budget_bytes = "32 MiB"
//! [pool.scheduler]                 # optional: any [scheduler] key, for this pool only
//! max_running = 8
//!
//! [workload]
//! trace = "../traces/mooncake_conversation_head.jsonl"   # default: none
//! format = "mooncake"              # mooncake | azure | vidur (default mooncake)
//! mode = "timestamps"              # timestamps | concurrency | rate (default timestamps)
//! time_scale = 0.01                # timestamps mode only: wall seconds per trace second (default 1.0)
//! # concurrency = 8                # concurrency mode only: requests kept in flight (required there)
//! # rate = 4.0                     # rate mode only: requests per second, seeded Poisson (required there)
//! warmup = 2                       # the first N requests are warmup (default 0)
//! limit = 40                       # then N are measured (default: the rest of the trace)
//! block_tokens = 16                # 512-token trace blocks scale to N tokens (default 512)
//! max_output_tokens = 32           # cap on output length (default: none)
//! seed = 1                         # token synthesis and arrivals (default 0)
//! ignore_eos = true                # outputs follow the trace (default true)
//! pool_choice = "seeded"           # with several pools: seeded | round-robin (default seeded)
//!
//! [speculative]                    # optional: speculative decoding (default: none)
//! drafter = "ngram"                # ngram: prompt lookup (what followed the last earlier match of the
//!                                  # suffix); mtp: the checkpoint's MTP layer (DeepSeek, cpu, no EP)
//! draft_tokens = 4                 # drafts a decode carries (1 to 16; fewer near the request's end)
//! ngram_min = 1                    # the shortest suffix matched (default 1)
//! ngram_max = 3                    # the longest suffix matched (default 3)
//!
//! [sampling]                       # how requests pick tokens (a trace line's "sampling" overrides it)
//! temperature = 0.0                # 0: greedy (default); above 0: seeded sampling
//! top_k = 0                        # keep the k most likely tokens (default 0: all)
//! top_p = 1.0                      # keep the smallest set reaching this probability (default 1.0)
//! seed = 0                         # draws are keyed on (seed, request id, position) (default 0)
//!
//! [offload]                        # optional: the KV offload tier, saves and loads (default: none)
//! store = "memory"                 # memory | disk
//! chunk_tokens = 256               # tokens per saved chunk, a multiple of memory.block_size (default 256)
//! capacity_bytes = "1 GiB"         # memory store: least recently used chunks go past this (default "1 GiB")
//! # path = "../out/kv-store"       # disk store: its folder, created if missing (required for disk)
//! max_retries = 3                  # a failed save is tried again this many times, then dropped (default 3)
//!
//! [slo]
//! ttft_ms = 2000.0                 # default: none
//! tpot_ms = 200.0                  # default: none
//!
//! [report]
//! out = "../out/quickstart"        # report.json, requests.jsonl (default: out/<graph file stem> from the working dir)
//! ```
//!
//! A disaggregated graph: the keys above, and these (the `[workload]`, `[slo]` and `[report]`
//! tables are left out here):
//!
//! ```toml
//! [model]
//! path = "../fixtures/hf/llama"
//!
//! [[pool]]
//! name = "prefill"
//! role = "prefill"                 # prefill pools need a [[link]] out
//! ranks = 2
//!
//! [[pool]]
//! name = "decode"
//! role = "decode"                  # decode pools need a [[link]] in
//! [pool.disaggregation]            # optional, decode pools only: when a request is prefilled remotely
//! remote_prefill_min_tokens = 32   # remote only if the prompt's uncached length on the decode rank is more (default 0)
//! max_prefill_queue = 16           # and fewer than this many wait for a prefill, at least 1 (default: no limit)
//!
//! [[link]]                         # a prefill pool handing off to a decode pool; each (from, to) once
//! from = "prefill"                 # required: a prefill pool
//! to = "decode"                    # required: a decode pool
//! backend = "tcp"                  # inproc | tcp (default inproc: both pools in one process)
//! endpoint = "127.0.0.1:0"         # tcp only: the consumer's listen address host:port, IPv6 as "[::1]:0";
//!                                  # port 0: the kernel picks (default "127.0.0.1:0")
//!
//! [transfer]                       # optional, only in a graph with links
//! deployment_token = "change-me"   # shared by a deployment's processes; 1 to 256 printable ASCII bytes (default: none)
//! checksum = true                  # checksum every transfer, verified before the ack (default true)
//! connections = 2                  # tcp connections per link, 1 to 16; a link's handoffs spread over them
//!                                  # by request, each carried whole by one (default 2)
//!
//! [faults]                         # optional: seeded faults on the transfer engine, for fault testing
//! seed = 7                         # (default 0)
//! drop_connection = 0.01           # chance a connection drops (default 0; every chance is finite, 0 to 1)
//! delay_ms = 5.0                   # a delayed message waits this long, ≥ 0 (default 0) ...
//! delay_probability = 0.1          # ... with this chance; set both or neither (default 0)
//! corrupt = 0.001                  # chance a transfer's bytes are corrupted (default 0)
//! duplicate_completion = 0.001     # chance a completion is delivered twice (default 0)
//! ```
//!
//! Not checked here: whether the memory budget holds one request. That needs the model's bytes per
//! token, which the runtime knows once the model is loaded.

mod error;
mod overrides;
mod raw;
mod rules;
#[cfg(test)]
mod test_support;
mod validate;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use error::{GraphError, Location};
pub use overrides::Overrides;
pub use rules::{host_port, parse_byte_size, parse_endpoint, MAX_DEPLOYMENT_TOKEN_BYTES};

use error::toml_error;
use raw::RawGraph;
use validate::Validator;

/// The components a graph may choose from: those of the runtime's registry
/// (`kvflow::registry::Registry::names`), which programs embedding kvflow extend. Executors
/// also check their own `executor_settings`.
#[derive(Clone)]
pub struct ComponentNames {
    pub executors: Vec<String>,
    pub routers: Vec<String>,
    pub executor_kinds: kvflow_operators::executor::ExecutorRegistry,
}

impl ComponentNames {
    /// What kvflow registers itself (`Registry::default`).
    pub fn builtin() -> Self {
        crate::registry::Registry::default().names()
    }
}

/// Trace formats `workload.format` can name (DESIGN §11): those `crate::trace` reads.
pub fn known_trace_formats() -> Vec<&'static str> {
    crate::trace::TraceFormat::ALL.iter().map(|f| f.name()).collect()
}

// ---------------------------------------------------------------------------------------------
// The validated graph.

/// A validated graph file. Every value is checked, every default filled in, every path resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    /// The graph file, as it was named when loaded (error messages name it so).
    pub path: PathBuf,
    /// A checkpoint folder, a llama GGUF file or a TOML model spec file; it exists.
    pub model: PathBuf,
    pub memory: MemoryConfig,
    pub scheduler: SchedulerConfig,
    /// At least one; names are unique. Either every pool is aggregated, or there are prefill and
    /// decode pools (at least one of each) and no aggregated pool.
    pub pools: Vec<PoolConfig>,
    /// Which prefill pools hand off to which decode pools (`[[link]]`), in file order: each from a
    /// prefill pool to a decode pool of `pools`, no pair twice. Every prefill pool has a link out
    /// and every decode pool a link in; empty when the pools are aggregated.
    pub links: Vec<LinkConfig>,
    /// `[transfer]`: what every link's transfers carry.
    pub transfer: TransferConfig,
    /// `[faults]`: seeded fault injection, for fault testing; none by default.
    pub faults: FaultsConfig,
    /// `[offload]`: the KV offload tier's store; none by default.
    pub offload: Option<OffloadConfig>,
    /// `[sampling]`: how a request picks its tokens unless its trace line says otherwise
    /// (greedy by default).
    pub sampling: kvflow_kernels::cpu::sampling::RequestSampling,
    pub workload: WorkloadConfig,
    pub slo: SloConfig,
    /// Where the report (report.json, requests.jsonl) is written.
    pub report_dir: PathBuf,
    /// `[serve]`: what `kvflow serve` takes.
    pub serve: ServeConfig,
}

/// `[serve]`: how `kvflow serve` takes requests.
#[derive(Clone, Debug, PartialEq)]
pub struct ServeConfig {
    /// The name `/v1/models` lists and requests give as `model` (default: the model file's or
    /// folder's name).
    pub model_name: String,
    /// Requests in flight at once (accepted, not ended); one more is answered 429.
    pub max_requests: usize,
    /// Output tokens of a request that names no `max_tokens` (a completion's default is 16, as
    /// OpenAI's).
    pub max_tokens: usize,
    /// The longest request (prompt and outputs) served: rank memory is planned for it. Default:
    /// the model's context, at most 4096.
    pub max_context: Option<usize>,
}

/// `[serve] max_context` when the graph does not set it, if the model's context is longer.
pub const DEFAULT_SERVE_CONTEXT: usize = 4096;

/// Memory per rank (DESIGN §7).
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryConfig {
    /// Bytes per rank for paged KV, state slots and snapshots; more than 0.
    pub budget_bytes: u64,
    /// Tokens per paged-KV block; at least 1.
    pub block_size: usize,
    /// Share of the budget for prefix state snapshots, in [0, 0.9]. Only families with recurrent
    /// state use it.
    pub snapshot_fraction: f64,
}

/// Per-rank batching limits of `schedule(t)`: the policy's own config (`[scheduler]`, with
/// `memory.snapshot_interval_blocks`), checked here: every limit at least 1 and `chunk_tokens`
/// at most `max_batched_tokens`.
pub use kvflow_operators::policy::scheduler::{AdmissionPolicy, SchedulerConfig};

/// Which of a run's pools a new request enters (`workload.pool_choice`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolChoice {
    /// A seeded split (by `workload.seed`): each run of as many consecutive requests as there are
    /// pools is dealt out in a seeded order — equal shares, the same split every run.
    Seeded,
    /// Each request to the next pool in turn.
    RoundRobin,
}

/// What a pool does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolRole {
    /// Prefill and decode in the same pool.
    Aggregated,
    /// Prefill, then hand the request off to a decode pool.
    Prefill,
    /// Admit handoffs from a prefill pool and decode them.
    Decode,
}

impl PoolRole {
    /// The name used in graph files.
    pub fn as_str(self) -> &'static str {
        match self {
            PoolRole::Aggregated => "aggregated",
            PoolRole::Prefill => "prefill",
            PoolRole::Decode => "decode",
        }
    }

    fn from_name(name: &str) -> Option<PoolRole> {
        match name {
            "aggregated" => Some(PoolRole::Aggregated),
            "prefill" => Some(PoolRole::Prefill),
            "decode" => Some(PoolRole::Decode),
            _ => None,
        }
    }
}

impl fmt::Display for PoolRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One pool: ranks that step together in one timely computation (DESIGN §2).
#[derive(Clone, Debug, PartialEq)]
pub struct PoolConfig {
    /// Unique within the graph; letters, digits, '-' and '_'.
    pub name: String,
    pub role: PoolRole,
    /// Timely workers in the pool, one per GPU or CPU executor; at least 1.
    pub ranks: usize,
    /// One of the registry's executors ([`ComponentNames`]).
    pub executor: String,
    /// The executor's settings (`[pool.executor_settings]`), checked by the executor.
    pub executor_settings: toml::Table,
    /// One of the registry's routers ([`ComponentNames`]).
    pub router: String,
    /// The graph's `[memory]` with this pool's `[pool.memory]` over it.
    pub memory: MemoryConfig,
    /// The graph's `[scheduler]` with this pool's `[pool.scheduler]` over it.
    pub scheduler: SchedulerConfig,
    /// A decode pool's `[pool.disaggregation]`; the defaults for every other role (which may not
    /// set it).
    pub disaggregation: DisaggregationConfig,
    /// `expert_parallel = true`: the MoE experts are split over the pool's ranks, each MoE layer
    /// a dispatch and a combine between them (DESIGN §4; cpu executor, MoE models).
    pub expert_parallel: bool,
    /// `hosts`: the `host:port` of each of the pool's processes, in process order (timely's
    /// cluster addresses); empty: one process. `kvflow run --pools NAME --process I` runs the
    /// I-th; `kvflow launch` starts them all.
    pub hosts: Vec<String>,
}

/// Conditional disaggregation of a decode pool (DESIGN §8, `[pool.disaggregation]`): the rule
/// its ranks decide with, checked here (`max_prefill_queue` at least 1).
pub use kvflow_operators::rank::DisaggregationRule as DisaggregationConfig;

/// One `[[link]]`: a prefill pool handing finished prefills off to a decode pool (DESIGN §8).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkConfig {
    /// A prefill pool of the graph: the producer.
    pub from: String,
    /// A decode pool of the graph: the consumer.
    pub to: String,
    pub backend: TransferBackend,
    /// The consumer's listen address: `Some` for `tcp` (default `127.0.0.1:0`), `None` for
    /// `inproc`.
    pub endpoint: Option<Endpoint>,
}

/// How a link moves handoffs (DESIGN §8; `link.backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferBackend {
    /// Both pools in one process: no serialization and no socket, one copy into the consumer's
    /// own blocks.
    Inproc,
    /// A TCP connection to the consumer's endpoint, on loopback or across hosts.
    Tcp,
}

impl TransferBackend {
    /// Every backend, in the order errors list them.
    pub const ALL: [TransferBackend; 2] = [TransferBackend::Inproc, TransferBackend::Tcp];

    /// The name used in graph files.
    pub fn name(self) -> &'static str {
        match self {
            TransferBackend::Inproc => "inproc",
            TransferBackend::Tcp => "tcp",
        }
    }

    /// The backend a graph file's name stands for.
    pub fn from_name(name: &str) -> Option<TransferBackend> {
        TransferBackend::ALL.into_iter().find(|backend| backend.name() == name)
    }
}

impl Default for TransferBackend {
    fn default() -> Self {
        validate::DEFAULT_TRANSFER_BACKEND
    }
}

impl fmt::Display for TransferBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A listen address: a host name or IP address, and a port (0: the kernel picks one). Written
/// `host:port`, an IPv6 address in brackets (`[::1]:0`); [`parse_endpoint`] reads it, `Display`
/// writes it back the same way.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// A host name, an IPv4 address, or an IPv6 address without its brackets.
    pub host: String,
    pub port: u16,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl FromStr for Endpoint {
    type Err = String;

    /// [`parse_endpoint`].
    fn from_str(text: &str) -> Result<Endpoint, String> {
        parse_endpoint(text)
    }
}

/// The KV offload tier (`[offload]`, DESIGN §9): where full prompt chunks are saved, and loaded
/// back from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadConfig {
    pub store: OffloadStore,
    /// Tokens per chunk: a positive multiple of the block size (default 256).
    pub chunk_tokens: usize,
    /// A failed save is tried again this many times, then dropped (default 3).
    pub max_retries: usize,
}

/// Which store the offload tier uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OffloadStore {
    /// In this process's memory, least recently used evicted first past `capacity_bytes`.
    Memory { capacity_bytes: u64 },
    /// One file per object under `path` (relative to the graph file's folder); it outlives the run.
    Disk { path: PathBuf },
}

/// What every transfer carries (`[transfer]`; only in a graph with links).
#[derive(Clone, PartialEq, Eq)]
pub struct TransferConfig {
    /// Shared by the processes of one deployment: a peer that does not present it is refused.
    /// 1 to [`MAX_DEPLOYMENT_TOKEN_BYTES`] bytes of printable ASCII when set; `None` (the
    /// default): no token. `Debug` does not show it.
    pub deployment_token: Option<String>,
    /// Each transfer carries a checksum of its bytes, verified before the ack (default true).
    pub checksum: bool,
    /// The tcp connections each link opens (1 to [`MAX_LINK_CONNECTIONS`], default 2): a link's
    /// handoffs spread over them by request, each carried whole by one, so handoffs in flight
    /// together move in parallel (one connection's sender and receiver leave a core idle part
    /// of the time, measured by `kvflow bench transfer`).
    pub connections: usize,
}

/// The most tcp connections a link opens.
pub const MAX_LINK_CONNECTIONS: usize = 16;

impl Default for TransferConfig {
    fn default() -> Self {
        validate::DEFAULT_TRANSFER
    }
}

impl fmt::Debug for TransferConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferConfig")
            .field("deployment_token", &self.deployment_token.as_ref().map(|_| "<set, not shown>"))
            .field("checksum", &self.checksum)
            .field("connections", &self.connections)
            .finish()
    }
}

/// Seeded fault injection on the transfer engine (`[faults]`), for fault testing: every
/// probability is finite and in [0, 1], every default 0 (no faults).
#[derive(Clone, Debug, PartialEq)]
pub struct FaultsConfig {
    /// Seeds every fault draw, so a failing run can be replayed.
    pub seed: u64,
    /// Chance that a connection is dropped (its transfers fail; one retry on a new connection).
    pub drop_connection: f64,
    /// How long a delayed message is held, in milliseconds (≥ 0, finite).
    pub delay_ms: f64,
    /// Chance that a message is delayed by `delay_ms`.
    pub delay_probability: f64,
    /// Chance that a transfer's bytes are corrupted (the checksum must catch it).
    pub corrupt: f64,
    /// Chance that a completion is delivered twice (the second, stale, must be dropped).
    pub duplicate_completion: f64,
}

impl Default for FaultsConfig {
    fn default() -> Self {
        validate::DEFAULT_FAULTS
    }
}

impl FaultsConfig {
    /// Whether any fault can happen.
    pub fn any(&self) -> bool {
        let FaultsConfig { seed: _, drop_connection, delay_ms, delay_probability, corrupt, duplicate_completion } =
            *self;
        drop_connection > 0.0
            || (delay_ms > 0.0 && delay_probability > 0.0)
            || corrupt > 0.0
            || duplicate_completion > 0.0
    }
}

/// How trace requests are released into the graph.
#[derive(Clone, Debug, PartialEq)]
pub enum WorkloadMode {
    /// At the trace's timestamps, scaled: `time_scale` wall seconds per trace second (≥ 0; 0
    /// releases every request at once).
    Timestamps { time_scale: f64 },
    /// Keep this many requests in flight (≥ 1).
    Concurrency(usize),
    /// Seeded Poisson arrivals at this many requests per second (> 0).
    Rate { per_second: f64 },
}

impl WorkloadMode {
    /// The name used in graph files (`workload.mode`).
    pub fn name(&self) -> &'static str {
        match self {
            WorkloadMode::Timestamps { .. } => "timestamps",
            WorkloadMode::Concurrency(_) => "concurrency",
            WorkloadMode::Rate { .. } => "rate",
        }
    }
}

/// The trace to replay and how (DESIGN §11).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadConfig {
    /// The trace file; it exists. `None` when the graph names no trace.
    pub trace: Option<PathBuf>,
    /// One of [`known_trace_formats`].
    pub format: String,
    pub mode: WorkloadMode,
    /// The first `warmup` requests are run but not measured.
    pub warmup: usize,
    /// How many requests are measured after the warmup; `None`: the rest of the trace (≥ 1 if set).
    pub limit: Option<usize>,
    /// The trace's 512-token hash blocks scale to this many tokens; at least 1.
    pub block_tokens: usize,
    /// Cap on each request's output length; at least 1 if set.
    pub max_output_tokens: Option<usize>,
    /// Seeds token synthesis and arrivals.
    pub seed: u64,
    /// Generate the trace's output lengths whatever tokens are sampled.
    pub ignore_eos: bool,
    /// A seeded fraction of requests (0 to 1) is cancelled `cancel_after_ms` after its release,
    /// to exercise cancellation.
    pub cancel_fraction: f64,
    pub cancel_after_ms: f64,
    /// Which pool each request enters, when the run starts several of the
    /// [`Graph::entry_pools`].
    pub pool_choice: PoolChoice,
}

/// Latency objectives for goodput; each is > 0 when set.
#[derive(Clone, Debug, PartialEq)]
pub struct SloConfig {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

// ---------------------------------------------------------------------------------------------
// Loading, overrides, lookup.

impl Graph {
    /// Reads, parses and validates a graph file.
    pub fn load(path: &Path) -> Result<Graph, GraphError> {
        Graph::load_with(path, &ComponentNames::builtin())
    }

    /// [`Graph::load`], checking component choices against `names` (a registry's).
    pub fn load_with(path: &Path, names: &ComponentNames) -> Result<Graph, GraphError> {
        Graph::load_overridden(path, names, &Overrides::default())
    }

    /// [`Graph::load_with`] with command-line overrides written in before anything is checked:
    /// a flag stands in for a value the file lacks or gets wrong.
    pub fn load_overridden(path: &Path, names: &ComponentNames, overrides: &Overrides) -> Result<Graph, GraphError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| GraphError::Read { file: path.to_path_buf(), source })?;
        Graph::parse_overridden(path, &text, names, overrides)
    }

    /// Parses and validates `text` as the graph file `path` (which names the file in errors and
    /// anchors relative paths; it is not read).
    pub fn parse(path: &Path, text: &str) -> Result<Graph, GraphError> {
        Graph::parse_with(path, text, &ComponentNames::builtin())
    }

    /// [`Graph::parse`], checking component choices against `names`.
    pub fn parse_with(path: &Path, text: &str, names: &ComponentNames) -> Result<Graph, GraphError> {
        Graph::parse_overridden(path, text, names, &Overrides::default())
    }

    /// [`Graph::parse_with`] with `overrides` written into the file as read, then checked with it.
    pub fn parse_overridden(
        path: &Path,
        text: &str,
        names: &ComponentNames,
        overrides: &Overrides,
    ) -> Result<Graph, GraphError> {
        let mut raw: RawGraph = toml::from_str(text).map_err(|error| toml_error(path, text, &error))?;
        let command_line = overrides.write_into(&mut raw);
        Validator::new(path, text, names, command_line).graph(raw)
    }

    /// The pool named `name`; the error lists the graph's pools.
    pub fn pool(&self, name: &str) -> Result<&PoolConfig, GraphError> {
        self.pools.iter().find(|pool| pool.name == name).ok_or_else(|| GraphError::UnknownPool {
            file: self.path.clone(),
            name: name.to_string(),
            known: self.pools.iter().map(|pool| pool.name.clone()).collect(),
        })
    }

    /// Whether the graph has prefill and decode pools (then it has no aggregated pool).
    pub fn is_disaggregated(&self) -> bool {
        self.pools.iter().any(|pool| pool.role != PoolRole::Aggregated)
    }

    /// The links out of pool `pool` (a prefill pool's decode pools), in file order; empty for
    /// another role or an unknown name.
    pub fn links_from(&self, pool: &str) -> Vec<&LinkConfig> {
        self.links.iter().filter(|link| link.from == pool).collect()
    }

    /// The links into pool `pool` (a decode pool's prefill pools), in file order; empty for
    /// another role or an unknown name.
    pub fn links_to(&self, pool: &str) -> Vec<&LinkConfig> {
        self.links.iter().filter(|link| link.to == pool).collect()
    }

    /// The pools new requests enter, in file order: the decode pools when the graph is
    /// disaggregated (a new request is first routed to a decode rank, which prefills it locally or
    /// has a linked prefill pool do it: DESIGN §8), else every pool (all aggregated).
    pub fn entry_pools(&self) -> Vec<&PoolConfig> {
        let entry = if self.is_disaggregated() { PoolRole::Decode } else { PoolRole::Aggregated };
        self.pools.iter().filter(|pool| pool.role == entry).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{linked_plus, minimal_plus, Fixture, MINIMAL};
    use super::*;

    /// The TOML examples in this module's documentation, so the docs cannot drift from the parser.
    fn documented_examples() -> Vec<String> {
        let source = include_str!("mod.rs");
        let mut examples = Vec::new();
        let mut example: Option<String> = None;
        for line in source.lines().take_while(|line| line.starts_with("//!")) {
            let line = line.trim_start_matches("//!").strip_prefix(' ').unwrap_or("");
            match (&mut example, line) {
                (None, "```toml") => example = Some(String::new()),
                (Some(_), "```") => examples.extend(example.take()),
                (Some(text), _) => {
                    text.push_str(line);
                    text.push('\n');
                }
                _ => {}
            }
        }
        examples
    }

    fn documented_example() -> String {
        documented_examples()[0].clone()
    }

    #[test]
    fn documented_example_parses_with_every_value() {
        let root = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(root.path().join("graphs")).expect("graphs");
        std::fs::create_dir_all(root.path().join("fixtures/hf/kimi_linear")).expect("model");
        std::fs::create_dir_all(root.path().join("traces")).expect("traces");
        std::fs::write(root.path().join("traces/mooncake_conversation_head.jsonl"), "").expect("trace");
        let path = root.path().join("graphs/quickstart.toml");
        std::fs::write(&path, documented_example()).expect("graph file");

        let graph = Graph::load(&path).unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(graph.model, root.path().join("fixtures/hf/kimi_linear"));
        assert_eq!(graph.memory, MemoryConfig { budget_bytes: 64 << 20, block_size: 16, snapshot_fraction: 0.25 });
        let scheduler = SchedulerConfig {
            max_running: 32,
            max_batched_tokens: 256,
            chunk_tokens: 64,
            prefix_cache: true,
            snapshot_interval_blocks: 4,
            admission: AdmissionPolicy::Optimistic,
            spec: Some(kvflow_operators::policy::scheduler::SpecConfig {
                draft_tokens: 4,
                drafter: kvflow_operators::policy::drafter::Drafter::Ngram(
                    kvflow_operators::policy::drafter::NgramDrafter { min_n: 1, max_n: 3 },
                ),
                widen_buckets: false,
            }),
        };
        assert_eq!(graph.scheduler, scheduler);
        assert_eq!(graph.pools.len(), 2);
        assert_eq!(graph.pools[0].ranks, 2);
        assert_eq!(graph.pools[0].role, PoolRole::Aggregated);
        assert_eq!(graph.pools[0].router, "least-outstanding");
        assert_eq!((graph.pools[0].memory.clone(), graph.pools[0].scheduler), (graph.memory.clone(), scheduler));
        let second = &graph.pools[1];
        assert_eq!(second.executor, "cpu-deferred");
        assert_eq!(second.executor_settings.get("delay_steps").and_then(|v| v.as_integer()), Some(1));
        assert_eq!(second.memory.budget_bytes, 32 << 20, "the pool's own [pool.memory] key");
        assert_eq!(second.memory.block_size, 16, "the rest from [memory]");
        assert_eq!(second.scheduler, SchedulerConfig { max_running: 8, ..scheduler });
        assert_eq!(
            graph.workload,
            WorkloadConfig {
                trace: Some(root.path().join("traces/mooncake_conversation_head.jsonl")),
                format: "mooncake".to_string(),
                mode: WorkloadMode::Timestamps { time_scale: 0.01 },
                warmup: 2,
                limit: Some(40),
                block_tokens: 16,
                max_output_tokens: Some(32),
                seed: 1,
                ignore_eos: true,
                cancel_fraction: 0.0,
                cancel_after_ms: 0.0,
                pool_choice: PoolChoice::Seeded,
            }
        );
        assert_eq!(graph.slo, SloConfig { ttft_ms: Some(2000.0), tpot_ms: Some(200.0) });
        assert_eq!(graph.report_dir, root.path().join("out/quickstart"));
    }

    #[test]
    fn documented_disaggregated_example_parses_with_every_value() {
        let examples = documented_examples();
        assert_eq!(examples.len(), 2);
        let root = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(root.path().join("graphs")).expect("graphs");
        std::fs::create_dir_all(root.path().join("fixtures/hf/llama")).expect("model");
        let path = root.path().join("graphs/pd.toml");
        std::fs::write(&path, &examples[1]).expect("graph file");

        let graph = Graph::load(&path).unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(graph.model, root.path().join("fixtures/hf/llama"));
        let roles: Vec<_> = graph.pools.iter().map(|p| (p.name.as_str(), p.role, p.ranks)).collect();
        assert_eq!(roles, [("prefill", PoolRole::Prefill, 2), ("decode", PoolRole::Decode, 1)]);
        assert_eq!(graph.pools[0].disaggregation, DisaggregationConfig::default());
        assert_eq!(
            graph.pools[1].disaggregation,
            DisaggregationConfig { remote_prefill_min_tokens: 32, max_prefill_queue: Some(16) }
        );
        assert_eq!(
            graph.links,
            [LinkConfig {
                from: "prefill".to_string(),
                to: "decode".to_string(),
                backend: TransferBackend::Tcp,
                endpoint: Some(Endpoint { host: "127.0.0.1".to_string(), port: 0 }),
            }]
        );
        assert_eq!(
            graph.transfer,
            TransferConfig { deployment_token: Some("change-me".to_string()), checksum: true, connections: 2 }
        );
        assert_eq!(
            graph.faults,
            FaultsConfig {
                seed: 7,
                drop_connection: 0.01,
                delay_ms: 5.0,
                delay_probability: 0.1,
                corrupt: 0.001,
                duplicate_completion: 0.001,
            }
        );
    }

    #[test]
    fn transfer_backends_round_trip_their_names() {
        for backend in TransferBackend::ALL {
            assert_eq!(TransferBackend::from_name(backend.name()), Some(backend));
            assert_eq!(backend.to_string(), backend.name());
        }
        assert_eq!(TransferBackend::from_name("rdma"), None);
        assert_eq!(TransferBackend::default(), TransferBackend::Inproc);
    }

    #[test]
    fn load_names_a_missing_graph_file() {
        let error = Graph::load(Path::new("/nonexistent/kvflow/graph.toml")).expect_err("no such file");
        assert!(matches!(error, GraphError::Read { .. }));
        assert!(error.to_string().starts_with("/nonexistent/kvflow/graph.toml: cannot read the graph file"), "{error}");
    }

    #[test]
    fn pool_lookup_lists_the_pools_it_has() {
        let fixture = Fixture::new();
        let graph = fixture.graph(&linked_plus(""));
        assert_eq!(graph.pool("d").map(|pool| pool.role).ok(), Some(PoolRole::Decode));
        let error = graph.pool("prefill").expect_err("no such pool");
        assert!(error.to_string().contains("no pool named `prefill`; the pools are `p`, `d`"), "{error}");
    }

    // --- overrides ---------------------------------------------------------------------------

    #[test]
    fn concurrency_override_switches_the_mode() {
        let fixture = Fixture::new();
        let text = minimal_plus("[workload]\nmode = \"rate\"\nrate = 2.0\n");
        let graph = fixture.parse_overridden(&text, &Overrides { concurrency: Some(4), ..Overrides::default() });
        assert_eq!(graph.expect("valid").workload.mode, WorkloadMode::Concurrency(4));
    }

    #[test]
    fn ranks_override_applies_to_every_pool() {
        let fixture = Fixture::new();
        let text = minimal_plus("[[pool]]\nname = \"second\"\nranks = 3\n");
        let graph =
            fixture.parse_overridden(&text, &Overrides { ranks: Some(2), ..Overrides::default() }).expect("valid");
        assert!(graph.pools.iter().all(|pool| pool.ranks == 2), "{:?}", graph.pools);
    }

    #[test]
    fn overrides_set_their_fields_and_leave_the_rest() {
        let fixture = Fixture::new();
        let before = fixture.graph(MINIMAL);
        let trace = fixture.dir.path().join("trace.jsonl");
        let graph = fixture
            .parse_overridden(
                MINIMAL,
                &Overrides {
                    model: Some(fixture.dir.path().to_path_buf()),
                    trace: Some(trace.clone()),
                    format: Some("azure".to_string()),
                    limit: Some(10),
                    warmup: Some(3),
                    block_tokens: Some(8),
                    max_output_tokens: Some(5),
                    out: Some(PathBuf::from("results/run1")),
                    ..Overrides::default()
                },
            )
            .expect("valid");
        assert_eq!(graph.model, fixture.dir.path());
        assert_eq!(graph.workload.trace, Some(trace));
        assert_eq!(graph.workload.format, "azure");
        assert_eq!(graph.workload.limit, Some(10));
        assert_eq!(graph.workload.warmup, 3);
        assert_eq!(graph.workload.block_tokens, 8);
        assert_eq!(graph.workload.max_output_tokens, Some(5));
        assert_eq!(graph.report_dir, PathBuf::from("results/run1"));
        assert_eq!((graph.memory, graph.scheduler, graph.pools), (before.memory, before.scheduler, before.pools));
        assert_eq!(graph.workload.mode, before.workload.mode);
    }

    #[test]
    fn no_overrides_change_nothing() {
        let fixture = Fixture::new();
        assert_eq!(fixture.parse_overridden(MINIMAL, &Overrides::default()).expect("valid"), fixture.graph(MINIMAL));
    }

    #[test]
    fn an_override_stands_in_for_a_value_the_graph_lacks_or_gets_wrong() {
        let fixture = Fixture::new();
        let model = fixture.dir.path().join("model");
        // No model at the graph's path, a trace that is not there, a limit of 0 and no pool ranks
        // that the validator would take: each flag replaces its value before anything is checked.
        let text = "[model]\npath = \"missing-model\"\n\n[[pool]]\nname = \"main\"\nranks = 0\n\n\
                    [workload]\ntrace = \"missing.jsonl\"\nlimit = 0\nmode = \"rate\"\nrate = -1.0\n";
        let error = fixture.error(text);
        assert_eq!(error.key(), Some("model.path"), "{error}");
        let overrides = Overrides {
            model: Some(model.clone()),
            trace: Some(fixture.dir.path().join("trace.jsonl")),
            limit: Some(5),
            ranks: Some(2),
            concurrency: Some(3),
            ..Overrides::default()
        };
        let graph = fixture.parse_overridden(text, &overrides).expect("every wrong value is overridden");
        assert_eq!(graph.model, model);
        assert_eq!((graph.workload.limit, graph.pools[0].ranks), (Some(5), 2));
        assert_eq!(graph.workload.mode, WorkloadMode::Concurrency(3));
        // A wrong value that no flag replaces is still an error naming its line.
        let error =
            fixture.parse_overridden(text, &Overrides { model: Some(model), ..Overrides::default() }).unwrap_err();
        assert_eq!((error.key(), error.line()), (Some("pool.ranks"), Some(6)), "{error}");
    }

    #[test]
    fn invalid_overrides_are_errors_that_name_the_command_line() {
        let fixture = Fixture::new();
        let cases: Vec<(Overrides, &str)> = vec![
            (Overrides { concurrency: Some(0), ..Overrides::default() }, "workload.concurrency"),
            (Overrides { ranks: Some(0), ..Overrides::default() }, "pool.ranks"),
            (Overrides { block_tokens: Some(0), ..Overrides::default() }, "workload.block_tokens"),
            (Overrides { limit: Some(0), ..Overrides::default() }, "workload.limit"),
            (Overrides { max_output_tokens: Some(0), ..Overrides::default() }, "workload.max_output_tokens"),
            (Overrides { format: Some("csv".to_string()), ..Overrides::default() }, "workload.format"),
            (Overrides { model: Some(PathBuf::from("/nonexistent/model")), ..Overrides::default() }, "model.path"),
            (
                Overrides { trace: Some(PathBuf::from("/nonexistent/t.jsonl")), ..Overrides::default() },
                "workload.trace",
            ),
        ];
        for (overrides, key) in cases {
            let overrides = Overrides { warmup: Some(7), ..overrides };
            let error = fixture.parse_overridden(MINIMAL, &overrides).expect_err(key);
            assert_eq!(error.key(), Some(key), "{error}");
            assert_eq!(error.line(), None, "{error}");
            assert!(error.to_string().contains("(set on the command line)"), "{error}");
        }
    }

    #[test]
    fn paths_in_a_graph_are_written_as_a_person_would_type_them() {
        use super::validate::lexically_normal;
        let fixture = Fixture::new();
        let graph = fixture.graph(&minimal_plus("[report]\nout = \"../out/./quickstart\"\n"));
        let parent = fixture.dir.path().parent().unwrap();
        assert_eq!(graph.report_dir, parent.join("out/quickstart"));
        let cases =
            [("graphs/../out/q", "out/q"), ("./a/b/../c", "a/c"), ("../x", "../x"), ("a/..", "."), ("/../a", "/a")];
        for (given, tidy) in cases {
            assert_eq!(lexically_normal(std::path::Path::new(given)), PathBuf::from(tidy), "{given}");
        }
    }
}
