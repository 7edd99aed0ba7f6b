//! What the scheduler decides for one step: the chunks each sequence feeds, and what changed
//! around them (admissions, preemptions, failures, state copies for the executor).

use crate::policy::sequence::SeqKey;
use kvflow_kernels::kv::{SlotId, SnapshotId};

/// One sequence's work in a step (`seq` is its index in the rank's [`Sequences`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub seq: usize,
    /// The sequence's generation when the chunk was decided.
    pub key: SeqKey,
    pub start: usize,
    pub len: usize,
    /// Sample a token after this chunk.
    pub sample: bool,
    /// The chunk's last token is still in flight: the one the sequence samples at this step.
    pub deferred: Option<u64>,
    /// The chunk feeds prompt tokens (prefix blocks and snapshots may follow from it).
    pub prefill: bool,
    /// "Verifies drafts": drafts fed after the chunk's last known token (`Sequence::drafts`),
    /// to verify: the chunk is `len - drafts` known tokens and then these.
    pub drafts: usize,
    /// "Drafter needs successor tokens": the drafter proposes from the token this chunk samples
    /// as soon as it is known — a producer's T0, whose drafts go with the handoff (the producer
    /// never verifies, so nothing else would hand its drafter that token). A separate fact from
    /// `drafts` (DESIGN §5, "drafter inputs explicit").
    pub drafter_successors: bool,
}

/// What `schedule` decided, beyond the chunks.
#[derive(Debug, Default, PartialEq)]
pub struct StepDecision {
    pub chunks: Vec<Chunk>,
    /// Requests (ids) that gave their memory back this step.
    pub preempted: Vec<u64>,
    /// Requests (ids) that can never run here, with the reason; already removed.
    pub failed: Vec<(u64, String)>,
    /// Requests (ids) admitted this step, with the prompt tokens restored from the prefix cache.
    pub admitted: Vec<(u64, usize)>,
    /// State copies to apply before the forward (new slots zeroed, prefix snapshots restored).
    pub state_ops: Vec<StateOp>,
    /// Snapshots the restores read, each with a reference taken (and its generation): the step
    /// owns them until it completes.
    pub restoring: Vec<(SnapshotId, u32)>,
}

impl StepDecision {
    /// Whether the step feeds nothing.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Empties it, keeping its buffers for the next step.
    pub fn clear(&mut self) {
        self.chunks.clear();
        self.preempted.clear();
        self.failed.clear();
        self.admitted.clear();
        self.state_ops.clear();
        self.restoring.clear();
    }
}

/// A copy of recurrent state a step asks for, applied by the executor in step order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateOp {
    /// Before the forward: a newly admitted request starts from the zero state.
    Zero { slot: SlotId },
    /// Before the forward: a prefix hit starts from the state kept at the prefix boundary.
    Restore { snapshot: SnapshotId, slot: SlotId },
    /// Before the forward: a verification that rejected drafts sets the slot back to its state
    /// just after `position`, the last token that held (kept by the step that verified it).
    Rewind { slot: SlotId, position: usize },
    /// After the forward: keep the state at a boundary the step just reached.
    Snapshot { slot: SlotId, snapshot: SnapshotId },
}
