//! The handoff descriptor on the wire (DESIGN §8): a fixed little-endian header (with the
//! request's sampling), the prompt's tokens, the producer's drafts and the request's stop tokens, then the payload — KV floats packed by layer, then the state slot's floats. The
//! consumer decodes the header against what *it* allocates ([`ConsumerLayout`]) before a byte of
//! payload is read, so a descriptor can never make it write outside the blocks and the slot it
//! allocated for that request.

use super::{Handoff, TransferId};
use crate::messages::Delivery;
use kvflow_kernels::cpu::sampling::{RequestSampling, SamplingParams};

const MAGIC: u32 = u32::from_le_bytes(*b"KVFH");
const VERSION: u16 = 4;
/// The most drafts a handoff carries (`[speculative] draft_tokens` is at most 16).
pub const MAX_HANDOFF_DRAFTS: usize = 16;
const HAS_STATE: u16 = 1;
const WARMUP: u16 = 2;
const UNCHECKED: u16 = 4;
const STREAM: u16 = 8;
/// Bytes of the fixed header.
pub const HEADER_BYTES: usize =
    4 + 2 + 2 + 8 + 4 + 8 + 8 + 4 + 8 + 8 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 8 + 8 + 4 + SAMPLING_BYTES;
/// Temperature, top-k, top-p, seed, the count of drafts and of stop tokens (which follow the
/// prompt, in that order).
const SAMPLING_BYTES: usize = 4 + 4 + 4 + 8 + 4 + 4;
/// `to_rank` of a handoff no decode rank asked for.
const NO_RANK: u32 = u32::MAX;

/// What the consumer's rank holds per block and per slot, and how long a prompt it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConsumerLayout {
    pub fingerprint: u64,
    pub block_size: usize,
    pub floats_per_block: usize,
    /// Floats of a state slot (0: the family has no recurrent state).
    pub state_floats: usize,
    pub vocab_size: usize,
    /// The longest prompt it admits (its context, or its memory).
    pub max_prompt: usize,
}

/// A decoded header: everything but the payload, which follows it.
#[derive(Clone, Debug, PartialEq)]
pub struct Descriptor {
    pub transfer: TransferId,
    pub request: u64,
    pub prompt: Vec<u32>,
    pub max_output_tokens: usize,
    pub warmup: bool,
    pub sampling: RequestSampling,
    pub drafts: Vec<u32>,
    pub delivery: Delivery,
    pub t0: u32,
    pub logits_hash: u64,
    /// Prompt blocks the consumer already holds (not sent).
    pub skip_blocks: usize,
    /// Blocks whose KV the handoff moves: the first `streamed_blocks` of them arrived ahead in
    /// pieces, the payload carries the rest.
    pub kv_blocks: usize,
    pub streamed_blocks: usize,
    pub has_state: bool,
    /// CRC32C of the payload bytes (over tcp it follows the payload instead: this is 0).
    pub checksum: u32,
    /// Whether the payload is checksummed.
    pub checked: bool,
    /// When the prefill started and when T0 became known (`wall_ms`).
    pub started_ms: f64,
    pub t0_ms: f64,
    /// The consumer's rank that asked for this prefill (the router places it there), if one did.
    pub to_rank: Option<u32>,
}

impl Descriptor {
    /// Bytes of payload after the header and prompt.
    pub fn payload_bytes(&self, layout: &ConsumerLayout) -> usize {
        let blocks = self.kv_blocks - self.streamed_blocks;
        4 * (blocks * layout.floats_per_block + if self.has_state { layout.state_floats } else { 0 })
    }
}

/// Why a descriptor was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("descriptor truncated: {got} bytes, {needed} needed")]
    Truncated { got: usize, needed: usize },
    #[error("not a kvflow handoff (magic {0:#010x})")]
    BadMagic(u32),
    #[error("handoff version {0}, this kvflow speaks {VERSION}")]
    BadVersion(u16),
    #[error("layout fingerprint {got:#018x} differs from this pool's {expected:#018x} (family, geometry, block size or dtype)")]
    LayoutMismatch { got: u64, expected: u64 },
    #[error("{what}: {got}, this pool expects {expected}")]
    Geometry { what: &'static str, got: usize, expected: usize },
    #[error("prompt of {got} tokens: this pool takes 1 to {max}")]
    PromptLength { got: usize, max: usize },
    #[error(
        "token {token} at prompt position {position} (or T0, or a draft after it) is outside the vocabulary of {vocab}"
    )]
    Token { token: u32, position: usize, vocab: usize },
    #[error("the model has recurrent state but the handoff carries none (all-or-nothing state)")]
    MissingState,
    #[error("the handoff carries state for a model without recurrent state")]
    UnexpectedState,
    #[error("sampling: {0}")]
    Sampling(String),
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let out = self.bytes[self.at..self.at + N].try_into().expect("length checked by the caller");
        self.at += N;
        out
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}

