//! The CUDA executor without a GPU: its kernels (`kernels/cuda/*.cu`) run on the CPU through the
//! emulation (`executor_settings.emulate = true`; the host compiler builds them, fibers stand in
//! for threads), so everything but the device itself is checked here and in CI — the kernels'
//! math against transformers and the CPU executor, batch invariance, the executor's launch path
//! (metadata, block tables, deferred tokens from the ring, handoffs device to device and through
//! the host) and
//! `--verify` against the cuda plain path on aggregated and P/D graphs. What only a GPU shows
//! (speed, asynchrony on a real stream) is `benches/device/run.sh`'s.

use crate::common::{expected, fixture, load, records, rel_err};
use crate::runtime::{assert_exact, run_graph, write_graph_with};
use kvflow::generate::{generate, GenerateOptions};
use kvflow::graph::Overrides;
use kvflow_kernels::cpu::sampling::{RequestSampling, Sampler, SamplingParams};
use kvflow_kernels::cuda::{Arg, DeviceKv, DeviceModel, DeviceState, Dtype, Gpu, PlainRunner, StepRows};
use kvflow_operators::executor::{CudaExecutor, CudaSettings, Executor, ExecutorContext};
use kvflow_operators::policy::memory::MemoryLayout;
use kvflow_operators::rank::TestSwitches;
use kvflow_operators::step::{
    BlockStore, ImportFrom, KvExport, KvImport, SeqKey, SeqSlice, SeqStep, StateOp, StepCompletion, StepLaunch,
};
use kvflow_operators::transfer::{Handoff, TransferId};
use std::sync::Arc;

/// The fixtures of the families the CUDA executor runs (mha, mla, gdn, hybrid_gdn, hybrid_kda;
/// sparse_mla's has a test of its own, whose prompts are long enough for the indexer to choose).
const CUDA_FIXTURES: [&str; 6] =
    ["hf/llama", "hf/qwen3", "hf/deepseek_v3", "hf/qwen3_next_gdn", "hf/qwen3_next", "hf/kimi_linear"];

fn emulated() -> Arc<Gpu> {
    Gpu::emulated().unwrap_or_else(|e| panic!("{e}"))
}

/// Each of `sampled` (the device's logits after `prompt`, then after each greedy token) is within
/// 1e-3 relative of the CPU executor's at the same step.
fn assert_near_the_cpu_executor(
    model: &kvflow_kernels::models::Model,
    prompt: &[u32],
    sampled: &[Vec<f32>],
    what: &str,
) {
    let n = sampled.len();
    let opts = GenerateOptions { max_new_tokens: n, decode_logits: n, ..Default::default() };
    let cpu = generate(model, &[prompt.to_vec()], &opts).unwrap().remove(0);
    let mut rows = vec![cpu.last_logits.clone()];
    rows.extend(cpu.decode_logits.unwrap());
    for (j, (got, row)) in sampled.iter().zip(&rows).enumerate() {
        let e = rel_err(got, row);
        assert!(e < 1e-3, "{what}: sampled row {j}: {e:.2e} relative from the CPU executor");
    }
}

/// Greedy tokens equal transformers' and every sampled row's logits are within 1e-3 of the CPU
/// executor's (the first, 7-token, case of each fixture: the emulation is slow).
#[test]
fn emulated_cuda_kernels_reproduce_the_fixtures_and_the_cpu_executor() {
    let gpu = emulated();
    for name in CUDA_FIXTURES {
        let dir = fixture(name);
        let model = load(&dir);
        let dm = DeviceModel::upload(&gpu, &model).unwrap();
        let runner = PlainRunner::new(&gpu, &dm).unwrap();
        let case = &expected(&dir).cases[0];
        let n = 12;
        let got = runner.generate(&case.prompt, n, 4, 16).unwrap();
        assert_eq!(got.error, None, "{name}");
        assert_eq!(got.tokens, case.greedy[..n], "{name}: greedy tokens");
        assert_near_the_cpu_executor(&model, &case.prompt, &got.logits, name);
        assert!(rel_err(&got.logits[0], &case.last_logits) < 1e-3, "{name}: last prompt logits vs transformers");
    }
}

/// DeepSeek-V3.2 on the device: the indexer's keys, scores and top-k (`kernels/cuda/indexer.cu`).
/// On the top-32 fixture's 97- and 300-token prompts and the top-64 fixture's 131-token prompt
/// (queries past the top-k pick their keys), prefilled whole and in chunks of 16 (a prompt row
/// ranks its keys in a row as long as the prompt): greedy tokens equal transformers' cached
/// generation (`expected_cached.json`, V3.2's oracle; its near-tie rule), the logits within 1e-3
/// of the CPU executor's, and the same bits whole and chunked.
#[test]
fn emulated_cuda_indexer_reproduces_deepseek_v32_cached_generation() {
    let gpu = emulated();
    for (name, cases) in [("hf-extra/deepseek_v32_topk32", &[1, 2][..]), ("hf/deepseek_v32", &[2][..])] {
        let dir = fixture(name);
        let model = load(&dir);
        let dm = DeviceModel::upload(&gpu, &model).unwrap();
        let runner = PlainRunner::new(&gpu, &dm).unwrap();
        let cached = crate::common::expected_named(&dir, "expected_cached.json");
        for &c in cases {
            let case = &cached.cases[c];
            let n = 6;
            let whole = runner.generate(&case.prompt, n, 1024, 16).unwrap();
            let chunked = runner.generate(&case.prompt, n, 16, 16).unwrap();
            assert_eq!(whole.error, None, "{name} case {c}");
            let what = format!("{name} case {c} ({} prompt tokens)", case.prompt.len());
            for (j, (&got, &want)) in whole.tokens.iter().zip(&case.greedy).enumerate() {
                if got != want {
                    assert!(case.greedy_gaps[j] < 1e-3, "{what}: token {j} is {got}, transformers' cached has {want}");
                    break;
                }
            }
            assert_eq!(bits(&whole.logits.concat()), bits(&chunked.logits.concat()), "{what}: whole vs chunks of 16");
            assert_near_the_cpu_executor(&model, &case.prompt, &whole.logits, &what);
        }
    }
}

