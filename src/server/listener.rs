//! `kvflow serve`'s accept loop (axum's own `serve` can do neither TLS nor these limits): each
//! connection, over TLS or plain TCP, is served by hyper's HTTP/1.1 connection with the router as
//! its service, under the limits of [`Access`]:
//! - a connection has `--header-read-timeout` from its start, or the end of its last answer, to
//!   the end of its next request's headers (hyper's own timer; the TLS handshake counts too), and
//!   is closed past it;
//! - one with no request in flight and no byte moving for `--keep-alive-timeout` is closed
//!   (hyper's graceful shutdown: an answer being written is finished first);
//! - at most `--max-connections` are open; one more is answered 503 with `Retry-After` and
//!   closed, and the refusals are logged at most once per 10 s, with their count;
//! - a client that half-closes (ends its sending side after its request, as `nc -N` does) is
//!   answered in full: the end of its input is not taken as its going away.
//!
//! The body's limits are the router's ([`super::body`]). At the stop, every connection is shut
//! down gracefully and the loop returns once all have ended.

use super::access::Access;
use super::openai::ApiError;
use axum::body::Body;
use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use futures_util::future::BoxFuture;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::Service;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use parking_lot::Mutex;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;

/// Connections over the cap answered 503 at once; past this many (a flood), one is closed
/// unanswered.
const REFUSING_AT_ONCE: usize = 64;
/// How long a connection over the cap has to send its request's headers for its 503.
const REFUSAL_HEADER_TIMEOUT: Duration = Duration::from_secs(2);
/// The shortest gap between two log lines about the same trouble.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// Accepts connections on `listener` and serves `app` on each until `stop` turns true; then
/// shuts every connection down gracefully and returns once all have ended.
pub async fn serve_connections(listener: TcpListener, app: Router, access: Arc<Access>, stop: watch::Receiver<bool>) {
    let cap = access.connection_cap();
    // Each connection task holds one permit: all of them back means every connection ended.
    let open = Arc::new(Semaphore::new(cap));
    let refusing = Arc::new(Semaphore::new(REFUSING_AT_ONCE));
    let shared = Arc::new(Shared {
        app: TowerToHyperService::new(app),
        tls: access.tls.clone().map(TlsAcceptor::from),
        access,
        stop: stop.clone(),
        refused: RateLimited::default(),
        troubles: RateLimited::default(),
    });
    let mut stopping = stop;
    loop {
        let accepted = tokio::select! {
            _ = stopped(&mut stopping) => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                shared
                    .troubles
                    .note(|n| format!("kvflow serve: {n} failed accept(s) since the last such line (latest: {e})"));
                // Out of file descriptors, say: give the open connections time to end.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        match open.clone().try_acquire_owned() {
            Ok(permit) => drop(tokio::spawn(shared.clone().serve(stream, permit))),
            Err(_) => shared.refuse(stream, peer, &refusing, cap),
        }
    }
    drop(listener);
    shared.refused.flush();
    let _ = open.acquire_many(cap as u32).await;
}

/// Returns once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// What every connection task shares.
struct Shared {
    app: TowerToHyperService<Router>,
    tls: Option<TlsAcceptor>,
    access: Arc<Access>,
    stop: watch::Receiver<bool>,
    refused: RateLimited,
    /// Failed accepts and TLS handshakes.
    troubles: RateLimited,
}

/// How one connection is served.
#[derive(Clone, Copy)]
struct Settings {
    header_read_timeout: Option<Duration>,
    keep_alive_timeout: Option<Duration>,
    keep_alive: bool,
    half_close: bool,
}

impl Shared {
    async fn serve(self: Arc<Self>, stream: TcpStream, _permit: OwnedSemaphorePermit) {
        let settings = Settings {
            header_read_timeout: self.access.header_read_limit(),
            keep_alive_timeout: self.access.keep_alive_limit(),
            keep_alive: true,
            half_close: !self.access.switches.no_half_close,
        };
        let activity = Arc::new(Activity::new());
        let answering = Answering { app: Some(self.app.clone()), refusal: None, activity: activity.clone() };
        self.speak(stream, answering, settings).await;
    }

    /// A connection over the cap: answered 503 (while few are), logged at most once per 10 s.
    fn refuse(self: &Arc<Self>, stream: TcpStream, peer: SocketAddr, refusing: &Arc<Semaphore>, cap: usize) {
        self.refused.note(|n| {
            format!(
                "kvflow serve: refused {n} connection(s) over --max-connections {cap} since the last such line \
                 (latest from {peer}), each answered 503 with Retry-After"
            )
        });
        let Ok(permit) = refusing.clone().try_acquire_owned() else {
            return; // a flood: closed unanswered as `stream` drops
        };
        let settings = Settings {
            header_read_timeout: Some(REFUSAL_HEADER_TIMEOUT),
            keep_alive_timeout: None,
            keep_alive: false,
            half_close: true,
        };
        let answering = Answering { app: None, refusal: Some(cap), activity: Arc::new(Activity::new()) };
        let shared = self.clone();
        tokio::spawn(async move {
            shared.speak(stream, answering, settings).await;
            drop(permit);
        });
    }

