//! The handoff descriptor on the wire (DESIGN §8), encoded with bincode 2 ([`WireDescriptor`]):
//! the transfer, the request's sampling, the prompt's tokens, the producer's drafts and the
//! request's stop tokens; the payload follows it as raw bytes — KV floats packed by layer, then
//! the state slot's floats. The consumer checks the decoded descriptor against what *it*
//! allocates ([`ConsumerLayout`]) before a byte of payload is read, so a descriptor can never
//! make it write outside the blocks and the slot it allocated for that request. The protocol's
//! version is agreed once, at registration (`tcp::frames`).

use super::{Handoff, TransferId};
use crate::messages::Delivery;
use bincode::{Decode, Encode};
use kvflow_kernels::cpu::sampling::{RequestSampling, SamplingParams};

/// The most drafts a handoff carries (`[speculative] draft_tokens` is at most 16).
pub const MAX_HANDOFF_DRAFTS: usize = 16;
/// The most bytes a descriptor may take (a prompt of about 3 million tokens): the limit its
/// decode runs under, so a claimed length never allocates beyond it.
pub const MAX_DESCRIPTOR_BYTES: usize = 16 << 20;

/// The bincode configuration of the handoff's frames, with the most bytes one may take.
pub(crate) type FrameConfig<const LIMIT: usize> = bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<LIMIT>,
>;

/// [`FrameConfig`] with `LIMIT`.
pub(crate) const fn frame_config<const LIMIT: usize>() -> FrameConfig<LIMIT> {
    bincode::config::standard().with_little_endian().with_variable_int_encoding().with_limit::<LIMIT>()
}

/// A handoff's descriptor as bincode encodes it.
#[derive(Clone, Debug, PartialEq, Encode, Decode)]
pub struct WireDescriptor {
    pub nonce: u64,
    pub generation: u32,
    pub request: u64,
    pub fingerprint: u64,
    pub t0: u32,
    pub logits_hash: u64,
    pub max_output_tokens: u64,
    /// Tokens a block of the producer holds (the blocks below count them).
    pub block_size: u32,
    pub skip_blocks: u32,
    pub kv_blocks: u32,
    pub streamed_blocks: u32,
    pub floats_per_block: u32,
    pub state_floats: u32,
    /// CRC32C of the payload, `None` when the transfer is not checksummed.
    pub checksum: Option<u32>,
    pub warmup: bool,
    pub stream: bool,
    pub started_ms: f64,
    pub t0_ms: f64,
    pub to_rank: Option<u32>,
    /// The prompt tokens the rank that asked already holds.
    pub to_skip_tokens: u32,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub seed: u64,
    pub prompt: Vec<u32>,
    pub drafts: Vec<u32>,
    pub stop_tokens: Vec<u32>,
}

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

impl ConsumerLayout {
    /// Floats of one token's KV across every layer (a block of any size holds a multiple).
    pub fn floats_per_token(&self) -> usize {
        self.floats_per_block / self.block_size.max(1)
    }
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
    /// Tokens a block of the producer holds (the blocks here count them).
    pub block_size: usize,
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
    /// The prompt tokens that rank already holds.
    pub to_skip_tokens: u32,
}

impl Descriptor {
    /// Floats of one of the producer's blocks (of this pool's floats a token).
    pub fn floats_per_block(&self, layout: &ConsumerLayout) -> usize {
        layout.floats_per_token() * self.block_size
    }

    /// Bytes of payload after the header and prompt.
    pub fn payload_bytes(&self, layout: &ConsumerLayout) -> usize {
        let blocks = self.kv_blocks - self.streamed_blocks;
        4 * (blocks * self.floats_per_block(layout) + if self.has_state { layout.state_floats } else { 0 })
    }
}

/// Why a descriptor was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("not a handoff descriptor: {0}")]
    Decode(String),
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

impl WireDescriptor {
    /// `h`'s descriptor. `checksum`: the payload's CRC32C, `Some(0)` when it follows the payload
    /// (a stream computes it while sending), or `None` when the transfer is not checksummed
    /// (`[transfer] checksum = false`). `streamed_blocks`: the blocks the payload leaves out,
    /// sent ahead in pieces (0: it is whole).
    pub fn of(h: &Handoff, checksum: Option<u32>, streamed_blocks: usize) -> WireDescriptor {
        let sampling = &h.sampling.params;
        WireDescriptor {
            nonce: h.transfer.nonce,
            generation: h.transfer.generation,
            request: h.request,
            fingerprint: h.fingerprint,
            t0: h.t0,
            logits_hash: h.logits_hash,
            max_output_tokens: h.max_output_tokens as u64,
            block_size: h.block_size as u32,
            skip_blocks: h.skip_blocks as u32,
            kv_blocks: h.kv_blocks as u32,
            streamed_blocks: streamed_blocks as u32,
            floats_per_block: h.floats_per_block as u32,
            state_floats: h.state.as_ref().map_or(0, Vec::len) as u32,
            checksum,
            warmup: h.warmup,
            stream: h.delivery.stream,
            started_ms: h.started_ms,
            t0_ms: h.t0_ms,
            to_rank: h.to.map(|b| b.rank),
            to_skip_tokens: h.to.map_or(0, |b| b.skip_tokens),
            temperature: sampling.temperature,
            top_k: u32::try_from(sampling.top_k).unwrap_or(u32::MAX),
            top_p: sampling.top_p,
            seed: h.sampling.seed,
            prompt: h.prompt.clone(),
            drafts: h.drafts.clone(),
            stop_tokens: h.delivery.stop_tokens.clone(),
        }
    }

