//! `store = "sim"`: a simulated run's offload store (issue 44). It holds sized objects — no
//! bytes, the size each chunk's object would have, counted against its capacity and evicted
//! least recently used first, as the memory store does — and a rank's save and load threads
//! become workers on the virtual clock ([`clocked_saver`], [`clocked_loader`]): a job waits
//! behind the rank's earlier ones (each thread does one at a time), takes the store's latency
//! plus its bytes at the store's save or load rate, and at its end the chunk is stored (or
//! looked up) and the completion record reaches the rank. Everything else — which chunks are
//! saved, the save fence, the blocks a save pins, the lookup at admission, the request waiting
//! in `loading`, the restored prefix published — is the engine's own.
//!
//! A save reads its blocks off the device while the rank's steps run: the rank's [`SavesBusy`]
//! says until when its saves run, and its `sim` executor prices the steps beside them slower
//! (`MeasuredTable::beside_saves`).
//!
//! Which time it holds: a save's or a load's, from its hand-over to its end on the virtual clock.
//! Which guarantee it carries: a chunk is in the store only from its save's end, and a load's
//! record comes no sooner than its bytes could have moved.

use super::worker::{Finish, Worker};
use super::{
    LoadDone, LoadJob, Loaded, Loader, MemoryStore, ObjectStore, SaveDone, SaveJob, SaveOutcome, SavePayload, Saver,
};
use crate::pool::wake::RankWaker;
use crate::sim::clock::{ns_of_seconds, VirtualClock};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The store and its rates.
pub struct SimulatedStore {
    pub store: Arc<MemoryStore>,
    /// Bytes a second a save moves (reading the blocks, encoding and storing them).
    pub save_bytes_per_s: f64,
    /// Bytes a second a load moves (getting and decoding the objects).
    pub load_bytes_per_s: f64,
    /// What every save and load takes beside its bytes.
    pub latency_ns: u64,
}

impl SimulatedStore {
    /// A job of `bytes` at `bytes_per_s`, handed over at `now` to a thread free at `free`:
    /// when it starts and ends.
    fn schedule(&self, free: &mut u64, now: u64, bytes: u64, bytes_per_s: f64) -> (u64, u64) {
        let start = (*free).max(now);
        *free = start + self.latency_ns + ns_of_seconds(bytes as f64 / bytes_per_s);
        (start, *free)
    }
}

/// Until when one rank's simulated saves run (its save worker sets it; its executor reads it),
/// and the rate they move bytes at.
#[derive(Debug)]
pub struct SavesBusy {
    until_ns: AtomicU64,
    pub bytes_per_s: f64,
}

impl SavesBusy {
    pub fn new(bytes_per_s: f64) -> Self {
        SavesBusy { until_ns: AtomicU64::new(0), bytes_per_s }
    }

    /// The end of the last save handed over: the saves run back to back until then from the
    /// hand-over of the first still running.
    pub fn until_ns(&self) -> u64 {
        self.until_ns.load(Ordering::Relaxed)
    }
}

/// Rank `order`'s save worker on `clock`, saying in `busy` until when its saves run.
pub fn clocked_saver(
    sim: Arc<SimulatedStore>,
    clock: Arc<VirtualClock>,
    waker: Arc<RankWaker>,
    order: u64,
    busy: Arc<SavesBusy>,
) -> Saver {
    let mut free = 0u64;
    Worker::clocked(clock, waker, order, move |job: SaveJob, now| {
        let SaveJob { id, key, payload, hashes } = job;
        let bytes = match payload {
            SavePayload::Sized(bytes) => bytes,
            SavePayload::Blocks { .. } => 0, // (a sim executor's exports are sized: never here)
        };
        // Asking the store first, as the save thread does: a chunk it holds costs the latency.
        let found = sim.store.contains(&key);
        let (start, end) = sim.schedule(&mut free, now, if found { 0 } else { bytes }, sim.save_bytes_per_s);
        if !found && bytes > 0 {
            busy.until_ns.fetch_max(end, Ordering::Relaxed);
        }
        let store = sim.store.clone();
        let finish: Finish<SaveDone> = Box::new(move || {
            let outcome = if found {
                SaveOutcome::Found
            } else if bytes == 0 {
                SaveOutcome::Dropped { why: "a save of real blocks in a simulated run".into() }
            } else {
                match store.put_sized(&key, bytes) {
                    Ok(()) => SaveOutcome::Stored { bytes, seconds: (end - start) as f64 / 1e9 },
                    Err(e) => SaveOutcome::Dropped { why: format!("1 try failed: {e}") },
                }
            };
            SaveDone { id, key, outcome, hashes }
        });
        (end, finish)
    })
}

/// Rank `order`'s load worker on `clock`: every chunk of a load, or none (one evicted before
/// the load's end fails it, and the request recomputes).
pub fn clocked_loader(sim: Arc<SimulatedStore>, clock: Arc<VirtualClock>, waker: Arc<RankWaker>, order: u64) -> Loader {
    let mut free = 0u64;
    Worker::clocked(clock, waker, order, move |job: LoadJob, now| {
        let sizes: Option<Vec<u64>> = job.keys.iter().map(|k| sim.store.size_of(k)).collect();
        let bytes = sizes.as_ref().map_or(0, |s| s.iter().sum());
        let (start, end) = sim.schedule(&mut free, now, bytes, sim.load_bytes_per_s);
        let store = sim.store.clone();
        let finish: Finish<LoadDone> = Box::new(move || {
            // (evicted since it started: the load fails, as a real one finding a chunk gone does)
            let missing = job.keys.iter().position(|k| !store.contains(k));
            let outcome = match missing {
                Some(i) => Err(format!("chunk {i} of {} ({}) is missing", job.keys.len(), job.keys[i])),
                None => Ok(Loaded::sized(job.keys.len(), bytes, (end - start) as f64 / 1e9)),
            };
            LoadDone { id: job.id, outcome }
        });
        (end, finish)
    })
}
