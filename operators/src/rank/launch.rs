//! `Rank::launch`: hands the decided batch to the executor, one phase at a time. The scheduler
//! already booked it (each sequence's `computed` moved on, a sampled token counts as in flight);
//! here, before any token of the step is known, the prompt blocks it completes are published in
//! the prefix cache and a snapshot is asked for at each boundary it reaches: the executor applies
//! the step's writes in launch order, so a later step that reads them runs after them. Handoffs
//! ride on the same order: an arrived one is imported before the step that feeds its T0, and a
//! prefill-only request's slot is copied out after the step that samples T0 (part of that step),
//! its blocks copied out too (a cuda rank names them in place) — the request holds them until the
//! consumer's ack. On a streaming link the earlier prompt chunks export the whole blocks they
//! complete as pieces (`stream`), and the export at T0 takes only the blocks after them.

use super::stats::StepEntry;
use super::{Rank, StepRecord};
use crate::messages::{wall_ms, Event};
use crate::policy::scheduler::snapshot_boundaries;
use crate::policy::scheduler::{Chunk, StepDecision};
use crate::policy::sequence::{RequestKind, Sequences};
use crate::step::{ImportFrom, KvExport, KvImport, SeqKey, SeqSource, SeqStep, StateOp, StepLaunch};
use kvflow_kernels::cpu::sampling::Sampler;
use std::collections::HashMap;

/// A decided batch as the executor sees it: each chunk with its sequence's tokens, blocks and
/// slot, read from the rank's state when the executor asks.
struct Batch<'a> {
    chunks: &'a [Chunk],
    seqs: &'a Sequences,
    /// Test switch: block tables replaced for some sequences.
    swapped: Option<&'a HashMap<usize, Vec<u32>>>,
}

impl SeqSource for Batch<'_> {
    fn len(&self) -> usize {
        self.chunks.len()
    }

    fn get(&self, i: usize) -> SeqStep<'_> {
        let c = &self.chunks[i];
        let s = self.seqs.get(c.seq);
        // With tokens in flight the chunk may start past the known ones (then it feeds only the
        // one it names; with a delay above 1 an older one may still be in flight too, its KV
        // already written).
        let known_end = c.start + c.len - c.drafts - usize::from(c.deferred.is_some());
        debug_assert!(
            known_end <= c.start || known_end <= s.tokens.len(),
            "a chunk feeds at most one token in flight, its last: {c:?}, {} tokens, {:?}, computed {}",
            s.tokens.len(),
            s.pending,
            s.computed
        );
        let known_end = known_end.min(s.tokens.len());
        SeqStep {
            key: c.key,
            known: &s.tokens[c.start.min(known_end)..known_end],
            deferred: c.deferred,
            drafts: if c.drafts > 0 { &s.spec.drafts } else { &[] },
            start_pos: c.start,
            block_table: self.swapped.and_then(|m| m.get(&c.seq)).map_or(s.blocks.blocks(), |t| &t[..]),
            slot: s.slot,
            prompt_len: s.prompt_len,
            sample: c.sample,
            sampler: Sampler::new(s.sampling, s.id),
            next_prompt_token: s.tokens.get(c.start + c.len).copied().filter(|_| c.start + c.len < s.prompt_len),
        }
    }
}

