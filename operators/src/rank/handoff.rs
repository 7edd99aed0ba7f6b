//! A rank's side of P/D handoffs (DESIGN §2, §8). Which side of a handoff a request is, if any
//! ([`RequestKind`]), is decided once, when the rank admits it (`sequence_for`); a request served
//! whole never reaches the code here.
//!
//! On a prefill pool (the producer): a request admitted `PrefillOnly` samples T0 only; the step
//! that reaches its prompt boundary copies its state slot (read then — the state before T0) and
//! its KV blocks (a cuda rank names them in place); when T0 arrives the handoff is built and sent (with the drafts
//! its drafter made from T0), and the request stays held, blocks and slot with it, until the
//! consumer's ack for that transfer comes back (producer frees after ack). In a process of a
//! prefill pool spread over processes, the remote decode pool's events for the rank's requests
//! come back through its `EventRelay` queue: drained in `poll` (never waited on), emitted at that
//! step, and the request counted in flight until its end came back.
//!
//! On a decode pool (the consumer): a `Handoff` admission takes its handoff from the pool's inbox
//! and continues from T0, its first decode input (with the producer's drafts after it); the rank
//! holds the handoff (`HandoffIn::imports`) until the step that feeds T0 writes it in.

use super::handoff_state::{HandoffIn, HandoffOut, Relayed};
use super::Rank;
use crate::messages::{wall_ms, Admission, AdmissionKind, Event};
use crate::policy::sequence::{ConsumerState, ProducerState, RequestKind, Sequence};
use crate::step::SeqKey;
use crate::transfer::{AckQueue, EventRelay, Handoff, HandoffInbox, HandoffSink, SimulatedPayload, Taken, TransferId};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

impl Rank {
    /// Makes this rank a producer: finished prefills go to `sink`.
    pub fn with_handoff_out(mut self, sink: Arc<dyn HandoffSink>, fingerprint: u64, queue: Arc<AtomicUsize>) -> Self {
        let acks = AckQueue::new(self.waker.clone());
        self.handoff_out = Some(HandoffOut::new(sink, fingerprint, acks, queue));
        self
    }

    /// Floats of one block in each layer (what a streamed piece is packed by).
    pub fn with_kv_layers(mut self, kv_layers: &[usize]) -> Self {
        if let Some(out) = self.handoff_out.as_mut() {
            out.kv_layers = kv_layers.to_vec();
        }
        self
    }

    /// The decode pool's events for this rank's requests come back through `relay` (a prefill
    /// pool spread over processes): the rank emits them, and stays in flight until each
    /// request's end has come.
    pub fn with_event_relay(mut self, relay: Arc<EventRelay>) -> Self {
        let queue = EventRelay::queue(self.waker.clone());
        if let Some(out) = self.handoff_out.as_mut() {
            out.relayed = Some(Relayed { relay, queue, awaited: HashSet::new() });
        }
        self
    }

    /// Handed-off requests whose end has not come back through the relay.
    pub fn awaiting_ends(&self) -> usize {
        self.handoff_out.as_ref().and_then(|o| o.relayed.as_ref()).map_or(0, |r| r.awaited.len())
    }

    /// Emits the events relayed since the last call (at this step); an end settles what the
    /// rank awaited.
    pub(super) fn apply_relayed(&mut self) {
        let Some(relayed) = self.handoff_out.as_mut().and_then(|o| o.relayed.as_mut()) else { return };
        for event in relayed.queue.drain() {
            if matches!(event, Event::Finished { .. } | Event::Failed { .. }) {
                relayed.awaited.remove(&event.id());
            }
            self.stats.relayed_events += 1;
            self.events.push((self.step, event));
        }
    }

    /// Nothing more comes back for request `id` (refused, cancelled, or never sent).
    fn stop_awaiting(&mut self, id: u64) {
        if let Some(relayed) = self.handoff_out.as_mut().and_then(|o| o.relayed.as_mut()) {
            relayed.awaited.remove(&id);
            relayed.relay.forget(id);
        }
    }

    /// Makes this rank a consumer: handoff admissions are taken from `inbox`.
    pub fn with_handoff_in(mut self, inbox: Arc<HandoffInbox>) -> Self {
        self.handoff_in = Some(HandoffIn { inbox, imports: HashMap::new() });
        self
    }

    /// Handed-off requests whose ack has not come.
    pub fn awaiting_acks(&self) -> usize {
        self.handoff_out.as_ref().map_or(0, |o| o.awaiting.len())
    }

