//! A decode pool's listening side: binds, accepts producer links, checks each handoff's
//! descriptor against its own layout, receives and checksums the payload, and delivers it to the
//! pool's inbox; an abort goes to the pool and is answered as seen. When the pool runs in a process
//! of its own it also sends each request's events back over the link it came by, and its
//! end-of-run check at the end.

use super::{
    put_status, read_u32, read_u64, write_status, ABORT_FRAME, CHECKSUM_REFUSAL, CLOSE_FRAME, HELLO, TAG_ABORT_SEEN,
    TAG_ACK, TAG_DONE, TAG_EVENTS,
};
use crate::messages::Event;
use crate::pool::emit::EventSink;
use crate::transfer::inproc::{Ack, ConsumerPool};
use crate::transfer::wire::{decode_descriptor, ConsumerLayout, HEADER_BYTES, MAX_HANDOFF_DRAFTS};
use crate::transfer::{read_floats, Crc32c, Handoff, Recycler, TransferId};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How a consumer is set up beyond its pool and layout.
#[derive(Clone, Debug, Default)]
pub struct ConsumerOptions {
    /// Producers must present it (`[transfer] deployment_token`).
    pub token: Option<String>,
    /// The pool runs in a process of its own, fed by this many producer links: once each has
    /// closed, its ingress closes.
    pub expect_links: Option<usize>,
}

/// Writes frames back on one connection.
struct TcpAcker {
    stream: Mutex<TcpStream>,
}

impl TcpAcker {
    fn write(&self, frame: &[u8]) {
        // A connection that is gone loses the frame: the producer's recovery sends again what
        // it did not hear about.
        let mut s = self.stream.lock();
        let _ = s.write_all(frame).and_then(|_| s.flush());
    }
}

impl Ack for TcpAcker {
    fn ack(&self, request: u64, transfer: TransferId, outcome: Result<(), String>) {
        let mut frame = Vec::with_capacity(32);
        frame.push(TAG_ACK);
        frame.extend_from_slice(&request.to_le_bytes());
        frame.extend_from_slice(&transfer.nonce.to_le_bytes());
        frame.extend_from_slice(&transfer.generation.to_le_bytes());
        put_status(&mut frame, &outcome);
        self.write(&frame);
    }
}

/// What the serving threads share.
#[derive(Default)]
struct Shared {
    /// Each producer link's newest connection, by link id: a handoff's ack (and its request's
    /// events) go there, so a link that reconnected hears about what it sent before.
    ackers: Mutex<HashMap<u64, Arc<TcpAcker>>>,
    /// The link each request came by.
    origin: Mutex<HashMap<u64, u64>>,
    /// Links that sent their close frame.
    closed: Mutex<HashSet<u64>>,
    /// Links whose connection ended without their close frame, and when (until they reconnect).
    dropped: Mutex<HashMap<u64, Instant>>,
    connections: AtomicUsize,
}

impl Shared {
    fn acker(&self, link: u64) -> Option<Arc<TcpAcker>> {
        self.ackers.lock().get(&link).cloned()
    }
}

/// The ack of a handoff that came over producer link `link`.
struct LinkAck {
    link: u64,
    shared: Arc<Shared>,
}

impl Ack for LinkAck {
    fn ack(&self, request: u64, transfer: TransferId, outcome: Result<(), String>) {
        if let Some(acker) = self.shared.acker(self.link) {
            acker.ack(request, transfer, outcome);
        }
    }
}

/// A decode pool's listening side.
pub struct TcpConsumer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
}

