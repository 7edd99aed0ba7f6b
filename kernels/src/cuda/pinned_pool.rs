//! Pinned (page-locked) host buffers for reuse: page-locking memory is slow, and freeing it
//! waits for the whole device (a link's reader freeing its staging would wait for the producer's
//! step; a rank freeing one waits for every step it has in flight), so buffers whose copies are
//! done serve the next ones, and none is freed while the pool lives: the spares are as many as
//! were ever taken at once (sizes are powers of two), which a rank's steps in flight and a
//! reader's transfers bound. A cuda rank keeps its own; a shared cache's reader and a pool's
//! landing keep one behind a lock ([`SharedPinned`]).

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

    /// `buf` back for reuse (every copy that used it must be done). Kept, never freed here: on
    /// an H100 a rank that freed the smallest spare beyond 64 stalled until its 20 launched steps
    /// had run, and the tokens of all of them were handed on at once.
    pub fn give_back(&mut self, buf: Option<PinnedBuf<T>>) {
        if let Some(buf) = buf {
            let at = self.spare.partition_point(|b| b.len() <= buf.len());
            self.spare.insert(at, buf);
        }
    }

    /// Buffers kept for reuse.
    pub fn spares(&self) -> usize {
        self.spare.len()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_given_back_are_all_kept_for_reuse() {
        let gpu = Gpu::emulated().unwrap();
        let mut pool = PinnedPool::<u32>::default();
        let taken: Vec<_> = (0..100).map(|i| pool.take(&gpu, 1000 + 100 * i).unwrap()).collect();
        let sizes: Vec<usize> = taken.iter().map(|b| b.len()).collect();
        taken.into_iter().for_each(|b| pool.give_back(Some(b)));
        assert_eq!(pool.spares(), 100, "none freed (freeing waits for the device)");
        let again: Vec<_> = sizes.iter().map(|&n| pool.take(&gpu, n).unwrap()).collect();
        assert_eq!(pool.spares(), 0, "each taken again from the spares");
        drop(again);
    }
}
