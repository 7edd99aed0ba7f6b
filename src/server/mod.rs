//! `kvflow serve`: an OpenAI-compatible HTTP front (axum on tokio) in place of the trace driver.
//! Each request enters the same ingress the driver uses (an entry pool, picked as the driver
//! picks), with the model's end-of-sequence ids as stop tokens and, when it streams, per-step
//! token events; the collector hands the request's progress to its connection ([`Progress`]).
//! A connection that goes away cancels its request through the pools' cancellation path (one
//! that only half-closes is answered in full); a full server (`[serve] max_requests` in flight)
//! answers 429. Connections are taken by the server's own accept loop ([`listener`]: TLS,
//! timeouts, the connection cap) and requests pass the API key's check ([`auth`]) and the body's
//! limits ([`body`]) before a handler sees them. SIGTERM or Ctrl-C stops taking
//! requests (503), lets those in flight finish for the grace period, cancels the rest, then
//! closes every ingress so the pools end and the run writes its report.

pub mod access;
pub mod auth;
mod body;
pub mod command;
mod listener;
pub mod metrics;
pub mod openai;
mod output;
pub mod tls;

use crate::graph::Graph;
use crate::runtime::collector::{Progress, SharedCollector};
use crate::runtime::entry::{Entries, Release};
use crate::runtime::front::{FrontEnd, FrontEndJob, PoolGauges};
use crate::text::TextModel;
use access::{Access, RefusedEarly};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvflow_kernels::cpu::sampling::RequestSampling;
use kvflow_kernels::models::Model;
use kvflow_operators::messages::Delivery;
use openai::{ApiError, Ask, Endpoint, Envelope, Limits};
use output::Output;
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Everything the server needs from the run.
pub struct ServeJob {
    /// Bound already (its address was printed).
    pub listener: std::net::TcpListener,
    /// Where its requests enter the run (and are cancelled).
    pub entries: Arc<Entries>,
    pub collector: SharedCollector,
    /// Set by SIGTERM or Ctrl-C (or a test): drain and stop.
    pub interrupted: Arc<AtomicBool>,
    pub grace: Duration,
    pub text: Option<Arc<TextModel>>,
    pub model_name: String,
    pub vocab_size: usize,
    pub max_context: usize,
    pub max_tokens: usize,
    pub max_requests: usize,
    pub sampling: RequestSampling,
    pub gauges: PoolGauges,
    /// Who may call, and the connections' limits.
    pub access: Arc<Access>,
}

/// What `kvflow serve` brings to a run: its bound socket and the model's text side. It is the
/// run's front end ([`FrontEnd`]): the HTTP server releases the requests.
pub struct Serving {
    pub listener: std::net::TcpListener,
    /// The tokenizer and chat template, when the model has them (else prompts are token ids).
    pub text: Option<Arc<TextModel>>,
    /// Who may call, and the connections' limits.
    pub access: Arc<Access>,
}

impl std::fmt::Debug for Serving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Serving")
            .field("listener", &self.listener)
            .field("text", &self.text.is_some())
            .field("access", &self.access)
            .finish()
    }
}

/// The longest request `kvflow serve` takes for `graph` on `model` (rank memory is planned for it).
pub fn serve_context(graph: &Graph, model: &Model) -> usize {
    let model_context = model.max_positions.unwrap_or(crate::graph::DEFAULT_SERVE_CONTEXT);
    graph.serve.max_context.unwrap_or(model_context.min(crate::graph::DEFAULT_SERVE_CONTEXT)).min(model_context)
}

impl FrontEnd for Serving {
    fn max_context(&self, graph: &Graph, model: &Model) -> usize {
        serve_context(graph, model)
    }

    fn spawn(&self, job: FrontEndJob<'_>) -> anyhow::Result<std::thread::JoinHandle<()>> {
        use anyhow::Context;
        let FrontEndJob { graph, model, entries, interrupted, grace, max_context, gauges } = job;
        Ok(spawn_server(ServeJob {
            listener: self.listener.try_clone().context("cannot use the listening socket")?,
            collector: entries.collector().clone(),
            entries,
            interrupted,
            grace,
            text: self.text.clone(),
            model_name: graph.serve.model_name.clone(),
            vocab_size: model.vocab_size,
            max_context,
            max_tokens: graph.serve.max_tokens,
            max_requests: graph.serve.max_requests,
            sampling: graph.sampling,
            gauges,
            access: self.access.clone(),
        })?)
    }
}

struct Server {
    job: ServeJob,
    stop_tokens: Vec<u32>,
    next_id: AtomicU64,
    draining: AtomicBool,
    refused: Mutex<BTreeMap<u16, u64>>,
    /// Bounds the requests being read at once ([`Server::read_request`]): one a core.
    readers: tokio::sync::Semaphore,
}