    /// Checks it against what this consumer allocates: every size, every token, the sampling.
    pub fn check(self, layout: &ConsumerLayout) -> Result<Descriptor, WireError> {
        let w = self;
        if w.fingerprint != layout.fingerprint {
            return Err(WireError::LayoutMismatch { got: w.fingerprint, expected: layout.fingerprint });
        }
        if w.drafts.len() > MAX_HANDOFF_DRAFTS {
            return Err(WireError::Geometry { what: "drafts", got: w.drafts.len(), expected: MAX_HANDOFF_DRAFTS });
        }
        if w.stop_tokens.len() > Delivery::MAX_STOP_TOKENS {
            let (got, expected) = (w.stop_tokens.len(), Delivery::MAX_STOP_TOKENS);
            return Err(WireError::Geometry { what: "stop tokens", got, expected });
        }
        let params = SamplingParams { temperature: w.temperature, top_k: w.top_k as usize, top_p: w.top_p };
        params.check().map_err(WireError::Sampling)?;
        let prompt_len = w.prompt.len();
        if prompt_len == 0 || prompt_len > layout.max_prompt {
            return Err(WireError::PromptLength { got: prompt_len, max: layout.max_prompt });
        }
        // Any block size: the same floats a token (the inbox re-cuts them into this pool's blocks).
        let block_size = w.block_size as usize;
        let per_token = layout.floats_per_token();
        if layout.floats_per_block > 0 && (block_size == 0 || w.floats_per_block as usize != per_token * block_size) {
            let (got, expected) = (w.floats_per_block as usize, per_token * block_size);
            return Err(WireError::Geometry { what: "floats per block", got, expected });
        }
        let (skip_blocks, kv_blocks, streamed_blocks) =
            (w.skip_blocks as usize, w.kv_blocks as usize, w.streamed_blocks as usize);
        let prompt_blocks = if layout.floats_per_block == 0 { 0 } else { prompt_len.div_ceil(block_size) };
        if skip_blocks > prompt_blocks || kv_blocks != prompt_blocks - skip_blocks {
            let expected = prompt_blocks.saturating_sub(skip_blocks);
            return Err(WireError::Geometry { what: "KV blocks sent", got: kv_blocks, expected });
        }
        if streamed_blocks > kv_blocks {
            return Err(WireError::Geometry {
                what: "KV blocks sent ahead",
                got: streamed_blocks,
                expected: kv_blocks,
            });
        }
        let has_state = w.state_floats > 0;
        match (has_state, layout.state_floats) {
            (false, f) if f > 0 => return Err(WireError::MissingState),
            (true, 0) => return Err(WireError::UnexpectedState),
            (true, f) if w.state_floats as usize != f => {
                return Err(WireError::Geometry { what: "state floats", got: w.state_floats as usize, expected: f })
            }
            _ => {}
        }
        let vocab = layout.vocab_size;
        let tokens = w.prompt.iter().chain([&w.t0]).chain(&w.drafts).chain(&w.stop_tokens);
        if let Some((position, &token)) = tokens.enumerate().find(|(_, &t)| t as usize >= vocab) {
            return Err(WireError::Token { token, position, vocab });
        }
        Ok(Descriptor {
            transfer: TransferId { nonce: w.nonce, generation: w.generation },
            request: w.request,
            prompt: w.prompt,
            max_output_tokens: usize::try_from(w.max_output_tokens).unwrap_or(usize::MAX),
            warmup: w.warmup,
            sampling: RequestSampling { params, seed: w.seed },
            drafts: w.drafts,
            delivery: Delivery { stop_tokens: w.stop_tokens, stream: w.stream },
            t0: w.t0,
            logits_hash: w.logits_hash,
            block_size,
            skip_blocks,
            kv_blocks,
            streamed_blocks,
            has_state,
            checksum: w.checksum.unwrap_or(0),
            checked: w.checksum.is_some(),
            started_ms: w.started_ms,
            t0_ms: w.t0_ms,
            to_rank: w.to_rank,
            to_skip_tokens: w.to_skip_tokens,
        })
    }
}

/// `h`'s descriptor, encoded (the payload follows it; see [`WireDescriptor::of`]).
pub fn encode_descriptor(h: &Handoff, checksum: Option<u32>, streamed_blocks: usize) -> Vec<u8> {
    let config = frame_config::<MAX_DESCRIPTOR_BYTES>();
    bincode::encode_to_vec(WireDescriptor::of(h, checksum, streamed_blocks), config).unwrap_or_default()
}

/// Decodes a descriptor from the start of `bytes` and checks it against `layout`. Returns the
/// descriptor and how many bytes it took.
pub fn decode_descriptor(bytes: &[u8], layout: &ConsumerLayout) -> Result<(Descriptor, usize), WireError> {
    let config = frame_config::<MAX_DESCRIPTOR_BYTES>();
    let (w, used): (WireDescriptor, usize) =
        bincode::decode_from_slice(bytes, config).map_err(|e| WireError::Decode(e.to_string()))?;
    Ok((w.check(layout)?, used))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn layout() -> ConsumerLayout {
        ConsumerLayout {
            fingerprint: 77,
            block_size: 4,
            floats_per_block: 8,
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
            block_size: 4,
            skip_blocks: 1,
            kv_blocks: 2,
            floats_per_block: 8,
            streamed: Vec::new(),
            kv: vec![0.5; 16],
            source: None,
            landed: None,
            state: Some(vec![1.0; 3]),
            started_ms: 0.0,
            t0_ms: 0.0,
            to: None,
            recycle: None,
            on_drop: Default::default(),
            simulated: None,
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
        assert_eq!(d.payload_bytes(&layout()), 4 * (16 + 3));
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
