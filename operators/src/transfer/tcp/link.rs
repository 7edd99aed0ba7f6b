//! A prefill pool's link to one decode pool over tcp (one of the `[transfer] connections` a
//! prefill pool opens to each decode pool): registers, then sends every handoff from a thread of
//! its own and keeps it until its ack, and every abort until the consumer says it has it;
//! reconnects when the connection drops and sends again what was unanswered and the aborts not
//! yet seen; and, when the decode pool runs in another process, hands the events coming back to
//! the run's collector, failing the requests a vanished peer still owed. Runs on its own threads,
//! never on a rank's step; what it sends it owns (an `Arc` of the handoff).

use super::frames::{self, Hello, ToConsumer, ToProducer};
use super::pieces;
use super::{read_status, CHECKSUM_REFUSAL};
use crate::messages::BackTo;
use crate::messages::Event;
use crate::pool::emit::EventSink;
use crate::transfer::faults::{Fault, Faults, TransferCounters};
use crate::transfer::inproc::{link_of, Ack, AckQueue, HandoffSink};
use crate::transfer::wire::WireDescriptor;
use crate::transfer::{stream_payload, Handoff, KvPiece, LinkRate, TransferId};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A clock reading that differs between processes started apart (seeds link ids).
fn messages_clock() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Where a producer connects and how it registers.
#[derive(Clone, Debug)]
pub struct LinkTarget {
    /// The decode pool's name.
    pub to: String,
    pub addr: SocketAddr,
    pub fingerprint: u64,
    pub token: Option<String>,
    /// Names this link to the consumer across its reconnections (set by [`TcpLink::connect`]).
    pub link_id: u64,
}

impl LinkTarget {
    fn describe(&self) -> String {
        format!("decode pool {} at {}", self.to, self.addr)
    }

    /// Connects and registers (fingerprint, token); the error names the peer, and says whether
    /// the consumer refused the registration (final: trying again gets the same answer).
    fn connect(&self) -> Result<TcpStream, ConnectFailure> {
        let where_ = self.describe();
        let failed = |why: String| ConnectFailure { why, refused: false };
        let mut stream =
            TcpStream::connect(self.addr).map_err(|e| failed(format!("cannot connect to {where_}: {e}")))?;
        let _ = stream.set_nodelay(true);
        let token = self.token.clone().unwrap_or_default();
        let hello = Hello { fingerprint: self.fingerprint, token, link_id: self.link_id };
        frames::write_hello(&mut stream, &hello).map_err(|e| failed(format!("{where_}: {e}")))?;
        read_status(&mut stream).map_err(|e| failed(format!("{where_}: {e}")))?.map_err(|why| ConnectFailure {
            why: format!("{where_} refused the registration: {why}"),
            refused: true,
        })?;
        Ok(stream)
    }
}

/// Why a connection to a consumer failed.
struct ConnectFailure {
    why: String,
    /// The consumer answered and refused the registration (not worth trying again).
    refused: bool,
}

/// A handoff sent and not answered yet.
struct Unanswered {
    handoff: Arc<Handoff>,
    ack: Arc<AckQueue>,
    /// 0 for the first send, 1 for the retry.
    attempt: u32,
    /// The connection it was last written on (`None`: queued to be written).
    sent_on: Option<u64>,
    /// Whether the connection dropped while it was being written (it is the one retried once).
    cut: bool,
    /// Times it was sent again, whole, after a drop that cut another transfer (bounded too).
    resends: u32,
    /// Sent with the pieces streamed ahead in its payload (a resend, or a consumer that lacked
    /// some of them).
    whole: bool,
}

/// How often a transfer that was written whole is sent again after drops that cut others.
const MAX_RESENDS: u32 = 3;

/// What the sending thread does next.
enum Job {
    Send(u64),
    Piece(Arc<KvPiece>),
    DropPieces(u64, TransferId),
    Abort(u64, TransferId),
    Close,
}

/// The current connection's writing half.
struct Conn {
    stream: Option<TcpStream>,
    epoch: u64,
}

