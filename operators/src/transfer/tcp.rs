//! The `tcp` transfer backend (DESIGN §8). The consumer binds its endpoint first (port 0: the
//! kernel picks), and only the bound address is published to producers (listener readiness).
//! Each producer connects and registers with the layout fingerprint and the deployment token;
//! the consumer refuses a mismatch. A handoff is then one frame: the descriptor's length, the
//! descriptor (checked against the consumer's own layout before a byte of payload is read), and
//! the payload — KV floats, then state floats — streamed in pieces, and its CRC32C, which the
//! producer computes while sending and the consumer while receiving (so it follows the payload),
//! verified before the ack. With `[transfer] checksum = false` none is computed. Acks (or
//! refusals) come back on the same connection; a connection that drops fails every handoff still
//! waiting on it, so nothing waits for a timeout.

use super::inproc::{handoff_admission, Ack, AckQueue, ConsumerPool, HandoffSink};
use super::wire::{decode_descriptor, encode_descriptor, ConsumerLayout, HEADER_BYTES};
use super::{locked, read_floats, stream_payload, Crc32c, Handoff, TransferId};
use kvflow_kernels::hash;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const HELLO: u32 = u32::from_le_bytes(*b"KVFR");

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// A status and message frame (0 = ok).
fn write_status(w: &mut impl Write, ok: bool, message: &str) -> std::io::Result<()> {
    let message = &message.as_bytes()[..message.len().min(u16::MAX as usize)];
    w.write_all(&[u8::from(!ok)])?;
    w.write_all(&(message.len() as u16).to_le_bytes())?;
    w.write_all(message)?;
    w.flush()
}

fn read_status(r: &mut impl Read) -> std::io::Result<Result<(), String>> {
    let mut head = [0; 3];
    r.read_exact(&mut head)?;
    let mut message = vec![0; u16::from_le_bytes([head[1], head[2]]) as usize];
    r.read_exact(&mut message)?;
    Ok(if head[0] == 0 { Ok(()) } else { Err(String::from_utf8_lossy(&message).into_owned()) })
}