/// The indexer's top-k on the device picks what torch.topk picks on CPU (its recorded choices)
/// and what the CPU executor's port picks on seeded rows of exact ties, on both of torch's paths.
#[test]
fn the_device_top_k_picks_the_keys_torch_picks_ties_included() {
    let failures = kvflow::bench::device::topk_check(&emulated()).unwrap();
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Every tile variant of the `linear` kernel (64, 32 and 16 square; the executor picks one by
/// the launch's shape) gives each element the bits of one fused multiply-add chain over k in
/// order, then the bias, then the accumulation: the bits never depend on the tile, so neither on
/// the batch. `linear_narrow` (picked by the output width alone) gives the bits of its own
/// fixed order. Shapes with tails in every dimension.
#[test]
fn every_linear_tile_gives_the_bits_of_one_fma_chain_per_element() {
    let gpu = emulated();
    // k spans three chunks of 256 (model.cu's LINEAR_CHUNK), the last one partial
    let (m, n, k) = (37usize, 50usize, 600usize);
    let mut rng = kvflow::bench::Lcg(9);
    let mut draw = |len: usize| -> Vec<f32> { (0..len).map(|_| (rng.draw() % 2001) as f32 / 1000.0 - 1.0).collect() };
    let (x, w, bias, y0) = (draw(m * k), draw(n * k), draw(n), draw(m * n));
    let want = chunked_chains(&x, &w, &bias, &y0, (m, n, k), |v| v);
    let (xd, wd, bd) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap(), gpu.upload(&bias).unwrap());
    let args_for = |y: &kvflow_kernels::cuda::DeviceBuf<f32>| {
        [
            Arg::Ptr(y.ptr()),
            Arg::Ptr(xd.ptr()),
            Arg::Ptr(wd.ptr()),
            Arg::Ptr(bd.ptr()),
            Arg::I32(m as i32),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            Arg::I64(k as i64),
            Arg::I64(n as i64),
            Arg::I64(0),
            Arg::I64(0),
            Arg::I64(0),
            Arg::I32(1),
        ]
    };
    for (kernel, tile) in [("linear", 64), ("linear_t2", 32), ("linear_t1", 16)] {
        let y = gpu.upload(&y0).unwrap();
        let grid = (n.div_ceil(tile) as u32, m.div_ceil(tile) as u32, 1);
        gpu.launch(kernel, grid, 256, 0, &args_for(&y)).unwrap();
        assert_eq!(bits(&gpu.download(&y, m * n).unwrap()), bits(&want), "{kernel}");
    }
    // the split: each chunk's chains by its own blocks, then added in chunk order
    let chunks = k.div_ceil(256);
    let partial = gpu.zeros::<f32>(chunks * m * n).unwrap();
    let split_args = [
        Arg::Ptr(partial.ptr()),
        Arg::Ptr(xd.ptr()),
        Arg::Ptr(wd.ptr()),
        Arg::I32(m as i32),
        Arg::I32(n as i32),
        Arg::I32(k as i32),
        Arg::I64(k as i64),
        Arg::I64(0),
        Arg::I64(0),
        Arg::I32(chunks as i32),
    ];
    gpu.launch("linear_split", (n.div_ceil(64) as u32, m.div_ceil(64) as u32, chunks as u32), 256, 0, &split_args)
        .unwrap();
    assert_chunks_sum(&gpu, &partial, &bd, &y0, (m, n, chunks), &want, "linear_split + linear_chunks_sum");
    // linear_narrow (outputs at most 256 wide): per element, lane l sums k = l, l + 32, … in
    // order, then the warp's shuffle-down tree adds the 32 partial sums
    let mut want = vec![0.0f32; m * n];
    for r in 0..m {
        for c in 0..n {
            let mut lanes = [0.0f32; 32];
            for (l, lane) in lanes.iter_mut().enumerate() {
                for i in (l..k).step_by(32) {
                    *lane = x[r * k + i].mul_add(w[c * k + i], *lane);
                }
            }
            for o in [16, 8, 4, 2, 1] {
                let before = lanes;
                for l in 0..32 {
                    lanes[l] = before[l] + if l + o < 32 { before[l + o] } else { before[l] };
                }
            }
            want[r * n + c] = y0[r * n + c] + (lanes[0] + bias[c]);
        }
    }
    let y = gpu.upload(&y0).unwrap();
    gpu.launch("linear_narrow", (m as u32, n.div_ceil(8) as u32, 1), 256, 0, &args_for(&y)).unwrap();
    assert_eq!(bits(&gpu.download(&y, m * n).unwrap()), bits(&want), "linear_narrow");
}

/// bf16 products (kernels/cuda/bf16.cu), whole and split by chunk, give every element the same
/// bits: its inputs and weights rounded to bf16, one chain per chunk of 256 (the emulation's
/// tensor-core product adds its 16 products in k order, one fma each), the chains added in order.
/// Odd sizes take the kernel's edges: rows past M, outputs past N, a last stage short of 32 inputs,
/// rows of W and x not 16-byte aligned.
#[test]
fn the_bf16_products_give_the_bits_of_their_chains_whole_and_split() {
    let gpu = emulated();
    // k a multiple of 8 stages by cp.async; 601 (rows not 16-byte aligned) element by element;
    // 150 × 140 spans two 128-square tiles each way, every warp of linear_bf16_wide with rows
    for (m, n, k) in [(37usize, 50usize, 600usize), (37, 50, 601), (150, 140, 600)] {
        bf16_products_match_their_chains(&gpu, m, n, k);
    }
}

fn bf16_products_match_their_chains(gpu: &Gpu, m: usize, n: usize, k: usize) {
    use kvflow_kernels::cuda::bf16_bits;
    let mut rng = kvflow::bench::Lcg(4);
    let mut draw = |len: usize| -> Vec<f32> { (0..len).map(|_| (rng.draw() % 2001) as f32 / 997.0 - 1.0).collect() };
    let (x, w, bias, y0) = (draw(m * k), draw(n * k), draw(n), draw(m * n));
    let widen = |v: f32| f32::from_bits((bf16_bits(v) as u32) << 16);
    let want = chunked_chains(&x, &w, &bias, &y0, (m, n, k), widen);
    let w16: Vec<u16> = w.iter().map(|&v| bf16_bits(v)).collect();
    for (kernel, got) in
        kvflow::bench::kernel_checks::bf16_product_outputs(gpu, (m, n, k), &x, &w16, &bias, &y0).unwrap()
    {
        assert_eq!(bits(&got), bits(&want), "{kernel} ({m} x {n} x {k})");
    }
}

/// What a linear kernel gives each element of the `m`×`n` output: `y0` plus (the sum, in chunk
/// order, of one fma chain per chunk of 256 of the `k` inputs, plus `bias`); inputs and weights
/// pass through `round` first (bf16 kernels round them).
fn chunked_chains(
    x: &[f32],
    w: &[f32],
    bias: &[f32],
    y0: &[f32],
    (m, n, k): (usize, usize, usize),
    round: impl Fn(f32) -> f32,
) -> Vec<f32> {
    let mut want = vec![0.0f32; m * n];
    for r in 0..m {
        for c in 0..n {
            let mut total = 0.0f32;
            for chunk in (0..k).step_by(256) {
                let mut acc = 0.0f32;
                for i in chunk..(chunk + 256).min(k) {
                    acc = round(x[r * k + i]).mul_add(round(w[c * k + i]), acc);
                }
                total += acc;
            }
            want[r * n + c] = y0[r * n + c] + (total + bias[c]);
        }
    }
    want
}

/// Runs linear_chunks_sum over a split product's `chunks` partial sums in `partial` (with `bias`)
/// into a fresh upload of `y0`, and asserts the result has `want`'s bits.
fn assert_chunks_sum(
    gpu: &Gpu,
    partial: &kvflow_kernels::cuda::DeviceBuf<f32>,
    bias: &kvflow_kernels::cuda::DeviceBuf<f32>,
    y0: &[f32],
    (m, n, chunks): (usize, usize, usize),
    want: &[f32],
    what: &str,
) {
    let y = kvflow::bench::kernel_checks::sum_chunks(gpu, partial, bias, y0, (m, n, chunks)).unwrap();
    assert_eq!(bits(&y), bits(want), "{what}");
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A prompt's logits are bit-identical alone and in a batch of 64 (other lengths around it, a
/// few longer than it, so the batch's attention launch cuts keys into more parts than the
/// prompt's own), in float32 and in bfloat16 (bf16 weights and KV cache).
#[test]
fn emulated_cuda_logits_are_the_same_bits_alone_and_in_a_batch_of_64() {
    let gpu = emulated();
    let model = load(&fixture("hf/deepseek_v3"));
    for dtype in [Dtype::Float32, Dtype::Bfloat16] {
        let dm = DeviceModel::upload_as(&gpu, &model, dtype).unwrap();
        let runner = PlainRunner::new(&gpu, &dm).unwrap();
        const PER_SEQ: usize = 10;
        let kv = DeviceKv::new(&gpu, &dm.kv_widths, 16, 64 * PER_SEQ, dtype).unwrap();
        let table = |s: u32| -> Vec<u32> { (s * PER_SEQ as u32..(s + 1) * PER_SEQ as u32).collect() };
        // 70 tokens: two parts of keys (64 each) for its last row
        let prompt: Vec<u32> = (0..70).map(|i| (i * 37 + 5) % 512).collect();
        let mut alone = StepRows::default();
        alone.push_seq(&prompt, 0, &table(20), 16, Some(0));
        let a = runner.step(&kv, &alone).unwrap().remove(0);
        let mut batch = StepRows::default();
        for s in 0..64u32 {
            if s == 20 {
                batch.push_seq(&prompt, 0, &table(s), 16, Some(s));
            } else {
                let len = if s % 16 == 3 { 100 + s } else { 1 + s % 6 };
                let other: Vec<u32> = (0..len).map(|i| (s * 11 + i * 3) % 512).collect();
                batch.push_seq(&other, 0, &table(s), 16, Some(s));
            }
        }
        let b = runner.step(&kv, &batch).unwrap().remove(20);
        assert_eq!(bits(&a.logits), bits(&b.logits), "{}: alone vs in a batch of 64", dtype.name());
        assert_eq!(a.logits_hash, b.logits_hash);
    }
}

/// Gated DeltaNet on the device (qwen3_next_gdn): a sequence's logits are the same bits alone in
/// its slot and in a batch of 8 sequences in 8 slots; and a prompt continued from a snapshot
/// restored into another slot gives the same bits as the one that ran through.
#[test]
fn a_gdn_sequence_is_batch_invariant_and_resumes_from_a_device_snapshot() {
    let gpu = emulated();
    let model = load(&fixture("hf/qwen3_next_gdn"));
    let dm = DeviceModel::upload(&gpu, &model).unwrap();
    assert!(dm.state_width > 0 && dm.kv_widths.is_empty(), "gdn keeps state and no paged KV");
    let runner = PlainRunner::new(&gpu, &dm).unwrap();
    let kv = DeviceKv::new(&gpu, &dm.kv_widths, 16, 1, dm.dtype).unwrap();
    let state = DeviceState::new(&gpu, dm.state_width, 8, 1, 0).unwrap();
    let vocab = model.vocab_size as u32;
    let prompt: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % vocab).collect();
    let zero_all = || (0..8).for_each(|s| state.zero_slot(&gpu, s).unwrap());
    zero_all();
    let mut alone = StepRows::default();
    alone.push_seq(&prompt, 0, &[], 16, Some(0)).in_slot(3);
    let a = runner.step_in(&kv, Some(&state), &alone).unwrap().remove(0);
    zero_all();
    let mut batch = StepRows::default();
    for s in 0..8u32 {
        if s == 3 {
            batch.push_seq(&prompt, 0, &[], 16, Some(s)).in_slot(s);
        } else {
            let other: Vec<u32> = (0..1 + s % 5).map(|i| (s * 11 + i * 3) % vocab).collect();
            batch.push_seq(&other, 0, &[], 16, Some(s)).in_slot(s);
        }
    }
    let b = runner.step_in(&kv, Some(&state), &batch).unwrap().remove(3);
    assert_eq!(bits(&a.logits), bits(&b.logits), "alone vs in a batch of 8");
    // Through in one slot, against: the first 6 tokens, a snapshot, restored into another slot,
    // then the rest there.
    zero_all();
    let mut through = StepRows::default();
    through.push_seq(&prompt, 0, &[], 16, Some(0)).in_slot(0);
    let whole = runner.step_in(&kv, Some(&state), &through).unwrap().remove(0);
    zero_all();
    let mut head = StepRows::default();
    head.push_seq(&prompt[..6], 0, &[], 16, None).in_slot(1);
    runner.step_in(&kv, Some(&state), &head).unwrap();
    state.snapshot(&gpu, 1, 0).unwrap();
    state.restore(&gpu, 0, 5).unwrap();
    assert_eq!(state.read_slot(&gpu, 5).unwrap(), state.read_slot(&gpu, 1).unwrap(), "the restored slot");
    let mut tail = StepRows::default();
    tail.push_seq(&prompt[6..], 6, &[], 16, Some(0)).in_slot(5);
    let resumed = runner.step_in(&kv, Some(&state), &tail).unwrap().remove(0);
    assert_eq!(bits(&whole.logits), bits(&resumed.logits), "resumed from the snapshot");
    assert_eq!(whole.token, resumed.token);
}

/// Deferred output on the device: a decode launched before the step that samples its input has
/// completed names that token by (sequence, step), and the executor feeds it from the ring slot
/// the earlier step's sampling writes. The tokens equal the ones the host-resolved path gives,
/// and only the host-resolved path waits for the device.
#[test]
fn a_decode_launched_before_its_input_is_sampled_reads_it_on_the_device() {
    let on = decode_six(true, false);
    let off = decode_six(false, false);
    assert_eq!(on.len(), 6);
    assert_eq!(on, off, "tokens read on the device = tokens resolved on the host");
    let expected_greedy = &expected(&fixture("hf/llama")).cases[0].greedy;
    assert_eq!(on, expected_greedy[..6]);
    // Without the mechanism (the ring slot of an older sample is read) the outputs go wrong.
    let stale = decode_six(true, true);
    assert_ne!(stale, on, "feeding a stale ring slot must change the output");
}

/// A decode step's launches captured into a graph once per shape and replayed give the bits of
/// the same steps launched directly: every sample's token and logits hash, over a context that
/// crosses two attention key-part boundaries (three shapes), for a family with paged KV only
/// and one with MLA, KDA state slots and MoE. The counts show the replays really happened.
#[test]
fn replayed_decode_graphs_give_the_bits_of_direct_launches() {
    for family in ["hf/llama", "hf/kimi_linear"] {
        let model = Arc::new(load(&fixture(family)));
        let (batch, prompt, steps) = (3, 60, 72);
        let run = |graphs: bool| {
            let settings = CudaSettings { cuda_graphs: graphs, ..EMULATE };
            let mut b = kvflow::bench::cuda_batch::CudaBatch::new(&model, &settings, batch, prompt, steps).unwrap();
            b.prefill().unwrap();
            let (_, waits) = b.decode(steps, true).unwrap();
            assert_eq!(waits, 0, "{family}: the decode path waited for the device");
            (b.samples.clone(), b.ex.graph_counts())
        };
        let (direct, none) = run(false);
        let (replayed, counts) = run(true);
        assert_eq!(none, None);
        assert_eq!(direct.len(), batch * (steps + 1));
        assert_eq!(replayed, direct, "{family}: graph replays changed a sample");
        // positions 60..131: key parts 1, 2 and 3, each decode shape captured when first seen
        // and replayed from then on (the prefill is launched directly)
        let counts = counts.unwrap();
        assert_eq!(counts.captured, 3, "{family}: {counts:?}");
        assert_eq!(counts.launched, 1, "{family}: {counts:?}");
        assert_eq!(counts.replayed, steps as u64, "{family}: {counts:?}");
    }
}

/// Verification steps of varying width replay one graph: a cuda rank pads a step whose every row
/// samples to a multiple of 8 rows (a padding sequence over blocks no request holds), so
/// verifications of 1, 2 and 3 drafts and a plain decode share a shape — captured once, replayed
/// every time — and sample what the same steps launched directly sample.
#[test]
fn verifications_of_any_width_replay_the_graph_of_their_padded_shape() {
    let model = Arc::new(load(&fixture("hf/llama")));
    let prompt: Vec<u32> = (0..20u32).map(|i| (i * 13 + 7) % model.vocab_size as u32).collect();
    let table: Vec<u32> = (0..4).collect();
    let key = SeqKey { index: 0, generation: 1 };
    let run = |graphs: bool| {
        let mut ex = cuda_rank(&model, &CudaSettings { cuda_graphs: graphs, ..EMULATE });
        let step = |ex: &mut CudaExecutor, t: u64, known: &[u32], drafts: &[u32], start_pos: usize| {
            let seq = SeqStep {
                key,
                known,
                deferred: None,
                drafts,
                start_pos,
                block_table: &table,
                slot: None,
                prompt_len: prompt.len(),
                sample: true,
                sampler: Sampler::default(),
                next_prompt_token: None,
            };
            let done = one_step(ex, t, seq, &[], &[], &[]).result.unwrap().remove(0);
            (done.token.unwrap(), done.checks.iter().map(|c| (c.kept, c.next)).collect::<Vec<_>>())
        };
        let mut samples = vec![step(&mut ex, 0, &prompt, &[], 0)];
        let mut pos = prompt.len();
        for (t, width) in [3usize, 1, 2, 0, 3].into_iter().enumerate() {
            let last = samples.last().unwrap().0;
            let drafts: Vec<u32> = (0..width as u32).map(|d| (last + d * 5 + 1) % model.vocab_size as u32).collect();
            samples.push(step(&mut ex, t as u64 + 1, &[last], &drafts, pos));
            pos += 1; // every draft is rejected or not: the next decode feeds after the first row
        }
        (samples, ex.graph_counts())
    };
    let (direct, _) = run(false);
    let (replayed, counts) = run(true);
    assert_eq!(replayed, direct, "padding and replays changed a sample");
    let counts = counts.unwrap();
    assert_eq!((counts.captured, counts.replayed, counts.launched), (1, 5, 1), "{counts:?}");
}

/// Six greedy tokens after the first llama case's prompt, each decode launched before the
/// previous step is polled (`deferred`), or after its token is known on the host.
fn decode_six(deferred: bool, stale: bool) -> Vec<u32> {
    let model = Arc::new(load(&fixture("hf/llama")));
    let prompt: Vec<u32> = vec![1, 17, 300, 45, 9, 88, 211];
    {
        let settings = CudaSettings {
            gpus: None,
            deferred_output: deferred,
            emulate: true,
            dtype: Default::default(),
            cuda_graphs: true,
            test_stale_ring_slot: stale,
            test_draws_keyed_on_row: false,
        };
        let mut ex = cuda_rank(&model, &settings);
        let key = SeqKey { index: 0, generation: 1 };
        let table = [2u32, 3];
        let mut tokens = Vec::new();
        let mut done: Vec<StepCompletion> = Vec::new();
        let launch = |ex: &mut CudaExecutor, step: u64, s: SeqStep<'_>| {
            let seqs = [s];
            let l = StepLaunch {
                step,
                before: &[],
                after: &[],
                applied_through: None,
                sampling: &[key],
                batch: &SeqSlice(&seqs),
                imports: &[],
                exports: &[],
            };
            ex.launch(&l, 0);
        };
        let base = SeqStep {
            drafts: &[],
            key,
            known: &prompt,
            deferred: None,
            start_pos: 0,
            block_table: &table,
            slot: None,
            prompt_len: prompt.len(),
            sample: true,
            sampler: Default::default(),
            next_prompt_token: None,
        };
        launch(&mut ex, 0, base);
        let waits = ex.host_waits();
        for k in 1..6u64 {
            let last;
            let s = if deferred {
                // launched before step k-1's completion is taken
                SeqStep { known: &[], deferred: Some(k - 1), start_pos: prompt.len() + k as usize - 1, ..base }
            } else {
                ex.poll(&mut done);
                for c in done.drain(..) {
                    tokens.extend(c.result.unwrap().iter().map(|s| s.token.unwrap()));
                }
                last = [*tokens.last().unwrap()];
                SeqStep { known: &last, start_pos: prompt.len() + k as usize - 1, ..base }
            };
            launch(&mut ex, k, s);
        }
        ex.poll(&mut done);
        for c in done.drain(..) {
            tokens.extend(c.result.unwrap().iter().map(|s| s.token.unwrap()));
        }
        let waited = ex.host_waits() - waits;
        if deferred {
            assert_eq!(waited, 0, "the deferred decode path waited for the device");
        } else {
            assert_eq!(waited, 5, "the host-resolved path waits once a step");
        }
        tokens
    }
}

