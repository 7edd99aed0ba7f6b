//! A connection of kvflow's own for loads, over TCP or a Unix socket. It sends a load's commands
//! as the `redis` crate packs them and reads the replies (RESP2) itself, so that a chunk's bytes
//! go from the socket straight into the buffer the load returns: the crate's parser copies a
//! large reply about three times (its buffer grows, then the value is copied out), which made a
//! load slower than `redis-benchmark` GET of the same bytes on the same server. A `rediss://`
//! store (TLS) has no wire: its loads go through the crate.

use super::faults::Failure;
use redis::{ConnectionAddr, ConnectionInfo};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// A reply, as far as a load reads one.
#[derive(Debug, PartialEq)]
pub enum Reply {
    Nil,
    Int(i64),
    /// A bulk or simple string.
    Bytes(Vec<u8>),
    /// The server's error line (`OOM …`, `NOAUTH …`).
    Error(String),
    Array(Vec<Reply>),
}

/// The most a bulk reply's buffer is allocated ahead of its bytes arriving (a larger one grows as
/// they come, so a wrong length from the peer cannot allocate what it claims).
const PREALLOCATE: usize = 64 << 20;
/// The longest reply line (a length, a number, a status or an error).
const LINE: u64 = 64 << 10;
/// The deepest arrays a reply may nest (a load's replies nest at most one deep).
const DEPTH: usize = 8;

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

pub struct Wire {
    stream: BufReader<Stream>,
}

impl Wire {
    /// Whether a store at `info` is reached over a wire (not TLS).
    pub fn serves(info: &ConnectionInfo) -> bool {
        matches!(info.addr(), ConnectionAddr::Tcp(..) | ConnectionAddr::Unix(_))
    }

    /// Connects to the store at `info` (which [`Wire::serves`]), logs in and selects its
    /// database; every read and write is bounded by `timeout`.
    pub fn connect(info: &ConnectionInfo, timeout: Duration) -> Result<Wire, Failure> {
        let stream = match info.addr() {
            ConnectionAddr::Tcp(host, port) => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address"));
                let mut found = None;
                for addr in std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), *port)).map_err(Failure::of_io)? {
                    match TcpStream::connect_timeout(&addr, timeout) {
                        Ok(s) => {
                            found = Some(s);
                            break;
                        }
                        Err(e) => last = e,
                    }
                }
                let s = found.ok_or_else(|| Failure::of_io(last))?;
                s.set_nodelay(true).map_err(Failure::of_io)?;
                s.set_read_timeout(Some(timeout)).map_err(Failure::of_io)?;
                s.set_write_timeout(Some(timeout)).map_err(Failure::of_io)?;
                Stream::Tcp(s)
            }
            ConnectionAddr::Unix(path) => {
                let s = UnixStream::connect(path).map_err(Failure::of_io)?;
                s.set_read_timeout(Some(timeout)).map_err(Failure::of_io)?;
                s.set_write_timeout(Some(timeout)).map_err(Failure::of_io)?;
                Stream::Unix(s)
            }
            other => return Err(Failure::Refused(format!("{other:?} is reached through the redis crate, not a wire"))),
        };
        let mut wire = Wire { stream: BufReader::with_capacity(64 << 10, stream) };
        let settings = info.redis_settings();
        let mut hello = redis::pipe();
        if let Some(password) = settings.password() {
            hello.cmd("AUTH");
            if let Some(user) = settings.username() {
                hello.arg(user);
            }
            hello.arg(password);
        }
        if settings.db() != 0 {
            hello.cmd("SELECT").arg(settings.db());
        }
        if !hello.is_empty() {
            for reply in wire.round_trip(&hello.get_packed_pipeline(), hello.len())? {
                if let Reply::Error(why) = reply {
                    return Err(Failure::of_server(why));
                }
            }
        }
        Ok(wire)
    }

    /// Sends `packed` (commands the `redis` crate packed) and reads their `replies` replies.
    pub fn round_trip(&mut self, packed: &[u8], replies: usize) -> Result<Vec<Reply>, Failure> {
        Ok(self.round_trip_streaming(packed, replies, usize::MAX, |_, _| ())?.0)
    }

    /// [`Wire::round_trip`], except that the reply at `streamed`, when it is a bulk string, is
    /// handed to `read` as it arrives (its length, and a reader of exactly its bytes) instead of
    /// being buffered: it comes back as what `read` returned, and as `Reply::Nil` in the list.
    /// Whatever `read` leaves unread is drained, so the connection stays in step.
    pub fn round_trip_streaming<T>(
        &mut self,
        packed: &[u8],
        replies: usize,
        streamed: usize,
        read: impl FnOnce(&mut dyn Read, usize) -> T,
    ) -> Result<(Vec<Reply>, Option<T>), Failure> {
        self.stream.get_mut().write_all(packed).map_err(Failure::of_io)?;
        let (mut out, mut read, mut streamed_out) = (Vec::with_capacity(replies), Some(read), None);
        for at in 0..replies {
            let r = &mut self.stream;
            let line = read_line(r).map_err(Failure::of_io)?;
            match (at == streamed, bulk_len(&line).map_err(Failure::of_io)?) {
                (true, Some(len)) => {
                    let mut body = r.by_ref().take(len as u64);
                    let read = read.take().expect("one streamed reply");
                    streamed_out = Some(read(&mut body, len));
                    std::io::copy(&mut body, &mut std::io::sink()).map_err(Failure::of_io)?;
                    if body.limit() > 0 {
                        return Err(Failure::of_io(torn("mid-value")));
                    }
                    end_of_value(r).map_err(Failure::of_io)?;
                    out.push(Reply::Nil);
                }
                _ => out.push(reply_after(&line, r, 0).map_err(Failure::of_io)?),
            }
        }
        Ok((out, streamed_out))
    }
}

