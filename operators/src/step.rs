//! What one step of a rank is, as the executor sees it: the launch (a borrowed view of the batch
//! the scheduler decided, with the state copies it needs before and after the forward) and the
//! completion that arrives later (the sampled tokens and the hash of each sampled logits row).
//!
//! Identity: a sequence is named by a [`SeqKey`] — its slot in the rank's slab *and* a
//! generation that changes whenever the request starts over (admission, preemption) — so a
//! completion for an older generation can be recognised and dropped. A decode scheduled while its
//! previous token is still in flight names that token by (sequence, step) ([`SeqStep::deferred`])
//! and the executor resolves it (deferred output, DESIGN §4).

pub use crate::kv_source::{BlockStore, KvSource};
pub use crate::policy::scheduler::StateOp;
pub use crate::policy::sequence::SeqKey;
use crate::transfer::Handoff;
use kvflow_kernels::kv::{SlotId, SnapshotId};
use std::sync::Arc;

/// After the forward: copy a sequence's KV blocks and state slot out (a finished prefill that
/// moves to a decode pool). The slot is read here, at the step that reached the prompt boundary —
/// the state a handoff carries, before T0 is applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvExport {
    pub key: SeqKey,
    pub blocks: Vec<u32>,
    pub slot: Option<SlotId>,
    /// The step copies the blocks out (packed by layer) before it completes, where a reader in
    /// place would wait for this rank's later steps (a CPU rank's steps hold its cache): a
    /// handoff, whose transfer then moves at the link's speed whatever the producer computes.
    /// Otherwise the blocks are read in place, held until their reader is done (a save, fenced by
    /// its pin; on a GPU every export, read on a stream of the reader's own).
    pub copy_out: bool,
    /// A streamed piece that leaves as its step launches, each layer read once the forward wrote
    /// it (an executor that [`exports_at_launch`]); else it leaves with the step's completion.
    ///
    /// [`exports_at_launch`]: crate::executor::Executor::exports_at_launch
    pub at_launch: bool,
}

/// What an export copied out, reported with the step's completion.
#[derive(Clone, Debug, PartialEq)]
pub struct Exported {
    pub key: SeqKey,
    /// KV of the blocks, packed by layer — or, when `source` is set, nothing: the consumer
    /// reads the blocks straight from the producer's cache.
    pub kv: Vec<f32>,
    pub source: Option<KvSource>,
    /// The state slot, read by the step (the handoff owns this copy).
    pub state: Option<Vec<f32>>,
    /// A simulated step's export: no bytes, the sizes they would have.
    pub simulated: Option<crate::transfer::SimulatedPayload>,
}

/// Before the forward (after the state copies): write KV into the blocks and state into the slot
/// allocated for it — an arriving handoff, or a chunk loaded from the offload store. `blocks`
/// are the ones `from` carries KV for; `snapshot`, when set, also keeps the written state there
/// (a restored prefix published with the state at its end).
#[derive(Clone, Debug)]
pub struct KvImport {
    pub key: SeqKey,
    pub blocks: Vec<u32>,
    pub slot: Option<SlotId>,
    pub snapshot: Option<SnapshotId>,
    pub from: ImportFrom,
}

/// What an import writes.
#[derive(Clone, Debug)]
pub enum ImportFrom {
    /// A finished prefill from another pool (its KV carried, or read in place from the producer).
    Handoff(Arc<Handoff>),
    /// One chunk of a prefix loaded from the offload store, for request `request`; the state at
    /// its end is written only for the prefix's last chunk (`writes_state`).
    Store { request: u64, object: Arc<crate::offload::ChunkObject>, writes_state: bool },
}

impl ImportFrom {
    /// The request it writes for.
    pub fn request(&self) -> u64 {
        match self {
            ImportFrom::Handoff(h) => h.request,
            ImportFrom::Store { request, .. } => *request,
        }
    }

    /// A producer's blocks it reads in place, if it does.
    pub fn source(&self) -> Option<&KvSource> {
        match self {
            ImportFrom::Handoff(h) => h.in_place(),
            ImportFrom::Store { .. } => None,
        }
    }