/// A trace of short prompts (10 to 30 tokens once scaled), so emulated runs stay quick.
fn short_trace(dir: &std::path::Path) -> String {
    let path = dir.join("short.jsonl");
    let lines: Vec<String> = (0..10)
        .map(|i| {
            let len = 320 + 64 * i;
            let ids: Vec<String> = (0..len / 512 + 1).map(|b| (i * 10 + b).to_string()).collect();
            format!(
                "{{\"timestamp\": {}, \"input_length\": {len}, \"output_length\": 8, \"hash_ids\": [{}]}}",
                i * 5,
                ids.join(", ")
            )
        })
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path.display().to_string()
}

const EMULATED: &str = "executor = \"cuda\"\n\n[pool.executor_settings]\nemulate = true\n";

/// `--verify` on an aggregated graph of two cuda ranks (against the cuda plain path): every
/// request exact, and both ranks served some.
#[test]
fn an_aggregated_cuda_graph_verifies_against_the_cuda_plain_path() {
    let models =
        ["hf/llama", "hf/deepseek_v3", "hf/deepseek_v32", "hf/qwen3_next_gdn", "hf/qwen3_next", "hf/kimi_linear"];
    for model in models {
        let (dir, report) = run_aggregated_cuda(model, "float32");
        assert_exact(&report, model);
        let ranks: std::collections::HashSet<u64> =
            records(dir.path()).iter().map(|r| r["rank"].as_u64().unwrap()).collect();
        assert_eq!(ranks.len(), 2, "{model}: both cuda ranks served requests");
    }
}

