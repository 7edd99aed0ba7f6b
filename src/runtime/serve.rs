//! Pools joined across processes (`--pools`): a process running only decode pools serves the
//! handoffs its producers send (no workload, no report: its requests' events go back over the
//! links, and its end-of-run check with them); the process driving the workload waits for each
//! remote decode pool to say it is done, and puts what it found in the report. A process of a
//! pool spread over processes that does not drive the workload runs its ranks beside the driving
//! one; in a prefill pool they hand off over this process's own links, and the decode pool's
//! events come back through them (`transfer::relay`).

use super::cluster::ClusterPlace;
use super::links::{self, WireOptions};
use super::options::{RunOptions, RunOutcome, EXIT_ACCOUNTING, EXIT_FAILED_REQUESTS, EXIT_OK};
use super::pool::{check_ranks, start_pool, LinkFigures, PoolJob, PoolResult, RunningPool};
use crate::graph::{Graph, PoolConfig};
use anyhow::{anyhow, bail, Result};
use kvflow_kernels::models::Model;
use kvflow_operators::messages::Event;
use kvflow_operators::pool::admit::Ingress;
use kvflow_operators::pool::emit::EventSink;
use kvflow_operators::transfer::{EventRelay, HandoffInbox, LostProducer, TcpLink};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a process waiting on another says so.
const NOTICE: Duration = Duration::from_secs(10);

/// Events of a request that came by no link (none can: a served pool takes only handoffs).
struct Nowhere;

impl EventSink for Nowhere {
    fn events(&mut self, _step: u64, events: Vec<Event>) {
        tracing::warn!(count = events.len(), "events with nowhere to go: dropped");
    }
}

/// The events sink of a decode pool in another process, for a process that sends none there.
fn nowhere_for(_pool: &str) -> Box<dyn EventSink + Send> {
    Box::new(Nowhere)
}

/// Runs decode pools fed by producers in other processes until every producer link has closed
/// or was lost (or, after a signal, its grace period is over, or none has been connected for the
/// stall timeout), then sends each link the pool's end-of-run check and exits with it: status 2
/// when it lost a producer (whose requests it cancelled, naming them), 4 when the check failed.
pub(super) fn serve_handoffs(
    graph: &Graph,
    opts: &RunOptions,
    pools: &[&PoolConfig],
    jobs: Vec<PoolJob>,
    model: &Model,
) -> Result<RunOutcome> {
    let options = WireOptions {
        endpoints: &opts.endpoints,
        remote_events: &nowhere_for,
        patience: Duration::ZERO,
        deliver_duplicates: opts.switches.deliver_duplicate_handoffs,
        accept_missing_pieces: opts.switches.accept_missing_pieces,
        serve_any_producer: opts.switches.serve_any_producer,
        relay: None,
        clock: None,
    };
    let mut wiring = links::wire(graph, pools, model, &options)?;
    if wiring.served.len() != pools.len() {
        bail!(
            "{}: --pools {}: a process that drives no workload runs only decode pools fed by prefill pools in other \
             processes over tcp links",
            graph.path.display(),
            pools.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(",")
        );
    }
    let mut running = Vec::new();
    for mut job in jobs {
        let name = job.name.clone();
        job.handoff = wiring.handoff.remove(&name).unwrap_or_default();
        let listener = wiring.listener(&name).ok_or_else(|| anyhow!("decode pool {name} has no listener"))?;
        let ingress = wiring.ingress[&name].clone();
        let pool = start_pool(job, Some(ingress.clone()), Some(listener.events_sink()), None)?;
        running.push((name, ingress, pool));
    }
    let lost = serve_producers(graph, opts, &wiring, &running);
    let mut exit_code = if lost.is_empty() { EXIT_OK } else { EXIT_FAILED_REQUESTS };
    for (name, _, pool) in running {
        let result = pool.join();
        let (stats, mut failures) = check_ranks(std::slice::from_ref(&result));
        failures.extend(unclaimed_handoffs(&wiring.inboxes));
        let took: u64 = stats.iter().flat_map(|(_, s)| s.iter()).map(|s| s.handoffs_in).sum();
        let outcome = if failures.is_empty() { Ok(()) } else { Err(failures.join("\n")) };
        for (pool, lost) in lost.iter().filter(|(pool, _)| *pool == name) {
            eprintln!(
                "decode pool `{pool}`: lost the producer link from {}: {} request(s) it handed off failed here \
                 (failure = \"{PRODUCER_LOST}\": cancelled at once, or ended after it went, unheard){}",
                lost.peer,
                lost.requests.len(),
                if lost.requests.is_empty() { String::new() } else { format!(": {:?}", lost.requests) }
            );
        }
        match &outcome {
            Ok(()) => eprintln!("decode pool `{name}`: took {took} handoff(s); every block and slot is free"),
            Err(why) => {
                eprintln!("decode pool `{name}`: end-of-run check failed:\n{why}");
                exit_code = EXIT_ACCOUNTING;
            }
        }
        write_served_report(graph, &name, took, &lost, &outcome);
        if let Some(listener) = wiring.listener(&name) {
            listener.finish(outcome);
        }
    }
    Ok(RunOutcome { report: None, out_dir: graph.report_dir.clone(), exit_code, note: None })
}

