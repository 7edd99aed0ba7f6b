//! Per-request recurrent state: a pool of slots (one per running request of a family with
//! linear-attention layers) and a pool of snapshots (a slot's state copied at a token boundary,
//! for prefix reuse, handoff and speculative rollback). Each entry holds the conv window and the
//! recurrent matrix of every linear layer, laid out by the model. Accounting is exact: every slot
//! and snapshot taken is returned, and `all_free()` says so.

use thiserror::Error;

/// Index of a state slot.
pub type SlotId = u32;
/// Index of a snapshot.
pub type SnapshotId = u32;

#[derive(Debug, Error, PartialEq, Eq)]
#[error("out of {what}: {total} in use")]
pub struct OutOfStates {
    pub what: &'static str,
    pub total: usize,
}

/// Fixed-width entries with a free list.
#[derive(Debug)]
struct Arena {
    what: &'static str,
    width: usize,
    data: Vec<f32>,
    free: Vec<u32>,
    in_use: Vec<bool>,
}

impl Arena {
    fn new(what: &'static str, width: usize, count: usize) -> Self {
        Arena {
            what,
            width,
            data: vec![0.0; width * count],
            free: (0..count as u32).rev().collect(),
            in_use: vec![false; count],
        }
    }

    fn allocate(&mut self) -> Result<u32, OutOfStates> {
        let id = self.free.pop().ok_or(OutOfStates { what: self.what, total: self.in_use.len() })?;
        self.in_use[id as usize] = true;
        Ok(id)
    }

    fn release(&mut self, id: u32) {
        assert!(self.in_use[id as usize], "{} {id} released twice", self.what);
        self.in_use[id as usize] = false;
        self.free.push(id);
    }

    fn get(&self, id: u32) -> &[f32] {
        debug_assert!(self.in_use[id as usize], "{} {id} is not held", self.what);
        &self.data[id as usize * self.width..(id as usize + 1) * self.width]
    }

    fn get_mut(&mut self, id: u32) -> &mut [f32] {
        debug_assert!(self.in_use[id as usize], "{} {id} is not held", self.what);
        &mut self.data[id as usize * self.width..(id as usize + 1) * self.width]
    }
}

/// Slots and snapshots of one rank.
#[derive(Debug)]
pub struct StatePool {
    slots: Arena,
    snapshots: Arena,
}

impl StatePool {
    /// `width` floats per entry (0 for families without recurrent state).
    pub fn new(width: usize, num_slots: usize, num_snapshots: usize) -> Self {
        StatePool {
            slots: Arena::new("state slots", width, num_slots),
            snapshots: Arena::new("state snapshots", width, num_snapshots),
        }
    }

    /// Floats per slot.
    pub fn width(&self) -> usize {
        self.slots.width
    }

    /// Bytes per slot or snapshot.
    pub fn bytes_per_entry(&self) -> usize {
        self.slots.width * std::mem::size_of::<f32>()
    }

    pub fn num_slots(&self) -> usize {
        self.slots.in_use.len()
    }

    pub fn num_free_slots(&self) -> usize {
        self.slots.free.len()
    }

    pub fn num_snapshots(&self) -> usize {
        self.snapshots.in_use.len()
    }

    pub fn num_free_snapshots(&self) -> usize {
        self.snapshots.free.len()
    }

    /// Whether every slot and snapshot is back in its pool.
    pub fn all_free(&self) -> bool {
        self.num_free_slots() == self.num_slots() && self.num_free_snapshots() == self.num_snapshots()
    }

    /// A slot holding the zero state (a request before its first token).
    pub fn allocate_slot(&mut self) -> Result<SlotId, OutOfStates> {
        let id = self.slots.allocate()?;
        self.slots.get_mut(id).fill(0.0);
        Ok(id)
    }

    pub fn release_slot(&mut self, id: SlotId) {
        self.slots.release(id);
    }

    pub fn slot(&self, id: SlotId) -> &[f32] {
        self.slots.get(id)
    }

    pub fn slot_mut(&mut self, id: SlotId) -> &mut [f32] {
        self.slots.get_mut(id)
    }

    /// Copies the slot's current state into a new snapshot.
    pub fn snapshot(&mut self, slot: SlotId) -> Result<SnapshotId, OutOfStates> {
        let snap = self.snapshots.allocate()?;
        let width = self.slots.width;
        let (s, d) = (slot as usize * width, snap as usize * width);
        let src = &self.slots.data[s..s + width];
        self.snapshots.data[d..d + width].copy_from_slice(src);
        Ok(snap)
    }

    /// Overwrites `slot` with the state kept in `snapshot` (the snapshot stays held).
    pub fn restore(&mut self, snapshot: SnapshotId, slot: SlotId) {
        let width = self.slots.width;
        let (s, d) = (snapshot as usize * width, slot as usize * width);
        debug_assert!(self.snapshots.in_use[snapshot as usize] && self.slots.in_use[slot as usize]);
        self.slots.data[d..d + width].copy_from_slice(&self.snapshots.data[s..s + width]);
    }

    pub fn release_snapshot(&mut self, id: SnapshotId) {
        self.snapshots.release(id);
    }

    pub fn snapshot_data(&self, id: SnapshotId) -> &[f32] {
        self.snapshots.get(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restored_snapshot_equals_the_state_it_copied() {
        let mut pool = StatePool::new(3, 2, 1);
        let a = pool.allocate_slot().unwrap();
        pool.slot_mut(a).copy_from_slice(&[1.0, 2.0, 3.0]);
        let snap = pool.snapshot(a).unwrap();
        pool.slot_mut(a)[0] = 9.0;
        let b = pool.allocate_slot().unwrap();
        pool.restore(snap, b);
        assert_eq!(pool.slot(b), &[1.0, 2.0, 3.0]);
        pool.release_snapshot(snap);
        pool.release_slot(a);
        pool.release_slot(b);
        assert!(pool.all_free());
    }

    #[test]
    fn a_new_slot_starts_from_zero_and_pools_run_out_cleanly() {
        let mut pool = StatePool::new(2, 1, 0);
        let a = pool.allocate_slot().unwrap();
        pool.slot_mut(a).fill(5.0);
        pool.release_slot(a);
        let b = pool.allocate_slot().unwrap();
        assert_eq!(pool.slot(b), &[0.0, 0.0]);
        assert_eq!(pool.allocate_slot().unwrap_err().what, "state slots");
        assert!(pool.snapshot(b).is_err());
    }
}
