//! The KV offload tier's storage side (DESIGN §9): chunk keys, the stored object and its checks,
//! the stores a pool saves prefixes to and loads them from, and the rank's save and load threads.
//! How a rank uses them — saves fenced by the dataflow, loads admitted when they complete — is in
//! `rank/offload.rs` and `rank/load.rs`.
//!
//! A chunk is `chunk_tokens` prompt tokens. Its key is `kvflow1-<namespace>/s<shard>of<shards>/<digest>`:
//! the namespace hashes everything that changes the stored bytes (family, geometry, dtype, block
//! size, chunk size, layer split), the digest chains the previous chunk's digest with this chunk's
//! tokens, so one key names one prefix in one layout — whichever rank or pool saved it.

mod disk;
mod key;
mod loader;
mod memory;
mod object;
mod recent_log;
mod redis_store;
mod saver;
mod simulated;
mod worker;

pub use disk::DiskStore;
pub use key::{chunk_digests, ChunkKey, Digest, Namespace};
pub use loader::{spawn_loader, LoadDone, LoadJob, Loaded, Loader, RestoredPrefix};
pub use memory::MemoryStore;
pub use object::{check_object, decode_object, encode_object, object_bytes, read_object, ChunkObject, ObjectError};
pub use redis_store::{LocalRedis, LocalRedisError, RedisConfig, RedisStore};
pub use saver::{spawn_saver, SaveDone, SaveJob, SaveOutcome, SavePayload, Saver};
pub use simulated::{clocked_loader, clocked_saver, SavesBusy, SimulatedStore};

/// Why a store could not do what it was asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The object does not fit (larger than the store, or the store is full of objects it may
    /// not evict).
    #[error("the store is full: {0}")]
    Full(String),
    /// The backing medium failed (a disk error, a refused connection).
    #[error("{0}")]
    Io(String),
}

/// What went wrong with a store during the run, by kind (a store that cannot fail counts none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoreFaults {
    /// Loads that found no chunk whole: no manifest, or a manifest without its data.
    pub missing: u64,
    /// Loads that found bytes unlike their manifest, or a chunk from before a restart.
    pub damaged: u64,
    /// Operations that found the store unreachable.
    pub down: u64,
    /// Operations slower than the store's timeout.
    pub timeouts: u64,
    /// Saves refused for lack of memory.
    pub full: u64,
    /// Restarts and flushes seen (each time, what the process knew of the store was dropped).
    pub restarts: u64,
}

/// Where saved chunks live. Objects are whole (a put is all or nothing); a get of a missing,
/// corrupt or truncated object is a miss (`Ok(None)`), never an error the caller must handle
/// differently from a miss. Implementations are shared by the ranks of a run (and may be
/// remote), so every method takes `&self`.
pub trait ObjectStore: Send + Sync {
    /// Stores `object` under `key`, replacing what was there.
    fn put(&self, key: &ChunkKey, object: &[u8]) -> Result<(), StoreError>;
    /// [`Self::put`] of a chunk whose blocks have the prefix hashes `hashes`: a store shared with
    /// other processes publishes them, so their routing indexes learn of the chunk.
    fn put_chunk(&self, key: &ChunkKey, object: &[u8], hashes: &[u64]) -> Result<(), StoreError> {
        let _ = hashes;
        self.put(key, object)
    }
    /// The chunks published to the store after position `cursor` of its log of publications,
    /// with their blocks' prefix hashes, and the log's end; `None` when the log no longer reaches
    /// back that far. A store no other process writes: nothing, ever (a rank reports its own
    /// saves as they complete).
    fn published_since(&self, cursor: u64) -> (u64, Option<Vec<(ChunkKey, Vec<u64>)>>) {
        (cursor, Some(Vec::new()))
    }
    /// The object under `key`, if the store holds a sound one.
    fn get(&self, key: &ChunkKey) -> Result<Option<Vec<u8>>, StoreError>;
    /// Whether the store holds an object under `key` (a cheap check; `get` may still miss).
    fn contains(&self, key: &ChunkKey) -> bool;
    /// Bytes of the objects it holds.
    fn bytes(&self) -> u64;
    /// The shard keys it evicted after position `cursor` of its eviction log, and the log's end
    /// (the next call's cursor); `None` for the keys when the log no longer reaches back that
    /// far (the caller then checks what it cares about with `contains`). A store that never
    /// evicts: nothing, ever.
    fn evicted_since(&self, cursor: u64) -> (u64, Option<Vec<ChunkKey>>) {
        (cursor, Some(Vec::new()))
    }
    /// Moves on each time the store loses what it held before (a restart, a flush): a rank then
    /// forgets which chunks it saved, and saves them again.
    fn generation(&self) -> u64 {
        0
    }
    /// What went wrong so far, by kind.
    fn faults(&self) -> StoreFaults {
        StoreFaults::default()
    }
    /// The decoded object under `key`, if the store holds a sound one (a damaged one is a miss).
    /// A store may read it straight into the floats, without a copy of the bytes in between.
    fn get_object(&self, key: &ChunkKey) -> Result<Option<ChunkObject>, StoreError> {
        Ok(self.get(key)?.and_then(|bytes| decode_object(&bytes).ok()))
    }
}

/// How many leading chunks of a prefix the store holds for every shard: `chunks[i]` lists chunk
/// `i`'s keys, one per shard. A chunk counts only when every shard's object is there, and the
/// prefix stops at the first chunk that does not.
pub fn longest_prefix(store: &dyn ObjectStore, chunks: &[Vec<ChunkKey>]) -> usize {
    chunks.iter().take_while(|shards| !shards.is_empty() && shards.iter().all(|k| store.contains(k))).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_prefix_needs_every_shard_of_every_chunk_up_to_it() {
        let ns = Namespace::of(&[("family", "mha"), ("block_size", "16")]);
        let digests = chunk_digests(&(0..40).collect::<Vec<u32>>(), 8, 0);
        let keys: Vec<Vec<ChunkKey>> = digests
            .iter()
            .map(|&d| (0..2).map(|s| ChunkKey { namespace: ns, shard: s, shards: 2, digest: d }).collect())
            .collect();
        let store = MemoryStore::new(1 << 20);
        for chunk in &keys[..3] {
            for k in chunk {
                store.put(k, b"x").unwrap();
            }
        }
        store.put(&keys[4][0], b"x").unwrap();
        store.put(&keys[4][1], b"x").unwrap();
        assert_eq!(longest_prefix(&store, &keys), 3, "chunk 3 is missing: chunk 4 does not count");
        let store = MemoryStore::new(1 << 20);
        store.put(&keys[0][0], b"x").unwrap();
        assert_eq!(longest_prefix(&store, &keys), 0, "one shard of chunk 0 is not a prefix");
    }
}
