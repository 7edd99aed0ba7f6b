//! The `tcp` transfer backend (DESIGN §8). The consumer binds its endpoint first (port 0: the
//! kernel picks), and only the bound address is published to producers (listener readiness).
//! Each producer link connects and registers with the layout fingerprint, the deployment token
//! and its link id; the consumer refuses a mismatch.
//!
//! Every frame is bincode 2 (`frames`: its length, then its body, decoded under a byte limit);
//! registration agrees the protocol version first. Producer → consumer, one frame after
//! another: a handoff (its descriptor — checked against the consumer's own layout before a byte
//! of payload is read —, then the payload as raw bytes, KV floats then state floats, and its
//! CRC32C, which the producer computes while sending and the consumer while receiving, verified
//! before the ack; with `[transfer] checksum = false` none is computed); an abort (a request
//! cancelled while in transfer, or after: the consumer drops or cancels it and answers); a close
//! (the producer's pool ended: no more handoffs on this link); a piece of a streamed handoff,
//! sent ahead while its prefill runs, and the drop of a request's pieces (`pieces`).
//!
//! Consumer → producer: acks (or refusals); and when the decode pool runs in another process,
//! the events of the requests that came over the link (their tokens, for the report) and, when
//! the pool has ended, its end-of-run check.
//!
//! Each link sends from its own thread (a rank never waits on a socket) and keeps every handoff
//! until its ack: when the connection drops, the link reconnects and sends what was unanswered
//! again; a transfer cut twice, or a peer that is gone, fails at once — nothing waits for a
//! timeout.

mod consumer;
mod frames;
mod landing;
mod link;
mod pieces;
#[cfg(test)]
mod tests;

pub use consumer::{ConsumerOptions, LostProducer, TcpConsumer};
pub use frames::PROTOCOL;
pub use link::{LinkOptions, LinkTarget, TcpLink, TcpLinks};

use std::io::{Read, Write};

/// How a consumer's refusal of a damaged payload begins (the producer sends it once more).
const CHECKSUM_REFUSAL: &str = "checksum";

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// The answer to a registration: a byte (0 = ok), a u16 length and a message — the shape every
/// kvflow version reads, so a peer of another version hears why it is refused.
fn write_status(w: &mut impl Write, outcome: &Result<(), String>) -> std::io::Result<()> {
    let message = outcome.as_ref().err().map_or("", String::as_str);
    let message = &message.as_bytes()[..message.len().min(u16::MAX as usize)];
    let mut frame = vec![u8::from(outcome.is_err())];
    frame.extend_from_slice(&(message.len() as u16).to_le_bytes());
    frame.extend_from_slice(message);
    w.write_all(&frame)?;
    w.flush()
}

fn read_status(r: &mut impl Read) -> std::io::Result<Result<(), String>> {
    let mut head = [0; 3];
    r.read_exact(&mut head)?;
    let mut message = vec![0; u16::from_le_bytes([head[1], head[2]]) as usize];
    r.read_exact(&mut message)?;
    Ok(if head[0] == 0 { Ok(()) } else { Err(String::from_utf8_lossy(&message).into_owned()) })
}