struct LinkShared {
    target: LinkTarget,
    checksum: bool,
    faults: Faults,
    counters: Arc<TransferCounters>,
    socket_bytes: Arc<AtomicU64>,
    rate: Option<Arc<LinkRate>>,
    /// The writing half, held by the sending thread for a whole handoff (paced at the link's
    /// rate): the rank's thread never takes it.
    conn: Mutex<Conn>,
    /// Set when the peer is gone for good: later sends fail with it at once.
    dead: Mutex<Option<String>>,
    unanswered: Mutex<HashMap<u64, Unanswered>>,
    /// Where answered requests' acks went (a duplicate ack goes there too, to be dropped and
    /// counted by the rank).
    answered: Mutex<HashMap<u64, Arc<AckQueue>>>,
    jobs: Mutex<Sender<Job>>,
    /// Aborts sent that the consumer has not said it has: sent again on a new connection (a
    /// decode rank waiting for a remote prefill that failed hears of it only by its abort).
    aborts: Mutex<HashMap<u64, TransferId>>,
    /// A decode pool in another process: where its events go, and the requests it took whose
    /// end has not come back yet (failed if the peer vanishes).
    remote: Mutex<Option<RemoteEnd>>,
    /// The remote pool's end-of-run check, once it sent it.
    done: Mutex<Option<Result<(), String>>>,
}

struct RemoteEnd {
    sink: Box<dyn EventSink + Send>,
    owed: HashSet<u64>,
}

/// A prefill pool's connection to one decode pool.
pub struct TcpLink {
    shared: Arc<LinkShared>,
}

/// How a link is set up beyond its target.
#[derive(Default)]
pub struct LinkOptions {
    /// Checksum every payload (`[transfer] checksum`).
    pub checksum: bool,
    pub faults: Faults,
    pub counters: Arc<TransferCounters>,
    pub socket_bytes: Arc<AtomicU64>,
    /// The decode pool runs in another process: its requests' events come back over the link
    /// and go here.
    pub events: Option<Box<dyn EventSink + Send>>,
    /// How long to keep trying to reach a consumer that is not listening yet (saying so every
    /// 10 s); zero: one try.
    pub patience: Duration,
    /// The link's rate (`[[link]] bandwidth`), shared by its connections: each piece of a
    /// handoff leaves once the bytes before it would have at that rate.
    pub rate: Option<Arc<LinkRate>>,
}

/// How often a link waiting for its consumer says so.
const CONNECT_NOTICE: Duration = Duration::from_secs(10);

impl TcpLink {
    /// Connects to `target` and registers, then starts the link's sending and ack threads.
    pub fn connect(mut target: LinkTarget, options: LinkOptions) -> Result<TcpLink, String> {
        static LINKS: AtomicU64 = AtomicU64::new(1);
        let here = kvflow_kernels::hash::mix(u64::from(std::process::id()), messages_clock());
        target.link_id = kvflow_kernels::hash::mix(here, LINKS.fetch_add(1, Ordering::Relaxed));
        let stream = connect_patiently(&target, options.patience)?;
        let reading = stream.try_clone().map_err(|e| format!("{}: {e}", target.describe()))?;
        let (jobs, queue) = channel();
        let shared = Arc::new(LinkShared {
            target,
            checksum: options.checksum,
            faults: options.faults,
            counters: options.counters,
            socket_bytes: options.socket_bytes,
            rate: options.rate,
            conn: Mutex::new(Conn { stream: Some(stream), epoch: 0 }),
            dead: Mutex::new(None),
            unanswered: Default::default(),
            answered: Default::default(),
            jobs: Mutex::new(jobs),
            aborts: Default::default(),
            remote: Mutex::new(options.events.map(|sink| RemoteEnd { sink, owed: HashSet::new() })),
            done: Mutex::new(None),
        });
        let name = shared.target.to.clone();
        let sending = shared.clone();
        std::thread::Builder::new()
            .name(format!("kvflow-send-{name}"))
            .spawn(move || send_loop(&sending, queue))
            .map_err(|e| format!("cannot start the sending thread of link to {name}: {e}"))?;
        let reader = shared.clone();
        std::thread::Builder::new()
            .name(format!("kvflow-acks-{name}"))
            .spawn(move || ack_loop(&reader, reading, 0))
            .map_err(|e| format!("cannot start the ack thread of link to {name}: {e}"))?;
        Ok(TcpLink { shared })
    }

