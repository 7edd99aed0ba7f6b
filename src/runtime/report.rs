//! The run's `report.json`: every top-level field is the run's total over all its pools (a
//! request counts once, when it ends), and `"pools": {NAME: {...}}` holds the same figures per
//! pool beside what only a pool has (its ranks, executor, memory layout, steps, utilization).

use super::collector::{RecordsFile, SharedCollector};
use super::options::RunOptions;
use super::verify::{reference_for, Verifier};
use crate::graph::Graph;
use crate::report::{RunSummary, Slo, VerifySummary};
use kvflow_kernels::models::Model;
use kvflow_operators::policy::memory::MemoryLayout;
use kvflow_operators::rank::{Distribution, RankStats, Utilization};
use serde_json::{json, Map, Value};
use std::time::Duration;

/// What the report says about the run beyond its requests.
pub struct RunContext<'a> {
    pub graph: &'a Graph,
    pub model: &'a Model,
    pub note: Option<String>,
    pub interrupted: bool,
    /// When the interrupt was noticed (ms since the run started).
    pub interrupted_ms: Option<f64>,
    pub grace: Duration,
    pub wall_s: f64,
    /// The run kept a virtual clock (every executor `sim`).
    pub simulated: bool,
    /// Per pool run: name, ranks, memory layout, executor.
    pub pools: &'a [(String, usize, MemoryLayout, String)],
    /// Per pool: the counters of its ranks in this process.
    pub stats: &'a [(String, Vec<RankStats>)],
    /// What the accounting checks found (empty when all is well).
    pub accounting: &'a [String],
    /// Bytes handoffs moved over sockets (tcp links).
    pub socket_bytes: u64,
    /// What the transfer engine counted (`TransferCounters::snapshot`).
    pub transfer: Vec<(&'static str, u64)>,
    /// Per pool under router `kv-aware`: the routing index's last event per rank, and resyncs.
    pub routing_index: Vec<(String, std::collections::BTreeMap<u32, u64>, u64)>,
    /// What went wrong with the offload store, by kind (with an offload tier).
    pub store_faults: Option<kvflow_operators::offload::StoreFaults>,
}

fn memory(layout: &MemoryLayout) -> Value {
    json!({"blocks_per_rank": layout.blocks, "block_size": layout.block_size, "slots_per_rank": layout.slots, "snapshots_per_rank": layout.snapshots})
}

/// Per-rank counters and utilization of some ranks (one pool's, or all).
fn rank_figures(stats: &[&RankStats]) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("utilization".into(), utilization(stats));
    m.insert("steps".into(), json!(stats.iter().map(|s| s.steps).collect::<Vec<_>>()));
    m.insert("empty_steps".into(), json!(stats.iter().map(|s| s.empty_steps).collect::<Vec<_>>()));
    m.insert("steps_held_back".into(), json!(stats.iter().map(|s| s.steps_held_back).collect::<Vec<_>>()));
    m.insert("launched_steps".into(), json!(stats.iter().map(|s| s.launched_steps).collect::<Vec<_>>()));
    m.insert("pool_wakes".into(), json!(stats.iter().map(|s| s.pool_wakes).collect::<Vec<_>>()));
    m.insert("stale_completions".into(), json!(stats.iter().map(|s| s.stale_completions).sum::<u64>()));
    m.insert("stale_releases".into(), json!(stats.iter().map(|s| s.stale_releases).sum::<u64>()));
    m.insert("unknown_completions".into(), json!(stats.iter().map(|s| s.unknown_completions).sum::<u64>()));
    m.insert("accounting_checks".into(), json!(stats.iter().map(|s| s.accounting_checks).collect::<Vec<_>>()));
    m
}

