//! What went wrong with the shared store, by kind: how an operation's failure is told (a fault of
//! a kind, or a refusal), counted for the report, and logged once a kind until the store is
//! reachable again (a store that is down would otherwise print a line a chunk).

use super::super::StoreFaults;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The kinds of fault a store operation can meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// A load found a manifest without its data, or no manifest (expired, evicted, torn).
    Missing,
    /// A load found bytes that do not match their manifest, or a manifest from before a restart.
    Damaged,
    /// The store refused the connection or dropped it.
    Down,
    /// The store answered slower than `timeout_ms`.
    Timeout,
    /// The store refused a save for lack of memory.
    Full,
    /// The store restarted or was flushed (its run id or kvflow's epoch token changed).
    Restart,
}

const KINDS: usize = 6;

impl FaultKind {
    fn name(self) -> &'static str {
        match self {
            FaultKind::Missing => "missing chunk",
            FaultKind::Damaged => "damaged chunk",
            FaultKind::Down => "store unreachable",
            FaultKind::Timeout => "store slower than timeout_ms",
            FaultKind::Full => "store full",
            FaultKind::Restart => "store restarted or flushed",
        }
    }
}

#[derive(Default)]
pub struct Faults {
    counts: [AtomicU64; KINDS],
    /// A bit a kind logged since the store was last reachable.
    warned: AtomicU32,
}

impl Faults {
    /// Counts a fault of `kind`, and logs `what` if it is the first of its kind since the store
    /// was last reachable.
    pub fn note(&self, kind: FaultKind, what: impl FnOnce() -> String) {
        self.counts[kind as usize].fetch_add(1, Ordering::Relaxed);
        let bit = 1 << kind as u32;
        if self.warned.fetch_or(bit, Ordering::Relaxed) & bit == 0 {
            tracing::warn!(
                "offload store (redis): {}: {}; more of this kind are counted in the report, not logged, until the \
                 store is reachable again",
                kind.name(),
                what()
            );
        }
    }

    /// The store answered again: a kind logged before is logged again when it recurs.
    pub fn reachable(&self) {
        let down = 1 << FaultKind::Down as u32 | 1 << FaultKind::Timeout as u32;
        if self.warned.fetch_and(!down, Ordering::Relaxed) & down != 0 {
            tracing::info!("offload store (redis): reachable again");
        }
        self.warned.fetch_and(!(1 << FaultKind::Restart as u32), Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> StoreFaults {
        let n = |k: FaultKind| self.counts[k as usize].load(Ordering::Relaxed);
        StoreFaults {
            missing: n(FaultKind::Missing),
            damaged: n(FaultKind::Damaged),
            down: n(FaultKind::Down),
            timeouts: n(FaultKind::Timeout),
            full: n(FaultKind::Full),
            restarts: n(FaultKind::Restart),
        }
    }
}

/// Why an operation failed.
#[derive(Debug)]
pub enum Failure {
    Fault(FaultKind, String),
    Refused(String),
}

impl Failure {
    pub fn of(e: redis::RedisError) -> Self {
        let text = e.to_string();
        if e.is_timeout() {
            Failure::Fault(FaultKind::Timeout, text)
        } else if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
            Failure::Fault(FaultKind::Down, text)
        } else {
            Failure::of_server(text)
        }
    }

    /// A failure of the connection itself.
    pub fn of_io(e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
                Failure::Fault(FaultKind::Timeout, e.to_string())
            }
            _ => Failure::Fault(FaultKind::Down, e.to_string()),
        }
    }

    /// The server's error reply `text`.
    pub fn of_server(text: String) -> Self {
        if text.starts_with("OOM") || text.contains("OOM") {
            Failure::Fault(FaultKind::Full, text)
        } else {
            Failure::Refused(text)
        }
    }
}
