//! A rank's memory bookkeeping under one roof: the ids of its KV blocks, state slots and
//! snapshots, the prefix cache that holds references into them, and what in-flight steps pin.
//! The bytes themselves live in the executor's caches; this side only says who holds what.
//!
//! Pinning (DESIGN §2, "records own what they read"): a sequence that lets go of its memory
//! (finished, preempted, cancelled) while a step that read or wrote it is still in flight hands
//! its blocks and slot to that step: they stay allocated until the step completes (and every
//! step before it: they complete in launch order), so no later step's preemption, eviction or
//! slot reuse can touch them. A prefix hit's snapshot is pinned by the step that restores it.
//! Every id carries a generation (see `IdPool`).
//!
//! Accounting is exact: [`RankMemory::audit`] checks that every held reference belongs to a live
//! request, a pinned in-flight step or the prefix cache, naming the request and block otherwise.

use super::prefix_cache::{block_hashes, PrefixCache};
use super::sequence::{Sequence, Sequences};
use kvflow_kernels::kv::{block_pool, BlockId, BlockPool, IdPool, SlotId, SnapshotId};
use std::collections::BTreeMap;

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
    /// States kept per slot while a sequence verifies drafts (its slot after each fed position,
    /// for a rejected draft's rollback): `draft_tokens + 1` in a pool that verifies with
    /// recurrent state, else 0. Budgeted beside the slots; the cuda executor keeps them on the
    /// device.
    pub verify_rows: usize,
}

impl MemoryLayout {
    /// What a prompt's chained keys (prefix-cache block hashes, offload chunk digests) start
    /// from: its length where the rows depend on it (DeepSeek-V3.2), else 0.
    pub fn prompt_seed(&self, prompt_len: usize) -> u64 {
        if self.prefix_keyed_by_prompt_len {
            prompt_len as u64
        } else {
            0
        }
    }

    /// `blocks` blocks of `block_size` tokens of paged KV, no state slots (families without
    /// recurrent state, driven outside a pool: benches, tests).
    pub fn kv_only(block_size: usize, blocks: usize) -> Self {
        MemoryLayout {
            block_size,
            blocks,
            slots: 0,
            snapshots: 0,
            keeps_kv: true,
            keeps_state: false,
            prefix_keyed_by_prompt_len: false,
            verify_rows: 0,
        }
    }
}

/// What a request let go of while a step that read it was in flight, each id with the
/// generation it was held at.
#[derive(Debug)]
struct Pinned {
    blocks: Vec<(BlockId, u32)>,
    slot: Option<(SlotId, u32)>,
}

/// Which kind of id a record holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    Block,
    Slot,
    Snapshot,
}

pub struct RankMemory {
    pub layout: MemoryLayout,
    pub blocks: BlockPool,
    pub slots: IdPool,
    pub snapshots: IdPool,
    pub prefix: PrefixCache,
    /// By the step that must complete before the memory returns.
    pinned: BTreeMap<u64, Vec<Pinned>>,
    /// Prefix blocks a decode rank keeps for requests whose remote prefill is out (it told the
    /// producer not to send them), by request.
    reserved: BTreeMap<u64, Vec<BlockId>>,
    /// Blocks an offload save reads in place, by save: held until that save's completion record
    /// (with each block's generation) returns them (DESIGN §5, save fencing).
    saving: BTreeMap<u64, Vec<(BlockId, u32)>>,
    /// The oldest step in flight (the rank keeps it current).
    in_flight_from: Option<u64>,
    /// Releases of pinned ids that named an older generation than the id's current one: dropped
    /// (they would have freed a newer holder's memory). Always 0 unless something is wrong.
    pub stale_releases: u64,
}

impl RankMemory {
    pub fn new(layout: MemoryLayout) -> Self {
        RankMemory {
            blocks: block_pool(if layout.keeps_kv { layout.blocks } else { 0 }),
            slots: IdPool::new("state slots", layout.slots),
            snapshots: IdPool::new("state snapshots", layout.snapshots),
            prefix: PrefixCache::new(layout.keeps_kv, layout.keeps_state),
            pinned: BTreeMap::new(),
            reserved: BTreeMap::new(),
            saving: BTreeMap::new(),
            in_flight_from: None,
            stale_releases: 0,
            layout,
        }
    }

