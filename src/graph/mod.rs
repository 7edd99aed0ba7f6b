//! Graph files: the TOML a user writes to describe what kvflow serves and how (DESIGN §3).
//!
//! A graph file names the model, sizes memory and the scheduler, lists the pools (role, ranks,
//! executor, router) and says which trace to replay, with which SLO and where to write the report.
//! It never wires operators: the runtime builds the per-pool operator graph of DESIGN §4 from it,
//! and [`Graph::to_dot`] prints that graph so users see the dataflow they run.
//!
//! Loading happens in three layers, each used once:
//! 1. *raw*: serde structs mirroring the file (`#[serde(deny_unknown_fields)]`, every value kept
//!    with its byte span), so an unknown key or a wrong type is a TOML error with a position;
//! 2. *validation*: every value is checked once, defaults are filled in and relative paths are
//!    resolved; each error names the file, the line of the key and the dotted key
//!    (`graphs/x.toml:14: key `scheduler.chunk_tokens`: 4096 is larger than
//!    scheduler.max_batched_tokens (512)`);
//! 3. *use*: [`Graph`] and its parts are plain immutable values. Command-line flags change them only
//!    through [`Graph::apply_overrides`], which runs the same checks.
//!
//! Relative paths in the file (`model.path`, `workload.trace`, `report.out`) resolve against the
//! folder holding the graph file; paths given as overrides are used as given (relative to the
//! working directory). Operators with a choice (executor, router) are chosen by name from the
//! registries [`ComponentNames`].
//!
//! A complete graph file, every key shown (only `[model]` and one `[[pool]]` with a `name` are
//! required; the comments give the defaults):
//!
//! ```toml
//! [model]
//! path = "../fixtures/hf/kimi_linear"   # checkpoint folder, or a TOML model spec file (seeded random weights)
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
//! executor = "cpu"                 # a name from the executor registry (default "cpu")
//! router = "least-outstanding"     # a name from the router registry (default "least-outstanding")
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
//!
//! [slo]
//! ttft_ms = 2000.0                 # default: none
//! tpot_ms = 200.0                  # default: none
//!
//! [report]
//! out = "../out/quickstart"        # report.json, requests.jsonl (default: out/<graph file stem> from the working dir)
//! ```
//!
//! Not checked here: whether the memory budget holds one request. That needs the model's bytes per
//! token, which the runtime knows once the model is loaded.

mod dot;

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

const DEFAULT_BUDGET_BYTES: u64 = 256 << 20;
const DEFAULT_BLOCK_SIZE: usize = 16;
const DEFAULT_SNAPSHOT_FRACTION: f64 = 0.25;
const MAX_SNAPSHOT_FRACTION: f64 = 0.9;
const DEFAULT_SNAPSHOT_INTERVAL_BLOCKS: usize = 4;
const DEFAULT_MAX_RUNNING: usize = 64;
const DEFAULT_MAX_BATCHED_TOKENS: usize = 512;
const DEFAULT_CHUNK_TOKENS: usize = 64;
const DEFAULT_EXECUTOR: &str = "cpu";
const DEFAULT_ROUTER: &str = "least-outstanding";
const DEFAULT_TRACE_FORMAT: &str = "mooncake";
/// Tokens per hash block in the traces as published (DESIGN §11).
const TRACE_BLOCK_TOKENS: usize = 512;

const POOL_ROLES: &[&str] = &["aggregated", "prefill", "decode"];
const WORKLOAD_MODES: &[&str] = &["timestamps", "concurrency", "rate"];

/// The component names a graph may choose from: those of the runtime's registry
/// (`kvflow::registry::Registry::names`), which programs embedding kvflow extend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComponentNames {
    pub executors: Vec<String>,
    pub routers: Vec<String>,
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
    /// A checkpoint folder or a TOML model spec file; it exists.
    pub model: PathBuf,
    pub memory: MemoryConfig,
    pub scheduler: SchedulerConfig,
    /// At least one; names are unique.
    pub pools: Vec<PoolConfig>,
    pub workload: WorkloadConfig,
    pub slo: SloConfig,
    /// Where the report (report.json, requests.jsonl) is written.
    pub report_dir: PathBuf,
}

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
    /// A snapshot is taken every this many blocks (and at the prompt end); at least 1.
    pub snapshot_interval_blocks: usize,
}

/// Per-rank batching limits of `schedule(t)`.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Running sequences per rank; at least 1.
    pub max_running: usize,
    /// Tokens per rank per step; at least 1.
    pub max_batched_tokens: usize,
    /// Prefill chunk size; at least 1 and at most `max_batched_tokens`.
    pub chunk_tokens: usize,
    pub prefix_cache: bool,
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
    /// One of the registry's routers ([`ComponentNames`]).
    pub router: String,
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
}

/// Latency objectives for goodput; each is > 0 when set.
#[derive(Clone, Debug, PartialEq)]
pub struct SloConfig {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
}

/// Command-line overrides of `kvflow run`. Paths are used as given (relative to the working
/// directory), not resolved against the graph file.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub model: Option<PathBuf>,
    pub trace: Option<PathBuf>,
    pub format: Option<String>,
    pub limit: Option<usize>,
    pub warmup: Option<usize>,
    pub block_tokens: Option<usize>,
    pub max_output_tokens: Option<usize>,
    /// Switches the workload to concurrency mode with this many requests in flight.
    pub concurrency: Option<usize>,
    /// Sets the ranks of every pool.
    pub ranks: Option<usize>,
    pub out: Option<PathBuf>,
}

// ---------------------------------------------------------------------------------------------
// Errors.

/// Where in a graph file an error is: the file, and the 1-based line when the value came from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub file: PathBuf,
    pub line: Option<usize>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}", self.file.display()),
            None => write!(f, "{}", self.file.display()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    #[error("{}: cannot read the graph file: {source}", .file.display())]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("{at}: {message}")]
    Syntax { at: Location, message: String },
    /// A key is unknown, has the wrong type or an invalid value, or is missing.
    #[error("{at}: key `{key}`: {message}")]
    Key { at: Location, key: String, message: String },
    #[error("{}: no pool named `{name}`; the pools are {}", .file.display(), quoted_list(.known))]
    UnknownPool { file: PathBuf, name: String, known: Vec<String> },
}

impl GraphError {
    /// The 1-based line in the graph file the error is about, when there is one.
    pub fn line(&self) -> Option<usize> {
        match self {
            GraphError::Syntax { at, .. } | GraphError::Key { at, .. } => at.line,
            GraphError::Read { .. } | GraphError::UnknownPool { .. } => None,
        }
    }

    /// The dotted key the error is about (`scheduler.chunk_tokens`), when there is one.
    pub fn key(&self) -> Option<&str> {
        match self {
            GraphError::Key { key, .. } => Some(key),
            _ => None,
        }
    }
}

