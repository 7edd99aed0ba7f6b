//! The last phase of `kvflow run` ([`super::run`]): joins the pools, the collector, the watchdog
//! and what released the requests; checks every rank's accounting (and the decode pools' in
//! other processes); waits for `--verify` to check the last requests; ends `requests.jsonl` and
//! writes `report.json` from the figures the collector folded as requests ended; and says how the
//! run went in its exit status.

use super::options::{RunOptions, RunOutcome, EXIT_ACCOUNTING, EXIT_FAILED_REQUESTS, EXIT_OK, EXIT_VERIFY_MISMATCH};
use super::pool::{check_ranks, LinkTotals, PoolResult};
use super::report::{run_report, write_steps, RunContext};
use super::serve;
use super::start::{RunThreads, Running};
use crate::graph::Graph;
use crate::report::write_report;
use anyhow::{anyhow, Context, Result};
use kvflow_operators::transfer::TcpLink;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Waits for the run to end, checks and reports it.
pub fn finish(graph: &Graph, opts: &RunOptions, running: Running, started: Instant) -> Result<RunOutcome> {
    let Running { model, layouts, note, collector, threads, kv_sampler, interrupted, links, store, clock } = running;
    let results = join_all(threads, &links.remote_links)?;
    let (stats, mut accounting) = check_ranks(&results);
    accounting.extend(serve::unclaimed_handoffs(&links.inboxes));
    accounting.extend(serve::remote_failures(&links.remote_links));
    let (summary, interrupted_ms, verifier) = {
        let mut c = collector.lock();
        let summary = c.finish().with_context(|| "cannot write requests.jsonl".to_string())?;
        (summary, c.interrupted_ms, c.take_verifier())
    };
    // A run whose end-of-run check failed reports no verification (as one that did not verify).
    let verify = match verifier {
        Some(verifier) => {
            if opts.show_progress {
                eprintln!("--verify: checking the last requests on the reference path");
            }
            verifier.finish(accounting.is_empty())?
        }
        None => Default::default(),
    };
    // A spread pool's other processes: what their links moved.
    let mut elsewhere = LinkTotals::default();
    for r in &results {
        elsewhere.add(&r.links_elsewhere);
    }
    let context = RunContext {
        graph,
        model: &model,
        note: note.clone(),
        interrupted: interrupted.load(Ordering::SeqCst),
        interrupted_ms,
        grace: opts.grace.unwrap_or(Duration::from_secs(10)),
        wall_s: clock.as_ref().map_or(started.elapsed().as_secs_f64(), |c| c.now_ms() / 1e3),
        simulated: clock.is_some(),
        pools: &layouts,
        stats: &stats,
        accounting: &accounting,
        socket_bytes: links.socket_bytes.load(Ordering::Relaxed) + elsewhere.socket_bytes,
        transfer: links
            .counters
            .snapshot()
            .iter()
            .zip(elsewhere.counters)
            .map(|(&(name, here), there)| (name, here + there))
            .collect(),
        routing_index: results
            .iter()
            .filter_map(|r| r.routing_index.clone().map(|(last, resyncs)| (r.name.clone(), last, resyncs)))
            .collect(),
        store_faults: store.as_ref().map(|s| s.faults()),
    };
    let mut report = run_report(&summary, &verify, &context);
    report["kv_usage"] = kv_sampler.join().map_err(|_| anyhow!("the KV sampler panicked"))?.into();
    write_report(&graph.report_dir, &report)
        .with_context(|| format!("cannot write the report into {}", graph.report_dir.display()))?;
    write_steps(&graph.report_dir, &stats)
        .with_context(|| format!("cannot write steps.jsonl into {}", graph.report_dir.display()))?;
    if !accounting.is_empty() {
        eprintln!("end-of-run check failed:\n{}", accounting.join("\n"));
    }
    let exit_code = exit_code(&report, summary.warmup_failed, &accounting, verify.mismatched);
    drop(links); // the listeners live until the run is over
    Ok(RunOutcome { report: Some(report), out_dir: graph.report_dir.clone(), exit_code, note })
}

/// Joins the pools (each through its joiner), then what waited on them: the decode pools in
/// other processes, the collector, the watchdog and what released the requests.
fn join_all(threads: RunThreads, remote_links: &[Arc<TcpLink>]) -> Result<Vec<PoolResult>> {
    let mut results = Vec::new();
    for j in threads.joiners {
        results.push(j.join().map_err(|_| anyhow!("a pool's joiner thread panicked"))?);
    }
    serve::await_remote_pools(remote_links);
    threads.collector.join().map_err(|_| anyhow!("the collector thread panicked"))?;
    threads.finished.store(true, Ordering::SeqCst);
    if let Some(w) = threads.watchdog {
        let _ = w.join();
    }
    threads.releaser.join().map_err(|_| anyhow!("the workload driver panicked"))?;
    Ok(results)
}

/// The run's exit status: an accounting failure first, then `--verify` mismatches, then failed
/// requests (warmup ones included; cancelled ones are not failures).
fn exit_code(report: &serde_json::Value, warmup_failed: usize, accounting: &[String], mismatched: usize) -> i32 {
    let failed = report["failed"].as_u64().unwrap_or(0) + warmup_failed as u64;
    if !accounting.is_empty() {
        EXIT_ACCOUNTING
    } else if mismatched > 0 {
        EXIT_VERIFY_MISMATCH
    } else if failed > 0 {
        EXIT_FAILED_REQUESTS
    } else {
        EXIT_OK
    }
}
