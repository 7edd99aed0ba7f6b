//! A request's memory as plain floats, for a handoff between pools (DESIGN §8): the KV of a list
//! of blocks, packed by layer (every block of layer 0, then layer 1, …), and a state slot. The
//! consumer writes what arrives into blocks and a slot it allocated; sizes are checked against
//! its own layout, so nothing lands outside them.

use super::{PagedKvCache, SlotId, StatePool};
use crate::hash;

/// Why arriving KV or state does not fit what the consumer allocated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    #[error("{what}: {got} floats for {expected} expected by this rank's layout")]
    WrongSize { what: &'static str, got: usize, expected: usize },
    #[error("block {block} is outside this rank's {blocks} blocks")]
    NoSuchBlock { block: u32, blocks: usize },
    #[error("slot {slot} is outside this rank's {slots} slots")]
    NoSuchSlot { slot: SlotId, slots: usize },
}

impl PagedKvCache {
    /// Floats one block holds across every layer.
    pub fn floats_per_block(&self) -> usize {
        (0..self.num_layers()).map(|l| self.layer(l).row_width()).sum::<usize>() * self.block_size()
    }

    /// Appends the KV of `blocks` to `out`, packed by layer.
    pub fn export_blocks(&self, blocks: &[u32], out: &mut Vec<f32>) {
        out.reserve(blocks.len() * self.floats_per_block());
        for l in 0..self.num_layers() {
            let layer = self.layer(l);
            let rows = self.block_size();
            for &b in blocks {
                let first = b as usize * rows;
                for r in first..first + rows {
                    out.extend_from_slice(layer.row(r));
                }
            }
        }
    }

    /// Copies the KV of `from` in `source` (another rank's cache of the same geometry) into
    /// `to` here: one copy, row by row. Every id and the geometry are checked first: on error
    /// nothing is written.
    pub fn copy_blocks_from(&mut self, source: &PagedKvCache, from: &[u32], to: &[u32]) -> Result<(), ImportError> {
        if from.len() != to.len() {
            return Err(ImportError::WrongSize { what: "KV blocks", got: from.len(), expected: to.len() });
        }
        if source.floats_per_block() != self.floats_per_block() || source.num_layers() != self.num_layers() {
            return Err(ImportError::WrongSize {
                what: "KV floats per block",
                got: source.floats_per_block(),
                expected: self.floats_per_block(),
            });
        }
        if let Some(&block) = to.iter().find(|&&b| b as usize >= self.num_blocks()) {
            return Err(ImportError::NoSuchBlock { block, blocks: self.num_blocks() });
        }
        if let Some(&block) = from.iter().find(|&&b| b as usize >= source.num_blocks()) {
            return Err(ImportError::NoSuchBlock { block, blocks: source.num_blocks() });
        }
        let rows = self.block_size();
        for l in 0..self.num_layers() {
            let (src, dst) = (source.layer(l), self.layer_mut(l));
            for (&f, &t) in from.iter().zip(to) {
                for r in 0..rows {
                    dst.row_mut(t as usize * rows + r).copy_from_slice(src.row(f as usize * rows + r));
                }
            }
        }
        Ok(())
    }

    /// Writes `data` (packed by layer, as [`Self::export_blocks`] gives it) into `blocks`. Every
    /// block id and the total size are checked first: on error nothing is written.
    pub fn import_blocks(&mut self, blocks: &[u32], data: &[f32]) -> Result<(), ImportError> {
        if let Some(&block) = blocks.iter().find(|&&b| b as usize >= self.num_blocks()) {
            return Err(ImportError::NoSuchBlock { block, blocks: self.num_blocks() });
        }
        let expected = blocks.len() * self.floats_per_block();
        if data.len() != expected {
            return Err(ImportError::WrongSize { what: "KV", got: data.len(), expected });
        }
        let rows = self.block_size();
        let mut at = 0;
        for l in 0..self.num_layers() {
            let width = self.layer(l).row_width();
            let layer = self.layer_mut(l);
            for &b in blocks {
                let first = b as usize * rows;
                for r in first..first + rows {
                    layer.row_mut(r).copy_from_slice(&data[at..at + width]);
                    at += width;
                }
            }
        }
        Ok(())
    }
}

