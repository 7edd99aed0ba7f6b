//! `memory`: the default store — objects in this process's memory, least recently used evicted
//! first once their bytes pass the capacity. A chunk's shard objects are evicted together.
//!
//! A simulated run's store (`store = "sim"`) is one of these holding sized objects: no bytes,
//! the size the object would have counted against the capacity ([`MemoryStore::put_sized`]).

use super::recent_log::RecentLog;
use super::{decode_object, ChunkKey, ChunkObject, Digest, ObjectStore, StoreError};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Objects by key, with a use clock per chunk (namespace and digest: all its shards).
pub struct MemoryStore {
    capacity: u64,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Shared, so a load decodes outside the lock; with the bytes each counts (its length, or
    /// a sized object's size).
    objects: HashMap<ChunkKey, (Arc<[u8]>, u64)>,
    /// Per chunk: its last use and its shard keys.
    chunks: HashMap<(u64, Digest), (u64, Vec<ChunkKey>)>,
    /// Chunks by last use.
    by_use: BTreeMap<u64, (u64, Digest)>,
    clock: u64,
    bytes: u64,
    /// The shard keys evicted.
    evicted: RecentLog<ChunkKey>,
}

impl Inner {
    fn touch(&mut self, key: &ChunkKey) {
        self.clock += 1;
        let chunk = (key.namespace.0, key.digest);
        let entry = self.chunks.entry(chunk).or_insert_with(|| (0, Vec::new()));
        self.by_use.remove(&entry.0);
        entry.0 = self.clock;
        if !entry.1.contains(key) {
            entry.1.push(*key);
        }
        self.by_use.insert(self.clock, chunk);
    }

    /// Evicts the least recently used chunk other than `keep`; returns whether one went.
    fn evict_one(&mut self, keep: (u64, Digest)) -> bool {
        let Some((&used, &chunk)) = self.by_use.iter().find(|(_, c)| **c != keep) else { return false };
        self.by_use.remove(&used);
        if let Some((_, keys)) = self.chunks.remove(&chunk) {
            for k in keys {
                self.evicted.push(k);
                if let Some((_, counted)) = self.objects.remove(&k) {
                    self.bytes -= counted;
                }
            }
        }
        true
    }
}

impl MemoryStore {
    /// A store holding at most `capacity` bytes of objects.
    pub fn new(capacity: u64) -> Self {
        MemoryStore { capacity, inner: Mutex::new(Inner::default()) }
    }
}

impl MemoryStore {
    /// The object under `key`, shared, with the bytes it counts, marked as used.
    fn shared(&self, key: &ChunkKey) -> Option<(Arc<[u8]>, u64)> {
        let mut s = self.inner.lock();
        let found = s.objects.get(key).cloned();
        if found.is_some() {
            s.touch(key);
        }
        found
    }

    /// Stores a sized object under `key`: no bytes, `size` counted against the capacity (a
    /// simulated run's save).
    pub fn put_sized(&self, key: &ChunkKey, size: u64) -> Result<(), StoreError> {
        self.insert(key, Arc::from(&[][..]), size)
    }

    /// The bytes the object under `key` counts, marked as used (a simulated run's load).
    pub fn size_of(&self, key: &ChunkKey) -> Option<u64> {
        self.shared(key).map(|(_, size)| size)
    }

    fn insert(&self, key: &ChunkKey, object: Arc<[u8]>, size: u64) -> Result<(), StoreError> {
        if size > self.capacity {
            return Err(StoreError::Full(format!(
                "an object of {size} bytes is larger than the store ({} bytes)",
                self.capacity
            )));
        }
        let mut s = self.inner.lock();
        if let Some((_, old)) = s.objects.remove(key) {
            s.bytes -= old;
        }
        let chunk = (key.namespace.0, key.digest);
        while s.bytes + size > self.capacity {
            if !s.evict_one(chunk) {
                return Err(StoreError::Full(format!(
                    "{} of {} bytes are this chunk's other shards",
                    s.bytes, self.capacity
                )));
            }
        }
        s.objects.insert(*key, (object, size));
        s.bytes += size;
        s.touch(key);
        Ok(())
    }
}

impl ObjectStore for MemoryStore {
    fn evicted_since(&self, cursor: u64) -> (u64, Option<Vec<ChunkKey>>) {
        self.inner.lock().evicted.since(cursor)
    }

    fn put(&self, key: &ChunkKey, object: &[u8]) -> Result<(), StoreError> {
        self.insert(key, Arc::from(object), object.len() as u64)
    }

    fn get(&self, key: &ChunkKey) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.shared(key).map(|(bytes, _)| bytes.to_vec()))
    }

    /// Decoded straight from the stored bytes (one copy, outside the lock).
    fn get_object(&self, key: &ChunkKey) -> Result<Option<ChunkObject>, StoreError> {
        let Some((bytes, _)) = self.shared(key) else { return Ok(None) };
        match decode_object(&bytes) {
            Ok(object) => Ok(Some(object)),
            Err(e) => {
                tracing::warn!("offload store: {key} is not a sound object ({e}); treated as a miss");
                Ok(None)
            }
        }
    }

    fn contains(&self, key: &ChunkKey) -> bool {
        self.inner.lock().objects.contains_key(key)
    }

    fn bytes(&self) -> u64 {
        self.inner.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::super::{chunk_digests, Namespace};
    use super::*;

    #[test]
    fn the_least_recently_used_chunk_goes_first_with_all_its_shards() {
        let ns = Namespace::of(&[("family", "mha")]);
        let d = chunk_digests(&(0..32).collect::<Vec<u32>>(), 8, 0);
        let key = |c: usize, shard| ChunkKey { namespace: ns, shard, shards: 2, digest: d[c] };
        let store = MemoryStore::new(40);
        for c in 0..2 {
            store.put(&key(c, 0), &[0; 10]).unwrap();
            store.put(&key(c, 1), &[0; 10]).unwrap();
        }
        assert_eq!(store.bytes(), 40);
        store.get(&key(0, 1)).unwrap(); // chunk 0 used last
        store.put(&key(2, 0), &[0; 10]).unwrap();
        assert!(!store.contains(&key(1, 0)) && !store.contains(&key(1, 1)), "chunk 1 went whole");
        assert!(store.contains(&key(0, 0)) && store.contains(&key(0, 1)) && store.contains(&key(2, 0)));
        assert_eq!(store.bytes(), 30);
        assert!(matches!(store.put(&key(3, 0), &[0; 41]), Err(StoreError::Full(_))));
        assert_eq!(store.get(&key(1, 0)), Ok(None));
        // its eviction log: chunk 1's two shards, read from any cursor
        let (end, keys) = store.evicted_since(0);
        assert_eq!((end, keys), (2, Some(vec![key(1, 0), key(1, 1)])));
        assert_eq!(store.evicted_since(1), (2, Some(vec![key(1, 1)])));
        assert_eq!(store.evicted_since(2), (2, Some(Vec::new())));
    }
}
