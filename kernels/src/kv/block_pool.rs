//! Block tables: the blocks of one sequence, in position order, taken from the rank's
//! [`BlockPool`] (an [`IdPool`] of KV block ids: refcounted, generational).

pub use super::id_pool::{IdPool, OutOfIds};

/// Index of a block in every layer of the paged cache.
pub type BlockId = u32;

/// The KV block ids of one rank.
pub type BlockPool = IdPool;

/// Not enough free blocks for a request.
pub type OutOfBlocks = OutOfIds;

/// A pool of `num_blocks` KV block ids.
pub fn block_pool(num_blocks: usize) -> BlockPool {
    IdPool::new("KV blocks", num_blocks)
}

/// The blocks of one sequence, in position order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
}

impl BlockTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Appends a block the caller already holds a reference to (e.g. a shared prefix block).
    pub fn push(&mut self, id: BlockId) {
        self.blocks.push(id);
    }

    /// Blocks needed beyond those held to store `tokens` tokens.
    pub fn blocks_missing(&self, tokens: usize, block_size: usize) -> usize {
        tokens.div_ceil(block_size).saturating_sub(self.blocks.len())
    }

    /// Grows the table to cover `tokens` tokens on behalf of request `owner`; all or nothing.
    pub fn grow_to(
        &mut self,
        tokens: usize,
        block_size: usize,
        pool: &mut BlockPool,
        owner: u64,
    ) -> Result<(), OutOfBlocks> {
        let missing = self.blocks_missing(tokens, block_size);
        if !pool.can_allocate(missing) {
            return Err(OutOfIds { what: pool.what(), needed: missing, free: pool.num_free(), total: pool.num_ids() });
        }
        for _ in 0..missing {
            self.blocks.push(pool.allocate_for(owner)?);
        }
        Ok(())
    }

    /// Takes the blocks out of the table (their references go with them).
    pub fn take(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.blocks)
    }

    /// Returns every block to the pool.
    pub fn release_all(&mut self, pool: &mut BlockPool) {
        for id in self.blocks.drain(..) {
            pool.release(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growing_and_releasing_returns_every_block() {
        let mut pool = block_pool(4);
        let mut t = BlockTable::new();
        t.grow_to(33, 16, &mut pool, 1).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(pool.num_free(), 1);
        t.release_all(&mut pool);
        assert_eq!(pool.num_free(), 4);
    }

    #[test]
    fn growth_is_all_or_nothing() {
        let mut pool = block_pool(2);
        let mut t = BlockTable::new();
        let err = t.grow_to(48, 16, &mut pool, 1).unwrap_err();
        assert_eq!(err, OutOfBlocks { what: "KV blocks", needed: 3, free: 2, total: 2 });
        assert_eq!(pool.num_free(), 2);
        assert!(t.is_empty());
    }
}