fn quoted_list(names: &[impl AsRef<str>]) -> String {
    names.iter().map(|name| format!("`{}`", name.as_ref())).collect::<Vec<_>>().join(", ")
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
        let text =
            std::fs::read_to_string(path).map_err(|source| GraphError::Read { file: path.to_path_buf(), source })?;
        Graph::parse_with(path, &text, names)
    }

    /// Parses and validates `text` as the graph file `path` (which names the file in errors and
    /// anchors relative paths; it is not read).
    pub fn parse(path: &Path, text: &str) -> Result<Graph, GraphError> {
        Graph::parse_with(path, text, &ComponentNames::builtin())
    }

    /// [`Graph::parse`], checking component choices against `names`.
    pub fn parse_with(path: &Path, text: &str, names: &ComponentNames) -> Result<Graph, GraphError> {
        let raw: RawGraph = toml::from_str(text).map_err(|error| toml_error(path, text, &error))?;
        Validator::new(path, text, names).graph(raw)
    }

    /// Overrides from the command line (`kvflow run` flags), re-validated. On error the graph is
    /// left as it was.
    pub fn apply_overrides(&mut self, overrides: &Overrides) -> Result<(), GraphError> {
        let from_command_line = |key: &str, message: String| GraphError::Key {
            at: Location { file: self.path.clone(), line: None },
            key: key.to_string(),
            message: format!("{message} (set on the command line)"),
        };
        let mut graph = self.clone();
        if let Some(model) = &overrides.model {
            graph.model = existing_path(model.clone()).map_err(|m| from_command_line("model.path", m))?;
        }
        if let Some(trace) = &overrides.trace {
            graph.workload.trace =
                Some(existing_path(trace.clone()).map_err(|m| from_command_line("workload.trace", m))?);
        }
        if let Some(format) = &overrides.format {
            graph.workload.format = one_of(format, &known_trace_formats(), "trace format")
                .map_err(|m| from_command_line("workload.format", m))?;
        }
        if let Some(limit) = overrides.limit {
            graph.workload.limit = Some(measured_limit(limit).map_err(|m| from_command_line("workload.limit", m))?);
        }
        if let Some(warmup) = overrides.warmup {
            graph.workload.warmup = warmup;
        }
        if let Some(block_tokens) = overrides.block_tokens {
            graph.workload.block_tokens =
                at_least_one(block_tokens).map_err(|m| from_command_line("workload.block_tokens", m))?;
        }
        if let Some(max_output_tokens) = overrides.max_output_tokens {
            graph.workload.max_output_tokens =
                Some(at_least_one(max_output_tokens).map_err(|m| from_command_line("workload.max_output_tokens", m))?);
        }
        if let Some(concurrency) = overrides.concurrency {
            graph.workload.mode = WorkloadMode::Concurrency(
                at_least_one(concurrency).map_err(|m| from_command_line("workload.concurrency", m))?,
            );
        }
        if let Some(ranks) = overrides.ranks {
            let ranks = at_least_one(ranks).map_err(|m| from_command_line("pool.ranks", m))?;
            for pool in &mut graph.pools {
                pool.ranks = ranks;
            }
        }
        if let Some(out) = &overrides.out {
            graph.report_dir = out.clone();
        }
        *self = graph;
        Ok(())
    }

    /// The pool named `name`; the error lists the graph's pools.
    pub fn pool(&self, name: &str) -> Result<&PoolConfig, GraphError> {
        self.pools.iter().find(|pool| pool.name == name).ok_or_else(|| GraphError::UnknownPool {
            file: self.path.clone(),
            name: name.to_string(),
            known: self.pools.iter().map(|pool| pool.name.clone()).collect(),
        })
    }

    /// The operator graph the runtime builds for each pool (DESIGN §4), as Graphviz DOT.
    pub fn to_dot(&self) -> String {
        dot::render(self)
    }
}

// ---------------------------------------------------------------------------------------------
// Raw layer: the file as written. Every value keeps its span so validation can name its line;
// every field is optional so defaults and "missing" messages are ours.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGraph {
    #[serde(default)]
    model: RawModel,
    #[serde(default)]
    memory: RawMemory,
    #[serde(default)]
    scheduler: RawScheduler,
    #[serde(default)]
    pool: Vec<Spanned<RawPool>>,
    #[serde(default)]
    workload: RawWorkload,
    #[serde(default)]
    slo: RawSlo,
    #[serde(default)]
    report: RawReport,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    path: Option<Spanned<String>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMemory {
    /// An integer, or a string with a unit; interpreted during validation.
    budget_bytes: Option<Spanned<toml::Value>>,
    block_size: Option<Spanned<usize>>,
    snapshot_fraction: Option<Spanned<f64>>,
    snapshot_interval_blocks: Option<Spanned<usize>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScheduler {
    max_running: Option<Spanned<usize>>,
    max_batched_tokens: Option<Spanned<usize>>,
    chunk_tokens: Option<Spanned<usize>>,
    prefix_cache: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPool {
    name: Option<Spanned<String>>,
    role: Option<Spanned<String>>,
    ranks: Option<Spanned<usize>>,
    executor: Option<Spanned<String>>,
    router: Option<Spanned<String>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWorkload {
    trace: Option<Spanned<String>>,
    format: Option<Spanned<String>>,
    mode: Option<Spanned<String>>,
    time_scale: Option<Spanned<f64>>,
    concurrency: Option<Spanned<usize>>,
    rate: Option<Spanned<f64>>,
    warmup: Option<usize>,
    limit: Option<Spanned<usize>>,
    block_tokens: Option<Spanned<usize>>,
    max_output_tokens: Option<Spanned<usize>>,
    seed: Option<u64>,
    ignore_eos: Option<bool>,
    cancel_fraction: Option<Spanned<f64>>,
    cancel_after_ms: Option<Spanned<f64>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSlo {
    ttft_ms: Option<Spanned<f64>>,
    tpot_ms: Option<Spanned<f64>>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReport {
    out: Option<Spanned<String>>,
}

// ---------------------------------------------------------------------------------------------
// Rules: one small function per check, shared by the file and the command line. Each returns the
// accepted value, or what is wrong with it (the caller adds where it came from).

fn at_least_one(value: usize) -> Result<usize, String> {
    if value == 0 {
        Err("must be at least 1, got 0".to_string())
    } else {
        Ok(value)
    }
}

fn measured_limit(value: usize) -> Result<usize, String> {
    if value == 0 {
        Err("must be at least 1, got 0 (leave it out to measure the rest of the trace)".to_string())
    } else {
        Ok(value)
    }
}

fn more_than_zero(value: f64) -> Result<f64, String> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(format!("must be a number more than 0, got {value}"))
    }
}

fn zero_or_more(value: f64) -> Result<f64, String> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(format!("must be a number of at least 0, got {value}"))
    }
}

fn snapshot_fraction(value: f64) -> Result<f64, String> {
    if (0.0..=MAX_SNAPSHOT_FRACTION).contains(&value) {
        Ok(value)
    } else {
        Err(format!("must be between 0 and {MAX_SNAPSHOT_FRACTION}, got {value}"))
    }
}

fn one_of(value: &str, known: &[impl AsRef<str>], what: &str) -> Result<String, String> {
    if known.iter().any(|k| k.as_ref() == value) {
        Ok(value.to_string())
    } else {
        Err(format!("`{value}` is not a known {what}; known: {}", quoted_list(known)))
    }
}

fn existing_path(path: PathBuf) -> Result<PathBuf, String> {
    if path.exists() {
        Ok(path)
    } else {
        Err(format!("`{}` does not exist", path.display()))
    }
}

fn pool_name(name: &str) -> Result<String, String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
    if !name.is_empty() && name.chars().all(allowed) {
        Ok(name.to_string())
    } else {
        Err(format!("`{name}` is not a pool name: use letters, digits, '-' and '_'"))
    }
}

