//! Validation: raw → [`Graph`], once. The [`Validator`] checks every value of a [`RawGraph`] with
//! the rules of `rules`, fills in the defaults below and resolves relative paths against the folder
//! holding the graph file; each error names the file, the line of the key and the dotted key.

use std::ops::Range;
use std::path::{Path, PathBuf};

use toml::Spanned;

use super::config::{
    known_trace_formats, AdmissionPolicy, ComponentNames, DisaggregationConfig, Graph, MemoryConfig, OffloadConfig,
    OffloadStore, PoolChoice, PoolConfig, PoolRole, RedisStoreConfig, SchedulerConfig, SimStoreConfig, SloConfig,
    WorkloadConfig, WorkloadMode,
};
use super::error::{line_of, quoted_list, GraphError, Location};
use super::overrides::CommandLineKeys;
use super::raw::{
    RawDisaggregation, RawGraph, RawMemory, RawOffload, RawPool, RawSampling, RawScheduler, RawServe, RawSlo,
    RawSpeculative, RawWorkload,
};
use super::rules::{
    at_least_one, byte_budget, existing_path, expand_path, measured_limit, milliseconds, more_than_zero, one_of,
    pool_hosts, pool_name, positive_milliseconds, rank_count, snapshot_fraction, token_count, zero_or_more, MAX_TOKENS,
};
use kvflow_kernels::cpu::sampling::{check_temperature, check_top_p, RequestSampling, SamplingParams};
use kvflow_operators::policy::drafter::{Drafter, NgramDrafter};
use kvflow_operators::policy::scheduler::SpecConfig;

const DEFAULT_MEMORY: MemoryConfig = MemoryConfig { budget_bytes: 256 << 20, block_size: 16, snapshot_fraction: 0.25 };
const DEFAULT_SCHEDULER: SchedulerConfig = SchedulerConfig {
    max_running: 64,
    max_batched_tokens: 512,
    chunk_tokens: 64,
    prefix_cache: true,
    snapshot_interval_blocks: 4,
    admission: AdmissionPolicy::Optimistic,
    spec: None,
};
/// The most drafts one decode may carry.
const MAX_DRAFT_TOKENS: usize = 16;
const DEFAULT_EXECUTOR: &str = "cpu";
const DEFAULT_ROUTER: &str = "least-outstanding";
const DEFAULT_TRACE_FORMAT: &str = "mooncake";
/// Tokens per hash block in the traces as published (DESIGN §11).
const TRACE_BLOCK_TOKENS: usize = 512;
/// Every remote-prefill condition open: a decode pool has every prompt with anything uncached
/// prefilled remotely, however long the prefill queue.
pub(super) const DEFAULT_DISAGGREGATION: DisaggregationConfig =
    DisaggregationConfig { remote_prefill_min_tokens: 0, max_prefill_queue: None };

const POOL_ROLES: &[&str] = &["aggregated", "prefill", "decode"];
const POOL_CHOICES: &[&str] = &["seeded", "round-robin"];
const WORKLOAD_MODES: &[&str] = &["timestamps", "concurrency", "rate"];

pub(super) struct Validator<'a> {
    file: &'a Path,
    text: &'a str,
    names: &'a ComponentNames,
    /// The folder holding the graph file: relative paths in it resolve against this.
    base: &'a Path,
    /// Keys whose values came from the command line: their errors say so and name no line, and
    /// their paths are used as given.
    command_line: CommandLineKeys,
}

impl<'a> Validator<'a> {
    pub(super) fn new(file: &'a Path, text: &'a str, names: &'a ComponentNames, command_line: CommandLineKeys) -> Self {
        Validator { file, text, names, base: file.parent().unwrap_or(Path::new("")), command_line }
    }

    fn at(&self, span: Option<Range<usize>>) -> Location {
        Location { file: self.file.to_path_buf(), line: span.map(|span| line_of(self.text, span.start)) }
    }

