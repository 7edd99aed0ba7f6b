//! Per-rank model memory: refcounted, generational id pools (KV blocks, state slots, snapshots),
//! per-sequence block tables, and the storage the executor owns — the paged cache of attention
//! rows and the slot/snapshot store of recurrent state.

mod block_pool;
mod cache;
mod export;
mod id_pool;
mod state_pool;

pub use block_pool::{block_pool, BlockId, BlockPool, BlockTable, OutOfBlocks};
pub use cache::{KvLayer, PagedKvCache};
pub use export::{layout_fingerprint, ImportError};
pub use id_pool::{IdPool, OutOfIds, StaleRelease};
pub use state_pool::{SlotId, SnapshotId, StatePool};