/// Runs this process's ranks of a pool spread over processes, another process driving the
/// workload. A prefill pool's ranks hand off over links of this process, relaying the events
/// that come back to the driving process; once the pool has ended, its links close and it
/// waits for the decode pools' end-of-run checks.
pub(super) fn run_beside_driver(
    graph: &Graph,
    opts: &RunOptions,
    place: &ClusterPlace,
    pools: &[&PoolConfig],
    jobs: Vec<PoolJob>,
    model: &Model,
) -> Result<RunOutcome> {
    let relay = Arc::new(EventRelay::default());
    let stall = opts.stall_timeout.unwrap_or(Duration::from_secs(60));
    let options = WireOptions {
        endpoints: &opts.endpoints,
        remote_events: &nowhere_for,
        patience: if stall.is_zero() { Duration::from_secs(3600) } else { stall },
        deliver_duplicates: opts.switches.deliver_duplicate_handoffs,
        accept_missing_pieces: opts.switches.accept_missing_pieces,
        serve_any_producer: opts.switches.serve_any_producer,
        relay: Some(relay),
        clock: None,
    };
    let mut wiring = links::wire(graph, pools, model, &options)?;
    let remote_links = std::mem::take(&mut wiring.remote_links);
    let mut results: Vec<PoolResult> = Vec::new();
    for mut job in jobs {
        job.handoff = wiring.handoff.remove(&job.name).unwrap_or_default();
        job.links_here =
            Some(LinkFigures { socket_bytes: wiring.socket_bytes.clone(), counters: wiring.counters.clone() });
        results.push(start_pool(job, None, None, None)?.join());
    }
    for link in &remote_links {
        link.close();
    }
    if let Some(lost) = results.iter().find_map(|r| r.lost.as_ref()) {
        bail!("{}", lost.message);
    }
    await_remote_pools(&remote_links);
    let (stats, mut failures) = check_ranks(&results);
    failures.extend(remote_failures(&remote_links));
    if !failures.is_empty() {
        bail!("process {}: end-of-run check failed:\n{}", place.process, failures.join("\n"));
    }
    if !remote_links.is_empty() {
        let ranks = || stats.iter().flat_map(|(_, s)| s.iter());
        let handed: u64 = ranks().map(|s| s.handoffs_out).sum();
        let relayed: u64 = ranks().map(|s| s.relayed_events).sum();
        eprintln!(
            "process {}: handed off {handed} request(s) over its own links and relayed {relayed} event(s) of \
             theirs to process 0; every block and slot is free",
            place.process
        );
    }
    Ok(RunOutcome { report: None, out_dir: graph.report_dir.clone(), exit_code: EXIT_OK, note: None })
}

/// How long a producer link whose connections all ended has to reconnect before it counts as
/// lost: a link whose connection dropped reconnects at once, one whose process is gone never.
const RECONNECT_WINDOW: Duration = Duration::from_secs(2);
/// What a served pool allows beyond its grace period, after a signal, for its producers (which
/// drain for theirs) to close their links before it cancels what it still holds.
const INTERRUPT_MARGIN: Duration = Duration::from_secs(2);
/// The failure cause a served pool names for the requests of a producer it lost.
pub const PRODUCER_LOST: &str = "producer-lost";

