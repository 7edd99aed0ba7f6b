//! A store's log of what changed in it — the keys it stopped holding (evicted, expired, dropped
//! after a restart), or the chunks other processes published — read from a cursor by each rank
//! that reports the offload tier to the routing index ([`super::ObjectStore::evicted_since`],
//! [`super::ObjectStore::published_since`]). It keeps the newest [`RECENT_LOG`] entries; a cursor
//! older than that gets `None` and checks what it cares about itself.

use std::collections::VecDeque;

/// Entries the log remembers.
pub const RECENT_LOG: usize = 1 << 16;

pub struct RecentLog<T> {
    /// Newest last.
    keys: VecDeque<T>,
    /// How many older entries were dropped from its front.
    dropped: u64,
}

impl<T> Default for RecentLog<T> {
    fn default() -> Self {
        RecentLog { keys: VecDeque::new(), dropped: 0 }
    }
}

impl<T: Clone> RecentLog<T> {
    pub fn push(&mut self, key: T) {
        self.keys.push_back(key);
        if self.keys.len() > RECENT_LOG {
            self.keys.pop_front();
            self.dropped += 1;
        }
    }

    /// The entries after position `cursor`, and the log's end (the next call's cursor).
    pub fn since(&self, cursor: u64) -> (u64, Option<Vec<T>>) {
        let end = self.dropped + self.keys.len() as u64;
        if cursor < self.dropped {
            return (end, None);
        }
        (end, Some(self.keys.iter().skip((cursor - self.dropped) as usize).cloned().collect()))
    }
}