/// Runs the server on its own thread (a tokio runtime of two workers) until it has drained;
/// it closes every ingress when done.
pub fn spawn_server(job: ServeJob) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("kvflow-serve".into()).spawn(move || {
        let stop_tokens = job.text.as_ref().and_then(|t| t.eos()).into_iter().collect();
        let server = Arc::new(Server {
            job,
            stop_tokens,
            next_id: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            refused: Mutex::new(BTreeMap::new()),
            readers: tokio::sync::Semaphore::new(std::thread::available_parallelism().map_or(1, |n| n.get())),
        });
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build();
        match runtime {
            Ok(rt) => rt.block_on(serve(server.clone())),
            Err(e) => eprintln!("kvflow serve: cannot start the HTTP runtime: {e}"),
        }
        server.job.entries.close();
    })
}

async fn serve(server: Arc<Server>) {
    let std_listener = match server.job.listener.try_clone() {
        Ok(l) => l,
        Err(e) => return eprintln!("kvflow serve: cannot use the listening socket: {e}"),
    };
    let _ = std_listener.set_nonblocking(true);
    let listener = match tokio::net::TcpListener::from_std(std_listener) {
        Ok(l) => l,
        Err(e) => return eprintln!("kvflow serve: cannot use the listening socket: {e}"),
    };
    let scheme = if server.job.access.tls.is_some() { "https" } else { "http" };
    match listener.local_addr() {
        Ok(address) => println!("kvflow serve: listening on {scheme}://{address}"),
        Err(e) => eprintln!("kvflow serve: listening (address unknown: {e})"),
    }
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let http =
        tokio::spawn(listener::serve_connections(listener, router(&server), server.job.access.clone(), stopping));
    server.until_drained().await;
    let _ = stop.send(true);
    // Connections still open after the drain (idle keep-alives) are dropped.
    if tokio::time::timeout(Duration::from_secs(5), http).await.is_err() {
        tracing::warn!("connections still open 5 s after the drain: dropped");
    }
}

/// The routes, under (outermost first) the count of early refusals, the API key's check on
/// `/v1/*` and the whole-body read with its size and time limits.
fn router(server: &Arc<Server>) -> Router {
    let access = &server.job.access;
    let body_limits = body::BodyLimits { max_bytes: access.max_body_bytes, read_timeout: access.body_read_limit() };
    let mut app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(prometheus))
        .with_state(server.clone())
        .layer(DefaultBodyLimit::max(access.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(body_limits, body::read_whole_body));
    if let Some(key) = &access.api_key {
        app = app.layer(axum::middleware::from_fn_with_state(Arc::new(key.clone()), auth::require_key));
    }
    app.layer(axum::middleware::map_response_with_state(server.clone(), count_early_refusal))
}

/// Counts a refusal of the layers (401, 408, 413) beside the handlers' own in `/metrics`.
async fn count_early_refusal(State(server): State<Arc<Server>>, response: Response) -> Response {
    if response.extensions().get::<RefusedEarly>().is_some() {
        *server.refused.lock().entry(response.status().as_u16()).or_default() += 1;
    }
    response
}

impl Server {
    /// Waits for an interrupt, then drains: new requests get 503, those in flight have the
    /// grace period, then the rest are cancelled and their ends awaited.
    async fn until_drained(&self) {
        while !self.job.interrupted.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        {
            let mut c = self.job.collector.lock();
            self.draining.store(true, Ordering::SeqCst);
            c.interrupted_now();
        }
        let open = || self.job.collector.lock().open_count();
        let in_flight = open();
        eprintln!(
            "kvflow serve: draining: {in_flight} request(s) in flight get {:.0} s to finish; new requests get 503",
            self.job.grace.as_secs_f64()
        );
        let deadline = Instant::now() + self.job.grace;
        while open() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let rest = self.job.collector.lock().in_flight();
        if !rest.is_empty() {
            eprintln!("kvflow serve: cancelling {} request(s) still in flight after the grace period", rest.len());
        }
        for &id in &rest {
            self.cancel(id);
        }
        let confirm_by = Instant::now() + self.job.grace.max(Duration::from_secs(5));
        while open() > 0 && Instant::now() < confirm_by {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.job.collector.lock().no_more_releases();
    }

    fn limits(&self) -> Limits<'_> {
        Limits {
            text: self.job.text.as_deref(),
            model_name: &self.job.model_name,
            vocab_size: self.job.vocab_size,
            max_context: self.job.max_context,
            max_tokens: self.job.max_tokens,
            sampling: self.job.sampling,
            max_prompt_bytes: self.job.text.as_ref().and_then(|t| t.max_prompt_bytes(self.job.max_context)),
        }
    }

