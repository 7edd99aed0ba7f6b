//! A rank's side of the offload tier (DESIGN §9), saves: which prompt chunks a step completes and
//! saves, the blocks each save holds until its completion record returns them, and the figures.
//! (Loads are in `load.rs`.)
//!
//! Save fencing (DESIGN §5): a save is asked for with the step that completes its chunk (an
//! export after that step's forward, in launch order) and its blocks are pinned under the save's
//! id at launch. Its job is made only when that step's completion is applied, reaches the `save`
//! operator on `verify`'s *saved* output, and is read in place by the rank's save thread; the
//! blocks return to the pool only when the save's completion record comes back. One save is in
//! the thread per request (its later jobs wait behind it, pinned); a chunk is saved once by this
//! rank (whichever request filled it first), and not at all when the store already holds it
//! (the save thread asks, off the step path). At most `max_pending_saves` saves are in flight on
//! a rank; a chunk completed beyond them is not saved, and counted. When the store loses what it
//! held (its generation moves on: a restart, a flush), the rank forgets which chunks it saved.

use super::offload_state::Launched;
use super::Rank;
use crate::offload::{ChunkKey, SaveDone, SaveJob, SaveOutcome, SavePayload};
use crate::policy::kv_index::OFFLOAD;
use crate::policy::scheduler::Chunk;
use crate::step::{Exported, KvExport};
use std::collections::VecDeque;

/// Dropped saves a rank logs one by one; the rest are counted (see `Rank::note_dropped_save`).
pub(super) const LOGGED_DROPPED_SAVES: u64 = 3;

impl Rank {
    /// The saves of step `t`: one per prompt chunk a prefill chunk of the step completes that
    /// this rank has not saved (write-through: whichever request fills a chunk first saves it) —
    /// for families with state, only a chunk that ends exactly where the step ends (the state
    /// the object carries; chunks end at snapshot boundaries, where prefill chunks stop). Their
    /// blocks are pinned under each save's id.
    pub(super) fn offload_saves(&mut self, t: u64, chunks: &[Chunk]) -> Vec<KvExport> {
        let Some(off) = self.offload.as_mut() else { return Vec::new() };
        let layout = self.memory.layout;
        let (bs, c_tokens) = (layout.block_size, off.setup.chunk_tokens);
        let generation = off.setup.store.generation();
        if generation != off.store_generation {
            off.known.clear();
            off.store_generation = generation;
        }
        let mut saves = Vec::new();
        for c in chunks.iter().filter(|c| c.prefill) {
            let seq = self.seqs.get(c.seq);
            let end = (c.start + c.len).min(seq.prompt_len);
            for k in c.start / c_tokens..end / c_tokens {
                // chunk k ends in this step
                if layout.keeps_state && (k + 1) * c_tokens != end {
                    continue;
                }
                let Some(&digest) = seq.offload.chunk_digests.get(k) else { continue };
                if off.known.contains(&digest) {
                    continue;
                }
                if off.launched.len() + off.writing.len() >= off.setup.max_pending_saves {
                    // Bounded: the chunk is not saved now (a later prompt holding it may save it).
                    off.stats.pending_limit_saves += 1;
                    continue;
                }
                off.known.insert(digest);
                let hashes = seq.prompt_hashes.get(k * c_tokens / bs..(k + 1) * c_tokens / bs);
                let hashes = hashes.map(<[u64]>::to_vec).unwrap_or_default();
                let key = off.key(digest);
                let blocks = if layout.keeps_kv {
                    seq.blocks.blocks()[k * c_tokens / bs..(k + 1) * c_tokens / bs].to_vec()
                } else {
                    Vec::new() // a family with state only: the object is the state at the chunk's end
                };
                let id = off.next_id;
                off.next_id += 1;
                self.memory.pin_for_save(id, &blocks);
                off.launched.push(Launched { step: t, id, seq: c.key, request: seq.id, key, hashes });
                let slot = if layout.keeps_state { seq.slot } else { None };
                saves.push(KvExport { key: c.key, blocks, slot, copy_out: false, at_launch: false });
            }
        }
        saves
    }