/// The header and prompt of `h` (the payload follows, see [`super::payload_bytes`]).
/// `checksum`: the payload's CRC32C, `Some(0)` when it follows the payload (a stream computes it
/// while sending), or `None` when the transfer is not checksummed (`[transfer] checksum = false`).
/// `streamed_blocks`: the blocks the payload leaves out, sent ahead in pieces (0: it is whole).
pub fn encode_descriptor(h: &Handoff, checksum: Option<u32>, streamed_blocks: usize) -> Vec<u8> {
    let unchecked = checksum.is_none();
    let checksum = checksum.unwrap_or(0);
    let mut out =
        Vec::with_capacity(HEADER_BYTES + 4 * (h.prompt.len() + h.drafts.len() + h.delivery.stop_tokens.len()));
    let flags = if h.state.is_some() { HAS_STATE } else { 0 }
        | if h.warmup { WARMUP } else { 0 }
        | if unchecked { UNCHECKED } else { 0 }
        | if h.delivery.stream { STREAM } else { 0 };
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&h.transfer.nonce.to_le_bytes());
    out.extend_from_slice(&h.transfer.generation.to_le_bytes());
    out.extend_from_slice(&h.request.to_le_bytes());
    out.extend_from_slice(&h.fingerprint.to_le_bytes());
    out.extend_from_slice(&h.t0.to_le_bytes());
    out.extend_from_slice(&h.logits_hash.to_le_bytes());
    out.extend_from_slice(&(h.max_output_tokens as u64).to_le_bytes());
    out.extend_from_slice(&(h.prompt.len() as u32).to_le_bytes());
    out.extend_from_slice(&(h.skip_blocks as u32).to_le_bytes());
    out.extend_from_slice(&(h.kv_blocks as u32).to_le_bytes());
    out.extend_from_slice(&(streamed_blocks as u32).to_le_bytes());
    out.extend_from_slice(&(h.floats_per_block as u32).to_le_bytes());
    out.extend_from_slice(&(h.state.as_ref().map_or(0, Vec::len) as u32).to_le_bytes());
    out.extend_from_slice(&checksum.to_le_bytes());
    out.extend_from_slice(&h.started_ms.to_bits().to_le_bytes());
    out.extend_from_slice(&h.t0_ms.to_bits().to_le_bytes());
    out.extend_from_slice(&h.to.map_or(NO_RANK, |b| b.rank).to_le_bytes());
    let sampling = &h.sampling.params;
    out.extend_from_slice(&sampling.temperature.to_bits().to_le_bytes());
    out.extend_from_slice(&u32::try_from(sampling.top_k).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&sampling.top_p.to_bits().to_le_bytes());
    out.extend_from_slice(&h.sampling.seed.to_le_bytes());
    out.extend_from_slice(&(h.drafts.len() as u32).to_le_bytes());
    out.extend_from_slice(&(h.delivery.stop_tokens.len() as u32).to_le_bytes());
    for t in h.prompt.iter().chain(&h.drafts).chain(&h.delivery.stop_tokens) {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out
}