    fn error(&self, key: &str, span: Option<Range<usize>>, message: impl Into<String>) -> GraphError {
        if self.command_line.contains(key) {
            let at = Location { file: self.file.to_path_buf(), line: None };
            return GraphError::Key {
                at,
                key: key.to_string(),
                message: format!("{} (set on the command line)", message.into()),
            };
        }
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

    /// A path written in the graph, resolved against the graph's folder and written as a person
    /// would type it (`out/quickstart`, not `graphs/../out/quickstart`).
    fn resolve(&self, relative: &str) -> PathBuf {
        lexically_normal(&self.base.join(relative))
    }

    /// The path `key` names: from the command line as given, else [`Self::resolve`]d.
    fn resolve_key(&self, key: &str, path: &str) -> PathBuf {
        if self.command_line.contains(key) {
            PathBuf::from(path)
        } else {
            self.resolve(path)
        }
    }

    pub(super) fn graph(&self, raw: RawGraph) -> Result<Graph, GraphError> {
        let Some(model_path) = &raw.model.path else {
            return Err(self.error(
                "model.path",
                None,
                "missing: every graph names its model (a checkpoint folder or a TOML model spec)",
            ));
        };
        let model = self.checked("model.path", model_path, |path| {
            let expanded = expand_path(&path)?;
            existing_path(self.resolve_key("model.path", &expanded)).map_err(|why| {
                if expanded == path {
                    why
                } else {
                    format!("{why} (expanded from `{path}`)")
                }
            })
        })?;
        let report_dir = self.field("report.out", raw.report.out.as_ref(), self.default_report_dir(), |out| {
            Ok(self.resolve_key("report.out", &out))
        })?;
        let memory = self.memory(&raw.memory, "memory", &DEFAULT_MEMORY)?;
        let mut scheduler = self.scheduler(&raw.scheduler, &raw.memory, "", &DEFAULT_SCHEDULER)?;
        let mut pools = self.pools(&raw.pool, &memory, &scheduler)?;
        if let Some(spanned) = &raw.speculative {
            let spec = self.speculative(spanned)?;
            scheduler.spec = Some(spec);
            for pool in &mut pools {
                pool.scheduler.spec = Some(spec);
            }
        }
        self.roles(&raw.pool, &pools)?;
        let links = self.links(&raw.link, &pools)?;
        self.every_pool_linked(&raw.pool, &pools, &links)?;
        let serve = self.serve(&raw.serve, &model)?;
        Ok(Graph {
            path: self.file.to_path_buf(),
            model,
            transfer: self.transfer(raw.transfer.as_ref(), &links)?,
            faults: self.faults(&raw.faults)?,
            offload: self.offload(raw.offload.as_ref(), &memory)?,
            sampling: self.sampling(&raw.sampling)?,
            pools,
            links,
            memory,
            scheduler,
            workload: self.workload(&raw.workload)?,
            slo: self.slo(&raw.slo)?,
            report_dir,
            report_steps: raw.report.steps.unwrap_or(false),
            serve,
        })
    }

    fn default_report_dir(&self) -> PathBuf {
        let stem = self.file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or("graph".to_string());
        Path::new("out").join(stem)
    }

    /// A `[memory]` table (`key` is `memory` or `pool.memory`) over `base`.
    fn memory(&self, raw: &RawMemory, key: &str, base: &MemoryConfig) -> Result<MemoryConfig, GraphError> {
        Ok(MemoryConfig {
            budget_bytes: self.field(
                &format!("{key}.budget_bytes"),
                raw.budget_bytes.as_ref(),
                base.budget_bytes,
                |v| byte_budget(&v),
            )?,
            block_size: self.field(
                &format!("{key}.block_size"),
                raw.block_size.as_ref(),
                base.block_size,
                token_count,
            )?,
            snapshot_fraction: self.field(
                &format!("{key}.snapshot_fraction"),
                raw.snapshot_fraction.as_ref(),
                base.snapshot_fraction,
                snapshot_fraction,
            )?,
        })
    }

    /// A `[scheduler]` table and its `memory.snapshot_interval_blocks`, over `base`; `prefix` is
    /// `""` for the graph's tables and `"pool."` for a pool's.
    fn scheduler(
        &self,
        raw: &RawScheduler,
        memory: &RawMemory,
        prefix: &str,
        base: &SchedulerConfig,
    ) -> Result<SchedulerConfig, GraphError> {
        let key = |k: &str| format!("{prefix}scheduler.{k}");
        let max_running = self.field(&key("max_running"), raw.max_running.as_ref(), base.max_running, token_count)?;
        let max_batched_tokens = self.field(
            &key("max_batched_tokens"),
            raw.max_batched_tokens.as_ref(),
            base.max_batched_tokens,
            token_count,
        )?;
        let chunk_tokens =
            self.field(&key("chunk_tokens"), raw.chunk_tokens.as_ref(), base.chunk_tokens, token_count)?;
        if chunk_tokens > max_batched_tokens {
            // Blame the key the user wrote: chunk_tokens if set, else the max_batched_tokens that
            // undercuts the inherited chunk.
            let inherited = if prefix.is_empty() { "the default" } else { "from [scheduler] or the default" };
            return Err(match (&raw.chunk_tokens, &raw.max_batched_tokens) {
                (Some(chunk), _) => self.error(
                    &key("chunk_tokens"),
                    Some(chunk.span()),
                    format!("{chunk_tokens} is larger than {} ({max_batched_tokens})", key("max_batched_tokens")),
                ),
                (None, max_batched) => self.error(
                    &key("max_batched_tokens"),
                    max_batched.as_ref().map(Spanned::span),
                    format!(
                        "{max_batched_tokens} is smaller than {} ({chunk_tokens}, {inherited}); lower {} too",
                        key("chunk_tokens"),
                        key("chunk_tokens")
                    ),
                ),
            });
        }
        Ok(SchedulerConfig {
            max_running,
            max_batched_tokens,
            chunk_tokens,
            prefix_cache: raw.prefix_cache.unwrap_or(base.prefix_cache),
            snapshot_interval_blocks: self.field(
                &format!("{prefix}memory.snapshot_interval_blocks"),
                memory.snapshot_interval_blocks.as_ref(),
                base.snapshot_interval_blocks,
                at_least_one,
            )?,
            admission: base.admission,
            spec: base.spec,
        })
    }

    fn pools(
        &self,
        raw: &[Spanned<RawPool>],
        memory: &MemoryConfig,
        scheduler: &SchedulerConfig,
    ) -> Result<Vec<PoolConfig>, GraphError> {
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
            let executor = self.field("pool.executor", pool.executor.as_ref(), DEFAULT_EXECUTOR.to_string(), |e| {
                one_of(&e, &self.names.executors, "executor")
            })?;
            let (pool_memory, pool_scheduler) =
                (pool.memory.clone().unwrap_or_default(), pool.scheduler.clone().unwrap_or_default());
            let expert_parallel = pool.expert_parallel.as_ref().is_some_and(|e| *e.get_ref());
            if let (true, Some(e)) = (expert_parallel, &pool.expert_parallel) {
                if !["cpu", "cuda", "sim"].contains(&executor.as_str()) {
                    return Err(self.error(
                        "pool.expert_parallel",
                        Some(e.span()),
                        format!(
                            "expert_parallel = true runs on the \"cpu\", \"cuda\" and \"sim\" executors (they have \
                             dispatch, experts and combine phases); pool `{name_value}` uses \"{executor}\""
                        ),
                    ));
                }
            }
            let admission =
                self.field("pool.admission", pool.admission.as_ref(), AdmissionPolicy::Optimistic, |a| {
                    AdmissionPolicy::from_name(&a).ok_or_else(|| {
                        format!("`{a}` is not an admission policy; known: {}", quoted_list(AdmissionPolicy::NAMES))
                    })
                })?;
            let ranks = self.field("pool.ranks", pool.ranks.as_ref(), 1, rank_count)?;
            let hosts = match &pool.hosts {
                None => Vec::new(),
                Some(h) => self.checked("pool.hosts", h, |hosts| {
                    if role == PoolRole::Decode && hosts.len() > 1 {
                        return Err(format!(
                            "decode pool `{name_value}` cannot be spread over processes: a handoff lands in the \
                             memory of the one process its link reaches; spread its prefill pool instead, or give it \
                             more ranks in one process"
                        ));
                    }
                    pool_hosts(hosts, ranks)
                })?,
            };
            let mut pool_scheduler_config = self.scheduler(&pool_scheduler, &pool_memory, "pool.", scheduler)?;
            pool_scheduler_config.admission = admission;
            pools.push(PoolConfig {
                role,
                ranks,
                hosts,
                executor_settings: self.executor_settings(&executor, pool.executor_settings.as_ref())?,
                executor,
                router: self.field("pool.router", pool.router.as_ref(), DEFAULT_ROUTER.to_string(), |r| {
                    one_of(&r, &self.names.routers, "router")
                })?,
                memory: self.memory(&pool_memory, "pool.memory", memory)?,
                scheduler: pool_scheduler_config,
                disaggregation: self.disaggregation(&name_value, role, pool.disaggregation.as_ref())?,
                expert_parallel,
                name: name_value,
            });
            name_spans.push(name.span());
        }
        Ok(pools)
    }

