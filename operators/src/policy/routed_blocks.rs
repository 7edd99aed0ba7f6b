//! What the `kv-aware` router knows each rank holds on its device ahead of the routing index
//! (issue 42 §4). The blocks of a request it routes count for that rank at once (*routed*); the
//! rank's cache events then confirm them (*stored*) or withdraw them (*removed*: evicted, or
//! never stored because the request was cancelled or hit). A routed block never confirmed is
//! forgotten once `routed_capacity` later routed blocks have pushed it out: the pool cannot
//! hold more than that at once, so an older prediction names a block its rank no longer has.
//!
//! `align` feeds it every rank's events and snapshots in their order, the same on every rank, so
//! every rank's router holds the same table and routes the same (DESIGN §11). Its size is
//! bounded by the pool: stored entries mirror the ranks' device caches, routed ones are capped.

use super::kv_index::{CacheChange, CacheEvent, CacheSnapshot, DEVICE};
use std::collections::{HashMap, VecDeque};

/// How one rank holds one block, as far as the router knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    /// Routed there (at this routing sequence number), not yet reported stored.
    Routed(u64),
    /// Reported stored by the rank's events.
    Stored,
}

#[derive(Debug)]
pub struct RoutedBlocks {
    /// Per block hash: the ranks that hold it or were sent it.
    blocks: HashMap<u64, Vec<(u32, Held)>>,
    /// Routed blocks, oldest first: (sequence number, hash, rank).
    routed_order: VecDeque<(u64, u64, u32)>,
    routed_capacity: usize,
    sequence: u64,
}

impl RoutedBlocks {
    /// A table that remembers at most `routed_capacity` routed blocks not yet confirmed; 0 turns
    /// it off (the router then knows only what the index reports).
    pub fn new(routed_capacity: usize) -> Self {
        RoutedBlocks { blocks: HashMap::new(), routed_order: VecDeque::new(), routed_capacity, sequence: 0 }
    }

    fn enabled(&self) -> bool {
        self.routed_capacity > 0
    }

    /// The leading blocks of `hashes` that `rank` holds or was sent.
    pub fn prefix(&self, hashes: &[u64], rank: usize) -> usize {
        hashes
            .iter()
            .take_while(|h| self.blocks.get(h).is_some_and(|held| held.iter().any(|&(r, _)| r as usize == rank)))
            .count()
    }

    /// A request's blocks were routed to `rank`: they count for it from now.
    pub fn routed(&mut self, hashes: &[u64], rank: usize) {
        if !self.enabled() {
            return;
        }
        self.sequence += 1;
        let rank = rank as u32;
        for &h in hashes {
            let held = self.blocks.entry(h).or_default();
            match held.iter_mut().find(|(r, _)| *r == rank) {
                Some((_, Held::Stored)) => continue, // already confirmed there
                Some((_, at)) => *at = Held::Routed(self.sequence),
                None => held.push((rank, Held::Routed(self.sequence))),
            }
            self.routed_order.push_back((self.sequence, h, rank));
        }
        while self.routed_order.len() > self.routed_capacity {
            let Some((at, h, rank)) = self.routed_order.pop_front() else { break };
            self.forget(h, |&(r, held)| r == rank && held == Held::Routed(at));
        }
    }

    /// The ranks' events, in each rank's order (after its snapshot, if it sent one).
    pub fn observe(&mut self, snapshot: Option<&CacheSnapshot>, events: &[CacheEvent]) {
        if !self.enabled() {
            return;
        }
        if let Some(s) = snapshot {
            // Nothing reported before the snapshot is trusted; routed blocks stay routed.
            let hashes: Vec<u64> = self.blocks.keys().copied().collect();
            for h in hashes {
                self.forget(h, |&(r, held)| r == s.rank && held == Held::Stored);
            }
            for &(tier, h) in &s.blocks {
                if tier == DEVICE {
                    self.store(h, s.rank);
                }
            }
        }
        for e in events {
            match &e.change {
                CacheChange::Stored { tier, hashes } if *tier == DEVICE => {
                    hashes.iter().for_each(|&h| self.store(h, e.rank));
                }
                CacheChange::Removed { tier, hashes } if *tier == DEVICE => {
                    for &h in hashes {
                        self.forget(h, |&(r, _)| r == e.rank);
                    }
                }
                _ => {}
            }
        }
    }

