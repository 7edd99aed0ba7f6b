//! The prefix cache of one rank: full prompt blocks keyed by chained block hashes
//! (`h_i = H(h_{i−1}, tokens of block i)`), each entry holding a reference to the block (so a
//! shared block stays put while anyone uses it) and, for families with recurrent state, a state
//! snapshot taken at that block boundary. A hit restores KV and state together or neither
//! (DESIGN §7): the usable prefix ends at the deepest boundary that has a snapshot and whose
//! blocks are all present. Entries nobody else references are evicted least recently used first.
//!
//! An entry is published when the step that writes it is launched, and is handed out only once
//! that step has completed (`lookup` is told which steps are still in flight): a step that fails
//! takes its entries with it before anyone could have read them.
//!
//! With [`PrefixCache::publish_events`], every entry that starts or stops holding its block (its
//! snapshot, for a family without paged KV) becomes a numbered stored/removed event for the
//! KV-aware routing index (`kv_index`), taken with [`PrefixCache::take_events`].

use super::kv_index::{CacheEvent, CacheEvents, CacheSnapshot, Tier, DEVICE};
use kvflow_kernels::hash;
use kvflow_kernels::kv::{BlockId, BlockPool, IdPool, SnapshotId};
use std::collections::HashMap;

#[derive(Debug, Default)]
struct Entry {
    block: Option<BlockId>,
    snapshot: Option<SnapshotId>,
    /// The steps that write the block and the snapshot.
    block_step: u64,
    snapshot_step: u64,
    last_used: u64,
}

/// What a lookup found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Full prompt blocks reusable from the start.
    pub matched: usize,
    /// Their KV blocks (families with paged KV), each with a reference taken for the caller.
    pub blocks: Vec<BlockId>,
    /// The state at the end of those blocks (families with recurrent state).
    pub snapshot: Option<SnapshotId>,
}

/// Chained hashes of the full blocks of `tokens`; `seed` separates requests whose rows depend on
/// more than their tokens (DeepSeek-V3.2's prompt length).
pub fn block_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<u64> {
    let mut h = hash::mix(hash::EMPTY, seed);
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            h = hash::tokens(h, block);
            h
        })
        .collect()
}

/// Prefix index and its references.
#[derive(Debug, Default)]
pub struct PrefixCache {
    entries: HashMap<u64, Entry>,
    tick: u64,
    keeps_kv: bool,
    keeps_state: bool,
    pub lookups: u64,
    pub hit_blocks: u64,
    /// The routing index's events, numbered, and those not yet taken (off unless asked for).
    events: Option<(CacheEvents, Vec<CacheEvent>)>,
}

impl PrefixCache {
    pub fn new(keeps_kv: bool, keeps_state: bool) -> Self {
        PrefixCache { keeps_kv, keeps_state, ..Default::default() }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// From now on, numbers every change to what the cache holds as rank `rank`'s events.
    pub fn publish_events(&mut self, rank: u32) {
        let mut events = CacheEvents::new(rank);
        let held: Vec<u64> = self.entries.iter().filter(|(_, e)| self.indexed(e)).map(|(h, _)| *h).collect();
        let first = events.stored(DEVICE, &held);
        self.events = Some((events, first.into_iter().collect()));
    }

    /// Publishes that another tier of this rank (the offload tier) now holds (`stored`) or no
    /// longer holds `hashes`, numbered with the cache's own events.
    pub fn note_tier(&mut self, tier: Tier, hashes: &[u64], stored: bool) {
        if let Some((events, out)) = self.events.as_mut() {
            out.extend(if stored { events.stored(tier, hashes) } else { events.removed(tier, hashes) });
        }
    }

    /// The events since the last call (empty unless [`PrefixCache::publish_events`]).
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(|(_, out)| std::mem::take(out)).unwrap_or_default()
    }

    /// What the cache holds as of its latest event (what a consumer resyncs from after a gap).
    pub fn events_snapshot(&self) -> Option<CacheSnapshot> {
        self.events.as_ref().map(|(events, _)| events.snapshot())
    }

    /// Whether an entry counts as held for routing: its block, or for a family without paged
    /// KV its snapshot.
    fn indexed(&self, e: &Entry) -> bool {
        if self.keeps_kv {
            e.block.is_some()
        } else {
            e.snapshot.is_some()
        }
    }

    /// Publishes the change of `h` from held (`was`) to `now`.
    fn note(&mut self, h: u64, was: bool, now: bool) {
        if let Some((events, out)) = self.events.as_mut() {
            let event = match (was, now) {
                (false, true) => events.stored(DEVICE, &[h]),
                (true, false) => events.removed(DEVICE, &[h]),
                _ => None,
            };
            out.extend(event);
        }
    }