fn byte_budget(value: &toml::Value) -> Result<u64, String> {
    let bytes = match value {
        toml::Value::Integer(bytes) => {
            u64::try_from(*bytes).map_err(|_| format!("must be more than 0 bytes, got {bytes}"))?
        }
        toml::Value::String(text) => parse_byte_size(text)?,
        other => {
            return Err(format!(
                "expected a byte count: an integer, or a string with a unit such as \"64 MiB\"; got a {}",
                other.type_str()
            ))
        }
    };
    if bytes == 0 {
        return Err("must be more than 0 bytes".to_string());
    }
    Ok(bytes)
}

/// Parses a byte count: a number with an optional unit, such as `"64 MiB"`, `"2GiB"`, `"500 MB"`,
/// `"1.5 GiB"` or `"4096"`. Units (any letter case): B, KB, MB, GB, TB (powers of 1000) and KiB,
/// MiB, GiB, TiB (powers of 1024). A fractional result is rounded down to whole bytes.
pub fn parse_byte_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let unit_start = trimmed.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(trimmed.len());
    let (number, unit) = (&trimmed[..unit_start], trimmed[unit_start..].trim());
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(format!("\"{text}\": unknown unit `{unit}`; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")),
    };
    let too_large = || format!("\"{text}\" is too large");
    if let Ok(whole) = number.parse::<u64>() {
        return whole.checked_mul(multiplier).ok_or_else(too_large);
    }
    let fractional: f64 =
        number.parse().map_err(|_| format!("\"{text}\" is not a byte count such as \"64 MiB\" or \"4096\""))?;
    let bytes = (fractional * multiplier as f64).floor();
    if bytes >= u64::MAX as f64 {
        return Err(too_large());
    }
    Ok(bytes as u64)
}

// ---------------------------------------------------------------------------------------------
// Validation: raw → Graph, once.

struct Validator<'a> {
    file: &'a Path,
    text: &'a str,
    names: &'a ComponentNames,
    /// The folder holding the graph file: relative paths in it resolve against this.
    base: &'a Path,
}

impl<'a> Validator<'a> {
    fn new(file: &'a Path, text: &'a str, names: &'a ComponentNames) -> Self {
        Validator { file, text, names, base: file.parent().unwrap_or(Path::new("")) }
    }

    fn at(&self, span: Option<Range<usize>>) -> Location {
        Location { file: self.file.to_path_buf(), line: span.map(|span| line_of(self.text, span.start)) }
    }

    fn error(&self, key: &str, span: Option<Range<usize>>, message: impl Into<String>) -> GraphError {
        GraphError::Key { at: self.at(span), key: key.to_string(), message: message.into() }
    }

    /// Checks `value` with `rule`, naming the key and its line on error.
    fn checked<T: Clone, U>(
        &self,
        key: &str,
        value: &Spanned<T>,
        rule: impl FnOnce(T) -> Result<U, String>,
    ) -> Result<U, GraphError> {
        rule(value.get_ref().clone()).map_err(|message| self.error(key, Some(value.span()), message))
    }

    /// [`Self::checked`] for a key that may be absent: then `default`.
    fn field<T: Clone, U>(
        &self,
        key: &str,
        raw: Option<&Spanned<T>>,
        default: U,
        rule: impl FnOnce(T) -> Result<U, String>,
    ) -> Result<U, GraphError> {
        match raw {
            None => Ok(default),
            Some(value) => self.checked(key, value, rule),
        }
    }

    /// [`Self::checked`] for a key that may be absent: then `None`.
    fn optional_field<T: Clone, U>(
        &self,
        key: &str,
        raw: Option<&Spanned<T>>,
        rule: impl FnOnce(T) -> Result<U, String>,
    ) -> Result<Option<U>, GraphError> {
        raw.map(|value| self.checked(key, value, rule)).transpose()
    }

    fn resolve(&self, relative: &str) -> PathBuf {
        self.base.join(relative)
    }

    fn graph(&self, raw: RawGraph) -> Result<Graph, GraphError> {
        let Some(model_path) = &raw.model.path else {
            return Err(self.error(
                "model.path",
                None,
                "missing: every graph names its model (a checkpoint folder or a TOML model spec)",
            ));
        };
        let model = self.checked("model.path", model_path, |path| existing_path(self.resolve(&path)))?;
        let report_dir =
            self.field("report.out", raw.report.out.as_ref(), self.default_report_dir(), |out| Ok(self.resolve(&out)))?;
        Ok(Graph {
            path: self.file.to_path_buf(),
            model,
            memory: self.memory(&raw.memory)?,
            scheduler: self.scheduler(&raw.scheduler)?,
            pools: self.pools(&raw.pool)?,
            workload: self.workload(&raw.workload)?,
            slo: self.slo(&raw.slo)?,
            report_dir,
        })
    }

    fn default_report_dir(&self) -> PathBuf {
        let stem = self.file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or("graph".to_string());
        Path::new("out").join(stem)
    }

    fn memory(&self, raw: &RawMemory) -> Result<MemoryConfig, GraphError> {
        Ok(MemoryConfig {
            budget_bytes: self
                .field("memory.budget_bytes", raw.budget_bytes.as_ref(), DEFAULT_BUDGET_BYTES, |v| byte_budget(&v))?,
            block_size: self.field("memory.block_size", raw.block_size.as_ref(), DEFAULT_BLOCK_SIZE, at_least_one)?,
            snapshot_fraction: self.field(
                "memory.snapshot_fraction",
                raw.snapshot_fraction.as_ref(),
                DEFAULT_SNAPSHOT_FRACTION,
                snapshot_fraction,
            )?,
            snapshot_interval_blocks: self.field(
                "memory.snapshot_interval_blocks",
                raw.snapshot_interval_blocks.as_ref(),
                DEFAULT_SNAPSHOT_INTERVAL_BLOCKS,
                at_least_one,
            )?,
        })
    }

    fn scheduler(&self, raw: &RawScheduler) -> Result<SchedulerConfig, GraphError> {
        let max_running =
            self.field("scheduler.max_running", raw.max_running.as_ref(), DEFAULT_MAX_RUNNING, at_least_one)?;
        let max_batched_tokens = self.field(
            "scheduler.max_batched_tokens",
            raw.max_batched_tokens.as_ref(),
            DEFAULT_MAX_BATCHED_TOKENS,
            at_least_one,
        )?;
        let chunk_tokens =
            self.field("scheduler.chunk_tokens", raw.chunk_tokens.as_ref(), DEFAULT_CHUNK_TOKENS, at_least_one)?;
        if chunk_tokens > max_batched_tokens {
            // Blame the key the user wrote: chunk_tokens if set, else the max_batched_tokens that
            // undercuts the default chunk.
            return Err(match (&raw.chunk_tokens, &raw.max_batched_tokens) {
                (Some(chunk), _) => self.error(
                    "scheduler.chunk_tokens",
                    Some(chunk.span()),
                    format!("{chunk_tokens} is larger than scheduler.max_batched_tokens ({max_batched_tokens})"),
                ),
                (None, max_batched) => self.error(
                    "scheduler.max_batched_tokens",
                    max_batched.as_ref().map(Spanned::span),
                    format!(
                        "{max_batched_tokens} is smaller than scheduler.chunk_tokens ({chunk_tokens}, the default); \
                         lower scheduler.chunk_tokens too"
                    ),
                ),
            });
        }
        Ok(SchedulerConfig {
            max_running,
            max_batched_tokens,
            chunk_tokens,
            prefix_cache: raw.prefix_cache.unwrap_or(true),
        })
    }

