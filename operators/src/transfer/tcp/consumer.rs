//! A decode pool's listening side: binds, accepts producer links, checks each handoff's
//! descriptor against its own layout, receives and checksums the payload, and delivers it to the
//! pool's inbox; an abort goes to the pool and is answered as seen. When the pool runs in a process
//! of its own it also sends each request's events back over the link it came by, and its
//! end-of-run check at the end.
//!
//! Who may connect: a producer presenting the layout fingerprint and the deployment token, and no
//! more distinct links than the graph links into the pool (`max_links`): one beyond them is
//! refused at registration, at once, and told why. Every refusal is logged with the peer's
//! address (never the token it presented). A link whose connections have all ended without its
//! close frame, and that has not connected again within the reconnect window, is lost
//! ([`TcpConsumer::lose_vanished`]): the requests it handed off that are still here are cancelled
//! at once, and it may not come back.

use super::frames::{self, ToConsumer, ToProducer};
use super::landing::land;
use super::pieces::{self, PIECES_REFUSAL};
use super::{read_u32, write_status, CHECKSUM_REFUSAL};
use crate::messages::Event;
use crate::pool::emit::EventSink;
use crate::transfer::inproc::{Ack, ConsumerPool};
use crate::transfer::stream::{check_cover, zeros_for_missing, StagedPieces};
use crate::transfer::wire::{ConsumerLayout, Descriptor};
use crate::transfer::{read_floats, Crc32c, Handoff, Recycler, TransferCounters, TransferId};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a connection may take to register (a peer that connects and says nothing is
/// dropped, not waited on).
const REGISTRATION_TIMEOUT: Duration = Duration::from_secs(10);

/// How a consumer is set up beyond its pool and layout.
#[derive(Clone, Debug, Default)]
pub struct ConsumerOptions {
    /// Producers must present it (`[transfer] deployment_token`).
    pub token: Option<String>,
    /// The pool runs in a process of its own, fed by this many producer links: once each has
    /// closed, its ingress closes.
    pub expect_links: Option<usize>,
    /// How many distinct producer links it takes (`None`: any number); a producer registering
    /// a link beyond them is refused.
    pub max_links: Option<usize>,
    /// A cuda pool's: where each handoff's KV lands in device memory as it arrives (else it is
    /// received into host memory), and the counters that count it.
    pub landing: Option<(Arc<kvflow_kernels::cuda::Landing>, Arc<crate::transfer::TransferCounters>)>,
}

/// A producer link as the consumer knows it.
struct LinkState {
    /// Where its newest connection came from.
    peer: SocketAddr,
    /// Its connections open now.
    open: usize,
    /// It sent its close frame.
    closed: bool,
    /// When its last connection ended without the close frame (until it connects again).
    dropped_at: Option<Instant>,
    /// It was counted as lost: its requests were cancelled, and it may not register again.
    lost: bool,
}

/// A producer link lost: its connections ended without its close frame and it did not come back.
#[derive(Clone, Debug)]
pub struct LostProducer {
    /// Where its last connection came from.
    pub peer: SocketAddr,
    /// The requests it handed off that failed with it: still here (cancelled when it was found
    /// lost), or ended here after it went (their end never reached it).
    pub requests: Vec<u64>,
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
        let (nonce, generation, refused) = (transfer.nonce, transfer.generation, outcome.err());
        self.write(&frames::encode(&ToProducer::Ack { request, nonce, generation, refused }));
    }
}

