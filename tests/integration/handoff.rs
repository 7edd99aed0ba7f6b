//! The handoff's math on every family: a prefill on one executor, its KV blocks and state slot
//! exported at the step that reached the prompt boundary and imported into *other* block and slot
//! ids on a second executor, which decodes from T0 — bit-identical to `kvflow generate` (tokens
//! and the hash of every sampled logits row).

use crate::common::{fixture, FIXTURES};
use kvflow::generate::{generate, GenerateOptions};
use kvflow_kernels::hash;
use kvflow_kernels::models::{self, Model};
use kvflow_operators::executor::{CpuStepRunner, ExecutorContext, OwnedStep};
use kvflow_operators::policy::memory::MemoryLayout;
use kvflow_operators::pool::wake::RankWaker;
use kvflow_operators::step::{
    ImportFrom, KvExport, KvImport, SeqKey, SeqSource, SeqStep, StateOp, StepCompletion, StepLaunch,
};
use kvflow_operators::transfer::{Handoff, TransferId};
use std::sync::Arc;

pub(crate) const BLOCK: usize = 16;

pub(crate) fn runner(model: &Arc<Model>) -> CpuStepRunner {
    runner_drafting(model, 0)
}

/// [`runner`] whose MTP pass proposes `mtp_drafts` drafts after each sampled token.
pub(crate) fn runner_drafting(model: &Arc<Model>, mtp_drafts: usize) -> CpuStepRunner {
    let layout = MemoryLayout {
        block_size: BLOCK,
        blocks: 64,
        slots: 4,
        snapshots: 0,
        keeps_kv: model.needs_blocks(),
        keeps_state: model.needs_slots(),
        prefix_keyed_by_prompt_len: false,
        verify_rows: 0,
    };
    let ctx = ExecutorContext {
        pool: "p".into(),
        rank: 0,
        model: model.clone(),
        layout,
        waker: Arc::new(RankWaker::default()),
        experts: None,
        mtp_drafts,
        clock: None,
        saves: None,
    };
    CpuStepRunner::new(&ctx)
}

/// A batch of one sequence.
struct One<'a>(SeqStep<'a>);

impl SeqSource for One<'_> {
    fn len(&self) -> usize {
        1
    }
    fn get(&self, _: usize) -> SeqStep<'_> {
        self.0
    }
}

