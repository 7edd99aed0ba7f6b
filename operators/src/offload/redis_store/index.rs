//! A process's own index of what the shared store holds (`contains` answers from it, so an
//! admission never waits for the network): filled from the store's log of publications and
//! renewals, each with its lease's end on the store's clock, and emptied at once when the store
//! restarts or is flushed (its `generation` then moves on). Keys it stops holding go on an
//! eviction log for the routing index.

use super::super::recent_log::RecentLog;
use super::super::ChunkKey;
use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

#[derive(Clone, Copy, Debug)]
struct Held {
    /// The lease's end, in ms on the store's clock.
    expires_ms: u64,
    bytes: u64,
}

pub struct Index {
    held: HashMap<ChunkKey, Held>,
    by_expiry: BTreeSet<(u64, ChunkKey)>,
    bytes: u64,
    pub evicted: RecentLog<ChunkKey>,
    /// Chunks published with their blocks' prefix hashes (for the routing index).
    pub published: RecentLog<(ChunkKey, Vec<u64>)>,
    /// The store's clock minus this process's (`local_ms`), from the last poll.
    offset_ms: i64,
    started: Instant,
    /// Moves on at each restart or flush seen.
    pub generation: u64,
}

impl Default for Index {
    fn default() -> Self {
        Index {
            held: HashMap::new(),
            by_expiry: BTreeSet::new(),
            bytes: 0,
            evicted: RecentLog::default(),
            published: RecentLog::default(),
            offset_ms: 0,
            started: Instant::now(),
            generation: 0,
        }
    }
}

impl Index {
    fn local_ms(&self) -> i64 {
        self.started.elapsed().as_millis() as i64
    }

    /// Now on the store's clock (as of the last poll's reading of it).
    pub fn store_now_ms(&self) -> u64 {
        (self.local_ms() + self.offset_ms).max(0) as u64
    }

    /// The store's clock read `store_ms` now.
    pub fn set_store_clock(&mut self, store_ms: u64) {
        self.offset_ms = store_ms as i64 - self.local_ms();
    }

    /// `key` was published (`bytes` long) with its lease ending at `expires_ms`.
    pub fn publish(&mut self, key: ChunkKey, bytes: u64, expires_ms: u64) {
        if let Some(old) = self.held.insert(key, Held { expires_ms, bytes }) {
            self.by_expiry.remove(&(old.expires_ms, key));
            self.bytes -= old.bytes;
        }
        self.by_expiry.insert((expires_ms, key));
        self.bytes += bytes;
    }

    /// `key`'s lease was renewed to `expires_ms` (nothing if the index does not hold it).
    pub fn renew(&mut self, key: ChunkKey, expires_ms: u64) {
        if let Some(held) = self.held.get_mut(&key) {
            if expires_ms > held.expires_ms {
                self.by_expiry.remove(&(held.expires_ms, key));
                held.expires_ms = expires_ms;
                self.by_expiry.insert((expires_ms, key));
            }
        }
    }

    /// The store no longer holds `key` (a load missed it).
    pub fn forget(&mut self, key: &ChunkKey) {
        if let Some(held) = self.held.remove(key) {
            self.by_expiry.remove(&(held.expires_ms, *key));
            self.bytes -= held.bytes;
            self.evicted.push(*key);
        }
    }

    /// Drops the keys whose lease ended.
    pub fn expire(&mut self) {
        let now = self.store_now_ms();
        while let Some(&(at, key)) = self.by_expiry.first().filter(|(at, _)| *at <= now) {
            self.by_expiry.remove(&(at, key));
            if let Some(held) = self.held.remove(&key) {
                self.bytes -= held.bytes;
                self.evicted.push(key);
            }
        }
    }

    /// The store restarted or was flushed: nothing it held before is trusted.
    pub fn clear(&mut self) {
        for key in std::mem::take(&mut self.held).into_keys() {
            self.evicted.push(key);
        }
        self.by_expiry.clear();
        self.bytes = 0;
        self.generation += 1;
    }

    pub fn holds(&self, key: &ChunkKey) -> bool {
        self.held.get(key).is_some_and(|h| h.expires_ms > self.store_now_ms())
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}