    /// A new sequence for admission `a`, picking tokens as it asks: a prefill pool's samples T0
    /// only.
    pub(super) fn new_sequence(&mut self, a: Admission) -> Option<Sequence> {
        let (sampling, delivery) = (a.sampling, a.delivery.clone());
        let mut seq = self.sequence_for(a)?;
        seq.sampling = sampling;
        seq.stream.delivery = delivery;
        // A handoff's T0 leaves again with its first decode tokens: the prefill rank streamed it
        // too, but that pool's event may come later than this one's (a reader orders by offset).
        seq.stream.streamed = 0;
        Some(seq)
    }

    /// The one place a request's kind is decided ([`RequestKind`]), from its admission's: served
    /// whole (an aggregated pool's, or a decode rank's that prefills it itself), the producer's
    /// side of a handoff (a prefill pool's: it samples T0 only), or the consumer's (it arrived
    /// as a handoff). `None`: it runs nowhere here (sent to a prefill pool, or failed).
    fn sequence_for(&mut self, a: Admission) -> Option<Sequence> {
        match a.kind {
            AdmissionKind::Whole => Some(Sequence::new(a.id, a.prompt, a.max_output_tokens, a.warmup)),
            AdmissionKind::Decide => self.decide(a),
            AdmissionKind::PrefillOnly { back_to } => {
                // T0 only (test switch: one more, so the state it exports has taken T0 in).
                let outputs = if self.switches.export_state_after_t0 { 2 } else { 1 };
                let mut seq = Sequence::new(a.id, a.prompt, outputs, a.warmup);
                seq.kind = RequestKind::Producer(ProducerState {
                    handoff_outputs: a.max_output_tokens,
                    back_to,
                    in_prefill_queue: back_to.is_some(),
                    ..ProducerState::default()
                });
                Some(seq)
            }
            AdmissionKind::Handoff { .. } => self.take_handoff(a),
        }
    }

    /// Test switch `prefill_drops_silently`: a prefill rank ends request `index` (just queued)
    /// with an event to the collector but without the abort that would tell the decode rank that
    /// sent it, as a rank that lost it would. Returns whether it did.
    pub(super) fn drops_prefill_silently(&mut self, index: usize) -> bool {
        let seq = self.seqs.get(index);
        if !seq.kind.is_producer() || self.switches.prefill_drops_silently != Some(seq.id) {
            return false;
        }
        let mut seq = self.seqs.remove(index);
        self.memory.release(&mut seq);
        self.fail_admission(seq.id, "dropped", "dropped by test switch prefill-drops-silently".into());
        true
    }

