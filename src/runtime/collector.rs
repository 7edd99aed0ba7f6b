//! The run's results on process 0, for every pool of the run: the workload driver records each
//! release (and the pool it entered), every pool's `emit` delivers each request's end (with the
//! times its rank stamped on every token, on the clock all processes share), and a collector
//! thread turns them into records, tells the driver which requests completed, and drives the
//! progress bar. A request counts once, when it ends.
//!
//! A record lives here only while its request is in flight: when the request ends it is written
//! to `requests.jsonl` ([`RecordsFile`]), folded into the report's figures ([`RunSummary`]) and
//! `/metrics`' ([`MetricsTally`]), handed to `--verify`'s checker, and dropped — so what the
//! collector holds is bounded by the requests in flight, not by those served. (One exception, for
//! the order of a P/D request's events: a request whose decode pool reported its end before its
//! prefill pool reported the handoff waits for that report.)

use super::verify::{Verifier, VerifyItem};
use crate::report::{MetricsTally, RequestRecord, RunSummary};
use indicatif::{ProgressBar, ProgressStyle};
use kvflow_kernels::cpu::sampling::RequestSampling;
use kvflow_operators::messages::{wall_ms, Event};
use kvflow_operators::pool::emit::EventSink;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::sync::Arc;

/// A request in flight: its record so far and how it samples (for `--verify`).
struct Open {
    record: RequestRecord,
    sampling: RequestSampling,
}

/// How many ends [`Collector::end_of`] remembers: far more than end within a stall timeout on
/// any pool this runtime drives, a few hundred KB at most.
pub const RECENT_ENDS: usize = 8192;