    fn pools(&self, raw: &[Spanned<RawPool>]) -> Result<Vec<PoolConfig>, GraphError> {
        if raw.is_empty() {
            return Err(self.error(
                "pool",
                None,
                "missing: a graph needs at least one [[pool]] (for example name = \"main\", role = \"aggregated\")",
            ));
        }
        let mut pools: Vec<PoolConfig> = Vec::with_capacity(raw.len());
        let mut name_spans: Vec<Range<usize>> = Vec::with_capacity(raw.len());
        for spanned in raw {
            let pool = spanned.get_ref();
            let Some(name) = &pool.name else {
                return Err(self.error("pool.name", Some(spanned.span()), "missing: every [[pool]] needs a name"));
            };
            let name_value = self.checked("pool.name", name, |name| pool_name(&name))?;
            if let Some(first) = pools.iter().position(|p| p.name == name_value) {
                let first_line = line_of(self.text, name_spans[first].start);
                return Err(self.error(
                    "pool.name",
                    Some(name.span()),
                    format!("pool `{name_value}` is already defined at line {first_line}"),
                ));
            }
            let role = self.field("pool.role", pool.role.as_ref(), PoolRole::Aggregated, |role| {
                PoolRole::from_name(&role)
                    .ok_or_else(|| format!("`{role}` is not a pool role; known: {}", quoted_list(POOL_ROLES)))
            })?;
            pools.push(PoolConfig {
                role,
                ranks: self.field("pool.ranks", pool.ranks.as_ref(), 1, at_least_one)?,
                executor: self.field("pool.executor", pool.executor.as_ref(), DEFAULT_EXECUTOR.to_string(), |e| {
                    one_of(&e, &self.names.executors, "executor")
                })?,
                router: self.field("pool.router", pool.router.as_ref(), DEFAULT_ROUTER.to_string(), |r| {
                    one_of(&r, &self.names.routers, "router")
                })?,
                name: name_value,
            });
            name_spans.push(name.span());
        }
        Ok(pools)
    }

    fn workload(&self, raw: &RawWorkload) -> Result<WorkloadConfig, GraphError> {
        Ok(WorkloadConfig {
            trace: self.optional_field("workload.trace", raw.trace.as_ref(), |t| existing_path(self.resolve(&t)))?,
            format: self.field("workload.format", raw.format.as_ref(), DEFAULT_TRACE_FORMAT.to_string(), |f| {
                one_of(&f, &known_trace_formats(), "trace format")
            })?,
            mode: self.workload_mode(raw)?,
            warmup: raw.warmup.unwrap_or(0),
            limit: self.optional_field("workload.limit", raw.limit.as_ref(), measured_limit)?,
            block_tokens: self.field(
                "workload.block_tokens",
                raw.block_tokens.as_ref(),
                TRACE_BLOCK_TOKENS,
                at_least_one,
            )?,
            max_output_tokens: self.optional_field(
                "workload.max_output_tokens",
                raw.max_output_tokens.as_ref(),
                at_least_one,
            )?,
            seed: raw.seed.unwrap_or(0),
            ignore_eos: raw.ignore_eos.unwrap_or(true),
            cancel_fraction: self.field("workload.cancel_fraction", raw.cancel_fraction.as_ref(), 0.0, |f: f64| {
                if (0.0..=1.0).contains(&f) {
                    Ok(f)
                } else {
                    Err(format!("must be between 0 and 1, got {f}"))
                }
            })?,
            cancel_after_ms: self.field("workload.cancel_after_ms", raw.cancel_after_ms.as_ref(), 0.0, |ms: f64| {
                if ms.is_finite() && ms >= 0.0 {
                    Ok(ms)
                } else {
                    Err(format!("must be a number of milliseconds ≥ 0, got {ms}"))
                }
            })?,
        })
    }

    /// `mode` picks the variant; each mode's own key must be valid, and a key that belongs to
    /// another mode is an error (it would otherwise be silently ignored).
    fn workload_mode(&self, raw: &RawWorkload) -> Result<WorkloadMode, GraphError> {
        let mode_span = raw.mode.as_ref().map(Spanned::span);
        let mode = self.field("workload.mode", raw.mode.as_ref(), "timestamps".to_string(), |mode| {
            one_of(&mode, WORKLOAD_MODES, "workload mode")
        })?;
        let mode_keys = [
            ("time_scale", "timestamps", raw.time_scale.as_ref().map(Spanned::span)),
            ("concurrency", "concurrency", raw.concurrency.as_ref().map(Spanned::span)),
            ("rate", "rate", raw.rate.as_ref().map(Spanned::span)),
        ];
        for (key, owner, span) in mode_keys {
            if let Some(span) = span {
                if owner != mode {
                    let defaulted = if raw.mode.is_none() { " (the default)" } else { "" };
                    return Err(self.error(
                        &format!("workload.{key}"),
                        Some(span),
                        format!("belongs to mode = \"{owner}\", but the mode is \"{mode}\"{defaulted}"),
                    ));
                }
            }
        }
        let missing = |key: &str, what: &str| {
            self.error(
                &format!("workload.{key}"),
                mode_span.clone(),
                format!("mode = \"{mode}\" needs `{key}`: {what}"),
            )
        };
        Ok(match mode.as_str() {
            "concurrency" => {
                let concurrency = raw
                    .concurrency
                    .as_ref()
                    .ok_or_else(|| missing("concurrency", "the number of requests kept in flight"))?;
                WorkloadMode::Concurrency(self.checked("workload.concurrency", concurrency, at_least_one)?)
            }
            "rate" => {
                let rate = raw.rate.as_ref().ok_or_else(|| missing("rate", "requests per second"))?;
                WorkloadMode::Rate { per_second: self.checked("workload.rate", rate, more_than_zero)? }
            }
            _ => WorkloadMode::Timestamps {
                time_scale: self.field("workload.time_scale", raw.time_scale.as_ref(), 1.0, zero_or_more)?,
            },
        })
    }