impl StatePool {
    /// Slots this store holds.
    pub fn num_slots(&self) -> usize {
        self.slot_count()
    }

    /// Writes `data` into `slot`, checking the slot id and the width first.
    pub fn import_slot(&mut self, slot: SlotId, data: &[f32]) -> Result<(), ImportError> {
        if slot as usize >= self.num_slots() {
            return Err(ImportError::NoSuchSlot { slot, slots: self.num_slots() });
        }
        if data.len() != self.width() {
            return Err(ImportError::WrongSize { what: "state", got: data.len(), expected: self.width() });
        }
        self.forget_rows(slot);
        self.slot_mut(slot).copy_from_slice(data);
        Ok(())
    }
}

/// A fingerprint of what a rank's memory holds per token and per request — the row width of every
/// attention layer, the state width, the block size and the element type — so two pools whose
/// layouts differ refuse to exchange handoffs instead of misreading them.
pub fn layout_fingerprint(family: &str, kv_row_widths: &[usize], state_width: usize, block_size: usize) -> u64 {
    let mut h = hash::mix(hash::EMPTY, family.len() as u64);
    for b in family.bytes() {
        h = hash::mix(h, b as u64);
    }
    h = hash::mix(h, kv_row_widths.len() as u64);
    for &w in kv_row_widths {
        h = hash::mix(h, w as u64);
    }
    h = hash::mix(h, state_width as u64);
    h = hash::mix(h, block_size as u64);
    hash::mix(h, 4) // f32 elements
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_exported_from_one_cache_import_into_other_block_ids_of_another() {
        let mut a = PagedKvCache::new(4, 6, &[3, 5]);
        for l in 0..2 {
            let w = a.layer(l).row_width();
            for r in 0..24 {
                a.layer_mut(l).row_mut(r).copy_from_slice(&vec![(l * 1000 + r) as f32; w]);
            }
        }
        let mut data = Vec::new();
        a.export_blocks(&[4, 1], &mut data);
        assert_eq!(data.len(), 2 * a.floats_per_block());
        let mut b = PagedKvCache::new(4, 3, &[3, 5]);
        b.import_blocks(&[0, 2], &data).unwrap();
        for l in 0..2 {
            for i in 0..4 {
                assert_eq!(b.layer(l).row(i), a.layer(l).row(16 + i), "block 4 → 0");
                assert_eq!(b.layer(l).row(8 + i), a.layer(l).row(4 + i), "block 1 → 2");
            }
        }
        assert!(matches!(b.import_blocks(&[3], &data[..a.floats_per_block()]), Err(ImportError::NoSuchBlock { .. })));
        assert!(matches!(b.import_blocks(&[0], &data), Err(ImportError::WrongSize { .. })));
    }

    #[test]
    fn a_slot_imports_only_at_its_width_and_only_into_a_slot_that_exists() {
        let mut s = StatePool::new(3, 2, 0);
        s.import_slot(1, &[1.0, 2.0, 3.0]).unwrap();
        assert_eq!(s.slot(1), &[1.0, 2.0, 3.0]);
        assert!(s.import_slot(2, &[0.0; 3]).is_err());
        assert!(s.import_slot(0, &[0.0; 2]).is_err());
    }

    #[test]
    fn layouts_that_differ_in_any_part_differ_in_fingerprint() {
        let base = layout_fingerprint("mha", &[64, 64], 0, 16);
        assert_eq!(base, layout_fingerprint("mha", &[64, 64], 0, 16));
        for other in [
            layout_fingerprint("mla", &[64, 64], 0, 16),
            layout_fingerprint("mha", &[64, 65], 0, 16),
            layout_fingerprint("mha", &[64, 64, 64], 0, 16),
            layout_fingerprint("mha", &[64, 64], 8, 16),
            layout_fingerprint("mha", &[64, 64], 0, 32),
        ] {
            assert_ne!(base, other);
        }
    }
}
