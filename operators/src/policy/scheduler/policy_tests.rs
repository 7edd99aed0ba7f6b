//! The scheduling policy on small made-up ranks: batching, chunking, preemption, admission
//! policies, drafts and prefix reuse.

use super::*;
use crate::policy::memory::MemoryLayout;

fn memory(blocks: usize) -> RankMemory {
    RankMemory::new(MemoryLayout::kv_only(4, blocks))
}

fn config(max_batched_tokens: usize, chunk_tokens: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_running: 8,
        max_batched_tokens,
        chunk_tokens,
        prefix_cache: true,
        snapshot_interval_blocks: 4,
        admission: AdmissionPolicy::Optimistic,
        spec: None,
    }
}

fn add(s: &mut Scheduler, seqs: &mut Sequences, id: u64, prompt: Vec<u32>, out: usize) -> usize {
    let mut seq = Sequence::new(id, prompt, out, false);
    seq.prompt_hashes = super::super::prefix_cache::block_hashes(&seq.tokens, 4, 0);
    let index = seqs.insert(seq);
    s.enqueue(index);
    index
}

/// Pretends step `t` (booked by `schedule`) completed: token 7 arrives where it sampled.
fn run(decision: &StepDecision, seqs: &mut Sequences, t: u64) {
    for c in &decision.chunks {
        let s = seqs.get_mut(c.seq);
        if c.sample {
            assert!(s.pending.pop(t));
            s.tokens.push(7);
        }
    }
}

fn chunk(seqs: &Sequences, seq: usize, start: usize, len: usize, sample: bool, prefill: bool) -> Chunk {
    Chunk {
        seq,
        key: seqs.get(seq).key,
        start,
        len,
        sample,
        deferred: None,
        prefill,
        drafts: 0,
        drafter_successors: false,
    }
}

#[test]
fn reserve_admits_only_what_the_rank_can_hold_to_the_end_and_never_preempts() {
    // 8 blocks of 4 tokens. Each request needs 3 blocks to its end (8 prompt + 4 outputs).
    for (policy, admitted_at_first) in [(AdmissionPolicy::Optimistic, 3), (AdmissionPolicy::Reserve, 2)] {
        let config = SchedulerConfig { admission: policy, ..config(64, 4) };
        let (mut s, mut seqs, mut mem) = (Scheduler::new(config), Sequences::default(), memory(8));
        for id in 0..3 {
            add(&mut s, &mut seqs, id, (id as u32 * 10..id as u32 * 10 + 8).collect(), 4);
        }
        let mut preempted = 0;
        for t in 1..40 {
            let d = s.schedule(&mut seqs, &mut mem, t);
            if t == 1 {
                assert_eq!(d.admitted.len(), admitted_at_first, "{policy:?}: first chunks fit for 3");
            }
            preempted += d.preempted.len();
            run(&d, &mut seqs, t);
            for id in 0..3 {
                let Some(i) = seqs.index_of(id).filter(|&i| seqs.get(i).finished()) else { continue };
                s.forget(i);
                mem.release(seqs.get_mut(i));
                seqs.remove(i);
            }
        }
        assert!(seqs.is_empty(), "{policy:?}: every request finished");
        if policy == AdmissionPolicy::Reserve {
            assert_eq!(preempted, 0, "reserve never preempts");
        } else {
            assert!(preempted > 0, "optimistic admission runs out and preempts");
        }
    }
}

#[test]
fn prefill_is_chunked_and_the_budget_holds() {
    let (mut s, mut seqs, mut mem) = (Scheduler::new(config(6, 4)), Sequences::default(), memory(16));
    let a = add(&mut s, &mut seqs, 1, (0..10).collect(), 2);
    let b = add(&mut s, &mut seqs, 2, (0..10).collect(), 2);
    let d = s.schedule(&mut seqs, &mut mem, 1);
    assert_eq!(d.chunks, vec![chunk(&seqs, a, 0, 4, false, true), chunk(&seqs, b, 0, 2, false, true)]);
    run(&d, &mut seqs, 1);
    let d = s.schedule(&mut seqs, &mut mem, 2);
    assert_eq!(d.chunks.iter().map(|c| c.len).sum::<usize>(), 6);
}