    /// Queues `h` for sending; `ack` hears the consumer's answer, or the failure.
    pub fn send_arc(&self, h: Arc<Handoff>, ack: Arc<AckQueue>) -> Result<String, String> {
        let s = &self.shared;
        if let Some(why) = s.dead.lock().clone() {
            return Err(why);
        }
        let request = h.request;
        let u = Unanswered { handoff: h, ack, attempt: 0, sent_on: None, cut: false, resends: 0, whole: false };
        s.unanswered.lock().insert(request, u);
        let _ = s.jobs.lock().send(Job::Send(request));
        Ok(s.target.to.clone())
    }

    /// This link's pool ended: tells the consumer no more handoffs come on it.
    pub fn close(&self) {
        let _ = self.shared.jobs.lock().send(Job::Close);
    }

    /// The remote decode pool's end-of-run check, once it sent it (`None`: not yet, or it is
    /// gone — then its requests were failed).
    pub fn remote_outcome(&self) -> Option<Result<(), String>> {
        self.shared.done.lock().clone()
    }

    /// Whether a remote decode pool is done with this link: it sent its end-of-run check, or it
    /// is gone (its requests failed). Always true for a pool of this process.
    pub fn finished(&self) -> bool {
        self.shared.remote.lock().is_none()
    }

    /// The address it sends to.
    pub fn addr(&self) -> SocketAddr {
        self.shared.target.addr
    }

    /// The decode pool this link goes to.
    pub fn to(&self) -> &str {
        &self.shared.target.to
    }
}

