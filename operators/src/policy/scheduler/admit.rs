//! Admissions: waiting requests start in arrival order while seats, the step's budget and memory
//! last. A request that can never fit the rank fails here; under `AdmissionPolicy::Reserve` one
//! starts only when the rank can hold it to its end. An admitted request gets its state slot,
//! reuses the longest cached prefix of its prompt (unless a handoff or a loaded prefix brings
//! its memory), and books its first chunk.

use super::{
    book, draft::draft_into, AdmissionPolicy, RankMemory, Scheduler, Sequence, Sequences, StateOp, StepDecision,
};
use kvflow_kernels::kv::SnapshotId;

impl Scheduler {
    /// Admits waiting requests, in arrival order, while seats, `budget` and memory last.
    pub(super) fn admit_waiting(
        &mut self,
        seqs: &mut Sequences,
        mem: &mut RankMemory,
        t: u64,
        budget: &mut usize,
        out: &mut StepDecision,
    ) {
        while self.running.len() < self.config.max_running && *budget > 0 {
            let Some(&index) = self.waiting.front() else { break };
            if let Some(reason) = never_fits(seqs.get(index), mem) {
                out.failed.push((seqs.get(index).id, reason));
                self.waiting.pop_front();
                seqs.remove(index);
                continue;
            }
            if !self.reserve_allows(index, seqs, mem) || !self.admit(index, seqs, mem, t, budget, out) {
                break;
            }
            self.waiting.pop_front();
            self.running.push(index);
        }
    }

    /// Under `AdmissionPolicy::Reserve`, whether the rank can hold request `index` to its end,
    /// the running requests' own ends counted first (always under `Optimistic`).
    fn reserve_allows(&self, index: usize, seqs: &Sequences, mem: &RankMemory) -> bool {
        if self.config.admission != AdmissionPolicy::Reserve {
            return true;
        }
        let promised: usize = self.running.iter().map(|&r| mem.blocks_to_end(seqs.get(r))).sum();
        mem.blocks_to_end(seqs.get(index)) + promised
            <= mem.blocks.num_free() + mem.prefix.evictable_blocks(&mem.blocks)
    }

    /// Starts request `index`: its slot, its prefix, blocks for its first chunk, and the chunk
    /// booked. Returns false, having given back what it took (a loaded prefix keeps its blocks),
    /// when a slot or the blocks are missing: admissions wait for the next step.
    fn admit(
        &mut self,
        index: usize,
        seqs: &mut Sequences,
        mem: &mut RankMemory,
        t: u64,
        budget: &mut usize,
        out: &mut StepDecision,
    ) -> bool {
        let seq = seqs.get_mut(index);
        if mem.layout.keeps_state {
            match mem.slots.allocate_for(seq.id) {
                Ok(slot) => seq.slot = Some(slot),
                Err(_) => return false, // every slot is held (or pinned by a step in flight)
            }
        }
        // (A handoff or a loaded prefix brings its prompt's memory; it looks nothing up.)
        let snapshot = if self.config.prefix_cache && !seq.brings_prefix() { restore_prefix(seq, mem) } else { None };
        let len = self.chunk_len(seq, *budget, mem.layout.block_size);
        if !mem.ensure_blocks(seq, seq.computed + len) {
            if seq.offload.restored.is_some() {
                // Keep the loaded prefix and its blocks; only the slot goes back.
                if let Some(slot) = seq.slot.take() {
                    mem.slots.release(slot);
                }
                return false;
            }
            mem.release(seq); // undo the prefix hit and the slot; try again next step
            if let Some(s) = snapshot {
                mem.snapshots.release(s);
            }
            return false;
        }
        if let Some(slot) = seq.slot {
            out.state_ops.push(match snapshot {
                Some(snapshot) => StateOp::Restore { snapshot, slot },
                None => StateOp::Zero { slot },
            });
        }
        out.restoring.extend(snapshot.map(|s| (s, mem.snapshots.generation(s))));
        out.admitted.push((seq.id, seq.cached));
        // A handed-off request's first decode: T0 and the producer's drafts.
        let len = match self.config.spec {
            Some(spec) if seq.kind.awaits_import() && len == 1 && *budget > 1 => {
                draft_into(seq, mem, spec, *budget - 1)
            }
            _ => len,
        };
        book(out, index, seq, len, t);
        *budget -= len;
        true
    }
}

/// Why a request can never run on this rank (its prompt and outputs need more KV blocks than
/// the rank has), if so.
fn never_fits(seq: &Sequence, mem: &RankMemory) -> Option<String> {
    let total = seq.prompt_len + seq.max_output_tokens;
    let needed = mem.blocks_for(total);
    (needed > mem.blocks.num_ids()).then(|| {
        format!(
            "needs {} KV blocks for {} tokens but the rank has {} (raise memory.budget_bytes)",
            needed,
            total,
            mem.blocks.num_ids()
        )
    })
}

/// Reuses the longest cached prefix of the prompt: shares its blocks and, for recurrent state,
/// returns the snapshot at its end with a reference taken (both or neither), leaving at least one
/// prompt token to compute.
fn restore_prefix(seq: &mut Sequence, mem: &mut RankMemory) -> Option<SnapshotId> {
    let bs = mem.layout.block_size;
    let usable = seq.prompt_hashes.len().min((seq.prompt_len - 1) / bs);
    let in_flight_from = mem.in_flight_from();
    let hit = mem.prefix.lookup(&seq.prompt_hashes[..usable], &mut mem.blocks, in_flight_from);
    if hit.matched == 0 {
        return None;
    }
    for b in hit.blocks {
        seq.blocks.push(b);
    }
    seq.computed = hit.matched * bs;
    seq.cached = seq.computed;
    let snapshot = hit.snapshot.filter(|_| seq.slot.is_some())?;
    mem.snapshots.share(snapshot);
    Some(snapshot)
}
