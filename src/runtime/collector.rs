//! The run's results on process 0, for every pool of the run: the workload driver records each
//! release (and the pool it entered), every pool's `emit` delivers each request's end (with the
//! times its rank stamped on every token, on the clock all processes share), and a collector
//! thread turns them into records, tells the driver which requests completed, and drives the
//! progress bar. A request counts once, when it ends.

use crate::report::RequestRecord;
use indicatif::{ProgressBar, ProgressStyle};
use kvflow_operators::messages::{wall_ms, Event};
use kvflow_operators::pool::emit::EventSink;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::mpsc::Sender;
use std::sync::Arc;

pub struct Collector {
    /// `wall_ms` when the run started: record times are relative to it.
    start_ms: f64,
    requests: HashMap<u64, RequestRecord>,
    completions: Sender<u64>,
    bar: ProgressBar,
    tokens: u64,
    /// When the run was interrupted (ms since it started), if it was.
    pub interrupted_ms: Option<f64>,
    /// Requests the workload holds (the driver releases each once).
    total: usize,
    /// Pools that ended under a failure, with its cause and message: what is released into one
    /// later fails at once with them.
    ended: HashMap<String, (String, String)>,
    /// Who waits on a request as it runs (`kvflow serve`'s client connections).
    watchers: HashMap<u64, Watcher>,
}

/// What a request's watcher hears: its tokens as they stream out (`offset` is the index of the
/// first among its outputs; events of two pools may arrive out of order), then its record.
#[derive(Debug)]
pub enum Progress {
    Tokens { offset: usize, tokens: Vec<u32> },
    Ended(Box<RequestRecord>),
}

/// Called on the collector thread for each of a request's [`Progress`]; must not block.
pub type Watcher = Box<dyn FnMut(Progress) + Send>;

/// The collector, shared by the driver thread and the collector thread.
pub type SharedCollector = Arc<Mutex<Collector>>;

