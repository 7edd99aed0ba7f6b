//! The stall watchdog. Each worker of every pool registers timely's own log streams before
//! building its dataflow; one thread on process 0 watches every pool of the run, and when no
//! capability in a pool changes for `--stall-timeout` seconds while requests released into it are
//! pending — or while it is mid-step (an operator past `admit` holds a capability) and the run has
//! requests pending: a prefill pool works for requests its decode pool holds — or, once every
//! request has ended, while the pool has not (it still waits for an ack, an abort or a remote
//! prefill) — it prints who holds that pool back and the run ends with status 3. So does a pool
//! that waits on what the run no longer waits for ([`Awaited`]): a request its ranks hold or await
//! that the collector already saw end (named, with how it ended), or its own end once its ingress
//! is closed (the workload driver is done, or every pool upstream ended) — a server's run never
//! has every request ended, so only this check sees such a pool there.
//!
//! The diagnosis is built from timely's logging, not from kvflow's bookkeeping:
//! - `timely/reachability/u64` (worker 0): the tracker's source pointstamps, i.e. every
//!   capability held anywhere in the pool, per operator, output port and time;
//! - `timely/progress/u64` (worker 0): progress messages received from every worker, whose
//!   capability updates summed per source worker say which rank holds each capability;
//! - `timely` (every local worker): operator names and channels (to tell the operator holding
//!   the pool back from those merely waiting behind it), and park events — a worker whose last
//!   flushed event is not a park and that has flushed nothing for the timeout is stuck inside an
//!   operator (its buffered events never flush).

use super::collector::SharedCollector;
use kvflow_operators::pool::admit::Ingress;
use kvflow_operators::rank::RankGauges;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use timely::logging::{TimelyEvent, TimelyEventBuilder, TimelyProgressEventBuilder};
use timely::progress::reachability::logging::{TrackerEvent, TrackerEventBuilder};
use timely::worker::Worker;

#[derive(Default)]
struct WorkerView {
    /// When this worker last flushed its logs (the end of each of its steps).
    last_flush: Option<Instant>,
    /// Whether its last flushed event was a park (idle, not stuck).
    parked: bool,
}

#[derive(Default)]
struct Seen {
    last_change: Option<Instant>,
    /// Operator names by node index in the pool's dataflow.
    names: HashMap<usize, String>,
    /// Channels: (source node, port) → target node.
    edges: Vec<((usize, usize), usize)>,
    /// Global capability counts from the tracker: (node, port, time) → count.
    capabilities: BTreeMap<(usize, usize, u64), i64>,
    /// Capability updates from progress messages, per source worker: (worker, node, port, time).
    by_worker: HashMap<(usize, usize, usize, u64), i64>,
    workers: BTreeMap<usize, WorkerView>,
}

/// Shared between the workers' loggers and the watchdog thread.
#[derive(Clone, Default)]
pub struct Watch {
    seen: Arc<Mutex<Seen>>,
}

impl Watch {
    /// Registers timely's log streams on a worker; call before it builds its dataflow.
    pub fn register(&self, worker: &mut Worker) {
        let index = worker.index();
        let Some(mut registry) = worker.log_register() else { return };
        let seen = self.seen.clone();
        registry.insert::<TimelyEventBuilder, _>("timely", move |_time, data| {
            let mut s = seen.lock();
            let view = s.workers.entry(index).or_default();
            view.last_flush = Some(Instant::now());
            let Some(events) = data else { return };
            if let Some((_, last)) = events.last() {
                view.parked = matches!(last, TimelyEvent::Park(timely::logging::ParkEvent::Park(_)));
            }
            if index != 0 {
                return;
            }
            for (_, event) in events.iter() {
                match event {
                    TimelyEvent::Operates(op) if op.addr.len() == 2 => {
                        s.names.insert(op.addr[1], op.name.clone());
                    }
                    TimelyEvent::Channels(ch) if ch.scope_addr.len() == 1 => s.edges.push((ch.source, ch.target.0)),
                    _ => {}
                }
            }
        });
        if index != 0 {
            return;
        }
        let seen = self.seen.clone();
        registry.insert::<TrackerEventBuilder<u64>, _>("timely/reachability/u64", move |_time, data| {
            let Some(events) = data else { return };
            let mut s = seen.lock();
            let mut changed = false;
            for (_, event) in events.iter() {
                if let TrackerEvent::SourceUpdate(update) = event {
                    for (node, port, time, diff) in &update.updates {
                        *s.capabilities.entry((*node, *port, *time)).or_default() += diff;
                        changed = true;
                    }
                }
            }
            s.capabilities.retain(|_, c| *c != 0);
            if changed {
                s.last_change = Some(Instant::now());
            }
        });
        let seen = self.seen.clone();
        registry.insert::<TimelyProgressEventBuilder<u64>, _>("timely/progress/u64", move |_time, data| {
            let Some(events) = data else { return };
            let mut s = seen.lock();
            for (_, event) in events.iter().filter(|(_, e)| !e.is_send) {
                for (node, port, time, diff) in &event.internal {
                    *s.by_worker.entry((event.source, *node, *port, *time)).or_default() += diff;
                }
            }
            s.by_worker.retain(|_, c| *c != 0);
        });
    }

