//! A cuda consumer's payloads landing in device memory as they arrive on a tcp connection: a
//! whole handoff's KV, a streamed handoff's pieces each as it comes, and the rest of a streamed
//! handoff after them — so the step that imports it only unpacks on the GPU. Which time it holds:
//! the connection thread's, while it reads a payload. Which guarantee it carries: every byte read
//! is checksummed as it lands, and a device that fails to take a payload leaves the stream in
//! step (the rest is read and dropped) and the handoff refused, never half landed.

use crate::transfer::read_floats;
use kvflow_kernels::cuda::{LandedKv, Landing};

/// Floats a landing stages at a time (4 MiB: one copy to the device per 4 MiB read).
const STAGING_FLOATS: usize = 1 << 20;

/// Receives `floats` KV floats from `conn` into device memory through `landing`, a piece at a
/// time (each piece copied to the device while the next is read), feeding the bytes to `seen`.
/// `Err` from the socket ends the connection; `Ok(Err(why))` when the device failed (the rest of
/// the payload is still read, so the stream stays in step, and the handoff is refused).
pub(super) fn land(
    conn: &mut impl std::io::Read,
    landing: &Landing,
    floats: usize,
    seen: &mut impl FnMut(&[u8]),
) -> std::io::Result<Result<LandedKv, String>> {
    let mut into = match landing.begin(floats, STAGING_FLOATS) {
        Ok(into) => into,
        Err(e) => return skip_floats(conn, floats, seen).map(|_| Err(e.to_string())),
    };
    let mut left = floats;
    while left > 0 {
        let piece = match into.next_piece() {
            Ok(piece) => piece,
            Err(e) => return skip_floats(conn, left, seen).map(|_| Err(e.to_string())),
        };
        let n = piece.len();
        read_floats(conn, piece, &mut *seen)?;
        if let Err(e) = into.landed() {
            return skip_floats(conn, left - n, seen).map(|_| Err(e.to_string()));
        }
        left -= n;
    }
    Ok(into.finish().map_err(|e| e.to_string()))
}

/// Reads and drops `floats` floats (feeding their bytes to `seen`).
fn skip_floats(conn: &mut impl std::io::Read, floats: usize, seen: &mut impl FnMut(&[u8])) -> std::io::Result<()> {
    let mut sink = vec![0f32; floats.min(crate::transfer::PIECE_FLOATS)];
    let mut left = floats;
    while left > 0 {
        let n = left.min(sink.len());
        read_floats(conn, &mut sink[..n], &mut *seen)?;
        left -= n;
    }
    Ok(())
}