#[test]
fn decodes_go_first() {
    let (mut s, mut seqs, mut mem) = (Scheduler::new(config(8, 8)), Sequences::default(), memory(16));
    let a = add(&mut s, &mut seqs, 1, vec![1, 2, 3], 4);
    run(&s.schedule(&mut seqs, &mut mem, 1), &mut seqs, 1); // 1 prefilled and sampled: now decoding
    let b = add(&mut s, &mut seqs, 2, (0..20).collect(), 2);
    let d = s.schedule(&mut seqs, &mut mem, 2);
    assert_eq!(d.chunks[0], chunk(&seqs, a, 3, 1, true, false));
    assert_eq!(d.chunks[1].seq, b);
}

#[test]
fn a_decode_follows_a_token_still_in_flight_every_step() {
    let (mut s, mut seqs, mut mem) = (Scheduler::new(config(8, 8)), Sequences::default(), memory(16));
    let a = add(&mut s, &mut seqs, 1, vec![1, 2, 3], 3);
    let d1 = s.schedule(&mut seqs, &mut mem, 1); // prefill; its first token is in flight
    assert_eq!(d1.chunks, vec![chunk(&seqs, a, 0, 3, true, true)]);
    // Steps 2 and 3 launch before step 1 completes: each names the token sampled before it.
    let d2 = s.schedule(&mut seqs, &mut mem, 2);
    assert_eq!(d2.chunks, vec![Chunk { deferred: Some(1), ..chunk(&seqs, a, 3, 1, true, false) }]);
    let d3 = s.schedule(&mut seqs, &mut mem, 3);
    assert_eq!(d3.chunks, vec![Chunk { deferred: Some(2), ..chunk(&seqs, a, 4, 1, true, false) }]);
    assert!(seqs.get(a).all_outputs_launched(), "three tokens in flight: all three outputs launched");
    assert!(s.schedule(&mut seqs, &mut mem, 4).is_empty(), "nothing more to launch until tokens arrive");
    for (t, d) in [(1, &d1), (2, &d2), (3, &d3)] {
        run(d, &mut seqs, t);
    }
    let seq = seqs.get(a);
    assert_eq!((seq.output_len(), seq.pending.len()), (3, 0));
    assert!(seq.check(4, true).is_ok());
}

