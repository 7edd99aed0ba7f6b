//! The `inproc` transfer backend: producer and consumer pools in one process, and the consumer
//! pool's inbox, which every backend delivers into. A handoff moves as an `Arc` (no
//! serialization, no socket). It carries the copy of the prompt's blocks a CPU producer's step
//! made, or names a cuda producer's blocks in place (`KvSource`); the consumer's executor copies
//! them into the blocks it allocated, before the step that first reads them. A handoff read in
//! place is acked when the consumer lets go of it, after that copy. One that carries its own
//! bytes (a CPU producer's, or any over tcp) is acked when it is taken. The producer holds the
//! request's blocks and slot until the ack arrives. A handoff from a pool of another block size
//! is cut into the consumer pool's blocks when it reaches the inbox (`reblock`). A cancelled
//! request's transfer is aborted explicitly (the consumer drops it, or cancels what it began, and
//! answers), never left to a timeout.

use super::faults::{Fault, Faults, TransferCounters};
use super::{Handoff, KvPiece, LinkRate, TransferId};
use crate::messages::{Admission, AdmissionKind, BackTo};
use crate::pool::admit::Ingress;
use crate::pool::wake::RankWaker;
use crate::sim::clock::VirtualClock;
use kvflow_kernels::hash;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// Where a consumer's answer to one handoff goes: `Ok` once it has the bytes, `Err` when it
/// refused them (a bad checksum, a layout it cannot hold) or the transfer was aborted.
pub trait Ack: Send + Sync {
    fn ack(&self, request: u64, transfer: TransferId, outcome: Result<(), String>);
}

/// An ack as the producer rank reads it.
pub type AckRecord = (u64, TransferId, Result<(), String>);

/// Acks for one producer rank, raised by consumers; draining them releases what the rank held.
pub struct AckQueue {
    acks: Mutex<Vec<AckRecord>>,
    waker: Arc<RankWaker>,
}

impl AckQueue {
    pub fn new(waker: Arc<RankWaker>) -> Arc<Self> {
        Arc::new(AckQueue { acks: Mutex::new(Vec::new()), waker })
    }

    /// Every ack raised since the last call.
    pub fn drain(&self) -> Vec<AckRecord> {
        std::mem::take(&mut *self.acks.lock())
    }
}

impl Ack for AckQueue {
    /// The consumer answered request `request`'s handoff `transfer`: wake the producer rank.
    fn ack(&self, request: u64, transfer: TransferId, outcome: Result<(), String>) {
        self.acks.lock().push((request, transfer, outcome));
        self.waker.wake();
    }
}

/// The answer a transfer gets when its request was cancelled while it moved.
pub const ABORTED: &str = "aborted: the request was cancelled while in transfer";

/// Handoffs that reached a consumer pool, by request id, until the rank the router chose takes
/// its one (every rank of the pool in this process shares the inbox). It also remembers which
/// requests it handed to a rank (a second delivery of one is a duplicate: dropped, counted)
/// and which were aborted (a delivery arriving after its abort is refused).
#[derive(Default)]
pub struct HandoffInbox {
    state: Mutex<InboxState>,
    /// Faults on purpose: a taken handoff's ack may be sent twice (`duplicate_completion`).
    pub faults: Faults,
    pub counters: Arc<TransferCounters>,
    /// Test switch (`TestSwitches::deliver_duplicate_handoffs`): every copy is delivered.
    pub deliver_duplicates: bool,
    /// Test switch (`TestSwitches::accept_missing_pieces`): a streamed handoff whose pieces did
    /// not all arrive is taken, the missing blocks read as zeros.
    pub accept_missing_pieces: bool,
    /// The pool's block size and its layers' floats a token: a handoff of other blocks is cut
    /// into these before it is taken (`reblock`; 0: taken as it comes).
    pub block_size: usize,
    pub kv_rows: Vec<usize>,
}

#[derive(Default)]
struct InboxState {
    arrived: HashMap<u64, Arrived>,
    taken: HashSet<u64>,
    aborted: HashSet<u64>,
}

/// A handoff waiting in an inbox, with where its ack goes.
type Arrived = (Arc<Handoff>, Arc<dyn Ack>);