/// One entry per rank of every pool (of every process, for a pool spread over processes): its
/// steps, the steps it launched nothing in, the handoffs it sent and took (and the events it
/// relayed back from a decode pool in another process), the bytes of
/// routed-expert weights it holds, the bytes it sent through expert exchanges (and of them the
/// floats that crossed in host memory), the chunks it
/// saved to and loaded from the offload store, the cache events it reported to the routing
/// index, and the drafts it fed.
fn rank_stats(stats: &[(String, Vec<RankStats>)]) -> Value {
    let entry = |pool: &String, s: &RankStats| {
        json!({"pool": pool, "rank": s.rank, "steps": s.steps, "empty_steps": s.empty_steps,
               "expert_bytes": s.expert_bytes, "exchange_bytes": s.exchange_bytes, "expert_rows": s.expert_rows,
               "exchange_host_bytes": s.exchange_host_bytes,
               "forward_tokens": s.forward_tokens, "handoffs_out": s.handoffs_out, "handoffs_in": s.handoffs_in,
               "relayed_events": s.relayed_events, "index_events": s.index_events,
               "index_offload_events": s.index_offload_events, "index_resyncs": s.index_resyncs, "saved_chunks": s.offload.saved_chunks, "loaded_chunks": s.offload.loaded_chunks,
               "offload_hit_tokens": s.offload.offload_hit_tokens, "proposed_tokens": s.spec.proposed_tokens,
               "drafted_tokens": s.spec.drafted_tokens,
               "handed_off_drafts": s.spec.handed_off_drafts,
               "draft_passes_without_samples": s.spec.draft_passes_without_samples})
    };
    Value::Array(stats.iter().flat_map(|(pool, ranks)| ranks.iter().map(move |s| entry(pool, s))).collect())
}

/// What the offload tier saved and loaded, and the prompt tokens each tier gave back.
fn offload(stats: &[&RankStats]) -> Value {
    let sum = |f: fn(&kvflow_operators::rank::OffloadStats) -> u64| stats.iter().map(|s| f(&s.offload)).sum::<u64>();
    let seconds =
        |f: fn(&kvflow_operators::rank::OffloadStats) -> f64| stats.iter().map(|s| f(&s.offload)).sum::<f64>();
    let rate = |bytes: u64, s: f64| if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 };
    let (saved, loaded) = (sum(|o| o.saved_bytes), sum(|o| o.loaded_bytes));
    json!({
        "offload_hit_tokens": sum(|o| o.offload_hit_tokens),
        "hbm_hit_tokens": sum(|o| o.hbm_hit_tokens),
        "saved_chunks": sum(|o| o.saved_chunks),
        "saved_bytes": saved,
        "loaded_chunks": sum(|o| o.loaded_chunks),
        "loaded_bytes": loaded,
        "save_gb_per_s": rate(saved, seconds(|o| o.save_seconds)),
        "load_gb_per_s": rate(loaded, seconds(|o| o.load_seconds)),
        "dropped_saves": sum(|o| o.dropped_saves),
        "pending_limit_saves": sum(|o| o.pending_limit_saves),
        "found_in_store": sum(|o| o.found_in_store),
        "store_lookups": sum(|o| o.store_lookups),
        "loads": sum(|o| o.loads),
        "failed_loads": sum(|o| o.failed_loads),
        "stale_loads": sum(|o| o.stale_loads),
        "steps_during_loads": sum(|o| o.steps_during_loads),
    })
}

/// Speculative decoding: the share of drafts the verifications kept, and the tokens a
/// verification step gave on average (the drafts it kept and the one after them).
fn spec(stats: &[&RankStats]) -> Value {
    let sum = |f: fn(&kvflow_operators::rank::SpecStats) -> u64| stats.iter().map(|s| f(&s.spec)).sum::<u64>();
    let (steps, drafted, accepted) = (sum(|s| s.verify_steps), sum(|s| s.drafted_tokens), sum(|s| s.accepted_tokens));
    json!({
        "acceptance_rate": if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 },
        "mean_accepted_len": if steps > 0 { (accepted + steps) as f64 / steps as f64 } else { 0.0 },
        "proposed_tokens": sum(|s| s.proposed_tokens),
        "verify_steps": steps,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "handed_off_drafts": sum(|s| s.handed_off_drafts),
        "first_decodes": sum(|s| s.first_decodes),
        "first_decode_drafts": sum(|s| s.first_decode_drafts),
    })
}