    fn store(&mut self, hash: u64, rank: u32) {
        let held = self.blocks.entry(hash).or_default();
        match held.iter_mut().find(|(r, _)| *r == rank) {
            Some((_, at)) => *at = Held::Stored,
            None => held.push((rank, Held::Stored)),
        }
    }

    fn forget(&mut self, hash: u64, which: impl Fn(&(u32, Held)) -> bool) {
        if let Some(held) = self.blocks.get_mut(&hash) {
            held.retain(|e| !which(e));
            if held.is_empty() {
                self.blocks.remove(&hash);
            }
        }
    }

    /// (block hashes known, routed blocks remembered): both bounded by the pool's size.
    #[cfg(test)]
    fn sizes(&self) -> (usize, usize) {
        (self.blocks.len(), self.routed_order.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(rank: u32, seq: u64, change: CacheChange) -> CacheEvent {
        CacheEvent { rank, seq, change }
    }

    #[test]
    fn routed_blocks_count_at_once_and_are_confirmed_or_withdrawn_by_events() {
        let mut t = RoutedBlocks::new(100);
        t.routed(&[1, 2, 3], 2);
        assert_eq!(t.prefix(&[1, 2, 3, 4], 2), 3, "routed: held at once");
        assert_eq!(t.prefix(&[1, 2, 3], 0), 0);
        t.observe(None, &[event(2, 1, CacheChange::Stored { tier: DEVICE, hashes: vec![1, 2, 3] })]);
        t.observe(None, &[event(2, 2, CacheChange::Removed { tier: DEVICE, hashes: vec![2] })]);
        assert_eq!(t.prefix(&[1, 2, 3], 2), 1, "an evicted block is withdrawn");
        // a block stored on two ranks, removed from one
        t.observe(None, &[event(0, 1, CacheChange::Stored { tier: DEVICE, hashes: vec![1] })]);
        t.observe(None, &[event(2, 3, CacheChange::Removed { tier: DEVICE, hashes: vec![1] })]);
        assert_eq!((t.prefix(&[1], 0), t.prefix(&[1], 2)), (1, 0));
        // the offload tier is the index's business
        t.observe(None, &[event(1, 1, CacheChange::Stored { tier: 1, hashes: vec![9] })]);
        assert_eq!(t.prefix(&[9], 1), 0);
    }

    #[test]
    fn an_unconfirmed_block_is_forgotten_when_later_routes_push_it_out_and_a_stored_one_is_not() {
        let mut t = RoutedBlocks::new(4);
        t.routed(&[1, 2], 0);
        t.observe(None, &[event(0, 1, CacheChange::Stored { tier: DEVICE, hashes: vec![1] })]);
        t.routed(&[7, 8, 9, 10], 1);
        assert_eq!(t.prefix(&[1, 2], 0), 1, "2 was never stored: pushed out; 1 was");
        t.routed(&[1, 5], 3);
        t.routed(&[10, 11, 12, 13], 3);
        assert_eq!(t.prefix(&[1], 0), 1, "a stored block stays until its rank removes it");
        assert_eq!(t.prefix(&[1, 5], 3), 0);
        assert_eq!(t.sizes().1, 4);
    }

    #[test]
    fn a_snapshot_replaces_what_its_rank_reported_and_keeps_what_was_routed() {
        let mut t = RoutedBlocks::new(100);
        t.observe(None, &[event(1, 1, CacheChange::Stored { tier: DEVICE, hashes: vec![1, 2] })]);
        t.routed(&[5], 1);
        let snapshot = CacheSnapshot { rank: 1, seq: 9, blocks: vec![(DEVICE, 2), (1, 3)] };
        t.observe(Some(&snapshot), &[]);
        assert_eq!((t.prefix(&[1], 1), t.prefix(&[2], 1), t.prefix(&[3], 1), t.prefix(&[5], 1)), (0, 1, 0, 1));
    }

    #[test]
    fn off_it_knows_nothing() {
        let mut t = RoutedBlocks::new(0);
        t.routed(&[1], 0);
        t.observe(None, &[event(0, 1, CacheChange::Stored { tier: DEVICE, hashes: vec![2] })]);
        assert_eq!((t.prefix(&[1], 0), t.prefix(&[2], 0), t.sizes()), (0, 0, (0, 0)));
    }
}