/// What the serving threads share.
#[derive(Default)]
struct Shared {
    /// Each producer link's newest connection, by link id: a handoff's ack (and its request's
    /// events) go there, so a link that reconnected hears about what it sent before.
    ackers: Mutex<HashMap<u64, Arc<TcpAcker>>>,
    /// The link each request still here came by (until its end event).
    origin: Mutex<HashMap<u64, u64>>,
    /// Every producer link that registered, by link id.
    links: Mutex<HashMap<u64, LinkState>>,
    connections: AtomicUsize,
    /// The pool takes no more handoffs (it is ending): one arriving is refused at once.
    stopped_taking: AtomicBool,
    /// Events of requests whose link has no connection now, by link: written when it
    /// reconnects; if it is lost, the requests they end are named with the others it lost.
    parked: Mutex<HashMap<u64, Vec<Event>>>,
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
    pool: ConsumerPool,
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
        let (serving, consumer) = (shared.clone(), pool.clone());
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
        Ok(TcpConsumer { addr, stop, shared, pool: consumer })
    }

    /// The address it listens on (the port the kernel picked, for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Producer connections open now, links that closed, and links lost.
    pub fn links(&self) -> (usize, usize, usize) {
        let links = self.shared.links.lock();
        let closed = links.values().filter(|l| l.closed).count();
        let lost = links.values().filter(|l| l.lost).count();
        (self.shared.connections.load(Ordering::SeqCst), closed, lost)
    }

    /// Finds the links whose connections all ended without their close frame and that have not
    /// connected again within `window` (their producer's process is gone: a link that dropped
    /// on its own reconnects at once): each is lost from now on, and the requests it handed off
    /// that are still here are cancelled in the pool, at once. The links newly lost, each with
    /// those requests and the ones that ended here after it went (their end never reached it).
    pub fn lose_vanished(&self, window: Duration) -> Vec<LostProducer> {
        let mut newly = Vec::new();
        {
            let mut links = self.shared.links.lock();
            for (&id, link) in links.iter_mut() {
                let gone = link.open == 0 && !link.closed && !link.lost;
                if gone && link.dropped_at.is_some_and(|at| at.elapsed() >= window) {
                    link.lost = true;
                    newly.push((id, link.peer));
                }
            }
        }
        newly
            .into_iter()
            .map(|(link, peer)| {
                let mut requests: Vec<u64> =
                    self.shared.origin.lock().iter().filter(|(_, &l)| l == link).map(|(&r, _)| r).collect();
                for &request in &requests {
                    self.pool.abort(request);
                }
                // Requests that ended here after it went: their end never reached it.
                let parked = self.shared.parked.lock().remove(&link).unwrap_or_default();
                let ended = parked.iter().filter(|e| matches!(e, Event::Finished { .. } | Event::Failed { .. }));
                requests.extend(ended.map(Event::id));
                requests.sort_unstable();
                requests.dedup();
                tracing::error!(
                    pool = %self.pool.name,
                    "the producer link from {peer} is lost: its connection closed without a close frame and it did not \
                     reconnect within {} ms; {} request(s) it handed off failed here (cancelled, or ended unheard)",
                    window.as_millis(),
                    requests.len()
                );
                LostProducer { peer, requests }
            })
            .collect()
    }

    /// The pool is ending: a handoff arriving from now on is refused at once (its producer
    /// fails the request, naming this pool), not left in an inbox nobody takes from.
    pub fn stop_taking(&self) {
        self.shared.stopped_taking.store(true, Ordering::SeqCst);
    }

    /// Cancels every request still here (a served pool whose grace period ran out); how many.
    pub fn cancel_all(&self) -> usize {
        let requests: Vec<u64> = self.shared.origin.lock().keys().copied().collect();
        for &request in &requests {
            self.pool.abort(request);
        }
        requests.len()
    }

    /// Where a pool in a process of its own sends its events: back over the link each request
    /// came by.
    pub fn events_sink(&self) -> Box<dyn EventSink + Send> {
        Box::new(RemoteEvents { shared: self.shared.clone() })
    }

    /// The pool ended: tells every producer link its end-of-run check.
    pub fn finish(&self, outcome: Result<(), String>) {
        let frame = frames::encode(&ToProducer::Done { failed: outcome.err() });
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
            let mut origin = self.shared.origin.lock();
            for e in events {
                let ended = matches!(e, Event::Finished { .. } | Event::Failed { .. });
                let link = if ended { origin.remove(&e.id()) } else { origin.get(&e.id()).copied() };
                match link {
                    Some(link) => by_link.entry(link).or_default().push(e),
                    None => tracing::warn!(request = e.id(), "event of a request that came by no link: dropped"),
                }
            }
        }
        for (link, events) in by_link {
            // A link with no connection now keeps its events until it reconnects (or is lost):
            // checked and parked under the parked lock, which a reconnection takes to flush.
            let acker = {
                let mut parked = self.shared.parked.lock();
                let acker = self.shared.acker(link);
                if acker.is_none() {
                    parked.entry(link).or_default().extend(events.iter().cloned());
                }
                acker
            };
            if let Some(acker) = acker {
                acker.write(&events_frame(&events));
            }
        }
    }
}

/// An events frame.
fn events_frame(events: &[Event]) -> Vec<u8> {
    frames::encode(&ToProducer::Events(events.to_vec()))
}