    /// A pool's `[pool.disaggregation]`: decode pools only.
    fn disaggregation(
        &self,
        pool: &str,
        role: PoolRole,
        raw: Option<&Spanned<RawDisaggregation>>,
    ) -> Result<DisaggregationConfig, GraphError> {
        let Some(spanned) = raw else { return Ok(DEFAULT_DISAGGREGATION) };
        if role != PoolRole::Decode {
            return Err(self.error(
                "pool.disaggregation",
                Some(spanned.span()),
                format!(
                    "only decode pools take [pool.disaggregation] (when a decode rank has its prefills done \
                     remotely), but pool `{pool}` is {role}"
                ),
            ));
        }
        let raw = spanned.get_ref();
        Ok(DisaggregationConfig {
            remote_prefill_min_tokens: self.field(
                "pool.disaggregation.remote_prefill_min_tokens",
                raw.remote_prefill_min_tokens.as_ref(),
                DEFAULT_DISAGGREGATION.remote_prefill_min_tokens,
                Ok,
            )?,
            max_prefill_queue: self.optional_field(
                "pool.disaggregation.max_prefill_queue",
                raw.max_prefill_queue.as_ref(),
                |queue| at_least_one(queue).map_err(|message| format!("{message} (leave it out for no limit)")),
            )?,
        })
    }

