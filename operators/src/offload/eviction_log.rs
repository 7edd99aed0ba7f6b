//! A store's log of the keys it stopped holding (evicted, expired, or dropped after a restart),
//! read from a cursor by each rank that reported chunks to the routing index
//! ([`super::ObjectStore::evicted_since`]). It keeps the newest [`EVICTION_LOG`] keys; a cursor
//! older than that gets `None` and checks what it cares about itself.

use super::ChunkKey;
use std::collections::VecDeque;

/// Keys the log remembers.
pub const EVICTION_LOG: usize = 1 << 16;

#[derive(Default)]
pub struct EvictionLog {
    /// Newest last.
    keys: VecDeque<ChunkKey>,
    /// How many older keys were dropped from its front.
    dropped: u64,
}

impl EvictionLog {
    pub fn push(&mut self, key: ChunkKey) {
        self.keys.push_back(key);
        if self.keys.len() > EVICTION_LOG {
            self.keys.pop_front();
            self.dropped += 1;
        }
    }

    /// The keys after position `cursor`, and the log's end (the next call's cursor).
    pub fn since(&self, cursor: u64) -> (u64, Option<Vec<ChunkKey>>) {
        let end = self.dropped + self.keys.len() as u64;
        if cursor < self.dropped {
            return (end, None);
        }
        (end, Some(self.keys.iter().skip((cursor - self.dropped) as usize).copied().collect()))
    }
}