/// One reply from `r`; a bulk string's bytes are read straight into its buffer.
pub fn read_reply(r: &mut impl BufRead, depth: usize) -> io::Result<Reply> {
    let line = read_line(r)?;
    reply_after(&line, r, depth)
}

/// A reply line, without its CRLF.
fn read_line(r: &mut impl BufRead) -> io::Result<Vec<u8>> {
    let mut line = Vec::with_capacity(32);
    r.by_ref().take(LINE).read_until(b'\n', &mut line)?;
    if !line.ends_with(b"\r\n") {
        return Err(torn("mid-line"));
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

/// The length of the bulk string `line` announces (`None` for any other reply, or nil).
fn bulk_len(line: &[u8]) -> io::Result<Option<usize>> {
    match line.split_first() {
        Some((b'$', rest)) => Ok(usize::try_from(number(rest)?).ok()),
        _ => Ok(None),
    }
}

/// The reply `line` begins, its body read from `r`.
fn reply_after(line: &[u8], r: &mut impl BufRead, depth: usize) -> io::Result<Reply> {
    let Some((&kind, rest)) = line.split_first() else { return Err(bad("an empty reply line")) };
    Ok(match kind {
        b'+' => Reply::Bytes(rest.to_vec()),
        b'-' => Reply::Error(String::from_utf8_lossy(rest).into_owned()),
        b':' => Reply::Int(number(rest)?),
        b'$' => match usize::try_from(number(rest)?) {
            Err(_) => Reply::Nil,
            Ok(len) => {
                let mut bytes = Vec::with_capacity(len.min(PREALLOCATE));
                r.take(len as u64).read_to_end(&mut bytes)?;
                if bytes.len() < len {
                    return Err(torn("mid-value"));
                }
                end_of_value(r)?;
                Reply::Bytes(bytes)
            }
        },
        b'*' => match usize::try_from(number(rest)?) {
            Err(_) => Reply::Nil,
            Ok(_) if depth >= DEPTH => return Err(bad("arrays nested deeper than a load's replies")),
            Ok(n) => Reply::Array((0..n).map(|_| read_reply(r, depth + 1)).collect::<io::Result<_>>()?),
        },
        _ => return Err(bad("a reply of a kind RESP2 does not have")),
    })
}

fn number(text: &[u8]) -> io::Result<i64> {
    std::str::from_utf8(text).ok().and_then(|s| s.parse().ok()).ok_or_else(|| bad("a length that is not a number"))
}

/// The CRLF after a bulk string's bytes.
fn end_of_value(r: &mut impl BufRead) -> io::Result<()> {
    let mut end = [0u8; 2];
    r.read_exact(&mut end)?;
    if end != *b"\r\n" {
        return Err(bad("a value longer than its length"));
    }
    Ok(())
}

fn torn(where_: &str) -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, format!("the store's reply ended {where_}"))
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("the store sent {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_read_back_and_a_torn_one_is_an_error() {
        let mut text: &[u8] = b"$5\r\nhello\r\n$-1\r\n:42\r\n+OK\r\n-OOM no memory\r\n*2\r\n$1\r\na\r\n:1\r\n";
        let mut next = || read_reply(&mut text, 0).unwrap();
        assert_eq!(next(), Reply::Bytes(b"hello".to_vec()));
        assert_eq!(next(), Reply::Nil);
        assert_eq!(next(), Reply::Int(42));
        assert_eq!(next(), Reply::Bytes(b"OK".to_vec()));
        assert_eq!(next(), Reply::Error("OOM no memory".into()));
        assert_eq!(next(), Reply::Array(vec![Reply::Bytes(b"a".to_vec()), Reply::Int(1)]));
        for torn in [&b"$5\r\nhel"[..], b"$5\r\nhelloXX", b"$5", b"?1\r\n", b"$x\r\n"] {
            assert!(read_reply(&mut &torn[..], 0).is_err(), "{:?}", String::from_utf8_lossy(torn));
        }
        let deep = "*1\r\n".repeat(DEPTH + 1) + ":1\r\n";
        assert!(read_reply(&mut deep.as_bytes(), 0).is_err(), "nesting is bounded");
    }
}
