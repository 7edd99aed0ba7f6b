//! The paged KV cache of one rank: for every attention layer, `num_blocks × block_size` rows of
//! that layer's per-token width. A block id names the same block in every layer (one block table
//! per sequence, as in vLLM). Which rows a sequence owns is the [`super::BlockPool`]'s business;
//! this type only stores values.

/// One layer's rows.
pub struct KvLayer {
    row_width: usize,
    data: Vec<f32>,
}

impl KvLayer {
    /// Per-token width of this layer's rows.
    pub fn row_width(&self) -> usize {
        self.row_width
    }

    /// The row at cache index `r` (see [`PagedKvCache::row_index`]).
    #[inline]
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.row_width..(r + 1) * self.row_width]
    }

    #[inline]
    /// Rows `first..first + n`, contiguous.
    pub fn rows(&self, first: usize, n: usize) -> &[f32] {
        &self.data[first * self.row_width..(first + n) * self.row_width]
    }

    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.row_width..(r + 1) * self.row_width]
    }
}

/// Paged KV storage for every attention layer of a model on one rank.
pub struct PagedKvCache {
    block_size: usize,
    num_blocks: usize,
    layers: Vec<KvLayer>,
}

impl PagedKvCache {
    /// Zeroed storage for `num_blocks` blocks of `block_size` tokens, one layer per entry of
    /// `row_widths`.
    pub fn new(block_size: usize, num_blocks: usize, row_widths: &[usize]) -> Self {
        assert!(block_size > 0, "block size must be positive");
        let layers = row_widths
            .iter()
            .map(|&w| KvLayer { row_width: w, data: vec![0.0; num_blocks * block_size * w] })
            .collect();
        PagedKvCache { block_size, num_blocks, layers }
    }

    /// Bytes one block takes across all layers.
    pub fn bytes_per_block(block_size: usize, row_widths: &[usize]) -> usize {
        block_size * row_widths.iter().sum::<usize>() * std::mem::size_of::<f32>()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Cache row of token position `pos` of a sequence with this block table.
    #[inline]
    pub fn row_index(&self, block_table: &[u32], pos: usize) -> usize {
        let block = block_table[pos / self.block_size] as usize;
        debug_assert!(block < self.num_blocks);
        block * self.block_size + pos % self.block_size
    }

    pub fn layer(&self, l: usize) -> &KvLayer {
        &self.layers[l]
    }

    pub fn layer_mut(&mut self, l: usize) -> &mut KvLayer {
        &mut self.layers[l]
    }

    /// Copies block `src` into block `dst` in every layer (copy-on-write of a shared block).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let bs = self.block_size;
        for layer in &mut self.layers {
            let w = layer.row_width * bs;
            let (s, d) = (src as usize * w, dst as usize * w);
            layer.data.copy_within(s..s + w, d);
        }
    }
}