/// What a rank finds in the inbox for a handoff admission.
pub enum Taken {
    Handoff(Arc<Handoff>),
    /// The transfer was aborted (its request was cancelled and reported so by the producer).
    Aborted,
    Missing,
}

impl HandoffInbox {
    pub fn new(faults: Faults, counters: Arc<TransferCounters>) -> Self {
        HandoffInbox {
            state: Default::default(),
            faults,
            counters,
            deliver_duplicates: false,
            accept_missing_pieces: false,
            block_size: 0,
            kv_rows: Vec::new(),
        }
    }

    /// A handoff arrived (cut into this pool's blocks first, when the producer's differ).
    /// Returns whether its admission should follow through the pool's ingress: not for a
    /// duplicate (acked again if it was already taken, so a producer whose
    /// ack was lost hears it) or for an aborted transfer (refused).
    pub fn put(&self, h: Arc<Handoff>, ack: Arc<dyn Ack>) -> bool {
        let (id, transfer) = (h.request, h.transfer);
        let h = match super::reblock::to_consumer_blocks(h, self.block_size, &self.kv_rows) {
            Ok(h) => h,
            Err(why) => {
                ack.ack(id, transfer, Err(format!("its blocks cannot become this pool's: {why}")));
                return false;
            }
        };
        let mut s = self.state.lock();
        let id = h.request;
        if s.aborted.contains(&id) {
            drop(s);
            TransferCounters::bump(&self.counters.aborted);
            ack.ack(id, h.transfer, Err(ABORTED.into()));
            return false;
        }
        if self.deliver_duplicates {
            s.taken.remove(&id);
            s.arrived.insert(id, (h, ack));
            return true;
        }
        if s.taken.contains(&id) {
            drop(s);
            TransferCounters::bump(&self.counters.duplicates);
            // Answered again, so a producer whose ack was lost hears it — unless the taken copy
            // reads the producer's blocks in place: its own ack comes when it is done with them.
            if h.source.is_none() {
                ack.ack(id, h.transfer, Ok(()));
            }
            return false;
        }
        if s.arrived.contains_key(&id) {
            // Not taken yet: its one ack comes at the take (a tcp link's acks go to its newest
            // connection).
            TransferCounters::bump(&self.counters.duplicates);
            return false;
        }
        s.arrived.insert(id, (h, ack));
        true
    }

    /// Takes request `id`'s handoff and acks it (the taker owns the bytes now).
    pub fn take(&self, id: u64) -> Taken {
        let mut s = self.state.lock();
        let Some((h, ack)) = s.arrived.remove(&id) else {
            return if s.aborted.contains(&id) { Taken::Aborted } else { Taken::Missing };
        };
        s.taken.insert(id);
        drop(s);
        let twice = self.faults.strikes(Fault::Duplicate, id, 0);
        if twice {
            TransferCounters::bump(&self.counters.duplicated);
        }
        let transfer = h.transfer;
        let answer = move || {
            ack.ack(id, transfer, Ok(()));
            if twice {
                ack.ack(id, transfer, Ok(())); // the producer must drop the second
            }
        };
        if h.source.is_some() {
            // Read in place: the ack goes when the last holder of the handoff lets go of it
            // (after the import copied the blocks, or when the request no longer needs them).
            h.on_drop.set(Box::new(answer));
        } else {
            answer();
        }
        Taken::Handoff(h)
    }

    /// Request `id` was cancelled: a handoff of it that waits here is dropped and answered
    /// [`ABORTED`], one still on its way will be. Returns whether one was waiting. (A handoff a
    /// rank took is that rank's to cancel.)
    pub fn abort(&self, id: u64) -> bool {
        let mut s = self.state.lock();
        if s.taken.contains(&id) {
            return false;
        }
        s.aborted.insert(id);
        let Some((h, ack)) = s.arrived.remove(&id) else { return false };
        drop(s);
        TransferCounters::bump(&self.counters.aborted);
        ack.ack(id, h.transfer, Err(ABORTED.into()));
        true
    }