    /// Chained hashes of a prompt's full blocks.
    pub fn prompt_hashes(&self, seq: &Sequence) -> Vec<u64> {
        block_hashes(&seq.tokens[..seq.prompt_len], self.layout.block_size, self.layout.prompt_seed(seq.prompt_len))
    }

    /// Prompt tokens of `seq` this rank's prefix cache would reuse now (at least one token is
    /// always left to compute).
    pub fn cached_prompt_tokens(&self, seq: &Sequence) -> usize {
        let bs = self.layout.block_size;
        let hashes = self.prompt_hashes(seq);
        let cap = (seq.prompt_len - 1) / bs;
        self.prefix.peek(&hashes[..cap.min(hashes.len())], self.in_flight_from) * bs
    }

    /// Takes a reference on the blocks of `seq`'s cached prefix (as a prefix hit does) and keeps
    /// them for it until its handoff arrives. Returns how many blocks.
    pub fn reserve_prefix(&mut self, seq: &Sequence) -> usize {
        if !self.layout.keeps_kv {
            return 0;
        }
        let hashes = self.prompt_hashes(seq);
        let usable = hashes.len().min((seq.prompt_len - 1) / self.layout.block_size);
        let hit = self.prefix.lookup(&hashes[..usable], &mut self.blocks, self.in_flight_from);
        let n = hit.blocks.len();
        if n > 0 {
            self.reserved.insert(seq.id, hit.blocks);
        }
        n
    }

    /// The prefix blocks kept for request `id` (the caller owns their references now).
    pub fn take_reserved(&mut self, id: u64) -> Vec<BlockId> {
        self.reserved.remove(&id).unwrap_or_default()
    }

    /// Lets go of the prefix blocks kept for request `id`.
    pub fn release_reserved(&mut self, id: u64) {
        for b in self.take_reserved(id) {
            self.blocks.release(b);
        }
    }

    /// The prefix blocks kept for each request whose handoff is awaited, by request.
    pub fn reserved_prefixes(&self) -> impl Iterator<Item = (u64, &[BlockId])> {
        self.reserved.iter().map(|(&id, blocks)| (id, blocks.as_slice()))
    }

    /// Takes a reference on `blocks` for save `save`, which reads them in place.
    pub fn pin_for_save(&mut self, save: u64, blocks: &[BlockId]) {
        let pinned = blocks
            .iter()
            .map(|&b| {
                self.blocks.share(b);
                (b, self.blocks.generation(b))
            })
            .collect();
        self.saving.insert(save, pinned);
    }

    /// Save `save` is done (stored or dropped): its blocks' references return.
    pub fn release_save(&mut self, save: u64) {
        for (b, generation) in self.saving.remove(&save).unwrap_or_default() {
            self.release_held(Held::Block, b, generation);
        }
    }

    /// Saves whose blocks are still held.
    pub fn saves_holding_blocks(&self) -> usize {
        self.saving.len()
    }

    /// Keeps a snapshot (allocated for request `request`, evicting the least recently used one
    /// if none is free) as the state at the boundary after block `h`, written by step `t`;
    /// returns it for the step to fill. `None` when the boundary has one already or none can be
    /// had.
    pub fn publish_snapshot(&mut self, h: u64, request: u64, t: u64) -> Option<SnapshotId> {
        if self.layout.snapshots == 0 || self.prefix.has_snapshot(h) {
            return None;
        }
        if self.snapshots.num_free() == 0 {
            self.prefix.evict_snapshot(&mut self.snapshots);
        }
        let snapshot = self.snapshots.allocate_for(request).ok()?;
        self.prefix.insert_snapshot(h, snapshot, &mut self.snapshots, t);
        Some(snapshot)
    }

