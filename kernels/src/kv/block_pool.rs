//! The paged block pool: hands out block ids, counts references (a prefix shared by several
//! sequences holds one reference per sequence), and takes them back. Accounting is exact:
//! `num_free() == num_blocks()` exactly when nothing holds a block.

use thiserror::Error;

/// Index of a block in every layer of the paged cache.
pub type BlockId = u32;

/// Not enough free blocks for a request.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("out of KV blocks: needed {needed}, {free} free of {total}")]
pub struct OutOfBlocks {
    pub needed: usize,
    pub free: usize,
    pub total: usize,
}

/// Free list plus reference counts.
#[derive(Debug)]
pub struct BlockPool {
    free: Vec<BlockId>,
    ref_counts: Vec<u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        // Hand out low ids first (pop from the end of a reversed list).
        BlockPool { free: (0..num_blocks as BlockId).rev().collect(), ref_counts: vec![0; num_blocks] }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn can_allocate(&self, n: usize) -> bool {
        self.free.len() >= n
    }

    /// Takes a free block with one reference.
    pub fn allocate(&mut self) -> Result<BlockId, OutOfBlocks> {
        let id = self.free.pop().ok_or(OutOfBlocks { needed: 1, free: 0, total: self.num_blocks() })?;
        debug_assert_eq!(self.ref_counts[id as usize], 0);
        self.ref_counts[id as usize] = 1;
        Ok(id)
    }

    /// Adds a reference to a block already held by someone.
    pub fn share(&mut self, id: BlockId) {
        let rc = &mut self.ref_counts[id as usize];
        assert!(*rc > 0, "block {id} is free: it cannot be shared");
        *rc += 1;
    }

    /// Drops one reference; the block is free again when none is left. Returns whether it was.
    pub fn release(&mut self, id: BlockId) -> bool {
        let rc = &mut self.ref_counts[id as usize];
        assert!(*rc > 0, "block {id} released more often than it was taken");
        *rc -= 1;
        if *rc == 0 {
            self.free.push(id);
            true
        } else {
            false
        }
    }

    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.ref_counts[id as usize]
    }
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

    /// Grows the table to cover `tokens` tokens; all or nothing.
    pub fn grow_to(&mut self, tokens: usize, block_size: usize, pool: &mut BlockPool) -> Result<(), OutOfBlocks> {
        let missing = self.blocks_missing(tokens, block_size);
        if !pool.can_allocate(missing) {
            return Err(OutOfBlocks { needed: missing, free: pool.num_free(), total: pool.num_blocks() });
        }
        for _ in 0..missing {
            self.blocks.push(pool.allocate()?);
        }
        Ok(())
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
        let mut pool = BlockPool::new(4);
        let mut t = BlockTable::new();
        t.grow_to(33, 16, &mut pool).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(pool.num_free(), 1);
        t.release_all(&mut pool);
        assert_eq!(pool.num_free(), 4);
    }

    #[test]
    fn growth_is_all_or_nothing() {
        let mut pool = BlockPool::new(2);
        let mut t = BlockTable::new();
        let err = t.grow_to(48, 16, &mut pool).unwrap_err();
        assert_eq!(err, OutOfBlocks { needed: 3, free: 2, total: 2 });
        assert_eq!(pool.num_free(), 2);
        assert!(t.is_empty());
    }

    #[test]
    fn a_shared_block_is_free_only_after_its_last_reference() {
        let mut pool = BlockPool::new(1);
        let id = pool.allocate().unwrap();
        pool.share(id);
        assert!(!pool.release(id));
        assert_eq!(pool.num_free(), 0);
        assert!(pool.release(id));
        assert_eq!(pool.num_free(), 1);
    }
}
