//! Pinned (page-locked) host buffers a cuda rank reuses: page-locking memory is slow, and freeing
//! it may wait for the device, so buffers of completed steps serve the next ones.

use kvflow_kernels::cuda::{CudaError, Gpu, PinnedBuf};

/// Pinned host buffers for reuse, smallest first.
pub(super) struct PinnedPool<T> {
    spare: Vec<PinnedBuf<T>>,
}

impl<T> Default for PinnedPool<T> {
    fn default() -> Self {
        PinnedPool { spare: Vec::new() }
    }
}

impl<T: Copy + Default> PinnedPool<T> {
    /// A buffer of at least `len` elements: a spare one, else a new one (sized to a power of two).
    pub(super) fn take(&mut self, gpu: &Gpu, len: usize) -> Result<PinnedBuf<T>, CudaError> {
        match self.spare.iter().position(|b| b.len() >= len) {
            Some(i) => Ok(self.spare.remove(i)),
            None => gpu.pinned(len.next_power_of_two().max(1024)),
        }
    }

    pub(super) fn give_back(&mut self, buf: Option<PinnedBuf<T>>) {
        if let Some(buf) = buf {
            let at = self.spare.partition_point(|b| b.len() <= buf.len());
            self.spare.insert(at, buf);
            if self.spare.len() > 64 {
                self.spare.remove(0);
            }
        }
    }
}