    /// Blocks a sequence needs to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        if self.layout.keeps_kv {
            tokens.div_ceil(self.layout.block_size)
        } else {
            0
        }
    }

    /// Blocks `seq` will still need beyond those it holds, to reach its last output token.
    pub fn blocks_to_end(&self, seq: &Sequence) -> usize {
        self.blocks_for(seq.prompt_len + seq.max_output_tokens).saturating_sub(seq.blocks.len())
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

    /// Returns everything a sequence holds — or, while the last step that fed it is in flight,
    /// hands it to that step, which returns it when it completes — and resets it to start from
    /// scratch. The caller gives the sequence a new generation if it stays.
    pub fn release(&mut self, seq: &mut Sequence) {
        let blocks = seq.blocks.take();
        let slot = seq.slot.take();
        match seq.take_last_launched() {
            Some(last) if self.in_flight_from.is_some_and(|oldest| last >= oldest) => {
                let blocks = blocks.into_iter().map(|b| (b, self.blocks.generation(b))).collect();
                let slot = slot.map(|s| (s, self.slots.generation(s)));
                self.pinned.entry(last).or_default().push(Pinned { blocks, slot });
            }
            _ => self.free(blocks, slot),
        }
        seq.computed = 0;
        seq.cached = 0;
        seq.pending.clear();
        // A prefix loaded for it lived in the blocks it just let go of: it recomputes.
        seq.offload.restored = None;
        seq.offload.loaded_tokens = 0;
        seq.spec.drafts.clear();
        seq.spec.proposed.clear();
        seq.spec.rewind_to = None;
    }

    fn free(&mut self, blocks: Vec<BlockId>, slot: Option<SlotId>) {
        for b in blocks {
            self.blocks.release(b);
        }
        if let Some(s) = slot {
            self.slots.release(s);
        }
    }

    /// The oldest step now in flight (`None`: nothing is): memory pinned by steps before it
    /// returns to the pools.
    pub fn steps_in_flight_from(&mut self, oldest: Option<u64>) {
        self.in_flight_from = oldest;
        while let Some(entry) = self.pinned.first_entry() {
            if oldest.is_some_and(|o| *entry.key() >= o) {
                break;
            }
            for pin in entry.remove() {
                for (b, generation) in pin.blocks {
                    self.release_held(Held::Block, b, generation);
                }
                if let Some((s, generation)) = pin.slot {
                    self.release_held(Held::Slot, s, generation);
                }
            }
        }
    }

    /// Drops one reference a record took on an id at `generation`; a release for an older
    /// generation frees nothing and is counted.
    pub fn release_held(&mut self, what: Held, id: u32, generation: u32) {
        let pool = match what {
            Held::Block => &mut self.blocks,
            Held::Slot => &mut self.slots,
            Held::Snapshot => &mut self.snapshots,
        };
        if let Err(stale) = pool.release_generation(id, generation) {
            self.stale_releases += 1;
            tracing::error!("{stale}");
        }
    }

    /// The oldest step in flight, if any.
    pub fn in_flight_from(&self) -> Option<u64> {
        self.in_flight_from
    }

    /// Requests whose memory steps in flight still pin.
    pub fn num_pinned(&self) -> usize {
        self.pinned.values().map(Vec::len).sum()
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
        let (mut blocks, mut slots, mut snapshots) =
            (Owned::of(&self.blocks), Owned::of(&self.slots), Owned::of(&self.snapshots));
        for seq in seqs.iter() {
            seq.blocks.blocks().iter().for_each(|&b| blocks.add(b));
            seq.slot.iter().for_each(|&s| slots.add(s));
        }
        self.reserved.values().flatten().for_each(|&b| blocks.add(b));
        self.saving.values().flatten().for_each(|&(b, _)| blocks.add(b));
        for pin in self.pinned.values().flatten() {
            pin.blocks.iter().for_each(|&(b, _)| blocks.add(b));
            pin.slot.iter().for_each(|&(s, _)| slots.add(s));
        }
        self.prefix.held_blocks().for_each(|b| blocks.add(b));
        self.prefix.held_snapshots().for_each(|s| snapshots.add(s));
        restoring.iter().for_each(|&s| snapshots.add(s));
        let mut problems = Vec::new();
        for (pool, owned) in [(&self.blocks, blocks), (&self.slots, slots), (&self.snapshots, snapshots)] {
            owned.compare(pool, &mut problems);
        }
        problems
    }
}

/// The references to one pool's ids that their owners account for: a count per id (the audit
/// runs each time a rank waits, so it costs a pass over the ids, not a map of them).
struct Owned {
    counts: Vec<u32>,
    /// Ids an owner names that the pool does not have.
    unknown: Vec<u32>,
}

impl Owned {
    fn of(pool: &IdPool) -> Self {
        Owned { counts: vec![0; pool.num_ids()], unknown: Vec::new() }
    }

