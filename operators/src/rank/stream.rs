//! A prefill rank's streamed handoffs (DESIGN §8, `transfer::stream`). Time: a piece is
//! exported by the step that completes its blocks (launch `t`, copied out after that step's
//! forward) and sent when that step's completion is applied — while later chunks compute; the
//! handoff at T0 carries what is left. On an executor that exports at launch (cuda), a piece is
//! sent as its step launches, named in place with the marks of its KV layers: the link reads
//! each layer once the forward wrote it, while the later layers compute — and the step that
//! samples T0 sends its whole blocks that way too, so the handoff carries only the last, partial
//! block and the state. Guarantee: every block leaves exactly once, in order, as
//! part of the one transfer its request has (fixed at the first piece); pieces of a request
//! that will not hand off are dropped at the consumer; the request keeps its blocks until the
//! handoff's ack as before.

use super::handoff_state::StreamOut;
use super::Rank;
use crate::messages::wall_ms;
use crate::policy::scheduler::Chunk;
use crate::step::{Exported, KvExport};
use crate::transfer::{KvPiece, TransferId};

impl Rank {
    /// The export that sends prefill chunk `c`'s completed blocks ahead of its handoff, if its
    /// request streams (its link's `stream_min_tokens`, its prompt at least that long) and the
    /// chunk completes blocks not exported yet — the chunk that samples T0 too when the piece
    /// leaves as the step launches (layer by layer).
    pub(super) fn piece_export(&mut self, c: &Chunk) -> Option<KvExport> {
        let at_launch = self.executor.exports_at_launch() && !self.switches.pieces_at_completion;
        let (out, layout) = (self.handoff_out.as_mut()?, &self.memory.layout);
        let seq = self.seqs.get(c.seq);
        let producer = seq.kind.producer()?;
        let last_chunk_waits = c.sample && !at_launch;
        if !c.prefill
            || last_chunk_waits
            || !layout.keeps_kv
            || out.kv_layers.is_empty()
            || producer.in_transfer.is_some()
        {
            return None;
        }
        if !out.streams.contains_key(&seq.id) {
            let min = out.sink.stream_min_tokens(seq.id, producer.back_to)?;
            if seq.prompt_len < min.max(1) {
                return None;
            }
            let transfer = TransferId { nonce: out.next_nonce, generation: seq.key.generation };
            out.next_nonce += 1;
            let stream = StreamOut { transfer, exported_blocks: 0, launched: Default::default(), sent: Vec::new() };
            out.streams.insert(seq.id, stream);
        }
        let bs = layout.block_size;
        let n = seq.prompt_len.div_ceil(bs).min(seq.blocks.len());
        let skip = producer.back_to.map_or(0, |b| b.skip_tokens as usize / bs).min(n);
        // Whole blocks only: the block the chunk ends in is written on by the next chunk.
        let full = ((c.start + c.len).min(seq.prompt_len) / bs).min(n);
        let stream = out.streams.get_mut(&seq.id)?;
        let (from, to) = (stream.exported_blocks, full.saturating_sub(skip));
        if to <= from {
            return None;
        }
        stream.exported_blocks = to;
        stream.launched.push_back((from, to - from, c.key.generation));
        let blocks = seq.blocks.blocks()[skip + from..skip + to].to_vec();
        Some(KvExport { key: c.key, blocks, slot: None, copy_out: true, at_launch })
    }

    /// The first block (after those the consumer holds) that the handoff at T0 still exports.
    pub(super) fn exported_ahead(&self, c: &Chunk) -> usize {
        let streams = self.handoff_out.as_ref().map(|o| &o.streams);
        streams.and_then(|s| s.get(&self.seqs.get(c.seq).id)).map_or(0, |s| s.exported_blocks)
    }

    /// Whether request `id` has sent pieces of its handoff ahead.
    pub(super) fn streaming(&self, id: u64) -> bool {
        self.handoff_out.as_ref().and_then(|o| o.streams.get(&id)).is_some_and(|s| !s.sent.is_empty())
    }

    /// A step completed a piece it exported: it leaves now, over the link its handoff will take.
    /// A piece of a request that ended or was preempted meanwhile is dropped (its consumer was
    /// told; a preempted one streams again).
    pub(super) fn send_piece(&mut self, e: Exported) {
        let Some(out) = self.handoff_out.as_mut() else { return };
        let index = e.key.index as usize;
        let Some(seq) = self.seqs.held_at_mut(index) else { return };
        let id = seq.id;
        let Some(producer) = seq.kind.producer() else { return };
        let back_to = producer.back_to;
        let Some(stream) = out.streams.get_mut(&id) else { return };
        // Launched by this request in this generation (a preemption restarts the stream), in order.
        let Some(&(first_block, blocks, generation)) = stream.launched.front() else { return };
        if generation != e.key.generation {
            return; // another request's, which ended: its slot holds this one now
        }
        stream.launched.pop_front();
        // A cuda rank names its blocks in place: the link reads them, not this thread (the
        // request holds them until the ack; a preemption restarts the stream).
        let source = e.source.filter(|_| e.kv.is_empty());
        let per_block: usize = out.kv_layers.iter().sum();
        let piece = KvPiece {
            request: id,
            transfer: stream.transfer,
            first_block,
            blocks,
            layer_floats: out.kv_layers.clone(),
            kv: e.kv,
            source,
            landed: None,
            sent_ms: wall_ms(),
            arrived_ms: 0.0,
        };
        let sent = if piece.len() == blocks * per_block {
            out.sink.send_piece(piece, back_to)
        } else {
            Err(format!("a piece of {blocks} block(s) holds {} floats, {} expected", piece.len(), blocks * per_block))
        };
        match sent {
            Ok(piece) => {
                self.stats.pieces_out += 1;
                self.stats.streamed_bytes += piece.bytes();
                stream.sent.push(piece);
            }
            // (fail ends the stream: it drops what was sent)
            Err(why) => {
                let step = self.step;
                self.fail(index, step, "handoff", format!("cannot send a piece of the handoff ahead: {why}"));
            }
        }
    }

    /// Preempted requests that were streaming start their stream over (under a new transfer,
    /// from their first block): what they sent named blocks they no longer hold.
    pub(super) fn restart_streams(&mut self, preempted: &[u64]) {
        for &id in preempted {
            let back_to = self.seqs.index_of(id).and_then(|i| self.seqs.get(i).kind.producer()).and_then(|p| p.back_to);
            self.end_stream(id, back_to);
        }
    }

    /// Request `id`'s stream ends before its handoff leaves (it failed, was cancelled or
    /// preempted before T0): the consumer drops the pieces it staged.
    pub(super) fn end_stream(&mut self, id: u64, back_to: Option<crate::request::BackTo>) {
        let Some(out) = self.handoff_out.as_mut() else { return };
        let Some(stream) = out.streams.remove(&id) else { return };
        if !stream.sent.is_empty() {
            out.sink.drop_pieces(id, stream.transfer, back_to);
            self.stats.streams_dropped += 1;
        }
    }

    /// Request `id`'s stream, taken by its handoff at T0 (it carries the pieces sent).
    pub(super) fn take_stream(&mut self, id: u64) -> Option<StreamOut> {
        self.handoff_out.as_mut().and_then(|o| o.streams.remove(&id))
    }
}
