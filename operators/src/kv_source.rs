//! Where the KV blocks an export names are read from: in place in the producer rank's cache
//! (host or device), which holds them until their reader is done — a cuda producer's handoff
//! (the consumer's ack) or a save (its completion). Shared by the step (an export, an import)
//! and the transfer engine (a handoff carries its source), below both. A CPU producer's handoff
//! carries a copy instead (`KvExport::copy_out`): a host cache is locked while its rank's step
//! runs. A cuda piece sent as its step launched carries the marks of its KV layers, which every
//! reader waits for on the GPU.

/// Blocks of a rank's KV cache read in place by a cuda producer's handoff (one copy, into the
/// consumer's blocks, or onto a socket) or by a save: the rank holds them until their reader is
/// done (the consumer's ack, the save's completion).
#[derive(Clone)]
pub struct KvSource {
    pub store: BlockStore,
    pub blocks: Vec<u32>,
    pub floats_per_block: usize,
    /// Device blocks a step still in flight writes (a piece sent as its step launched): when
    /// each layer is written, which a reader waits for before it reads that layer.
    pub marks: Option<std::sync::Arc<kvflow_kernels::cuda::LayerMarks>>,
}

/// Where the blocks of a [`KvSource`] live.
#[derive(Clone)]
pub enum BlockStore {
    /// A CPU rank's cache.
    Host(std::sync::Arc<parking_lot::RwLock<kvflow_kernels::models::ModelCache>>),
    /// A GPU rank's device cache: a `cuda` consumer on the same device copies the blocks device
    /// to device; everyone else reads them through a stream of their own.
    Device(std::sync::Arc<kvflow_kernels::cuda::SharedKv>),
}

impl KvSource {
    /// The blocks' KV, packed by layer (a copy; empty when a device read fails, which the
    /// import then refuses by its size).
    pub fn read(&self) -> Vec<f32> {
        self.read_waiting().0
    }

    /// [`read`](Self::read), and how long it waited for the owner's cache (a host cache is
    /// locked while its rank's step runs).
    pub fn read_waiting(&self) -> (Vec<f32>, std::time::Duration) {
        match &self.store {
            BlockStore::Host(cache) => {
                let mut kv = Vec::new();
                let asked = std::time::Instant::now();
                let cache = cache.read();
                let waited = asked.elapsed();
                cache.kv.export_blocks(&self.blocks, &mut kv);
                (kv, waited)
            }
            BlockStore::Device(shared) => {
                let kv = shared.read(&self.blocks, self.marks.as_deref()).unwrap_or_else(|e| {
                    tracing::error!("reading a handoff's blocks from the GPU: {e}");
                    Vec::new()
                });
                (kv, std::time::Duration::ZERO)
            }
        }
    }

    /// The blocks' KV, packed by layer, handed to `piece` in pieces of about `piece_floats`
    /// through one staging buffer: a host cache is locked one block at a time, never while
    /// `piece` runs (a socket write does not hold back the producer's steps); device blocks are
    /// copied out a layer at a time into pinned staging, on a stream of the reader's own, each
    /// layer handed on while the next is copied out. A failed device read hands on what it had
    /// (the consumer refuses the import by its size).
    pub fn stream(&self, piece_floats: usize, mut piece: impl FnMut(&[f32])) {
        let cache = match &self.store {
            BlockStore::Host(cache) => cache,
            BlockStore::Device(shared) => {
                if let Err(e) = shared.stream_layers(&self.blocks, self.marks.as_deref(), piece_floats, piece) {
                    tracing::error!("streaming a handoff's blocks from the GPU: {e}");
                }
                return;
            }
        };
        let mut staging: Vec<f32> = Vec::with_capacity(piece_floats + self.floats_per_block);
        let layers = cache.read().kv.num_layers();
        for l in 0..layers {
            for &b in &self.blocks {
                {
                    let cache = cache.read();
                    let rows = cache.kv.block_size();
                    staging.extend_from_slice(cache.kv.layer(l).rows(b as usize * rows, rows));
                }
                if staging.len() >= piece_floats {
                    piece(&staging);
                    staging.clear();
                }
            }
        }
        if !staging.is_empty() {
            piece(&staging);
        }
    }
}

impl std::fmt::Debug for KvSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KvSource({} blocks in place)", self.blocks.len())
    }
}

impl PartialEq for KvSource {
    fn eq(&self, other: &Self) -> bool {
        let same = match (&self.store, &other.store) {
            (BlockStore::Host(a), BlockStore::Host(b)) => std::sync::Arc::ptr_eq(a, b),
            (BlockStore::Device(a), BlockStore::Device(b)) => std::sync::Arc::ptr_eq(a, b),
            _ => false,
        };
        same && self.blocks == other.blocks
    }
}