/// Step `t` of one sequence, with the state copies `before` and the handoffs, handed to `run`.
pub(crate) fn with_launch<R>(
    t: u64,
    seq: SeqStep<'_>,
    before: &[StateOp],
    imports: &[KvImport],
    exports: &[KvExport],
    run: impl FnOnce(&StepLaunch<'_>) -> R,
) -> R {
    let batch = One(seq);
    let sampling = [seq.key];
    let launch = StepLaunch {
        step: t,
        before,
        after: &[],
        applied_through: None,
        sampling: &sampling,
        batch: &batch,
        imports,
        exports,
    };
    run(&launch)
}

/// Runs one step of one sequence through every phase.
pub(crate) fn step(
    r: &mut CpuStepRunner,
    t: u64,
    seq: SeqStep<'_>,
    before: &[StateOp],
    imports: &[KvImport],
    exports: &[KvExport],
) -> StepCompletion {
    with_launch(t, seq, before, imports, exports, |launch| {
        let mut owned = Some(OwnedStep::copy_of(launch));
        (0..r.phases()).find_map(|phase| r.run_phase(phase, owned.take())).expect("the last phase completes the step")
    })
}

#[test]
fn a_handoff_between_executors_continues_bit_identically_on_every_family() {
    let mut checked = 0;
    for name in FIXTURES {
        let model = Arc::new(models::load(&fixture(name)).unwrap());
        let prompt: Vec<u32> = (0..37u32).map(|i| (i * 7 + 3) % model.vocab_size as u32).collect();
        let outputs = 6;
        let p = prompt.len();
        let key = SeqKey { index: 0, generation: 1 };
        // Producer: blocks 0.., slot 0.
        let mut producer = runner(&model);
        let blocks: Vec<u32> = if model.needs_blocks() { (0..p.div_ceil(BLOCK) as u32).collect() } else { vec![] };
        let slot = model.needs_slots().then_some(0);
        let zero: Vec<StateOp> = slot.map(|slot| StateOp::Zero { slot }).into_iter().collect();
        // The blocks named in place (a cuda producer's way, and the test switch's), and copied out
        // by the step (a CPU producer's handoff).
        let export = [
            KvExport { key, blocks: blocks.clone(), slot, copy_out: false, at_launch: false },
            KvExport { key, blocks: blocks.clone(), slot, copy_out: true, at_launch: false },
        ];
        let prefill = SeqStep {
            drafts: &[],
            key,
            known: &prompt,
            deferred: None,
            start_pos: 0,
            block_table: &blocks,
            slot,
            prompt_len: p,
            sample: true,
            sampler: Default::default(),
            next_prompt_token: None,
        };
        let done = step(&mut producer, 0, prefill, &zero, &[], &export);
        let sampled = done.result.unwrap();
        let t0 = sampled[0].token.unwrap();
        let mut exports = done.exports.into_iter();
        let (exported, copied) = (exports.next().unwrap(), exports.next().unwrap());
        let handoff = Arc::new(Handoff {
            sampling: Default::default(),
            drafts: Vec::new(),
            delivery: Default::default(),
            transfer: TransferId { nonce: 1, generation: 1 },
            request: 0,
            prompt: prompt.clone(),
            max_output_tokens: outputs,
            warmup: false,
            t0,
            logits_hash: hash::chain_row(hash::EMPTY, sampled[0].logits_hash),
            fingerprint: model.layout_fingerprint(BLOCK),
            block_size: BLOCK,
            skip_blocks: 0,
            kv_blocks: blocks.len(),
            floats_per_block: exported.source.as_ref().filter(|_| !blocks.is_empty()).map_or(0, |s| s.floats_per_block),
            streamed: Vec::new(),
            kv: exported.kv,
            // The producer's blocks, read in place by the consumer's import (one copy).
            source: exported.source,
            landed: None,
            state: exported.state,
            started_ms: 0.0,
            t0_ms: 0.0,
            to: None,
            recycle: None,
            on_drop: Default::default(),
            simulated: None,
        });
        // Consumer: other block ids and another slot.
        let decode_from = |handoff: Arc<Handoff>| {
            let mut consumer = runner(&model);
            let table: Vec<u32> =
                if model.needs_blocks() { (20..20 + (p + outputs).div_ceil(BLOCK) as u32).collect() } else { vec![] };
            let cslot = model.needs_slots().then_some(3);
            let czero: Vec<StateOp> = cslot.map(|slot| StateOp::Zero { slot }).into_iter().collect();
            let import = [KvImport {
                key,
                blocks: table[..blocks.len()].to_vec(),
                slot: cslot,
                snapshot: None,
                from: ImportFrom::Handoff(handoff.clone()),
            }];
            let (mut tokens, mut chain) = (vec![handoff.t0], handoff.logits_hash);
            for i in 0..outputs - 1 {
                let last = [*tokens.last().unwrap()];
                let decode = SeqStep {
                    drafts: &[],
                    key,
                    known: &last,
                    deferred: None,
                    start_pos: p + i,
                    block_table: &table,
                    slot: cslot,
                    prompt_len: p,
                    sample: true,
                    sampler: Default::default(),
                    next_prompt_token: None,
                };
                let (before, imports) = if i == 0 { (&czero[..], &import[..]) } else { (&[][..], &[][..]) };
                let s = step(&mut consumer, 1 + i as u64, decode, before, imports, &[]).result.unwrap();
                tokens.push(s[0].token.unwrap());
                chain = hash::chain_row(chain, s[0].logits_hash);
            }
            (tokens, chain)
        };
        let (tokens, chain) = decode_from(handoff.clone());
        // The copy the step made (what a CPU producer's handoff carries, inproc or over a socket)
        // is the blocks' bytes, and continues the same way.
        assert_eq!(copied.kv, handoff.kv_floats().into_owned(), "{name}: the step's copy is the blocks read out");
        let mut owned = (*handoff).clone();
        (owned.kv, owned.source) = (copied.kv, None);
        let handoff = Arc::new(owned);
        assert_eq!(decode_from(handoff.clone()), (tokens.clone(), chain), "{name}: in place and the copy agree");
        let opts = GenerateOptions { max_new_tokens: outputs, ..Default::default() };
        let reference = generate(&model, std::slice::from_ref(&prompt), &opts).unwrap().remove(0);
        assert_eq!(tokens, reference.tokens, "{name}: tokens");
        assert_eq!(chain, reference.logits_hash, "{name}: logits bits");
        // The state half matters exactly for the families that have it: without it (a zeroed
        // slot) the continuation differs; with KV zeroed it differs for every family with KV.
        if let Some(state) = &handoff.state {
            let mut zeroed = (*handoff).clone();
            zeroed.state = Some(vec![0.0; state.len()]);
            assert_ne!(decode_from(Arc::new(zeroed)).1, chain, "{name}: the state half is used");
        }
        if !handoff.kv.is_empty() {
            let mut zeroed = (*handoff).clone();
            zeroed.kv = vec![0.0; handoff.kv.len()];
            assert_ne!(decode_from(Arc::new(zeroed)).1, chain, "{name}: the KV half is used");
        }
        checked += 1;
    }
    assert_eq!(checked, FIXTURES.len());
}