    /// Serves one connection, over TLS when the server has it.
    async fn speak(&self, stream: TcpStream, answering: Answering, settings: Settings) {
        let activity = answering.activity.clone();
        let io = Watched { inner: stream, activity: activity.clone() };
        let Some(acceptor) = &self.tls else {
            return self.drive(TokioIo::new(io), answering, &activity, settings).await;
        };
        let handshake = acceptor.accept(io);
        let secured = match settings.header_read_timeout {
            None => handshake.await,
            Some(limit) => match tokio::time::timeout(limit, handshake).await {
                Ok(secured) => secured,
                Err(_) => return tracing::debug!("TLS handshake not done within the header read timeout: closed"),
            },
        };
        match secured {
            Ok(stream) => self.drive(TokioIo::new(stream), answering, &activity, settings).await,
            Err(e) => self
                .troubles
                .note(|n| format!("kvflow serve: {n} failed TLS handshake(s) since the last such line (latest: {e})")),
        }
    }

    /// Runs hyper's connection on `io` until it ends, shutting it down gracefully at the stop
    /// or once it has been idle for the keep-alive timeout.
    async fn drive<I>(&self, io: I, answering: Answering, activity: &Activity, settings: Settings)
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let mut builder = http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(settings.header_read_timeout)
            .half_close(settings.half_close)
            .keep_alive(settings.keep_alive);
        let connection = builder.serve_connection(io, answering);
        tokio::pin!(connection);
        let mut stop = self.stop.clone();
        let mut closing = false;
        loop {
            let idle_limit = settings.keep_alive_timeout.filter(|_| !closing);
            let idle_check = async {
                match idle_limit {
                    Some(limit) => tokio::time::sleep_until(activity.idle_deadline(limit).into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ended = connection.as_mut() => {
                    if let Err(e) = ended {
                        tracing::debug!("connection ended: {e}");
                    }
                    return;
                }
                _ = stopped(&mut stop), if !closing => {
                    connection.as_mut().graceful_shutdown();
                    closing = true;
                }
                _ = idle_check => {
                    if idle_limit.is_some_and(|limit| activity.idle_deadline(limit) <= Instant::now()) {
                        connection.as_mut().graceful_shutdown();
                        closing = true;
                    }
                }
            }
        }
    }
}

/// The service of one connection: the router, or (over the cap) a 503 for every request.
#[derive(Clone)]
struct Answering {
    app: Option<TowerToHyperService<Router>>,
    /// The cap this connection was over.
    refusal: Option<usize>,
    activity: Arc<Activity>,
}

impl Service<Request<Incoming>> for Answering {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        // In flight until hyper drops the answer's body (written, or the connection gone).
        let busy = self.activity.begin();
        let Some(app) = &self.app else {
            return Box::pin(std::future::ready(Ok(over_the_cap(self.refusal.unwrap_or_default()))));
        };
        let answer = app.call(request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    busy.progress();
                    frame
                }))
            }))
        })
    }
}

fn over_the_cap(cap: usize) -> Response<Body> {
    let message = format!("{cap} connections are open, the most this server takes (--max-connections); retry later");
    let refusal = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "too_many_connections", message);
    let mut response = refusal.into_response();
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// When a connection last moved a byte, and how many of its requests are in flight.
struct Activity {
    born: Instant,
    /// Milliseconds after `born`.
    last_ms: AtomicU64,
    in_flight: AtomicUsize,
}

impl Activity {
    fn new() -> Activity {
        Activity { born: Instant::now(), last_ms: AtomicU64::new(0), in_flight: AtomicUsize::new(0) }
    }

    fn touch(&self) {
        self.last_ms.store(self.born.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn begin(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.touch();
        Busy(self.clone())
    }

    /// When the connection will have been idle for `limit` if nothing moves (with a request in
    /// flight it is not idle: `limit` from now, to look again).
    fn idle_deadline(&self, limit: Duration) -> Instant {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return Instant::now() + limit;
        }
        self.born + Duration::from_millis(self.last_ms.load(Ordering::Relaxed)) + limit
    }
}

/// One request in flight on a connection.
struct Busy(Arc<Activity>);

impl Busy {
    fn progress(&self) {
        self.0.touch();
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.0.touch();
    }
}

/// A connection's stream, noting each byte that moves in its [`Activity`].
struct Watched<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.touch();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.touch();
        }
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.activity.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A warning printed at most once per [`LOG_EVERY`], saying how many times it happened since
/// its last print (the rest is printed by [`RateLimited::flush`]).
#[derive(Default)]
struct RateLimited {
    /// When it was last printed, and how many since.
    state: Mutex<(Option<Instant>, u64)>,
    latest: Mutex<Option<String>>,
}

impl RateLimited {
    /// Counts one; prints `line(count)` unless a line went out less than [`LOG_EVERY`] ago.
    fn note(&self, line: impl FnOnce(u64) -> String) {
        let mut state = self.state.lock();
        state.1 += 1;
        if state.0.is_some_and(|at| at.elapsed() < LOG_EVERY) {
            *self.latest.lock() = Some(line(state.1));
            return;
        }
        let count = std::mem::take(&mut state.1);
        state.0 = Some(Instant::now());
        *self.latest.lock() = None;
        drop(state);
        tracing::warn!("{}", line(count));
    }

    /// Prints what was counted since the last line.
    fn flush(&self) {
        if let Some(line) = self.latest.lock().take() {
            tracing::warn!("{line}");
        }
    }
}
