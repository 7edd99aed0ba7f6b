//! A rank's model memory under one roof: the model cache (paged KV, state slots, snapshots), the
//! block pool, and the prefix cache that holds references into both. Accounting is exact:
//! `check_all_free` holds at the end of every run.

use super::prefix_cache::{block_hashes, PrefixCache};
use super::sequence::Sequence;
use kvflow_kernels::kv::BlockPool;
use kvflow_kernels::models::ModelCache;

/// Sizes a rank's memory is split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryLayout {
    pub block_size: usize,
    pub blocks: usize,
    pub slots: usize,
    pub snapshots: usize,
    pub keeps_kv: bool,
    pub keeps_state: bool,
    /// Prefix keys also carry the prompt length (DeepSeek-V3.2: its prompt rows depend on it).
    pub prefix_keyed_by_prompt_len: bool,
}

pub struct RankMemory {
    pub layout: MemoryLayout,
    pub cache: ModelCache,
    pub pool: BlockPool,
    pub prefix: PrefixCache,
}

impl RankMemory {
    pub fn new(layout: MemoryLayout, cache: ModelCache) -> Self {
        RankMemory {
            pool: BlockPool::new(layout.blocks),
            prefix: PrefixCache::new(layout.keeps_kv, layout.keeps_state),
            layout,
            cache,
        }
    }

    /// Chained hashes of a prompt's full blocks.
    pub fn prompt_hashes(&self, seq: &Sequence) -> Vec<u64> {
        let seed = if self.layout.prefix_keyed_by_prompt_len { seq.prompt_len as u64 } else { 0 };
        block_hashes(&seq.tokens[..seq.prompt_len], self.layout.block_size, seed)
    }

    /// Blocks a sequence needs to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        if self.layout.keeps_kv {
            tokens.div_ceil(self.layout.block_size)
        } else {
            0
        }
    }

    /// Grows the sequence's blocks to cover `tokens`, evicting prefix-cache blocks if needed.
    /// All or nothing; returns whether it succeeded.
    pub fn ensure_blocks(&mut self, seq: &mut Sequence, tokens: usize) -> bool {
        if !self.layout.keeps_kv {
            return true;
        }
        let missing = seq.blocks.blocks_missing(tokens, self.layout.block_size);
        if missing > self.pool.num_free() {
            let short = missing - self.pool.num_free();
            self.prefix.evict_blocks(short, &mut self.pool);
        }
        seq.blocks.grow_to(tokens, self.layout.block_size, &mut self.pool).is_ok()
    }

    /// Returns everything a sequence holds; it must start again from scratch.
    pub fn release(&mut self, seq: &mut Sequence) {
        seq.blocks.release_all(&mut self.pool);
        if let Some(slot) = seq.slot.take() {
            self.cache.states.release_slot(slot);
        }
        seq.computed = 0;
        seq.cached = 0;
    }

    /// Whether every block, slot and snapshot is free (after the prefix cache was cleared).
    pub fn all_free(&self) -> bool {
        self.pool.num_free() == self.pool.num_blocks() && self.cache.states.all_free()
    }

    /// Drops the prefix cache's references (end of run, before the accounting check).
    pub fn clear_prefix_cache(&mut self) {
        self.prefix.clear(&mut self.pool, &mut self.cache.states);
    }
}