    /// The span of a pool's `role`, or of its header when the role is the default.
    fn role_span(raw: &Spanned<RawPool>) -> Range<usize> {
        raw.get_ref().role.as_ref().map_or(raw.span(), Spanned::span)
    }

    /// A graph is aggregated, or disaggregated with at least one prefill and one decode pool and
    /// no aggregated pool.
    fn roles(&self, raw: &[Spanned<RawPool>], pools: &[PoolConfig]) -> Result<(), GraphError> {
        let linked: Vec<&str> =
            pools.iter().filter(|p| p.role != PoolRole::Aggregated).map(|p| p.name.as_str()).collect();
        if linked.is_empty() {
            return Ok(());
        }
        let first = |role: PoolRole| pools.iter().position(|p| p.role == role);
        if let Some(index) = first(PoolRole::Aggregated) {
            let defaulted = if raw[index].get_ref().role.is_none() { " (the default role)" } else { "" };
            return Err(self.error(
                "pool.role",
                Some(Self::role_span(&raw[index])),
                format!(
                    "pool `{}` is aggregated{defaulted}, but the graph also has prefill and decode pools ({}): a \
                     graph's pools are all aggregated, or all prefill and decode pools joined by [[link]]",
                    pools[index].name,
                    quoted_list(&linked)
                ),
            ));
        }
        match (first(PoolRole::Prefill), first(PoolRole::Decode)) {
            (Some(prefill), None) => Err(self.error(
                "pool.role",
                Some(Self::role_span(&raw[prefill])),
                format!(
                    "prefill pool `{}` has no decode pool to hand off to: a graph with prefill pools needs a pool \
                     with role = \"decode\"",
                    pools[prefill].name
                ),
            )),
            (None, Some(decode)) => Err(self.error(
                "pool.role",
                Some(Self::role_span(&raw[decode])),
                format!(
                    "decode pool `{}` has no prefill pool to take prefills from: a graph with decode pools needs \
                     a pool with role = \"prefill\" (a pool that prefills its own requests is role = \
                     \"aggregated\")",
                    pools[decode].name
                ),
            )),
            _ => Ok(()),
        }
    }

