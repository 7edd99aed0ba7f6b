//! The offload tier's state on one rank (`Rank::offload`): where it saves and loads, the saves
//! launched, ready and being written, the loads in flight, and its counters. What a rank does
//! with it is in `offload` (saves) and `load` (loads).

use super::recent_set::RecentSet;
use crate::offload::{
    object_bytes, ChunkKey, Digest, LoadDone, LoadJob, Loader, Namespace, ObjectStore, SaveJob, Saver, SimulatedStore,
};
use crate::step::SeqKey;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

/// What a pool's ranks save to and load from, and how.
#[derive(Clone)]
pub struct OffloadSetup {
    pub store: Arc<dyn ObjectStore>,
    pub namespace: Namespace,
    pub chunk_tokens: usize,
    pub max_retries: usize,
    /// Saves in flight (launched, waiting or being written) beyond which a completed chunk is
    /// not saved (counted in `pending_limit_saves`).
    pub max_pending_saves: usize,
    /// What one chunk's object holds in this layout: KV floats, and state floats (0: none). A
    /// loaded object of another shape is refused (the request recomputes).
    pub chunk_kv_floats: usize,
    pub state_floats: usize,
    /// A simulated run's store (`store = "sim"`): the rank's save and load threads become
    /// workers on the virtual clock, moving sized chunks at the store's rates.
    pub simulated: Option<Arc<SimulatedStore>>,
}

impl OffloadSetup {
    /// The bytes one chunk's object takes in this layout.
    pub fn chunk_object_bytes(&self) -> u64 {
        object_bytes(self.chunk_kv_floats, (self.state_floats > 0).then_some(self.state_floats))
    }
}

/// The tier's counters of one rank.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OffloadStats {
    pub saved_chunks: u64,
    pub saved_bytes: u64,
    pub save_seconds: f64,
    pub dropped_saves: u64,
    /// Chunks not saved because `max_pending_saves` saves were in flight.
    pub pending_limit_saves: u64,
    /// Chunks not saved because the store already held them (saved by another rank, pool or run).
    pub found_in_store: u64,
    /// Times a prompt's chunks were looked up in the store (a prompt without a chunk to load
    /// beyond its last token, one chunk long or shorter, never is).
    pub store_lookups: u64,
    /// Loads started, and those that failed (the request recomputed) or whose request had gone.
    pub loads: u64,
    pub failed_loads: u64,
    pub stale_loads: u64,
    pub loaded_chunks: u64,
    pub loaded_bytes: u64,
    pub load_seconds: f64,
    /// Prompt tokens admitted from the store, and from this rank's own prefix cache.
    pub offload_hit_tokens: u64,
    pub hbm_hit_tokens: u64,
    /// Steps launched with work while a load was in flight (loads never hold the pool).
    pub steps_during_loads: u64,
}

/// A save asked for with a launched step, until that step completes.
#[derive(Debug)]
pub(super) struct Launched {
    pub(super) step: u64,
    pub(super) id: u64,
    pub(super) seq: SeqKey,
    pub(super) request: u64,
    pub(super) key: ChunkKey,
    /// Its blocks' prefix hashes.
    pub(super) hashes: Vec<u64>,
}

/// A load in flight: the request (in the generation it was started for) and its chunks.
#[derive(Debug)]
pub(super) struct Loading {
    pub key: SeqKey,
    pub first_chunk: usize,
    pub chunks: usize,
}

pub struct RankOffload {
    pub(super) setup: OffloadSetup,
    pub(super) saver: Saver,
    pub(super) loader: Loader,
    pub(super) next_id: u64,
    pub(super) launched: Vec<Launched>,
    /// Jobs made from completed steps, for the `save` operator.
    pub(super) ready: Vec<SaveJob>,
    /// Saves handed to the thread (or about to be): id → (request, digest).
    pub(super) writing: HashMap<u64, (u64, Digest)>,
    /// Chunks this rank saved or is saving (not saved again), the latest [`KNOWN_CHUNKS`].
    pub(super) known: RecentSet<Digest>,
    /// Requests with a save in the thread, and their next jobs (one save in flight per request).
    pub(super) busy: HashSet<u64>,
    pub(super) queued: HashMap<u64, VecDeque<SaveJob>>,
    /// Loads in flight, by id; jobs for the `load` operator; loads failed before the thread.
    pub(super) loading: HashMap<u64, Loading>,
    pub(super) load_jobs: Vec<LoadJob>,
    pub(super) failed_now: Vec<LoadDone>,
    /// Under router `kv-aware`: each chunk the store holds that this rank reported to the
    /// routing index (its blocks' prefix hashes), and how far it read the store's eviction log.
    pub(super) reported: HashMap<ChunkKey, Vec<u64>>,
    pub(super) evictions_seen: u64,
    /// How far it read the store's log of chunks other processes published.
    pub(super) publications_seen: u64,
    /// The store's generation when `known` was last true of it (a restart or flush since: the
    /// chunks it remembers saving are gone, and are saved again).
    pub(super) store_generation: u64,
    pub stats: OffloadStats,
}

/// How many saved chunks a rank remembers not to save again (16 bytes each, about 2 MB). One
/// it forgot is saved again when a prompt holding it is prefilled: the save finds it in the store
/// (`found_in_store`) and only its export was spent. Remembering every chunk ever saved would
/// grow with the distinct prompts a server ever served.
pub(super) const KNOWN_CHUNKS: usize = 1 << 16;

impl RankOffload {
    pub fn new(setup: OffloadSetup, saver: Saver, loader: Loader) -> Self {
        RankOffload {
            setup,
            saver,
            loader,
            next_id: 0,
            launched: Vec::new(),
            ready: Vec::new(),
            writing: HashMap::new(),
            known: RecentSet::new(KNOWN_CHUNKS),
            busy: HashSet::new(),
            queued: HashMap::new(),
            loading: HashMap::new(),
            load_jobs: Vec::new(),
            failed_now: Vec::new(),
            reported: HashMap::new(),
            evictions_seen: 0,
            publications_seen: 0,
            store_generation: 0,
            stats: OffloadStats::default(),
        }
    }

    /// Saves launched, ready or being written, and loads in flight.
    pub fn in_flight(&self) -> usize {
        self.launched.len() + self.ready.len() + self.writing.len() + self.loading.len()
    }
}
