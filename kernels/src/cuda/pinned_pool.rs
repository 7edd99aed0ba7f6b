//! Pinned (page-locked) host buffers for reuse: page-locking memory is slow, and freeing it
//! waits for the whole device (a link's reader freeing its staging would wait for the producer's
//! step), so buffers whose copies are done serve the next ones. A cuda rank keeps its own; a
//! shared cache's reader and a pool's landing keep one behind a lock ([`SharedPinned`]).

use super::{CudaError, Gpu, PinnedBuf};
use parking_lot::Mutex;

/// Pinned host buffers for reuse, smallest first.
pub struct PinnedPool<T> {
    spare: Vec<PinnedBuf<T>>,
}

impl<T> Default for PinnedPool<T> {
    fn default() -> Self {
        PinnedPool { spare: Vec::new() }
    }
}

impl<T: Copy + Default> PinnedPool<T> {
    /// A buffer of at least `len` elements: a spare one, else a new one (sized to a power of two).
    pub fn take(&mut self, gpu: &Gpu, len: usize) -> Result<PinnedBuf<T>, CudaError> {
        match self.spare.iter().position(|b| b.len() >= len) {
            Some(i) => Ok(self.spare.remove(i)),
            None => gpu.pinned(len.next_power_of_two().max(1024)),
        }
    }

    pub fn give_back(&mut self, buf: Option<PinnedBuf<T>>) {
        if let Some(buf) = buf {
            let at = self.spare.partition_point(|b| b.len() <= buf.len());
            self.spare.insert(at, buf);
            if self.spare.len() > 64 {
                self.spare.remove(0);
            }
        }
    }
}

/// A [`PinnedPool`] of floats shared by the threads of one reader or landing.
#[derive(Default)]
pub struct SharedPinned(Mutex<PinnedPool<f32>>);

impl SharedPinned {
    /// A buffer of at least `len` floats (a spare one, else a new one).
    pub fn take(&self, gpu: &Gpu, len: usize) -> Result<PinnedBuf<f32>, CudaError> {
        self.0.lock().take(gpu, len)
    }

    /// `buf` back for reuse: every copy that used it must be done.
    pub fn give_back(&self, buf: PinnedBuf<f32>) {
        self.0.lock().give_back(Some(buf))
    }
}
