//! What a graph file says, validated: plain immutable values ([`Graph`] and its parts) that the
//! runtime reads. They are made once, by `validate.rs` from the raw layer, and never changed
//! after; the manual for the file is docs/graph-format.md.

use std::fmt;
use std::path::PathBuf;

/// Trace formats `workload.format` can name (DESIGN §11): those `crate::trace` reads.
pub fn known_trace_formats() -> Vec<&'static str> {
    crate::trace::TraceFormat::ALL.iter().map(|f| f.name()).collect()
}

pub use crate::registry::ComponentNames;

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
    /// `report.steps`: every rank logs its launched steps into `steps.jsonl` (off by default).
    pub report_steps: bool,
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

    pub(super) fn from_name(name: &str) -> Option<PoolRole> {
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

impl PoolConfig {
    /// Whether the pool's decodes verify drafts: with `[speculative]`, every pool but a prefill
    /// pool's (a producer drafts for its handoffs, never verifies).
    pub fn verifies(&self) -> bool {
        self.scheduler.spec.is_some() && self.role != PoolRole::Prefill
    }

    /// Rows a decode of the pool feeds at most: its token and, where it verifies, its drafts.
    pub fn verification_width(&self) -> usize {
        1 + self.scheduler.spec.filter(|_| self.verifies()).map_or(0, |s| s.draft_tokens)
    }
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
    /// The link's rate in bytes a second (`bandwidth = "100 MB/s"`): handoffs leave no faster
    /// (a token bucket on the sender, shared by the link's connections). `None`: as fast as the
    /// backend moves them.
    pub bandwidth: Option<u64>,
    /// Prompts of at least this many tokens hand off in pieces while they prefill (each
    /// completed chunk's blocks sent at once, the rest with T0); shorter ones go whole. `None`
    /// (the default): every handoff goes whole, after its prefill.
    pub stream_min_tokens: Option<usize>,
}

/// How a link moves handoffs (DESIGN §8; `link.backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferBackend {
    /// Both pools in one process: no serialization and no socket; the consumer copies the
    /// handoff's KV into its own blocks.
    Inproc,
    /// A TCP connection to the consumer's endpoint, on loopback or across hosts.
    Tcp,
    /// A simulated run's link (every pool's executor `sim`): a handoff moves no bytes and
    /// arrives when the virtual clock reaches the end of its transfer at the link's
    /// `bandwidth` (behind the handoffs sent over the link before it; none: at once).
    Sim,
}

impl TransferBackend {
    /// Every backend, in the order errors list them.
    pub const ALL: [TransferBackend; 3] = [TransferBackend::Inproc, TransferBackend::Tcp, TransferBackend::Sim];

    /// The name used in graph files.
    pub fn name(self) -> &'static str {
        match self {
            TransferBackend::Inproc => "inproc",
            TransferBackend::Tcp => "tcp",
            TransferBackend::Sim => "sim",
        }
    }

    /// The backend a graph file's name stands for.
    pub fn from_name(name: &str) -> Option<TransferBackend> {
        TransferBackend::ALL.into_iter().find(|backend| backend.name() == name)
    }
}

impl Default for TransferBackend {
    fn default() -> Self {
        DEFAULT_TRANSFER_BACKEND
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

/// The KV offload tier (`[offload]`, DESIGN §9): where full prompt chunks are saved, and loaded
/// back from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadConfig {
    pub store: OffloadStore,
    /// Tokens per chunk: a positive multiple of the block size (default 256).
    pub chunk_tokens: usize,
    /// A failed save is tried again this many times, then dropped (default 3).
    pub max_retries: usize,
    /// Saves a rank may have in flight (launched, waiting or being written); a chunk completed
    /// beyond them is not saved, and counted (default 64).
    pub max_pending_saves: usize,
}

/// Which store the offload tier uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OffloadStore {
    /// In this process's memory, least recently used evicted first past `capacity_bytes`.
    Memory { capacity_bytes: u64 },
    /// One file per object under `path` (relative to the graph file's folder); it outlives the run.
    Disk { path: PathBuf },
    /// A Redis or Valkey server shared by every process that names it (`redis_store` in
    /// kvflow-operators says what it keeps there).
    Redis(RedisStoreConfig),
    /// A simulated run's store (every pool's executor `sim`): sized chunks, least recently
    /// used evicted first past `capacity_bytes`, each save and load taking the latency plus its
    /// bytes at the store's rate (`offload::SimulatedStore` in kvflow-operators).
    Sim(SimStoreConfig),
}

impl OffloadStore {
    /// Its name in a graph (`store = "…"`).
    pub fn kind(&self) -> &'static str {
        match self {
            OffloadStore::Memory { .. } => "memory",
            OffloadStore::Disk { .. } => "disk",
            OffloadStore::Redis(_) => "redis",
            OffloadStore::Sim(_) => "sim",
        }
    }
}

/// `store = "sim"`: its capacity and rates.
#[derive(Clone, Debug, PartialEq)]
pub struct SimStoreConfig {
    pub capacity_bytes: u64,
    /// GB/s a rank's saves move (default 8).
    pub save_gbps: f64,
    /// GB/s a rank's loads move (default 8).
    pub load_gbps: f64,
    /// µs every save and load takes beside its bytes (default 20).
    pub latency_us: f64,
}

impl Eq for SimStoreConfig {}

/// `store = "redis"`: where the server is and how long chunks live there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedisStoreConfig {
    /// `redis://host:port/db` or `rediss://…` (TLS); never with a password in it.
    pub url: String,
    /// The environment variable that holds the password, if the server wants one.
    pub password_env: Option<String>,
    /// A chunk expires this long after it was saved or last loaded (default 1 h).
    pub lease_ms: u64,
    /// An operation slower than this counts as failed (default 2 s).
    pub timeout_ms: u64,
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
        DEFAULT_TRANSFER
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
        DEFAULT_FAULTS
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

pub(super) const DEFAULT_TRANSFER_BACKEND: TransferBackend = TransferBackend::Inproc;

pub(super) const DEFAULT_TRANSFER: TransferConfig =
    TransferConfig { deployment_token: None, checksum: true, connections: 2 };

/// No faults.
pub(super) const DEFAULT_FAULTS: FaultsConfig = FaultsConfig {
    seed: 0,
    drop_connection: 0.0,
    delay_ms: 0.0,
    delay_probability: 0.0,
    corrupt: 0.0,
    duplicate_completion: 0.0,
};