/// Writes `steps.jsonl` into `dir` when the run logged its steps (`[report] steps`): a line
/// per launched step of every rank — pool, rank, step, its shape, and when it launched and when
/// its completion was applied, in ms since the run's first launch. Nothing when none logged.
pub fn write_steps(dir: &std::path::Path, stats: &[(String, Vec<RankStats>)]) -> std::io::Result<()> {
    let logged = stats.iter().flat_map(|(pool, ranks)| ranks.iter().map(move |r| (pool, r)));
    let logged: Vec<_> = logged.filter_map(|(pool, r)| r.steps_log.as_ref().map(|l| (pool, r.rank, l))).collect();
    if logged.is_empty() {
        return Ok(());
    }
    let origin = logged.iter().flat_map(|(_, _, l)| l.iter().map(|e| e.launched_ms)).fold(f64::INFINITY, f64::min);
    let mut out = std::io::BufWriter::new(std::fs::File::create(dir.join("steps.jsonl"))?);
    for (pool, rank, log) in logged {
        for e in log {
            let mut line = serde_json::to_value(e).map_err(std::io::Error::other)?;
            line["pool"] = json!(pool);
            line["rank"] = json!(rank);
            line["launched_ms"] = json!(e.launched_ms - origin);
            line["done_ms"] = json!(e.done_ms.map(|d| d - origin));
            std::io::Write::write_all(&mut out, format!("{line}\n").as_bytes())?;
        }
    }
    std::io::Write::flush(&mut out)
}

/// Sets up where the run's records go as its requests end: `requests.jsonl` in the report
/// folder, the report's figures under the graph's SLO, and `--verify`'s checker.
pub fn report_as_requests_end(
    graph: &Graph,
    opts: &RunOptions,
    model: &std::sync::Arc<Model>,
    collector: &SharedCollector,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let file = RecordsFile::create(&graph.report_dir)
        .with_context(|| format!("cannot write requests.jsonl into {}", graph.report_dir.display()))?;
    let verifier = match opts.verify {
        true => Some(Verifier::spawn(model.clone(), reference_for(graph)?, graph.scheduler.chunk_tokens)?),
        false => None,
    };
    let slo = Slo { ttft_ms: graph.slo.ttft_ms, tpot_ms: graph.slo.tpot_ms };
    collector.lock().report_into(Some(file), slo, verifier);
    Ok(())
}

/// The whole report.
pub fn run_report(summary: &RunSummary, verify: &VerifySummary, ctx: &RunContext) -> Value {
    let g = ctx.graph;
    let all_stats: Vec<&RankStats> = ctx.stats.iter().flat_map(|(_, s)| s.iter()).collect();
    let layouts: Vec<MemoryLayout> = ctx.pools.iter().map(|p| p.2).collect();
    let mut extra = json!({
        "pool": ctx.pools.iter().map(|p| p.0.as_str()).collect::<Vec<_>>().join(","),
        "ranks": ctx.pools.iter().map(|p| p.1).sum::<usize>(),
        "model": g.model.display().to_string(),
        "family": ctx.model.family.to_string(),
        "trace": g.workload.trace.as_ref().map(|t| t.display().to_string()),
        "mode": g.workload.mode.name(),
        "note": ctx.note,
        "interrupted": ctx.interrupted,
        "interrupted_ms": ctx.interrupted_ms,
        "grace_s": ctx.grace.as_secs_f64(),
        // A simulated run's length on its virtual clock (its time on this machine would make two
        // runs of one seed differ).
        "wall_s": ctx.wall_s,
        "clock": if ctx.simulated { "virtual" } else { "wall" },
        // One layout when every pool shares it; per pool under "pools" otherwise.
        "memory": if layouts.windows(2).all(|w| w[0] == w[1]) { layouts.first().map(memory) } else { None },
        "accounting_errors": ctx.accounting,
    });
    let top = extra.as_object_mut().expect("an object");
    top.extend(rank_figures(&all_stats));
    top.insert("rank_stats".into(), rank_stats(ctx.stats));
    if !ctx.routing_index.is_empty() {
        let pools: serde_json::Map<String, Value> = ctx
            .routing_index
            .iter()
            .map(|(pool, last, resyncs)| {
                let by_rank: serde_json::Map<String, Value> =
                    last.iter().map(|(r, s)| (r.to_string(), json!(s))).collect();
                (pool.clone(), json!({"last_event_by_rank": by_rank, "resyncs": resyncs}))
            })
            .collect();
        top.insert("routing_index".into(), Value::Object(pools));
    }
    if g.offload.is_some() {
        let mut figures = offload(&all_stats);
        figures["store_faults"] = json!(ctx.store_faults.unwrap_or_default());
        top.insert("offload".into(), figures);
    }
    if g.scheduler.spec.is_some() {
        top.insert("spec".into(), spec(&all_stats));
    }
    let mut pools = Map::new();
    for (name, ranks, layout, executor) in ctx.pools {
        let stats: Vec<&RankStats> = ctx.stats.iter().filter(|(n, _)| n == name).flat_map(|(_, s)| s.iter()).collect();
        let mut figures = json!({"ranks": ranks, "executor": executor, "memory": memory(layout)});
        figures.as_object_mut().expect("an object").extend(rank_figures(&stats));
        if g.offload.is_some() {
            figures.as_object_mut().expect("an object").insert("offload".into(), offload(&stats));
        }
        pools.insert(name.clone(), summary.pool_report(name, &verify.restricted_to(name), figures));
    }
    top.insert("pools".into(), Value::Object(pools));
    if !g.links.is_empty() {
        let backends: Vec<&str> = g.links.iter().map(|l| l.backend.name()).collect();
        let backend = if backends.windows(2).all(|w| w[0] == w[1]) { backends[0].to_string() } else { "mixed".into() };
        top.insert("handoff".into(), handoff(summary, &all_stats, &backend, ctx));
    }
    summary.report(verify, extra)
}