    /// The KV landed in this consumer's device memory as it arrived, if all of it was: (first
    /// block, blocks, landed) parts in block order.
    pub fn landed(&self) -> Option<Vec<(usize, usize, &crate::transfer::Landed)>> {
        match self {
            ImportFrom::Handoff(h) => h.landed_parts(),
            ImportFrom::Store { .. } => None,
        }
    }

    /// The KV floats it writes, packed by layer (read from the producer's blocks when in place).
    pub fn kv_floats(&self) -> std::borrow::Cow<'_, [f32]> {
        match self {
            ImportFrom::Handoff(h) => h.kv_floats(),
            ImportFrom::Store { object, .. } => std::borrow::Cow::Borrowed(&object.kv),
        }
    }

    /// The state it writes into the slot.
    pub fn state(&self) -> Option<&[f32]> {
        match self {
            ImportFrom::Handoff(h) => h.state.as_deref(),
            ImportFrom::Store { object, writes_state, .. } => object.state.as_deref().filter(|_| *writes_state),
        }
    }

    /// What it is, for errors: "handoff of request 7", "offload load of request 7".
    pub fn describe(&self) -> String {
        match self {
            ImportFrom::Handoff(h) => format!("handoff of request {}", h.request),
            ImportFrom::Store { request, .. } => format!("offload load of request {request}"),
        }
    }
}

/// One sequence's part of a launched step.
#[derive(Clone, Copy, Debug)]
pub struct SeqStep<'a> {
    pub key: SeqKey,
    /// Tokens fed whose values are known.
    pub known: &'a [u32],
    /// `Some(step)`: one more token is fed after `known`, the one this sequence sampled at `step`
    /// and whose completion the rank has not applied yet; the executor resolves it.
    pub deferred: Option<u64>,
    /// Drafts fed after the known (and deferred) tokens, to verify: the step scores the row after
    /// the last known token and after each draft (`Sampled::checks`); `verify` keeps the drafts
    /// the scores agree with.
    pub drafts: &'a [u32],
    /// Position of the first token fed.
    pub start_pos: usize,
    /// Blocks covering every position up to the last fed (empty for families without KV).
    pub block_table: &'a [u32],
    pub slot: Option<SlotId>,
    pub prompt_len: usize,
    /// Sample a token after the last token fed.
    pub sample: bool,
    /// How its tokens are picked (and its drafts checked).
    pub sampler: kvflow_kernels::cpu::sampling::Sampler,
    /// A prompt chunk that ends before the prompt does: the prompt token after it (what the MTP
    /// drafter pairs with the chunk's last position).
    pub next_prompt_token: Option<u32>,
}

impl SeqStep<'_> {
    /// Tokens fed in this step.
    pub fn len(&self) -> usize {
        self.known.len() + usize::from(self.deferred.is_some()) + self.drafts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a launch's sequences come from: the rank's own state, read in place (a launch copies
/// nothing unless its executor does).
pub trait SeqSource {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The `i`-th sequence of the step (`i < len()`).
    fn get(&self, i: usize) -> SeqStep<'_>;
}

/// A step as launched: the batch of `step`, with the state copies around its forward.
#[derive(Clone, Copy)]
pub struct StepLaunch<'a> {
    pub step: u64,
    pub before: &'a [StateOp],
    pub after: &'a [StateOp],
    /// The newest step whose completion the rank has applied: tokens sampled at or before it are
    /// known to the rank and never named by a later launch.
    pub applied_through: Option<u64>,
    /// The sequences the step samples, in batch order (what its completion reports on).
    pub sampling: &'a [SeqKey],
    pub batch: &'a dyn SeqSource,
    /// Handoffs and offload loads written in before the forward.
    pub imports: &'a [KvImport],
    /// Sequences copied out after the forward.
    pub exports: &'a [KvExport],
}

impl<'a> StepLaunch<'a> {
    /// The step's sequences, in batch order.
    pub fn seqs(&self) -> impl Iterator<Item = SeqStep<'a>> + 'a {
        let batch = self.batch;
        (0..batch.len()).map(move |i| batch.get(i))
    }
}

/// A launch's sequences held in a slice (benches, tests, programs driving an executor directly).
pub struct SeqSlice<'a>(pub &'a [SeqStep<'a>]);

impl SeqSource for SeqSlice<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn get(&self, i: usize) -> SeqStep<'_> {
        self.0[i]
    }
}

