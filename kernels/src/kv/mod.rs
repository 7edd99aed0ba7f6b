//! Per-rank model memory: the paged KV block pool, per-sequence block tables and the cache that
//! stores the rows; and the slot/snapshot pool for recurrent state.

mod block_pool;
mod cache;
mod state_pool;

pub use block_pool::{BlockId, BlockPool, BlockTable, OutOfBlocks};
pub use cache::{KvLayer, PagedKvCache};
pub use state_pool::{OutOfStates, SlotId, SnapshotId, StatePool};