/// A decode pool's listening side.
pub struct TcpConsumer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl TcpConsumer {
    /// Binds `endpoint` (`host:port`, `[::1]:0`, …) for `pool`, then starts accepting. An error
    /// names the endpoint: registration never goes ahead on a listener that did not bind.
    pub fn bind(
        endpoint: &str,
        pool: ConsumerPool,
        layout: ConsumerLayout,
        token: Option<String>,
    ) -> Result<TcpConsumer, String> {
        let listener = TcpListener::bind(endpoint).map_err(|e| format!("cannot listen on {endpoint}: {e}"))?;
        let addr = listener.local_addr().map_err(|e| format!("{endpoint}: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        std::thread::Builder::new()
            .name(format!("kvflow-listen-{}", pool.name))
            .spawn(move || {
                for conn in listener.incoming() {
                    if stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(conn) = conn else { continue };
                    let (pool, token) = (pool.clone(), token.clone());
                    let _ = std::thread::Builder::new()
                        .name(format!("kvflow-recv-{}", pool.name))
                        .spawn(move || serve(conn, &pool, layout, token.as_deref()));
                }
            })
            .map_err(|e| format!("cannot start the listener of {endpoint}: {e}"))?;
        Ok(TcpConsumer { addr, stop })
    }

    /// The address it listens on (the port the kernel picked, for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpConsumer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr); // wakes the accept loop so it sees the flag
    }
}

/// Acks written back on a connection.
struct TcpAcker {
    stream: Mutex<TcpStream>,
}

impl Ack for TcpAcker {
    fn ack(&self, request: u64, transfer: TransferId, outcome: Result<(), String>) {
        let mut s = locked(&self.stream);
        let mut frame = Vec::with_capacity(32);
        frame.extend_from_slice(&request.to_le_bytes());
        frame.extend_from_slice(&transfer.nonce.to_le_bytes());
        frame.extend_from_slice(&transfer.generation.to_le_bytes());
        let _ = s
            .write_all(&frame)
            .and_then(|_| write_status(&mut *s, outcome.is_ok(), outcome.err().as_deref().unwrap_or("")));
    }
}

/// One producer's connection: registration, then handoff frames until it closes.
fn serve(mut conn: TcpStream, pool: &ConsumerPool, layout: ConsumerLayout, token: Option<&str>) {
    let _ = conn.set_nodelay(true);
    let registered = (|| -> std::io::Result<Result<(), String>> {
        if read_u32(&mut conn)? != HELLO {
            return Ok(Err("not a kvflow producer".into()));
        }
        let fingerprint = read_u64(&mut conn)?;
        let mut len = [0; 2];
        conn.read_exact(&mut len)?;
        let mut presented = vec![0; u16::from_le_bytes(len) as usize];
        conn.read_exact(&mut presented)?;
        if fingerprint != layout.fingerprint {
            return Ok(Err(format!(
                "layout fingerprint {fingerprint:#018x} differs from decode pool {}'s {:#018x}",
                pool.name, layout.fingerprint
            )));
        }
        if token.is_some_and(|t| t.as_bytes() != presented) {
            return Ok(Err(format!("decode pool {} refused the deployment token", pool.name)));
        }
        Ok(Ok(()))
    })();
    let Ok(registered) = registered else { return };
    let refused = registered.is_err();
    if write_status(&mut conn, registered.is_ok(), registered.err().as_deref().unwrap_or("")).is_err() || refused {
        return;
    }
    let Ok(back) = conn.try_clone() else { return };
    let acker: Arc<dyn Ack> = Arc::new(TcpAcker { stream: Mutex::new(back) });
    let max_descriptor = HEADER_BYTES + 4 * layout.max_prompt;
    let recycler = super::Recycler::default();
    while let Ok(len) = read_u32(&mut conn) {
        let len = len as usize;
        if len > max_descriptor {
            tracing::error!(pool = %pool.name, len, "handoff descriptor longer than any this pool takes: connection closed");
            return;
        }
        let mut descriptor = vec![0; len];
        if conn.read_exact(&mut descriptor).is_err() {
            return;
        }
        let d = match decode_descriptor(&descriptor, &layout) {
            Ok((d, _)) => d,
            Err(e) => {
                // The payload's length is unknown: the stream cannot be resynchronised.
                tracing::error!(pool = %pool.name, "handoff refused: {e}; connection closed");
                return;
            }
        };
        // Receive the payload, checksumming as it arrives.
        let (kv_floats, state_floats) =
            (d.kv_blocks * layout.floats_per_block, if d.has_state { layout.state_floats } else { 0 });
        let mut crc = Crc32c::new();
        let mut floats = recycler.take(kv_floats + state_floats);
        let checked = d.checked;
        if read_floats(&mut conn, &mut floats, |bytes| {
            if checked {
                crc.update(bytes)
            }
        })
        .is_err()
        {
            return;
        }
        let Ok(sent_crc) = read_u32(&mut conn) else { return };
        if d.checked && crc.value() != sent_crc {
            let why = format!("checksum {:#010x}, expected {sent_crc:#010x}: the bytes were damaged", crc.value());
            acker.ack(d.request, d.transfer, Err(why));
            continue;
        }
        let state = d.has_state.then(|| floats.split_off(kv_floats));
        let h = Handoff {
            transfer: d.transfer,
            request: d.request,
            prompt: d.prompt,
            max_output_tokens: d.max_output_tokens,
            warmup: d.warmup,
            t0: d.t0,
            logits_hash: d.logits_hash,
            fingerprint: layout.fingerprint,
            skip_blocks: d.skip_blocks,
            kv_blocks: d.kv_blocks,
            floats_per_block: layout.floats_per_block,
            kv: floats,
            state,
            started_ms: d.started_ms,
            t0_ms: d.t0_ms,
            recycle: Some(recycler.clone()),
        };
        let admission = handoff_admission(&h);
        pool.inbox.put(Arc::new(h), acker.clone());
        pool.ingress.push(admission);
    }
}

/// A prefill pool's connection to one decode pool.
pub struct TcpLink {
    to: String,
    /// Checksum every payload (`[transfer] checksum`).
    pub checksum: bool,
    stream: Mutex<TcpStream>,
    /// Handoffs sent and not answered, by request id.
    pending: Arc<Mutex<HashMap<u64, Arc<AckQueue>>>>,
    socket_bytes: Arc<AtomicU64>,
}

impl TcpLink {
    /// Connects to decode pool `to` at `addr` and registers (fingerprint, token).
    pub fn connect(
        to: &str,
        addr: impl ToSocketAddrs + std::fmt::Debug,
        fingerprint: u64,
        token: Option<&str>,
        socket_bytes: Arc<AtomicU64>,
    ) -> Result<TcpLink, String> {
        let where_ = format!("decode pool {to} at {addr:?}");
        let mut stream = TcpStream::connect(&addr).map_err(|e| format!("cannot connect to {where_}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let token = token.unwrap_or("").as_bytes();
        let mut hello = Vec::new();
        hello.extend_from_slice(&HELLO.to_le_bytes());
        hello.extend_from_slice(&fingerprint.to_le_bytes());
        hello.extend_from_slice(&(token.len() as u16).to_le_bytes());
        hello.extend_from_slice(token);
        stream.write_all(&hello).map_err(|e| format!("{where_}: {e}"))?;
        read_status(&mut stream)
            .map_err(|e| format!("{where_}: {e}"))?
            .map_err(|why| format!("{where_} refused the registration: {why}"))?;
        let pending: Arc<Mutex<HashMap<u64, Arc<AckQueue>>>> = Default::default();
        let (mut acks, waiting) = (stream.try_clone().map_err(|e| e.to_string())?, pending.clone());
        let name = to.to_string();
        std::thread::Builder::new()
            .name(format!("kvflow-acks-{to}"))
            .spawn(move || {
                let reason = loop {
                    let frame = (|| -> std::io::Result<(u64, TransferId, Result<(), String>)> {
                        let request = read_u64(&mut acks)?;
                        let nonce = read_u64(&mut acks)?;
                        let generation = read_u32(&mut acks)?;
                        Ok((request, TransferId { nonce, generation }, read_status(&mut acks)?))
                    })();
                    match frame {
                        Ok((request, transfer, outcome)) => {
                            if let Some(queue) = locked(&waiting).remove(&request) {
                                queue.ack(request, transfer, outcome);
                            }
                        }
                        Err(e) => break e.to_string(),
                    }
                };
                // The connection is gone: every handoff still waiting on it fails now.
                for (request, queue) in locked(&waiting).drain() {
                    let why = format!("the connection to decode pool {name} dropped ({reason})");
                    queue.ack(request, TransferId { nonce: 0, generation: 0 }, Err(why));
                }
            })
            .map_err(|e| format!("{where_}: {e}"))?;
        Ok(TcpLink { to: to.to_string(), checksum: true, stream: Mutex::new(stream), pending, socket_bytes })
    }

    /// Sends `h`: descriptor, payload streamed in pieces (checksummed as it goes), checksum.
    pub fn send_ref(&self, h: &Handoff, ack: Arc<AckQueue>) -> Result<String, String> {
        let descriptor = encode_descriptor(h, self.checksum.then_some(0));
        locked(&self.pending).insert(h.request, ack);
        let mut s = locked(&self.stream);
        let mut sent = s.write_all(&(descriptor.len() as u32).to_le_bytes()).and_then(|_| s.write_all(&descriptor));
        let mut payload = 0;
        let crc = stream_payload(h, self.checksum, |bytes| {
            if sent.is_ok() {
                sent = s.write_all(bytes);
                payload += bytes.len();
            }
        });
        let sent = sent.and_then(|_| s.write_all(&crc.to_le_bytes())).and_then(|_| s.flush());
        match sent {
            Ok(()) => {
                self.socket_bytes.fetch_add((8 + descriptor.len() + payload) as u64, Ordering::Relaxed);
                Ok(self.to.clone())
            }
            Err(e) => {
                locked(&self.pending).remove(&h.request);
                Err(format!("sending to decode pool {}: {e}", self.to))
            }
        }
    }
}

/// `tcp` links of one prefill pool.
pub struct TcpLinks {
    pub links: Vec<TcpLink>,
}

impl HandoffSink for TcpLinks {
    fn send(&self, h: Handoff, ack: Arc<AckQueue>) -> Result<String, String> {
        if self.links.is_empty() {
            return Err("no decode pool is linked".into());
        }
        let pick = (hash::mix(hash::EMPTY, h.request) % self.links.len() as u64) as usize;
        self.links[pick].send_ref(&h, ack)
    }
}