    fn slo(&self, raw: &RawSlo) -> Result<SloConfig, GraphError> {
        Ok(SloConfig {
            ttft_ms: self.optional_field("slo.ttft_ms", raw.ttft_ms.as_ref(), more_than_zero)?,
            tpot_ms: self.optional_field("slo.tpot_ms", raw.tpot_ms.as_ref(), more_than_zero)?,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// TOML errors (syntax, unknown key, wrong type) in the same `FILE:LINE: key `a.b`: ...` form.

/// 1-based line of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end].iter().filter(|&&b| b == b'\n').count() + 1
}

fn toml_error(file: &Path, text: &str, error: &toml::de::Error) -> GraphError {
    let at = Location { file: file.to_path_buf(), line: error.span().map(|span| line_of(text, span.start)) };
    let message = error.message().trim_end().to_string();
    match error.span().and_then(|span| key_at(text, span.start)) {
        Some(key) if key == "pool" && message.contains("expected a sequence") => {
            GraphError::Key { at, key, message: format!("{message}: pools are an array of tables, written [[pool]]") }
        }
        Some(key) => GraphError::Key { at, key, message },
        None => GraphError::Syntax { at, message },
    }
}

/// The dotted key whose name or value covers byte `offset`, the innermost when several do.
/// `None` when the text is not valid TOML (the error is then a syntax error).
fn key_at(text: &str, offset: usize) -> Option<String> {
    let document = toml::de::DeTable::parse(text).ok()?;
    let mut spans = Vec::new();
    collect_key_spans(document.get_ref(), "", &mut spans);
    spans
        .into_iter()
        .filter(|(_, span)| span.contains(&offset) || (span.is_empty() && span.start == offset))
        .min_by_key(|(_, span)| span.len())
        .map(|(key, _)| key)
}

/// Every key of `table` (recursively) with the spans of its name and its value. Tables opened by
/// a header span only the header, so nested keys are collected whatever their parent's span.
fn collect_key_spans(table: &toml::de::DeTable<'_>, prefix: &str, out: &mut Vec<(String, Range<usize>)>) {
    for (name, value) in table {
        let key = if prefix.is_empty() { name.get_ref().to_string() } else { format!("{prefix}.{}", name.get_ref()) };
        out.push((key.clone(), name.span()));
        out.push((key.clone(), value.span()));
        match value.get_ref() {
            toml::de::DeValue::Table(inner) => collect_key_spans(inner, &key, out),
            toml::de::DeValue::Array(items) => {
                for item in items.iter() {
                    out.push((key.clone(), item.span()));
                    if let toml::de::DeValue::Table(inner) = item.get_ref() {
                        collect_key_spans(inner, &key, out);
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder holding a graph file `graph.toml`, a model folder `model/` and a trace
    /// `trace.jsonl`, so paths in test graphs exist.
    struct Fixture {
        dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Self {
            let dir = tempfile::tempdir().expect("temp dir");
            std::fs::create_dir(dir.path().join("model")).expect("model dir");
            std::fs::write(dir.path().join("trace.jsonl"), "").expect("trace");
            Fixture { dir }
        }

        fn graph_path(&self) -> PathBuf {
            self.dir.path().join("graph.toml")
        }

        fn parse(&self, text: &str) -> Result<Graph, GraphError> {
            Graph::parse(&self.graph_path(), text)
        }

        fn graph(&self, text: &str) -> Graph {
            self.parse(text).unwrap_or_else(|error| panic!("{error}"))
        }

        fn error(&self, text: &str) -> GraphError {
            match self.parse(text) {
                Ok(graph) => panic!("expected an error, got {graph:?}"),
                Err(error) => error,
            }
        }
    }

    const MINIMAL: &str = "[model]\npath = \"model\"\n\n[[pool]]\nname = \"main\"\n";

    /// `MINIMAL` with `extra` appended (its first line is line 6).
    fn minimal_plus(extra: &str) -> String {
        format!("{MINIMAL}{extra}")
    }

    /// The error names `key`, the `line` and the file, in the `FILE:LINE: key `KEY`:` form, and its
    /// message contains each of `fragments`.
    #[track_caller]
    fn assert_key_error(error: &GraphError, key: &str, line: usize, fragments: &[&str]) {
        let shown = error.to_string();
        assert_eq!(error.key(), Some(key), "{shown}");
        assert_eq!(error.line(), Some(line), "{shown}");
        assert!(shown.contains(&format!("graph.toml:{line}: key `{key}`: ")), "{shown}");
        for fragment in fragments {
            assert!(shown.contains(fragment), "`{fragment}` not in: {shown}");
        }
    }

    #[test]
    fn minimal_graph_gets_every_default() {
        let fixture = Fixture::new();
        let graph = fixture.graph(MINIMAL);
        assert_eq!(graph.path, fixture.graph_path());
        assert_eq!(graph.model, fixture.dir.path().join("model"));
        assert_eq!(
            graph.memory,
            MemoryConfig {
                budget_bytes: 256 << 20,
                block_size: 16,
                snapshot_fraction: 0.25,
                snapshot_interval_blocks: 4
            }
        );
        assert_eq!(
            graph.scheduler,
            SchedulerConfig { max_running: 64, max_batched_tokens: 512, chunk_tokens: 64, prefix_cache: true }
        );
        assert_eq!(
            graph.pools,
            vec![PoolConfig {
                name: "main".to_string(),
                role: PoolRole::Aggregated,
                ranks: 1,
                executor: "cpu".to_string(),
                router: "least-outstanding".to_string(),
            }]
        );
        assert_eq!(
            graph.workload,
            WorkloadConfig {
                trace: None,
                format: "mooncake".to_string(),
                mode: WorkloadMode::Timestamps { time_scale: 1.0 },
                warmup: 0,
                limit: None,
                block_tokens: 512,
                max_output_tokens: None,
                seed: 0,
                ignore_eos: true,
                cancel_fraction: 0.0,
                cancel_after_ms: 0.0,
            }
        );
        assert_eq!(graph.slo, SloConfig { ttft_ms: None, tpot_ms: None });
        assert_eq!(graph.report_dir, PathBuf::from("out/graph"));
    }

    /// The TOML example in this module's documentation, so the docs cannot drift from the parser.
    fn documented_example() -> String {
        let source = include_str!("mod.rs");
        let mut example = String::new();
        let mut inside = false;
        for line in source.lines().take_while(|line| line.starts_with("//!")) {
            let line = line.trim_start_matches("//!").strip_prefix(' ').unwrap_or("");
            match (inside, line) {
                (false, "```toml") => inside = true,
                (true, "```") => break,
                (true, _) => {
                    example.push_str(line);
                    example.push('\n');
                }
                _ => {}
            }
        }
        example
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
        let graphs = root.path().join("graphs");
        assert_eq!(graph.model, graphs.join("../fixtures/hf/kimi_linear"));
        assert_eq!(
            graph.memory,
            MemoryConfig {
                budget_bytes: 64 << 20,
                block_size: 16,
                snapshot_fraction: 0.25,
                snapshot_interval_blocks: 4
            }
        );
        assert_eq!(
            graph.scheduler,
            SchedulerConfig { max_running: 32, max_batched_tokens: 256, chunk_tokens: 64, prefix_cache: true }
        );
        assert_eq!(graph.pools.len(), 1);
        assert_eq!(graph.pools[0].ranks, 2);
        assert_eq!(graph.pools[0].role, PoolRole::Aggregated);
        assert_eq!(graph.pools[0].router, "least-outstanding");
        assert_eq!(
            graph.workload,
            WorkloadConfig {
                trace: Some(graphs.join("../traces/mooncake_conversation_head.jsonl")),
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
            }
        );
        assert_eq!(graph.slo, SloConfig { ttft_ms: Some(2000.0), tpot_ms: Some(200.0) });
        assert_eq!(graph.report_dir, graphs.join("../out/quickstart"));
    }

    #[test]
    fn concurrency_and_rate_modes_parse() {
        let fixture = Fixture::new();
        let graph = fixture.graph(&minimal_plus("[workload]\nmode = \"concurrency\"\nconcurrency = 8\n"));
        assert_eq!(graph.workload.mode, WorkloadMode::Concurrency(8));
        let graph = fixture.graph(&minimal_plus("[workload]\nmode = \"rate\"\nrate = 4\n"));
        assert_eq!(graph.workload.mode, WorkloadMode::Rate { per_second: 4.0 });
        let graph = fixture.graph(&minimal_plus("[workload]\ntime_scale = 0\n"));
        assert_eq!(graph.workload.mode, WorkloadMode::Timestamps { time_scale: 0.0 });
    }

    #[test]
    fn relative_paths_resolve_against_the_graph_folder() {
        let root = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(root.path().join("graphs/nested")).expect("graphs");
        std::fs::create_dir_all(root.path().join("models/tiny")).expect("model");
        std::fs::write(root.path().join("t.jsonl"), "").expect("trace");
        let path = root.path().join("graphs/nested/g.toml");
        let text = "[model]\npath = \"../../models/tiny\"\n[[pool]]\nname = \"p\"\n\
                    [workload]\ntrace = \"../../t.jsonl\"\n[report]\nout = \"results\"\n";
        let graph = Graph::parse(&path, text).unwrap_or_else(|error| panic!("{error}"));
        let folder = root.path().join("graphs/nested");
        assert_eq!(graph.model, folder.join("../../models/tiny"));
        assert_eq!(graph.workload.trace, Some(folder.join("../../t.jsonl")));
        assert_eq!(graph.report_dir, folder.join("results"));
    }

    #[test]
    fn absolute_paths_are_kept() {
        let fixture = Fixture::new();
        let model = fixture.dir.path().join("model");
        let graph = Graph::parse(
            Path::new("elsewhere/g.toml"),
            &format!("[model]\npath = {:?}\n[[pool]]\nname = \"p\"\n", model.display().to_string()),
        )
        .unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(graph.model, model);
    }

    #[test]
    fn a_graph_file_in_the_working_directory_resolves_paths_from_it() {
        let names = ComponentNames::builtin();
        let validator = Validator::new(Path::new("g.toml"), "", &names);
        assert_eq!(validator.resolve("model"), PathBuf::from("model"));
    }

    #[test]
    fn load_names_a_missing_graph_file() {
        let error = Graph::load(Path::new("/nonexistent/kvflow/graph.toml")).expect_err("no such file");
        assert!(matches!(error, GraphError::Read { .. }));
        assert!(error.to_string().starts_with("/nonexistent/kvflow/graph.toml: cannot read the graph file"), "{error}");
    }

    // --- TOML-level errors -------------------------------------------------------------------

    #[test]
    fn unknown_key_names_the_key_and_line() {
        let error = Fixture::new().error(&minimal_plus("[scheduler]\nmax_running = 4\nchunk_size = 8\n"));
        assert_key_error(&error, "scheduler.chunk_size", 8, &["unknown field `chunk_size`", "chunk_tokens"]);
    }

    #[test]
    fn unknown_key_in_a_pool_names_the_key_and_line() {
        let error = Fixture::new().error("[model]\npath = \"model\"\n[[pool]]\nname = \"a\"\nsize = 2\n");
        assert_key_error(&error, "pool.size", 5, &["unknown field `size`"]);
    }

    #[test]
    fn unknown_section_and_top_level_key_are_errors() {
        let fixture = Fixture::new();
        assert_key_error(&fixture.error(&minimal_plus("[stores]\nkind = \"disk\"\n")), "stores", 6, &["unknown field"]);
        assert_key_error(&fixture.error(&format!("title = \"x\"\n{MINIMAL}")), "title", 1, &["unknown field"]);
    }

    #[test]
    fn wrong_type_names_the_key_and_line() {
        let error = Fixture::new().error("[model]\npath = \"model\"\n[[pool]]\nname = \"a\"\nranks = \"two\"\n");
        assert_key_error(&error, "pool.ranks", 5, &["invalid type", "expected usize"]);
        let error = Fixture::new().error(&minimal_plus("[scheduler]\nmax_running = -1\n"));
        assert_key_error(&error, "scheduler.max_running", 7, &["-1"]);
    }

    #[test]
    fn a_single_bracket_pool_table_hints_at_double_brackets() {
        let error = Fixture::new().error("[model]\npath = \"model\"\n[pool]\nname = \"a\"\n");
        assert_key_error(&error, "pool", 3, &["written [[pool]]"]);
    }

    #[test]
    fn toml_syntax_error_names_the_line() {
        let error = Fixture::new().error(&minimal_plus("[slo]\nttft_ms = \n"));
        assert!(matches!(error, GraphError::Syntax { .. }), "{error}");
        assert_eq!(error.line(), Some(7), "{error}");
        assert!(error.to_string().contains("graph.toml:7: "), "{error}");
    }

    // --- model -------------------------------------------------------------------------------

    #[test]
    fn missing_model_is_an_error() {
        let error = Fixture::new().error("[[pool]]\nname = \"main\"\n");
        assert_eq!(error.key(), Some("model.path"));
        assert!(error.to_string().contains("missing"), "{error}");
    }

    #[test]
    fn model_path_that_does_not_exist_names_the_resolved_path() {
        let fixture = Fixture::new();
        let error = fixture.error("\n[model]\npath = \"no_such_model\"\n[[pool]]\nname = \"a\"\n");
        let resolved = fixture.dir.path().join("no_such_model");
        assert_key_error(&error, "model.path", 3, &[&format!("`{}` does not exist", resolved.display())]);
    }

    // --- pools -------------------------------------------------------------------------------

    #[test]
    fn a_graph_without_pools_is_an_error() {
        let error = Fixture::new().error("[model]\npath = \"model\"\n");
        assert_eq!(error.key(), Some("pool"));
        assert!(error.to_string().contains("at least one [[pool]]"), "{error}");
    }

    #[test]
    fn duplicate_pool_names_are_an_error() {
        let error = Fixture::new().error(&minimal_plus("\n[[pool]]\nname = \"main\"\n"));
        assert_key_error(&error, "pool.name", 8, &["`main` is already defined at line 5"]);
    }

    #[test]
    fn a_pool_without_a_name_is_an_error_at_its_header() {
        let error = Fixture::new().error(&minimal_plus("[[pool]]\nranks = 2\n"));
        assert_key_error(&error, "pool.name", 6, &["missing"]);
    }

    #[test]
    fn pool_names_must_be_identifiers() {
        let error = Fixture::new().error("[model]\npath = \"model\"\n[[pool]]\nname = \"my pool\"\n");
        assert_key_error(&error, "pool.name", 4, &["letters, digits"]);
    }

    #[test]
    fn zero_ranks_is_an_error() {
        let error = Fixture::new().error(&minimal_plus("ranks = 0\n"));
        assert_key_error(&error, "pool.ranks", 6, &["at least 1"]);
    }

    #[test]
    fn unknown_role_lists_the_roles() {
        let error = Fixture::new().error(&minimal_plus("role = \"verify\"\n"));
        assert_key_error(&error, "pool.role", 6, &["`verify`", "`aggregated`, `prefill`, `decode`"]);
    }

    #[test]
    fn prefill_and_decode_roles_parse() {
        let fixture = Fixture::new();
        let graph = fixture.graph(
            "[model]\npath = \"model\"\n[[pool]]\nname = \"p\"\nrole = \"prefill\"\n\
             [[pool]]\nname = \"d\"\nrole = \"decode\"\nrouter = \"round-robin\"\n",
        );
        assert_eq!(graph.pools[0].role, PoolRole::Prefill);
        assert_eq!(graph.pools[1].role, PoolRole::Decode);
        assert_eq!(graph.pools[1].router, "round-robin");
    }

    #[test]
    fn executor_must_be_in_the_registry() {
        let error = Fixture::new().error(&minimal_plus("executor = \"tpu\"\n"));
        assert_key_error(&error, "pool.executor", 6, &["`tpu` is not a known executor", "`cpu`"]);
    }

    #[test]
    fn router_must_be_in_the_registry() {
        let error = Fixture::new().error(&minimal_plus("router = \"random\"\n"));
        assert_key_error(&error, "pool.router", 6, &["`random`", "`least-outstanding`, `round-robin`"]);
    }

    #[test]
    fn pool_lookup_lists_the_pools_it_has() {
        let fixture = Fixture::new();
        let graph = fixture.graph(&minimal_plus("[[pool]]\nname = \"decode\"\nrole = \"decode\"\n"));
        assert_eq!(graph.pool("decode").map(|pool| pool.role).ok(), Some(PoolRole::Decode));
        let error = graph.pool("prefill").expect_err("no such pool");
        assert!(error.to_string().contains("no pool named `prefill`; the pools are `main`, `decode`"), "{error}");
    }

    // --- memory and scheduler ----------------------------------------------------------------

    #[test]
    fn zero_block_size_is_an_error() {
        let error = Fixture::new().error(&minimal_plus("[memory]\nblock_size = 0\n"));
        assert_key_error(&error, "memory.block_size", 7, &["at least 1"]);
    }

    #[test]
    fn snapshot_fraction_outside_zero_to_point_nine_is_an_error() {
        let fixture = Fixture::new();
        let error = fixture.error(&minimal_plus("[memory]\nsnapshot_fraction = 0.95\n"));
        assert_key_error(&error, "memory.snapshot_fraction", 7, &["between 0 and 0.9", "0.95"]);
        let error = fixture.error(&minimal_plus("[memory]\nsnapshot_fraction = -0.1\n"));
        assert_key_error(&error, "memory.snapshot_fraction", 7, &["-0.1"]);
        let error = fixture.error(&minimal_plus("[memory]\nsnapshot_fraction = nan\n"));
        assert_key_error(&error, "memory.snapshot_fraction", 7, &["NaN"]);
        assert_eq!(fixture.graph(&minimal_plus("[memory]\nsnapshot_fraction = 0\n")).memory.snapshot_fraction, 0.0);
    }

    #[test]
    fn zero_snapshot_interval_is_an_error() {
        let error = Fixture::new().error(&minimal_plus("[memory]\nsnapshot_interval_blocks = 0\n"));
        assert_key_error(&error, "memory.snapshot_interval_blocks", 7, &["at least 1"]);
    }

    #[test]
    fn budget_accepts_bytes_or_a_string_with_a_unit() {
        let fixture = Fixture::new();
        let budget = |value: &str| fixture.graph(&minimal_plus(&format!("[memory]\nbudget_bytes = {value}\n"))).memory;
        assert_eq!(budget("1048576").budget_bytes, 1 << 20);
        assert_eq!(budget("\"2 GiB\"").budget_bytes, 2 << 30);
    }

    #[test]
    fn zero_or_unparsable_budget_is_an_error() {
        let fixture = Fixture::new();
        let error = fixture.error(&minimal_plus("[memory]\nbudget_bytes = 0\n"));
        assert_key_error(&error, "memory.budget_bytes", 7, &["more than 0 bytes"]);
        let error = fixture.error(&minimal_plus("[memory]\nbudget_bytes = \"0 MiB\"\n"));
        assert_key_error(&error, "memory.budget_bytes", 7, &["more than 0 bytes"]);
        let error = fixture.error(&minimal_plus("[memory]\nbudget_bytes = \"64 MiX\"\n"));
        assert_key_error(&error, "memory.budget_bytes", 7, &["unknown unit `MiX`"]);
        let error = fixture.error(&minimal_plus("[memory]\nbudget_bytes = -5\n"));
        assert_key_error(&error, "memory.budget_bytes", 7, &["-5"]);
        let error = fixture.error(&minimal_plus("[memory]\nbudget_bytes = 1.5\n"));
        assert_key_error(&error, "memory.budget_bytes", 7, &["expected a byte count", "float"]);
    }

    #[test]
    fn byte_sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_byte_size("64 MiB"), Ok(64 << 20));
        assert_eq!(parse_byte_size("2 GiB"), Ok(2 << 30));
        assert_eq!(parse_byte_size("500 MB"), Ok(500_000_000));
        assert_eq!(parse_byte_size("512 KiB"), Ok(512 << 10));
        assert_eq!(parse_byte_size("1 TiB"), Ok(1 << 40));
        assert_eq!(parse_byte_size("3 kb"), Ok(3_000));
        assert_eq!(parse_byte_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_byte_size(" 4096 "), Ok(4096));
        assert_eq!(parse_byte_size("4096 B"), Ok(4096));
        assert_eq!(parse_byte_size("1.5 GiB"), Ok(3 << 29));
    }

    #[test]
    fn byte_sizes_reject_bad_units_and_numbers() {
        assert!(parse_byte_size("64 MiX").unwrap_err().contains("unknown unit `MiX`"));
        assert!(parse_byte_size("MiB").is_err());
        assert!(parse_byte_size("").is_err());
        assert!(parse_byte_size("1.2.3 MB").is_err());
        assert!(parse_byte_size("-1 MB").is_err());
        assert!(parse_byte_size("99999999999 TiB").unwrap_err().contains("too large"));
    }

    #[test]
    fn chunk_larger_than_max_batched_tokens_is_an_error() {
        let error = Fixture::new().error(&minimal_plus("[scheduler]\nmax_batched_tokens = 512\nchunk_tokens = 4096\n"));
        assert_key_error(
            &error,
            "scheduler.chunk_tokens",
            8,
            &["4096 is larger than scheduler.max_batched_tokens (512)"],
        );
    }

    #[test]
    fn max_batched_tokens_below_the_default_chunk_blames_max_batched_tokens() {
        let error = Fixture::new().error(&minimal_plus("[scheduler]\nmax_batched_tokens = 32\n"));
        assert_key_error(&error, "scheduler.max_batched_tokens", 7, &["32 is smaller than scheduler.chunk_tokens (64"]);
    }

    #[test]
    fn zero_scheduler_limits_are_errors() {
        let fixture = Fixture::new();
        for key in ["max_running", "max_batched_tokens", "chunk_tokens"] {
            let error = fixture.error(&minimal_plus(&format!("[scheduler]\n{key} = 0\n")));
            assert_key_error(&error, &format!("scheduler.{key}"), 7, &["at least 1"]);
        }
    }

    // --- workload ----------------------------------------------------------------------------

    #[test]
    fn concurrency_mode_needs_concurrency_of_at_least_one() {
        let fixture = Fixture::new();
        let error = fixture.error(&minimal_plus("[workload]\nmode = \"concurrency\"\n"));
        assert_key_error(&error, "workload.concurrency", 7, &["mode = \"concurrency\" needs `concurrency`"]);
        let error = fixture.error(&minimal_plus("[workload]\nmode = \"concurrency\"\nconcurrency = 0\n"));
        assert_key_error(&error, "workload.concurrency", 8, &["at least 1"]);
    }

    #[test]
    fn rate_mode_needs_a_positive_rate() {
        let fixture = Fixture::new();
        let error = fixture.error(&minimal_plus("[workload]\nmode = \"rate\"\n"));
        assert_key_error(&error, "workload.rate", 7, &["needs `rate`"]);
        let error = fixture.error(&minimal_plus("[workload]\nmode = \"rate\"\nrate = 0.0\n"));
        assert_key_error(&error, "workload.rate", 8, &["more than 0"]);
        let error = fixture.error(&minimal_plus("[workload]\nmode = \"rate\"\nrate = inf\n"));
        assert_key_error(&error, "workload.rate", 8, &["more than 0"]);
    }

    #[test]
    fn negative_time_scale_is_an_error() {
        let error = Fixture::new().error(&minimal_plus("[workload]\nmode = \"timestamps\"\ntime_scale = -1.0\n"));
        assert_key_error(&error, "workload.time_scale", 8, &["at least 0"]);
    }

    #[test]
    fn a_key_of_another_mode_is_an_error_naming_its_mode() {
        let fixture = Fixture::new();
        let error = fixture.error(&minimal_plus("[workload]\nmode = \"timestamps\"\nrate = 4.0\n"));
        assert_key_error(&error, "workload.rate", 8, &["belongs to mode = \"rate\"", "the mode is \"timestamps\""]);
        let error = fixture.error(&minimal_plus("[workload]\nconcurrency = 8\n"));
        assert_key_error(&error, "workload.concurrency", 7, &["belongs to mode = \"concurrency\"", "(the default)"]);
        let error = fixture.error(&minimal_plus("[workload]\nmode = \"rate\"\nrate = 1.0\ntime_scale = 2.0\n"));
        assert_key_error(&error, "workload.time_scale", 9, &["belongs to mode = \"timestamps\""]);
    }

    #[test]
    fn unknown_mode_is_an_error() {
        let error = Fixture::new().error(&minimal_plus("[workload]\nmode = \"burst\"\n"));
        assert_key_error(&error, "workload.mode", 7, &["`burst`", "`timestamps`, `concurrency`, `rate`"]);
    }

    #[test]
    fn unknown_trace_format_is_an_error() {
        let error = Fixture::new().error(&minimal_plus("[workload]\nformat = \"sharegpt\"\n"));
        assert_key_error(&error, "workload.format", 7, &["`sharegpt`", "`mooncake`, `azure`, `vidur`"]);
    }

    #[test]
    fn zero_block_tokens_is_an_error() {
        let error = Fixture::new().error(&minimal_plus("[workload]\nblock_tokens = 0\n"));
        assert_key_error(&error, "workload.block_tokens", 7, &["at least 1"]);
    }

    #[test]
    fn zero_limit_and_zero_output_cap_are_errors() {
        let fixture = Fixture::new();
        assert_key_error(
            &fixture.error(&minimal_plus("[workload]\nlimit = 0\n")),
            "workload.limit",
            7,
            &["at least 1"],
        );
        assert_key_error(
            &fixture.error(&minimal_plus("[workload]\nmax_output_tokens = 0\n")),
            "workload.max_output_tokens",
            7,
            &["at least 1"],
        );
    }

    #[test]
    fn trace_that_does_not_exist_is_an_error() {
        let fixture = Fixture::new();
        let error = fixture.error(&minimal_plus("[workload]\ntrace = \"missing.jsonl\"\n"));
        let resolved = fixture.dir.path().join("missing.jsonl");
        assert_key_error(&error, "workload.trace", 7, &[&format!("`{}` does not exist", resolved.display())]);
        let graph = fixture.graph(&minimal_plus("[workload]\ntrace = \"trace.jsonl\"\n"));
        assert_eq!(graph.workload.trace, Some(fixture.dir.path().join("trace.jsonl")));
    }

    // --- slo ---------------------------------------------------------------------------------

    #[test]
    fn slo_values_must_be_positive() {
        let fixture = Fixture::new();
        let error = fixture.error(&minimal_plus("[slo]\nttft_ms = 0\n"));
        assert_key_error(&error, "slo.ttft_ms", 7, &["more than 0"]);
        let error = fixture.error(&minimal_plus("[slo]\nttft_ms = 100\ntpot_ms = -5.0\n"));
        assert_key_error(&error, "slo.tpot_ms", 8, &["more than 0"]);
    }

    // --- overrides ---------------------------------------------------------------------------

    #[test]
    fn concurrency_override_switches_the_mode() {
        let fixture = Fixture::new();
        let mut graph = fixture.graph(&minimal_plus("[workload]\nmode = \"rate\"\nrate = 2.0\n"));
        graph.apply_overrides(&Overrides { concurrency: Some(4), ..Overrides::default() }).expect("valid");
        assert_eq!(graph.workload.mode, WorkloadMode::Concurrency(4));
    }

    #[test]
    fn ranks_override_applies_to_every_pool() {
        let fixture = Fixture::new();
        let mut graph = fixture.graph(&minimal_plus("[[pool]]\nname = \"second\"\nranks = 3\n"));
        graph.apply_overrides(&Overrides { ranks: Some(2), ..Overrides::default() }).expect("valid");
        assert!(graph.pools.iter().all(|pool| pool.ranks == 2), "{:?}", graph.pools);
    }

    #[test]
    fn overrides_set_their_fields_and_leave_the_rest() {
        let fixture = Fixture::new();
        let mut graph = fixture.graph(MINIMAL);
        let before = graph.clone();
        let trace = fixture.dir.path().join("trace.jsonl");
        graph
            .apply_overrides(&Overrides {
                model: Some(fixture.dir.path().to_path_buf()),
                trace: Some(trace.clone()),
                format: Some("azure".to_string()),
                limit: Some(10),
                warmup: Some(3),
                block_tokens: Some(8),
                max_output_tokens: Some(5),
                out: Some(PathBuf::from("results/run1")),
                ..Overrides::default()
            })
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
        let mut graph = fixture.graph(MINIMAL);
        let before = graph.clone();
        graph.apply_overrides(&Overrides::default()).expect("valid");
        assert_eq!(graph, before);
    }

    #[test]
    fn invalid_overrides_are_errors_and_leave_the_graph_unchanged() {
        let fixture = Fixture::new();
        let mut graph = fixture.graph(MINIMAL);
        let before = graph.clone();
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
            // A valid override next to the invalid one must not be applied either.
            let overrides = Overrides { warmup: Some(7), ..overrides };
            let error = graph.apply_overrides(&overrides).expect_err(key);
            assert_eq!(error.key(), Some(key), "{error}");
            assert_eq!(error.line(), None, "{error}");
            assert!(error.to_string().contains("(set on the command line)"), "{error}");
            assert_eq!(graph, before, "{key}");
        }
    }
}