    /// Handoffs not taken yet.
    pub fn len(&self) -> usize {
        self.state.lock().arrived.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A decode pool a producer may hand off to: its ingress and its inbox.
#[derive(Clone)]
pub struct ConsumerPool {
    pub name: String,
    pub ingress: Arc<Ingress>,
    pub inbox: Arc<HandoffInbox>,
}

impl ConsumerPool {
    /// Delivers a handoff: into the inbox, then (unless a duplicate or aborted) its admission.
    pub fn deliver(&self, h: Arc<Handoff>, ack: Arc<dyn Ack>) {
        let admission = handoff_admission(&h);
        if self.inbox.put(h, ack) {
            self.ingress.push(admission);
        }
    }

    /// Aborts request `id`'s transfer here: drops a waiting handoff, and cancels the request on
    /// the rank that took it or waits for it.
    pub fn abort(&self, id: u64) {
        self.inbox.abort(id);
        self.ingress.cancel(id);
    }
}

/// Where a producer rank's finished prefills go: the decode pools its links name, one chosen
/// per request (a seeded draw on its id, so a run is repeatable).
pub trait HandoffSink: Send + Sync {
    /// Sends `h`; `ack` is raised when the consumer has it (or refused it, or the transfer
    /// failed for good). Returns the pool it goes to.
    fn send(&self, h: Handoff, ack: Arc<AckQueue>) -> Result<String, String>;

    /// Request `request`, whose handoff `transfer` was sent (to `back_to`, when a decode rank
    /// asked for it), was cancelled: ask the consumer to drop it (its answer is the transfer's
    /// ack). Also how a decode rank waiting for a remote prefill that failed hears of it.
    fn abort(&self, request: u64, transfer: TransferId, back_to: Option<BackTo>);

    /// The shortest prompt whose handoff over the link request `request` takes leaves in
    /// pieces while it prefills (`[[link]] stream_min_tokens`); `None`: that link sends whole.
    fn stream_min_tokens(&self, _request: u64, _back_to: Option<BackTo>) -> Option<usize> {
        None
    }

    /// Sends `piece` ahead of its handoff (over the link the handoff will take). Returns it as
    /// the producer keeps it: the handoff carries it (a retry sends it again, whole).
    fn send_piece(&self, piece: KvPiece, _back_to: Option<BackTo>) -> Result<Arc<KvPiece>, String> {
        Ok(Arc::new(piece))
    }

    /// Request `request`, which sent pieces of transfer `transfer`, will not hand off: the
    /// consumer drops what it staged.
    fn drop_pieces(&self, _request: u64, _transfer: TransferId, _back_to: Option<BackTo>) {}
}

/// The admission a handoff enters its decode pool with.
pub fn handoff_admission(h: &Handoff) -> Admission {
    Admission {
        id: h.request,
        prompt: h.prompt.clone(),
        max_output_tokens: h.max_output_tokens,
        warmup: h.warmup,
        kind: AdmissionKind::Handoff { rank: h.to.map(|b| b.rank) },
        sampling: h.sampling,
        cached: Vec::new(),
        delivery: h.delivery.clone(),
    }
}

/// Which of `n` links request `request` goes over (seeded on its id, so a run is repeatable
/// and an abort follows its handoff).
pub fn pick_link(request: u64, n: usize) -> usize {
    (hash::mix(hash::EMPTY, request) % n.max(1) as u64) as usize
}

/// The link a request's handoff goes over: back to the decode pool that asked for it, else a
/// seeded pick.
pub fn link_of(request: u64, back_to: Option<BackTo>, n: usize) -> usize {
    match back_to {
        Some(b) if (b.link as usize) < n => b.link as usize,
        _ => pick_link(request, n),
    }
}

/// `inproc` links to decode pools of this process.
pub struct InprocLinks {
    pub consumers: Vec<ConsumerPool>,
    /// Each link's rate (`[[link]] bandwidth`), by consumer: a handoff is delivered once its
    /// bytes would have left at that rate, behind those sent over the link before it.
    pub rates: Vec<Option<Arc<LinkRate>>>,
    /// Each link's `stream_min_tokens`, by consumer.
    pub stream_min_tokens: Vec<Option<usize>>,
    pub faults: Faults,
    pub counters: Arc<TransferCounters>,
    /// Backend `sim`: the simulated run's clock, on which a handoff arrives when its bytes would
    /// have moved (`None`: `inproc`, on the wall clock).
    pub clock: Option<Arc<VirtualClock>>,
}

/// Where a simulated handoff's arrival falls among the events of one virtual instant: after
/// the steps' completions (ordered by rank).
const ARRIVAL_ORDER: u64 = 1 << 32;

impl HandoffSink for InprocLinks {
    fn send(&self, h: Handoff, ack: Arc<AckQueue>) -> Result<String, String> {
        if self.consumers.is_empty() {
            return Err("no decode pool is linked".into());
        }
        let link = link_of(h.request, h.to, self.consumers.len());
        let to = &self.consumers[link];
        if to.ingress.is_closed() {
            return Err(format!("decode pool {} no longer takes handoffs", to.name));
        }
        // A dropped transfer is sent once more; lost twice, the request fails.
        for attempt in 0..2 {
            if !self.faults.strikes(Fault::Drop, h.request, attempt) {
                break;
            }
            TransferCounters::bump(&self.counters.dropped);
            if attempt == 1 {
                TransferCounters::bump(&self.counters.failed);
                return Err(format!("the transfer to decode pool {} was lost twice (faults.drop_connection)", to.name));
            }
            TransferCounters::bump(&self.counters.retries);
        }
        let (h, ack): (Arc<Handoff>, Arc<dyn Ack>) = (Arc::new(h), ack);
        let copies = if self.faults.strikes(Fault::Duplicate, h.request, 1) {
            TransferCounters::bump(&self.counters.duplicated);
            2
        } else {
            1
        };
        let rate = self.rates.get(link).and_then(Option::as_ref);
        if let Some(clock) = &self.clock {
            // Simulated: it arrives when the virtual clock reaches the end of its transfer.
            let now = clock.now_ns();
            let mut due = rate.map_or(now, |rate| rate.reserve_virtual(now, h.unstreamed_bytes()));
            if self.faults.strikes(Fault::Delay, h.request, 0) {
                TransferCounters::bump(&self.counters.delayed);
                due += self.faults.delay.as_nanos() as u64;
            }
            let (to, name) = (to.clone(), to.name.clone());
            clock.at(
                due,
                ARRIVAL_ORDER,
                Box::new(move || {
                    for _ in 0..copies {
                        to.deliver(h.clone(), ack.clone());
                    }
                }),
            );
            return Ok(name);
        }
        // Held back until its bytes would have left at the link's rate, and by a delay fault.
        // (Its pieces went at their own time: what is left moves now.)
        let mut due = rate.map(|rate| rate.reserve(h.unstreamed_bytes()));
        if self.faults.strikes(Fault::Delay, h.request, 0) {
            TransferCounters::bump(&self.counters.delayed);
            due = Some(due.unwrap_or_else(Instant::now) + self.faults.delay);
        }
        if let Some(due) = due {
            let to = to.clone();
            std::thread::Builder::new()
                .name("kvflow-delayed-handoff".into())
                .spawn(move || {
                    std::thread::sleep(due.saturating_duration_since(Instant::now()));
                    for _ in 0..copies {
                        to.deliver(h.clone(), ack.clone());
                    }
                })
                .map_err(|e| format!("cannot hold the transfer back: {e}"))?;
        } else {
            for _ in 0..copies {
                to.deliver(h.clone(), ack.clone());
            }
        }
        Ok(to.name.clone())
    }

    fn abort(&self, request: u64, _transfer: TransferId, back_to: Option<BackTo>) {
        if let Some(to) = self.consumers.get(link_of(request, back_to, self.consumers.len())) {
            to.abort(request);
        }
    }

    fn stream_min_tokens(&self, request: u64, back_to: Option<BackTo>) -> Option<usize> {
        let link = link_of(request, back_to, self.consumers.len());
        self.stream_min_tokens.get(link).copied().flatten()
    }

    /// In one process a piece moves as an `Arc` its handoff carries: it is counted as arrived
    /// when its bytes would have, at the link's rate.
    fn send_piece(&self, mut piece: KvPiece, back_to: Option<BackTo>) -> Result<Arc<KvPiece>, String> {
        let link = link_of(piece.request, back_to, self.consumers.len());
        let rate = self.rates.get(link).and_then(Option::as_ref);
        let lag =
            rate.map_or(Default::default(), |r| r.reserve(piece.bytes()).saturating_duration_since(Instant::now()));
        piece.arrived_ms = crate::messages::wall_ms() + lag.as_secs_f64() * 1000.0;
        Ok(Arc::new(piece))
    }
}
