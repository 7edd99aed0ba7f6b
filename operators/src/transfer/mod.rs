//! Handoffs between pools (DESIGN §2, §8): what a finished prefill hands a decode pool — the
//! prompt's paged KV (packed by layer), the recurrent state at the prompt boundary, and the first
//! sampled token T0 with its logits hash — and its wire form. The transfer engine moves them;
//! each carries a nonce and generation so a duplicate or late completion is dropped. `relay`
//! brings a remote decode pool's events back through the prefill ranks of a spread pool.

pub mod faults;
pub mod inproc;
mod landed;
pub mod rate;
pub mod reblock;
pub mod relay;
pub mod stream;
pub mod tcp;
pub mod wire;

pub use crate::checksum::Crc32c;
pub use crate::request::TransferId;
pub use faults::{Fault, Faults, TransferCounters};
pub use inproc::{
    handoff_admission, pick_link, Ack, AckQueue, AckRecord, ConsumerPool, HandoffInbox, HandoffSink, InprocLinks,
    Taken, ABORTED,
};
pub use landed::Landed;
pub use rate::LinkRate;
pub use relay::{EventRelay, RelayQueue};
use std::sync::Arc;
pub use stream::{KvPiece, MergeError, StagedPieces};
pub use tcp::{ConsumerOptions, LinkOptions, LinkTarget, LostProducer, TcpConsumer, TcpLink, TcpLinks};
pub use wire::{decode_descriptor, encode_descriptor, ConsumerLayout, Descriptor, WireError};

/// A finished prefill, ready to move.
#[derive(Clone, Debug, PartialEq)]
pub struct Handoff {
    pub transfer: TransferId,
    pub request: u64,
    pub prompt: Vec<u32>,
    pub max_output_tokens: usize,
    pub warmup: bool,
    /// How the request picks its tokens (the consumer samples on with it).
    pub sampling: kvflow_kernels::cpu::sampling::RequestSampling,
    /// Its stop tokens and whether it streams (a served request).
    pub delivery: crate::request::Delivery,
    /// Drafts the producer's drafter made from T0: the consumer's first decode feeds T0 and
    /// these (DESIGN §10).
    pub drafts: Vec<u32>,
    /// The first sampled token: the consumer's first decode input, applied exactly once.
    pub t0: u32,
    /// The request's logits hash chain through T0 (so `--verify` compares the whole output).
    pub logits_hash: u64,
    /// The producer's layout fingerprint (`Model::layout_fingerprint`).
    pub fingerprint: u64,
    /// Tokens a block of the producer holds: `skip_blocks`, `kv_blocks` and `floats_per_block`
    /// count its blocks (the consumer's inbox re-cuts them into its own, `reblock`).
    pub block_size: usize,
    /// Prompt blocks the consumer already holds (not sent).
    pub skip_blocks: usize,
    /// Blocks whose KV the handoff moves (the ones sent ahead in `streamed`, then `kv`'s).
    pub kv_blocks: usize,
    pub floats_per_block: usize,
    /// Pieces sent ahead while the prefill ran (`stream`), in block order: the first blocks of
    /// the `kv_blocks`.
    pub streamed: Vec<Arc<KvPiece>>,
    /// KV of the blocks after the streamed ones, packed by layer — empty when `source` is set:
    /// then the blocks are read in place from the producer's cache (which holds them until the
    /// ack).
    pub kv: Vec<f32>,
    pub source: Option<crate::kv_source::KvSource>,
    /// The same KV landed in a cuda consumer's device memory piece by piece as it arrived (then
    /// `kv` is empty).
    pub landed: Option<Landed>,
    /// The state slot at the prompt boundary (before T0), for families with recurrent state.
    pub state: Option<Vec<f32>>,
    /// When the prefill's first chunk ran and when T0 became known (`wall_ms`).
    pub started_ms: f64,
    pub t0_ms: f64,
    /// The decode rank that asked for this prefill, if one did.
    pub to: Option<crate::request::BackTo>,
    /// Where `kv`'s buffer goes back when the handoff is dropped (a receiving side reuses its
    /// buffers instead of faulting in fresh pages for every handoff).
    pub recycle: Option<Recycler>,
    /// Runs when the handoff is dropped: a consumer reading `source` in place acks then — it
    /// no longer needs the producer's blocks.
    pub on_drop: OnDrop,
    /// A simulated run's handoff (executor `sim`): its sizes without its bytes (`kv` is empty
    /// and `state` is `None`; `kv_blocks` and `floats_per_block` say what it would move).
    pub simulated: Option<SimulatedPayload>,
}

