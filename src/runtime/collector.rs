//! The run's results on process 0: the workload driver records each release, `emit` delivers
//! every event, and the collector timestamps them as they arrive (the client's view), tells the
//! driver when a request is done, and drives the progress bar.

use crate::report::RequestRecord;
use indicatif::{ProgressBar, ProgressStyle};
use kvflow_operators::emit::EventSink;
use kvflow_operators::messages::Event;
use std::collections::HashMap;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[derive(Default)]
struct Progress {
    record: RequestRecord,
    started_ms: Option<f64>,
    first_token_ms: Option<f64>,
    last_token_ms: Option<f64>,
}

pub struct Collector {
    epoch: Instant,
    pool: String,
    requests: HashMap<u64, Progress>,
    completions: Sender<u64>,
    bar: ProgressBar,
    tokens: u64,
}

/// The collector, shared by the driver thread and worker 0.
pub type SharedCollector = Arc<Mutex<Collector>>;

impl Collector {
    pub fn new(pool: &str, total: usize, completions: Sender<u64>, show_progress: bool) -> SharedCollector {
        let bar = if show_progress { ProgressBar::new(total as u64) } else { ProgressBar::hidden() };
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} requests  {msg}  {elapsed}").expect("valid template"),
        );
        Arc::new(Mutex::new(Collector {
            epoch: Instant::now(),
            pool: pool.to_string(),
            requests: HashMap::new(),
            completions,
            bar,
            tokens: 0,
        }))
    }

    fn now_ms(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1000.0
    }

    /// The driver released a request.
    pub fn released(&mut self, id: u64, prompt: &[u32], max_output_tokens: usize, warmup: bool) {
        let now = self.now_ms();
        let record = RequestRecord {
            id,
            warmup,
            arrival_ms: now,
            input_len: prompt.len(),
            output_len: max_output_tokens,
            pool: self.pool.clone(),
            prompt_tokens: prompt.to_vec(),
            ..Default::default()
        };
        self.requests.insert(id, Progress { record, ..Default::default() });
    }

    fn on_event(&mut self, event: Event) {
        let now = self.now_ms();
        let id = event.id();
        let Some(p) = self.requests.get_mut(&id) else {
            tracing::warn!(request = id, "event for a request that was never released");
            return;
        };
        let mut done = false;
        match event {
            Event::Started { rank, cached_tokens, .. } => {
                p.started_ms.get_or_insert(now);
                p.record.rank = Some(rank);
                p.record.cached_tokens = cached_tokens;
            }
            Event::Token { index, token, .. } => {
                debug_assert_eq!(index, p.record.output_tokens.len(), "tokens arrive in order");
                p.record.output_tokens.push(token);
                p.first_token_ms.get_or_insert(now);
                p.last_token_ms = Some(now);
                self.tokens += 1;
            }
            Event::Finished { rank, logits_hash, preemptions, .. } => {
                p.record.rank = Some(rank);
                p.record.logits_hash = logits_hash;
                p.record.preemptions = preemptions;
                p.record.done_ms = Some(now);
                done = true;
            }
            Event::Failed { rank, cause, message, .. } => {
                p.record.rank = Some(rank);
                p.record.error = Some(message);
                p.record.failure = Some(cause);
                done = true;
            }
        }
        if done {
            let r = &mut p.record;
            let arrival = r.arrival_ms;
            r.queue_ms = p.started_ms.map(|s| s - arrival);
            r.ttft_ms = p.first_token_ms.map(|f| f - arrival);
            r.e2e_ms = r.done_ms.map(|d| d - arrival);
            let n = r.output_tokens.len();
            r.tpot_ms = match (p.first_token_ms, p.last_token_ms) {
                (Some(f), Some(l)) if n > 1 => Some((l - f) / (n - 1) as f64),
                _ => None,
            };
            self.bar.inc(1);
            let secs = self.epoch.elapsed().as_secs_f64().max(1e-9);
            self.bar.set_message(format!("{:.0} tokens/s", self.tokens as f64 / secs));
            // The driver may be gone (stopped); nothing to tell then.
            let _ = self.completions.send(id);
        }
    }

    /// Every request's record, in id order, and ends the progress bar.
    pub fn finish(&mut self) -> Vec<RequestRecord> {
        self.bar.finish_and_clear();
        let mut records: Vec<RequestRecord> = self.requests.drain().map(|(_, p)| p.record).collect();
        records.sort_by_key(|r| r.id);
        records
    }
}

/// `emit`'s sink: forwards a pool's events to the shared collector.
pub struct CollectorSink(pub SharedCollector);

impl EventSink for CollectorSink {
    fn events(&mut self, _step: u64, events: Vec<Event>) {
        let mut c = self.0.lock().expect("collector lock");
        for e in events {
            c.on_event(e);
        }
    }
}