/// Reads the registration: the producer's fingerprint, token and link id, checked.
fn register(
    conn: &mut TcpStream,
    pool: &str,
    layout: &ConsumerLayout,
    token: Option<&str>,
) -> std::io::Result<Result<u64, String>> {
    let hello = match frames::read_hello(conn)? {
        Ok(hello) => hello,
        Err(why) => return Ok(Err(why)),
    };
    let (fingerprint, presented, link) = (hello.fingerprint, hello.token, hello.link_id);
    if fingerprint != layout.fingerprint {
        return Ok(Err(format!(
            "layout fingerprint {fingerprint:#018x} differs from decode pool {pool}'s {:#018x}",
            layout.fingerprint
        )));
    }
    if token.is_some_and(|t| t != presented) {
        return Ok(Err(format!("decode pool {pool} refused the deployment token")));
    }
    Ok(Ok(link))
}

/// Admits link `link` from `peer` among the pool's producer links: a link it knows (a
/// reconnection), or a new one while fewer than `max_links` registered. A lost link may not come
/// back (its requests were cancelled here).
fn admit_link(
    shared: &Shared,
    pool: &str,
    link: u64,
    peer: SocketAddr,
    max_links: Option<usize>,
) -> Result<(), String> {
    let mut links = shared.links.lock();
    if let Some(known) = links.get_mut(&link) {
        if known.lost {
            return Err(format!(
                "decode pool {pool} counted this producer link as lost (it did not reconnect in time) and cancelled \
                 its requests; it takes no more from it"
            ));
        }
        (known.peer, known.dropped_at) = (peer, None);
        known.open += 1;
        return Ok(());
    }
    if let Some(max) = max_links.filter(|&max| links.len() >= max) {
        return Err(format!(
            "decode pool {pool} already serves the {max} producer connection(s) its graph links into it \
             ([transfer] connections per link, from each process of the linked prefill pools); an unexpected \
             producer is refused"
        ));
    }
    links.insert(link, LinkState { peer, open: 1, closed: false, dropped_at: None, lost: false });
    Ok(())
}

/// One producer connection: registration (within [`REGISTRATION_TIMEOUT`]), then frames until it
/// closes. A refusal is answered, and logged with the peer's address.
fn serve(
    mut conn: TcpStream,
    pool: &ConsumerPool,
    layout: ConsumerLayout,
    options: &ConsumerOptions,
    shared: &Arc<Shared>,
) {
    let _ = conn.set_nodelay(true);
    let peer = conn.peer_addr().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let _ = conn.set_read_timeout(Some(REGISTRATION_TIMEOUT));
    let registered = match register(&mut conn, &pool.name, &layout, options.token.as_deref()) {
        Ok(registered) => registered,
        Err(e) => {
            tracing::warn!(pool = %pool.name, "a connection from {peer} ended before it registered: {e}");
            return;
        }
    };
    let _ = conn.set_read_timeout(None);
    let registered =
        registered.and_then(|link| admit_link(shared, &pool.name, link, peer, options.max_links).map(|()| link));
    let mut flush = Vec::new();
    if let Err(why) = &registered {
        tracing::warn!(pool = %pool.name, "refused a producer connecting from {peer}: {why}");
    }
    // The acker is in place before the status goes out: the producer opens its next connection
    // only after reading this one's status, so a link's connections register in order and acks
    // go to the newest. (Registered after the status, a preempted older connection could
    // overwrite a newer one with a socket already closed, and every later ack would be lost.)
    if let Ok(link) = &registered {
        let Ok(back) = conn.try_clone() else { return connection_ended(shared, *link) };
        let acker = Arc::new(TcpAcker { stream: Mutex::new(back) });
        let missed = {
            let mut parked = shared.parked.lock();
            shared.ackers.lock().insert(*link, acker.clone());
            parked.remove(link)
        };
        // What its requests said while it had no connection (after the status, below).
        if let Some(missed) = missed {
            flush.push(missed);
        }
    }
    let answered = write_status(&mut conn, &registered.as_ref().map(|_| ()).map_err(Clone::clone));
    let Ok(link) = registered else { return };
    if let (Ok(()), Some(acker)) = (&answered, shared.acker(link)) {
        for events in flush {
            acker.write(&events_frame(&events));
        }
    }
    if answered.is_ok() {
        serve_frames(conn, link, pool, layout, options, shared);
    }
    connection_ended(shared, link);
}

