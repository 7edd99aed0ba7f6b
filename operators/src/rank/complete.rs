//! `Rank::poll`: applies the completions its executor has ready, in launch order. A completion
//! returns what its step's record pinned; each sampled token reaches its sequence only if that
//! sequence is still in the generation the step was launched for (else it is dropped and
//! counted: the request was preempted or cancelled meanwhile). A request whose last token
//! arrives ends here; a failed step fails the requests it fed. A verification's kept drafts count
//! as computed; the MTP drafter's proposal for the next step is kept on the sequence
//! (`Sequence::model_drafts`, a copy); a producer's request whose step sampled T0 with
//! "drafter needs successor tokens" set drafts from T0 for its handoff now. A streaming
//! request's new tokens leave as an event of the step that sampled them; a streamed handoff's
//! piece its step exported leaves over the link now (`stream`), never before its step completed.

use super::Rank;
use crate::messages::{wall_ms, Event};
use crate::policy::memory::Held;
use crate::step::StepCompletion;
use kvflow_kernels::hash;

impl Rank {
    /// Applies every completion the executor has ready; returns how many.
    pub fn poll(&mut self) -> usize {
        self.apply_acks();
        self.apply_relayed();
        self.apply_saves();
        self.apply_loads();
        let mut ready = std::mem::take(&mut self.completions);
        self.executor.poll(&mut ready);
        let n = ready.len();
        for c in ready.drain(..) {
            self.apply(c);
        }
        self.completions = ready;
        n
    }

    /// Asks the executor to complete what is in flight now and applies what it has ready; when
    /// something completed while the pool parks, raises the rank's waker so the pool resumes.
    pub fn flush(&mut self) {
        if self.in_flight.is_empty() {
            return;
        }
        self.executor.flush();
        if self.poll() > 0 {
            self.waker.wake();
        }
    }

    fn apply(&mut self, c: StepCompletion) {
        let Some(pos) = self.in_flight.iter().position(|r| r.step == c.step) else {
            self.stats.unknown_completions += 1;
            tracing::error!(pool = %self.pool, rank = self.index, step = c.step, "completion for a step not in flight: dropped");
            return;
        };
        if pos > 0 {
            tracing::error!(pool = %self.pool, rank = self.index, step = c.step, "completion out of launch order");
        }
        let record = self.in_flight.remove(pos).expect("found above");
        if let Some(entry) = self.stats.steps_log.iter_mut().flat_map(|l| l.iter_mut().rev()).find(|e| e.step == c.step)
        {
            entry.done_ms = Some(wall_ms());
        }
        self.memory.steps_in_flight_from(self.oldest_in_flight());
        for &(snapshot, generation) in &record.restoring {
            self.memory.release_held(Held::Snapshot, snapshot, generation);
        }
        self.applied_through = Some(self.applied_through.map_or(c.step, |a| a.max(c.step)));
        let mut exports = c.exports;
        let saved = exports.split_off(record.handoff_exports.min(exports.len()));
        self.offload_completed(c.step, c.result.is_ok(), saved);
        // Only a prefill pool's requests export for a handoff: pieces leave now, a handoff's
        // export waits for its T0.
        for (i, e) in exports.into_iter().enumerate() {
            if !c.result.is_ok() {
                break;
            } else if record.sent_at_launch.contains(&i) {
                continue;
            } else if record.pieces.contains(&e.key) {
                self.send_piece(e);
            } else if let Some(out) = self.handoff_out.as_mut() {
                out.exported.insert(e.key, e);
            }
        }
        let sampled = match c.result {
            Ok(sampled) => sampled,
            Err(e) => {
                let m = &mut self.memory;
                m.prefix.forget(&record.published, &mut m.blocks, &mut m.snapshots);
                for &key in &record.seqs {
                    if self.seqs.by_key_mut(key).is_some() {
                        self.fail(key.index as usize, c.step, "executor", format!("step {} failed: {e}", c.step));
                    }
                }
                self.spare_keys.push(record.seqs);
                return;
            }
        };
        self.spare_keys.push(record.seqs);
        if !c.failed.is_empty() {
            // What the step published may hold KV computed from a failed row's wrong hidden state.
            let m = &mut self.memory;
            m.prefix.forget(&record.published, &mut m.blocks, &mut m.snapshots);
        }
        for (key, why) in &c.failed {
            if self.seqs.by_key_mut(*key).is_some() {
                self.fail(key.index as usize, c.step, "expert-combine", why.clone());
            }
        }
        if sampled.len() != record.sampling.len() || sampled.iter().zip(&record.sampling).any(|(s, k)| s.seq != *k) {
            self.missing_samples(c.step, &record.sampling, &sampled);
        }
        self.spare_keys.push(record.sampling);
        let now = wall_ms();
        let check = !self.switches.accept_stale_completions;
        for mut s in sampled.into_iter().filter(|s| !c.failed.iter().any(|(k, _)| *k == s.seq)) {
            let held = if check { self.seqs.by_key_mut(s.seq) } else { self.seqs.held_at_mut(s.seq.index as usize) };
            let Some(seq) = held else {
                self.stats.stale_completions += 1;
                continue;
            };
            if !seq.pending.pop(c.step) && check {
                let message =
                    format!("step {} sampled a token the request was not waiting for ({:?})", c.step, seq.pending);
                self.fail(s.seq.index as usize, c.step, "executor", message);
                continue;
            }
            // The MTP drafter's proposal for the next step, made after this step's last token.
            seq.spec.model_drafts = std::mem::take(&mut s.drafts);
            // A verification (`verify`'s decision): the drafts that hold count as computed.
            let drafted = std::mem::take(&mut seq.spec.drafts).len();
            if drafted > 0 {
                self.verify_drafts(s.seq.index as usize, drafted, &s);
            }
            for (token, logits_hash) in s.verified() {
                let Some(token) = token else {
                    let message = format!(
                        "step {}: the logits it sampled from hold NaN or infinite values (the model's weights or \
                         config give non-finite numbers); no token was sampled",
                        c.step
                    );
                    self.fail(s.seq.index as usize, c.step, "non-finite-logits", message);
                    break;
                };
                let seq = self.seqs.get_mut(s.seq.index as usize);
                seq.tokens.push(token);
                seq.logits_hash = hash::chain_row(seq.logits_hash, logits_hash);
                if let (Some(producer), true) = (seq.kind.producer_mut(), seq.tokens.len() == seq.prompt_len + 1) {
                    producer.t0_chain = Some(seq.logits_hash);
                }
                seq.stream.token_times.record(now);
                if record.draft_from.contains(&s.seq) {
                    self.draft_from_successor(s.seq.index as usize);
                }
                if self.seqs.get(s.seq.index as usize).finished() {
                    self.finish(s.seq.index as usize, c.step);
                    break;
                }
            }
            self.stream_out(s.seq, c.step);
        }
    }