    fn offload(
        &self,
        raw: Option<&Spanned<RawOffload>>,
        memory: &MemoryConfig,
    ) -> Result<Option<OffloadConfig>, GraphError> {
        let Some(spanned) = raw else { return Ok(None) };
        let raw = spanned.get_ref();
        let bs = memory.block_size;
        let chunk_tokens = self.field("offload.chunk_tokens", raw.chunk_tokens.as_ref(), 256, |n| {
            if n == 0 || n % bs != 0 || n > MAX_TOKENS {
                Err(format!(
                    "{n} tokens per chunk; expected a positive multiple of memory.block_size ({bs}), at most {MAX_TOKENS}"
                ))
            } else {
                Ok(n)
            }
        })?;
        let kind = self.field("offload.store", raw.store.as_ref(), "memory".to_string(), |s| {
            if ["memory", "disk", "redis", "sim"].contains(&s.as_str()) {
                Ok(s)
            } else {
                Err(format!("`{s}` is not an offload store; known: `memory`, `disk`, `redis`, `sim`"))
            }
        })?;
        // Keys only some stores take, and which.
        let only = |key: &str, span: Option<std::ops::Range<usize>>, store: &str, what: &str| {
            span.map_or(Ok(()), |span| {
                Err(self.error(key, Some(span), &format!("only the {store} store has {what} (this one is `{kind}`)")))
            })
        };
        if kind != "disk" {
            only("offload.path", raw.path.as_ref().map(|v| v.span()), "disk", "a folder")?;
        }
        if kind != "memory" && kind != "sim" {
            only("offload.capacity_bytes", raw.capacity_bytes.as_ref().map(|v| v.span()), "memory", "a capacity")?;
        }
        if kind != "sim" {
            only("offload.save_gbps", raw.save_gbps.as_ref().map(|v| v.span()), "sim", "a save rate")?;
            only("offload.load_gbps", raw.load_gbps.as_ref().map(|v| v.span()), "sim", "a load rate")?;
            only("offload.latency_us", raw.latency_us.as_ref().map(|v| v.span()), "sim", "a latency")?;
        }
        if kind != "redis" {
            only("offload.url", raw.url.as_ref().map(|v| v.span()), "redis", "a URL")?;
            only("offload.password_env", raw.password_env.as_ref().map(|v| v.span()), "redis", "a password")?;
            only("offload.lease_ms", raw.lease_ms.as_ref().map(|v| v.span()), "redis", "leases")?;
            only("offload.timeout_ms", raw.timeout_ms.as_ref().map(|v| v.span()), "redis", "a timeout")?;
        }
        let store = match kind.as_str() {
            "disk" => {
                let Some(path) = &raw.path else {
                    return Err(self.error(
                        "offload.path",
                        Some(spanned.span()),
                        "missing: store = \"disk\" needs a folder",
                    ));
                };
                OffloadStore::Disk { path: self.resolve(path.get_ref()) }
            }
            "redis" => OffloadStore::Redis(self.redis_store(spanned)?),
            _ => {
                let capacity_bytes =
                    self.field("offload.capacity_bytes", raw.capacity_bytes.as_ref(), 1 << 30, |v| byte_budget(&v))?;
                if kind == "sim" {
                    OffloadStore::Sim(self.sim_store(raw, capacity_bytes)?)
                } else {
                    OffloadStore::Memory { capacity_bytes }
                }
            }
        };
        let max_retries = raw.max_retries.as_ref().map_or(3, |r| *r.get_ref());
        let max_pending_saves = self.field("offload.max_pending_saves", raw.max_pending_saves.as_ref(), 64, |n| {
            if n == 0 {
                Err("0 saves in flight would save nothing; expected at least 1".to_string())
            } else {
                Ok(n)
            }
        })?;
        Ok(Some(OffloadConfig { store, chunk_tokens, max_retries, max_pending_saves }))
    }

    /// `store = "sim"`'s rates: positive and finite, the latency at least 0.
    fn sim_store(&self, raw: &RawOffload, capacity_bytes: u64) -> Result<SimStoreConfig, GraphError> {
        let rate = |gbps: f64| {
            if gbps.is_finite() && gbps > 0.0 {
                Ok(gbps)
            } else {
                Err(format!("{gbps} GB/s; expected a positive rate"))
            }
        };
        let save_gbps = self.field("offload.save_gbps", raw.save_gbps.as_ref(), 8.0, rate)?;
        let load_gbps = self.field("offload.load_gbps", raw.load_gbps.as_ref(), 8.0, rate)?;
        let latency_us = self.field("offload.latency_us", raw.latency_us.as_ref(), 20.0, |us: f64| {
            if us.is_finite() && us >= 0.0 {
                Ok(us)
            } else {
                Err(format!("{us} µs; expected 0 or more"))
            }
        })?;
        Ok(SimStoreConfig { capacity_bytes, save_gbps, load_gbps, latency_us })
    }

