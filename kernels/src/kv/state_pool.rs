//! Per-request recurrent state storage: slots (one per running request of a family with
//! linear-attention layers) and snapshots (a slot's state copied at a token boundary, for prefix
//! reuse, handoff and speculative rollback). Each entry holds the conv window and the recurrent
//! matrix of every linear layer, laid out by the model.
//!
//! Like [`super::PagedKvCache`], this type only stores values: which slot and snapshot ids are in
//! use is the business of the rank's [`super::IdPool`]s, and the executor that owns this storage
//! applies the copies a step asks for ([`StatePool::zero_slot`], [`StatePool::snapshot_into`],
//! [`StatePool::restore`], [`StatePool::rewind`]) in step order.

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
    rows: Vec<RowStates>,
}

/// The state of one slot after each of a run of its positions, kept from a step that verifies
/// drafts until the slot's next launch:
/// a rejected draft rolls the slot back by one copy ([`StatePool::rewind`]), with no second
/// forward (which, with expert parallelism, would run collectives no other rank joins).
#[derive(Debug)]
struct RowStates {
    slot: SlotId,
    first: usize,
    /// `width` floats per position from `first`, each layer writing its own section.
    states: Vec<f32>,
}

impl StatePool {
    /// `width` floats per entry (0 for families without recurrent state).
    pub fn new(width: usize, num_slots: usize, num_snapshots: usize) -> Self {
        StatePool {
            width,
            slots: vec![0.0; width * num_slots],
            snapshots: vec![0.0; width * num_snapshots],
            rows: Vec::new(),
        }
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
        self.forget_rows(id);
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
        self.forget_rows(slot);
        let (s, d) = (self.range(snapshot), self.range(slot));
        self.slots[d].copy_from_slice(&self.snapshots[s]);
    }

    pub fn snapshot_data(&self, id: SnapshotId) -> &[f32] {
        &self.snapshots[self.range(id)]
    }

    /// From now on, keep `slot`'s state after each of the positions `first..first + count` (the
    /// layers call [`StatePool::keep_row`] as they advance it) — until the slot is rewound,
    /// tracked again, zeroed, restored or imported: the rows outlive the step that verifies, so
    /// the rewind can come with the sequence's next launch, once `verify` has decided.
    pub fn track_rows(&mut self, slot: SlotId, first: usize, count: usize) {
        self.rows.retain(|r| r.slot != slot);
        self.rows.push(RowStates { slot, first, states: vec![0.0; count * self.width] });
    }

    /// A layer has advanced `slot` over `position`: if that position is tracked, its section
    /// `section` of the slot is kept.
    pub fn keep_row(&mut self, slot: SlotId, position: usize, section: std::ops::Range<usize>) {
        if self.rows.is_empty() {
            return;
        }
        let from = self.range(slot);
        let Some(rows) = self.rows.iter_mut().find(|r| r.slot == slot) else { return };
        let Some(i) = position.checked_sub(rows.first).filter(|i| (i + 1) * self.width <= rows.states.len()) else {
            return;
        };
        let at = i * self.width;
        rows.states[at + section.start..at + section.end]
            .copy_from_slice(&self.slots[from.start + section.start..from.start + section.end]);
    }

    /// Sets `slot` to its state just after `position`, kept since [`StatePool::track_rows`], and
    /// drops the slot's kept rows. False when that position was not tracked (the slot is
    /// unchanged).
    pub fn rewind(&mut self, slot: SlotId, position: usize) -> bool {
        let to = self.range(slot);
        let Some(at) = self.rows.iter().position(|r| r.slot == slot) else { return false };
        let rows = self.rows.swap_remove(at);
        let Some(i) = position.checked_sub(rows.first).filter(|i| (i + 1) * self.width <= rows.states.len()) else {
            return false;
        };
        self.slots[to].copy_from_slice(&rows.states[i * self.width..(i + 1) * self.width]);
        true
    }

    /// Drops the rows kept for `slot` (it starts over).
    pub fn forget_rows(&mut self, slot: SlotId) {
        self.rows.retain(|r| r.slot != slot);
    }

    /// How many slots have rows kept.
    pub fn slots_with_rows(&self) -> usize {
        self.rows.len()
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

    #[test]
    fn a_rewound_slot_holds_the_state_kept_after_that_position() {
        let mut pool = StatePool::new(4, 2, 0);
        pool.track_rows(1, 10, 3);
        for position in 10..13 {
            // two layers, each advancing and keeping its own half
            for section in [0..2, 2..4] {
                pool.slot_mut(1)[section.clone()].iter_mut().for_each(|v| *v += 1.0);
                pool.keep_row(1, position, section);
            }
        }
        assert_eq!(pool.slot(1), &[3.0; 4]);
        assert!(!pool.rewind(0, 10), "slot 0 kept nothing");
        pool.track_rows(0, 4, 1);
        pool.zero_slot(0);
        assert_eq!(pool.slots_with_rows(), 1, "a zeroed slot starts over: its rows go");
        assert!(pool.rewind(1, 10));
        assert_eq!(pool.slot(1), &[1.0; 4]);
        assert!(!pool.rewind(1, 11), "a rewind uses the rows up");
        assert_eq!(pool.slot(1), &[1.0; 4]);
        assert_eq!(pool.slots_with_rows(), 0);
        pool.track_rows(1, 10, 3);
        assert!(!pool.rewind(1, 13), "an untracked position leaves the slot alone");
    }
}