/// Connects and registers, trying again for up to `patience` while the consumer is not there.
fn connect_patiently(target: &LinkTarget, patience: Duration) -> Result<TcpStream, String> {
    let started = Instant::now();
    let mut noticed = Instant::now();
    loop {
        match target.connect() {
            Ok(stream) => return Ok(stream),
            Err(ConnectFailure { why, refused: true }) => return Err(why),
            Err(ConnectFailure { why: e, .. }) if started.elapsed() >= patience => {
                return Err(if patience.is_zero() {
                    e
                } else {
                    format!("{e} (tried for {} s)", started.elapsed().as_secs())
                })
            }
            Err(ConnectFailure { why: e, .. }) => {
                if noticed.elapsed() >= CONNECT_NOTICE {
                    eprintln!("still waiting for {} ({e})", target.describe());
                    noticed = Instant::now();
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

impl LinkShared {
    /// The transfer of `request` failed for good: its rank hears why.
    fn fail(&self, request: u64, why: String) {
        if let Some(u) = self.unanswered.lock().remove(&request) {
            TransferCounters::bump(&self.counters.failed);
            u.ack.ack(request, u.handoff.transfer, Err(why));
        }
    }

    /// Sends `request`'s handoff again after its connection dropped: once if the drop cut it
    /// (or the consumer refused its damaged bytes), a few times if it had been written whole
    /// (the consumer may well have it: a second copy is answered as a duplicate). Past that it
    /// fails, and the consumer is asked to drop whatever it has of it.
    fn retry(&self, request: u64, why: &str) {
        let mut unanswered = self.unanswered.lock();
        let Some(u) = unanswered.get_mut(&request) else { return };
        let again = if u.cut {
            u.attempt += 1;
            u.attempt == 1
        } else {
            u.resends += 1;
            u.resends <= MAX_RESENDS
        };
        if again {
            (u.sent_on, u.cut) = (None, false);
            TransferCounters::bump(&self.counters.retries);
            let _ = self.jobs.lock().send(Job::Send(request));
        } else {
            let transfer = u.handoff.transfer;
            drop(unanswered);
            self.fail(request, format!("{why}, again on the retry"));
            let _ = self.jobs.lock().send(Job::Abort(request, transfer));
        }
    }
}

/// The link's sending thread: writes each queued handoff (descriptor, payload checksummed as it
/// goes, checksum) or abort on the current connection. Faults strike here.
fn send_loop(s: &LinkShared, queue: Receiver<Job>) {
    for job in queue {
        let request = match job {
            Job::Abort(request, transfer) => {
                s.aborts.lock().insert(request, transfer);
                let (nonce, generation) = (transfer.nonce, transfer.generation);
                let frame = frames::encode(&ToConsumer::Abort { request, nonce, generation });
                let mut conn = s.conn.lock();
                if let Some(stream) = conn.stream.as_mut() {
                    // Lost with a connection that drops: sent again on the next one.
                    let _ = stream.write_all(&frame);
                }
                continue;
            }
            Job::Piece(piece) => {
                send_piece(s, &piece);
                continue;
            }
            Job::DropPieces(request, transfer) => {
                let mut conn = s.conn.lock();
                if let Some(stream) = conn.stream.as_mut() {
                    // Lost with a connection that drops: its pieces went with it.
                    let _ = stream.write_all(&pieces::drop_frame(request, transfer));
                }
                continue;
            }
            Job::Close => {
                let mut conn = s.conn.lock();
                if let Some(stream) = conn.stream.as_mut() {
                    let _ = stream.write_all(&frames::encode(&ToConsumer::Close)).and_then(|_| stream.flush());
                }
                continue;
            }
            Job::Send(request) => request,
        };
        let (h, attempt, whole) = match s.unanswered.lock().get(&request) {
            // Sent again: whole (the pieces may have gone with a connection that dropped).
            Some(u) if u.sent_on.is_none() => (u.handoff.clone(), u.attempt, u.whole || u.attempt + u.resends > 0),
            _ => continue, // answered, failed or aborted meanwhile, or already sent
        };
        if s.faults.strikes(Fault::Delay, request, attempt) {
            TransferCounters::bump(&s.counters.delayed);
            std::thread::sleep(s.faults.delay);
        }
        let drop_midway = s.faults.strikes(Fault::Drop, request, attempt);
        let corrupt = s.faults.strikes(Fault::Corrupt, request, attempt);
        let copies = if s.faults.strikes(Fault::Duplicate, request, attempt + 2) { 2 } else { 1 };
        let mut conn = s.conn.lock();
        let epoch = conn.epoch;
        let Some(stream) = conn.stream.as_mut() else {
            drop(conn);
            s.fail(request, format!("{} is gone", s.target.describe()));
            continue;
        };
        if let Some(u) = s.unanswered.lock().get_mut(&request) {
            u.sent_on = Some(epoch);
        }
        let mut written = 0u64;
        let mut outcome = Ok(());
        for copy in 0..copies {
            let rate = s.rate.as_deref();
            let faults = (drop_midway, corrupt && copy == 0);
            outcome = write_handoff(stream, &h, whole, s.checksum, faults, rate, &mut written);
            if outcome.is_err() || drop_midway {
                break; // a second copy after a cut one would be read as the rest of the first
            }
        }
        if copies == 2 {
            TransferCounters::bump(&s.counters.duplicated);
        }
        if corrupt {
            TransferCounters::bump(&s.counters.corrupted);
        }
        s.socket_bytes.fetch_add(written, Ordering::Relaxed);
        if drop_midway {
            TransferCounters::bump(&s.counters.dropped);
        }
        if outcome.is_err() || drop_midway {
            // The ack thread sees the connection end and recovers (it retries this transfer).
            if let Some(u) = s.unanswered.lock().get_mut(&request) {
                u.cut = true;
            }
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// Writes one handoff frame — `whole`: with the KV its pieces sent ahead; `faults`: drop
/// midway (stop halfway through the payload), corrupt (damage a byte after the checksum took it
/// in). Adds the bytes written to `written`.
fn write_handoff(
    stream: &mut TcpStream,
    h: &Handoff,
    whole: bool,
    checksum: bool,
    (drop_midway, corrupt): (bool, bool),
    rate: Option<&LinkRate>,
    written: &mut u64,
) -> std::io::Result<()> {
    let ahead = if whole { 0 } else { h.streamed_blocks() };
    let descriptor = frames::encode(&ToConsumer::Handoff(WireDescriptor::of(h, checksum.then_some(0), ahead)));
    let pace = |bytes: usize| rate.inspect(|r| r.pace(bytes as u64));
    pace(descriptor.len());
    stream.write_all(&descriptor)?;
    *written += descriptor.len() as u64;
    let total = if whole { h.payload_bytes() } else { h.unstreamed_bytes() };
    let mut sent = Ok(());
    let mut payload = 0u64;
    let crc = stream_payload(h, checksum, whole, |bytes: &[u8]| {
        if sent.is_err() || (drop_midway && payload >= total / 2) {
            return;
        }
        pace(bytes.len());
        sent = if corrupt && payload == 0 {
            let mut damaged = bytes.to_vec();
            damaged[0] ^= 0x5a;
            stream.write_all(&damaged)
        } else {
            stream.write_all(bytes)
        };
        payload += bytes.len() as u64;
    });
    *written += payload;
    sent?;
    if drop_midway {
        return Ok(());
    }
    stream.write_all(&crc.to_le_bytes())?;
    *written += 4;
    stream.flush()
}

/// Writes a piece on the current connection (paced); a piece that cannot be written, or that
/// a drop fault strikes, is lost — its handoff is then refused and sent again whole.
fn send_piece(s: &LinkShared, piece: &KvPiece) {
    if s.faults.strikes(Fault::Drop, piece.request, PIECE_FAULTS + piece.first_block as u32) {
        TransferCounters::bump(&s.counters.dropped);
        return;
    }
    let mut conn = s.conn.lock();
    let Some(stream) = conn.stream.as_mut() else { return };
    let mut written = 0;
    let sent = pieces::write_piece(stream, piece, s.checksum, s.rate.as_deref(), &mut written);
    s.socket_bytes.fetch_add(written, Ordering::Relaxed);
    if sent.is_err() {
        let _ = stream.shutdown(Shutdown::Both); // the ack thread sees it end and reconnects
    }
}

/// Fault draws for a request's pieces start here (a handoff's own draws are its attempts).
const PIECE_FAULTS: u32 = 1 << 16;

/// The link's ack thread: hands each answer to the rank that sent the handoff; when the
/// connection ends, reconnects once and sends again what was unanswered, or fails it.
fn ack_loop(s: &LinkShared, mut reading: TcpStream, mut epoch: u64) {
    loop {
        let reason = loop {
            match frames::read_to_producer(&mut reading) {
                Ok(ToProducer::Ack { request, nonce, generation, refused }) => {
                    answer(s, request, TransferId { nonce, generation }, refused.map_or(Ok(()), Err))
                }
                Ok(ToProducer::Events(events)) => forward_events(s, events),
                Ok(ToProducer::AbortSeen { request }) => {
                    s.aborts.lock().remove(&request);
                }
                Ok(ToProducer::Done { failed }) => {
                    // The remote pool ended: nothing more comes on this link.
                    *s.done.lock() = Some(failed.map_or(Ok(()), Err));
                    s.remote.lock().take();
                    return;
                }
                Err(e) => break e.to_string(),
            }
        };
        let why = format!("the connection to {} dropped ({reason})", s.target.describe());
        // Reconnect under the connection's lock, so a send lands either in what is retried here
        // or on the new connection.
        let mut conn = s.conn.lock();
        if let Some(old) = conn.stream.take() {
            let _ = old.shutdown(Shutdown::Both);
        }
        let dropped: Vec<u64> =
            s.unanswered.lock().iter().filter(|(_, u)| u.sent_on == Some(epoch)).map(|(&request, _)| request).collect();
        match s.target.connect().map_err(|f| f.why).and_then(|stream| {
            let reader = stream.try_clone().map_err(|e| e.to_string())?;
            Ok((stream, reader))
        }) {
            Ok((stream, reader)) => {
                epoch += 1;
                conn.stream = Some(stream);
                conn.epoch = epoch;
                drop(conn);
                tracing::warn!(link = %s.target.to, "{why}; reconnected, {} transfer(s) sent again", dropped.len());
                for request in dropped {
                    s.retry(request, &why);
                }
                let aborts: Vec<(u64, TransferId)> = s.aborts.lock().iter().map(|(&r, &t)| (r, t)).collect();
                for (request, transfer) in aborts {
                    let _ = s.jobs.lock().send(Job::Abort(request, transfer));
                }
                reading = reader;
            }
            Err(e) => {
                let dead = format!("{why}, and reconnecting failed: {e}");
                *s.dead.lock() = Some(dead.clone());
                drop(conn);
                tracing::error!(link = %s.target.to, "{dead}");
                let all: Vec<u64> = s.unanswered.lock().keys().copied().collect();
                for request in all {
                    s.fail(request, dead.clone());
                }
                fail_owed(s, &dead);
                return;
            }
        }
    }
}

/// The consumer answered `request`'s transfer. A damaged payload is sent once more, one that
/// lacked pieces streamed ahead is sent whole; an answer
/// for a request already answered goes to its rank, which drops it as stale.
fn answer(s: &LinkShared, request: u64, transfer: TransferId, outcome: Result<(), String>) {
    if let Err(why) = &outcome {
        if why.starts_with(pieces::PIECES_REFUSAL) {
            // Sent again whole, at once: not a retry (a whole handoff lacks no piece).
            if let Some(u) = s.unanswered.lock().get_mut(&request).filter(|u| !u.whole) {
                (u.whole, u.sent_on) = (true, None);
                TransferCounters::bump(&s.counters.retries);
                let _ = s.jobs.lock().send(Job::Send(request));
                return;
            }
        }
        if why.starts_with(CHECKSUM_REFUSAL) {
            if let Some(u) = s.unanswered.lock().get_mut(&request) {
                u.cut = true;
            }
            s.retry(request, why);
            return;
        }
    }
    let u = {
        let mut unanswered = s.unanswered.lock();
        match unanswered.get(&request) {
            Some(u) if u.handoff.transfer == transfer => unanswered.remove(&request),
            _ => None,
        }
    };
    match u {
        Some(u) => {
            if outcome.is_ok() {
                if let Some(remote) = s.remote.lock().as_mut() {
                    remote.owed.insert(request);
                }
            }
            s.answered.lock().insert(request, u.ack.clone());
            u.ack.ack(request, transfer, outcome);
        }
        None => {
            if let Some(queue) = s.answered.lock().get(&request).cloned() {
                queue.ack(request, transfer, outcome);
            }
        }
    }
}

/// Events of requests the remote decode pool ran: to the collector (an end settles what it owed).
fn forward_events(s: &LinkShared, events: Vec<Event>) {
    let mut remote = s.remote.lock();
    let Some(remote) = remote.as_mut() else { return };
    for e in &events {
        if matches!(e, Event::Finished { .. } | Event::Failed { .. }) {
            remote.owed.remove(&e.id());
        }
    }
    remote.sink.events(0, events);
}

/// The remote decode pool is gone: every request it took and never ended fails, naming it.
fn fail_owed(s: &LinkShared, why: &str) {
    let Some(mut remote) = s.remote.lock().take() else { return };
    let mut owed: Vec<u64> = remote.owed.drain().collect();
    owed.sort_unstable();
    let events = owed
        .into_iter()
        .map(|id| Event::Failed {
            id,
            rank: usize::MAX,
            cause: "handoff".into(),
            message: format!("{why}: the request was decoding there"),
            tokens: Vec::new(),
            token_times: Default::default(),
            started_ms: None,
        })
        .collect();
    remote.sink.events(0, events);
}

/// `tcp` links of one prefill pool: `connections` of them to each decode pool, decode pool by
/// decode pool (the ones to the first pool, then to the second, …).
pub struct TcpLinks {
    pub links: Vec<Arc<TcpLink>>,
    /// Connections to each decode pool (at least 1).
    pub connections: usize,
    /// Each decode pool's link's `stream_min_tokens`.
    stream_min_tokens: Vec<Option<usize>>,
    /// The connection each streaming request's pieces went by (its handoff and any abort follow
    /// them there), until its handoff leaves or its pieces are dropped.
    streams: Mutex<HashMap<u64, usize>>,
}

impl TcpLinks {
    /// The connections to the decode pool request `request` goes to (as [`link_of`] picks it).
    fn connections_of(&self, request: u64, back_to: Option<BackTo>) -> &[Arc<TcpLink>] {
        let per_pool = self.connections.max(1);
        let pool = link_of(request, back_to, self.links.len() / per_pool);
        self.links.get(pool * per_pool..(pool + 1) * per_pool).unwrap_or(&[])
    }

    /// `connections` links to each decode pool (pool by pool), whose links stream from
    /// `stream_min_tokens` (by pool).
    pub fn new(links: Vec<Arc<TcpLink>>, connections: usize, stream_min_tokens: Vec<Option<usize>>) -> Self {
        TcpLinks { links, connections, stream_min_tokens, streams: Default::default() }
    }

    /// The connection request `request`'s pieces went by, if it streams.
    fn stream_link(&self, request: u64) -> Option<&Arc<TcpLink>> {
        self.streams.lock().get(&request).and_then(|&i| self.links.get(i))
    }

    /// [`Self::stream_link`], forgotten: its handoff leaves, or its pieces are dropped.
    fn take_stream_link(&self, request: u64) -> Option<&Arc<TcpLink>> {
        self.streams.lock().remove(&request).and_then(|i| self.links.get(i))
    }

    /// The index (in `links`) of the connection to request `request`'s decode pool with the
    /// fewest handoffs unanswered (so handoffs in flight together go over different ones).
    fn least_loaded(&self, request: u64, back_to: Option<BackTo>) -> Result<usize, String> {
        let per_pool = self.connections.max(1);
        let first = link_of(request, back_to, self.links.len() / per_pool) * per_pool;
        let connections = self.connections_of(request, back_to);
        let least = connections.iter().enumerate().min_by_key(|(_, link)| link.unanswered());
        least.map(|(i, _)| first + i).ok_or_else(|| "no decode pool is linked".to_string())
    }
}

impl TcpLink {
    /// Handoffs sent and not answered yet.
    pub(super) fn unanswered(&self) -> usize {
        self.shared.unanswered.lock().len()
    }

    fn holds(&self, request: u64) -> bool {
        self.shared.unanswered.lock().contains_key(&request)
    }
}

impl HandoffSink for TcpLinks {
    /// Sends over the connection its pieces went by, else the pool's least loaded one.
    fn send(&self, h: Handoff, ack: Arc<AckQueue>) -> Result<String, String> {
        let link = match self.take_stream_link(h.request) {
            Some(link) => link,
            None => &self.links[self.least_loaded(h.request, h.to)?],
        };
        link.send_arc(Arc::new(h), ack)
    }

    fn stream_min_tokens(&self, request: u64, back_to: Option<BackTo>) -> Option<usize> {
        let pools = self.links.len() / self.connections.max(1);
        self.stream_min_tokens.get(link_of(request, back_to, pools)).copied().flatten()
    }

    /// Over the connection the request's first piece took (the fewest handoffs unanswered then).
    fn send_piece(&self, piece: KvPiece, back_to: Option<BackTo>) -> Result<Arc<KvPiece>, String> {
        let link = match self.stream_link(piece.request) {
            Some(link) => link,
            None => {
                let index = self.least_loaded(piece.request, back_to)?;
                self.streams.lock().insert(piece.request, index);
                &self.links[index]
            }
        };
        let s = &link.shared;
        if let Some(why) = s.dead.lock().clone() {
            return Err(why);
        }
        let mut piece = piece;
        piece.arrived_ms = piece.sent_ms; // the consumer's copy says when it arrived
        let piece = Arc::new(piece);
        let _ = s.jobs.lock().send(Job::Piece(piece.clone()));
        Ok(piece)
    }

    fn drop_pieces(&self, request: u64, transfer: TransferId, _back_to: Option<BackTo>) {
        if let Some(link) = self.take_stream_link(request) {
            let _ = link.shared.jobs.lock().send(Job::DropPieces(request, transfer));
        }
    }

    /// Aborts over the connection that carries the transfer (behind it), else any of the pool's:
    /// the consumer drops the request whichever of its connections the abort comes by.
    fn abort(&self, request: u64, transfer: TransferId, back_to: Option<BackTo>) {
        let connections = self.connections_of(request, back_to);
        let streamed = self.stream_link(request).cloned();
        let held = connections.iter().find(|link| link.holds(request));
        let Some(link) = held.or(streamed.as_ref()).or(connections.first()) else { return };
        let _ = link.shared.jobs.lock().send(Job::Abort(request, transfer));
    }
}