impl Rank {
    /// The handoff copies of a step: a prefill-only request's blocks and slot are exported after
    /// the step that samples its T0 (the state at the prompt boundary); an arrived handoff is
    /// imported before the step that feeds T0 — and only then: a request that had to start over
    /// recomputes instead.
    /// A streaming request's earlier chunks export their completed blocks as pieces (listed in
    /// `pieces`, by sequence) and its handoff's export takes the rest.
    fn handoff_ops(&mut self, chunks: &[Chunk], pieces: &mut Vec<SeqKey>) -> (Vec<KvImport>, Vec<KvExport>) {
        let (mut imports, mut exports) = (Vec::new(), Vec::new());
        let bs = self.memory.layout.block_size;
        for c in chunks {
            if let Some(piece) = self.piece_export(c) {
                if !piece.at_launch {
                    pieces.push(c.key);
                }
                exports.push(piece);
                if !c.sample {
                    continue;
                }
            }
            let ahead = self.exported_ahead(c);
            let seq = self.seqs.get_mut(c.seq);
            match &mut seq.kind {
                RequestKind::Whole => {}
                RequestKind::Producer(producer) => {
                    // The export follows the step that samples T0 — the prompt boundary (test
                    // switch: the step that feeds T0, so the state has taken it in).
                    let exports_here =
                        if self.switches.export_state_after_t0 { c.start == seq.prompt_len } else { c.sample };
                    if !exports_here {
                        continue;
                    }
                    let n = if self.memory.layout.keeps_kv { seq.prompt_len.div_ceil(bs) } else { 0 };
                    let n = n.min(seq.blocks.len());
                    // Blocks the decode rank already holds are not exported (prefix reuse), nor
                    // those sent ahead in pieces.
                    let skip = producer.back_to.map_or(0, |b| b.skip_tokens as usize / bs).min(n);
                    let blocks = seq.blocks.blocks()[(skip + ahead).min(n)..n].to_vec();
                    // The slot it holds now, read by this step (test switch: the one it was
                    // first admitted with, which a preemption may have given to another request).
                    let first = self.handoff_out.as_mut().and_then(|o| o.admission_slots.remove(&seq.id));
                    let slot = match first {
                        Some(first) if self.switches.export_admission_slot => Some(first),
                        _ => seq.slot,
                    };
                    // Copied out by the step (test switch: named in place, read through the cache).
                    let copy_out = !self.switches.read_handoffs_in_place;
                    exports.push(KvExport { key: c.key, blocks, slot, copy_out, at_launch: false });
                }
                RequestKind::Consumer(consumer) => {
                    if !std::mem::take(&mut consumer.awaits_import) {
                        continue;
                    }
                    let (id, start, prompt_len) = (seq.id, c.start, seq.prompt_len);
                    let Some(handoff) = self.take_import(id) else { continue };
                    let seq = self.seqs.get(c.seq);
                    let (skip, kv) = (handoff.skip_blocks, handoff.kv_blocks);
                    if start == prompt_len && skip + kv <= seq.blocks.len() {
                        let blocks = seq.blocks.blocks()[skip..skip + kv].to_vec();
                        let from = ImportFrom::Handoff(handoff);
                        imports.push(KvImport { key: c.key, blocks, slot: seq.slot, snapshot: None, from });
                        self.stats.spec.first_decodes += 1;
                        self.stats.spec.first_decode_drafts += c.drafts as u64;
                    }
                }
            }
        }
        (imports, exports)
    }