/// Decodes a header and prompt from the start of `bytes`, checking every size against `layout`.
/// Returns the descriptor and how many bytes it took.
pub fn decode_descriptor(bytes: &[u8], layout: &ConsumerLayout) -> Result<(Descriptor, usize), WireError> {
    if bytes.len() < HEADER_BYTES {
        return Err(WireError::Truncated { got: bytes.len(), needed: HEADER_BYTES });
    }
    let mut r = Reader { bytes, at: 0 };
    let magic = r.u32();
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = r.u16();
    if version != VERSION {
        return Err(WireError::BadVersion(version));
    }
    let flags = r.u16();
    let transfer = TransferId { nonce: r.u64(), generation: r.u32() };
    let request = r.u64();
    let fingerprint = r.u64();
    if fingerprint != layout.fingerprint {
        return Err(WireError::LayoutMismatch { got: fingerprint, expected: layout.fingerprint });
    }
    let t0 = r.u32();
    let logits_hash = r.u64();
    let max_output_tokens = usize::try_from(r.u64()).unwrap_or(usize::MAX);
    let prompt_len = r.u32() as usize;
    let skip_blocks = r.u32() as usize;
    let kv_blocks = r.u32() as usize;
    let streamed_blocks = r.u32() as usize;
    let floats_per_block = r.u32() as usize;
    let state_floats = r.u32() as usize;
    let checksum = r.u32();
    let started_ms = f64::from_bits(r.u64());
    let t0_ms = f64::from_bits(r.u64());
    let to_rank = Some(r.u32()).filter(|&rank| rank != NO_RANK);
    let (temperature, top_k, top_p) = (f32::from_bits(r.u32()), r.u32() as usize, f32::from_bits(r.u32()));
    let sampling = RequestSampling { params: SamplingParams { temperature, top_k, top_p }, seed: r.u64() };
    let draft_count = r.u32() as usize;
    if draft_count > MAX_HANDOFF_DRAFTS {
        return Err(WireError::Geometry { what: "drafts", got: draft_count, expected: MAX_HANDOFF_DRAFTS });
    }
    let stop_count = r.u32() as usize;
    if stop_count > Delivery::MAX_STOP_TOKENS {
        return Err(WireError::Geometry { what: "stop tokens", got: stop_count, expected: Delivery::MAX_STOP_TOKENS });
    }
    sampling.params.check().map_err(WireError::Sampling)?;
    if prompt_len == 0 || prompt_len > layout.max_prompt {
        return Err(WireError::PromptLength { got: prompt_len, max: layout.max_prompt });
    }
    if floats_per_block != layout.floats_per_block {
        return Err(WireError::Geometry {
            what: "floats per block",
            got: floats_per_block,
            expected: layout.floats_per_block,
        });
    }
    let prompt_blocks = if layout.floats_per_block == 0 { 0 } else { prompt_len.div_ceil(layout.block_size) };
    if skip_blocks > prompt_blocks || kv_blocks != prompt_blocks - skip_blocks {
        return Err(WireError::Geometry {
            what: "KV blocks sent",
            got: kv_blocks,
            expected: prompt_blocks.saturating_sub(skip_blocks),
        });
    }
    if streamed_blocks > kv_blocks {
        return Err(WireError::Geometry { what: "KV blocks sent ahead", got: streamed_blocks, expected: kv_blocks });
    }
    let has_state = flags & HAS_STATE != 0;
    match (has_state, layout.state_floats) {
        (false, w) if w > 0 => return Err(WireError::MissingState),
        (true, 0) => return Err(WireError::UnexpectedState),
        (true, w) if state_floats != w => {
            return Err(WireError::Geometry { what: "state floats", got: state_floats, expected: w })
        }
        _ => {}
    }
    let needed = HEADER_BYTES + 4 * (prompt_len + draft_count + stop_count);
    if bytes.len() < needed {
        return Err(WireError::Truncated { got: bytes.len(), needed });
    }
    let prompt: Vec<u32> = (0..prompt_len).map(|_| r.u32()).collect();
    let drafts: Vec<u32> = (0..draft_count).map(|_| r.u32()).collect();
    let stop_tokens: Vec<u32> = (0..stop_count).map(|_| r.u32()).collect();
    let vocab = layout.vocab_size;
    let tokens = prompt.iter().chain([&t0]).chain(&drafts).chain(&stop_tokens);
    if let Some((position, &token)) = tokens.enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(WireError::Token { token, position, vocab });
    }
    let descriptor = Descriptor {
        transfer,
        request,
        prompt,
        max_output_tokens,
        warmup: flags & WARMUP != 0,
        sampling,
        drafts,
        delivery: Delivery { stop_tokens, stream: flags & STREAM != 0 },
        t0,
        logits_hash,
        skip_blocks,
        kv_blocks,
        streamed_blocks,
        has_state,
        checksum,
        checked: flags & UNCHECKED == 0,
        started_ms,
        t0_ms,
        to_rank,
    };
    Ok((descriptor, needed))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn layout() -> ConsumerLayout {
        ConsumerLayout {
            fingerprint: 77,
            block_size: 4,
            floats_per_block: 6,
            state_floats: 3,
            vocab_size: 100,
            max_prompt: 64,
        }
    }

    pub(crate) fn handoff() -> Handoff {
        Handoff {
            transfer: TransferId { nonce: 9, generation: 2 },
            request: 41,
            prompt: vec![1, 2, 3, 4, 5, 6, 7, 8, 9],
            max_output_tokens: 5,
            warmup: true,
            sampling: RequestSampling { params: SamplingParams { temperature: 0.7, top_k: 5, top_p: 0.9 }, seed: 3 },
            drafts: vec![7, 8, 9],
            delivery: Delivery { stop_tokens: vec![2, 99], stream: true },
            t0: 42,
            logits_hash: 0xABCD,
            fingerprint: 77,
            skip_blocks: 1,
            kv_blocks: 2,
            floats_per_block: 6,
            streamed: Vec::new(),
            kv: vec![0.5; 12],
            source: None,
            landed: None,
            state: Some(vec![1.0; 3]),
            started_ms: 0.0,
            t0_ms: 0.0,
            to: None,
            recycle: None,
            on_drop: Default::default(),
        }
    }

    #[test]
    fn a_descriptor_round_trips() {
        let h = handoff();
        let bytes = encode_descriptor(&h, Some(123), 0);
        let (d, used) = decode_descriptor(&bytes, &layout()).unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!((d.request, d.t0, d.skip_blocks, d.kv_blocks, d.checksum), (41, 42, 1, 2, 123));
        assert_eq!(d.prompt, h.prompt);
        assert_eq!((d.sampling, &d.drafts, &d.delivery), (h.sampling, &h.drafts, &h.delivery));
        assert!(d.warmup && d.has_state);
        assert_eq!(d.payload_bytes(&layout()), 4 * (12 + 3));
    }

    #[test]
    fn every_size_is_checked_against_the_consumer() {
        let ok = handoff();
        let with = |edit: fn(&mut Handoff)| {
            let mut h = handoff();
            edit(&mut h);
            h
        };
        let refuse = |h: Handoff, layout: ConsumerLayout| {
            decode_descriptor(&encode_descriptor(&h, Some(0), 0), &layout).unwrap_err()
        };
        assert!(matches!(
            refuse(ok.clone(), ConsumerLayout { fingerprint: 1, ..layout() }),
            WireError::LayoutMismatch { .. }
        ));
        assert!(matches!(refuse(with(|h| h.kv_blocks = 3), layout()), WireError::Geometry { .. }));
        assert!(matches!(refuse(with(|h| h.skip_blocks = 9), layout()), WireError::Geometry { .. }));
        assert!(matches!(refuse(with(|h| h.state = None), layout()), WireError::MissingState));
        assert!(matches!(
            refuse(ok.clone(), ConsumerLayout { state_floats: 0, ..layout() }),
            WireError::UnexpectedState
        ));
        assert!(matches!(refuse(with(|h| h.t0 = 100), layout()), WireError::Token { .. }));
        assert!(matches!(
            refuse(ok.clone(), ConsumerLayout { max_prompt: 8, ..layout() }),
            WireError::PromptLength { .. }
        ));
    }

    /// Random and truncated messages give errors, never a panic (and a decode never reads past
    /// what it was given).
    #[test]
    fn random_and_truncated_messages_never_panic() {
        let valid = encode_descriptor(&handoff(), Some(5), 0);
        let mut state = 0x1234_5678_9ABC_DEF0u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for cut in 0..valid.len() {
            assert!(decode_descriptor(&valid[..cut], &layout()).is_err(), "cut at {cut}");
        }
        for _ in 0..20_000 {
            let mut bytes = valid.clone();
            for _ in 0..1 + next() % 6 {
                let i = (next() as usize) % bytes.len();
                bytes[i] = next() as u8;
            }
            if next() % 4 == 0 {
                bytes.truncate((next() as usize) % (bytes.len() + 1));
            }
            let _ = decode_descriptor(&bytes, &layout());
            let noise: Vec<u8> = (0..(next() % 200) as usize).map(|_| next() as u8).collect();
            let _ = decode_descriptor(&noise, &layout());
        }
    }
}
