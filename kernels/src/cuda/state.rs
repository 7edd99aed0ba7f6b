//! A rank's recurrent state in device memory (DESIGN §6): `slots` state slots and `snapshots`
//! snapshots of `width` floats each, laid out as the CPU `StatePool` lays them out (per linear
//! layer from its offset: the conv window, then the recurrent matrix of each head), so a slot
//! read from the device is a handoff's state as the CPU executor makes it. The copies a step
//! asks for — zero a slot, restore a snapshot into one, snapshot one — are enqueued on the rank's
//! stream in step order, like the step itself, and so are a handoff's copies of a slot out (after
//! the step that reaches the prompt boundary) and in (before the step that feeds T0).
//!
//! A sequence that verifies drafts has its slot's state after each position it feeds kept in
//! `kept` (`verify_rows` rows per slot, written by the linear layers' kernels as the rows go by),
//! until its next launch: a rejected draft rolls the slot back by one copy from there
//! ([`DeviceState::rewind`]), as the CPU `StatePool` does — no second forward.

use super::error::CudaError;
use super::gpu::{DeviceBuf, Gpu, PinnedBuf};
use super::launch::{blocks_for, Arg};

pub struct DeviceState {
    slots: DeviceBuf<f32>,
    snapshots: DeviceBuf<f32>,
    /// `verify_rows` states per slot, slot by slot.
    kept: DeviceBuf<f32>,
    pub width: usize,
    pub num_slots: usize,
    pub num_snapshots: usize,
    pub verify_rows: usize,
    /// Per slot: the first position its kept rows follow, and how many (host bookkeeping, in
    /// launch order; the copies themselves are stream-ordered).
    tracked: parking_lot::Mutex<Vec<Option<(usize, usize)>>>,
}

/// The first row of `kept` a verifying sequence's states go to (its rows follow in order).
pub type KeptRow = u32;

impl DeviceState {
    /// Zeroed storage for `num_slots` slots and `num_snapshots` snapshots of `width` floats, and
    /// `verify_rows` kept states per slot (0: the pool does not verify drafts).
    pub fn new(
        gpu: &Gpu,
        width: usize,
        num_slots: usize,
        num_snapshots: usize,
        verify_rows: usize,
    ) -> Result<Self, CudaError> {
        Ok(DeviceState {
            slots: gpu.zeros::<f32>(width * num_slots)?,
            snapshots: gpu.zeros::<f32>(width * num_snapshots)?,
            kept: gpu.zeros::<f32>(width * num_slots * verify_rows)?,
            width,
            num_slots,
            num_snapshots,
            verify_rows,
            tracked: parking_lot::Mutex::new(vec![None; num_slots]),
        })
    }

    /// Device address of the first slot (slot `s` starts `s × width` floats on).
    pub(crate) fn base(&self) -> u64 {
        self.slots.ptr()
    }

    /// Device address of the kept states (row `r` starts `r × width` floats on; 0 when none).
    pub(crate) fn kept_base(&self) -> u64 {
        if self.verify_rows == 0 {
            0
        } else {
            self.kept.ptr()
        }
    }

    /// From this launch on, keep `slot`'s state after each of the positions `first..first +
    /// count` (the linear layers write them as they advance the slot) until the slot is rewound,
    /// tracked again, zeroed or restored (a handoff's slot is zeroed first). Returns the first kept row, for
    /// the step's rows (`StepRows::keeps_states`).
    pub fn track_rows(&self, slot: u32, first: usize, count: usize) -> Result<KeptRow, CudaError> {
        self.check("slot", slot, self.num_slots)?;
        if count > self.verify_rows {
            return Err(CudaError::Unsupported(format!(
                "slot {slot}: a verification feeds {count} positions, and the device keeps {} states per slot \
                 (draft_tokens + 1)",
                self.verify_rows
            )));
        }
        self.tracked.lock()[slot as usize] = Some((first, count));
        Ok((slot as usize * self.verify_rows) as KeptRow)
    }

