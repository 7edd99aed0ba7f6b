//! A set that remembers only its latest `capacity` members, oldest forgotten first: for what a
//! rank must remember for a while but not forever (a server runs for weeks) — the chunks it saved
//! (`offload_state`), the remote prefills it cancelled (`handoff_state`).

use std::collections::{HashSet, VecDeque};
use std::hash::Hash;

/// The latest `capacity` members inserted; older ones are forgotten in insertion order.
pub(super) struct RecentSet<T> {
    members: HashSet<T>,
    /// In the order they were inserted (a member removed early stays here until its turn, so the
    /// list never exceeds the bound).
    order: VecDeque<T>,
    capacity: usize,
}

impl<T: Copy + Eq + Hash> RecentSet<T> {
    pub(super) fn new(capacity: usize) -> Self {
        RecentSet { members: HashSet::new(), order: VecDeque::new(), capacity: capacity.max(1) }
    }

    /// Remembers `item`; whether it was new.
    pub(super) fn insert(&mut self, item: T) -> bool {
        if !self.members.insert(item) {
            return false;
        }
        if self.order.len() == self.capacity {
            if let Some(oldest) = self.order.pop_front() {
                self.members.remove(&oldest);
                self.members.insert(item); // the oldest may have been `item` itself, re-inserted
            }
        }
        self.order.push_back(item);
        true
    }

    pub(super) fn contains(&self, item: &T) -> bool {
        self.members.contains(item)
    }

    /// Forgets `item`; whether it was remembered.
    pub(super) fn remove(&mut self, item: &T) -> bool {
        self.members.remove(item)
    }

    /// Forgets every member.
    pub(super) fn clear(&mut self) {
        self.members.clear();
        self.order.clear();
    }

    #[cfg(test)]
    pub(super) fn sizes(&self) -> (usize, usize) {
        (self.members.len(), self.order.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recent_set_stays_bounded_and_keeps_the_latest() {
        let capacity = 1000;
        let mut set = RecentSet::new(capacity);
        for i in 0..3 * capacity as u64 {
            assert!(set.insert(i), "{i} is new");
            assert!(!set.insert(i), "{i} is remembered now");
        }
        assert_eq!(set.sizes(), (capacity, capacity));
        assert!(set.insert(0), "the oldest are forgotten");
        assert!(!set.insert(3 * capacity as u64 - 1), "the latest are remembered");
        assert!(set.remove(&(3 * capacity as u64 - 2)) && !set.remove(&7));
        assert!(set.insert(3 * capacity as u64 - 2), "a removed member may come back");
        let (members, order) = set.sizes();
        assert!(members <= capacity && order <= capacity);
    }
}