/// What a simulated handoff would carry beside its KV blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimulatedPayload {
    /// The state slot's floats (0 for a model without recurrent state).
    pub state_floats: usize,
}

impl Handoff {
    /// The KV floats it carries, packed by layer over all its blocks (read from the producer's
    /// blocks when in place; the streamed pieces merged in).
    pub fn kv_floats(&self) -> std::borrow::Cow<'_, [f32]> {
        if !self.streamed.is_empty() {
            let rest = self.unstreamed_floats();
            let rest_blocks = self.kv_blocks.saturating_sub(self.streamed_blocks());
            return std::borrow::Cow::Owned(stream::merge(&self.streamed, &rest, rest_blocks).unwrap_or_else(|e| {
                tracing::error!(request = self.request, "merging a streamed handoff: {e}");
                Vec::new()
            }));
        }
        self.unstreamed_floats()
    }

    /// Blocks sent ahead in pieces.
    pub fn streamed_blocks(&self) -> usize {
        self.streamed.iter().map(|p| p.blocks).sum()
    }

    /// The producer's blocks it reads in place — only when it reads all of them so (a streamed
    /// handoff merges its pieces on the host).
    pub fn in_place(&self) -> Option<&crate::kv_source::KvSource> {
        self.source.as_ref().filter(|_| self.streamed.is_empty())
    }

    /// Its KV in a consumer's device memory, when all of it landed there: (first block, blocks,
    /// landed) in block order — the pieces streamed ahead, then the rest.
    pub fn landed_parts(&self) -> Option<Vec<(usize, usize, &Landed)>> {
        let streamed = self.streamed_blocks();
        let mut parts = Vec::with_capacity(self.streamed.len() + 1);
        for p in &self.streamed {
            parts.push((p.first_block, p.blocks, p.landed.as_ref()?));
        }
        parts.push((streamed, self.kv_blocks.saturating_sub(streamed), self.landed.as_ref()?));
        Some(parts)
    }

    /// The KV of the blocks after the streamed ones.
    fn unstreamed_floats(&self) -> std::borrow::Cow<'_, [f32]> {
        match (&self.source, &self.landed) {
            (Some(source), _) => std::borrow::Cow::Owned(source.read()),
            (None, Some(landed)) => std::borrow::Cow::Owned(landed.read_back(self.request)),
            (None, None) => std::borrow::Cow::Borrowed(&self.kv),
        }
    }

    /// Bytes of its payload (KV and state), the streamed pieces' included.
    pub fn payload_bytes(&self) -> u64 {
        let state = self.simulated.map_or(self.state.as_ref().map_or(0, Vec::len), |s| s.state_floats);
        4 * (self.kv_blocks * self.floats_per_block + state) as u64
    }

    /// Whether it carries the request's state slot (a simulated one: would carry).
    pub fn carries_state(&self) -> bool {
        self.state.is_some() || self.simulated.is_some_and(|s| s.state_floats > 0)
    }

    /// Bytes it moves after its pieces (what is left to send at T0).
    pub fn unstreamed_bytes(&self) -> u64 {
        self.payload_bytes() - 4 * (self.streamed_blocks() * self.floats_per_block) as u64
    }

    /// How long its pieces moved before T0 (ms): from the first piece sent to the last that
    /// arrived, up to T0 — the transfer that overlapped the prefill.
    pub fn overlapped_ms(&self) -> f64 {
        let first = self.streamed.iter().map(|p| p.sent_ms).fold(f64::INFINITY, f64::min);
        let last = self.streamed.iter().map(|p| p.arrived_ms).fold(f64::NEG_INFINITY, f64::max);
        if self.streamed.is_empty() {
            0.0
        } else {
            (last.min(self.t0_ms) - first).max(0.0)
        }
    }
}

impl Drop for Handoff {
    fn drop(&mut self) {
        if let Some(r) = &self.recycle {
            r.give_back(std::mem::take(&mut self.kv));
        }
        if let Some(f) = self.on_drop.0.lock().take() {
            f();
        }
    }
}

