//! A rank's memory bookkeeping under one roof: the ids of its KV blocks, state slots and
//! snapshots, the prefix cache that holds references into them, and what in-flight steps pin.
//! The bytes themselves live in the executor's caches; this side only says who holds what.
//!
//! Pinning (DESIGN §2, "records own what they read"): a sequence that lets go of its memory
//! (finished, preempted, cancelled) while steps that read or write it are still in flight hands
//! its blocks and slot to those steps: they stay allocated until the last such step completes, so
//! no later step's preemption, eviction or slot reuse can touch them. A prefix hit's snapshot is
//! pinned by the step that restores it. Every id carries a generation (see `IdPool`).
//!
//! Accounting is exact: [`RankMemory::audit`] checks that every held reference belongs to a live
//! request, a pinned in-flight step or the prefix cache, naming the request and block otherwise.

use super::prefix_cache::{block_hashes, PrefixCache};
use super::sequence::{Sequence, Sequences};
use crate::step::SeqKey;
use kvflow_kernels::kv::{block_pool, BlockId, BlockPool, IdPool, SlotId, SnapshotId};
use std::collections::{BTreeMap, HashMap};

/// Sizes a rank's memory is split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryLayout {
    pub block_size: usize,
    pub blocks: usize,
    pub slots: usize,
    pub snapshots: usize,
    pub keeps_kv: bool,
    pub keeps_state: bool,
    /// Prefix keys also carry the prompt length (DeepSeek-V3.2: its prompt rows depend on it).
    pub prefix_keyed_by_prompt_len: bool,
}

/// What a request let go of while steps that read it were in flight.
#[derive(Debug)]
struct Pinned {
    blocks: Vec<BlockId>,
    slot: Option<SlotId>,
    steps_left: u32,
}

pub struct RankMemory {
    pub layout: MemoryLayout,
    pub blocks: BlockPool,
    pub slots: IdPool,
    pub snapshots: IdPool,
    pub prefix: PrefixCache,
    /// By the generation of the sequence that let go.
    pinned: HashMap<SeqKey, Pinned>,
}

impl RankMemory {
    pub fn new(layout: MemoryLayout) -> Self {
        RankMemory {
            blocks: block_pool(if layout.keeps_kv { layout.blocks } else { 0 }),
            slots: IdPool::new("state slots", layout.slots),
            snapshots: IdPool::new("state snapshots", layout.snapshots),
            prefix: PrefixCache::new(layout.keeps_kv, layout.keeps_state),
            pinned: HashMap::new(),
            layout,
        }
    }

    /// Chained hashes of a prompt's full blocks.
    pub fn prompt_hashes(&self, seq: &Sequence) -> Vec<u64> {
        let seed = if self.layout.prefix_keyed_by_prompt_len { seq.prompt_len as u64 } else { 0 };
        block_hashes(&seq.tokens[..seq.prompt_len], self.layout.block_size, seed)
    }

    /// Blocks a sequence needs to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        if self.layout.keeps_kv {
            tokens.div_ceil(self.layout.block_size)
        } else {
            0
        }
    }

    /// Grows the sequence's blocks to cover `tokens`, evicting prefix-cache blocks if needed.
    /// All or nothing; returns whether it succeeded.
    pub fn ensure_blocks(&mut self, seq: &mut Sequence, tokens: usize) -> bool {
        if !self.layout.keeps_kv {
            return true;
        }
        let missing = seq.blocks.blocks_missing(tokens, self.layout.block_size);
        if missing > self.blocks.num_free() {
            let short = missing - self.blocks.num_free();
            self.prefix.evict_blocks(short, &mut self.blocks);
        }
        seq.blocks.grow_to(tokens, self.layout.block_size, &mut self.blocks, seq.id).is_ok()
    }

    /// Returns everything a sequence holds — or hands it to its steps in flight, which return it
    /// when the last of them completes — and resets it to start from scratch. The caller gives
    /// the sequence a new generation if it stays.
    pub fn release(&mut self, seq: &mut Sequence) {
        let blocks = seq.blocks.take();
        let slot = seq.slot.take();
        if seq.in_flight_steps > 0 {
            let pin = Pinned { blocks, slot, steps_left: seq.in_flight_steps };
            self.pinned.insert(seq.key, pin);
        } else {
            self.free(blocks, slot);
        }
        seq.computed = 0;
        seq.cached = 0;
        seq.pending.clear();
        seq.in_flight_steps = 0;
    }

    fn free(&mut self, blocks: Vec<BlockId>, slot: Option<SlotId>) {
        for b in blocks {
            self.blocks.release(b);
        }
        if let Some(s) = slot {
            self.slots.release(s);
        }
    }

    /// A step that read the memory of `key` completed, and `key` is no longer a live sequence.
    /// Returns whether `key` had pinned memory (else the step named an unknown sequence).
    pub fn step_done(&mut self, key: SeqKey) -> bool {
        let Some(pin) = self.pinned.get_mut(&key) else { return false };
        pin.steps_left -= 1;
        if pin.steps_left == 0 {
            let pin = self.pinned.remove(&key).expect("present");
            self.free(pin.blocks, pin.slot);
        }
        true
    }

    /// Requests whose memory in-flight steps still pin.
    pub fn num_pinned(&self) -> usize {
        self.pinned.len()
    }

    /// Whether every block, slot and snapshot is free (after the prefix cache was cleared).
    pub fn all_free(&self) -> bool {
        self.blocks.all_free() && self.slots.all_free() && self.snapshots.all_free()
    }

    /// Drops the prefix cache's references (end of run, before the accounting check).
    pub fn clear_prefix_cache(&mut self) {
        self.prefix.clear(&mut self.blocks, &mut self.snapshots);
    }

    /// Checks that every reference held on a block, slot or snapshot belongs to a live request
    /// of `seqs`, to memory pinned by a step in flight (`restoring`: the snapshots launched
    /// steps read), or to the prefix cache. Returns one line per id that is held more (or less)
    /// than its owners account for, naming the request it was last allocated to.
    pub fn audit(&self, seqs: &Sequences, restoring: &[SnapshotId]) -> Vec<String> {
        let mut problems = Vec::new();
        let mut blocks: BTreeMap<u32, u32> = BTreeMap::new();
        let mut slots: BTreeMap<u32, u32> = BTreeMap::new();
        let mut snapshots: BTreeMap<u32, u32> = BTreeMap::new();
        for seq in seqs.iter() {
            seq.blocks.blocks().iter().for_each(|&b| *blocks.entry(b).or_default() += 1);
            seq.slot.iter().for_each(|&s| *slots.entry(s).or_default() += 1);
        }
        for pin in self.pinned.values() {
            pin.blocks.iter().for_each(|&b| *blocks.entry(b).or_default() += 1);
            pin.slot.iter().for_each(|&s| *slots.entry(s).or_default() += 1);
        }
        self.prefix.held_blocks().for_each(|b| *blocks.entry(b).or_default() += 1);
        self.prefix.held_snapshots().for_each(|s| *snapshots.entry(s).or_default() += 1);
        restoring.iter().for_each(|&s| *snapshots.entry(s).or_default() += 1);
        for (pool, owned) in [(&self.blocks, &blocks), (&self.slots, &slots), (&self.snapshots, &snapshots)] {
            compare(pool, owned, &mut problems);
        }
        problems
    }
}

