//! Validation: raw → [`Graph`], once. The [`Validator`] checks every value of a [`RawGraph`] with
//! the rules of `rules`, fills in the defaults below and resolves relative paths against the folder
//! holding the graph file; each error names the file, the line of the key and the dotted key.

use std::ops::Range;
use std::path::{Path, PathBuf};

use toml::Spanned;

use super::error::{line_of, quoted_list};
use super::raw::{RawGraph, RawMemory, RawPool, RawScheduler, RawSlo, RawWorkload};
use super::rules::{
    at_least_one, byte_budget, existing_path, measured_limit, more_than_zero, one_of, pool_name, rank_count,
    snapshot_fraction, token_count, zero_or_more,
};
use super::{
    known_trace_formats, ComponentNames, Graph, GraphError, Location, MemoryConfig, PoolChoice, PoolConfig, PoolRole,
    SchedulerConfig, SloConfig, WorkloadConfig, WorkloadMode,
};

const DEFAULT_MEMORY: MemoryConfig = MemoryConfig { budget_bytes: 256 << 20, block_size: 16, snapshot_fraction: 0.25 };
const DEFAULT_SCHEDULER: SchedulerConfig = SchedulerConfig {
    max_running: 64,
    max_batched_tokens: 512,
    chunk_tokens: 64,
    prefix_cache: true,
    snapshot_interval_blocks: 4,
};
const DEFAULT_EXECUTOR: &str = "cpu";
const DEFAULT_ROUTER: &str = "least-outstanding";
const DEFAULT_TRACE_FORMAT: &str = "mooncake";
/// Tokens per hash block in the traces as published (DESIGN §11).
const TRACE_BLOCK_TOKENS: usize = 512;

const POOL_ROLES: &[&str] = &["aggregated", "prefill", "decode"];
const POOL_CHOICES: &[&str] = &["seeded", "round-robin"];
const WORKLOAD_MODES: &[&str] = &["timestamps", "concurrency", "rate"];

pub(super) struct Validator<'a> {
    file: &'a Path,
    text: &'a str,
    names: &'a ComponentNames,
    /// The folder holding the graph file: relative paths in it resolve against this.
    base: &'a Path,
}

impl<'a> Validator<'a> {
    pub(super) fn new(file: &'a Path, text: &'a str, names: &'a ComponentNames) -> Self {
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

    pub(super) fn graph(&self, raw: RawGraph) -> Result<Graph, GraphError> {
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
        let memory = self.memory(&raw.memory, "memory", &DEFAULT_MEMORY)?;
        let scheduler = self.scheduler(&raw.scheduler, &raw.memory, "", &DEFAULT_SCHEDULER)?;
        Ok(Graph {
            path: self.file.to_path_buf(),
            model,
            pools: self.pools(&raw.pool, &memory, &scheduler)?,
            memory,
            scheduler,
            workload: self.workload(&raw.workload)?,
            slo: self.slo(&raw.slo)?,
            report_dir,
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
            pools.push(PoolConfig {
                role,
                ranks: self.field("pool.ranks", pool.ranks.as_ref(), 1, rank_count)?,
                executor_settings: self.executor_settings(&executor, pool.executor_settings.as_ref())?,
                executor,
                router: self.field("pool.router", pool.router.as_ref(), DEFAULT_ROUTER.to_string(), |r| {
                    one_of(&r, &self.names.routers, "router")
                })?,
                memory: self.memory(&pool_memory, "pool.memory", memory)?,
                scheduler: self.scheduler(&pool_scheduler, &pool_memory, "pool.", scheduler)?,
                name: name_value,
            });
            name_spans.push(name.span());
        }
        Ok(pools)
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
            cancel_after_ms: self.field("workload.cancel_after_ms", raw.cancel_after_ms.as_ref(), 0.0, |ms: f64| {
                if ms.is_finite() && ms >= 0.0 {
                    Ok(ms)
                } else {
                    Err(format!("must be a number of milliseconds ≥ 0, got {ms}"))
                }
            })?,
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

    fn slo(&self, raw: &RawSlo) -> Result<SloConfig, GraphError> {
        Ok(SloConfig {
            ttft_ms: self.optional_field("slo.ttft_ms", raw.ttft_ms.as_ref(), more_than_zero)?,
            tpot_ms: self.optional_field("slo.tpot_ms", raw.tpot_ms.as_ref(), more_than_zero)?,
        })
    }
}

#[cfg(test)]
mod tests;