/// Something to run once, when a handoff is dropped (not part of what the handoff is: a clone
/// has none, and it is ignored by equality).
#[derive(Default)]
pub struct OnDrop(parking_lot::Mutex<Option<Box<dyn FnOnce() + Send>>>);

impl OnDrop {
    /// Sets what runs at the drop.
    pub fn set(&self, f: Box<dyn FnOnce() + Send>) {
        *self.0.lock() = Some(f);
    }
}

impl Clone for OnDrop {
    fn clone(&self) -> Self {
        OnDrop::default()
    }
}

impl PartialEq for OnDrop {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for OnDrop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnDrop")
    }
}

/// A few float buffers kept for reuse.
#[derive(Clone, Default)]
pub struct Recycler(std::sync::Arc<parking_lot::Mutex<Vec<Vec<f32>>>>);

impl Recycler {
    /// Buffers kept at most (the rest are freed).
    const KEEP: usize = 4;

    /// A buffer of `len` floats (contents unspecified: the caller overwrites all of it).
    pub fn take(&self, len: usize) -> Vec<f32> {
        let mut v = self.0.lock().pop().unwrap_or_default();
        v.resize(len, 0.0);
        v
    }

    fn give_back(&self, v: Vec<f32>) {
        let mut kept = self.0.lock();
        if kept.len() < Self::KEEP && v.capacity() > 0 {
            kept.push(v);
        }
    }
}

impl std::fmt::Debug for Recycler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Recycler")
    }
}

impl PartialEq for Recycler {
    fn eq(&self, _: &Self) -> bool {
        true // where buffers go back is not part of what a handoff is
    }
}

/// Floats per piece a payload is sent and received in (1 MiB).
pub const PIECE_FLOATS: usize = 1 << 15;

/// `floats` as little-endian bytes: the floats' own memory on a little-endian machine (no copy),
/// a converted copy elsewhere.
pub fn le_bytes(floats: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: f32 has no padding and every bit pattern is a valid u8; the byte slice covers
        // exactly the floats' memory and borrows it for the same lifetime.
        std::borrow::Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(floats.as_ptr().cast::<u8>(), floats.len() * 4)
        })
    } else {
        std::borrow::Cow::Owned(floats.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// Reads `floats.len()` little-endian floats from `r` into `floats`, in pieces, feeding each
/// piece's bytes to `seen` as it arrives (the checksum).
pub fn read_floats(r: &mut impl std::io::Read, floats: &mut [f32], mut seen: impl FnMut(&[u8])) -> std::io::Result<()> {
    for chunk in floats.chunks_mut(PIECE_FLOATS) {
        if cfg!(target_endian = "little") {
            // SAFETY: as in `le_bytes`; any bytes read are a valid f32 bit pattern.
            let bytes = unsafe { std::slice::from_raw_parts_mut(chunk.as_mut_ptr().cast::<u8>(), chunk.len() * 4) };
            r.read_exact(bytes)?;
            seen(bytes);
        } else {
            let mut bytes = vec![0u8; chunk.len() * 4];
            r.read_exact(&mut bytes)?;
            seen(&bytes);
            for (v, b) in chunk.iter_mut().zip(bytes.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
    Ok(())
}

/// The payload of `h` as bytes (KV floats, then state floats, little endian), fed to `sink` in
/// pieces while its checksum is computed (when `checksum`) — the same pass, never a second one
/// over the bytes. `whole`: the streamed pieces' KV too (merged in), else only what follows
/// them. Returns the checksum (0 when not computed).
pub fn stream_payload(h: &Handoff, checksum: bool, whole: bool, mut sink: impl FnMut(&[u8])) -> u32 {
    let mut crc = Crc32c::new();
    let mut send = |floats: &[f32]| {
        let bytes = le_bytes(floats);
        if checksum {
            crc.update(&bytes);
        }
        sink(&bytes);
    };
    match &h.source {
        _ if whole && !h.streamed.is_empty() => h.kv_floats().chunks(PIECE_FLOATS).for_each(&mut send),
        // Read in place from the producer's blocks, a staged piece at a time.
        Some(source) => source.stream(PIECE_FLOATS, &mut send),
        None => h.kv.chunks(PIECE_FLOATS).for_each(&mut send),
    }
    h.state.as_deref().unwrap_or(&[]).chunks(PIECE_FLOATS).for_each(&mut send);
    if checksum {
        crc.value()
    } else {
        0
    }
}
