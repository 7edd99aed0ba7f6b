//! Handoffs between pools (DESIGN §2, §8): what a finished prefill hands a decode pool — the
//! prompt's paged KV (packed by layer), the recurrent state at the prompt boundary, and the first
//! sampled token T0 with its logits hash — and its wire form. The transfer engine moves them;
//! each carries a nonce and generation so a duplicate or late completion is dropped.

pub mod checksum;
pub mod inproc;
pub mod tcp;
pub mod wire;

pub use checksum::Crc32c;
pub use inproc::{handoff_admission, Ack, AckQueue, AckRecord, ConsumerPool, HandoffInbox, HandoffSink, InprocLinks};
pub use tcp::{TcpConsumer, TcpLink, TcpLinks};
pub use wire::{decode_descriptor, encode_descriptor, ConsumerLayout, Descriptor, WireError};

/// Names one transfer: a nonce unique per producer, and the generation of the request it moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransferId {
    pub nonce: u64,
    pub generation: u32,
}

/// A finished prefill, ready to move.
#[derive(Clone, Debug, PartialEq)]
pub struct Handoff {
    pub transfer: TransferId,
    pub request: u64,
    pub prompt: Vec<u32>,
    pub max_output_tokens: usize,
    pub warmup: bool,
    /// The first sampled token: the consumer's first decode input, applied exactly once.
    pub t0: u32,
    /// The request's logits hash chain through T0 (so `--verify` compares the whole output).
    pub logits_hash: u64,
    /// The producer's layout fingerprint (`Model::layout_fingerprint`).
    pub fingerprint: u64,
    /// Prompt blocks the consumer already holds (not sent).
    pub skip_blocks: usize,
    /// Blocks whose KV `kv` carries.
    pub kv_blocks: usize,
    pub floats_per_block: usize,
    /// KV of blocks `skip_blocks..`, packed by layer.
    pub kv: Vec<f32>,
    /// The state slot at the prompt boundary (before T0), for families with recurrent state.
    pub state: Option<Vec<f32>>,
    /// When the prefill's first chunk ran and when T0 became known (`wall_ms`).
    pub started_ms: f64,
    pub t0_ms: f64,
}

/// The payload of `h` as bytes (KV floats, then state floats, little endian), fed to `sink` in
/// pieces while its checksum is computed — the same pass, never a second one over the bytes.
pub fn stream_payload(h: &Handoff, mut sink: impl FnMut(&[u8])) -> u32 {
    let mut crc = Crc32c::new();
    let mut buf = Vec::with_capacity(1 << 16);
    for part in [&h.kv[..], h.state.as_deref().unwrap_or(&[])] {
        for chunk in part.chunks(1 << 14) {
            buf.clear();
            for v in chunk {
                buf.extend_from_slice(&v.to_le_bytes());
            }
            crc.update(&buf);
            sink(&buf);
        }
    }
    crc.value()
}