    /// A handoff admission: takes its handoff from the inbox and continues from T0 (the
    /// consumer's side), or fails it (missing, refused, cancelled while in transfer).
    fn take_handoff(&mut self, a: Admission) -> Option<Sequence> {
        let cancelled = self.remote_prefill.as_mut().is_some_and(|r| r.arrived(a.id));
        let taken = self.handoff_in.as_ref().map_or(Taken::Missing, |i| i.inbox.take(a.id));
        let h = match taken {
            Taken::Handoff(h) => h,
            // Cancelled while in transfer: the producer reported it, and the abort answered the
            // transfer. The prefix blocks this rank kept for it go back (a cancel that came
            // through `cancel_remote_prefill` gave them back already: then there are none).
            Taken::Aborted => {
                self.give_back_reserved(a.id);
                return None;
            }
            Taken::Missing => {
                self.give_back_reserved(a.id);
                self.fail_admission(a.id, "handoff-missing", "admitted as a handoff, but no handoff arrived".into());
                return None;
            }
        };
        if self.memory.layout.keeps_state != h.carries_state() {
            // All or nothing: KV without the recurrent state (or state this model does not keep)
            // is refused, never run on a zeroed half.
            let why = format!(
                "the handoff carries {} state slot, but this model {} one (all-or-nothing state)",
                if h.carries_state() { "a" } else { "no" },
                if self.memory.layout.keeps_state { "needs" } else { "has no" }
            );
            self.memory.release_reserved(a.id);
            self.fail_admission(a.id, "handoff", why);
            return None;
        }
        let reserved = self.memory.take_reserved(a.id);
        let kept = reserved.len();
        if cancelled || h.skip_blocks != kept {
            for b in reserved {
                self.memory.blocks.release(b);
            }
            if cancelled {
                // Cancelled while its remote prefill was out; taking it freed the producer.
                self.fail_admission(a.id, "cancelled", "cancelled while in transfer".into());
            } else {
                let why = format!(
                    "the handoff leaves out {} prompt block(s), but this rank kept {} for it",
                    h.skip_blocks, kept
                );
                self.fail_admission(a.id, "handoff", why);
            }
            return None;
        }
        self.stats.handoffs_in += 1;
        let (taken_ms, overlapped_ms) = (wall_ms(), h.overlapped_ms());
        self.events.push((self.step, Event::Received { id: a.id, rank: self.index, taken_ms, overlapped_ms }));
        let mut seq = Sequence::new(a.id, a.prompt, a.max_output_tokens, a.warmup);
        seq.stream.delivery = a.delivery; // T0 may be a stop token
                                          // Its leading blocks are the prefix this rank kept for it; the rest arrive.
        for b in reserved {
            seq.blocks.push(b);
        }
        seq.cached = kept * self.memory.layout.block_size;
        seq.first_cached = seq.cached;
        // T0 is known: it is the first decode input, fed once, at the prompt boundary.
        seq.tokens.push(h.t0);
        seq.spec.handed_drafts = h.drafts.clone();
        seq.computed = seq.prompt_len;
        seq.logits_hash = h.logits_hash;
        seq.stream.token_times.record(h.t0_ms);
        seq.started_ms = Some(h.started_ms);
        if seq.finished() {
            // T0 was its only output: it ends here, with nothing to compute.
            let event = Event::Finished {
                id: seq.id,
                rank: self.index,
                tokens: vec![h.t0],
                token_times: seq.stream.token_times,
                started_ms: h.started_ms,
                cached_tokens: 0,
                logits_hash: h.logits_hash,
                preemptions: 0,
            };
            self.events.push((self.step, event));
            self.memory.release(&mut seq); // the prefix blocks it kept
            return None;
        }
        seq.kind = RequestKind::Consumer(ConsumerState { awaits_import: true });
        if let Some(handoff_in) = self.handoff_in.as_mut() {
            handoff_in.imports.insert(a.id, h);
        }
        Some(seq)
    }

    /// Request `id`'s handoff will not come (aborted, or missing): the prefix blocks this rank
    /// kept for it go back, or they stay reserved for good, shrinking the rank's memory (test
    /// switch `handoff_keeps_reserved_prefix_on_abort` keeps them).
    fn give_back_reserved(&mut self, id: u64) {
        if !self.switches.handoff_keeps_reserved_prefix_on_abort {
            self.memory.release_reserved(id);
        }
    }

    /// The accounting check's part for reserved prefixes (DESIGN §7): a decode rank keeps
    /// prefix blocks only for a remote prefill it still awaits (reserved and awaited begin
    /// together in `decide`, and end together when the handoff is taken, found aborted or
    /// missing, or the request is cancelled). One line per request that keeps some without
    /// awaiting its handoff: nothing will ever give them back.
    pub(super) fn reserved_without_awaited_prefill(&self) -> Vec<String> {
        let awaited = |id: &u64| self.remote_prefill.as_ref().is_some_and(|r| r.awaiting.contains_key(id));
        self.memory
            .reserved_prefixes()
            .filter(|(id, _)| !awaited(id))
            .map(|(id, blocks)| {
                format!(
                    "request {id} keeps {} prefix block(s) {blocks:?} reserved, but this rank no longer awaits \
                     its handoff: leaked (nothing gives them back)",
                    blocks.len()
                )
            })
            .collect()
    }