impl SeqSource for [SeqStep<'_>] {
    fn len(&self) -> usize {
        <[SeqStep]>::len(self)
    }

    fn get(&self, i: usize) -> SeqStep<'_> {
        self[i]
    }
}

/// A token a step sampled for a sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sampled {
    pub seq: SeqKey,
    /// The token, or `None` when the logits row held a NaN or an infinity (no token is sampled
    /// from those; the request fails, naming it).
    pub token: Option<u32>,
    /// `kvflow_kernels::hash::logits_row` of the logits row it was sampled from.
    pub logits_hash: u64,
    /// A step that fed drafts: the executor's check of each, in order (one per draft). The
    /// executor scores every row; which of them hold is `verify`'s to decide
    /// ([`Sampled::kept_drafts`]).
    pub checks: Vec<DraftCheck>,
    /// With the `mtp` drafter: drafts for the next step, proposed after the last token that
    /// holds.
    pub drafts: Vec<u32>,
}

/// The executor's check of one draft: whether the token its position's row chose (`token`, or
/// the row before it for the first draft) is the draft fed there, and the token the row after
/// the draft chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftCheck {
    /// The row before the draft chose it (greedy: it is the argmax; sampling: the
    /// speculative-sampling rule kept it).
    pub kept: bool,
    /// The token the row after the draft chose (`None`: non-finite logits), and that row's hash.
    pub next: Option<u32>,
    pub next_hash: u64,
}

impl Sampled {
    /// One token, no drafts.
    pub fn one(seq: SeqKey, token: Option<u32>, logits_hash: u64) -> Self {
        Sampled { seq, token, logits_hash, checks: Vec::new(), drafts: Vec::new() }
    }

    /// How many drafts hold: each while every draft before it held (the rows past the first
    /// rejection were scored on a prefix that no longer holds, and count for nothing).
    pub fn kept_drafts(&self) -> usize {
        self.checks.iter().take_while(|c| c.kept).count()
    }

    /// The tokens that hold, in order, with their rows' hashes: `token`, then the token after
    /// each kept draft (the last one chosen where no draft held, or after the last draft).
    pub fn verified(&self) -> impl Iterator<Item = (Option<u32>, u64)> + '_ {
        let after = self.checks[..self.kept_drafts()].iter().map(|c| (c.next, c.next_hash));
        std::iter::once((self.token, self.logits_hash)).chain(after)
    }

    /// The last token that holds.
    pub fn last_verified(&self) -> Option<u32> {
        self.verified().last().and_then(|(t, _)| t)
    }
}

/// Why a step could not complete.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExecutorError {
    #[error("sequence {seq} names the token it sampled at step {step}, which this executor does not hold")]
    UnresolvedToken { seq: SeqKey, step: u64 },
    #[error("the executor stopped: {0}")]
    Stopped(String),
    #[error("{0}")]
    Launch(String),
}

/// What a launched step produced, once it completed.
#[derive(Clone, Debug, PartialEq)]
pub struct StepCompletion {
    pub step: u64,
    pub result: Result<Vec<Sampled>, ExecutorError>,
    /// What the step's exports copied out, in the order asked.
    pub exports: Vec<Exported>,
    /// Sequences of the step that failed while the rest of it ran (a MoE row that got no
    /// expert result), with why: their requests fail, and whatever was sampled for them is not
    /// taken.
    pub failed: Vec<(SeqKey, String)>,
}

impl StepCompletion {
    /// A completion with no exports.
    pub fn of(step: u64, result: Result<Vec<Sampled>, ExecutorError>) -> Self {
        StepCompletion { step, result, exports: Vec::new(), failed: Vec::new() }
    }
}