/// What the handoffs of a P/D run moved.
/// Per handoff, its transfer time (T0 sampled → the decode rank took it) and bytes.
fn handoff(summary: &RunSummary, stats: &[&RankStats], backend: &str, ctx: &RunContext) -> Value {
    let h = &summary.handoff;
    let (secs, bytes) = (h.seconds, h.bytes);
    let mut v = json!({
        "backend": backend,
        "count": stats.iter().map(|s| s.handoffs_out).sum::<u64>(),
        "received": stats.iter().map(|s| s.handoffs_in).sum::<u64>(),
        "bytes": stats.iter().map(|s| s.handoff_bytes).sum::<u64>(),
        "socket_bytes": ctx.socket_bytes,
        "saved_bytes": stats.iter().map(|s| s.handoff_saved_bytes).sum::<u64>(),
        "pieces": stats.iter().map(|s| s.pieces_out).sum::<u64>(),
        "pieces_at_launch": stats.iter().map(|s| s.pieces_at_launch).sum::<u64>(),
        "streamed_bytes": stats.iter().map(|s| s.streamed_bytes).sum::<u64>(),
        "streams_dropped": stats.iter().map(|s| s.streams_dropped).sum::<u64>(),
        "local_prefills": stats.iter().map(|s| s.local_prefills).sum::<u64>(),
        "remote_prefills": stats.iter().map(|s| s.remote_prefills).sum::<u64>(),
        "mean_ms": h.transfer.mean(),
        "p99_ms": h.transfer.percentile(99.0),
        "gb_per_s": if secs > 0.0 { bytes as f64 / secs / 1e9 } else { 0.0 },
        "failed": h.failed,
        "stale_acks": stats.iter().map(|s| s.stale_acks).sum::<u64>(),
        "requests_with_t0_from_prefill": h.moved,
    });
    let obj = v.as_object_mut().expect("an object");
    for (name, value) in &ctx.transfer {
        obj.insert(if *name == "failed" { "transfer_failures".into() } else { name.to_string() }, json!(value));
    }
    v
}

/// KV, slot and snapshot utilization and batch size over the run: the per-step distributions
/// of the given ranks pooled together (each `{"p50", "p90", "p99", "mean", "max"}`; the
/// percentiles within 0.1%, the mean and maximum exact).
fn utilization(stats: &[&RankStats]) -> Value {
    let mut pooled = Utilization::default();
    for s in stats {
        pooled.merge(&s.utilization);
    }
    let figures = |d: &Distribution| json!({"p50": d.percentile(50.0), "p90": d.percentile(90.0), "p99": d.percentile(99.0), "mean": d.mean(), "max": d.max()});
    json!({
        "ranks_sampled": stats.len(),
        "steps_sampled": pooled.steps(),
        "kv": figures(&pooled.kv),
        "slots": figures(&pooled.slots),
        "snapshots": figures(&pooled.snapshots),
        "batch_seqs": figures(&pooled.batch_seqs),
        "batch_tokens": figures(&pooled.batch_tokens),
    })
}