    /// A streaming request still held here (a prefill pool's, in transfer, too): its tokens
    /// sampled since it last streamed, as an event of this step.
    fn stream_out(&mut self, key: crate::step::SeqKey, step: u64) {
        let Some(seq) = self.seqs.by_key_mut(key).filter(|s| s.stream.delivery.stream) else { return };
        let outputs = &seq.tokens[seq.prompt_len..];
        if outputs.len() > seq.stream.streamed {
            let tokens = outputs[seq.stream.streamed..].to_vec();
            let event = Event::Tokens { id: seq.id, rank: self.index, offset: seq.stream.streamed, tokens };
            seq.stream.streamed = outputs.len();
            self.events.push((step, event));
        }
    }

    /// The executor broke its contract: step `step` was to sample `expected` (in batch order) but
    /// reported `got`. A request left without its token fails (it would wait for it forever).
    fn missing_samples(&mut self, step: u64, expected: &[crate::step::SeqKey], got: &[crate::step::Sampled]) {
        let reported: std::collections::HashSet<_> = got.iter().map(|s| s.seq).collect();
        for &key in expected.iter().filter(|k| !reported.contains(k)) {
            tracing::error!(pool = %self.pool, rank = self.index, step, seq = %key, "the executor reported no token for a sequence the step samples");
            if self.seqs.by_key_mut(key).is_some() {
                self.fail(key.index as usize, step, "executor", format!("step {step} completed without its token"));
            }
        }
    }

    /// A request produced its last token (on a prefill pool: T0, and it hands off).
    fn finish(&mut self, index: usize, step: u64) {
        if self.seqs.get(index).kind.is_producer() && self.hand_off(index, step) {
            return;
        }
        self.scheduler.forget(index);
        let mut seq = self.seqs.remove(index);
        if self.switches.leak_blocks_of == Some(seq.id) {
            let _forgotten = seq.blocks.take(); // test switch: a release that never happens
        }
        self.memory.release(&mut seq);
        let event = Event::Finished {
            id: seq.id,
            rank: self.index,
            tokens: seq.tokens.split_off(seq.prompt_len),
            token_times: seq.stream.token_times,
            started_ms: seq.started_ms.unwrap_or_else(wall_ms),
            cached_tokens: seq.first_cached,
            logits_hash: seq.logits_hash,
            preemptions: seq.preemptions,
        };
        self.events.push((step, event));
    }
}