    /// When a capability last changed anywhere in the pool.
    fn last_change(&self) -> Option<Instant> {
        self.seen.lock().last_change
    }

    /// Whether the pool is in the middle of a step: an operator other than `admit` (which holds
    /// a parked pool's next step) holds a capability.
    fn mid_step(&self) -> bool {
        let s = self.seen.lock();
        s.capabilities
            .iter()
            .any(|(&(node, _, _), &count)| count > 0 && s.names.get(&node).is_none_or(|n| n != "admit"))
    }

    /// Who holds the pool back, in words.
    pub fn diagnose(&self, stalled_for: Duration, timeout: Duration) -> String {
        let s = self.seen.lock();
        let name = |node: usize| s.names.get(&node).cloned().unwrap_or_else(|| format!("operator #{node}"));
        let mut out = Vec::new();
        for (rank, view) in &s.workers {
            if let (false, Some(last)) = (view.parked, view.last_flush) {
                if last.elapsed() >= timeout {
                    out.push(format!(
                        "  rank {rank} is stuck inside an operator: its step has not returned for {:.1} s",
                        last.elapsed().as_secs_f64()
                    ));
                }
            }
        }
        // Capabilities held now, and by which ranks.
        let held: Vec<(usize, usize, u64)> = s.capabilities.iter().filter(|(_, c)| **c > 0).map(|(k, _)| *k).collect();
        let holders = |node: usize, port: usize, time: u64| -> Vec<usize> {
            let mut ranks: Vec<usize> = s
                .by_worker
                .iter()
                .filter(|((_, n, p, t), c)| *n == node && *p == port && *t == time && **c > 0)
                .map(|((w, ..), _)| *w)
                .collect();
            ranks.sort_unstable();
            ranks.dedup();
            ranks
        };
        // The operator holding the pool back: it holds the earliest time, and is not downstream
        // (through operators that do not advance time) of another holder of that time.
        let earliest = held.iter().map(|h| h.2).min();
        // What a capability on output `port` of `from` holds back: the operators that output
        // feeds, and everything downstream of them.
        let downstream_of = |from: usize, port: usize| -> HashSet<usize> {
            let mut reached = HashSet::new();
            let mut todo: Vec<usize> = s
                .edges
                .iter()
                .filter(|&&((src, p), _)| src == from && p == port)
                .map(|&(_, dst)| dst)
                .filter(|&dst| reached.insert(dst))
                .collect();
            while let Some(n) = todo.pop() {
                for &((src, _), dst) in &s.edges {
                    let advances_time = s.names.get(&src).is_some_and(|n| n.contains("Feedback"));
                    if src == n && !advances_time && reached.insert(dst) {
                        todo.push(dst);
                    }
                }
            }
            reached
        };
        let at_earliest: Vec<&(usize, usize, u64)> = held.iter().filter(|h| Some(h.2) == earliest).collect();
        let blocked: HashSet<usize> = at_earliest.iter().flat_map(|h| downstream_of(h.0, h.1)).collect();
        // `verify`'s sampled output (port 1) holds a step while it is in flight: that is the
        // cause only when nothing else holds the step (with expert parallelism, a step stays in
        // flight until its last `combine`, so a held exchange shows there too).
        let is_in_flight_hold =
            |node: usize, port: usize| port == 1 && s.names.get(&node).is_some_and(|n| n == "verify");
        let others = at_earliest.iter().any(|h| !blocked.contains(&h.0) && !is_in_flight_hold(h.0, h.1));
        for &&(node, port, time) in &at_earliest {
            if blocked.contains(&node) || (others && is_in_flight_hold(node, port)) {
                continue;
            }
            let ranks = holders(node, port, time);
            let who = match ranks.as_slice() {
                [] => "on an unknown rank".to_string(),
                [one] => format!("on rank {one}"),
                many => format!("on ranks {}", many.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")),
            };
            out.push(format!(
                "  holding the pool back: operator `{}` {who} holds step {time} (output {port})",
                name(node)
            ));
        }
        let waiting: Vec<String> = held
            .iter()
            .filter(|h| Some(h.2) != earliest || blocked.contains(&h.0))
            .map(|&(node, port, time)| {
                let ranks = holders(node, port, time);
                format!("`{}` at step {time} (ranks {:?})", name(node), ranks)
            })
            .collect();
        if !waiting.is_empty() {
            out.push(format!("  waiting behind it: {}", waiting.join(", ")));
        }
        if out.is_empty() {
            out.push("  no operator holds a capability: the pool is parked with work pending".into());
        }
        format!(
            "stall: no capability changed for {:.1} s while requests are pending (or the pool waits to end)\n{}",
            stalled_for.as_secs_f64(),
            out.join("\n")
        )
    }
}

/// What a pool may wait on that the run no longer waits for, read beside timely's logs: per pool,
/// its ranks' gauges (the requests each holds or awaits, as its last `schedule` left them) and its
/// ingress; the collector (which requests ended); the pools that ended.
pub struct Awaited {
    pub pools: HashMap<String, (Vec<Arc<RankGauges>>, Arc<Ingress>)>,
    pub collector: SharedCollector,
    pub ended_pools: Arc<Mutex<HashSet<String>>>,
}

impl Awaited {
    /// What pool `pool`, not ended yet, waits on in vain, in words (empty: nothing): each request
    /// its ranks hold or await that the collector saw end, and its own end once its ingress is
    /// closed.
    pub fn in_vain(&self, pool: &str) -> Vec<String> {
        let Some((gauges, ingress)) = self.pools.get(pool) else { return Vec::new() };
        if self.ended_pools.lock().contains(pool) {
            return Vec::new();
        }
        let mut ids: Vec<u64> = gauges.iter().flat_map(|g| g.awaited()).collect();
        ids.sort_unstable();
        ids.dedup();
        let collector = self.collector.lock();
        let mut vain: Vec<String> = ids
            .into_iter()
            .filter_map(|id| collector.end_of(id).map(|end| format!("request {id}, which already ended ({end})")))
            .collect();
        if ingress.is_closed() {
            vain.push(
                "its own end: its ingress is closed (the workload driver is done, or every pool upstream ended)"
                    .to_string(),
            );
        }
        vain
    }
}

/// Watches every pool of a run on a thread: when a pool has requests pending (`pending(Some(name))`)
/// — or is in the middle of a step while the run has requests pending (`pending(None)`: a prefill
/// pool works for requests its decode pool holds), or waits on what the run no longer waits for
/// (`awaited`, unless `None`: [`Awaited::in_vain`]) — and none of its capabilities changed for
/// `timeout`, calls `on_stall` with the diagnosis (the runtime's `pending(Some(name))` also counts
/// a pool that has not ended once every request has) of every such pool (`on_stall` is expected to
/// end the process). Ends when `done` is set.
pub fn spawn_watchdog(
    pools: Vec<(String, Watch)>,
    timeout: Duration,
    pending: impl Fn(Option<&str>) -> usize + Send + 'static,
    awaited: Option<Awaited>,
    done: Arc<std::sync::atomic::AtomicBool>,
    on_stall: impl FnOnce(String) + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("kvflow-watchdog".into()).spawn(move || {
        let started = Instant::now();
        // Per pool: when it was last seen changing (or without pending work), and the change seen.
        let mut quiet: Vec<(Instant, Option<Instant>)> = vec![(Instant::now(), None); pools.len()];
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(100));
            // Quiet pools waited on: (pool, how long quiet, what it waits on in vain).
            let mut quiet_now = Vec::new();
            for ((name, watch), (since, seen)) in pools.iter().zip(quiet.iter_mut()) {
                let change = watch.last_change();
                let in_vain = awaited.as_ref().map_or_else(Vec::new, |a| a.in_vain(name));
                let waited_on =
                    !in_vain.is_empty() || pending(Some(name)) > 0 || (pending(None) > 0 && watch.mid_step());
                if change != *seen || !waited_on {
                    *seen = change;
                    *since = Instant::now();
                    continue;
                }
                quiet_now.push((name, watch, since.elapsed(), in_vain));
            }
            // A pool stalls at the timeout; a pool that waits in vain, or has been quiet for half
            // the timeout, is named beside it even if not quiet as long, since the stalled one may
            // only wait behind it (a decode pool waiting for handoffs a stalled prefill pool
            // withholds; a prefill pool waiting for its decode pool's end), so the diagnosis says
            // what the run waits on.
            let stalls = |quiet_for: Duration| quiet_for >= timeout && started.elapsed() >= timeout;
            let mut stalled = Vec::new();
            if quiet_now.iter().any(|(_, _, quiet_for, _)| stalls(*quiet_for)) {
                for (name, watch, quiet_for, in_vain) in &quiet_now {
                    if *quiet_for < timeout / 2 && in_vain.is_empty() {
                        continue;
                    }
                    let mut text = format!("pool {name}: {}", watch.diagnose(*quiet_for, timeout));
                    for what in in_vain {
                        text.push_str(&format!("\n  pool {name} waits in vain on {what}"));
                    }
                    stalled.push(text);
                }
            }
            if !stalled.is_empty() {
                on_stall(stalled.join("\n"));
                return;
            }
        }
    })
}
