//! How something outside the dataflow — an executor's completion, later a transfer ack or a
//! load done — wakes a parked pool from the rank it landed on: it raises the rank's flag and
//! activates that rank's `admit`, which (when the pool is parked) emits a wake record every rank
//! receives, so every rank resumes at the same step (DESIGN §4: any rank can wake its pool).

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use timely::scheduling::SyncActivator;

/// One rank's wake-up line.
#[derive(Default)]
pub struct RankWaker {
    raised: AtomicBool,
    activator: Mutex<Option<SyncActivator>>,
    /// Times this rank's `admit` woke the parked pool.
    woke_pool: AtomicU64,
}

impl RankWaker {
    /// Something completed that the rank should look at: wake it if its pool is parked.
    pub fn wake(&self) {
        self.raised.store(true, Ordering::SeqCst);
        self.activate();
    }

    /// Activates the rank's `admit` without raising the flag (new work in the ingress).
    pub(crate) fn activate(&self) {
        if let Some(a) = self.activator.lock().as_ref() {
            // The worker may have finished; nothing to wake then.
            let _ = a.activate();
        }
    }

    /// Whether the flag was raised since the last call (and lowers it).
    pub fn take(&self) -> bool {
        self.raised.swap(false, Ordering::SeqCst)
    }

    /// This rank woke its parked pool.
    pub(crate) fn woke_pool(&self) {
        self.woke_pool.fetch_add(1, Ordering::Relaxed);
    }

    /// Times this rank woke its parked pool.
    pub fn pool_wakes(&self) -> u64 {
        self.woke_pool.load(Ordering::Relaxed)
    }

    pub(crate) fn set_activator(&self, activator: SyncActivator) {
        *self.activator.lock() = Some(activator);
    }
}