/// One of link `link`'s connections ended: the last one without its close frame starts the
/// reconnect window.
fn connection_ended(shared: &Shared, link: u64) {
    let mut links = shared.links.lock();
    if let Some(state) = links.get_mut(&link) {
        state.open = state.open.saturating_sub(1);
        if state.open == 0 && !state.closed {
            state.dropped_at = Some(Instant::now());
            // Its events wait for a reconnection from now on, rather than go to a dead socket.
            let _parked = shared.parked.lock();
            shared.ackers.lock().remove(&link);
        }
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
    let recycler = Recycler::default();
    // Pieces of streamed handoffs that came by this connection (they go with it).
    let mut staged = StagedPieces::default();
    loop {
        let frame = match frames::read_to_consumer(&mut conn) {
            Ok(frame) => frame,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                // What follows cannot be found again in the stream.
                return tracing::error!(pool = %pool.name, "a frame refused: {e}; connection closed");
            }
            Err(_) => return, // the connection ended
        };
        let w = match frame {
            ToConsumer::Handoff(w) => w,
            ToConsumer::Piece(header) => {
                match pieces::read_piece(&mut conn, header, &layout, options.landing.as_ref().map(|(l, _)| &**l)) {
                    Ok(Ok(piece)) => {
                        TransferCounters::bump(&pool.inbox.counters.pieces_staged);
                        if let (Some(_), Some((_, counters))) = (&piece.landed, &options.landing) {
                            TransferCounters::bump(&counters.pieces_landed_on_device);
                        }
                        staged.put(piece);
                    }
                    // Not staged: its handoff will be refused and sent again whole.
                    Ok(Err(why)) => tracing::warn!(pool = %pool.name, "a streamed piece was damaged ({why}): dropped"),
                    Err(e) => {
                        return tracing::error!(pool = %pool.name, "a streamed piece refused: {e}; connection closed")
                    }
                }
                continue;
            }
            ToConsumer::DropPieces { request, .. } => {
                staged.drop_request(request);
                continue;
            }
            ToConsumer::Abort { request, .. } => {
                staged.drop_request(request);
                pool.abort(request);
                // Said back, so the producer stops sending it again after a reconnection.
                if let Some(back) = shared.acker(link) {
                    back.write(&frames::encode(&ToProducer::AbortSeen { request }));
                }
                continue;
            }
            ToConsumer::Close => {
                link_closed(shared, link, pool, options);
                continue;
            }
        };
        let d = match w.check(&layout) {
            Ok(d) => d,
            Err(e) => {
                // The payload's length is unknown: the stream cannot be resynchronised.
                return tracing::error!(pool = %pool.name, "handoff refused: {e}; connection closed");
            }
        };
        // Pieces sent ahead, all of them staged, or the handoff is refused (after its payload is
        // read, so the stream stays in step) and sent again whole.
        let mut streamed = staged.take(d.request, d.transfer);
        let per_block = d.floats_per_block(&layout);
        let cover = check_cover(&streamed, d.streamed_blocks, per_block);
        if cover.is_err() && pool.inbox.accept_missing_pieces {
            streamed = zeros_for_missing(streamed, d.streamed_blocks, per_block);
            // test switch
        }
        let payload = match receive_payload(&mut conn, &d, &layout, options, &recycler) {
            Err(()) => return,
            Ok(Err(why)) => {
                acker.ack(d.request, d.transfer, Err(why));
                continue;
            }
            Ok(Ok(_)) if cover.is_err() && !pool.inbox.accept_missing_pieces => {
                TransferCounters::bump(&pool.inbox.counters.refused_for_pieces);
                let why = cover.err().map(|e| e.to_string()).unwrap_or_default();
                acker.ack(d.request, d.transfer, Err(format!("{PIECES_REFUSAL}: {why}")));
                continue;
            }
            Ok(Ok(payload)) => payload,
        };
        if let (Some(_), Some((_, counters))) = (&payload.landed, &options.landing) {
            TransferCounters::bump(&counters.landed_on_device);
        }
        let h = handoff_of(d, &layout, streamed, payload, &recycler);
        if shared.stopped_taking.load(Ordering::SeqCst) {
            let why = format!("decode pool {} is ending and takes no more handoffs", pool.name);
            acker.ack(h.request, h.transfer, Err(why));
            continue;
        }
        shared.origin.lock().insert(h.request, link);
        pool.deliver(Arc::new(h), acker.clone());
    }
}