    /// A prefill rank's request sampled T0: build its handoff from what the step exported, send
    /// it, and keep the request (and its memory) until the ack. Returns false when this rank
    /// hands nothing off (it is no prefill pool's).
    pub(super) fn hand_off(&mut self, index: usize, step: u64) -> bool {
        let Some(out) = self.handoff_out.as_mut() else { return false };
        let seq = self.seqs.get_mut(index);
        let Some(producer) = seq.kind.producer_mut() else { return false };
        let (outputs, back_to, t0_chain) = (producer.handoff_outputs, producer.back_to, producer.t0_chain);
        let key = seq.key;
        let exported = out.exported.remove(&key);
        let Some(exported) = exported else {
            let why = format!("step {step} sampled T0 but exported no KV for the handoff");
            self.fail(index, step, "handoff", why);
            return true;
        };
        // A streamed handoff is the transfer its first piece began (in the generation it has now).
        let stream = self.take_stream(self.seqs.get(index).id);
        let seq = self.seqs.get_mut(index);
        let Some(out) = self.handoff_out.as_mut() else { return false };
        let nonce = stream.as_ref().map_or(out.next_nonce, |s| s.transfer.nonce);
        out.next_nonce += u64::from(stream.is_none());
        let transfer = TransferId { nonce, generation: key.generation };
        let streamed = stream.map_or(Vec::new(), |s| s.sent);
        let sent_ahead = !streamed.is_empty();
        let streamed_blocks: usize = streamed.iter().map(|p| p.blocks).sum();
        let kv_blocks = seq.prompt_len.div_ceil(self.memory.layout.block_size);
        let kv_blocks = if self.memory.layout.keeps_kv { kv_blocks } else { 0 };
        let skip_blocks = back_to.map_or(0, |b| b.skip_tokens as usize / self.memory.layout.block_size).min(kv_blocks);
        let kv_blocks = kv_blocks - skip_blocks;
        let handoff = Handoff {
            transfer,
            request: seq.id,
            prompt: seq.tokens[..seq.prompt_len].to_vec(),
            max_output_tokens: outputs,
            warmup: seq.warmup,
            sampling: seq.sampling,
            delivery: seq.stream.delivery.clone(),
            drafts: std::mem::take(&mut seq.spec.handed_drafts),
            t0: seq.tokens[seq.prompt_len],
            logits_hash: t0_chain.unwrap_or(seq.logits_hash),
            fingerprint: out.fingerprint,
            block_size: self.memory.layout.block_size,
            skip_blocks,
            kv_blocks,
            floats_per_block: match (&exported.source, kv_blocks - streamed_blocks.min(kv_blocks)) {
                _ if !streamed.is_empty() || exported.simulated.is_some() => out.kv_layers.iter().sum(),
                (_, 0) => 0,
                (Some(source), _) => source.floats_per_block,
                (None, n) => exported.kv.len() / n,
            },
            streamed,
            kv: exported.kv,
            source: exported.source,
            landed: None,
            state: exported.state.filter(|_| !self.switches.handoff_without_state),
            started_ms: seq.started_ms.unwrap_or_else(wall_ms),
            t0_ms: seq.stream.token_times.first.unwrap_or_else(wall_ms),
            to: back_to,
            recycle: None,
            on_drop: Default::default(),
            simulated: exported.simulated.map(|s| SimulatedPayload {
                state_floats: if self.switches.handoff_without_state { 0 } else { s.state_floats },
            }),
        };
        let bytes = handoff.payload_bytes();
        self.stats.handoff_saved_bytes += 4 * (skip_blocks * handoff.floats_per_block) as u64;
        let (id, started_ms, t0_ms, preemptions) =
            (handoff.request, handoff.started_ms, handoff.t0_ms, seq.preemptions);
        if let Some(r) = out.relayed.as_mut() {
            // Before it is sent: its events cannot come back first.
            r.relay.expect(id, &r.queue);
            r.awaited.insert(id);
        }
        match out.sink.send(handoff, out.acks.clone()) {
            Ok(to) => {
                self.scheduler.forget(index);
                let producer = self.seqs.get_mut(index).kind.producer_mut().expect("checked above");
                producer.in_transfer = Some(transfer);
                if std::mem::take(&mut producer.in_prefill_queue) {
                    super::leave_queue(&out.queue);
                }
                out.awaiting.insert(nonce, key);
                if self.switches.free_before_ack {
                    self.release_handed_off(key); // test switch: the ack, when it comes, finds nothing
                }
                self.stats.handoffs_out += 1;
                self.stats.handoff_bytes += bytes;
                self.events
                    .push((step, Event::HandedOff { id, rank: self.index, to, started_ms, t0_ms, bytes, preemptions }));
            }
            Err(why) => {
                if sent_ahead {
                    out.sink.drop_pieces(id, transfer, back_to); // what the consumer staged goes
                }
                self.stop_awaiting(id);
                self.fail(index, step, "handoff", format!("cannot hand off: {why}"));
            }
        }
        true
    }