    /// Reads a request's body into an [`Ask`]: the JSON, the chat template's render and the
    /// tokenizing. They take time in proportion to the body (and the template), so they run on
    /// tokio's blocking threads, at most one a core at once, never on the async workers that
    /// answer `/health` and every stream.
    async fn read_request(self: &Arc<Self>, endpoint: Endpoint, body: Bytes) -> Result<Ask, ApiError> {
        let internal = |why: String| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal", why);
        let _slot = self.readers.acquire().await.map_err(|e| internal(e.to_string()))?;
        let server = self.clone();
        tokio::task::spawn_blocking(move || openai::parse(endpoint, &body, &server.limits()))
            .await
            .map_err(|e| internal(format!("reading the request failed: {e}")))?
    }

    fn refused(&self, e: ApiError) -> Response {
        *self.refused.lock().entry(e.status.as_u16()).or_default() += 1;
        e.into_response()
    }

    /// Releases `ask` into an entry pool (as the trace driver releases its requests); its
    /// progress arrives on the ticket. A draining or full server refuses it.
    fn submit(self: &Arc<Self>, ask: &Ask) -> Result<Ticket, ApiError> {
        let (tx, rx) = unbounded_channel();
        let mut released = None;
        self.job.entries.release(|c| {
            if self.draining.load(Ordering::SeqCst) {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    "draining",
                    "the server is shutting down and takes no new requests",
                ));
            }
            let open = c.open_count();
            if open >= self.job.max_requests {
                return Err(ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_exceeded",
                    "queue_full",
                    format!(
                        "{open} requests in flight, the most this server takes ([serve] max_requests); retry later"
                    ),
                ));
            }
            let id = self.next_id.fetch_add(1, Ordering::SeqCst);
            released = Some(id);
            Ok(Release {
                id,
                prompt: ask.prompt.clone(),
                max_output_tokens: ask.max_tokens,
                warmup: false,
                sampling: ask.sampling,
                delivery: Delivery {
                    stop_tokens: self.stop_tokens.clone(),
                    stream: ask.stream || !ask.stop.is_empty(),
                },
                watcher: Some(Box::new(move |p| {
                    let _ = tx.send(p);
                })),
            })
        })?;
        let id = released.expect("a request the server released has an id");
        Ok(Ticket { rx, guard: CancelOnDrop { server: self.clone(), id, armed: true } })
    }

    fn cancel(&self, id: u64) {
        self.job.entries.cancel(id);
    }
}

/// A request's progress, and its cancellation should its connection go away first.
struct Ticket {
    rx: UnboundedReceiver<Progress>,
    guard: CancelOnDrop,
}

struct CancelOnDrop {
    server: Arc<Server>,
    id: u64,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            tracing::info!(request = self.id, "client gone before its request ended: cancelling it");
            self.server.cancel(self.id);
        }
    }
}

async fn completions(State(server): State<Arc<Server>>, body: Bytes) -> Response {
    answer(server, Endpoint::Completions, body).await
}

async fn chat(State(server): State<Arc<Server>>, body: Bytes) -> Response {
    answer(server, Endpoint::Chat, body).await
}

async fn answer(server: Arc<Server>, endpoint: Endpoint, body: Bytes) -> Response {
    let ask = match server.read_request(endpoint, body).await {
        Ok(ask) => ask,
        Err(e) => return server.refused(e),
    };
    let ticket = match server.submit(&ask) {
        Ok(t) => t,
        Err(e) => return server.refused(e),
    };
    let envelope = Envelope::new(endpoint, ticket.guard.id, &server.job.model_name);
    let output = Output::new(server.job.text.clone(), server.stop_tokens.clone(), ask.stop.clone());
    let answer = Answer { ticket, output, envelope, ask, queue: VecDeque::new(), done: false };
    if answer.ask.stream {
        Sse::new(answer.into_stream()).keep_alive(KeepAlive::new().interval(Duration::from_secs(5))).into_response()
    } else {
        answer.whole().await
    }
}

/// One request's answer as it is built.
struct Answer {
    ticket: Ticket,
    output: Output,
    envelope: Envelope,
    ask: Ask,
    /// Stream chunks ready to send.
    queue: VecDeque<SseEvent>,
    done: bool,
}

/// How a request ended, for its last chunk or its whole answer.
enum End {
    Finished(&'static str),
    Failed(ApiError),
}

impl Answer {
    fn usage(&self) -> Value {
        openai::usage(self.ask.prompt.len(), self.output.ids().len())
    }

    fn finish_reason(&self, record: Option<&crate::report::RequestRecord>) -> &'static str {
        if self.output.stopped_by_string || self.output.ended_on_stop_token() {
            "stop"
        } else if record.is_some_and(|r| r.failure.as_deref() == Some(crate::report::CANCELLED)) {
            "abort"
        } else {
            "length"
        }
    }

