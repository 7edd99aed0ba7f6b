//! `cuda`'s side of a P/D handoff (DESIGN §6): an arriving handoff written into its blocks before
//! the step's forward — device to device from a producer on this GPU, from the device memory a
//! tcp handoff landed in (a streamed one's pieces each unpacked at its own blocks), else unpacked
//! from pinned memory — with its recurrent state into its
//! slot; and a step's exports, its blocks read in place once it completed and its state slot
//! copied out after its forward — except streamed pieces, handed back as the step is enqueued
//! with an event per KV layer (`LayerMarks`), read layer by layer once the forward wrote them.
//!
//! Which time it holds: the step's, from its launch to its completion (the record owns what the
//! GPU reads).
//! Which guarantee it carries: the producer holds the blocks until the consumer's record, which
//! owns the handoff, lets go of it; a state lands after the slot's own copies and before the
//! forward that reads it; a piece handed out at launch is read no sooner than its layers' marks.

use super::{fail, CudaExecutor};
use crate::step::{BlockStore, ExecutorError, Exported, KvExport, KvImport, KvSource, StepLaunch};
use crate::transfer::Landed;
use kvflow_kernels::cuda::{Gpu, LayerMarks, PinnedBuf};
use std::sync::Arc;

impl CudaExecutor {
    /// The handoffs into their blocks (after the step's own state copies, before its forward):
    /// device to device from a producer on this GPU with the same layout, else unpacked from
    /// pinned memory; a recurrent state into its slot. Returns what the record must own until
    /// the step completes: each import (and its staged floats), and the staged states.
    #[allow(clippy::type_complexity)]
    pub(super) fn import_handoffs(
        &mut self,
        gpu: &Arc<Gpu>,
        launch: &StepLaunch<'_>,
        block_lists: &[u64],
    ) -> Result<(Vec<(KvImport, Option<PinnedBuf<f32>>)>, Vec<PinnedBuf<f32>>), ExecutorError> {
        let fpb = self.kv.kv.floats_per_block();
        let mut imports = Vec::new();
        let mut states_in = Vec::new();
        for (i, import) in launch.imports.iter().enumerate() {
            let h = &import.from;
            let bad = |m: String| ExecutorError::Launch(format!("{}: {m}", h.describe()));
            match (import.slot, h.state(), &self.state) {
                (None, None, _) => {}
                (Some(slot), Some(floats), Some(state)) => {
                    // the state after the prompt, into the request's slot
                    if floats.len() != state.width {
                        return Err(bad(format!("{} state floats for a slot of {}", floats.len(), state.width)));
                    }
                    let mut staged = self.pinned_floats.take(gpu, floats.len()).map_err(fail)?;
                    staged.as_mut_slice()[..floats.len()].copy_from_slice(floats);
                    state.copy_in(gpu, slot, &staged).map_err(fail)?;
                    if let Some(snapshot) = import.snapshot {
                        state.snapshot(gpu, slot, snapshot).map_err(fail)?;
                    }
                    states_in.push(staged);
                }
                _ => return Err(bad("the slot and the state it carries do not match (all-or-nothing state)".into())),
            }
            let from = block_lists[launch.imports.len() + launch.exports.len() + i];
            if let Some(KvSource { store: BlockStore::Device(producer), blocks, .. }) = h.source() {
                // (a cache of another layout or dtype is read through the packed f32 path below)
                if producer.same_device(gpu) && producer.kv.same_layout(&self.kv.kv) {
                    // device to device, on this rank's stream: the producer holds the blocks
                    // until the record (which owns the handoff) lets go of it
                    if blocks.len() != import.blocks.len() {
                        return Err(bad(format!("{} blocks for {}", blocks.len(), import.blocks.len())));
                    }
                    producer.kv.check_blocks(blocks).map_err(fail)?;
                    self.kv.kv.copy_from(gpu, &producer.kv, block_lists[i], from, blocks.len()).map_err(fail)?;
                    self.imported_on_device += 1;
                    imports.push((import.clone(), None));
                    continue;
                }
            }
            let floats = import.blocks.len() * fpb;
            if let Some(parts) = h.landed().filter(|parts| parts.iter().all(|(_, _, l)| l.0.same_device(gpu))) {
                // landed in device memory as it arrived (a streamed handoff's pieces each at its
                // blocks): unpacked once the landing's copies are done (this stream waits for
                // them on the GPU)
                let landed: usize = parts.iter().map(|(_, _, Landed(l))| l.floats).sum();
                let blocks: usize = parts.iter().map(|(_, n, _)| n).sum();
                if landed != floats || blocks != import.blocks.len() {
                    return Err(bad(format!(
                        "{landed} KV floats in {blocks} blocks for {} of {fpb}",
                        import.blocks.len()
                    )));
                }
                for (first, n, Landed(part)) in parts.into_iter().filter(|(_, n, _)| *n > 0) {
                    gpu.stream_waits_for(&part.event).map_err(fail)?;
                    let list = block_lists[i] + (first * std::mem::size_of::<u32>()) as u64;
                    self.kv.kv.unpack(gpu, part.ptr(), list, n).map_err(fail)?;
                }
                self.imported_on_device += 1;
                imports.push((import.clone(), None));
                continue;
            }
            let kv = h.kv_floats();
            if kv.len() != floats {
                return Err(bad(format!("{} KV floats for {} blocks of {fpb}", kv.len(), import.blocks.len())));
            }
            let mut staged = self.pinned_floats.take(gpu, floats).map_err(fail)?;
            staged.as_mut_slice()[..floats].copy_from_slice(&kv);
            let packed = gpu.scratch::<f32>(floats).map_err(fail)?;
            gpu.copy_to_device(packed.ptr(), &staged, floats).map_err(fail)?;
            self.kv.kv.unpack(gpu, packed.ptr(), block_lists[i], import.blocks.len()).map_err(fail)?;
            self.imported_through_host += 1;
            imports.push((import.clone(), Some(staged)));
        }
        Ok((imports, states_in))
    }