    /// Releases what each acked handoff's request held. An ack for a transfer this rank does
    /// not await (a duplicate, or for an older generation) is dropped and counted.
    pub(super) fn apply_acks(&mut self) {
        let Some(out) = self.handoff_out.as_ref() else { return };
        for (request, transfer, outcome) in out.acks.drain() {
            let awaiting = &mut self.handoff_out.as_mut().expect("checked above").awaiting;
            let Some(key) = awaiting.get(&transfer.nonce).copied().filter(|k| k.generation == transfer.generation)
            else {
                self.stats.stale_acks += 1;
                continue;
            };
            awaiting.remove(&transfer.nonce);
            let aborted = self.seqs.by_key_mut(key).and_then(|s| s.kind.producer()).is_some_and(|p| p.aborted);
            if outcome.is_err() {
                self.stop_awaiting(request);
            }
            match outcome {
                Ok(()) => self.release_handed_off(key),
                // Cancelled while in transfer: reported then; its memory goes now.
                Err(_) if aborted => self.release_handed_off(key),
                // The consumer refused it: the request fails here, naming why (its memory freed).
                Err(why) if self.seqs.by_key_mut(key).is_some() => self.fail(
                    key.index as usize,
                    self.step,
                    "handoff",
                    format!("the decode pool refused the handoff: {why}"),
                ),
                Err(_) => {}
            }
        }
    }

    /// A prefill pool's request `index` is cancelled. After its handoff was sent it is reported
    /// cancelled now, the consumer is asked to drop the transfer, and its memory stays held until
    /// that transfer's answer (the abort's ack) comes back — the producer frees after the ack.
    /// Returns whether it was in transfer (then the cancel is done: now, or before).
    pub(super) fn abort_in_transfer(&mut self, index: usize) -> bool {
        let seq = self.seqs.get_mut(index);
        let Some(producer) = seq.kind.producer_mut() else { return false };
        if producer.aborted {
            return true;
        }
        let Some(transfer) = producer.in_transfer else { return false };
        producer.aborted = true;
        let back_to = producer.back_to;
        let event = Event::Failed {
            id: seq.id,
            rank: self.index,
            cause: "cancelled".into(),
            message: "cancelled while in transfer".into(),
            tokens: seq.tokens[seq.prompt_len..].to_vec(),
            token_times: seq.stream.token_times,
            started_ms: seq.started_ms,
        };
        let id = seq.id;
        self.events.push((self.step, event));
        self.stop_awaiting(id); // reported here; what the decode pool says of it now is dropped
        if let Some(out) = &self.handoff_out {
            out.sink.abort(id, transfer, back_to);
        }
        true
    }

    /// A request of either side of a handoff ends here (failed, cancelled). A prefill pool's
    /// leaves the pool's queue and drops what its step exported, and a decode rank that asked
    /// for it hears of it (through the link's abort), so it stops waiting; a decode pool's drops
    /// the handoff it still held for its import.
    pub(super) fn handoff_ended(&mut self, seq: &mut Sequence) {
        match &mut seq.kind {
            RequestKind::Whole => {}
            RequestKind::Producer(producer) => {
                if producer.in_transfer.is_none() {
                    self.end_stream(seq.id, producer.back_to);
                }
                let Some(out) = self.handoff_out.as_mut() else { return };
                out.exported.remove(&seq.key);
                if std::mem::take(&mut producer.in_prefill_queue) {
                    super::leave_queue(&out.queue);
                }
                if let Some(back_to) = producer.back_to {
                    let transfer = producer.in_transfer.unwrap_or(TransferId { nonce: 0, generation: 0 });
                    out.sink.abort(seq.id, transfer, Some(back_to));
                }
            }
            RequestKind::Consumer(_) => self.drop_import(seq.id),
        }
    }

    /// The handoff held for request `id`'s import goes (the request ended, or its first launch
    /// took it).
    pub(super) fn take_import(&mut self, id: u64) -> Option<Arc<Handoff>> {
        self.handoff_in.as_mut().and_then(|h| h.imports.remove(&id))
    }

    fn drop_import(&mut self, id: u64) {
        drop(self.take_import(id));
    }

    /// A decode rank was asked to cancel a request it does not hold: a handoff of it waiting in
    /// the inbox (or still on its way) is dropped and answered as aborted.
    pub(super) fn abort_arriving(&mut self, id: u64) {
        if let Some(handoff_in) = &self.handoff_in {
            handoff_in.inbox.abort(id);
        }
    }

    fn release_handed_off(&mut self, key: SeqKey) {
        if self.seqs.by_key_mut(key).is_none() {
            return; // cancelled meanwhile: already released
        }
        let mut seq = self.seqs.remove(key.index as usize);
        self.memory.release(&mut seq);
    }

    /// Fails a request before it got a sequence.
    fn fail_admission(&mut self, id: u64, cause: &str, message: String) {
        let event = Event::Failed {
            id,
            rank: self.index,
            cause: cause.into(),
            message,
            tokens: Vec::new(),
            token_times: Default::default(),
            started_ms: None,
        };
        self.events.push((self.step, event));
    }
}
