//! Ids of per-rank memory — KV blocks, state slots, state snapshots — handed out, counted and
//! taken back. The pool holds no data (the executor's caches do): it says which ids are in use,
//! how many holders each has (a prefix shared by several sequences holds one reference per
//! sequence; a step in flight pins what it reads), and which *generation* of an id a holder has,
//! so a late release can never free a newer allocation of the same id.
//!
//! Accounting is exact: `num_free() == num_ids()` exactly when nothing holds an id.

use thiserror::Error;

/// Not enough free ids for a request.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("out of {what}: needed {needed}, {free} free of {total}")]
pub struct OutOfIds {
    pub what: &'static str,
    pub needed: usize,
    pub free: usize,
    pub total: usize,
}

/// A release that named an older generation of the id than the one allocated now.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("{what} {id}: release for generation {stale} dropped (now at generation {current})")]
pub struct StaleRelease {
    pub what: &'static str,
    pub id: u32,
    pub stale: u32,
    pub current: u32,
}

/// Free list, reference counts, generations, and the last owner of every id.
#[derive(Debug)]
pub struct IdPool {
    what: &'static str,
    free: Vec<u32>,
    ref_counts: Vec<u32>,
    /// Bumped at every allocation from free.
    generations: Vec<u32>,
    /// The request an id was last allocated to (for naming a leak).
    owners: Vec<u64>,
}

impl IdPool {
    /// `count` ids, all free; `what` names them in errors ("KV blocks", "state slots", …).
    pub fn new(what: &'static str, count: usize) -> Self {
        // Hand out low ids first (pop from the end of a reversed list).
        IdPool {
            what,
            free: (0..count as u32).rev().collect(),
            ref_counts: vec![0; count],
            generations: vec![0; count],
            owners: vec![u64::MAX; count],
        }
    }

    pub fn what(&self) -> &'static str {
        self.what
    }

    pub fn num_ids(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn all_free(&self) -> bool {
        self.free.len() == self.ref_counts.len()
    }

    pub fn can_allocate(&self, n: usize) -> bool {
        self.free.len() >= n
    }

    /// Takes a free id with one reference, on behalf of request `owner`.
    pub fn allocate_for(&mut self, owner: u64) -> Result<u32, OutOfIds> {
        let id = self.free.pop().ok_or(OutOfIds { what: self.what, needed: 1, free: 0, total: self.num_ids() })?;
        let i = id as usize;
        debug_assert_eq!(self.ref_counts[i], 0);
        self.ref_counts[i] = 1;
        self.generations[i] = self.generations[i].wrapping_add(1);
        self.owners[i] = owner;
        Ok(id)
    }

    /// Takes a free id with one reference (no owner recorded).
    pub fn allocate(&mut self) -> Result<u32, OutOfIds> {
        self.allocate_for(u64::MAX)
    }

    /// Adds a reference to an id already held by someone.
    pub fn share(&mut self, id: u32) {
        let rc = &mut self.ref_counts[id as usize];
        assert!(*rc > 0, "{} {id} is free: it cannot be shared", self.what);
        *rc += 1;
    }

    /// Drops one reference; the id is free again when none is left. Returns whether it was.
    pub fn release(&mut self, id: u32) -> bool {
        let rc = &mut self.ref_counts[id as usize];
        assert!(*rc > 0, "{} {id} released more often than it was taken", self.what);
        *rc -= 1;
        if *rc == 0 {
            self.free.push(id);
            true
        } else {
            false
        }
    }

    /// [`IdPool::release`] for a holder that took the id at `generation`: a release naming an
    /// older generation (the id was freed and handed out again since) changes nothing.
    pub fn release_generation(&mut self, id: u32, generation: u32) -> Result<bool, StaleRelease> {
        let current = self.generations[id as usize];
        if current != generation || self.ref_counts[id as usize] == 0 {
            return Err(StaleRelease { what: self.what, id, stale: generation, current });
        }
        Ok(self.release(id))
    }

    pub fn ref_count(&self, id: u32) -> u32 {
        self.ref_counts[id as usize]
    }

    /// The generation of the id's current (or last) allocation.
    pub fn generation(&self, id: u32) -> u32 {
        self.generations[id as usize]
    }

    /// The request the id was last allocated to, if one was named.
    pub fn owner(&self, id: u32) -> Option<u64> {
        Some(self.owners[id as usize]).filter(|&o| o != u64::MAX)
    }

    /// Ids in use (reference count above zero), in id order.
    pub fn in_use(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.ref_counts.iter().enumerate().filter(|(_, &rc)| rc > 0).map(|(id, &rc)| (id as u32, rc))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_id_is_free_only_after_its_last_reference() {
        let mut pool = IdPool::new("KV blocks", 1);
        let id = pool.allocate().unwrap();
        pool.share(id);
        assert!(!pool.release(id));
        assert_eq!(pool.num_free(), 0);
        assert!(pool.release(id));
        assert!(pool.all_free());
        pool.allocate().unwrap();
        assert_eq!(pool.allocate().unwrap_err().to_string(), "out of KV blocks: needed 1, 0 free of 1");
    }

    #[test]
    fn a_release_for_an_older_generation_leaves_the_new_allocation_alone() {
        let mut pool = IdPool::new("state slots", 1);
        let id = pool.allocate_for(7).unwrap();
        let first = pool.generation(id);
        assert!(pool.release(id));
        let again = pool.allocate_for(8).unwrap();
        assert_eq!(again, id);
        let err = pool.release_generation(id, first).unwrap_err();
        assert_eq!((err.stale, err.current), (first, first + 1));
        assert_eq!(pool.ref_count(id), 1, "the newer holder keeps its reference");
        assert_eq!(pool.owner(id), Some(8));
        assert_eq!(pool.release_generation(id, first + 1), Ok(true));
    }
}
