//! A rank's paged KV cache in device memory: one buffer per KV layer of `num_blocks ×
//! block_size` rows, and the kernels that move a request's blocks — pack into one contiguous
//! buffer, unpack from one, copy between two caches on one GPU (DESIGN §7, the handoff; the
//! offload tier reuses them). The packed layout is `PagedKvCache::export_blocks`'s: by layer,
//! then block, then row, so a packed buffer is a handoff's `kv` as the CPU executor makes it.
//! The cache holds the executor's dtype (f32, or bf16: rounded as rows are written, widened as
//! they are read); a packed buffer is always f32.

use super::error::CudaError;
use super::gpu::{DeviceBuf, Event, Gpu, PinnedBuf};
use super::launch::Arg;
use super::pinned_pool::SharedPinned;
use super::weights::{bf16_bits, Dtype};
use std::sync::Arc;

pub struct DeviceKv {
    /// Each layer's values, as 16-bit words (two per f32 value, one per bf16 value).
    layers: Vec<DeviceBuf<u16>>,
    widths: Vec<usize>,
    pub dtype: Dtype,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Device copies of the layers' addresses and widths (for pack/unpack).
    layer_ptrs: DeviceBuf<u64>,
    widths_dev: DeviceBuf<i32>,
}

impl DeviceKv {
    /// A zeroed cache of `num_blocks` blocks for KV layers of row widths `widths`, in `dtype`.
    pub fn new(
        gpu: &Gpu,
        widths: &[usize],
        block_size: usize,
        num_blocks: usize,
        dtype: Dtype,
    ) -> Result<Self, CudaError> {
        let words = dtype.bytes() / 2;
        let layers = widths
            .iter()
            .map(|w| gpu.zeros::<u16>(num_blocks * block_size * w * words))
            .collect::<Result<Vec<_>, _>>()?;
        let ptrs: Vec<u64> = layers.iter().map(DeviceBuf::ptr).collect();
        let w32: Vec<i32> = widths.iter().map(|&w| w as i32).collect();
        Ok(DeviceKv {
            layer_ptrs: gpu.upload(&ptrs)?,
            widths_dev: gpu.upload(&w32)?,
            layers,
            widths: widths.to_vec(),
            dtype,
            block_size,
            num_blocks,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Values of one block over every layer (floats, once packed).
    pub fn floats_per_block(&self) -> usize {
        self.widths.iter().sum::<usize>() * self.block_size
    }

    /// Bytes of device memory one block takes over every layer.
    pub fn bytes_per_block(&self) -> usize {
        self.floats_per_block() * self.dtype.bytes()
    }

    /// The kernels' `kv_bf16` argument.
    pub(crate) fn bf16_arg(&self) -> Arg {
        Arg::I32((self.dtype == Dtype::Bfloat16) as i32)
    }

    /// Device address of layer `l`'s cache.
    pub(crate) fn layer(&self, l: usize) -> u64 {
        self.layers[l].ptr()
    }

    pub(crate) fn width(&self, l: usize) -> usize {
        self.widths[l]
    }

    /// Overwrites layer `l` with `data` (checks and benches: waits for the copy).
    pub fn fill_layer(&self, gpu: &Gpu, l: usize, data: &[f32]) -> Result<(), CudaError> {
        if data.len() != self.num_blocks * self.block_size * self.widths[l] {
            return Err(CudaError::Unsupported(format!("layer {l}: {} floats do not fill it", data.len())));
        }
        let bytes = data.len() * self.dtype.bytes();
        match self.dtype {
            Dtype::Float32 => {
                let staged = gpu.upload(data)?;
                gpu.copy_on_device(self.layer(l), staged.ptr(), bytes)?;
                gpu.wait()
            }
            Dtype::Bfloat16 => {
                let staged = gpu.upload(&data.iter().map(|&v| bf16_bits(v)).collect::<Vec<_>>())?;
                gpu.copy_on_device(self.layer(l), staged.ptr(), bytes)?;
                gpu.wait()
            }
        }
    }

    /// `Err` naming the first block outside this cache.
    pub fn check_blocks(&self, blocks: &[u32]) -> Result<(), CudaError> {
        match blocks.iter().find(|&&b| b as usize >= self.num_blocks) {
            Some(b) => {
                Err(CudaError::Unsupported(format!("block {b} is outside the cache ({} blocks)", self.num_blocks)))
            }
            None => Ok(()),
        }
    }

    /// Enqueues the gather of `n` blocks (listed at device address `blocks`) into `packed`
    /// (`n × floats_per_block` floats).
    pub fn pack(&self, gpu: &Gpu, packed: u64, blocks: u64, n: usize) -> Result<(), CudaError> {
        self.move_blocks(gpu, "pack_blocks", packed, blocks, n)
    }

    /// Enqueues the scatter of `packed` into `n` blocks (listed at device address `blocks`).
    pub fn unpack(&self, gpu: &Gpu, packed: u64, blocks: u64, n: usize) -> Result<(), CudaError> {
        self.move_blocks(gpu, "unpack_blocks", packed, blocks, n)
    }

    /// Enqueues the gather of layer `layer` of `n` blocks (listed at device address `blocks`)
    /// into `packed`: that layer's part of what [`DeviceKv::pack`] writes.
    pub fn pack_layer(&self, gpu: &Gpu, layer: usize, packed: u64, blocks: u64, n: usize) -> Result<(), CudaError> {
        let args = [
            Arg::Ptr(packed),
            Arg::Ptr(self.layer_ptrs.at(layer)),
            Arg::Ptr(self.widths_dev.at(layer)),
            Arg::Ptr(blocks),
            Arg::I32(n as i32),
            Arg::I32(self.block_size as i32),
            self.bf16_arg(),
        ];
        gpu.launch("pack_blocks", (n as u32, 1, 1), 256, 0, &args)
    }

    fn move_blocks(&self, gpu: &Gpu, kernel: &str, packed: u64, blocks: u64, n: usize) -> Result<(), CudaError> {
        let args = [
            Arg::Ptr(packed),
            Arg::Ptr(self.layer_ptrs.ptr()),
            Arg::Ptr(self.widths_dev.ptr()),
            Arg::Ptr(blocks),
            Arg::I32(n as i32),
            Arg::I32(self.block_size as i32),
            self.bf16_arg(),
        ];
        gpu.launch(kernel, (n as u32, self.layers.len() as u32, 1), 256, 0, &args)
    }

    /// Whether `other`'s blocks have this cache's widths, block size and dtype (what a
    /// device-to-device block copy needs).
    pub fn same_layout(&self, other: &DeviceKv) -> bool {
        other.widths == self.widths && other.block_size == self.block_size && other.dtype == self.dtype
    }

    /// Enqueues the copy of `n` blocks of `from` (at device address `from_blocks`) into this
    /// cache's blocks at `to_blocks`: both caches on `gpu`, of the same geometry.
    pub fn copy_from(
        &self,
        gpu: &Gpu,
        from: &DeviceKv,
        to_blocks: u64,
        from_blocks: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        if !self.same_layout(from) {
            return Err(CudaError::Unsupported("the two caches differ in layout".into()));
        }
        let args = [
            Arg::Ptr(self.layer_ptrs.ptr()),
            Arg::Ptr(from.layer_ptrs.ptr()),
            Arg::Ptr(self.widths_dev.ptr()),
            Arg::Ptr(to_blocks),
            Arg::Ptr(from_blocks),
            Arg::I32(self.block_size as i32),
            Arg::I32(self.dtype.bytes() as i32),
        ];
        gpu.launch("copy_blocks", (n as u32, self.layers.len() as u32, 1), 256, 0, &args)
    }

    /// Enqueues the write of `rows` rows of `src` (stride `src_stride`) into layer `l`'s cache
    /// rows listed at `write_rows`.
    pub(crate) fn write_rows(
        &self,
        gpu: &Gpu,
        l: usize,
        src: u64,
        src_stride: usize,
        write_rows: u64,
        rows: usize,
    ) -> Result<(), CudaError> {
        let args = [
            Arg::Ptr(self.layer(l)),
            self.bf16_arg(),
            Arg::Ptr(src),
            Arg::Ptr(write_rows),
            Arg::I32(self.widths[l] as i32),
            Arg::I64(src_stride as i64),
        ];
        gpu.launch("write_cache_rows", (rows as u32, 1, 1), 128, 0, &args)
    }
}

/// When each KV layer of a step's blocks is written: an event per KV layer, recorded on the
/// rank's stream after the decoder layer that writes it ([`DeviceModel::enqueue_step`]).
/// A reader on a stream of its own has its stream wait, on the GPU, for layer `l`'s event before
/// it reads layer `l`: the blocks leave layer by layer while the step's later layers compute.
/// A step that completed has passed every mark (waiting on them costs nothing then).
///
/// [`DeviceModel::enqueue_step`]: super::model::DeviceModel::enqueue_step
pub struct LayerMarks(pub Vec<Event>);

impl LayerMarks {
    /// No mark yet for any of `kv_layers` KV layers: what a marked enqueue fills.
    pub fn unset(kv_layers: usize) -> Vec<Option<Event>> {
        (0..kv_layers).map(|_| None).collect()
    }

    /// The marks, if the enqueue marked every KV layer (an MTP layer's KV is written by the
    /// draft passes after the forward: not marked).
    pub fn of(marked: Vec<Option<Event>>) -> Option<LayerMarks> {
        marked.into_iter().collect::<Option<Vec<Event>>>().map(LayerMarks)
    }
}

/// A rank's device cache as a handoff reads it in place: a consumer on the same device copies
/// the blocks device to device (`DeviceKv::copy_from` on its own stream); anyone else reads them
/// through a stream of its own here (never the producer rank's, whose steps it would wait for).
pub struct SharedKv {
    pub kv: DeviceKv,
    /// The GPU the blocks live on (its own stream and host-wait count: not the rank's).
    reader: Arc<Gpu>,
    /// The reader's staging, kept for the next handoff (freeing it would wait for the device).
    staging: SharedPinned,
}

impl SharedKv {
    /// Shares `kv`, which lives on `gpu`'s device.
    pub fn new(kv: DeviceKv, gpu: &Gpu) -> Result<Self, CudaError> {
        let reader = if gpu.is_emulated() { Gpu::emulated()? } else { Gpu::open(gpu.ordinal)? };
        Ok(SharedKv { kv, reader, staging: SharedPinned::default() })
    }

    /// Whether `gpu` can read these blocks with its own kernels (the same device, or both
    /// emulated in this process).
    pub fn same_device(&self, gpu: &Gpu) -> bool {
        self.reader.same_device(gpu)
    }

    /// The KV of `blocks`, packed by layer, handed to `piece` a layer at a time (then cut into
    /// pieces of at most `piece_floats`): each layer is packed and copied into pinned staging on
    /// the reader's stream while the layer before it is handed on from the other of two staging
    /// buffers, so a socket write overlaps the copy-out rather than following all of it. With
    /// `marks` (blocks a step still in flight writes), layer `l` is read after its mark.
    pub fn stream_layers(
        &self,
        blocks: &[u32],
        marks: Option<&LayerMarks>,
        piece_floats: usize,
        mut piece: impl FnMut(&[f32]),
    ) -> Result<(), CudaError> {
        self.kv.check_blocks(blocks)?;
        if marks.is_some_and(|m| m.0.len() != self.kv.num_layers()) {
            return Err(CudaError::Unsupported("a mark for each KV layer".into()));
        }
        let n = blocks.len();
        let layer_floats: Vec<usize> = self.kv.widths.iter().map(|w| n * self.kv.block_size * w).collect();
        let largest = layer_floats.iter().copied().max().unwrap_or(0);
        if n == 0 || largest == 0 {
            return Ok(());
        }
        let list = self.reader.upload(blocks)?;
        let packed = [self.reader.scratch::<f32>(largest)?, self.reader.scratch::<f32>(largest)?];
        let mut staging = [self.staging.take(&self.reader, largest)?, self.staging.take(&self.reader, largest)?];
        let mut copied: Vec<Event> = Vec::with_capacity(2);
        let mut hand_on = |staging: &PinnedBuf<f32>, floats: usize| {
            staging.as_slice()[..floats].chunks(piece_floats.max(1)).for_each(&mut piece)
        };
        for (l, &floats) in layer_floats.iter().enumerate() {
            let (dev, host) = (&packed[l % 2], &mut staging[l % 2]);
            if let Some(marks) = marks {
                self.reader.stream_waits_for(&marks.0[l])?;
            }
            self.kv.pack_layer(&self.reader, l, dev.ptr(), list.ptr(), n)?;
            self.reader.copy_to_host(host, dev.ptr(), floats)?;
            copied.push(self.reader.record()?);
            if l > 0 {
                // the layer before this one, while this one is copied out
                self.reader.wait_for(&copied[l - 1])?;
                hand_on(&staging[(l - 1) % 2], layer_floats[l - 1]);
            }
        }
        let last = layer_floats.len() - 1;
        self.reader.wait_for(&copied[last])?;
        hand_on(&staging[last % 2], layer_floats[last]);
        // (both copies are done: the last one waited for, the one before it before it)
        staging.into_iter().for_each(|buf| self.staging.give_back(buf));
        Ok(())
    }

    /// The KV of `blocks`, packed by layer, copied to the host (waits, on the reader's stream;
    /// with `marks`, for the last of them first).
    pub fn read(&self, blocks: &[u32], marks: Option<&LayerMarks>) -> Result<Vec<f32>, CudaError> {
        self.kv.check_blocks(blocks)?;
        if let Some(last) = marks.and_then(|m| m.0.last()) {
            self.reader.stream_waits_for(last)?;
        }
        let floats = blocks.len() * self.kv.floats_per_block();
        let list = self.reader.upload(blocks)?;
        let packed = self.reader.scratch::<f32>(floats)?;
        self.kv.pack(&self.reader, packed.ptr(), list.ptr(), blocks.len())?;
        self.reader.download(&packed, floats)
    }
}