    /// Step `step` completed (`ok`: its forward ran) with `saved`, what its save exports copied
    /// out, in launch order: each becomes a job for the `save` operator, or — when the step
    /// failed or the executor exported nothing — a dropped save whose blocks return now.
    pub(super) fn offload_completed(&mut self, step: u64, ok: bool, saved: Vec<Exported>) {
        let Some(off) = self.offload.as_mut() else { return };
        let (mine, rest): (Vec<Launched>, Vec<Launched>) = off.launched.drain(..).partition(|l| l.step == step);
        off.launched = rest;
        let mut saved = saved.into_iter();
        for l in mine {
            let off = self.offload.as_mut().expect("checked above");
            let export = if ok { saved.next() } else { None };
            let payload = export.and_then(|e| match (e.source, e.simulated) {
                (Some(source), _) => Some(SavePayload::Blocks { source, state: e.state }),
                // a simulated step's chunk: the bytes its object would have (f32, as stored)
                (None, Some(_)) => Some(SavePayload::Sized(off.setup.chunk_object_bytes())),
                (None, None) => None,
            });
            match payload {
                Some(payload) => {
                    off.writing.insert(l.id, (l.request, l.key.digest));
                    off.ready.push(SaveJob { id: l.id, key: l.key, payload, hashes: l.hashes });
                }
                None => {
                    off.known.remove(&l.key.digest);
                    self.memory.release_save(l.id);
                    self.note_dropped_save(|| format!("step {step} gave no copy of {} (seq {})", l.key, l.seq));
                }
            }
        }
    }

    /// Jobs for the `save` operator.
    pub fn take_save_jobs(&mut self) -> Vec<SaveJob> {
        self.offload.as_mut().map(|o| std::mem::take(&mut o.ready)).unwrap_or_default()
    }

    /// The `save` operator hands the jobs of a completed step to the save thread — one save in
    /// flight per request: a request's later jobs wait, their blocks pinned, until the one
    /// before returns.
    pub fn submit_saves(&mut self, jobs: Vec<SaveJob>) {
        let release_early = self.switches.release_saves_early;
        for job in jobs {
            if release_early {
                // Test switch: the blocks go back before the save has read them.
                self.memory.release_save(job.id);
            }
            let Some(off) = self.offload.as_mut() else { return };
            let Some(&(request, _)) = off.writing.get(&job.id) else { continue };
            if off.busy.insert(request) {
                self.send_save(request, job);
            } else {
                off.queued.entry(request).or_default().push_back(job);
            }
        }
    }

    /// Hands request `request`'s job to the save thread (the request is busy until it returns);
    /// if the thread is gone the save is dropped, and the request's next job goes instead.
    fn send_save(&mut self, request: u64, job: SaveJob) {
        if self.offload.is_none() {
            return;
        }
        let mut next = Some(job);
        while let Some(job) = next.take() {
            let off = self.offload.as_mut().expect("checked above");
            let id = job.id;
            let key = job.key;
            if off.saver.submit(job) {
                return;
            }
            if let Some((_, digest)) = off.writing.remove(&id) {
                off.known.remove(&digest);
            }
            self.memory.release_save(id);
            self.note_dropped_save(|| format!("save of {key} dropped: the save thread is gone"));
            let off = self.offload.as_mut().expect("checked above");
            next = off.queued.get_mut(&request).and_then(VecDeque::pop_front);
        }
        let off = self.offload.as_mut().expect("checked above");
        off.queued.remove(&request);
        off.busy.remove(&request);
    }