    /// Enqueues setting `slot` to its state just after `position`, kept since
    /// [`DeviceState::track_rows`], and drops the slot's kept rows. False when that position was
    /// not tracked (nothing is enqueued).
    pub fn rewind(&self, gpu: &Gpu, slot: u32, position: usize) -> Result<bool, CudaError> {
        self.check("slot", slot, self.num_slots)?;
        let Some((first, count)) = self.tracked.lock()[slot as usize].take() else { return Ok(false) };
        let Some(i) = position.checked_sub(first).filter(|&i| i < count) else { return Ok(false) };
        let row = slot as usize * self.verify_rows + i;
        gpu.copy_on_device(self.slot_at(slot), self.kept.at(row * self.width), self.width * 4)?;
        Ok(true)
    }

    fn forget_rows(&self, slot: u32) {
        if let Some(t) = self.tracked.lock().get_mut(slot as usize) {
            *t = None;
        }
    }

    fn check(&self, what: &str, id: u32, count: usize) -> Result<(), CudaError> {
        if id as usize >= count {
            return Err(CudaError::Unsupported(format!("{what} {id} is outside the device state ({count})")));
        }
        Ok(())
    }

    fn slot_at(&self, slot: u32) -> u64 {
        self.slots.at(slot as usize * self.width)
    }

    fn snapshot_at(&self, snapshot: u32) -> u64 {
        self.snapshots.at(snapshot as usize * self.width)
    }

    /// Enqueues zeroing `slot` (a request before its first token).
    pub fn zero_slot(&self, gpu: &Gpu, slot: u32) -> Result<(), CudaError> {
        self.check("slot", slot, self.num_slots)?;
        self.forget_rows(slot);
        let n = self.width;
        gpu.launch(
            "zero_floats",
            (blocks_for(n, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(self.slot_at(slot)), Arg::I64(n as i64)],
        )
    }

    /// Enqueues copying `snapshot` into `slot` (a prefix hit starts from it).
    pub fn restore(&self, gpu: &Gpu, snapshot: u32, slot: u32) -> Result<(), CudaError> {
        self.check("slot", slot, self.num_slots)?;
        self.forget_rows(slot);
        self.check("snapshot", snapshot, self.num_snapshots)?;
        gpu.copy_on_device(self.slot_at(slot), self.snapshot_at(snapshot), self.width * 4)
    }

    /// Enqueues copying `slot` into `snapshot` (a boundary the step reached).
    pub fn snapshot(&self, gpu: &Gpu, slot: u32, snapshot: u32) -> Result<(), CudaError> {
        self.check("slot", slot, self.num_slots)?;
        self.check("snapshot", snapshot, self.num_snapshots)?;
        gpu.copy_on_device(self.snapshot_at(snapshot), self.slot_at(slot), self.width * 4)
    }

    /// Enqueues copying `slot` out into `dst` (pinned, at least `width` floats): a handoff's state,
    /// read after the step that reached the prompt boundary. `dst` must outlive the copy.
    pub fn copy_out(&self, gpu: &Gpu, slot: u32, dst: &mut PinnedBuf<f32>) -> Result<(), CudaError> {
        self.check("slot", slot, self.num_slots)?;
        gpu.copy_to_host(dst, self.slot_at(slot), self.width)
    }

    /// Enqueues writing `src` (pinned, `width` floats) into `slot`: an arriving handoff's state.
    /// `src` must outlive the copy.
    pub fn copy_in(&self, gpu: &Gpu, slot: u32, src: &PinnedBuf<f32>) -> Result<(), CudaError> {
        self.check("slot", slot, self.num_slots)?;
        gpu.copy_to_device(self.slot_at(slot), src, self.width)
    }

    /// The slot's state, waiting for it (checks only: counted as a host wait).
    pub fn read_slot(&self, gpu: &Gpu, slot: u32) -> Result<Vec<f32>, CudaError> {
        self.check("slot", slot, self.num_slots)?;
        let staged = gpu.scratch::<f32>(self.width)?;
        gpu.copy_on_device(staged.ptr(), self.slot_at(slot), self.width * 4)?;
        gpu.download(&staged, self.width)
    }
}