    /// Exports marked `at_launch` (a streamed piece) leave as their step is enqueued: each names
    /// its blocks in place with the marks of the KV layers the forward writes, so the link reads
    /// layer `l` once it is written, while the later layers compute. (The completion still lists
    /// them; the rank sends each once.)
    pub(super) fn hand_out_at_launch(&mut self, asked: &[KvExport], exported: &[Exported], marks: Arc<LayerMarks>) {
        for (i, (a, e)) in asked.iter().zip(exported).enumerate().filter(|(_, (a, _))| a.at_launch) {
            let mut early = e.clone();
            if let Some(source) = early.source.as_mut() {
                source.marks = Some(marks.clone());
            }
            debug_assert!(a.slot.is_none(), "a piece carries no state");
            self.launched_exports.push((i, early));
        }
    }

    /// 5. Exports: the blocks, read in place once this step has completed (the producer holds
    ///    them until the consumer's ack), and each export's state slot as this step leaves it (the
    ///    state at the prompt boundary), copied out in stream order after the forward; the record
    ///    holds the copy until completion.
    #[allow(clippy::type_complexity)]
    pub(super) fn export_handoffs(
        &mut self,
        gpu: &Gpu,
        asked: &[KvExport],
    ) -> Result<(Vec<Exported>, Vec<(usize, usize, PinnedBuf<f32>)>), ExecutorError> {
        let fpb = self.kv.kv.floats_per_block();
        let mut exports = Vec::new();
        let mut states_out = Vec::new();
        for e in asked {
            if let Some(slot) = e.slot {
                let state = self.state.as_ref().ok_or_else(|| {
                    ExecutorError::Launch("a slot export from a model that keeps no recurrent state".into())
                })?;
                let mut out = self.pinned_floats.take(gpu, state.width).map_err(fail)?;
                state.copy_out(gpu, slot, &mut out).map_err(fail)?;
                states_out.push((exports.len(), state.width, out));
            }
            exports.push(Exported {
                key: e.key,
                kv: Vec::new(),
                source: Some(KvSource {
                    store: BlockStore::Device(self.kv.clone()),
                    blocks: e.blocks.clone(),
                    floats_per_block: fpb,
                    marks: None,
                }),
                state: None,
                simulated: None,
            });
        }
        Ok((exports, states_out))
    }
}
