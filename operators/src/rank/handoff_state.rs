//! The P/D handoff's state on one rank (`Rank::handoff_out`, `Rank::handoff_in`): on a prefill
//! pool's rank (a producer), where its handoffs go, the transfers awaiting their ack and what a
//! step exported for a handoff until T0 lands; on a decode pool's rank (a consumer), where
//! arriving handoffs wait and the ones taken that await their import; on a decode rank that
//! decides where its new requests are prefilled (`[pool.disaggregation]`), its rule, targets and
//! remote prefills under way. What a rank does with it is in `handoff` and `disaggregate`; a rank
//! of an aggregated pool has none of it.

use super::recent_set::RecentSet;
use crate::pool::admit::Ingress;
use crate::request::TransferId;
use crate::step::{Exported, SeqKey};
use crate::transfer::{AckQueue, EventRelay, Handoff, HandoffInbox, HandoffSink, RelayQueue};
use kvflow_kernels::kv::SlotId;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

/// What a prefill rank needs to hand off, and its handoffs under way.
pub struct HandoffOut {
    pub sink: Arc<dyn HandoffSink>,
    /// The model's layout fingerprint at this pool's block size.
    pub fingerprint: u64,
    /// Floats of one block in each layer (what a streamed piece is packed by).
    pub(super) kv_layers: Vec<usize>,
    pub(super) acks: Arc<AckQueue>,
    pub(super) next_nonce: u64,
    /// The pool's queue of prefills decode ranks asked for (they weigh it when deciding).
    pub(super) queue: Arc<AtomicUsize>,
    /// A prefill pool spread over processes, its decode pool in another: the events coming back
    /// for this rank's requests, and the requests whose end has not come back yet.
    pub(super) relayed: Option<Relayed>,
    /// The requests whose handoff awaits its ack, by the transfer's nonce.
    pub(super) awaiting: HashMap<u64, SeqKey>,
    /// What the last completion's exports copied out, by sequence, until its T0 is applied.
    pub(super) exported: HashMap<SeqKey, Exported>,
    /// Test switch `export_admission_slot` only: the slot each request got when first admitted.
    pub(super) admission_slots: HashMap<u64, SlotId>,
    /// Requests whose prompt's KV leaves in pieces while they prefill, by id (`stream`), until
    /// their handoff leaves or they end.
    pub(super) streams: HashMap<u64, StreamOut>,
}

impl HandoffOut {
    pub(super) fn new(
        sink: Arc<dyn HandoffSink>,
        fingerprint: u64,
        acks: Arc<AckQueue>,
        queue: Arc<AtomicUsize>,
    ) -> Self {
        HandoffOut {
            sink,
            fingerprint,
            kv_layers: Vec::new(),
            acks,
            next_nonce: 1,
            queue,
            relayed: None,
            awaiting: HashMap::new(),
            exported: HashMap::new(),
            admission_slots: HashMap::new(),
            streams: HashMap::new(),
        }
    }
}

/// A producer's handoff under way in pieces: its transfer (its nonce fixed at the first piece),
/// the blocks the launched steps export ahead (counted from the first block the handoff sends),
/// the pieces of launched steps not completed yet (first block, count and the generation that
/// launched it, in launch order), and the pieces sent (its handoff carries them).
#[derive(Debug)]
pub(super) struct StreamOut {
    pub(super) transfer: TransferId,
    pub(super) exported_blocks: usize,
    pub(super) launched: std::collections::VecDeque<(usize, usize, u32)>,
    pub(super) sent: Vec<Arc<crate::transfer::KvPiece>>,
}

/// Events of a remote decode pool relayed to this rank (`transfer::relay`).
pub(super) struct Relayed {
    pub(super) relay: Arc<EventRelay>,
    pub(super) queue: Arc<RelayQueue>,
    pub(super) awaited: HashSet<u64>,
}

/// What a decode rank takes handoffs from, and the handoffs it holds for their import.
pub(super) struct HandoffIn {
    pub(super) inbox: Arc<HandoffInbox>,
    /// The handoff of each held request (by id) whose first decode has not launched yet
    /// (`ConsumerState::awaits_import`): that launch writes it in, or drops it when the request
    /// started over (it recomputes); a request that ends before drops it then.
    pub(super) imports: HashMap<u64, Arc<Handoff>>,
}

/// When a decode rank sends a prefill away (a decode pool's `[pool.disaggregation]`): remote
/// only when both hold, otherwise it prefills locally.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DisaggregationRule {
    /// A remote prefill only when the prompt's uncached length on the chosen decode rank (the
    /// tokens its prefix cache lacks) is more than this; 0 (the default): every prompt with
    /// anything uncached is prefilled remotely.
    pub remote_prefill_min_tokens: usize,
    /// A remote prefill only while fewer than this many requests wait in the prefill queue (at
    /// least 1); `None` (the default): no limit.
    pub max_prefill_queue: Option<usize>,
}

/// A prefill pool a decode rank can send prefills to.
#[derive(Clone)]
pub struct PrefillTarget {
    pub name: String,
    pub ingress: Arc<Ingress>,
    /// The decode pool's index among the prefill pool's links (where the handoff comes back).
    pub link: u16,
    /// Requests sent to the prefill pool and not yet handed off (its queue).
    pub queue: Arc<AtomicUsize>,
}

/// What a decode rank of a pool with `[pool.disaggregation]` decides with.
#[derive(Clone)]
pub struct RemotePrefill {
    pub rule: DisaggregationRule,
    pub targets: Vec<PrefillTarget>,
}

/// A deciding decode rank's state: its rule and targets, the remote prefills it awaits (by
/// request, with the prefill pool's index), and those cancelled meanwhile.
pub(super) struct RemotePrefills {
    pub(super) setup: RemotePrefill,
    pub(super) awaiting: HashMap<u64, usize>,
    /// Cancelled while their prefill was out: a handoff may still arrive for one (the prefill pool
    /// sent it before the cancel reached it) and is refused. Most never arrive (the prefill pool
    /// dropped the request, or its prefill failed), so only the latest [`CANCELLED_REMEMBERED`]
    /// are kept: a set of every one would grow for as long as a server runs.
    pub(super) cancelled: RecentSet<u64>,
}

/// How many cancelled remote prefills a decode rank remembers (16 bytes each). A handoff arrives
/// within its transfer's time of the cancel; for one to be forgotten first, this many later
/// requests would have to be cancelled in that time.
pub(super) const CANCELLED_REMEMBERED: usize = 1 << 14;

impl RemotePrefills {
    /// Request `id`'s handoff arrived: it is no longer awaited. Returns whether it was cancelled
    /// meanwhile.
    pub(super) fn arrived(&mut self, id: u64) -> bool {
        self.awaiting.remove(&id);
        self.cancelled.remove(&id)
    }
}
