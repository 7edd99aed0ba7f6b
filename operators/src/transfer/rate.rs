//! A link's rate (`[[link]] bandwidth`): a token bucket on the sending side that lets a link's
//! bytes leave no faster than the rate, so a run on loopback with a small model moves its KV the
//! way a slower link moves a large model's. Each send reserves the link for its bytes after
//! whatever was reserved before it (handoffs over one link share its rate, whichever connection
//! or thread sends them), and is due when the last of them has left. The bucket holds at most
//! [`CREDIT`] of idle time: what a send loses to oversleeping or to writing its bytes is made up
//! by the next, so a link keeps its rate at 10–400 Gbit/s as at 100 MB/s, and an idle link still
//! lets no more than that burst go at once.
//!
//! A simulated run's link (backend `sim`) keeps the same queue on the virtual clock
//! (`reserve_virtual`), without the credit: nothing oversleeps there.

use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// The idle time a link's bucket keeps as credit (a burst of the link's rate times this).
pub const CREDIT: Duration = Duration::from_millis(2);

/// One link's rate, shared by everything that sends over the link.
#[derive(Debug)]
pub struct LinkRate {
    bytes_per_s: f64,
    /// When the bytes reserved so far have all left.
    free_at: Mutex<Instant>,
    /// The same on a simulated run's virtual clock, in ns.
    free_at_ns: Mutex<u64>,
}

impl LinkRate {
    /// A link that moves `bytes_per_s` bytes a second (> 0).
    pub fn new(bytes_per_s: f64) -> Self {
        LinkRate { bytes_per_s, free_at: Mutex::new(Instant::now()), free_at_ns: Mutex::new(0) }
    }

    /// Reserves the link for `bytes` at virtual instant `now_ns`, after what was reserved
    /// before; returns the virtual instant they have left.
    pub fn reserve_virtual(&self, now_ns: u64, bytes: u64) -> u64 {
        let mut free_at = self.free_at_ns.lock();
        *free_at = (*free_at).max(now_ns) + (bytes as f64 / self.bytes_per_s * 1e9).round() as u64;
        *free_at
    }

    /// Reserves the link for `bytes`, after what was reserved before; returns when they have
    /// left at the link's rate.
    pub fn reserve(&self, bytes: u64) -> Instant {
        let mut free_at = self.free_at.lock();
        let now = Instant::now();
        let start = (*free_at).max(now.checked_sub(CREDIT).unwrap_or(now));
        *free_at = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_s);
        *free_at
    }

    /// Sends `bytes` at the link's rate: waits until they have left.
    pub fn pace(&self, bytes: u64) {
        let due = self.reserve(bytes);
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_over_one_link_queue_behind_each_other_at_its_rate() {
        let started = Instant::now();
        let rate = LinkRate::new(1e6); // 1 MB/s
        let first = rate.reserve(100_000);
        let second = rate.reserve(50_000);
        let (a, b) = (first - started, second - started);
        assert!(a >= Duration::from_millis(100) && a < Duration::from_millis(150), "{a:?}");
        assert!(b >= Duration::from_millis(150) && b < Duration::from_millis(200), "{b:?}: after the first");
    }

    #[test]
    fn on_the_virtual_clock_sends_queue_behind_each_other_and_an_idle_link_starts_afresh() {
        let rate = LinkRate::new(1e9); // 1 GB/s: a byte a ns
        assert_eq!(rate.reserve_virtual(1_000, 500), 1_500);
        assert_eq!(rate.reserve_virtual(1_200, 300), 1_800, "behind the first");
        assert_eq!(rate.reserve_virtual(5_000, 100), 5_100, "idle meanwhile: no credit, no queue");
    }

    #[test]
    fn a_link_left_idle_holds_no_more_than_its_credit_for_later() {
        let rate = LinkRate::new(1e6);
        rate.reserve(1_000);
        std::thread::sleep(Duration::from_millis(20));
        let asked = Instant::now();
        let due = rate.reserve(10_000);
        // 10 ms of bytes, less at most CREDIT of the 20 ms idle
        assert!(due - asked >= Duration::from_millis(10) - CREDIT, "{:?}: a burst beyond the credit", due - asked);
    }

    #[test]
    fn a_send_late_by_less_than_the_credit_is_due_as_if_it_had_been_on_time() {
        // Whatever a send loses after its due time (oversleeping, writing its bytes) is made up
        // by the next: at 10 Gbit/s a 128 KiB write is due 105 µs after the one before it, and
        // a sleep alone oversleeps by 50+ µs.
        let rate = LinkRate::new(1e8);
        let first = rate.reserve(1_000);
        std::thread::sleep(Duration::from_millis(1));
        let asked = Instant::now();
        let second = rate.reserve(1_000);
        assert!(second <= asked, "{:?} after it was asked: the late second send waits again", second - asked);
        if asked - first < CREDIT {
            assert_eq!(second - first, Duration::from_micros(10), "due right after the first");
        }
    }
}