    /// Whether `h` is held for routing now.
    fn held(&self, h: u64) -> bool {
        self.entries.get(&h).is_some_and(|e| self.indexed(e))
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest reusable prefix among `hashes` (the prompt's full blocks, already capped so
    /// at least one token is left to compute), among entries whose writing step completed
    /// (steps from `in_flight_from` on have not). Takes a reference on every block and keeps the
    /// snapshot entry alive; the caller restores the snapshot into its slot.
    pub fn lookup(&mut self, hashes: &[u64], pool: &mut BlockPool, in_flight_from: Option<u64>) -> PrefixHit {
        self.lookups += 1;
        self.tick += 1;
        let (usable, snapshot) = self.usable(hashes, in_flight_from);
        let mut hit = PrefixHit { matched: usable, blocks: Vec::with_capacity(usable), snapshot };
        for h in &hashes[..usable] {
            let e = self.entries.get_mut(h).expect("walked above");
            e.last_used = self.tick;
            if let Some(b) = e.block {
                pool.share(b);
                hit.blocks.push(b);
            }
        }
        self.hit_blocks += usable as u64;
        hit
    }

    /// How many leading blocks of `hashes` [`lookup`](Self::lookup) would reuse now, without
    /// taking anything (a decode rank deciding where to prefill asks this).
    pub fn peek(&self, hashes: &[u64], in_flight_from: Option<u64>) -> usize {
        self.usable(hashes, in_flight_from).0
    }

    /// The reusable prefix of `hashes` — every block written, and for families with state a
    /// snapshot at its end — and that snapshot.
    fn usable(&self, hashes: &[u64], in_flight_from: Option<u64>) -> (usize, Option<SnapshotId>) {
        let written = |step: u64| in_flight_from.is_none_or(|oldest| step < oldest);
        let (mut usable, mut snapshot) = (0, None);
        for (i, h) in hashes.iter().enumerate() {
            let Some(e) = self.entries.get(h) else { break };
            if self.keeps_kv && !(e.block.is_some() && written(e.block_step)) {
                break;
            }
            if self.keeps_state {
                if let Some(s) = e.snapshot.filter(|_| written(e.snapshot_step)) {
                    usable = i + 1;
                    snapshot = Some(s);
                }
            } else {
                usable = i + 1;
            }
        }
        (usable, snapshot)
    }

    /// The leading blocks of `hashes` that are cached and written, whatever the snapshots (a
    /// prefix loaded from the offload store brings the state at its own end), each with a
    /// reference taken for the caller. Empty for families without paged KV.
    pub fn take_blocks(&mut self, hashes: &[u64], pool: &mut BlockPool, in_flight_from: Option<u64>) -> Vec<BlockId> {
        let written = |step: u64| in_flight_from.is_none_or(|oldest| step < oldest);
        self.tick += 1;
        let mut blocks = Vec::new();
        for h in hashes.iter().take_while(|_| self.keeps_kv) {
            let Some(e) = self.entries.get_mut(h) else { break };
            let Some(b) = e.block.filter(|_| written(e.block_step)) else { break };
            e.last_used = self.tick;
            pool.share(b);
            blocks.push(b);
        }
        blocks
    }

    /// Records that `block` holds (once step `step` has written it) the prompt block with
    /// chained hash `h`.
    pub fn insert_block(&mut self, h: u64, block: Option<BlockId>, pool: &mut BlockPool, step: u64) {
        self.tick += 1;
        let was = self.held(h);
        let e = self.entries.entry(h).or_default();
        e.last_used = self.tick;
        if e.block.is_none() {
            if let Some(b) = block {
                pool.share(b);
                e.block = Some(b);
                e.block_step = step;
            }
        }
        let now = self.held(h);
        self.note(h, was, now);
    }

    /// Whether the boundary after block `h` already has a snapshot.
    pub fn has_snapshot(&self, h: u64) -> bool {
        self.entries.get(&h).is_some_and(|e| e.snapshot.is_some())
    }

    /// Keeps `snapshot` (once step `step` has written it) as the state at the boundary after
    /// block `h`.
    pub fn insert_snapshot(&mut self, h: u64, snapshot: SnapshotId, snapshots: &mut IdPool, step: u64) {
        self.tick += 1;
        let was = self.held(h);
        let e = self.entries.entry(h).or_default();
        e.last_used = self.tick;
        e.snapshot_step = step;
        if let Some(old) = e.snapshot.replace(snapshot) {
            snapshots.release(old);
        }
        let now = self.held(h);
        self.note(h, was, now);
    }

    /// Blocks only the cache references (what [`PrefixCache::evict_blocks`] could free).
    pub fn evictable_blocks(&self, pool: &BlockPool) -> usize {
        self.entries.values().filter(|e| e.block.is_some_and(|b| pool.ref_count(b) == 1)).count()
    }

    /// Frees up to `needed` blocks that only the cache references, least recently used first.
    /// Returns how many it freed.
    pub fn evict_blocks(&mut self, needed: usize, pool: &mut BlockPool) -> usize {
        let mut candidates: Vec<(u64, u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.block.is_some_and(|b| pool.ref_count(b) == 1))
            .map(|(h, e)| (e.last_used, *h))
            .collect();
        candidates.sort_unstable();
        let mut freed = 0;
        for (_, h) in candidates.into_iter().take(needed) {
            let was = self.held(h);
            let e = self.entries.get_mut(&h).expect("listed above");
            pool.release(e.block.take().expect("filtered on a block"));
            freed += 1;
            let now = self.held(h);
            self.note(h, was, now);
            self.drop_if_empty(h);
        }
        freed
    }

    /// Removes `h`'s entry once it holds neither a block nor a snapshot: the index holds what
    /// the cache can hand out, so it stays as large as the rank's memory, not as the number of
    /// distinct prefixes ever served.
    fn drop_if_empty(&mut self, h: u64) {
        if self.entries.get(&h).is_some_and(|e| e.block.is_none() && e.snapshot.is_none()) {
            self.entries.remove(&h);
        }
    }

    /// Frees the least recently used snapshot, if any. Returns whether one was freed.
    pub fn evict_snapshot(&mut self, snapshots: &mut IdPool) -> bool {
        let victim =
            self.entries.iter().filter(|(_, e)| e.snapshot.is_some()).min_by_key(|(_, e)| e.last_used).map(|(h, _)| *h);
        match victim {
            Some(h) => {
                let was = self.held(h);
                let s = self.entries.get_mut(&h).and_then(|e| e.snapshot.take()).expect("picked above");
                snapshots.release(s);
                let now = self.held(h);
                self.note(h, was, now);
                self.drop_if_empty(h);
                true
            }
            None => false,
        }
    }

    /// Drops the entries of `hashes` (blocks a failed step was to write), with their references.
    pub fn forget(&mut self, hashes: &[u64], pool: &mut BlockPool, snapshots: &mut IdPool) {
        for h in hashes {
            let was = self.held(*h);
            self.note(*h, was, false);
            if let Some(e) = self.entries.remove(h) {
                if let Some(b) = e.block {
                    pool.release(b);
                }
                if let Some(s) = e.snapshot {
                    snapshots.release(s);
                }
            }
        }
    }

    /// The blocks the cache holds a reference to (for the accounting check).
    pub fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.entries.values().filter_map(|e| e.block)
    }

    /// The snapshots the cache holds (for the accounting check).
    pub fn held_snapshots(&self) -> impl Iterator<Item = SnapshotId> + '_ {
        self.entries.values().filter_map(|e| e.snapshot)
    }