impl TcpConsumer {
    /// Binds `endpoint` (`host:port`, `[::1]:0`, …) for `pool`, then starts accepting. An error
    /// names the endpoint: registration never goes ahead on a listener that did not bind.
    pub fn bind(
        endpoint: &str,
        pool: ConsumerPool,
        layout: ConsumerLayout,
        options: ConsumerOptions,
    ) -> Result<TcpConsumer, String> {
        let listener = TcpListener::bind(endpoint).map_err(|e| format!("cannot listen on {endpoint}: {e}"))?;
        let addr = listener.local_addr().map_err(|e| format!("{endpoint}: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (stopping, shared) = (stop.clone(), Arc::new(Shared::default()));
        let serving = shared.clone();
        std::thread::Builder::new()
            .name(format!("kvflow-listen-{}", pool.name))
            .spawn(move || {
                for conn in listener.incoming() {
                    if stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(conn) = conn else { continue };
                    let (pool, options, shared) = (pool.clone(), options.clone(), serving.clone());
                    let _ = std::thread::Builder::new().name(format!("kvflow-recv-{}", pool.name)).spawn(move || {
                        shared.connections.fetch_add(1, Ordering::SeqCst);
                        serve(conn, &pool, layout, &options, &shared);
                        shared.connections.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            })
            .map_err(|e| format!("cannot start the listener of {endpoint}: {e}"))?;
        Ok(TcpConsumer { addr, stop, shared })
    }

    /// The address it listens on (the port the kernel picked, for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Producer connections open now, and links that closed.
    pub fn links(&self) -> (usize, usize) {
        (self.shared.connections.load(Ordering::SeqCst), self.shared.closed.lock().len())
    }

    /// Links whose connection ended without a close frame and that have not connected again for
    /// `after` (their producer's process is gone: no close frame will come from it).
    pub fn vanished(&self, after: Duration) -> usize {
        let closed = self.shared.closed.lock();
        self.shared.dropped.lock().iter().filter(|(l, at)| !closed.contains(l) && at.elapsed() >= after).count()
    }

    /// Where a pool in a process of its own sends its events: back over the link each request
    /// came by.
    pub fn events_sink(&self) -> Box<dyn EventSink + Send> {
        Box::new(RemoteEvents { shared: self.shared.clone() })
    }

    /// The pool ended: tells every producer link its end-of-run check.
    pub fn finish(&self, outcome: Result<(), String>) {
        let mut frame = vec![TAG_DONE];
        put_status(&mut frame, &outcome);
        let ackers: Vec<Arc<TcpAcker>> = self.shared.ackers.lock().values().cloned().collect();
        for acker in ackers {
            acker.write(&frame);
        }
    }
}

impl Drop for TcpConsumer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr); // wakes the accept loop so it sees the flag
    }
}

/// A decode pool's events, sent back to the producers their requests came from.
struct RemoteEvents {
    shared: Arc<Shared>,
}

impl EventSink for RemoteEvents {
    fn events(&mut self, _step: u64, events: Vec<Event>) {
        let mut by_link: HashMap<u64, Vec<Event>> = HashMap::new();
        {
            let origin = self.shared.origin.lock();
            for e in events {
                match origin.get(&e.id()) {
                    Some(&link) => by_link.entry(link).or_default().push(e),
                    None => tracing::warn!(request = e.id(), "event of a request that came by no link: dropped"),
                }
            }
        }
        for (link, events) in by_link {
            let Ok(body) = serde_json::to_vec(&events) else { continue };
            let mut frame = Vec::with_capacity(5 + body.len());
            frame.push(TAG_EVENTS);
            frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
            frame.extend_from_slice(&body);
            if let Some(acker) = self.shared.acker(link) {
                acker.write(&frame);
            }
        }
    }
}

/// Reads the registration: the producer's fingerprint, token and link id, checked.
fn register(
    conn: &mut TcpStream,
    pool: &str,
    layout: &ConsumerLayout,
    token: Option<&str>,
) -> std::io::Result<Result<u64, String>> {
    if read_u32(conn)? != HELLO {
        return Ok(Err("not a kvflow producer".into()));
    }
    let fingerprint = read_u64(conn)?;
    let mut len = [0; 2];
    conn.read_exact(&mut len)?;
    let mut presented = vec![0; u16::from_le_bytes(len) as usize];
    conn.read_exact(&mut presented)?;
    let link = read_u64(conn)?;
    if fingerprint != layout.fingerprint {
        return Ok(Err(format!(
            "layout fingerprint {fingerprint:#018x} differs from decode pool {pool}'s {:#018x}",
            layout.fingerprint
        )));
    }
    if token.is_some_and(|t| t.as_bytes() != presented) {
        return Ok(Err(format!("decode pool {pool} refused the deployment token")));
    }
    Ok(Ok(link))
}

/// One producer connection: registration, then frames until it closes.
fn serve(
    mut conn: TcpStream,
    pool: &ConsumerPool,
    layout: ConsumerLayout,
    options: &ConsumerOptions,
    shared: &Arc<Shared>,
) {
    let _ = conn.set_nodelay(true);
    let Ok(registered) = register(&mut conn, &pool.name, &layout, options.token.as_deref()) else { return };
    // The acker is in place before the status goes out: the producer opens its next connection
    // only after reading this one's status, so a link's connections register in order and acks
    // go to the newest. (Registered after the status, a preempted older connection could
    // overwrite a newer one with a socket already closed, and every later ack would be lost.)
    if let Ok(link) = &registered {
        let Ok(back) = conn.try_clone() else { return };
        shared.ackers.lock().insert(*link, Arc::new(TcpAcker { stream: Mutex::new(back) }));
    }
    if write_status(&mut conn, &registered.as_ref().map(|_| ()).map_err(Clone::clone)).is_err() {
        return;
    }
    let Ok(link) = registered else { return };
    shared.dropped.lock().remove(&link);
    serve_frames(conn, link, pool, layout, options, shared);
    if !shared.closed.lock().contains(&link) {
        shared.dropped.lock().insert(link, Instant::now());
    }
}

/// A registered producer link's frames, until its connection ends.
fn serve_frames(
    mut conn: TcpStream,
    link: u64,
    pool: &ConsumerPool,
    layout: ConsumerLayout,
    options: &ConsumerOptions,
    shared: &Arc<Shared>,
) {
    let acker: Arc<dyn Ack> = Arc::new(LinkAck { link, shared: shared.clone() });
    let max_descriptor = HEADER_BYTES + 4 * (layout.max_prompt + MAX_HANDOFF_DRAFTS);
    let recycler = Recycler::default();
    while let Ok(len) = read_u32(&mut conn) {
        if len == ABORT_FRAME {
            let Ok(request) = read_u64(&mut conn) else { return };
            if read_u64(&mut conn).and_then(|_| read_u32(&mut conn)).is_err() {
                return;
            }
            pool.abort(request);
            // Said back, so the producer stops sending it again after a reconnection.
            if let Some(back) = shared.acker(link) {
                let mut frame = vec![TAG_ABORT_SEEN];
                frame.extend_from_slice(&request.to_le_bytes());
                back.write(&frame);
            }
            continue;
        }
        if len == CLOSE_FRAME {
            let mut closed = shared.closed.lock();
            closed.insert(link);
            if options.expect_links.is_some_and(|n| closed.len() >= n) {
                pool.ingress.close();
            }
            continue;
        }
        let len = len as usize;
        if len > max_descriptor {
            tracing::error!(pool = %pool.name, len, "handoff descriptor longer than any this pool takes: connection closed");
            return;
        }
        let mut descriptor = vec![0; len];
        if conn.read_exact(&mut descriptor).is_err() {
            return;
        }
        let d = match decode_descriptor(&descriptor, &layout) {
            Ok((d, _)) => d,
            Err(e) => {
                // The payload's length is unknown: the stream cannot be resynchronised.
                tracing::error!(pool = %pool.name, "handoff refused: {e}; connection closed");
                return;
            }
        };
        // Receive the payload, checksumming as it arrives.
        let (kv_floats, state_floats) =
            (d.kv_blocks * layout.floats_per_block, if d.has_state { layout.state_floats } else { 0 });
        let mut crc = Crc32c::new();
        let mut floats = recycler.take(kv_floats + state_floats);
        let checked = d.checked;
        if read_floats(&mut conn, &mut floats, |bytes| {
            if checked {
                crc.update(bytes)
            }
        })
        .is_err()
        {
            return;
        }
        let Ok(sent_crc) = read_u32(&mut conn) else { return };
        if d.checked && crc.value() != sent_crc {
            let why =
                format!("{CHECKSUM_REFUSAL} {:#010x}, expected {sent_crc:#010x}: the bytes were damaged", crc.value());
            acker.ack(d.request, d.transfer, Err(why));
            continue;
        }
        let state = d.has_state.then(|| floats.split_off(kv_floats));
        let h = Handoff {
            transfer: d.transfer,
            request: d.request,
            prompt: d.prompt,
            max_output_tokens: d.max_output_tokens,
            warmup: d.warmup,
            sampling: d.sampling,
            drafts: d.drafts,
            delivery: d.delivery,
            t0: d.t0,
            logits_hash: d.logits_hash,
            fingerprint: layout.fingerprint,
            skip_blocks: d.skip_blocks,
            kv_blocks: d.kv_blocks,
            floats_per_block: layout.floats_per_block,
            kv: floats,
            source: None,
            state,
            started_ms: d.started_ms,
            t0_ms: d.t0_ms,
            to: d.to_rank.map(|rank| crate::messages::BackTo { link: 0, rank, skip_blocks: d.skip_blocks as u32 }),
            recycle: Some(recycler.clone()),
            on_drop: Default::default(),
        };
        shared.origin.lock().insert(h.request, link);
        pool.deliver(Arc::new(h), acker.clone());
    }
}