    /// Launches the batch decided for step `t` (a rank with nothing decided launches nothing; if
    /// it still has steps in flight it flushes its executor instead of running empty steps).
    pub fn launch(&mut self, t: u64) {
        if self.switches.stuck_in_forward == Some((self.index, self.stats.steps)) {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
        let mut decided = self.take_decided(t);
        self.stats.steps += 1;
        self.stats.step_times.record(wall_ms());
        self.stats.preemptions += decided.preempted.len() as u64;
        self.restart_streams(&decided.preempted);
        self.note_failures_and_admissions(t, &decided);
        if decided.is_empty() {
            self.stats.empty_steps += 1;
            decided.clear();
            self.decided = decided;
            self.flush();
            return;
        }
        self.sample_utilization(&decided.chunks);
        if let Some(off) = self.offload.as_mut().filter(|o| !o.loading.is_empty()) {
            off.stats.steps_during_loads += 1;
        }
        // 1. what the prompt chunks complete: prefix entries and snapshots
        let (after, mut published) = self.publish_prefixes(t, &decided.chunks);
        // 2. handoffs: exported after the step that samples T0 (a prefill pool), written in
        //    before the step that feeds it (a decode pool); prefixes loaded from the offload
        //    store written in (and published) before the step that admits them
        let mut pieces = Vec::new();
        let (mut imports, mut exports) = self.handoff_ops(&decided.chunks, &mut pieces);
        imports.extend(self.restore_imports(t, &decided.chunks, &mut published));
        // 3. offload saves: after the step's forward too, the handoffs' exports first
        let handoff_exports = exports.len();
        exports.extend(self.offload_saves(t, &decided.chunks));
        // 4. a verification that rejected drafts: the slot goes back to the state after the last
        //    token that held, before the sequence's next forward reads it
        for c in &decided.chunks {
            let seq = self.seqs.get_mut(c.seq);
            if let (Some(position), Some(slot)) = (seq.spec.rewind_to.take(), seq.slot) {
                decided.state_ops.push(StateOp::Rewind { slot, position });
            }
        }
        // 5. the launch the executor sees, read in place
        let swapped = self.swapped_tables(&decided.chunks);
        let batch = Batch { chunks: &decided.chunks, seqs: &self.seqs, swapped: swapped.as_ref() };
        let mut sampling = std::mem::take(&mut self.sampling);
        sampling.clear();
        sampling.extend(decided.chunks.iter().filter(|c| c.sample).map(|c| c.key));
        let launch = StepLaunch {
            step: t,
            before: &decided.state_ops,
            after: &after,
            applied_through: self.applied_through,
            sampling: &sampling,
            imports: &imports,
            exports: &exports,
            batch: &batch,
        };
        if let Some(log) = self.stats.steps_log.as_mut() {
            let shape = crate::sim::StepShape::of(&launch);
            log.push(StepEntry { step: t, launched_ms: wall_ms(), done_ms: None, shape });
        }
        for phase in 0..self.executor.phases() {
            self.executor.launch(&launch, phase);
        }
        // pieces that leave as their step launches (their completion lists them again)
        let mut sent_at_launch = Vec::new();
        let mut launched = Vec::new();
        self.executor.take_launched_exports(&mut launched);
        for (index, mut e) in launched {
            if self.switches.unmarked_pieces {
                e.source.iter_mut().for_each(|s| s.marks = None);
            }
            sent_at_launch.push(index);
            self.stats.pieces_at_launch += 1;
            self.send_piece(e);
        }
        let mut keys = self.spare_keys.pop().unwrap_or_default();
        keys.clear();
        keys.extend(decided.chunks.iter().map(|c| c.key));
        let restoring = std::mem::take(&mut decided.restoring);
        let mut record_sampling = self.spare_keys.pop().unwrap_or_default();
        record_sampling.clear();
        record_sampling.extend_from_slice(&sampling);
        self.sampling = sampling;
        self.in_flight.push_back(StepRecord {
            step: t,
            seqs: keys,
            sampling: record_sampling,
            restoring,
            published,
            handoff_exports,
            pieces,
            sent_at_launch,
            draft_from: decided.chunks.iter().filter(|c| c.drafter_successors).map(|c| c.key).collect(),
        });
        self.memory.steps_in_flight_from(self.oldest_in_flight());
        self.stats.launched_steps += 1;
        self.stats.forward_tokens += decided.chunks.iter().map(|c| c.len as u64).sum::<u64>();
        decided.clear(); // launched once; the buffers stay for the next step
        self.decided = decided;
    }

    /// The batch decided for step `t`: only a batch decided for `t` launches at `t`.
    fn take_decided(&mut self, t: u64) -> StepDecision {
        let mut decided = std::mem::take(&mut self.decided);
        if self.decided_for.take() != Some(t) {
            // Only a batch decided for `t` launches at `t` (schedule(t + 1) waits for
            // forward(t), so this does not happen; if it did, launching would run a later
            // step's batch early and twice).
            if !decided.is_empty() {
                tracing::error!(pool = %self.pool, rank = self.index, step = t, "no batch was decided for this step");
            }
            decided.clear();
        }
        decided
    }

    /// The step's requests that can never run here fail (an event each); the admitted ones
    /// note when they started, and what came from the prefix cache and the offload store.
    fn note_failures_and_admissions(&mut self, t: u64, decided: &StepDecision) {
        for (id, message) in decided.failed.iter().cloned() {
            let event = Event::Failed {
                id,
                rank: self.index,
                cause: "does-not-fit".into(),
                message,
                tokens: Vec::new(),
                token_times: Default::default(),
                started_ms: None,
            };
            self.events.push((t, event));
        }
        let now = wall_ms();
        for &(id, cached) in &decided.admitted {
            if let Some(seq) = self.seqs.index_of(id).map(|i| self.seqs.get_mut(i)) {
                if let Some(off) = self.offload.as_mut() {
                    let loaded = std::mem::take(&mut seq.offload.loaded_tokens);
                    off.stats.offload_hit_tokens += loaded as u64;
                    off.stats.hbm_hit_tokens += cached.saturating_sub(loaded) as u64;
                }
                if seq.started_ms.is_none() {
                    seq.started_ms = Some(now);
                    seq.first_cached = cached;
                    if let (true, Some(slot), Some(out)) =
                        (self.switches.export_admission_slot, seq.slot, self.handoff_out.as_mut())
                    {
                        out.admission_slots.insert(id, slot);
                    }
                }
            }
        }
    }

    /// What the step's prompt chunks complete, published in the prefix cache before any of its
    /// tokens is known: the full prompt blocks (and a handoff's blocks, written by its import at
    /// this step) and a snapshot at each boundary reached. Returns the snapshots to take after
    /// the forward, and the hashes published.
    fn publish_prefixes(&mut self, t: u64, chunks: &[Chunk]) -> (Vec<StateOp>, Vec<u64>) {
        let bs = self.memory.layout.block_size;
        let interval = self.scheduler.config.snapshot_interval_blocks;
        let caching = self.scheduler.config.prefix_cache;
        let mut after = Vec::new();
        let mut published = Vec::new();
        // A handoff's prompt blocks, written by its import at this step, are this rank's to
        // reuse too (decode-side prefix reuse: a later remote prefill need not send them).
        for chunk in chunks.iter().filter(|_| caching && self.memory.layout.keeps_kv) {
            let seq = self.seqs.get(chunk.seq);
            if !seq.kind.awaits_import() || chunk.start != seq.prompt_len {
                continue;
            }
            let full = (seq.prompt_len / bs).min(seq.prompt_hashes.len()).min(seq.blocks.len());
            for b in 0..full {
                let (h, block) = (seq.prompt_hashes[b], seq.blocks.blocks()[b]);
                self.memory.prefix.insert_block(h, Some(block), &mut self.memory.blocks, t);
                published.push(h);
            }
        }
        for chunk in chunks.iter().filter(|c| c.prefill && caching) {
            let seq = self.seqs.get(chunk.seq);
            let end = chunk.start + chunk.len;
            for b in chunk.start / bs..end.min(seq.prompt_len) / bs {
                let h = seq.prompt_hashes[b];
                let block = self.memory.layout.keeps_kv.then(|| seq.blocks.blocks()[b]);
                self.memory.prefix.insert_block(h, block, &mut self.memory.blocks, t);
                published.push(h);
            }
            let Some(slot) = seq.slot else { continue };
            if self.memory.layout.snapshots == 0 || !snapshot_boundaries(seq.prompt_len, bs, interval).contains(&end) {
                continue;
            }
            let h = seq.prompt_hashes[end / bs - 1];
            if let Some(snapshot) = self.memory.publish_snapshot(h, seq.id, t) {
                after.push(StateOp::Snapshot { slot, snapshot });
            }
        }
        (after, published)
    }

    /// Test switch: block tables with their first two entries swapped, for the decodes of the
    /// requests it names.
    fn swapped_tables(&self, chunks: &[Chunk]) -> Option<HashMap<usize, Vec<u32>>> {
        let every = self.switches.swap_block_table_every?;
        let swapped = chunks
            .iter()
            .filter_map(|c| {
                let s = self.seqs.get(c.seq);
                let decode = c.len == 1 && c.start >= s.prompt_len;
                (s.id.is_multiple_of(every) && decode && s.blocks.len() >= 3).then(|| {
                    let mut t = s.blocks.blocks().to_vec();
                    t.swap(0, 1);
                    (c.seq, t)
                })
            })
            .collect();
        Some(swapped)
    }

    fn sample_utilization(&mut self, chunks: &[Chunk]) {
        let used = |total: usize, free: usize| if total == 0 { 0.0 } else { (total - free) as f64 / total as f64 };
        let m = &self.memory;
        let s = &mut self.stats.utilization;
        s.kv.record(used(m.blocks.num_ids(), m.blocks.num_free()));
        s.slots.record(used(m.slots.num_ids(), m.slots.num_free()));
        s.snapshots.record(used(m.snapshots.num_ids(), m.snapshots.num_free()));
        s.batch_seqs.record(chunks.len() as f64);
        s.batch_tokens.record(chunks.iter().map(|c| c.len).sum::<usize>() as f64);
    }
}