/// Serves the producers of every running pool until each pool's ingress has closed: every
/// producer link closed (the consumer closes it then), or closed or lost; or, after a signal,
/// its producers gone or its grace period over (what it still holds is cancelled then); or no
/// producer connected for the stall timeout. The producers lost, by pool.
fn serve_producers(
    graph: &Graph,
    opts: &RunOptions,
    wiring: &links::Wiring,
    running: &[(String, Arc<Ingress>, RunningPool)],
) -> Vec<(String, LostProducer)> {
    let stall = opts.stall_timeout.unwrap_or(Duration::from_secs(60));
    let grace = opts.grace.unwrap_or(Duration::from_secs(10)) + INTERRUPT_MARGIN;
    let interrupted = opts.interrupt.clone().unwrap_or_default();
    let (mut noticed, mut unconnected_since, mut interrupted_at) = (Instant::now(), Instant::now(), None);
    let mut lost_all = Vec::new();
    while running.iter().any(|(_, ingress, _)| !ingress.is_closed()) {
        std::thread::sleep(Duration::from_millis(100));
        if interrupted.load(Ordering::SeqCst) && interrupted_at.is_none() {
            interrupted_at = Some(Instant::now());
        }
        for (name, ingress, _) in running {
            let Some(listener) = wiring.listener(name) else { continue };
            let window = if opts.switches.keep_vanished_producers { Duration::MAX } else { RECONNECT_WINDOW };
            for lost in listener.lose_vanished(window) {
                eprintln!(
                    "decode pool `{name}`: the producer link from {} is lost (its connection closed without a close frame \
                     and it did not reconnect within {} s): {} request(s) it handed off failed here, cancelled \
                     or ended unheard (failure = \"{PRODUCER_LOST}\")",
                    lost.peer,
                    RECONNECT_WINDOW.as_secs(),
                    lost.requests.len()
                );
                lost_all.push((name.clone(), lost));
            }
            if ingress.is_closed() {
                continue;
            }
            let (open, closed, lost) = listener.links();
            let expected = links::producer_connections(graph, name);
            let end = |why: String| {
                eprintln!("decode pool `{name}`: {why}");
                listener.stop_taking();
                ingress.close();
            };
            if open > 0 {
                unconnected_since = Instant::now();
            }
            if lost > 0 && closed + lost >= expected {
                end(format!(
                    "every producer link closed or was lost ({closed} closed, {lost} lost); ending once what it \
                     holds is done"
                ));
            } else if interrupted_at.is_some() && open == 0 {
                end("interrupted, and no producer is connected; finishing what it holds".into());
            } else if interrupted_at.is_some_and(|at| at.elapsed() >= grace) {
                let cancelled = listener.cancel_all();
                end(format!(
                    "interrupted {} s ago and its producers have not closed their links; cancelled the {cancelled} \
                     request(s) it still held and ending",
                    grace.as_secs()
                ));
            } else if !stall.is_zero() && open == 0 && unconnected_since.elapsed() >= stall {
                end(format!(
                    "no producer connected for {} s ({closed} of {expected} connection(s) closed); ending \
                     (--stall-timeout)",
                    stall.as_secs()
                ));
            } else if noticed.elapsed() >= NOTICE {
                let waiting = if interrupted_at.is_some() {
                    "interrupted: serving its producers until they close"
                } else {
                    "serving"
                };
                eprintln!(
                    "decode pool `{name}` on {}: {open} producer connection(s) open, {closed} of {expected} \
                     closed; {waiting}",
                    listener.addr()
                );
            }
        }
        if noticed.elapsed() >= NOTICE {
            noticed = Instant::now();
        }
    }
    lost_all
}

/// Writes `served-POOL.json` in the report folder: what decode pool `pool`, served in a process
/// of its own, took, the producers it lost with the requests it failed for each (by cause), and
/// its end-of-run check. (The producers' process writes report.json.) A failure to write it is
/// said, not fatal: the pool has ended and its producers were told.
fn write_served_report(
    graph: &Graph,
    pool: &str,
    took: u64,
    lost: &[(String, LostProducer)],
    outcome: &Result<(), String>,
) {
    let lost: Vec<serde_json::Value> = lost
        .iter()
        .filter(|(p, _)| p == pool)
        .map(|(_, l)| {
            serde_json::json!({"address": l.peer.to_string(), "failure": PRODUCER_LOST, "requests": l.requests})
        })
        .collect();
    let report = serde_json::json!({
        "pool": pool,
        "handoffs_taken": took,
        "producers_lost": lost,
        "end_of_run_check": outcome.as_ref().err(),
    });
    let path = graph.report_dir.join(format!("served-{pool}.json"));
    let written = std::fs::create_dir_all(&graph.report_dir)
        .and_then(|()| std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap_or_default()));
    if let Err(e) = written {
        eprintln!("decode pool `{pool}`: cannot write {}: {e}", path.display());
    }
}

/// Handoffs left in a decode pool's inbox at the end: neither taken nor aborted.
pub(super) fn unclaimed_handoffs(inboxes: &[(String, Arc<HandoffInbox>)]) -> Vec<String> {
    inboxes
        .iter()
        .filter(|(_, inbox)| !inbox.is_empty())
        .map(|(name, inbox)| {
            format!("decode pool {name}: {} handoff(s) arrived and were never taken or aborted", inbox.len())
        })
        .collect()
}

/// Waits until every decode pool in another process is done with its link (it sent its
/// end-of-run check, or it is gone), saying so every 10 s.
pub(super) fn await_remote_pools(links: &[Arc<TcpLink>]) {
    let started = Instant::now();
    let mut noticed = Instant::now();
    while links.iter().any(|l| !l.finished()) {
        std::thread::sleep(Duration::from_millis(20));
        if noticed.elapsed() >= NOTICE {
            for l in links.iter().filter(|l| !l.finished()) {
                eprintln!(
                    "waited {} s for decode pool `{}` at {} to finish its requests",
                    started.elapsed().as_secs(),
                    l.to(),
                    l.addr()
                );
            }
            noticed = Instant::now();
        }
    }
}

/// What remote decode pools' end-of-run checks found.
pub(super) fn remote_failures(links: &[Arc<TcpLink>]) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    links
        .iter()
        .filter(|l| seen.insert(l.to().to_string()))
        .filter_map(|l| match l.remote_outcome() {
            Some(Err(why)) => Some(format!("decode pool {} (at {}): {why}", l.to(), l.addr())),
            _ => None,
        })
        .collect()
}