/// Link `link` sent its close frame: once every link the pool expects has, its ingress closes.
fn link_closed(shared: &Shared, link: u64, pool: &ConsumerPool, options: &ConsumerOptions) {
    let mut links = shared.links.lock();
    if let Some(state) = links.get_mut(&link) {
        state.closed = true;
    }
    let closed = links.values().filter(|l| l.closed).count();
    if options.expect_links.is_some_and(|n| closed >= n) {
        pool.ingress.close();
    }
}

/// The handoff descriptor `d` names, with the pieces it streamed ahead and its payload.
fn handoff_of(
    d: Descriptor,
    layout: &ConsumerLayout,
    streamed: Vec<Arc<crate::transfer::KvPiece>>,
    payload: Payload,
    recycler: &Recycler,
) -> Handoff {
    Handoff {
        transfer: d.transfer,
        request: d.request,
        fingerprint: layout.fingerprint,
        skip_blocks: d.skip_blocks,
        kv_blocks: d.kv_blocks,
        block_size: d.block_size,
        floats_per_block: d.floats_per_block(layout),
        streamed,
        kv: payload.kv,
        source: None,
        landed: payload.landed,
        state: payload.state,
        started_ms: d.started_ms,
        t0_ms: d.t0_ms,
        to: d.to_rank.map(|rank| crate::messages::BackTo { link: 0, rank, skip_tokens: d.to_skip_tokens }),
        recycle: Some(recycler.clone()),
        on_drop: Default::default(),
        simulated: None,
        prompt: d.prompt,
        max_output_tokens: d.max_output_tokens,
        warmup: d.warmup,
        sampling: d.sampling,
        drafts: d.drafts,
        delivery: d.delivery,
        t0: d.t0,
        logits_hash: d.logits_hash,
    }
}

/// A handoff's payload as received: its KV (in host memory, or landed in device memory) and its
/// state.
struct Payload {
    kv: Vec<f32>,
    landed: Option<crate::transfer::Landed>,
    state: Option<Vec<f32>>,
}

/// Receives `d`'s payload and checksum from `conn`, checksumming as it arrives: the KV lands in
/// device memory piece by piece when the pool has a landing. `Err(())`: the connection ended;
/// `Ok(Err(why))`: the handoff is refused (damaged bytes, or a device that failed to take them).
fn receive_payload(
    conn: &mut impl std::io::Read,
    d: &crate::transfer::Descriptor,
    layout: &ConsumerLayout,
    options: &ConsumerOptions,
    recycler: &Recycler,
) -> Result<Result<Payload, String>, ()> {
    let kv_blocks = d.kv_blocks - d.streamed_blocks;
    let (kv_floats, state_floats) =
        (kv_blocks * d.floats_per_block(layout), if d.has_state { layout.state_floats } else { 0 });
    let mut crc = Crc32c::new();
    let mut seen = |bytes: &[u8]| {
        if d.checked {
            crc.update(bytes)
        }
    };
    // (the blocks after a streamed handoff's pieces land as the pieces did; blocks of another
    // size are re-cut on the host)
    let own_blocks = d.block_size == layout.block_size;
    let (mut floats, landed) = match options.landing.as_ref().filter(|_| own_blocks) {
        Some((landing, _)) => {
            let landed = land(conn, landing, kv_floats, &mut seen).map_err(|_| ())?;
            let mut state = recycler.take(state_floats);
            read_floats(conn, &mut state, &mut seen).map_err(|_| ())?;
            (state, Some(landed))
        }
        None => {
            let mut floats = recycler.take(kv_floats + state_floats);
            read_floats(conn, &mut floats, &mut seen).map_err(|_| ())?;
            (floats, None)
        }
    };
    let sent_crc = read_u32(conn).map_err(|_| ())?;
    if d.checked && crc.value() != sent_crc {
        let why =
            format!("{CHECKSUM_REFUSAL} {:#010x}, expected {sent_crc:#010x}: the bytes were damaged", crc.value());
        return Ok(Err(why));
    }
    Ok(Ok(match landed {
        Some(Err(why)) => return Ok(Err(format!("landing the handoff in device memory: {why}"))),
        // landed: `floats` holds the state alone
        Some(Ok(landed)) => Payload {
            kv: Vec::new(),
            landed: Some(crate::transfer::Landed(Arc::new(landed))),
            state: d.has_state.then_some(floats),
        },
        None => {
            let state = d.has_state.then(|| floats.split_off(kv_floats));
            Payload { kv: floats, landed: None, state }
        }
    }))
}
