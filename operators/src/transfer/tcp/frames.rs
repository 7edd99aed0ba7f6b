//! The tcp link's frames (DESIGN §8), encoded with bincode 2: each is its body's length (a
//! little-endian u32), then the body, decoded under a byte limit so that a length it claims
//! never allocates beyond it. A handoff's and a piece's raw bytes, and their CRC32C, follow
//! their frame.
//!
//! Registration comes first on a connection: the producer's magic and protocol version (fixed
//! bytes, so a peer of any version can read them), then its [`Hello`] frame; the consumer
//! answers with a status (a byte, a u16 length and a message — the one shape every kvflow
//! version reads), refusing a peer of another version with a message naming both.

use super::super::wire::{frame_config, WireDescriptor, MAX_DESCRIPTOR_BYTES};
use crate::messages::Event;
use bincode::{Decode, Encode};
use std::io::{Read, Write};

/// This kvflow's handoff protocol version (bincode frames; 4 and older wrote fixed
/// little-endian frames).
pub const PROTOCOL: u32 = 5;
/// What a producer's first bytes are.
pub(super) const MAGIC: [u8; 4] = *b"KVF2";
/// What a producer of protocol 4 or older sent first.
const OLD_MAGIC: [u8; 4] = *b"KVFR";
/// The most bytes of a frame a consumer sends (events carry a request's tokens).
pub(super) const MAX_TO_PRODUCER: usize = 64 << 20;
/// The most bytes of a frame a producer sends (a handoff's descriptor carries its prompt).
pub(super) const MAX_TO_CONSUMER: usize = MAX_DESCRIPTOR_BYTES + 1024;
/// The most bytes of a registration.
const MAX_HELLO: usize = 4096;

/// A producer's registration: its layout fingerprint, the deployment token and its link id.
#[derive(Clone, Debug, PartialEq, Encode, Decode)]
pub(super) struct Hello {
    pub fingerprint: u64,
    pub token: String,
    pub link_id: u64,
}

/// A streamed piece's header: its floats and their CRC32C follow.
#[derive(Clone, Debug, PartialEq, Encode, Decode)]
pub(super) struct PieceHeader {
    pub request: u64,
    pub nonce: u64,
    pub generation: u32,
    pub first_block: u32,
    pub blocks: u32,
    /// Floats of one block in each layer.
    pub layer_floats: Vec<u32>,
    pub sent_ms: f64,
    pub checked: bool,
}

/// Producer → consumer.
#[derive(Clone, Debug, PartialEq, Encode, Decode)]
pub(super) enum ToConsumer {
    /// A handoff: its payload's bytes, then their CRC32C (0 when unchecked), follow.
    Handoff(WireDescriptor),
    /// A piece sent ahead of its handoff: its floats, then their CRC32C, follow.
    Piece(PieceHeader),
    /// Drop the pieces staged for a request that will not hand off.
    DropPieces { request: u64, nonce: u64 },
    /// A request cancelled while in transfer (or after): drop or cancel it and answer.
    Abort { request: u64, nonce: u64, generation: u32 },
    /// The producer's pool ended: nothing more on this link.
    Close,
}