    /// Applies the save thread's completion records: each returns its save's blocks, and sends
    /// its request's next job.
    pub(super) fn apply_saves(&mut self) -> usize {
        let Some(off) = self.offload.as_mut() else { return 0 };
        let done: Vec<SaveDone> = off.saver.returns.take();
        for d in &done {
            let Some(off) = self.offload.as_mut() else { break };
            let Some((request, digest)) = off.writing.remove(&d.id) else {
                tracing::error!(pool = %self.pool, rank = self.index, "offload: a completion for save {} it does not await", d.id);
                continue;
            };
            let stored = !matches!(d.outcome, SaveOutcome::Dropped { .. });
            if self.cache_reports.is_some() && stored && !off.reported.contains_key(&d.key) {
                // the store holds the chunk now: the routing index hears of it as the offload tier
                // (unless it heard already, from the store's log of publications)
                self.memory.prefix.note_tier(OFFLOAD, &d.hashes, true);
                off.reported.insert(d.key, d.hashes.clone());
            }
            match &d.outcome {
                SaveOutcome::Stored { bytes, seconds } => {
                    off.stats.saved_chunks += 1;
                    off.stats.saved_bytes += bytes;
                    off.stats.save_seconds += seconds;
                }
                SaveOutcome::Found => off.stats.found_in_store += 1,
                SaveOutcome::Dropped { why } => {
                    off.known.remove(&digest);
                    self.note_dropped_save(|| format!("save of {} dropped: {why}", d.key));
                }
            }
            self.memory.release_save(d.id);
            let off = self.offload.as_mut().expect("checked above");
            match off.queued.get_mut(&request).and_then(VecDeque::pop_front) {
                Some(next) => self.send_save(request, next),
                None => {
                    off.queued.remove(&request);
                    off.busy.remove(&request);
                }
            }
        }
        done.len()
    }

    /// Counts a dropped save (the report's `dropped_saves`) and logs `what` for only the first
    /// [`LOGGED_DROPPED_SAVES`] of the rank: a store that refuses every save would otherwise
    /// print a line per chunk. The rest are counted, and the count is logged at the end of the
    /// run ([`Self::log_dropped_saves`]).
    fn note_dropped_save(&mut self, what: impl FnOnce() -> String) {
        let Some(off) = self.offload.as_mut() else { return };
        off.stats.dropped_saves += 1;
        let dropped = off.stats.dropped_saves;
        if dropped <= LOGGED_DROPPED_SAVES {
            tracing::warn!(pool = %self.pool, rank = self.index, "offload: {}", what());
        }
        if dropped == LOGGED_DROPPED_SAVES {
            tracing::warn!(
                pool = %self.pool,
                rank = self.index,
                "offload: further dropped saves on this rank are counted, not logged; the count comes at the end of the run"
            );
        }
    }

    /// End of run: how many saves this rank dropped in all, when more than were logged.
    pub(super) fn log_dropped_saves(&self) {
        let dropped = self.offload.as_ref().map_or(0, |o| o.stats.dropped_saves);
        if dropped > LOGGED_DROPPED_SAVES {
            tracing::warn!(
                pool = %self.pool,
                rank = self.index,
                "offload: {dropped} saves dropped on this rank in all (the first {LOGGED_DROPPED_SAVES} logged)"
            );
        }
    }

    /// Reports to the routing index what changed in the store: the chunks of its layout that
    /// other processes published (a shared store's log), and those it reported that the store
    /// has since evicted. It reads both logs from where it last stopped (work in proportion to
    /// the changes, not to what it reported), and scans only if the eviction log no longer
    /// reaches back.
    pub(super) fn report_offload_tier(&mut self) {
        let Some(off) = self.offload.as_mut() else { return };
        let (end, published) = off.setup.store.published_since(off.publications_seen);
        off.publications_seen = end;
        for (key, hashes) in published.unwrap_or_default() {
            if key.namespace == off.setup.namespace && !off.reported.contains_key(&key) {
                self.memory.prefix.note_tier(OFFLOAD, &hashes, true);
                off.reported.insert(key, hashes);
            }
        }
        let store = off.setup.store.clone();
        let (end, evicted) = store.evicted_since(off.evictions_seen);
        if end == off.evictions_seen {
            return;
        }
        off.evictions_seen = end;
        let gone: Vec<ChunkKey> = match evicted {
            // a key evicted and stored again since is still held
            Some(keys) => keys.into_iter().filter(|k| off.reported.contains_key(k) && !store.contains(k)).collect(),
            None => off.reported.keys().filter(|k| !store.contains(k)).copied().collect(),
        };
        for key in gone {
            if let Some(hashes) = off.reported.remove(&key) {
                self.memory.prefix.note_tier(OFFLOAD, &hashes, false);
            }
        }
    }
}
