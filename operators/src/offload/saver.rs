//! A rank's save thread: it takes save jobs the `save` operator hands it (each emitted only after
//! the step that wrote its blocks completed), reads the blocks in place, writes the chunk object
//! to the store, and returns a completion record — with the save's id, which the rank's memory
//! holds the blocks under — on a queue the rank drains when its waker fires. A failed put is
//! tried again up to `max_retries` times, then the save is dropped (the tier is a cache). While a
//! store keeps failing, new saves are dropped at once for a back-off that starts at 1 s and
//! doubles to 30 s: a failing store never holds blocks or steps.

use super::worker::Worker;
use super::{encode_object, ChunkKey, ChunkObject, ObjectStore};
use crate::pool::wake::RankWaker;
use crate::step::KvSource;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One chunk to save: its key and what it writes.
#[derive(Clone)]
pub struct SaveJob {
    pub id: u64,
    pub key: ChunkKey,
    pub payload: SavePayload,
    /// The prefix hashes of the chunk's blocks (published with it by a shared store).
    pub hashes: Vec<u64>,
}

/// What a save writes.
#[derive(Clone)]
pub enum SavePayload {
    /// The blocks it reads in place, and the state at the chunk's end.
    Blocks { source: KvSource, state: Option<Vec<f32>> },
    /// A simulated step's chunk (executor `sim`): no bytes, the size its object would have.
    Sized(u64),
}

/// How a save ended.
#[derive(Clone, Debug, PartialEq)]
pub enum SaveOutcome {
    Stored {
        bytes: u64,
        seconds: f64,
    },
    /// The store held the chunk already (saved by another rank, pool or run): nothing written.
    Found,
    Dropped {
        why: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct SaveDone {
    pub id: u64,
    pub key: ChunkKey,
    pub outcome: SaveOutcome,
    /// The job's prefix hashes, back to the rank (which reports a stored chunk to the routing index).
    pub hashes: Vec<u64>,
}

/// The back-off after a dropped save: 1 s, doubling to 30 s; a stored save resets it.
#[derive(Clone, Copy, Debug)]
struct Backoff {
    until: Option<Instant>,
    next: Duration,
}

const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// A rank's save thread.
pub type Saver = Worker<SaveJob, SaveDone>;

/// Starts the save thread of one rank. `read_delay` (test only: a slow store) is waited before a
/// job reads its blocks.
pub fn spawn_saver(
    store: Arc<dyn ObjectStore>,
    max_retries: usize,
    waker: Arc<RankWaker>,
    read_delay: Duration,
    name: String,
) -> Result<Saver, String> {
    let mut backoff = Backoff { until: None, next: FIRST_BACKOFF };
    Worker::spawn(name, waker, move |job: SaveJob| {
        let outcome = save_one(&*store, &job, max_retries, read_delay, &mut backoff);
        SaveDone { id: job.id, key: job.key, outcome, hashes: job.hashes }
        // the job (and the source's cache handle) goes before the rank is told
    })
}

fn save_one(
    store: &dyn ObjectStore,
    job: &SaveJob,
    max_retries: usize,
    read_delay: Duration,
    backoff: &mut Backoff,
) -> SaveOutcome {
    if let Some(until) = backoff.until.filter(|&u| Instant::now() < u) {
        let left = until.saturating_duration_since(Instant::now()).as_secs_f64();
        return SaveOutcome::Dropped { why: format!("the store is backing off after failures ({left:.1} s left)") };
    }
    if store.contains(&job.key) {
        return SaveOutcome::Found;
    }
    let SavePayload::Blocks { source, state } = &job.payload else {
        return SaveOutcome::Dropped {
            why: "a simulated chunk has no bytes to store (store = \"sim\" holds it)".into(),
        };
    };
    if !read_delay.is_zero() {
        std::thread::sleep(read_delay);
    }
    // The save's time: reading its blocks, encoding and storing them (not the wait for the
    // rank's step to let go of its cache).
    let started = Instant::now();
    let (kv, waited) = source.read_waiting();
    if kv.is_empty() && !source.blocks.is_empty() {
        return SaveOutcome::Dropped { why: "its blocks could not be read".into() };
    }
    let object = encode_object(&ChunkObject { kv, state: state.clone() });
    let mut last = String::new();
    for _ in 0..=max_retries {
        match store.put_chunk(&job.key, &object, &job.hashes) {
            Ok(()) => {
                *backoff = Backoff { until: None, next: FIRST_BACKOFF };
                let seconds = started.elapsed().saturating_sub(waited).as_secs_f64();
                return SaveOutcome::Stored { bytes: object.len() as u64, seconds };
            }
            Err(e) => last = e.to_string(),
        }
    }
    // Logged by the rank that receives the outcome (the first few of its dropped saves).
    backoff.until = Some(Instant::now() + backoff.next);
    backoff.next = (backoff.next * 2).min(MAX_BACKOFF);
    SaveOutcome::Dropped { why: format!("{} tries failed: {last}", max_retries + 1) }
}