/// The same in bfloat16 for the families whose attention takes the tensor cores (prompts of 320 to
/// 896 tokens: several key parts, split over blocks or folded in the block by the step's shape),
/// with captured decode graphs, aggregated and in P/D (bf16 blocks handed off over tcp): every
/// request exact against the cuda plain path in bf16.
#[test]
fn bf16_cuda_graphs_on_tensor_cores_verify_against_the_cuda_plain_path() {
    let (_dir, report) = run_pd_cuda_as("hf/llama", "backend = \"tcp\"\n", "bfloat16");
    assert_exact(&report, "hf/llama P/D in bf16");
    for model in ["hf/llama", "hf/qwen3_next"] {
        let (_dir, report) = run_aggregated_cuda(model, "bfloat16");
        assert_exact(&report, model);
    }
}

/// An aggregated graph of two emulated cuda ranks in `dtype` over [`short_trace`], 10 requests
/// four at a time, with `--verify`.
fn run_aggregated_cuda(model: &str, dtype: &str) -> (tempfile::TempDir, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let pools = format!("[[pool]]\nname = \"main\"\nrole = \"aggregated\"\nranks = 2\n{EMULATED}dtype = \"{dtype}\"\n");
    let trace = short_trace(dir.path());
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 10";
    let graph = write_graph_with(dir.path(), model, &trace, workload, "32 MiB", &pools);
    let report = run_graph(&graph, Overrides::default(), Default::default());
    (dir, report)
}

/// Recurrent state on the device through the runtime (qwen3_next_gdn on two cuda ranks): the
/// requests share their first 512 prompt tokens, so later ones start from a state snapshot the
/// device kept at a block boundary (`StateOp::Snapshot`, then `Restore` into a new slot) — every
/// request exact against the cuda plain path, with prefix hits.
#[test]
fn a_gdn_cuda_graph_restores_device_snapshots_on_prefix_hits_and_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.jsonl");
    let lines: Vec<String> = (0..8)
        .map(|i| {
            let len = 560 + 16 * i;
            format!(
                "{{\"timestamp\": {}, \"input_length\": {len}, \"output_length\": 6, \"hash_ids\": [7, {}]}}",
                i * 40,
                100 + i
            )
        })
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    let pools = format!("[[pool]]\nname = \"main\"\nrole = \"aggregated\"\nranks = 2\n{EMULATED}");
    let workload = "mode = \"concurrency\"\nconcurrency = 2\nwarmup = 0\nlimit = 8";
    let graph = write_graph_with(dir.path(), "hf/qwen3_next_gdn", &path.to_string_lossy(), workload, "32 MiB", &pools);
    let report = run_graph(&graph, Overrides::default(), Default::default());
    assert_exact(&report, "qwen3_next_gdn on cuda ranks");
    assert!(report["prefix_hit_rate"].as_f64().unwrap() > 0.0, "prefix hits restored device snapshots: {report}");
}

/// 10 short requests through a 1P1D graph of emulated cuda pools over `backend`, verified.
fn run_pd_cuda(model: &str, backend: &str) -> (tempfile::TempDir, serde_json::Value) {
    run_pd_cuda_as(model, &format!("backend = \"{backend}\"\n"), "float32")
}

/// [`run_pd_cuda`] with both pools' products and KV cache in `dtype`, the link's keys `link`.
fn run_pd_cuda_as(model: &str, link: &str, dtype: &str) -> (tempfile::TempDir, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let pools = format!(
        "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n{EMULATED}dtype = \"{dtype}\"\n\n\
         [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n{EMULATED}dtype = \"{dtype}\"\n\n\
         [[link]]\nfrom = \"prefill\"\nto = \"decode\"\n{link}"
    );
    let trace = short_trace(dir.path());
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 10";
    let graph = write_graph_with(dir.path(), model, &trace, workload, "32 MiB", &pools);
    let report = run_graph(&graph, Overrides::default(), Default::default());
    (dir, report)
}

/// The recurrent families in P/D on cuda pools (qwen3_next and kimi_linear: KV and state;
/// qwen3_next_gdn: state only), over `inproc` and `tcp`: the prefill rank's slot is copied out after the step that
/// reaches the prompt boundary and into the decode rank's slot before the step that feeds T0 —
/// every request handed off with its state, outputs exact against the cuda plain path.
#[test]
fn recurrent_families_hand_off_their_device_state_between_cuda_pools() {
    let cases = [
        ("hf/qwen3_next", "inproc"),
        ("hf/qwen3_next_gdn", "tcp"),
        ("hf/qwen3_next", "tcp"),
        ("hf/kimi_linear", "inproc"),
    ];
    for (model, backend) in cases {
        let (_dir, report) = run_pd_cuda(model, backend);
        let what = format!("{model} 1P1D cuda over {backend}");
        assert_exact(&report, &what);
        assert_eq!(report["handoff"]["count"].as_u64().unwrap(), 10, "{what}: {report}");
        assert!(report["handoff"]["bytes"].as_u64().unwrap() > 0, "{what}");
    }
}