impl Collector {
    pub fn new(total: usize, completions: Sender<u64>, show_progress: bool) -> SharedCollector {
        let bar = if show_progress { ProgressBar::new(total as u64) } else { ProgressBar::hidden() };
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} requests  {msg}  {elapsed}").expect("valid template"),
        );
        Arc::new(Mutex::new(Collector {
            start_ms: wall_ms(),
            requests: HashMap::new(),
            completions,
            bar,
            tokens: 0,
            interrupted_ms: None,
            ended: HashMap::new(),
            watchers: HashMap::new(),
            total,
        }))
    }

    /// Notes that the run was interrupted now.
    pub fn interrupted_now(&mut self) {
        self.interrupted_ms.get_or_insert(wall_ms() - self.start_ms);
    }

    /// The driver released a request into `pool`.
    pub fn released(&mut self, id: u64, pool: &str, prompt: &[u32], max_output_tokens: usize, warmup: bool) {
        let record = RequestRecord {
            id,
            warmup,
            arrival_ms: wall_ms() - self.start_ms,
            input_len: prompt.len(),
            output_len: max_output_tokens,
            pool: pool.to_string(),
            pools: vec![pool.to_string()],
            prompt_tokens: prompt.to_vec(),
            ..Default::default()
        };
        self.requests.insert(id, record);
        if let Some((cause, message)) = self.ended.get(pool).cloned() {
            self.fail_open(pool, &cause, &message);
        }
    }

    /// Has `watcher` hear request `id`'s progress (call it before releasing the request).
    pub fn watch(&mut self, id: u64, watcher: Watcher) {
        self.watchers.insert(id, watcher);
    }

    /// Records a request's end, reported by `pool`.
    pub fn apply(&mut self, pool: &str, event: Event) {
        let id = event.id();
        if let Event::Tokens { offset, tokens, .. } = event {
            if let Some(watcher) = self.watchers.get_mut(&id) {
                watcher(Progress::Tokens { offset, tokens });
            }
            return;
        }
        let start = self.start_ms;
        let Some(r) = self.requests.get_mut(&id) else {
            tracing::warn!(pool, request = id, "event for a request that was never released: dropped");
            return;
        };
        if let Event::HandedOff { rank, to, started_ms, t0_ms, bytes, preemptions, .. } = &event {
            r.prefill_rank = Some(*rank);
            // It moved on (the decode pool may even have reported its end already); a request
            // that entered its decode pool first lists the prefill pool before it.
            if !r.pools.iter().any(|p| p == pool) {
                let at = r.pools.iter().position(|p| p == to).unwrap_or(r.pools.len());
                r.pools.insert(at, pool.to_string());
            }
            if !r.pools.iter().any(|p| p == to) {
                r.pools.push(to.clone());
            }
            r.prefill_started_ms = Some(started_ms - start);
            r.t0_ms = Some(t0_ms - start);
            r.handoff_bytes = *bytes;
            // The prefill side's preemptions, added to the decode side's (now, if that ended first).
            r.prefill_preemptions = *preemptions;
            if r.ended_ms.is_some() {
                r.preemptions += *preemptions;
            }
            return;
        }
        if let Event::Received { taken_ms, .. } = &event {
            r.received_ms = Some(taken_ms - start);
            return;
        }
        if r.ended_ms.is_some() {
            tracing::warn!(pool, request = id, "second end for a request: dropped");
            return;
        }
        if !r.pools.iter().any(|p| p == pool) {
            r.pools.push(pool.to_string());
        }
        r.ended_ms = Some(wall_ms() - start);
        let (tokens, times, started_ms) = match event {
            Event::Finished {
                rank, tokens, token_times, started_ms, cached_tokens, logits_hash, preemptions, ..
            } => {
                r.rank = Some(rank);
                r.cached_tokens = cached_tokens;
                r.logits_hash = logits_hash;
                r.preemptions = preemptions + r.prefill_preemptions;
                r.done_ms = token_times.last.map(|t| t - start);
                (tokens, token_times, Some(started_ms))
            }
            Event::Failed { rank, cause, message, tokens, token_times, started_ms, .. } => {
                r.rank = (rank != usize::MAX).then_some(rank);
                r.error = Some(message);
                r.failure = Some(cause);
                (tokens, token_times, started_ms)
            }
            Event::HandedOff { .. } | Event::Received { .. } | Event::Tokens { .. } => unreachable!("handled above"),
        };
        let arrival = r.arrival_ms;
        r.queue_ms = started_ms.map(|s| s - start - arrival);
        r.ttft_ms = times.first.map(|f| f - start - arrival);
        // The TTFT split: T0 in hand on the decoding rank is when it took the handoff (P/D),
        // or when it sampled T0 (aggregated).
        let t0 = times.first.map(|f| f - start);
        let started = started_ms.map(|s| s - start);
        r.prefill_ms = started.zip(t0).map(|(s, f)| f - s);
        let in_hand = if r.t0_ms.is_some() { r.received_ms } else { t0 };
        r.transfer_ms = if r.t0_ms.is_some() { t0.zip(r.received_ms).map(|(f, got)| got - f) } else { Some(0.0) };
        r.first_decode_ms = in_hand.zip(times.second.map(|s| s - start)).map(|(h, s)| s - h);
        r.e2e_ms = times.last.map(|l| l - start - arrival);
        r.tpot_ms = match (times.first, times.last) {
            (Some(f), Some(l)) if tokens.len() > 1 => Some((l - f) / (tokens.len() - 1) as f64),
            _ => None,
        };
        self.tokens += tokens.len() as u64;
        r.output_tokens = tokens;
        if let Some(mut watcher) = self.watchers.remove(&id) {
            watcher(Progress::Ended(Box::new(r.clone())));
        }
        self.bar.inc(1);
        let secs = ((wall_ms() - start) / 1000.0).max(1e-9);
        self.bar.set_message(format!("{:.0} tokens/s", self.tokens as f64 / secs));
        // The driver may be gone (stopped); nothing to tell then.
        let _ = self.completions.send(id);
    }

    /// `wall_ms` when the run started: record times are relative to it.
    pub fn start_ms(&self) -> f64 {
        self.start_ms
    }

    /// No request is released after this one (a server that stopped taking requests): the
    /// requests released so far are all the run has.
    pub fn no_more_releases(&mut self) {
        self.total = self.requests.len();
    }

    /// Pools that ended under a failure, with its message (what is released into one fails).
    pub fn failed_pools(&self) -> Vec<(String, String)> {
        self.ended.iter().map(|(pool, (_, message))| (pool.clone(), message.clone())).collect()
    }

    /// Every request's record so far (ended or not).
    pub fn records(&self) -> impl Iterator<Item = &RequestRecord> {
        self.requests.values()
    }

    /// How many requests released have not ended yet.
    pub fn open_count(&self) -> usize {
        self.requests.values().filter(|r| r.ended_ms.is_none()).count()
    }

    /// How request `id` ended, in words, once it has (`None`: not ended, or never released).
    pub fn end_of(&self, id: u64) -> Option<String> {
        let r = self.requests.get(&id).filter(|r| r.ended_ms.is_some())?;
        Some(match (&r.failure, &r.error) {
            (Some(cause), Some(message)) => format!("failed with {cause}: {message}"),
            _ => "completed".to_string(),
        })
    }

    /// Requests released that have not ended yet.
    pub fn in_flight(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.requests.values().filter(|r| r.ended_ms.is_none()).map(|r| r.id).collect();
        ids.sort_unstable();
        ids
    }

    /// How many requests released into `pool` have not ended yet.
    /// Every request of the workload was released and has ended.
    pub fn all_ended(&self) -> bool {
        self.requests.len() >= self.total && self.requests.values().all(|r| r.ended_ms.is_some())
    }

    pub fn in_flight_in(&self, pool: &str) -> usize {
        self.requests.values().filter(|r| r.ended_ms.is_none() && r.pools.last().is_some_and(|p| p == pool)).count()
    }

    /// Ends request `id`, released into `pool`, before it entered the pool: it was refused at
    /// the door (`cause`, `message` say why).
    pub fn refuse(&mut self, id: u64, pool: &str, cause: &str, message: String) {
        self.apply(pool, failed_here(id, cause, message));
    }

    /// Ends every request still open in `pool` with `cause` (the pool's computation ended
    /// without reporting them), so no request is silently dropped and the driver stops waiting.
    pub fn fail_open(&mut self, pool: &str, cause: &str, message: &str) {
        self.ended.insert(pool.to_string(), (cause.to_string(), message.to_string()));
        let open = self.open_where(|r| r.pools.last().is_some_and(|p| p == pool));
        for id in open {
            self.apply(pool, failed_here(id, cause, message.into()));
        }
    }

    /// Ends every request still open that a rank of prefill pool `pool` other than `kept`
    /// handed off: the decode pool's events for it came back through that rank's process, now
    /// gone with the pool (`transfer::relay`).
    pub fn fail_relayed(&mut self, pool: &str, kept: std::ops::Range<usize>, cause: &str, message: &str) {
        let open = self.open_where(|r| {
            r.pools.iter().any(|p| p == pool) && r.prefill_rank.is_some_and(|rank| !kept.contains(&rank))
        });
        let message = format!("{message}; its decode pool's events came back through that process");
        for id in open {
            self.apply(pool, failed_here(id, cause, message.clone()));
        }
    }

    /// The requests not ended yet that `pick` picks.
    fn open_where(&self, pick: impl Fn(&RequestRecord) -> bool) -> Vec<u64> {
        self.requests.values().filter(|r| r.ended_ms.is_none() && pick(r)).map(|r| r.id).collect()
    }

    /// Every request's record, in id order, and ends the progress bar.
    pub fn finish(&mut self) -> Vec<RequestRecord> {
        self.bar.finish_and_clear();
        let mut records: Vec<RequestRecord> = self.requests.drain().map(|(_, r)| r).collect();
        records.sort_by_key(|r| r.id);
        records
    }
}