/// Consumer → producer.
#[derive(Clone, Debug, PartialEq, Encode, Decode)]
pub(super) enum ToProducer {
    /// The answer to a handoff: `refused` says why when it was not taken.
    Ack { request: u64, nonce: u64, generation: u32, refused: Option<String> },
    /// Events of requests that came over the link (a decode pool in another process).
    Events(#[bincode(with_serde)] Vec<Event>),
    /// The remote pool ended, with its end-of-run check.
    Done { failed: Option<String> },
    /// The consumer has this request's abort.
    AbortSeen { request: u64 },
}

/// `frame` as its length and body.
pub(super) fn encode<T: Encode>(frame: &T) -> Vec<u8> {
    let body = bincode::encode_to_vec(frame, frame_config::<MAX_TO_PRODUCER>()).unwrap_or_default();
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Reads one frame of at most `max` bytes.
pub(super) fn read<T: Decode<()>, const MAX: usize>(r: &mut impl Read) -> std::io::Result<T> {
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let mut len = [0; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX {
        return Err(bad(format!("a frame of {len} bytes (at most {MAX})")));
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body)?;
    let (frame, used) = bincode::decode_from_slice(&body, frame_config::<MAX>()).map_err(|e| bad(format!("{e}")))?;
    if used != len {
        return Err(bad(format!("a frame of {len} bytes whose body takes {used}")));
    }
    Ok(frame)
}

/// A frame from the producer.
pub(super) fn read_to_consumer(r: &mut impl Read) -> std::io::Result<ToConsumer> {
    read::<ToConsumer, MAX_TO_CONSUMER>(r)
}

/// A frame from the consumer.
pub(super) fn read_to_producer(r: &mut impl Read) -> std::io::Result<ToProducer> {
    read::<ToProducer, MAX_TO_PRODUCER>(r)
}

/// Writes the registration: the magic, this protocol's version, then `hello`.
pub(super) fn write_hello(w: &mut impl Write, hello: &Hello) -> std::io::Result<()> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&PROTOCOL.to_le_bytes());
    out.extend_from_slice(&encode(hello));
    w.write_all(&out)?;
    w.flush()
}

/// Reads a registration. `Ok(Err(why))`: a peer to refuse (another protocol version, or not
/// a kvflow producer), told why.
pub(super) fn read_hello(r: &mut impl Read) -> std::io::Result<Result<Hello, String>> {
    let mut magic = [0; 4];
    r.read_exact(&mut magic)?;
    if magic == OLD_MAGIC {
        return Ok(Err(format!(
            "the producer speaks kvflow's handoff protocol 4 or older; this decode pool speaks protocol {PROTOCOL}: \
             run the same kvflow version on both sides"
        )));
    }
    if magic != MAGIC {
        return Ok(Err("not a kvflow producer".into()));
    }
    let mut version = [0; 4];
    r.read_exact(&mut version)?;
    let version = u32::from_le_bytes(version);
    if version != PROTOCOL {
        return Ok(Err(format!(
            "the producer speaks kvflow's handoff protocol {version}; this decode pool speaks protocol {PROTOCOL}: \
             run the same kvflow version on both sides"
        )));
    }
    read::<Hello, MAX_HELLO>(r).map(Ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::wire::tests::handoff;

    fn every_frame() -> Vec<ToConsumer> {
        let piece = PieceHeader {
            request: 1,
            nonce: 2,
            generation: 3,
            first_block: 4,
            blocks: 5,
            layer_floats: vec![6, 7],
            sent_ms: 8.5,
            checked: true,
        };
        vec![
            ToConsumer::Handoff(WireDescriptor::of(&handoff(), Some(0), 1)),
            ToConsumer::Piece(piece),
            ToConsumer::DropPieces { request: 9, nonce: 10 },
            ToConsumer::Abort { request: 11, nonce: 12, generation: 13 },
            ToConsumer::Close,
        ]
    }

    #[test]
    fn every_frame_round_trips() {
        for frame in every_frame() {
            assert_eq!(read_to_consumer(&mut &encode(&frame)[..]).unwrap(), frame);
        }
        let event = Event::Received { id: 1, rank: 2, taken_ms: 3.5, overlapped_ms: 1.25 };
        for frame in [
            ToProducer::Ack { request: 1, nonce: 2, generation: 3, refused: Some("checksum".into()) },
            ToProducer::Events(vec![event]),
            ToProducer::Done { failed: None },
            ToProducer::AbortSeen { request: 4 },
        ] {
            assert_eq!(read_to_producer(&mut &encode(&frame)[..]).unwrap(), frame);
        }
    }

    #[test]
    fn a_peer_of_another_protocol_version_is_refused_naming_both() {
        let hello = Hello { fingerprint: 1, token: "t".into(), link_id: 2 };
        let mut bytes = Vec::new();
        write_hello(&mut bytes, &hello).unwrap();
        assert_eq!(read_hello(&mut &bytes[..]).unwrap(), Ok(hello));
        bytes[4..8].copy_from_slice(&7u32.to_le_bytes());
        let why = read_hello(&mut &bytes[..]).unwrap().unwrap_err();
        assert!(why.contains("protocol 7") && why.contains(&format!("protocol {PROTOCOL}")), "{why}");
        // What a producer of protocol 4 sent first: its magic, then its fingerprint.
        let old = [b"KVFR".as_slice(), &1u64.to_le_bytes()].concat();
        let why = read_hello(&mut &old[..]).unwrap().unwrap_err();
        assert!(why.contains("protocol 4 or older") && why.contains(&format!("protocol {PROTOCOL}")), "{why}");
        assert!(read_hello(&mut &b"HTTP/1.1"[..]).unwrap().is_err());
    }

    /// Random and truncated frames give errors, never a panic, and a length a frame claims
    /// never allocates beyond the limit its decode runs under.
    #[test]
    fn random_and_truncated_frames_never_panic() {
        let mut state = 0x0123_4567_89AB_CDEFu64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for valid in every_frame().iter().map(encode) {
            for cut in 0..valid.len() {
                assert!(read_to_consumer(&mut &valid[..cut]).is_err(), "cut at {cut}");
            }
            for _ in 0..4_000 {
                let mut bytes = valid.clone();
                for _ in 0..1 + next() % 6 {
                    let i = (next() as usize) % bytes.len();
                    bytes[i] = next() as u8;
                }
                let _ = read_to_consumer(&mut &bytes[..]);
                let _ = read_to_producer(&mut &bytes[..]);
            }
        }
        // A body that claims a vector of a billion tokens: refused by the limit, not allocated.
        let mut claim = vec![0u8]; // variant 0, a descriptor whose first fields are small …
        claim.extend([1u8; 17]);
        claim.extend([252, 0, 0xCA, 0x9A, 0x3B]); // … then a length of 1,000,000,000 (varint u32)
        let framed = [&(claim.len() as u32).to_le_bytes()[..], &claim].concat();
        assert!(read_to_consumer(&mut &framed[..]).is_err());
        for _ in 0..2_000 {
            let noise: Vec<u8> = (0..(next() % 300) as usize).map(|_| next() as u8).collect();
            let framed = [&(noise.len() as u32).to_le_bytes()[..], &noise].concat();
            let _ = read_to_consumer(&mut &framed[..]);
            let _ = read_to_producer(&mut &framed[..]);
        }
    }
}