    /// Releases every reference the cache holds (end of run).
    pub fn clear(&mut self, pool: &mut BlockPool, snapshots: &mut IdPool) {
        let held: Vec<u64> = self.entries.iter().filter(|(_, e)| self.indexed(e)).map(|(h, _)| *h).collect();
        for h in held {
            self.note(h, true, false);
        }
        for (_, e) in self.entries.drain() {
            if let Some(b) = e.block {
                pool.release(b);
            }
            if let Some(s) = e.snapshot {
                snapshots.release(s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_prefixes_hash_alike_and_differ_after_the_first_difference() {
        let a = block_hashes(&[1, 2, 3, 4, 5, 6, 7], 2, 0);
        let b = block_hashes(&[1, 2, 3, 4, 9, 9], 2, 0);
        assert_eq!(a.len(), 3);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(block_hashes(&[1, 2], 2, 1), block_hashes(&[1, 2], 2, 0));
    }

    #[test]
    fn evicted_entries_leave_the_index_so_it_is_bounded_by_the_blocks() {
        let mut pool = kvflow_kernels::kv::block_pool(4);
        let mut cache = PrefixCache::new(true, false);
        for prompt in 0..100u32 {
            if pool.num_free() == 0 {
                assert_eq!(cache.evict_blocks(1, &mut pool), 1);
            }
            let b = pool.allocate().unwrap();
            cache.insert_block(block_hashes(&[prompt, prompt], 2, 0)[0], Some(b), &mut pool, 1);
            pool.release(b); // only the cache holds it
        }
        assert_eq!(cache.len(), 4, "one entry per block held, not one per prefix ever seen");
        cache.clear(&mut pool, &mut IdPool::new("state snapshots", 0));
    }

    #[test]
    fn a_hit_shares_the_blocks_and_eviction_spares_blocks_in_use() {
        let mut pool = kvflow_kernels::kv::block_pool(4);
        let mut cache = PrefixCache::new(true, false);
        let hashes = block_hashes(&[1, 2, 3, 4], 2, 0);
        let (b0, b1) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        cache.insert_block(hashes[0], Some(b0), &mut pool, 4);
        cache.insert_block(hashes[1], Some(b1), &mut pool, 4);
        pool.release(b0);
        pool.release(b1); // the writer finished; only the cache holds them
        assert_eq!(cache.lookup(&hashes, &mut pool, Some(4)).matched, 0, "step 4 has not written them yet");
        let hit = cache.lookup(&hashes, &mut pool, Some(5));
        assert_eq!(hit.blocks, vec![b0, b1]);
        pool.release(b1); // the reader let go of one block
        assert_eq!(cache.evict_blocks(4, &mut pool), 1, "only the unused block can go");
        pool.release(b0);
        cache.clear(&mut pool, &mut IdPool::new("state snapshots", 0));
        assert_eq!(pool.num_free(), 4);
    }

    /// The events a cache publishes rebuild, in a routing index, exactly what it holds: after
    /// inserts, an eviction, a failed step's entries forgotten and the final clear.
    #[test]
    fn published_events_keep_the_routing_index_equal_to_the_cache() {
        use crate::policy::kv_index::{KvIndex, PrefixLen};
        let mut pool = kvflow_kernels::kv::block_pool(8);
        let mut snapshots = IdPool::new("state snapshots", 0);
        let mut cache = PrefixCache::new(true, false);
        let hashes = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 2, 0);
        let early = pool.allocate().unwrap();
        cache.insert_block(hashes[0], Some(early), &mut pool, 0);
        pool.release(early);
        cache.publish_events(3); // what it held before counts as its first event
        for (i, h) in hashes.iter().enumerate().skip(1) {
            let b = pool.allocate().unwrap();
            cache.insert_block(*h, Some(b), &mut pool, i as u64);
            pool.release(b);
        }
        let mut index = KvIndex::start();
        let mut apply = |cache: &mut PrefixCache, chain: &[u64]| {
            for e in cache.take_events() {
                index.apply(&e).unwrap();
            }
            index.prefix_lengths(chain)
        };
        assert_eq!(apply(&mut cache, &hashes), vec![PrefixLen { rank: 3, tier: DEVICE, blocks: 4 }]);
        cache.forget(&hashes[2..3], &mut pool, &mut snapshots);
        assert_eq!(apply(&mut cache, &hashes), vec![PrefixLen { rank: 3, tier: DEVICE, blocks: 2 }]);
        // the least recently used block is the first: the chain then starts with a hole
        assert_eq!(cache.evict_blocks(1, &mut pool), 1);
        assert_eq!(apply(&mut cache, &hashes), vec![]);
        assert_eq!(apply(&mut cache, &hashes[1..2]), vec![PrefixLen { rank: 3, tier: DEVICE, blocks: 1 }]);
        cache.clear(&mut pool, &mut snapshots);
        assert_eq!(apply(&mut cache, &hashes[1..]), vec![]);
        assert_eq!(cache.events_snapshot().map(|s| s.blocks.len()), Some(0));
        assert_eq!(pool.num_free(), 8);
    }

    #[test]
    fn recurrent_hits_stop_at_the_deepest_snapshot() {
        let mut pool = kvflow_kernels::kv::block_pool(8);
        let mut snapshots = IdPool::new("state snapshots", 2);
        let mut cache = PrefixCache::new(true, true);
        let hashes = block_hashes(&[1, 2, 3, 4, 5, 6], 2, 0);
        for h in &hashes {
            let b = pool.allocate().unwrap();
            cache.insert_block(*h, Some(b), &mut pool, 0);
            pool.release(b);
        }
        let snap = snapshots.allocate().unwrap();
        cache.insert_snapshot(hashes[1], snap, &mut snapshots, 0);
        let hit = cache.lookup(&hashes, &mut pool, None);
        assert_eq!(hit.matched, 2, "KV and state are restored together: up to the snapshot");
        assert_eq!(hit.blocks.len(), 2);
        assert_eq!(hit.snapshot, Some(snap));
        for b in hit.blocks {
            pool.release(b);
        }
        cache.clear(&mut pool, &mut snapshots);
        assert!(snapshots.all_free() && pool.num_free() == 8);
    }
}
