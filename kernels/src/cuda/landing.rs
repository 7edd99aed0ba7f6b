//! A handoff's KV landing in device memory as it arrives: a cuda consumer's tcp receiver reads
//! each piece of the payload into pinned staging (two buffers, taking turns) and copies it to
//! the device on a stream of the landing's own while it reads the next, so the step that imports
//! the handoff unpacks from device memory — no host copy of the payload on the step's path, and
//! no host wait (the rank's stream waits on the landing's event on the GPU).

use super::error::CudaError;
use super::gpu::{DeviceBuf, Event, Gpu, PinnedBuf};
use super::pinned_pool::SharedPinned;
use std::sync::Arc;

/// Where a pool's handoffs land: one GPU, reached through a stream of its own (never a rank's),
/// with staging kept from one payload to the next (freeing pinned memory waits for the device).
pub struct Landing {
    gpu: Arc<Gpu>,
    staging: Arc<SharedPinned>,
}

impl Landing {
    /// Lands on GPU `ordinal` (or in this process's emulation of the kernels).
    pub fn open(ordinal: usize, emulated: bool) -> Result<Self, CudaError> {
        let gpu = if emulated { Gpu::emulated()? } else { Gpu::open(ordinal)? };
        Ok(Landing { gpu, staging: Arc::default() })
    }

    /// Device memory for a payload of `floats` floats, filled piece by piece.
    pub fn begin(&self, floats: usize, piece_floats: usize) -> Result<LandingKv, CudaError> {
        let piece = piece_floats.clamp(1, floats.max(1));
        Ok(LandingKv {
            gpu: self.gpu.clone(),
            buf: self.gpu.scratch::<f32>(floats.max(1))?,
            floats,
            staging: [self.staging.take(&self.gpu, piece)?, self.staging.take(&self.gpu, piece)?],
            spares: self.staging.clone(),
            copied: [None, None],
            at: 0,
            turn: 0,
        })
    }
}

/// A payload landing: [`LandingKv::next_piece`] gives the staging to read the next piece into,
/// [`LandingKv::landed`] sends it on; [`LandingKv::finish`] once every float has landed.
pub struct LandingKv {
    gpu: Arc<Gpu>,
    buf: DeviceBuf<f32>,
    floats: usize,
    staging: [PinnedBuf<f32>; 2],
    spares: Arc<SharedPinned>,
    /// The copy out of each staging buffer in flight, if any.
    copied: [Option<Event>; 2],
    /// Floats landed (or being copied) so far.
    at: usize,
    turn: usize,
}

impl LandingKv {
    /// The staging for the next piece (at most its capacity, and what is left): waits, on the
    /// host, for the copy that used this buffer two pieces ago.
    pub fn next_piece(&mut self) -> Result<&mut [f32], CudaError> {
        let t = self.turn;
        if let Some(event) = self.copied[t].take() {
            self.gpu.wait_for(&event)?;
        }
        let len = self.staging[t].len().min(self.floats - self.at);
        Ok(&mut self.staging[t].as_mut_slice()[..len])
    }

    /// The piece read into [`LandingKv::next_piece`]'s staging (all of it) goes to the device.
    pub fn landed(&mut self) -> Result<(), CudaError> {
        let t = self.turn;
        let len = self.staging[t].len().min(self.floats - self.at);
        self.gpu.copy_to_device(self.buf.at(self.at), &self.staging[t], len)?;
        self.copied[t] = Some(self.gpu.record()?);
        self.at += len;
        self.turn = 1 - t;
        Ok(())
    }

    /// Every float sent on: the payload in device memory, ready once its event is.
    pub fn finish(self) -> Result<LandedKv, CudaError> {
        if self.at != self.floats {
            return Err(CudaError::Unsupported(format!("{} of {} floats landed", self.at, self.floats)));
        }
        let event = self.gpu.record()?;
        // (the staging buffers stay alive until their copies are done: kept after the event)
        self.gpu.wait_for(&event)?;
        let LandingKv { gpu, buf, floats, staging, spares, .. } = self;
        staging.into_iter().for_each(|b| spares.give_back(b));
        Ok(LandedKv { gpu, buf, floats, event })
    }
}

/// A handoff's KV in device memory, packed by layer as on the wire.
pub struct LandedKv {
    gpu: Arc<Gpu>,
    buf: DeviceBuf<f32>,
    pub floats: usize,
    /// Recorded after the last piece's copy.
    pub event: Event,
}

impl LandedKv {
    /// Whether `gpu`'s kernels can read it (the same device, or both emulated).
    pub fn same_device(&self, gpu: &Gpu) -> bool {
        self.gpu.same_device(gpu)
    }

    /// Its device address.
    pub fn ptr(&self) -> u64 {
        self.buf.ptr()
    }

    /// A copy on the host (a consumer on another device or the CPU; waits).
    pub fn read(&self) -> Result<Vec<f32>, CudaError> {
        self.gpu.download(&self.buf, self.floats)
    }
}

impl std::fmt::Debug for Landing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Landing(GPU {})", self.gpu.ordinal)
    }
}

impl std::fmt::Debug for LandedKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LandedKv({} floats on GPU {})", self.floats, self.gpu.ordinal)
    }
}