/// `--verify` on a 1P1D graph of cuda pools, over `inproc` (the decode rank copies the prefill
/// rank's blocks device to device) and over `tcp` (read out on a stream of the link's own, sent
/// over loopback, unpacked on the decode rank's device): every request handed off, outputs exact.
/// deepseek_v32's cache rows carry its index keys: the decode rank's indexer ranks the prompt's keys
/// the prefill rank wrote.
#[test]
fn a_pd_cuda_graph_hands_off_kv_and_verifies_over_inproc_and_tcp() {
    for (model, backend) in [("hf/qwen3", "inproc"), ("hf/qwen3", "tcp"), ("hf/deepseek_v32", "tcp")] {
        let (dir, report) = run_pd_cuda(model, backend);
        assert_exact(&report, &format!("{model} 1P1D cuda over {backend}"));
        assert_eq!(report["handoff"]["count"].as_u64().unwrap(), 10, "{backend}: {report}");
        assert!(report["handoff"]["bytes"].as_u64().unwrap() > 0);
        for r in records(dir.path()) {
            assert_eq!(r["pools"], serde_json::json!(["prefill", "decode"]), "{backend}: {r}");
        }
    }
    // Streamed: the cuda prefill rank's pieces leave as each chunk's step launches, named in
    // place with the marks of their KV layers (the link reads a layer once the forward wrote
    // it), over tcp while later layers and chunks compute (prompts of several chunks) — the
    // chunk that samples T0 too. Test switch `pieces-at-completion` sends them as each step
    // completes instead, and the last chunk's blocks with the handoff.
    let dir = tempfile::tempdir().unwrap();
    let pools = format!(
        "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n{EMULATED}\n\
         [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n{EMULATED}\n\
         [[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"tcp\"\nstream_min_tokens = 1\n"
    );
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 6";
    let graph =
        write_graph_with(dir.path(), "hf/qwen3", "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools);
    let mut streamed_bytes = Vec::new();
    for at_launch in [true, false] {
        let switches = TestSwitches { pieces_at_completion: !at_launch, ..Default::default() };
        let report = run_graph(&graph, Overrides::default(), switches);
        assert_exact(&report, &format!("hf/qwen3 1P1D cuda over tcp, streamed, at launch {at_launch}"));
        let h = &report["handoff"];
        assert!(h["pieces"].as_u64().unwrap() > 0 && h["pieces_staged"].as_u64().unwrap() > 0, "streamed: {h}");
        let at_launch_count = if at_launch { h["pieces"].clone() } else { 0.into() };
        assert_eq!(h["pieces_at_launch"], at_launch_count, "at launch {at_launch}: {h}");
        // each piece landed in the decode rank's device memory as it came, and the rest after
        // it: the import only unpacks on the device
        assert_eq!(h["pieces_landed_on_device"], h["pieces_staged"], "streamed: {h}");
        assert_eq!(h["landed_on_device"], report["completed"], "streamed: {h}");
        streamed_bytes.push(h["streamed_bytes"].as_u64().unwrap());
    }
    // at launch, the step that samples T0 sends its whole blocks ahead too
    assert!(streamed_bytes[0] > streamed_bytes[1], "streamed bytes at launch, at completion: {streamed_bytes:?}");
}

/// Without a driver, a run with a cuda pool is refused before it starts, naming the pool and
/// what is missing; a model the cuda kernels cannot run is refused naming its layer and why.
#[test]
fn a_cuda_pool_that_cannot_start_is_refused_before_the_run() {
    let specs = tempfile::tempdir().unwrap();
    let wide = specs.path().join("wide.toml");
    std::fs::write(&wide, WIDE_KIMI).unwrap();
    let run = |model: &str, settings: &str| {
        let dir = tempfile::tempdir().unwrap();
        let pools =
            format!("[[pool]]\nname = \"gpu\"\nrole = \"aggregated\"\nranks = 1\nexecutor = \"cuda\"\n{settings}");
        let trace = short_trace(dir.path());
        let workload = "mode = \"concurrency\"\nconcurrency = 2\nwarmup = 0\nlimit = 3";
        let graph = write_graph_with(dir.path(), model, &trace, workload, "32 MiB", &pools);
        let g = kvflow::graph::Graph::load(&graph).unwrap();
        let outcome = kvflow::runtime::run(&g, &Default::default(), &Default::default());
        format!("{:#}", outcome.err().expect("the run is refused"))
    };
    let e = run(&wide.display().to_string(), "\n[pool.executor_settings]\nemulate = true\n");
    assert!(e.contains("pool gpu") && e.contains("layer 0") && e.contains("head_dim 512 over 256"), "{e}");
    if kvflow_kernels::cuda::driver_present() {
        eprintln!("NOT RUN (the no-driver half): this machine has a CUDA driver");
        return;
    }
    let e = run("hf/llama", "");
    assert!(e.contains("pool gpu") && e.contains("no CUDA driver") && e.contains("emulate = true"), "{e}");
}

/// An emulated cuda rank with 4 blocks of 16 tokens.
fn cuda_rank(model: &Arc<kvflow_kernels::models::Model>, settings: &CudaSettings) -> CudaExecutor {
    CudaExecutor::new(&ExecutorContext::standalone("t", model.clone(), MemoryLayout::kv_only(16, 4)), settings).unwrap()
}

const EMULATE: CudaSettings = CudaSettings {
    gpus: None,
    deferred_output: true,
    emulate: true,
    dtype: kvflow_kernels::cuda::Dtype::Float32,
    cuda_graphs: true,
    test_stale_ring_slot: false,
    test_draws_keyed_on_row: false,
};

/// Runs step `t` of one sequence on `ex`, with the state copies `before` and the handoffs, and
/// returns its completion.
fn one_step(
    ex: &mut dyn Executor,
    t: u64,
    seq: SeqStep<'_>,
    before: &[StateOp],
    imports: &[KvImport],
    exports: &[KvExport],
) -> StepCompletion {
    crate::handoff::with_launch(t, seq, before, imports, exports, |launch| ex.launch(launch, 0));
    let mut done = Vec::new();
    while done.is_empty() {
        ex.poll(&mut done);
    }
    done.remove(0)
}

/// A verification on a cuda rank keeps the drafts greedy decoding agrees with and rolls the rest
/// back on the device: the state after each fed position is kept by the linear layers' kernels,
/// and `StateOp::Rewind` copies the one after the last kept draft into the slot (spec.rs's
/// check, on every family; without the rewind the recurrent families' next rows differ).
#[test]
fn a_cuda_verification_rolls_recurrent_state_back_on_the_device() {
    for name in crate::common::FIXTURES {
        let model = Arc::new(load(&fixture(name)));
        let layout = MemoryLayout {
            slots: 1,
            keeps_kv: model.needs_blocks(),
            keeps_state: model.needs_slots(),
            verify_rows: 5,
            ..MemoryLayout::kv_only(16, 4)
        };
        let new = || CudaExecutor::new(&ExecutorContext::standalone("t", model.clone(), layout), &EMULATE).unwrap();
        crate::spec::verification_keeps_and_rolls_back(name, &model, new, |ex, t, seq, before| {
            one_step(ex, t, seq, before, &[], &[])
        });
    }
}

/// The MTP drafter on a cuda rank: after each step the layer's passes run on the device over the
/// positions whose successor now holds — a middle prompt chunk's last one paired with the next
/// prompt token, a verification's kept prefix and the token after it — and chain on their own
/// output. The drafts equal the CPU executor's, step by step: a prompt in two chunks, then
/// decodes verifying two right drafts and a wrong one, then none right.
#[test]
fn a_cuda_rank_drafts_with_the_mtp_layer_as_the_cpu_executor_does() {
    let dir = tempfile::tempdir().unwrap();
    let model = Arc::new(load(&crate::spec::mtp_checkpoint(dir.path())));
    let k = 3;
    let mut cpu = crate::handoff::runner_drafting(&model, k);
    let ctx = ExecutorContext {
        mtp_drafts: k,
        ..ExecutorContext::standalone("t", model.clone(), MemoryLayout::kv_only(16, 64))
    };
    let mut cuda = CudaExecutor::new(&ctx, &EMULATE).unwrap();
    let prompt: Vec<u32> = (0..37u32).map(|i| (i * 29 + 11) % model.vocab_size as u32).collect();
    let table: Vec<u32> = (0..5).collect();
    let key = SeqKey { index: 0, generation: 1 };
    let seq = |known: &'static [u32], drafts: &'static [u32], start_pos: usize, sample: bool| SeqStep {
        key,
        known,
        deferred: None,
        drafts,
        start_pos,
        block_table: Box::leak(table.clone().into_boxed_slice()),
        slot: None,
        prompt_len: prompt.len(),
        sample,
        sampler: Sampler::default(),
        next_prompt_token: (start_pos + known.len() < prompt.len()).then(|| prompt[start_pos + known.len()]),
    };
    let leak = |v: Vec<u32>| -> &'static [u32] { Box::leak(v.into_boxed_slice()) };
    // the greedy continuation, for drafts that hold
    let mut plain = crate::handoff::runner(&model);
    let mut greedy = vec![];
    let first = crate::handoff::step(&mut plain, 1, seq(leak(prompt.clone()), &[], 0, true), &[], &[], &[]);
    greedy.push(first.result.unwrap()[0].token.unwrap());
    for t in 0..3 {
        let s = seq(leak(vec![greedy[t]]), &[], prompt.len() + t, true);
        greedy.push(crate::handoff::step(&mut plain, 2 + t as u64, s, &[], &[], &[]).result.unwrap()[0].token.unwrap());
    }
    let wrong = (greedy[3] + 1) % model.vocab_size as u32;
    let steps = [
        seq(leak(prompt[..16].to_vec()), &[], 0, false),
        seq(leak(prompt[16..].to_vec()), &[], 16, true),
        seq(leak(vec![greedy[0]]), leak(vec![greedy[1], greedy[2], wrong]), prompt.len(), true),
        seq(leak(vec![greedy[3]]), leak(vec![wrong, wrong]), prompt.len() + 3, true),
    ];
    let mut drafted = 0;
    for (t, s) in steps.into_iter().enumerate() {
        let on_cpu = crate::handoff::step(&mut cpu, t as u64, s, &[], &[], &[]).result.unwrap();
        let on_cuda = one_step(&mut cuda, t as u64, s, &[], &[], &[]).result.unwrap();
        let tokens = |v: &[kvflow_operators::step::Sampled]| {
            v.iter().map(|x| (x.token, x.kept_drafts(), x.drafts.clone())).collect::<Vec<_>>()
        };
        assert_eq!(tokens(&on_cuda), tokens(&on_cpu), "step {t}");
        drafted += on_cuda.iter().map(|x| x.drafts.len()).sum::<usize>();
        if t == 2 {
            assert_eq!(on_cuda[0].kept_drafts(), 2, "two drafts held");
        }
    }
    assert_eq!(drafted, 3 * k, "every sampling step drafted {k}");
}

/// A handoff between two cuda pools on one device goes device to device: the producer's export
/// is its blocks in place, and the consumer copies them into its own with a kernel — no host
/// staging — then continues from T0 exactly. A CPU consumer of the same handoff reads the blocks
/// through the host and continues the same way.
#[test]
fn a_handoff_between_cuda_ranks_on_one_device_goes_device_to_device() {
    let model = Arc::new(load(&fixture("hf/llama")));
    let case = &expected(&fixture("hf/llama")).cases[0];
    let key = SeqKey { index: 0, generation: 1 };
    let mut producer = cuda_rank(&model, &EMULATE);
    let prefill = SeqStep {
        drafts: &[],
        key,
        known: &case.prompt,
        deferred: None,
        start_pos: 0,
        block_table: &[0],
        slot: None,
        prompt_len: case.prompt.len(),
        sample: true,
        sampler: Default::default(),
        next_prompt_token: None,
    };
    let export = KvExport { key, blocks: vec![0], slot: None, copy_out: true, at_launch: false };
    let done = one_step(&mut producer, 0, prefill, &[], &[], &[export]);
    let t0 = done.result.unwrap()[0].token.unwrap();
    assert_eq!(t0, case.greedy[0]);
    let exported = done.exports.into_iter().next().unwrap();
    assert!(exported.kv.is_empty(), "the export is the blocks in place, not a copy");
    let source = exported.source.clone().unwrap();
    assert!(matches!(source.store, BlockStore::Device(_)));
    let handoff = Arc::new(Handoff {
        sampling: Default::default(),
        drafts: Vec::new(),
        delivery: Default::default(),
        transfer: TransferId { nonce: 1, generation: 1 },
        request: 7,
        prompt: case.prompt.clone(),
        max_output_tokens: 4,
        warmup: false,
        t0,
        logits_hash: 0,
        fingerprint: model.layout_fingerprint(16),
        block_size: 16,
        skip_blocks: 0,
        kv_blocks: 1,
        floats_per_block: source.floats_per_block,
        streamed: Vec::new(),
        kv: Vec::new(),
        source: Some(source),
        landed: None,
        state: None,
        started_ms: 0.0,
        t0_ms: 0.0,
        to: None,
        recycle: None,
        on_drop: Default::default(),
        simulated: None,
    });
    // what a tcp sender streams: a layer at a time (through pinned staging, each layer handed on
    // while the next is copied out), cut into pieces, the bytes of the whole read
    let source = handoff.source.as_ref().unwrap();
    let (mut pieces, mut streamed) = (0, Vec::new());
    source.stream(7, |piece| {
        pieces += 1;
        streamed.extend_from_slice(piece);
    });
    assert_eq!(bits(&streamed), bits(&source.read()), "streamed, the whole read");
    assert!(pieces >= 2 * model.num_layers(), "{pieces} pieces: cut as asked");
    let decode = SeqStep { known: &[t0], start_pos: case.prompt.len(), block_table: &[2], ..prefill };
    let import =
        KvImport { key, blocks: vec![2], slot: None, snapshot: None, from: ImportFrom::Handoff(handoff.clone()) };
    let mut consumer = cuda_rank(&model, &EMULATE);
    let next = one_step(&mut consumer, 0, decode, &[], std::slice::from_ref(&import), &[]);
    assert_eq!(next.result.unwrap()[0].token, Some(case.greedy[1]), "the consumer continues from T0");
    assert_eq!(consumer.imports(), (1, 0), "imported device to device, nothing staged through the host");
    // the same KV landed in device memory piece by piece, as a cuda consumer's tcp receiver
    // lands it (here 5 floats a piece): unpacked from there, nothing staged at the step
    let floats = source.read();
    let landing = kvflow_kernels::cuda::Landing::open(0, true).unwrap();
    let mut into = landing.begin(floats.len(), 5).unwrap();
    let mut at = 0;
    while at < floats.len() {
        let piece = into.next_piece().unwrap();
        let n = piece.len();
        piece.copy_from_slice(&floats[at..at + n]);
        into.landed().unwrap();
        at += n;
    }
    let mut landed = (*handoff).clone();
    landed.source = None;
    landed.landed = Some(kvflow_operators::transfer::Landed(Arc::new(into.finish().unwrap())));
    let from = ImportFrom::Handoff(Arc::new(landed));
    let landed_import = KvImport { key, blocks: vec![3], slot: None, snapshot: None, from };
    let mut lands = cuda_rank(&model, &EMULATE);
    let decode_3 = SeqStep { block_table: &[3], ..decode };
    let next = one_step(&mut lands, 0, decode_3, &[], &[landed_import], &[]);
    assert_eq!(next.result.unwrap()[0].token, Some(case.greedy[1]), "a consumer of the landed KV continues from T0");
    assert_eq!(lands.imports(), (1, 0), "unpacked from device memory, nothing staged through the host");
    // a CPU rank reads the same blocks through the host
    let ctx = ExecutorContext::standalone("c", model.clone(), MemoryLayout::kv_only(16, 4));
    let mut cpu = kvflow_operators::executor::CpuExecutor::new(
        kvflow_operators::executor::CpuStepRunner::new(&ctx),
        Default::default(),
    );
    let next = one_step(&mut cpu, 0, decode, &[], &[import], &[]);
    assert_eq!(next.result.unwrap()[0].token, Some(case.greedy[1]), "a CPU consumer of a GPU producer");
}

/// A linear-attention head wider than the recurrent kernels' block is refused by name, not run
/// with some of its values never computed (a seeded kimi_linear with 512-wide KDA heads).
/// A seeded kimi_linear whose linear-attention heads are 512 wide (the kernels take 256).
const WIDE_KIMI: &str = "model_type = \"kimi_linear\"\nseed = 1\nvocab_size = 64\nhidden_size = 64\n\
                intermediate_size = 64\nnum_hidden_layers = 1\nnum_attention_heads = 2\n\
                num_key_value_heads = 2\nkv_lora_rank = 16\nqk_nope_head_dim = 8\nqk_rope_head_dim = 8\n\
                v_head_dim = 8\nnum_experts = 2\nnum_experts_per_token = 1\nnum_shared_experts = 1\n\
                moe_intermediate_size = 16\nfirst_k_dense_replace = 1\nlayer_types = [\"linear_attention\"]\n\n\
                [linear_attn_config]\nnum_heads = 1\n\
                head_dim = 512\nshort_conv_kernel_size = 4\n";

#[test]
fn a_linear_attention_head_too_wide_for_the_cuda_kernels_is_refused_naming_it() {
    let spec = kvflow_kernels::checkpoint::ModelSpec::parse("wide.toml".into(), WIDE_KIMI).unwrap();
    let model = kvflow_kernels::models::build(&spec.config, &spec.weights).unwrap();
    let why = kvflow_kernels::cuda::unsupported(&model).expect("refused");
    assert!(why.contains("head_dim 512 over 256"), "{why}");
}

/// The lines `kvflow bench speed` prints for `dtype` at each of `shapes` ("2 × 4"): each shape's
/// section (from its `== DTYPE SHAPE` header) has the prefill, decode, graphs and bound lines, and
/// no profile (the emulation has no device timer); returns the sections by shape.
fn speed_sections<'a>(stdout: &'a str, dtype: &str, shapes: &[&str]) -> Vec<&'a str> {
    assert!(!stdout.contains("\nprofile "), "a profile under emulation: {stdout}");
    shapes
        .iter()
        .map(|shape| {
            let header = format!("== {dtype} {shape}\n");
            let start = stdout.find(&header).unwrap_or_else(|| panic!("no {header:?}: {stdout}"));
            let rest = &stdout[start + header.len()..];
            let section = &rest[..rest.find("\n== ").map_or(rest.len(), |e| e + 1)];
            for needle in [
                format!("prefill      kvflow {dtype}: {shape} tokens in "),
                "of the ".to_string(),
                format!("decode       kvflow {dtype}: "),
                " 0 host waits".to_string(),
                format!("graphs       kvflow {dtype}: "),
                format!("bound        {dtype} decode step at {shape}: "),
                format!("summary      {dtype} {shape}: prefill "),
            ] {
                assert!(section.contains(&needle), "{dtype} {shape}: no {needle:?} in {section}");
            }
            section
        })
        .collect()
}