/// The end of a request the run failed itself (no rank reported it).
fn failed_here(id: u64, cause: &str, message: String) -> Event {
    Event::Failed {
        id,
        rank: usize::MAX,
        cause: cause.into(),
        message,
        tokens: Vec::new(),
        token_times: Default::default(),
        started_ms: None,
    }
}

/// A batch of one pool's events.
pub type EventBatch = (Arc<str>, Vec<Event>);

/// A pool's `emit` sink on its worker 0: hands each batch, named by its pool, to the collector
/// thread, so the worker goes straight back to the step loop.
pub struct CollectorSink {
    pub pool: Arc<str>,
    pub batches: Sender<EventBatch>,
}

impl EventSink for CollectorSink {
    fn events(&mut self, _step: u64, events: Vec<Event>) {
        // The collector thread outlives the workers; a failed send means the run is ending.
        let _ = self.batches.send((self.pool.clone(), events));
    }
}

/// Applies every batch the pools' `emit`s send until every sender is gone.
pub fn spawn_collector_thread(
    collector: SharedCollector,
) -> std::io::Result<(Sender<EventBatch>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = std::sync::mpsc::channel::<EventBatch>();
    let handle = std::thread::Builder::new().name("kvflow-collector".into()).spawn(move || {
        for (pool, events) in rx {
            let mut c = collector.lock();
            for e in events {
                c.apply(&pool, e);
            }
        }
    })?;
    Ok((tx, handle))
}