    /// `store = "redis"`'s keys: a `redis://` or `rediss://` URL without a password (that comes
    /// from the environment variable `password_env` names), the lease and the timeout.
    fn redis_store(&self, spanned: &Spanned<RawOffload>) -> Result<RedisStoreConfig, GraphError> {
        let raw = spanned.get_ref();
        let Some(url) = &raw.url else {
            return Err(self.error(
                "offload.url",
                Some(spanned.span()),
                "missing: store = \"redis\" needs the server's URL (`redis://127.0.0.1:6379/0`, or `rediss://` for TLS)",
            ));
        };
        let url = self.checked("offload.url", url, |u| {
            let Some(rest) = u.strip_prefix("redis://").or_else(|| u.strip_prefix("rediss://")) else {
                return Err(format!("`{u}` is not a Redis URL; expected `redis://host:port/db` or `rediss://…` (TLS)"));
            };
            let authority = rest.split('/').next().unwrap_or("");
            if authority.rsplit_once('@').is_some_and(|(user, _)| user.contains(':')) {
                return Err("holds a password; a graph never does: put it in an environment variable and name \
                            that in offload.password_env"
                    .to_string());
            }
            if authority.rsplit('@').next().is_none_or(str::is_empty) {
                return Err(format!("`{u}` names no host"));
            }
            Ok(u)
        })?;
        let password_env = self.optional_field("offload.password_env", raw.password_env.as_ref(), |name| {
            if name.is_empty() || name.contains('=') || name.contains('\0') {
                Err(format!("`{name}` is not an environment variable's name"))
            } else {
                Ok(name)
            }
        })?;
        let positive = |what: &'static str| {
            move |ms: u64| if ms == 0 { Err(format!("0 ms; expected a positive {what}")) } else { Ok(ms) }
        };
        let lease_ms = self.field("offload.lease_ms", raw.lease_ms.as_ref(), 3_600_000, positive("lease"))?;
        let timeout_ms = self.field("offload.timeout_ms", raw.timeout_ms.as_ref(), 2_000, positive("timeout"))?;
        Ok(RedisStoreConfig { url, password_env, lease_ms, timeout_ms })
    }

    /// `[speculative]`: the drafter and how many drafts a decode carries; every pool's decodes
    /// draft (a prefill pool's requests never decode, so never draft).
    fn speculative(&self, spanned: &Spanned<RawSpeculative>) -> Result<SpecConfig, GraphError> {
        let raw = spanned.get_ref();
        let drafter =
            self.field("speculative.drafter", raw.drafter.as_ref(), "ngram".to_string(), |d| match d.as_str() {
                "ngram" | "mtp" => Ok(d),
                _ => Err(format!("`{d}` is not a drafter; known: `ngram`, `mtp`")),
            })?;
        let draft_tokens = self.field("speculative.draft_tokens", raw.draft_tokens.as_ref(), 4, |k| {
            if (1..=MAX_DRAFT_TOKENS).contains(&k) {
                Ok(k)
            } else {
                Err(format!("{k} drafts per decode; expected 1 to {MAX_DRAFT_TOKENS}"))
            }
        })?;
        let ngram_min = self.field("speculative.ngram_min", raw.ngram_min.as_ref(), 1, at_least_one)?;
        let ngram_max = self.field("speculative.ngram_max", raw.ngram_max.as_ref(), 3, |n| {
            if n >= ngram_min && n <= 64 {
                Ok(n)
            } else {
                Err(format!("{n}; expected ngram_min ({ngram_min}) to 64"))
            }
        })?;
        Ok(SpecConfig {
            draft_tokens,
            drafter: match drafter.as_str() {
                "mtp" => Drafter::Mtp,
                _ => Drafter::Ngram(NgramDrafter { min_n: ngram_min, max_n: ngram_max }),
            },
            widen_buckets: false,
        })
    }

    /// `[sampling]`: temperature at least 0 (0 is greedy), top_p in (0, 1].
    fn sampling(&self, raw: &RawSampling) -> Result<RequestSampling, GraphError> {
        let temperature = self.field("sampling.temperature", raw.temperature.as_ref(), 0.0, check_temperature)?;
        let top_k = raw.top_k.as_ref().map_or(0, |k| *k.get_ref());
        let top_p = self.field("sampling.top_p", raw.top_p.as_ref(), 1.0, check_top_p)?;
        let params = SamplingParams { temperature, top_k, top_p };
        Ok(RequestSampling { params, seed: raw.seed.unwrap_or(0) })
    }

    /// `[pool.executor_settings]`, checked by the executor it configures.
    fn executor_settings(&self, executor: &str, raw: Option<&Spanned<toml::Table>>) -> Result<toml::Table, GraphError> {
        let Some(raw) = raw else { return Ok(toml::Table::new()) };
        if let Some(kind) = self.names.executor_kinds.get(executor) {
            kind.check(raw.get_ref()).map_err(|e| {
                let key = format!("pool.executor_settings.{}", e.key);
                self.error(&key, Some(raw.span()), format!("{} (executor `{executor}`)", e.message))
            })?;
        }
        Ok(raw.get_ref().clone())
    }

    fn workload(&self, raw: &RawWorkload) -> Result<WorkloadConfig, GraphError> {
        Ok(WorkloadConfig {
            trace: self.optional_field("workload.trace", raw.trace.as_ref(), |t| {
                existing_path(self.resolve_key("workload.trace", &t))
            })?,
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
                token_count,
            )?,
            max_output_tokens: self.optional_field(
                "workload.max_output_tokens",
                raw.max_output_tokens.as_ref(),
                token_count,
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
            cancel_after_ms: self.field("workload.cancel_after_ms", raw.cancel_after_ms.as_ref(), 0.0, milliseconds)?,
            pool_choice: self.field("workload.pool_choice", raw.pool_choice.as_ref(), PoolChoice::Seeded, |c| {
                one_of(&c, POOL_CHOICES, "pool choice").map(|c| {
                    if c == "round-robin" {
                        PoolChoice::RoundRobin
                    } else {
                        PoolChoice::Seeded
                    }
                })
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
                WorkloadMode::Concurrency(self.checked("workload.concurrency", concurrency, token_count)?)
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

    fn serve(&self, raw: &RawServe, model: &Path) -> Result<super::ServeConfig, GraphError> {
        let stem = model.file_stem().map_or("model".to_string(), |s| s.to_string_lossy().into_owned());
        Ok(super::ServeConfig {
            model_name: self.field("serve.model_name", raw.model_name.as_ref(), stem, |name: String| {
                if name.trim().is_empty() {
                    Err("must not be empty".to_string())
                } else {
                    Ok(name)
                }
            })?,
            max_requests: self.field("serve.max_requests", raw.max_requests.as_ref(), 256, token_count)?,
            max_tokens: self.field("serve.max_tokens", raw.max_tokens.as_ref(), 256, token_count)?,
            max_context: self.optional_field("serve.max_context", raw.max_context.as_ref(), token_count)?,
        })
    }

    fn slo(&self, raw: &RawSlo) -> Result<SloConfig, GraphError> {
        Ok(SloConfig {
            ttft_ms: self.optional_field("slo.ttft_ms", raw.ttft_ms.as_ref(), positive_milliseconds)?,
            tpot_ms: self.optional_field("slo.tpot_ms", raw.tpot_ms.as_ref(), positive_milliseconds)?,
        })
    }
}

mod links;
#[cfg(test)]
mod tests;

/// `path` without `.` components and with each `name/..` pair removed, by its text alone (no
/// filesystem access: a `..` after a symlink is taken as written, as a shell's `cd` takes it).
/// A leading `..` stays; an empty result is `.`.
pub(super) fn lexically_normal(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out: Vec<Component> = Vec::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => match out.last() {
                Some(Component::Normal(_)) => {
                    out.pop();
                }
                Some(Component::RootDir | Component::Prefix(_)) => {}
                _ => out.push(part),
            },
            other => out.push(other),
        }
    }
    if out.is_empty() {
        return PathBuf::from(".");
    }
    out.iter().collect()
}