/// `kvflow bench speed` end to end on the emulated kernels, on the 2.0 B spec of
/// benches/device/kimi-2b.toml shrunk to a tiny width (same layout: KDA and MLA layers, experts),
/// at two shapes, beside a baseline of transformers_speed.py's format that has figures for the
/// first shape only: each shape's prefill (with its fraction of the matmul rate), decode and
/// bound lines, the ratio to each anchor that measured, and why the others did not.
#[test]
fn the_speed_bench_runs_the_kimi_spec_through_the_cuda_executor() {
    let spec = std::fs::read_to_string(crate::common::repo().join("benches/device/kimi-2b.toml")).unwrap();
    let mut tiny = spec;
    for (from, to) in [
        ("hidden_size = 2048", "hidden_size = 64"),
        ("intermediate_size = 5632", "intermediate_size = 96"),
        ("vocab_size = 32000", "vocab_size = 256"),
        ("kv_lora_rank = 512", "kv_lora_rank = 16"),
        ("qk_nope_head_dim = 128", "qk_nope_head_dim = 8"),
        ("qk_rope_head_dim = 64", "qk_rope_head_dim = 8"),
        ("v_head_dim = 128", "v_head_dim = 8"),
        ("moe_intermediate_size = 512", "moe_intermediate_size = 16"),
        ("head_dim = 128", "head_dim = 16"),
    ] {
        assert!(tiny.contains(from), "{from}");
        tiny = tiny.replace(from, to);
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kimi-tiny.toml");
    std::fs::write(&path, tiny).unwrap();
    let baseline = dir.path().join("transformers-speed.json");
    std::fs::write(
        &baseline,
        r#"{"transformers": "5.17.0", "torch": "2.11.0", "gpu": "none", "matmul_tflops_float32": 50.0,
            "matmul_tflops_bfloat16": 700.0, "shapes": {"2x4": {
              "float32": [{"name": "transformers eager, dynamic cache", "prefill_tokens_per_s": 500.0,
                           "decode_ms_per_step": 70.0}],
              "bfloat16": [{"name": "transformers eager, dynamic cache", "prefill_tokens_per_s": 1000.0,
                            "decode_ms_per_step": 60.0, "note": "seeded"},
                           {"name": "products alone", "decode_ms_per_step": 0.5},
                           {"name": "transformers compiled", "error": "torch.compile failed: seeded"}]}}}"#,
    )
    .unwrap();
    let (p, b) = (path.display().to_string(), baseline.display().to_string());
    let out = crate::common::kvflow(&[
        "bench",
        "speed",
        "--model",
        &p,
        "--shapes",
        "2x4,1x6",
        "--steps",
        "1",
        "--baseline",
        &b,
        "--emulate",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("family hybrid_kda, 16 layers"), "{stdout}");
    assert!(stdout.contains("torch.matmul 8192²: float32 50.0 TFLOP/s, bfloat16 700.0 TFLOP/s"), "{stdout}");
    for dtype in ["float32", "bfloat16"] {
        let sections = speed_sections(&stdout, dtype, &["2 × 4", "1 × 6"]);
        let rate = if dtype == "float32" { "50.0" } else { "700.0" };
        for s in &sections {
            assert!(s.contains(&format!(" of the {dtype} matmul rate ({rate} TFLOP/s, torch 8192², same run)")), "{s}");
        }
        let (theirs_prefill, theirs_decode) = if dtype == "float32" { ("500", "70.00") } else { ("1000", "60.00") };
        let first = sections[0];
        for needle in [
            format!("prefill      vs transformers eager, dynamic cache: {theirs_prefill} tokens/s"),
            format!("decode       vs transformers eager, dynamic cache: {theirs_decode} ms/step, "),
            " of the bound".to_string(),
            "ratio=".to_string(),
        ] {
            assert!(first.contains(&needle), "{dtype} 2 × 4: no {needle:?} in {first}");
        }
        // the second shape is not in the baseline: said, not guessed
        assert!(sections[1].contains(&format!("no {dtype} figures at 1x6 (it has {dtype} at 2x4)")), "{}", sections[1]);
        assert!(sections[1].contains("decode       vs transformers: not measured at 1x6"), "{}", sections[1]);
    }
    let bf16 = speed_sections(&stdout, "bfloat16", &["2 × 4"])[0];
    assert!(bf16.contains("decode       vs products alone: 0.50 ms/step"), "{bf16}");
    assert!(
        bf16.contains("0.000 of the matmul rate); decode ") && bf16.contains("vs transformers eager 60.00 ms (ratio="),
        "{bf16}"
    );
    assert!(
        bf16.contains("anchors      transformers compiled: measured nothing: torch.compile failed: seeded"),
        "{bf16}"
    );
}

/// The dense spec of benches/device/llama-1b.toml shrunk to a tiny width through `kvflow bench
/// speed` on the emulated kernels at two shapes in bfloat16, against the JSON
/// benches/device/transformers_speed.py writes in its dry run (the two sides agree on the format);
/// and the bench's refusals of bad shapes and of the old baseline format, each naming what was
/// wrong.
#[test]
fn the_speed_bench_runs_the_dense_spec_at_each_shape_against_the_scripts_json() {
    let repo = crate::common::repo();
    let mut tiny = std::fs::read_to_string(repo.join("benches/device/llama-1b.toml")).unwrap();
    for (from, to) in [
        ("hidden_size = 2048", "hidden_size = 64"),
        ("intermediate_size = 8192", "intermediate_size = 128"),
        ("vocab_size = 32000", "vocab_size = 256"),
        ("num_hidden_layers = 16", "num_hidden_layers = 2"),
        ("num_attention_heads = 32", "num_attention_heads = 4"),
        ("num_key_value_heads = 8", "num_key_value_heads = 2"),
        ("head_dim = 64", "head_dim = 16"),
    ] {
        assert!(tiny.contains(from), "{from}");
        tiny = tiny.replace(from, to);
    }
    assert!(tiny.contains("tie_word_embeddings = true") && tiny.contains("rope_type = \"llama3\""), "{tiny}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llama-tiny.toml");
    std::fs::write(&path, tiny).unwrap();
    let json = dir.path().join("dry.json");
    let script = repo.join("benches/device/transformers_speed.py");
    let dry = std::process::Command::new("python3")
        .args([script.as_os_str(), path.as_os_str(), json.as_os_str()])
        .args(["--shapes", "2x4,1x6", "--float32-shapes", "2x4", "--dry-run"])
        .output()
        .expect("python3 runs");
    assert!(dry.status.success(), "{}", String::from_utf8_lossy(&dry.stderr));
    let (p, j) = (path.display().to_string(), json.display().to_string());

    // bad input first (each refused before any kernel runs)
    let old = dir.path().join("old.json");
    std::fs::write(&old, r#"{"transformers": "5.17.0", "torch": "2.11", "float32": {}, "bfloat16": {}}"#).unwrap();
    let o = old.display().to_string();
    let out = crate::common::kvflow(&["bench", "speed", "--model", &p, "--baseline", &o, "--emulate"]);
    crate::common::assert_clean_failure(&out, &[&o, "old one-shape format", "\"shapes\""]);
    let out = crate::common::kvflow(&["bench", "speed", "--model", &p, "--shapes", "2x0", "--emulate"]);
    crate::common::assert_clean_failure(&out, &["--shapes", "2x0", "prompt tokens"]);
    let out = crate::common::kvflow(&["bench", "speed", "--model", &p, "--shapes", "2x4", "--batch", "3", "--emulate"]);
    crate::common::assert_clean_failure(&out, &["--shapes", "--batch"]);
    let out = crate::common::kvflow(&["bench", "speed", "--model", &p, "--shapes", "1x200000", "--emulate"]);
    crate::common::assert_clean_failure(&out, &["--shapes 1x200000", "131072"]);
    let out = crate::common::kvflow(&["bench", "speed", "--model", &p, "--tune", "BF16_STAGES=9", "--emulate"]);
    crate::common::assert_clean_failure(&out, &["--tune BF16_STAGES=9", "2 to 4"]);

    // with tuning constants set (kernels/src/cuda/sources.rs TUNABLES): the kernels compile with
    // them and the run goes through
    let out = crate::common::kvflow(&[
        "bench",
        "speed",
        "--model",
        &p,
        "--shapes",
        "2x4,1x6",
        "--dtype",
        "bfloat16",
        "--steps",
        "1",
        "--baseline",
        &j,
        "--emulate",
        "--tune",
        "BF16_STAGES=2",
        "--tune",
        "FA_MERGE_AHEAD=1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("tuning       BF16_STAGES=2 FA_MERGE_AHEAD=1"), "{stdout}");
    assert!(stdout.contains("family mha, 2 layers"), "{stdout}");
    assert!(!stdout.contains("== float32"), "{stdout}");
    for section in speed_sections(&stdout, "bfloat16", &["2 × 4", "1 × 6"]) {
        assert!(section.contains("bfloat16 matmul rate not measured"), "{section}");
        for part in ["eager", "products", "compiled", "sdpa"] {
            let line = format!("anchors      {part} (dry run): measured nothing: dry run: nothing measured");
            assert!(section.contains(&line), "no {line:?} in {section}");
        }
    }
}

/// Seeded sampling on the device (`sample_drawn`) draws the token the CPU rule draws from the same
/// logits row (`kvflow::bench::draw_check`, which `bench device` runs on the GPU): temperatures,
/// top-k, top-p, ties, vocabularies from 1 to 140,000.
#[test]
fn the_device_draws_the_tokens_the_cpu_rule_draws() {
    let failures = kvflow::bench::draw_check::draw_check(&emulated()).unwrap();
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A request draws the same tokens on a cuda rank in a batch of four — prefill, then decode steps
/// with two in flight, replayed from captured graphs — as alone on the cuda plain path: each draw is
/// keyed on (seed, request, position). Keyed on the row's place in the batch instead
/// (`test_draws_keyed_on_row`), the tokens change.
#[test]
fn a_request_draws_the_same_tokens_in_a_batch_on_the_device_as_alone() {
    let model = Arc::new(load(&fixture("hf/llama")));
    let sampling = RequestSampling { params: SamplingParams { temperature: 0.8, top_k: 0, top_p: 0.9 }, seed: 5 };
    let (batch, prompt, steps) = (4, 12, 10);
    let batched = |keyed_on_row: bool| {
        let settings = CudaSettings { test_draws_keyed_on_row: keyed_on_row, ..EMULATE };
        let mut b = kvflow::bench::cuda_batch::CudaBatch::new(&model, &settings, batch, prompt, steps).unwrap();
        b.sample_by(sampling);
        b.prefill().unwrap();
        b.decode(steps, true).unwrap();
        let mut tokens = vec![Vec::new(); batch];
        for &(seq, token, _) in &b.samples {
            tokens[seq as usize].push(token.unwrap());
        }
        let prompts: Vec<Vec<u32>> = (0..batch).map(|i| b.prompt(i).to_vec()).collect();
        (tokens, prompts, b.ex.graph_counts().unwrap())
    };
    let (tokens, prompts, counts) = batched(false);
    assert!(counts.replayed > 0, "decode steps replayed captured graphs: {counts:?}");
    let gpu = emulated();
    let dm = DeviceModel::upload_as(&gpu, &model, Dtype::Float32).unwrap();
    let runner = PlainRunner::new(&gpu, &dm).unwrap();
    let mut off_greedy = 0;
    for (i, prompt) in prompts.iter().enumerate() {
        let sampler = Sampler::new(sampling, kvflow::bench::cuda_batch::REQUEST_IDS + i as u64);
        let alone = runner.generate_by(prompt, steps + 1, 64, 16, &sampler).unwrap();
        assert_eq!(tokens[i], alone.tokens, "sequence {i}: in the batch vs alone");
        off_greedy += usize::from(runner.generate(prompt, steps + 1, 64, 16).unwrap().tokens != alone.tokens);
    }
    assert!(off_greedy >= 2, "sampling changed only {off_greedy} of {batch} outputs from greedy");
    let (keyed_on_row, _, _) = batched(true);
    assert_ne!(keyed_on_row, tokens, "draws keyed on the batch row must change the tokens");
}

/// Seeded sampling on cuda pools through the runtime: an aggregated graph of two ranks and a 1P1D
/// graph over tcp, drawing at temperature 0.8 with top-p 0.9 (the handoff carries the request's
/// sampling), are exact under `--verify` against the cuda plain path drawing with the same keys,
/// and most outputs differ from the greedy run's.
#[test]
fn sampled_cuda_graphs_verify_against_the_cuda_plain_path() {
    const SAMPLED: &str = "\n[sampling]\ntemperature = 0.8\ntop_p = 0.9\nseed = 11\n";
    let aggregated = format!("[[pool]]\nname = \"main\"\nrole = \"aggregated\"\nranks = 2\n{EMULATED}");
    let pd = format!(
        "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n{EMULATED}\n\
         [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n{EMULATED}\n\
         [[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"tcp\"\n"
    );
    for (what, pools) in [("aggregated", aggregated), ("1P1D tcp", pd)] {
        let dir = tempfile::tempdir().unwrap();
        let trace = short_trace(dir.path());
        let workload = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 6";
        let run = |pools: &str, name: &str| {
            let graph = write_graph_with(dir.path(), "hf/llama", &trace, workload, "32 MiB", pools);
            let out = dir.path().join(name);
            let overrides = Overrides { out: Some(out.clone()), ..Default::default() };
            let report = run_graph(&graph, overrides, Default::default());
            assert_exact(&report, &format!("{what} {name}"));
            let mut lines = crate::common::records_in(&out);
            lines.sort_by_key(|r| r["id"].as_u64());
            lines.iter().map(|r| r["output_tokens"].clone()).collect::<Vec<_>>()
        };
        let greedy = run(&pools, "greedy");
        let sampled = run(&format!("{pools}{SAMPLED}"), "sampled");
        let differ = greedy.iter().zip(&sampled).filter(|(a, b)| a != b).count();
        assert!(differ * 2 > greedy.len(), "{what}: sampling changed {differ} of {} outputs", greedy.len());
    }
}

/// n-gram speculative decoding on cuda pools: the drafts of a step are scored on the device (a
/// row after the last known token and after each draft) and checked as the CPU executor checks
/// them, so greedy drafting gives the plain outputs — `--verify` exact against the cuda plain path
/// — with drafts really fed, kept (llama) and rejected (three conversation requests, whose outputs
/// repeat enough to draft; `benches/device/run.sh` drafts on every family, aggregated and 1P1D).
/// The recurrent families roll each rejection back on the device
/// ([`a_cuda_verification_rolls_recurrent_state_back_on_the_device`] takes the rollback away).
#[test]
fn ngram_drafting_on_cuda_pools_gives_the_plain_outputs() {
    const SPEC: &str = "\n[speculative]\ndrafter = \"ngram\"\ndraft_tokens = 4\n";
    let aggregated = format!("[[pool]]\nname = \"main\"\nrole = \"aggregated\"\nranks = 2\n{EMULATED}");
    let workload = "mode = \"concurrency\"\nconcurrency = 3\nwarmup = 0\nlimit = 3";
    let trace = "mooncake_conversation_head.jsonl";
    // (the recurrent families reject from their first drafts: shorter outputs do)
    for (model, outputs) in [("hf/llama", 32), ("hf/qwen3_next", 16), ("hf/kimi_linear", 16)] {
        let dir = tempfile::tempdir().unwrap();
        let graph = write_graph_with(dir.path(), model, trace, workload, "32 MiB", &format!("{aggregated}{SPEC}"));
        let outputs = Overrides { max_output_tokens: Some(outputs), ..Default::default() };
        let report = run_graph(&graph, outputs, TestSwitches::default());
        assert_exact(&report, &format!("{model} drafting on cuda"));
        let spec = &report["spec"];
        let (drafted, accepted) = (spec["drafted_tokens"].as_u64().unwrap(), spec["accepted_tokens"].as_u64().unwrap());
        assert!(drafted > accepted, "{model}: drafts were rejected: {spec}");
        assert!(model != "hf/llama" || accepted > 0, "{model}: drafts were kept: {spec}");
    }
}

/// The MTP drafter on cuda pools (the seeded DeepSeek-V3 with its MTP layer): `--verify` exact
/// against the cuda plain path, aggregated and 1P1D over tcp, drafts really fed; the producer's
/// drafts from T0 travel with the handoff (the MTP layer's KV streamed from and landed into device
/// memory with the rest) and are the consumer's first drafts. A model without an MTP layer is
/// refused by name.
#[test]
fn mtp_drafting_on_cuda_pools_is_exact_and_hands_its_drafts_off() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = crate::spec::mtp_checkpoint(dir.path());
    let link = format!(
        "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n{EMULATED}\n[[pool]]\nname = \"decode\"\n\
         role = \"decode\"\nranks = 1\n{EMULATED}\n[[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"tcp\"\n\
         endpoint = \"127.0.0.1:0\"\n"
    );
    let cases = [("aggregated", format!("[[pool]]\nname = \"main\"\nranks = 2\n{EMULATED}")), ("1P1D tcp", link)];
    for (what, pools) in cases {
        let run_dir = dir.path().join(what.replace(' ', "-"));
        std::fs::create_dir_all(&run_dir).unwrap();
        let graph = crate::spec::mtp_graph(&run_dir, &ckpt.to_string_lossy(), &pools, &[("limit = 8", "limit = 4")]);
        let outputs = Overrides { max_output_tokens: Some(16), ..Default::default() };
        let report = run_graph(&graph, outputs, TestSwitches::default());
        assert_exact(&report, what);
        let spec = &report["spec"];
        assert!(spec["drafted_tokens"].as_u64().unwrap() > 0, "{what}: MTP drafts were fed: {spec}");
        if what.starts_with("1P1D") {
            let sent = spec["handed_off_drafts"].as_u64().unwrap();
            assert!(sent > 0 && spec["first_decode_drafts"] == sent, "{what}: {spec}");
            assert_eq!(report["handoff"]["landed_on_device"], report["completed"], "{what}: {}", report["handoff"]);
        }
    }
    let pools = format!("[[pool]]\nname = \"main\"\nranks = 1\n{EMULATED}");
    let graph = crate::spec::mtp_graph(dir.path(), "hf/llama", &pools, &[]);
    let refused = crate::common::kvflow(&["run", &graph.to_string_lossy()]);
    crate::common::assert_clean_failure(&refused, &["speculative.drafter", "holds no MTP layer"]);
}

/// T0 exactly once with drafting on cuda pools: the producer (a cuda rank) drafts from T0, the
/// handoff carries the drafts over tcp with the KV streamed from device memory and the recurrent
/// state, the consumer lands each piece of the KV in device memory as it arrives, and its first
/// decode (a cuda rank) verifies T0 and exactly those drafts, rolling rejected ones back on the
/// device (spec.rs's check; the test switch takes the producer's drafts away).
#[test]
fn a_cuda_consumers_first_decode_verifies_the_cuda_producers_drafts() {
    let pools = format!(
        "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n{EMULATED}\n[[pool]]\nname = \"decode\"\n\
         role = \"decode\"\nranks = 1\n{EMULATED}\n[[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"tcp\"\n\
         endpoint = \"127.0.0.1:0\"\n"
    );
    let outputs = Overrides { max_output_tokens: Some(16), limit: Some(4), ..Default::default() };
    let report = crate::spec::first_decodes_verify_the_producers_drafts("hf/kimi_linear", &pools, outputs);
    let handoff = &report["handoff"];
    assert_eq!(handoff["landed_on_device"], report["completed"], "every handoff landed on the device: {handoff}");
}

/// `kvflow bench spec --executor cuda`: the plain and the drafting run both on a cuda pool (here
/// emulated), figures and acceptance printed; the cuda pool's flags are refused without it.
#[test]
fn the_spec_bench_drafts_on_a_cuda_pool() {
    let args = ["bench", "spec", "--requests", "2", "--outputs", "12", "--rounds", "1", "--executor", "cuda"];
    let out = crate::common::kvflow(&[&args[..], &["--emulate", "--kv-budget", "32 MiB"]].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("executor cuda (float32, emulated"), "{stdout}");
    let accepted: f64 = stdout
        .split("mean accepted length ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no mean accepted length: {stdout}"));
    assert!(accepted > 1.0, "drafts were kept on the cuda pool: {stdout}");
    assert!(stdout.contains("decode_ratio="), "{stdout}");
    let out = crate::common::kvflow(&["bench", "spec", "--emulate"]);
    crate::common::assert_clean_failure(&out, &["--emulate", "--executor cuda"]);
}
