//! Faults on purpose (`[faults]`): the transfer engine drops a connection in the middle of a
//! payload, delays a transfer, corrupts a payload's bytes after its checksum was taken, or
//! delivers a transfer (and so its completion) twice. Each draw is a seeded hash of the request,
//! the kind of fault and the attempt — never of timing — so a failing run replays exactly.
//! Users run it against their deployment; the tests run the fault matrix with it.

use kvflow_kernels::hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How often each fault happens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    pub seed: u64,
    /// Chance that a transfer's connection drops partway through its payload.
    pub drop_connection: f64,
    /// How long a delayed transfer is held back.
    pub delay: Duration,
    /// Chance that a transfer is delayed.
    pub delay_probability: f64,
    /// Chance that a transfer's payload is damaged on the way (after its checksum was taken).
    pub corrupt: f64,
    /// Chance that a transfer is delivered twice (two completions for one transfer).
    pub duplicate_completion: f64,
}

/// One kind of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Drop,
    Delay,
    Corrupt,
    Duplicate,
}

impl Faults {
    /// Whether any fault can happen.
    pub fn any(&self) -> bool {
        self.drop_connection > 0.0
            || (self.delay_probability > 0.0 && !self.delay.is_zero())
            || self.corrupt > 0.0
            || self.duplicate_completion > 0.0
    }

    /// Whether `fault` strikes attempt `attempt` of request `request`'s transfer.
    pub fn strikes(&self, fault: Fault, request: u64, attempt: u32) -> bool {
        let p = match fault {
            Fault::Drop => self.drop_connection,
            Fault::Delay if self.delay.is_zero() => 0.0,
            Fault::Delay => self.delay_probability,
            Fault::Corrupt => self.corrupt,
            Fault::Duplicate => self.duplicate_completion,
        };
        if p <= 0.0 {
            return false;
        }
        let draw = hash::mix(hash::mix(hash::mix(self.seed, fault as u64), request), attempt as u64);
        ((draw >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// What a transfer engine counts: shared by every link of a run, read into the report.
#[derive(Debug, Default)]
pub struct TransferCounters {
    /// Transfers sent again on a new connection after theirs dropped.
    pub retries: AtomicU64,
    /// Transfers that failed for good (their request failed with an error record).
    pub failed: AtomicU64,
    /// Transfers a consumer received twice and dropped the second time.
    pub duplicates: AtomicU64,
    /// Transfers aborted by an explicit abort (the request was cancelled while in transfer).
    pub aborted: AtomicU64,
    /// Faults injected, by kind.
    pub dropped: AtomicU64,
    pub delayed: AtomicU64,
    pub corrupted: AtomicU64,
    pub duplicated: AtomicU64,
    /// Handoffs a cuda consumer's tcp receiver landed in device memory piece by piece.
    pub landed_on_device: AtomicU64,
    /// Pieces of streamed handoffs a tcp consumer staged, and handoffs it refused for lacking
    /// some (each then sent again whole).
    pub pieces_staged: AtomicU64,
    pub refused_for_pieces: AtomicU64,
    /// Of the staged pieces, those a cuda consumer landed in device memory as they arrived.
    pub pieces_landed_on_device: AtomicU64,
}

/// How many counters [`TransferCounters::snapshot`] gives.
pub const TRANSFER_COUNTERS: usize = 12;

impl TransferCounters {
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters as `(name, value)` pairs, for the report.
    pub fn snapshot(&self) -> [(&'static str, u64); TRANSFER_COUNTERS] {
        let v = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            ("retries", v(&self.retries)),
            ("failed", v(&self.failed)),
            ("duplicates_dropped", v(&self.duplicates)),
            ("aborted", v(&self.aborted)),
            ("faults_dropped", v(&self.dropped)),
            ("faults_delayed", v(&self.delayed)),
            ("faults_corrupted", v(&self.corrupted)),
            ("faults_duplicated", v(&self.duplicated)),
            ("landed_on_device", v(&self.landed_on_device)),
            ("pieces_staged", v(&self.pieces_staged)),
            ("refused_for_pieces", v(&self.refused_for_pieces)),
            ("pieces_landed_on_device", v(&self.pieces_landed_on_device)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_seeded_and_follow_the_probability() {
        let f = Faults { seed: 7, corrupt: 0.25, ..Default::default() };
        let hits = (0..4000).filter(|&r| f.strikes(Fault::Corrupt, r, 0)).count();
        assert!((800..1200).contains(&hits), "{hits}");
        let again = (0..4000).filter(|&r| f.strikes(Fault::Corrupt, r, 0)).count();
        assert_eq!(hits, again);
        assert!(!(0..4000).any(|r| f.strikes(Fault::Drop, r, 0)));
        let other_seed = Faults { seed: 8, ..f };
        assert_ne!(
            (0..64).map(|r| f.strikes(Fault::Corrupt, r, 0)).collect::<Vec<_>>(),
            (0..64).map(|r| other_seed.strikes(Fault::Corrupt, r, 0)).collect::<Vec<_>>()
        );
    }
}
