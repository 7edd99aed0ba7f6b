//! A rank's side of the offload tier (DESIGN §9), loads. A new request whose prompt the store
//! holds further than this rank's prefix cache does starts a load instead of queueing (the rank
//! asks the store's `contains` here, at admission): it takes references on the prefix blocks the
//! cache has, allocates blocks for the chunks to load, and waits in the `loading` stage (its
//! load named by an id and its sequence's generation) while the pool keeps stepping. The `load`
//! operator hands the job to the rank's load thread, which gets every chunk off the step path,
//! or fails the load. Its completion record, drained when the rank's waker fires, queues the
//! request — with the prefix as computed, or from scratch when the load failed (it recomputes).
//! The step that admits it writes the chunks into its blocks (and the last chunk's state into
//! its slot) before its forward.
//!
//! Guarantee carried: restored prefixes published (DESIGN §5) — that step also publishes the
//! restored blocks, and for recurrent families a snapshot of the restored state, in the prefix
//! cache, so the next request with the prefix hits in HBM; a load that failed publishes nothing.

use super::offload_state::{Loading, RankOffload};
use super::Rank;
use crate::offload::{chunk_digests, longest_prefix, ChunkKey, Digest, LoadDone, LoadJob, RestoredPrefix};
use crate::policy::memory::MemoryLayout;
use crate::policy::scheduler::Chunk;
use crate::policy::sequence::Sequence;
use crate::step::{ImportFrom, KvImport, SeqKey};
use std::sync::Arc;

impl RankOffload {
    /// The store's keys of a prompt's full chunks (chained digests).
    pub fn chunk_digests(&self, seq: &Sequence, layout: &MemoryLayout) -> Vec<Digest> {
        chunk_digests(&seq.tokens[..seq.prompt_len], self.setup.chunk_tokens, layout.prompt_seed(seq.prompt_len))
    }

    /// The key of one chunk (one shard until tensor or pipeline parallelism exists).
    pub(super) fn key(&self, digest: Digest) -> ChunkKey {
        ChunkKey { namespace: self.setup.namespace, shard: 0, shards: 1, digest }
    }
}

impl Rank {
    /// Whether the request in generation `key` waits for a load.
    pub(super) fn is_loading(&self, key: SeqKey) -> bool {
        self.offload.as_ref().is_some_and(|o| o.loading.values().any(|l| l.key == key))
    }

    /// Starts loading request `index`'s prefix when the store holds chunks past what this rank's
    /// prefix cache would give it (at least one prompt token is always left to compute). Returns
    /// whether it did; the request is then queued by the load's completion.
    pub(super) fn start_load(&mut self, index: usize) -> bool {
        let Some(off) = self.offload.as_mut() else { return false };
        let m = &mut self.memory;
        let seq = self.seqs.get_mut(index);
        let (bs, c) = (m.layout.block_size, off.setup.chunk_tokens);
        let most = ((seq.prompt_len - 1) / c).min(seq.offload.chunk_digests.len());
        if most == 0 || seq.brings_prefix() || m.blocks_for(seq.prompt_len + seq.max_output_tokens) > m.blocks.num_ids()
        {
            return false;
        }
        let caching = self.scheduler.config.prefix_cache;
        let in_flight_from = m.in_flight_from();
        let usable = seq.prompt_hashes.len().min((seq.prompt_len - 1) / bs);
        // What an admission would reuse from the cache now (for recurrent families, up to a
        // snapshot); the cache's blocks cover the chunks before `first`; the store must hold
        // chunks from there on.
        let hit = if caching { m.prefix.peek(&seq.prompt_hashes[..usable], in_flight_from) * bs } else { 0 };
        let mut kept = if caching {
            m.prefix.take_blocks(&seq.prompt_hashes[..most * c / bs], &mut m.blocks, in_flight_from)
        } else {
            Vec::new()
        };
        let first = kept.len() * bs / c;
        for b in kept.drain(first * c / bs..) {
            m.blocks.release(b);
        }
        let wanted: Vec<Vec<ChunkKey>> = (first..most).map(|k| vec![off.key(seq.offload.chunk_digests[k])]).collect();
        off.stats.store_lookups += 1;
        let held = longest_prefix(&*off.setup.store, &wanted);
        if held == 0 || (first + held) * c <= hit {
            for b in kept {
                m.blocks.release(b);
            }
            return false;
        }
        for b in kept {
            seq.blocks.push(b);
        }
        if !m.ensure_blocks(seq, (first + held) * c) {
            m.release(seq); // nothing ran on them: freed at once
            return false;
        }
        let keys: Vec<ChunkKey> = wanted.into_iter().take(held).flatten().collect();
        let id = off.next_id;
        off.next_id += 1;
        off.loading.insert(id, Loading { key: seq.key, first_chunk: first, chunks: held });
        off.load_jobs.push(LoadJob { id, keys });
        off.stats.loads += 1;
        true
    }

    /// Load jobs for the `load` operator.
    pub fn take_load_jobs(&mut self) -> Vec<LoadJob> {
        self.offload.as_mut().map(|o| std::mem::take(&mut o.load_jobs)).unwrap_or_default()
    }