/// Lines for every id whose reference count differs from what its owners account for.
fn compare(pool: &IdPool, owned: &BTreeMap<u32, u32>, problems: &mut Vec<String>) {
    let held: BTreeMap<u32, u32> = pool.in_use().collect();
    let ids: std::collections::BTreeSet<u32> = held.keys().chain(owned.keys()).copied().collect();
    for id in ids {
        let (refs, accounted) = (held.get(&id).copied().unwrap_or(0), owned.get(&id).copied().unwrap_or(0));
        if refs == accounted {
            continue;
        }
        let last = match pool.owner(id) {
            Some(r) => format!("request {r}"),
            None => "no request".to_string(),
        };
        let what = pool.what().trim_end_matches('s');
        problems.push(if refs > accounted {
            format!(
                "{what} {id} is held ({refs} reference(s)) but only {accounted} belong to a live request, a step in \
                 flight or the prefix cache: leaked by {last}, to which it was last allocated"
            )
        } else {
            format!("{what} {id} is owned {accounted} time(s) but holds {refs} reference(s) (last allocated to {last})")
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory() -> RankMemory {
        RankMemory::new(MemoryLayout {
            block_size: 4,
            blocks: 4,
            slots: 2,
            snapshots: 0,
            keeps_kv: true,
            keeps_state: true,
            prefix_keyed_by_prompt_len: false,
        })
    }

    #[test]
    fn memory_released_while_a_step_is_in_flight_stays_pinned_until_that_step_completes() {
        let mut mem = memory();
        let mut seqs = Sequences::default();
        let i = seqs.insert(Sequence::new(5, vec![1; 8], 4, false));
        let seq = seqs.get_mut(i);
        assert!(mem.ensure_blocks(seq, 8));
        seq.slot = Some(mem.slots.allocate_for(5).unwrap());
        seq.in_flight_steps = 2;
        let key = seq.key;
        mem.release(seq); // preempted with two steps in flight
        seqs.renew(i);
        assert_eq!(mem.blocks.num_free(), 2, "the in-flight steps still pin its two blocks");
        assert_eq!(mem.slots.num_free(), 1, "and its slot");
        assert!(mem.audit(&seqs, &[]).is_empty(), "pinned memory is accounted for");
        assert!(mem.step_done(key));
        assert_eq!(mem.blocks.num_free(), 2);
        assert!(mem.step_done(key));
        assert!(mem.all_free(), "the last step returned everything");
        assert!(!mem.step_done(key), "nothing is left under that generation");
    }

    #[test]
    fn the_audit_names_a_leaked_block_and_the_request_that_held_it() {
        let mut mem = memory();
        let mut seqs = Sequences::default();
        let i = seqs.insert(Sequence::new(9, vec![1; 5], 4, false));
        assert!(mem.ensure_blocks(seqs.get_mut(i), 5));
        assert!(mem.audit(&seqs, &[]).is_empty());
        let _forgotten = seqs.get_mut(i).blocks.take(); // a release that never happened
        let problems = mem.audit(&seqs, &[]);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].starts_with("KV block 0 is held (1 reference(s))"), "{problems:?}");
        assert!(problems[0].contains("leaked by request 9"), "{problems:?}");
    }
}