    fn add(&mut self, id: u32) {
        match self.counts.get_mut(id as usize) {
            Some(count) => *count += 1,
            None => self.unknown.push(id),
        }
    }

    /// Lines for every id whose reference count differs from what its owners account for.
    fn compare(self, pool: &IdPool, problems: &mut Vec<String>) {
        let what = pool.what().trim_end_matches('s');
        for id in self.unknown {
            problems.push(format!("{what} {id} is owned, but there are only {} of them", pool.num_ids()));
        }
        for (id, &accounted) in self.counts.iter().enumerate() {
            let id = id as u32;
            let refs = pool.ref_count(id);
            if refs == accounted {
                continue;
            }
            let last = match pool.owner(id) {
                Some(r) => format!("request {r}"),
                None => "no request".to_string(),
            };
            problems.push(if refs > accounted {
                format!(
                    "{what} {id} is held ({refs} reference(s)) but only {accounted} belong to a live request, a step \
                     in flight or the prefix cache: leaked by {last}, to which it was last allocated"
                )
            } else {
                format!(
                    "{what} {id} is owned {accounted} time(s) but holds {refs} reference(s) (last allocated to {last})"
                )
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl RankMemory {
        fn snapshots_for_test(&mut self) -> SnapshotId {
            self.snapshots.allocate().unwrap()
        }
    }

    fn memory() -> RankMemory {
        RankMemory::new(MemoryLayout {
            block_size: 4,
            blocks: 4,
            slots: 2,
            snapshots: 1,
            keeps_kv: true,
            keeps_state: true,
            prefix_keyed_by_prompt_len: false,
            verify_rows: 0,
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
        seq.launched_at(11);
        mem.steps_in_flight_from(Some(10)); // steps 10 and 11 are in flight
        mem.release(seq); // preempted while step 11 reads it
        seqs.renew(i);
        assert_eq!(mem.blocks.num_free(), 2, "the in-flight step still pins its two blocks");
        assert_eq!(mem.slots.num_free(), 1, "and its slot");
        assert_eq!(mem.blocks.allocate().unwrap(), 2, "a new allocation cannot get them");
        mem.blocks.release(2);
        assert!(mem.audit(&seqs, &[]).is_empty(), "pinned memory is accounted for");
        mem.steps_in_flight_from(Some(11)); // step 10 completed
        assert_eq!(mem.blocks.num_free(), 2);
        mem.steps_in_flight_from(None); // step 11 completed
        assert!(mem.all_free(), "the step returned everything");
        assert_eq!(mem.num_pinned(), 0);
    }

    #[test]
    fn a_release_for_an_older_generation_frees_nothing_and_is_counted() {
        let mut mem = memory();
        let first = mem.snapshots_for_test();
        let generation = mem.snapshots.generation(first);
        mem.release_held(Held::Snapshot, first, generation);
        let again = mem.snapshots.allocate().unwrap();
        assert_eq!(again, first, "the id is handed out again");
        mem.release_held(Held::Snapshot, first, generation); // a late, duplicate release
        assert_eq!(mem.snapshots.ref_count(again), 1, "the newer holder keeps it");
        assert_eq!(mem.stale_releases, 1);
    }

    #[test]
    fn memory_whose_last_step_completed_returns_at_once() {
        let mut mem = memory();
        let mut seqs = Sequences::default();
        let i = seqs.insert(Sequence::new(5, vec![1; 8], 4, false));
        let seq = seqs.get_mut(i);
        assert!(mem.ensure_blocks(seq, 8));
        seq.launched_at(3);
        mem.steps_in_flight_from(Some(4));
        mem.release(seq);
        assert!(mem.all_free());
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
        // an owner naming an id the pool does not have, and one counted twice
        let blocks = mem.blocks.num_ids() as u32;
        mem.reserved.insert(9, vec![blocks + 3]);
        seqs.get_mut(i).blocks.push(0);
        seqs.get_mut(i).blocks.push(0);
        let problems = mem.audit(&seqs, &[]);
        assert!(problems.contains(&format!("KV block {} is owned, but there are only {blocks} of them", blocks + 3)));
        assert!(
            problems.iter().any(|p| p.starts_with("KV block 0 is owned 2 time(s) but holds 1 reference(s)")),
            "{problems:?}"
        );
    }
}