    /// The `load` operator hands jobs to the load thread (if it is gone, the load fails at once
    /// and its request recomputes).
    pub fn submit_loads(&mut self, jobs: Vec<LoadJob>) {
        let Some(off) = self.offload.as_mut() else { return };
        for job in jobs {
            let id = job.id;
            if !off.loader.submit(job) {
                off.failed_now.push(LoadDone { id, outcome: Err("the load thread is gone".into()) });
            }
        }
    }

    /// Applies the load thread's completion records: each queues its request, its prefix
    /// restored (all of it) or, when the load failed, to recompute. A record for a request that
    /// went meanwhile (cancelled: its blocks went with it) is dropped and counted.
    pub(super) fn apply_loads(&mut self) -> usize {
        let Some(off) = self.offload.as_mut() else { return 0 };
        let mut done: Vec<LoadDone> = std::mem::take(&mut off.failed_now);
        done.extend(off.loader.returns.take());
        for d in &done {
            let Some(loading) = off.loading.remove(&d.id) else {
                tracing::error!(pool = %self.pool, rank = self.index, "offload: a completion for load {} it does not await", d.id);
                continue;
            };
            let Some(seq) = self.seqs.by_key_mut(loading.key) else {
                off.stats.stale_loads += 1;
                continue;
            };
            let c = off.setup.chunk_tokens;
            let outcome = d.outcome.clone().and_then(|loaded| {
                let (kv, state) = (off.setup.chunk_kv_floats, off.setup.state_floats);
                let fits = |o: &crate::offload::ChunkObject| {
                    o.kv.len() == kv
                        && o.state.as_ref().map_or(0, Vec::len) == state
                        && o.state.is_some() == (state > 0)
                };
                match loaded.objects.iter().position(|o| !loaded.sized && !fits(o)) {
                    Some(i) => {
                        Err(format!("chunk {i} does not have this layout's shape ({kv} KV and {state} state floats)"))
                    }
                    None => Ok(loaded),
                }
            });
            match outcome {
                Ok(loaded) => {
                    off.stats.loaded_chunks += loaded.objects.len() as u64;
                    off.stats.loaded_bytes += loaded.bytes;
                    off.stats.load_seconds += loaded.seconds;
                    let restored = RestoredPrefix {
                        first_chunk: loading.first_chunk,
                        chunk_tokens: c,
                        objects: loaded.objects.into_iter().map(Arc::new).collect(),
                    };
                    seq.computed = restored.end();
                    seq.cached = seq.computed;
                    seq.offload.loaded_tokens = loading.chunks * c;
                    seq.offload.restored = Some(restored);
                }
                Err(why) => {
                    tracing::warn!(pool = %self.pool, rank = self.index, "offload: loading request {}'s prefix failed ({why}); it recomputes", seq.id);
                    off.stats.failed_loads += 1;
                    self.memory.release(seq);
                }
            }
            self.scheduler.enqueue(loading.key.index as usize);
        }
        done.len()
    }

    /// The imports of step `t`: a request admitted with a loaded prefix has its chunks written
    /// into its blocks (the last one's state into its slot) before the forward — and only then:
    /// one that had to start over recomputes. The restored blocks are published in the prefix
    /// cache (with a snapshot of the restored state, for recurrent families) into `published`.
    pub(super) fn restore_imports(&mut self, t: u64, chunks: &[Chunk], published: &mut Vec<u64>) -> Vec<KvImport> {
        let mut imports = Vec::new();
        let publish = self.scheduler.config.prefix_cache && !self.switches.skip_publishing_restored;
        let layout = self.memory.layout;
        for c in chunks {
            let seq = self.seqs.get_mut(c.seq);
            if seq.offload.restored.as_ref().is_none_or(|r| r.end() != c.start) {
                continue;
            }
            let restored = seq.offload.restored.take().expect("checked above");
            let per_chunk = restored.chunk_tokens / layout.block_size;
            let end_blocks = restored.end() / layout.block_size;
            let last = restored.objects.len() - 1;
            let mut snapshot = None;
            if publish {
                // (The blocks before the first loaded chunk came from the cache: published.)
                for b in restored.first_chunk * per_chunk..end_blocks.min(seq.prompt_hashes.len()) {
                    let block = layout.keeps_kv.then(|| seq.blocks.blocks()[b]);
                    self.memory.prefix.insert_block(seq.prompt_hashes[b], block, &mut self.memory.blocks, t);
                    published.push(seq.prompt_hashes[b]);
                }
                if let (Some(_), Some(&h)) = (seq.slot, seq.prompt_hashes.get(end_blocks.wrapping_sub(1))) {
                    snapshot = self.memory.publish_snapshot(h, seq.id, t);
                }
            }
            for (k, object) in restored.objects.into_iter().enumerate() {
                let chunk = restored.first_chunk + k;
                let blocks = if layout.keeps_kv {
                    seq.blocks.blocks()[chunk * per_chunk..(chunk + 1) * per_chunk].to_vec()
                } else {
                    Vec::new()
                };
                // Every chunk's object carries the state at its end: the last one's is written.
                let (slot, snapshot) = if k == last { (seq.slot, snapshot) } else { (None, None) };
                let from = ImportFrom::Store { request: seq.id, object, writes_state: k == last };
                imports.push(KvImport { key: c.key, blocks, slot, snapshot, from });
            }
        }
        imports
    }
}
