//! Per-request recurrent state storage: slots (one per running request of a family with
//! linear-attention layers) and snapshots (a slot's state copied at a token boundary, for prefix
//! reuse, handoff and speculative rollback). Each entry holds the conv window and the recurrent
//! matrix of every linear layer, laid out by the model.
//!
//! Like [`super::PagedKvCache`], this type only stores values: which slot and snapshot ids are in
//! use is the business of the rank's [`super::IdPool`]s, and the executor that owns this storage
//! applies the copies a step asks for ([`StatePool::zero_slot`], [`StatePool::snapshot_into`],
//! [`StatePool::restore`]) in step order.

/// Index of a state slot.
pub type SlotId = u32;
/// Index of a snapshot.
pub type SnapshotId = u32;

/// Slot and snapshot storage of one rank.
#[derive(Debug)]
pub struct StatePool {
    width: usize,
    slots: Vec<f32>,
    snapshots: Vec<f32>,
}

impl StatePool {
    /// `width` floats per entry (0 for families without recurrent state).
    pub fn new(width: usize, num_slots: usize, num_snapshots: usize) -> Self {
        StatePool { width, slots: vec![0.0; width * num_slots], snapshots: vec![0.0; width * num_snapshots] }
    }

    pub(super) fn slot_count(&self) -> usize {
        self.slots.len().checked_div(self.width).unwrap_or(0)
    }

    /// Floats per slot.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Bytes per slot or snapshot.
    pub fn bytes_per_entry(&self) -> usize {
        self.width * std::mem::size_of::<f32>()
    }

    fn range(&self, id: u32) -> std::ops::Range<usize> {
        id as usize * self.width..(id as usize + 1) * self.width
    }

    /// Sets a slot to the zero state (a request before its first token).
    pub fn zero_slot(&mut self, id: SlotId) {
        let r = self.range(id);
        self.slots[r].fill(0.0);
    }

    pub fn slot(&self, id: SlotId) -> &[f32] {
        &self.slots[self.range(id)]
    }

    pub fn slot_mut(&mut self, id: SlotId) -> &mut [f32] {
        let r = self.range(id);
        &mut self.slots[r]
    }

    /// Copies the slot's current state into `snapshot`.
    pub fn snapshot_into(&mut self, slot: SlotId, snapshot: SnapshotId) {
        let (s, d) = (self.range(slot), self.range(snapshot));
        self.snapshots[d].copy_from_slice(&self.slots[s]);
    }

    /// Overwrites `slot` with the state kept in `snapshot` (the snapshot is unchanged).
    pub fn restore(&mut self, snapshot: SnapshotId, slot: SlotId) {
        let (s, d) = (self.range(snapshot), self.range(slot));
        self.slots[d].copy_from_slice(&self.snapshots[s]);
    }

    pub fn snapshot_data(&self, id: SnapshotId) -> &[f32] {
        &self.snapshots[self.range(id)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restored_snapshot_equals_the_state_it_copied() {
        let mut pool = StatePool::new(3, 2, 1);
        pool.slot_mut(0).copy_from_slice(&[1.0, 2.0, 3.0]);
        pool.snapshot_into(0, 0);
        pool.slot_mut(0)[0] = 9.0;
        pool.restore(0, 1);
        assert_eq!(pool.slot(1), &[1.0, 2.0, 3.0]);
        assert_eq!(pool.snapshot_data(0), &[1.0, 2.0, 3.0]);
        pool.zero_slot(1);
        assert_eq!(pool.slot(1), &[0.0, 0.0, 0.0]);
    }
}