pub struct Collector {
    /// `wall_ms` when the run started: record times are relative to it.
    start_ms: f64,
    /// Requests released that have not ended.
    open: HashMap<u64, Open>,
    /// Requests ended whose prefill pool's handoff report is still to come (their decode pool
    /// took the handoff and reported the end first).
    awaiting_handoff: HashMap<u64, Open>,
    /// Requests released so far.
    released: usize,
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
    /// The report's figures over the requests ended so far.
    summary: RunSummary,
    /// `/metrics`' counters and histograms, kept as requests are released, hand off and end.
    metrics: MetricsTally,
    /// Where ended records go (none in a run that writes no report).
    file: Option<RecordsFile>,
    /// The last [`RECENT_ENDS`] requests that ended, with how (in words), oldest first: what the
    /// stall watchdog asks of a request a pool still waits on, in memory bounded however long
    /// the run.
    recent_ends: VecDeque<u64>,
    /// How each of `recent_ends` ended.
    how_ended: HashMap<u64, String>,
    /// `--verify`'s checker, when the run verifies.
    verifier: Option<Verifier>,
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
            open: HashMap::new(),
            awaiting_handoff: HashMap::new(),
            released: 0,
            completions,
            bar,
            tokens: 0,
            interrupted_ms: None,
            ended: HashMap::new(),
            watchers: HashMap::new(),
            total,
            summary: RunSummary::default(),
            metrics: MetricsTally::default(),
            file: None,
            verifier: None,
            recent_ends: VecDeque::new(),
            how_ended: HashMap::new(),
        }))
    }

    /// Writes each ended request's record into `file`, counts it against `slo` and has
    /// `verifier` check it (call before the first release).
    pub fn report_into(&mut self, file: Option<RecordsFile>, slo: crate::report::Slo, verifier: Option<Verifier>) {
        self.file = file;
        self.summary = RunSummary::new(slo);
        self.verifier = verifier;
    }

    /// Times count from the virtual clock's start (a simulated run: `wall_ms` reads the virtual
    /// time on the thread that steps it, where this collector's events are applied).
    pub fn on_virtual_clock(&mut self) {
        self.start_ms = 0.0;
    }

    /// Notes that the run was interrupted now.
    pub fn interrupted_now(&mut self) {
        self.interrupted_ms.get_or_insert(wall_ms() - self.start_ms);
    }

    /// The driver released a request into `pool`; it samples with `sampling` (`--verify`
    /// replays it so).
    pub fn released(
        &mut self,
        id: u64,
        pool: &str,
        prompt: &[u32],
        max_output_tokens: usize,
        warmup: bool,
        sampling: RequestSampling,
    ) {
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
        self.metrics.released(&record);
        self.open.insert(id, Open { record, sampling });
        self.released += 1;
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
        match event {
            Event::Tokens { offset, tokens, .. } => {
                if let Some(watcher) = self.watchers.get_mut(&id) {
                    watcher(Progress::Tokens { offset, tokens });
                }
            }
            Event::HandedOff { rank, to, started_ms, t0_ms, bytes, preemptions, .. } => {
                let handoff = Handoff { rank, to, started_ms, t0_ms, bytes, preemptions };
                self.handed_off(pool, id, handoff);
            }
            Event::Received { taken_ms, overlapped_ms, .. } => {
                let start = self.start_ms;
                let Some(open) = self.open.get_mut(&id) else {
                    return tracing::warn!(pool, request = id, "handoff taken for a request not in flight: dropped");
                };
                let r = &mut open.record;
                r.received_ms = Some(taken_ms - start);
                r.transfer_overlapped_ms = Some(overlapped_ms);
                if let Some(t0) = r.t0_ms {
                    self.metrics.transferred(r.warmup, taken_ms - start - t0);
                }
            }
            Event::Finished { .. } | Event::Failed { .. } => self.end(pool, id, event),
        }
    }

    /// A prefill pool handed request `id` off: it moved on to the decode pool `to` (which may even
    /// have reported its end already).
    fn handed_off(&mut self, pool: &str, id: u64, h: Handoff) {
        let start = self.start_ms;
        let Some(open) = self.open.get_mut(&id).or_else(|| self.awaiting_handoff.get_mut(&id)) else {
            // A request its decode pool ended (failed, cancelled) before taking this handoff.
            return tracing::debug!(pool, request = id, "handoff of a request already ended: not recorded");
        };
        let r = &mut open.record;
        r.prefill_rank = Some(h.rank);
        // A request that entered its decode pool first lists the prefill pool before it.
        if !r.pools.iter().any(|p| p == pool) {
            let at = r.pools.iter().position(|p| *p == h.to).unwrap_or(r.pools.len());
            r.pools.insert(at, pool.to_string());
        }
        if !r.pools.iter().any(|p| *p == h.to) {
            r.pools.push(h.to);
        }
        r.prefill_started_ms = Some(h.started_ms - start);
        let first = r.t0_ms.is_none();
        r.t0_ms = Some(h.t0_ms - start);
        r.handoff_bytes = h.bytes;
        if first {
            self.metrics.handed_off(r.warmup, h.bytes);
            if let Some(received) = r.received_ms {
                self.metrics.transferred(r.warmup, received - (h.t0_ms - start));
            }
        }
        // The prefill side's preemptions, added to the decode side's (now, if that ended first).
        r.prefill_preemptions = h.preemptions;
        if r.ended_ms.is_some() {
            r.preemptions += h.preemptions;
        }
        if let Some(done) = self.awaiting_handoff.remove(&id) {
            self.retire(done);
        }
    }

    /// Request `id` ended (`event` is its `Finished` or `Failed`): its record is completed, its
    /// watcher and the driver hear of it, and it leaves (unless its handoff report is still to come).
    fn end(&mut self, pool: &str, id: u64, event: Event) {
        let start = self.start_ms;
        let Some(mut open) = self.open.remove(&id) else {
            return tracing::warn!(
                pool,
                request = id,
                "end of a request not in flight (never released, or ended): dropped"
            );
        };
        let r = &mut open.record;
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
            Event::HandedOff { .. } | Event::Received { .. } | Event::Tokens { .. } => unreachable!("not an end"),
        };
        let arrival = r.arrival_ms;
        r.queue_ms = started_ms.map(|s| s - start - arrival);
        r.ttft_ms = times.first.map(|f| f - start - arrival);
        r.second_token_ms = times.second.map(|s| s - start - arrival);
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
        let how = match &r.failure {
            Some(cause) => format!("failed with {cause}"),
            None => "completed".to_string(),
        };
        if self.recent_ends.len() == RECENT_ENDS {
            if let Some(oldest) = self.recent_ends.pop_front() {
                self.how_ended.remove(&oldest);
            }
        }
        self.recent_ends.push_back(id);
        self.how_ended.insert(id, how);
        self.metrics.ended(r);
        if let Some(mut watcher) = self.watchers.remove(&id) {
            watcher(Progress::Ended(Box::new(r.clone())));
        }
        self.bar.inc(1);
        let secs = ((wall_ms() - start) / 1000.0).max(1e-9);
        self.bar.set_message(format!("{:.0} tokens/s", self.tokens as f64 / secs));
        // The driver may be gone (stopped); nothing to tell then.
        let _ = self.completions.send(id);
        if r.received_ms.is_some() && r.t0_ms.is_none() {
            self.awaiting_handoff.insert(id, open);
        } else {
            self.retire(open);
        }
    }

    /// A request whose record is complete leaves memory: written out, counted, handed to
    /// `--verify`.
    fn retire(&mut self, open: Open) {
        let Open { record, sampling } = open;
        self.summary.add(&record);
        if let Some(verifier) = &self.verifier {
            if record.error.is_none() && !record.output_tokens.is_empty() {
                verifier.check(VerifyItem::of(&record, sampling));
            }
        }
        if let Some(file) = &mut self.file {
            file.push(&record);
        }
    }

    /// `wall_ms` when the run started: record times are relative to it.
    pub fn start_ms(&self) -> f64 {
        self.start_ms
    }

    /// No request is released after this one (a server that stopped taking requests): the
    /// requests released so far are all the run has.
    pub fn no_more_releases(&mut self) {
        self.total = self.released;
    }

    /// Pools that ended under a failure, with its message (what is released into one fails).
    pub fn failed_pools(&self) -> Vec<(String, String)> {
        self.ended.iter().map(|(pool, (_, message))| (pool.clone(), message.clone())).collect()
    }

    /// `/metrics`' counters and histograms over the requests so far.
    pub fn metrics(&self) -> &MetricsTally {
        &self.metrics
    }

    /// How many requests released have not ended yet.
    pub fn open_count(&self) -> usize {
        self.open.len()
    }

    /// How request `id` ended, in words, if it is among the last [`RECENT_ENDS`] to end (`None`:
    /// not ended, never released here, or ended long before).
    pub fn end_of(&self, id: u64) -> Option<&str> {
        self.how_ended.get(&id).map(String::as_str)
    }

    /// Requests released that have not ended yet.
    pub fn in_flight(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.open.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// The entry pool request `id` went to, while it is in flight.
    pub fn entry_pool_of(&self, id: u64) -> Option<&str> {
        self.open.get(&id).map(|o| o.record.pool.as_str())
    }

    /// Every request of the workload was released and has ended.
    pub fn all_ended(&self) -> bool {
        self.released >= self.total && self.open.is_empty()
    }

    /// How many requests released into `pool` have not ended yet.
    pub fn in_flight_in(&self, pool: &str) -> usize {
        self.open.values().filter(|o| o.record.pools.last().is_some_and(|p| p == pool)).count()
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

    /// The requests not ended yet that `pick` picks, in id order.
    fn open_where(&self, pick: impl Fn(&RequestRecord) -> bool) -> Vec<u64> {
        let mut ids: Vec<u64> = self.open.values().filter(|o| pick(&o.record)).map(|o| o.record.id).collect();
        ids.sort_unstable();
        ids
    }

    /// Takes `--verify`'s checker (the run's end joins it).
    pub fn take_verifier(&mut self) -> Option<Verifier> {
        self.verifier.take()
    }

    /// Ends the run's records: the requests still held (never ended, or waiting for a handoff
    /// report) are counted and written too, `requests.jsonl` is flushed, and the progress bar
    /// ends. Returns the run's figures.
    pub fn finish(&mut self) -> std::io::Result<RunSummary> {
        self.bar.finish_and_clear();
        let mut held: Vec<Open> = self.open.drain().chain(self.awaiting_handoff.drain()).map(|(_, o)| o).collect();
        held.sort_by_key(|o| o.record.id);
        for open in held {
            self.retire(open);
        }
        if let Some(file) = self.file.take() {
            file.finish()?;
        }
        Ok(std::mem::take(&mut self.summary))
    }
}

/// What a prefill pool reports of a handoff (`Event::HandedOff`).
struct Handoff {
    rank: usize,
    to: String,
    started_ms: f64,
    t0_ms: f64,
    bytes: u64,
    preemptions: usize,
}

/// How many ended records may wait for an earlier request to end before `requests.jsonl` gives
/// up its id order (a long request in a server that goes on serving).
const MAX_WAITING_RECORDS: usize = 1024;

/// `requests.jsonl`, written as requests end (buffered; flushed at the end), one line per
/// request in id order: a record that ends before an earlier one waits, as its line, until the
/// earlier one is written — at most [`MAX_WAITING_RECORDS`] of them; past that the oldest
/// waiting goes out first (and the order is by end from there on for what it passed).
pub struct RecordsFile {
    path: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
    /// The id the next line in order has.
    next_id: u64,
    waiting: BTreeMap<u64, String>,
    /// The first write that failed (the run goes on; its end reports it).
    error: Option<std::io::Error>,
}

impl RecordsFile {
    /// Creates (or empties) `dir/requests.jsonl`.
    pub fn create(dir: &Path) -> std::io::Result<RecordsFile> {
        let path = dir.join("requests.jsonl");
        let out = std::io::BufWriter::new(std::fs::File::create(&path)?);
        Ok(RecordsFile { path, out, next_id: 0, waiting: BTreeMap::new(), error: None })
    }

    /// Writes `record`'s line, or keeps it until the requests before it have been written.
    pub fn push(&mut self, record: &RequestRecord) {
        let line = match serde_json::to_string(record) {
            Ok(line) => line,
            Err(e) => return self.failed(e.into()),
        };
        if record.id < self.next_id {
            return self.write(&line);
        }
        self.waiting.insert(record.id, line);
        if self.waiting.len() > MAX_WAITING_RECORDS {
            if let Some((id, line)) = self.waiting.pop_first() {
                self.next_id = id + 1;
                self.write(&line);
            }
        }
        while let Some(line) = self.waiting.remove(&self.next_id) {
            self.next_id += 1;
            self.write(&line);
        }
    }

    fn write(&mut self, line: &str) {
        if let Err(e) = self.out.write_all(line.as_bytes()).and_then(|()| self.out.write_all(b"\n")) {
            self.failed(e);
        }
    }

    fn failed(&mut self, e: std::io::Error) {
        if self.error.is_none() {
            tracing::error!(path = %self.path.display(), "cannot write a request's record: {e}");
            self.error = Some(e);
        }
    }

    /// Writes what still waits (in id order) and flushes; the first error of the run, if any.
    pub fn finish(mut self) -> std::io::Result<()> {
        for line in std::mem::take(&mut self.waiting).into_values() {
            self.write(&line);
        }
        let flushed = self.out.flush();
        match self.error.take() {
            Some(e) => Err(std::io::Error::new(e.kind(), format!("{}: {e}", self.path.display()))),
            None => flushed.map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", self.path.display()))),
        }
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
