//! Paged KV memory: the block pool that hands out block ids, per-sequence block tables, and the
//! cache that stores the rows.

mod block_pool;
mod cache;

pub use block_pool::{BlockId, BlockPool, BlockTable, OutOfBlocks};
pub use cache::{KvLayer, PagedKvCache};