    /// Waits for the next progress: a piece of output, or the request's end (a stop string
    /// ends it here; the guard cancels what it would still generate).
    async fn next(&mut self) -> Step {
        match self.ticket.rx.recv().await {
            Some(Progress::Tokens { offset, tokens }) => {
                self.output.take(offset, tokens);
                let (text, ids) = self.output.piece();
                if self.output.stopped_by_string {
                    return Step::End(End::Finished("stop"), text, ids);
                }
                Step::Piece(text, ids)
            }
            Some(Progress::Ended(record)) => {
                self.ticket.guard.armed = false;
                let (text, ids) = self.output.finish(&record.output_tokens);
                let failed = record.error.is_some() && record.failure.as_deref() != Some(crate::report::CANCELLED);
                if failed {
                    let cause = record.failure.clone().unwrap_or_else(|| "unknown".into());
                    let message = record.error.clone().unwrap_or_default();
                    let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", &cause, message);
                    return Step::End(End::Failed(e), text, ids);
                }
                Step::End(End::Finished(self.finish_reason(Some(&record))), text, ids)
            }
            None => {
                let e = ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "run-ended",
                    "the run ended before the request did",
                );
                Step::End(End::Failed(e), String::new(), Vec::new())
            }
        }
    }

    async fn whole(mut self) -> Response {
        let mut text = String::new();
        loop {
            match self.next().await {
                Step::Piece(piece, _) => text.push_str(&piece),
                Step::End(End::Failed(e), ..) => return e.into_response(),
                Step::End(End::Finished(reason), rest, _) => {
                    text.push_str(&rest);
                    let body = self.envelope.whole(&text, self.output.ids(), reason, self.usage());
                    return Json(body).into_response();
                }
            }
        }
    }

    fn into_stream(mut self) -> impl futures_util::Stream<Item = Result<SseEvent, Infallible>> {
        if self.envelope.endpoint == Endpoint::Chat {
            let first = self.envelope.chunk("", &[], true, None);
            self.queue.push_back(SseEvent::default().data(first.to_string()));
        }
        futures_util::stream::unfold(self, |mut a| async move {
            loop {
                if let Some(event) = a.queue.pop_front() {
                    return Some((Ok(event), a));
                }
                if a.done {
                    return None;
                }
                match a.next().await {
                    Step::Piece(text, ids) => {
                        if !text.is_empty() || !ids.is_empty() {
                            let chunk = a.envelope.chunk(&text, &ids, false, None);
                            a.queue.push_back(SseEvent::default().data(chunk.to_string()));
                        }
                    }
                    Step::End(end, text, ids) => {
                        match end {
                            End::Failed(e) => a.queue.push_back(SseEvent::default().data(e.body().to_string())),
                            End::Finished(reason) => {
                                let last = a.envelope.chunk(&text, &ids, false, Some(reason));
                                a.queue.push_back(SseEvent::default().data(last.to_string()));
                                if a.ask.include_usage {
                                    let usage = a.envelope.usage_chunk(a.usage());
                                    a.queue.push_back(SseEvent::default().data(usage.to_string()));
                                }
                            }
                        }
                        a.queue.push_back(SseEvent::default().data("[DONE]"));
                        a.done = true;
                    }
                }
            }
        })
    }
}

/// What [`Answer::next`] brought.
enum Step {
    Piece(String, Vec<u32>),
    End(End, String, Vec<u32>),
}

async fn models(State(server): State<Arc<Server>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": server.job.model_name, "object": "model", "created": 0, "owned_by": "kvflow",
        "max_model_len": server.job.max_context,
    }]}))
}

/// 200 while the server takes requests; 503 while it drains, or once a pool has ended under a
/// failure (a lost process, say: what would enter it fails).
async fn health(State(server): State<Arc<Server>>) -> Response {
    let failed = server.job.collector.lock().failed_pools();
    if server.draining.load(Ordering::SeqCst) {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "draining"}))).into_response()
    } else if !failed.is_empty() {
        let pools: Vec<Value> = failed.iter().map(|(pool, why)| json!({"pool": pool, "error": why})).collect();
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "pool-ended", "pools": pools}))).into_response()
    } else {
        Json(json!({"status": "ok"})).into_response()
    }
}

async fn prometheus(State(server): State<Arc<Server>>) -> Response {
    let refused = server.refused.lock().clone();
    let text = {
        let c = server.job.collector.lock();
        let live = metrics::Live {
            in_flight: c.open_count(),
            pools: &server.job.gauges,
            refused: &refused,
            draining: server.draining.load(Ordering::SeqCst),
        };
        metrics::render(c.metrics(), &live)
    };
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}