#[test]
fn the_youngest_running_request_is_preempted_when_blocks_run_out() {
    let (mut s, mut seqs, mut mem) = (Scheduler::new(config(64, 64)), Sequences::default(), memory(4));
    let a = add(&mut s, &mut seqs, 1, (0..8).collect(), 8); // 2 blocks, grows to 4
    let b = add(&mut s, &mut seqs, 2, (100..108).collect(), 8); // 2 blocks
    run(&s.schedule(&mut seqs, &mut mem, 1), &mut seqs, 1);
    assert_eq!(s.num_running(), 2);
    let d = s.schedule(&mut seqs, &mut mem, 2); // request 1 needs a third block: none is free
    assert_eq!(d.preempted, vec![2]);
    assert_eq!(seqs.get(b).computed, 0);
    assert_eq!(seqs.get(b).preemptions, 1);
    assert!(d.chunks.iter().all(|c| c.seq == a));
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn a_request_that_can_never_fit_fails_instead_of_waiting_forever() {
    let (mut s, mut seqs, mut mem) = (Scheduler::new(config(64, 64)), Sequences::default(), memory(2));
    add(&mut s, &mut seqs, 1, (0..10).collect(), 4);
    let d = s.schedule(&mut seqs, &mut mem, 1);
    assert_eq!(d.failed.len(), 1);
    assert!(d.failed[0].1.contains("KV blocks"));
    assert!(s.is_idle());
}

#[test]
fn a_decode_carries_drafts_only_with_nothing_in_flight_and_blocks_for_them() {
    let spec = SpecConfig {
        draft_tokens: 3,
        drafter: crate::policy::drafter::Drafter::Ngram(crate::policy::drafter::NgramDrafter { min_n: 1, max_n: 2 }),
        widen_buckets: false,
    };
    let config = SchedulerConfig { spec: Some(spec), ..config(64, 64) };
    let (mut s, mut seqs, mut mem) = (Scheduler::new(config), Sequences::default(), memory(16));
    let a = add(&mut s, &mut seqs, 1, vec![5, 6, 7, 5, 6], 8);
    let d = s.schedule(&mut seqs, &mut mem, 1);
    assert_eq!(d.chunks, vec![chunk(&seqs, a, 0, 5, true, true)], "the prompt first");
    run(&d, &mut seqs, 1); // samples 7: tokens 5 6 7 5 6 7
    assert_eq!(propose_into(seqs.get_mut(a), &spec), 3, "propose(1)");
    let d = s.schedule(&mut seqs, &mut mem, 2);
    assert_eq!(d.chunks, vec![Chunk { drafts: 3, ..chunk(&seqs, a, 5, 4, true, false) }]);
    assert_eq!(seqs.get(a).spec.drafts, vec![5, 6, 7], "what followed the last 7 6... match");
    assert_eq!(seqs.get(a).computed, 6, "only the known token counts until the verification");
    assert!(seqs.get(a).blocks.len() * 4 >= 6 + 3, "blocks for every position the chunk writes");
    assert_eq!(propose_into(seqs.get_mut(a), &spec), 0, "nothing proposed while its drafts are verified");
    assert!(s.schedule(&mut seqs, &mut mem, 3).is_empty(), "not again while its drafts are verified");
    // The verification kept 1 draft (what `Rank::apply` does): on it goes, drafting again.
    let seq = seqs.get_mut(a);
    assert!(seq.pending.pop(2));
    seq.spec.drafts.clear();
    seq.computed += 1;
    seq.tokens.extend([5, 9]);
    propose_into(seqs.get_mut(a), &spec);
    let d = s.schedule(&mut seqs, &mut mem, 4);
    assert_eq!(d.chunks[0].start, 7);
    assert!(d.chunks[0].drafts <= 1, "one output left after this token: at most one draft");
    // No free block for drafts: a plain decode, nobody preempted.
    let (mut s, mut seqs, mut mem) = (Scheduler::new(config), Sequences::default(), memory(3));
    let b = add(&mut s, &mut seqs, 2, vec![1, 2, 1, 2, 1, 2], 6); // 2 blocks now, 3 to its end
    add(&mut s, &mut seqs, 3, vec![9, 9, 9], 1); // holds the third block
    run(&s.schedule(&mut seqs, &mut mem, 1), &mut seqs, 1);
    propose_into(seqs.get_mut(b), &spec);
    let d = s.schedule(&mut seqs, &mut mem, 2);
    assert_eq!((d.chunks[0].len, d.chunks[0].drafts, d.preempted.len()), (1, 0, 0), "{:?}", d.chunks);
    assert!(seqs.get(b).spec.proposed.is_empty(), "a proposal is used or dropped when the decode is booked");
    assert!(seqs.get(b).spec.drafts.is_empty());
}

#[test]
fn a_decode_that_would_draft_nothing_goes_on_with_its_token_in_flight() {
    // With a drafter on, a decode whose token is in flight waits for it (the drafter proposes
    // from it) — but a request that keeps next to nothing drafts at width 0, so it decodes on
    // at plain decoding's pace (an executor with deferred output keeps a step in flight), its
    // hope of drafting again growing a little each step.
    let spec = SpecConfig {
        draft_tokens: 4,
        drafter: crate::policy::drafter::Drafter::Ngram(crate::policy::drafter::NgramDrafter { min_n: 1, max_n: 2 }),
        widen_buckets: false,
    };
    let config = SchedulerConfig { spec: Some(spec), ..config(64, 64) };
    let (mut s, mut seqs, mut mem) = (Scheduler::new(config), Sequences::default(), memory(16));
    let a = add(&mut s, &mut seqs, 1, vec![5, 6, 7, 5, 6], 12);
    run(&s.schedule(&mut seqs, &mut mem, 1), &mut seqs, 1);
    let d = s.schedule(&mut seqs, &mut mem, 2); // a decode, its token in flight after this
    assert_eq!((d.chunks.len(), d.chunks[0].deferred), (1, None));
    seqs.get_mut(a).spec.draft_acceptance = 1.0;
    assert!(s.schedule(&mut seqs, &mut mem, 3).is_empty(), "it drafts next: it waits for its token");
    seqs.get_mut(a).spec.draft_acceptance = 0.0;
    let d = s.schedule(&mut seqs, &mut mem, 4);
    assert_eq!(d.chunks.len(), 1, "it would draft nothing: it decodes on");
    assert_eq!((d.chunks[0].deferred, d.chunks[0].drafts), (Some(2), 0), "with the token of step 2 in flight");
    assert!(seqs.get(a).spec.draft_acceptance > 0.0, "hope returns");
}

#[test]
fn the_draft_width_is_a_bucket_that_never_exceeds_what_the_request_can_use() {
    // A property over random schedules: whatever the recent acceptance and the outputs left,
    // a chunk carries at most the scheduler's limit of drafts, at a configured width, with
    // blocks for every position it writes. With bucketing allowed to round up (test switch
    // `widen_draft_buckets`, "scheduled width" in docs/design.md §5) it does not hold.
    assert_eq!(first_width_violation(false), None);
    let widened = first_width_violation(true);
    assert!(widened.is_some(), "rounding buckets up must break the property");
}

/// The first schedule, over 300 random ones, that breaks the width property (a message).
fn first_width_violation(widen_buckets: bool) -> Option<String> {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: u64| {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (rng >> 33) % n
    };
    for _ in 0..300 {
        let k = 1 + next(8) as usize;
        let drafter =
            crate::policy::drafter::Drafter::Ngram(crate::policy::drafter::NgramDrafter { min_n: 1, max_n: 2 });
        let spec = SpecConfig { draft_tokens: k, drafter, widen_buckets };
        let buckets: Vec<usize> = spec.buckets().collect();
        for recent in [0.0, 0.05, 0.3, 0.6, 1.0] {
            let limit = next(10) as usize;
            let w = spec.width(recent, limit);
            if !(w <= limit && w <= k && (w == 0 || buckets.contains(&w))) {
                return Some(format!("k {k} recent {recent} limit {limit}: {w}"));
            }
            if recent == 1.0 && limit >= k {
                assert_eq!(w, k, "full acceptance drafts at full width");
            }
        }
        let config = SchedulerConfig { spec: Some(spec), ..config(1 + next(40) as usize, 64) };
        let (mut s, mut seqs, mut mem) = (Scheduler::new(config), Sequences::default(), memory(8 + next(24) as usize));
        let outputs = 1 + next(12) as usize;
        let a = add(&mut s, &mut seqs, 1, (0..6).map(|i| (i % 2) as u32).collect(), outputs);
        for t in 1..30 {
            seqs.get_mut(a).spec.draft_acceptance = next(11) as f32 / 10.0;
            propose_into(seqs.get_mut(a), &spec);
            let d = s.schedule(&mut seqs, &mut mem, t);
            for c in &d.chunks {
                let seq = seqs.get(c.seq);
                let left = seq.max_output_tokens - seq.output_len();
                if !(c.drafts <= k && c.drafts < left.max(1)) {
                    return Some(format!("{c:?}: {left} outputs left"));
                }
                assert!(seq.blocks.len() * 4 >= c.start + c.len, "blocks for every position: {c:?}");
                if c.len > config.max_batched_tokens {
                    return Some(format!("{c:?} over the step's budget"));
                }
            }
            // The step completed: no draft kept, the token after the known one arrives.
            let Some(seq) = seqs.index_of(1).map(|i| seqs.get_mut(i)) else { break };
            if seq.pending.pop(t) {
                seq.spec.drafts.clear();
                seq.tokens.push(1);
            }
            if seq.finished() {
                break;
            }
        }
    }
    None
}

#[test]
fn an_admission_reuses_cached_prompt_blocks() {
    let (mut s, mut seqs, mut mem) = (Scheduler::new(config(64, 64)), Sequences::default(), memory(16));
    let a = add(&mut s, &mut seqs, 1, (0..9).collect(), 1);
    let d = s.schedule(&mut seqs, &mut mem, 1);
    run(&d, &mut seqs, 1);
    // What the rank does after the step: cache the prompt's full blocks.
    let seq = seqs.get(a);
    let hashes = mem.prompt_hashes(seq);
    for (b, h) in hashes.iter().enumerate() {
        let block = seq.blocks.blocks()[b];
        mem.prefix.insert_block(*h, Some(block), &mut mem.blocks, 1);
    }
    let b = add(&mut s, &mut seqs, 2, (0..9).chain(50..53).collect(), 1);
    let d = s.schedule(&mut seqs, &mut mem, 2);
    assert_eq!(d.admitted, vec![(2, 8)]);
    assert_eq!(d.chunks.last().unwrap(), &chunk(&seqs, b, 8, 4, true, true));
    assert_eq!(seqs.get(b).blocks.blocks()[..2], seqs.get(a).blocks.blocks()[..2]);
}
