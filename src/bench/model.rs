//! `kvflow bench model`: prefill and decode throughput of one CPU executor (one thread, a rank's)
//! and the GFLOP/s it achieves, beside two GEMM baselines measured in the same run on the model's
//! largest weight shape at the decode batch size: kvflow's own GEMM and `matrixmultiply`'s sgemm.
//! The last line is `ratio=<decode GFLOP/s over the faster baseline>`.
//!
//! The decode batch shares one prefilled context (its blocks referenced by every sequence, as a
//! prefix cache would), then each sequence feeds its own token and decodes on its own blocks, so
//! attention reads `context` keys per sequence without prefilling `batch × context` tokens.

use anyhow::{bail, Result};
use kvflow_kernels::cpu::gemm::PackedMatrix;
use kvflow_kernels::cpu::sampling::argmax;
use kvflow_kernels::kv::{block_pool, BlockPool, BlockTable, SlotId};
use kvflow_kernels::models::{self, LogitsWanted, Model, ModelCache, SeqInput};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The default model: a seeded mha model of a small production shape.
pub const DEFAULT_SPEC: &str = r#"
model_type = "llama"
seed = 7
hidden_size = 1024
num_hidden_layers = 8
num_attention_heads = 16
num_key_value_heads = 4
head_dim = 64
intermediate_size = 2816
vocab_size = 32000
"#;

pub struct ModelBenchArgs {
    pub model: Option<PathBuf>,
    pub batch: usize,
    pub context: usize,
    pub decode_steps: usize,
}

fn gflops(flops: f64, d: Duration) -> f64 {
    flops / d.as_secs_f64() / 1e9
}

/// Best of `reps` timings of `f`.
fn best_of(reps: usize, mut f: impl FnMut()) -> Duration {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .expect("reps > 0")
}

/// Tokens of a KV block in the bench's cache.
const BLOCK_SIZE: usize = 16;

pub fn run(args: &ModelBenchArgs) -> Result<()> {
    check_sizes(args)?;
    let model = load_model(args)?;
    println!("threads      1 (one rank)");
    let baseline = gemm_baselines(&model, args.batch);
    let mut context = SharedContext::prefill(&model, args)?;
    let (tokens_per_s, decode) = decode(&model, &mut context, args)?;
    if let Some(gguf) = args.model.as_ref().filter(|p| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))) {
        llama_cpp_beside(gguf, args.batch, args.context, args.decode_steps, tokens_per_s);
    }
    println!("ratio={:.3}", decode / baseline);
    Ok(())
}

/// Refuses sizes the bench cannot hold.
fn check_sizes(args: &ModelBenchArgs) -> Result<()> {
    if args.batch == 0 || args.context == 0 || args.decode_steps == 0 {
        bail!("--batch, --context and --decode-steps must be positive");
    }
    // The bench holds batch × (context + decode steps) tokens of KV and activations.
    const MAX_TOKENS: usize = 1 << 20;
    if args.batch.saturating_mul(args.context.saturating_add(args.decode_steps)) > MAX_TOKENS {
        bail!(
            "--batch {} × (--context {} + --decode-steps {}) is more than the {MAX_TOKENS} tokens the bench holds",
            args.batch,
            args.context,
            args.decode_steps
        );
    }
    Ok(())
}

/// The model `--model` names (default: `DEFAULT_SPEC`), and its line.
fn load_model(args: &ModelBenchArgs) -> Result<Model> {
    let t0 = Instant::now();
    let model = match &args.model {
        Some(path) => models::load(path)?,
        None => {
            let spec = kvflow_kernels::checkpoint::ModelSpec::parse("<default bench spec>".into(), DEFAULT_SPEC)?;
            models::build(&spec.config, &spec.weights)?
        }
    };
    let name = args
        .model
        .as_ref()
        .map_or("default seeded mha (hidden 1024, 8 layers, vocab 32000)".to_string(), |p| p.display().to_string());
    println!(
        "model        {name}: family {}, {} layers, hidden {}, vocab {} (built in {:.1} s)",
        model.family,
        model.num_layers(),
        model.hidden_size,
        model.vocab_size,
        t0.elapsed().as_secs_f64()
    );
    Ok(model)
}

/// 1. The baselines' GFLOP/s on the largest weight shape at the decode batch size `m`: the faster
/// of kvflow's own GEMM and matrixmultiply's sgemm.
fn gemm_baselines(model: &Model, m: usize) -> f64 {
    let (n, k) = model.largest_weight_shape();
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
    let x: Vec<f32> = (0..m * k).map(|i| ((i * 104729) % 1000) as f32 / 1000.0 - 0.5).collect();
    let packed = PackedMatrix::from_rows(&w, n, k);
    let mut out = vec![0.0f32; m * n];
    let gemm_flops = 2.0 * (m * n * k) as f64;
    let own = gflops(gemm_flops, best_of(5, || packed.matmul(&x, m, &mut out)));
    let mm = gflops(
        gemm_flops,
        best_of(5, || unsafe {
            // C[m × n] = X[m × k] · Wᵀ, with Wᵀ read through strides from the [n × k] weight.
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                x.as_ptr(),
                k as isize,
                1,
                w.as_ptr(),
                1,
                k as isize,
                0.0,
                out.as_mut_ptr(),
                n as isize,
                1,
            );
        }),
    );
    println!("baseline     gemm {m}×{k}·({n}×{k})ᵀ: kvflow {own:.1} GFLOP/s, matrixmultiply {mm:.1} GFLOP/s");
    own.max(mm)
}

/// The one prefilled context every decoding sequence shares, and the cache and blocks the
/// sequences decode on.
struct SharedContext {
    pool: BlockPool,
    cache: ModelCache,
    /// The context's blocks.
    table: BlockTable,
    /// The slot holding the context's recurrent state (slot `batch`; slots 0..batch are the
    /// sequences'), for families with one.
    slot: Option<SlotId>,
}

impl SharedContext {
    /// 2. Prefills one shared context of `args.context` tokens, in chunks of 512, and prints its
    /// figures; the cache has room for every sequence's own blocks too.
    fn prefill(model: &Model, args: &ModelBenchArgs) -> Result<SharedContext> {
        let (bs, ctx, m) = (BLOCK_SIZE, args.context, args.batch);
        let steps = args.decode_steps + 2;
        let per_seq_blocks = (ctx + steps + 1).div_ceil(bs) - ctx / bs + 1;
        let total_blocks = ctx.div_ceil(bs) + m * per_seq_blocks;
        let mut pool = block_pool(total_blocks);
        let slots = if model.needs_slots() { m + 1 } else { 0 };
        let mut cache = model.new_cache(bs, total_blocks, slots, 1);
        let prompt: Vec<u32> = (0..ctx).map(|i| ((i * 31 + 7) % model.vocab_size) as u32).collect();
        let mut table = BlockTable::new();
        if model.needs_blocks() {
            table.grow_to(ctx, bs, &mut pool, 0)?;
        }
        // Slot m holds the shared context's state; slots 0..m the sequences' (a new store is zeroed).
        let slot = model.needs_slots().then_some(m as SlotId);
        let t = Instant::now();
        for start in (0..ctx).step_by(512) {
            let end = (start + 512).min(ctx);
            model.forward(
                &[SeqInput {
                    tokens: &prompt[start..end],
                    start_pos: start,
                    block_table: table.blocks(),
                    slot,
                    prompt_len: ctx,
                    logits: if end == ctx { LogitsWanted::Last } else { LogitsWanted::None },
                }],
                &mut cache,
            );
        }
        let prefill_time = t.elapsed();
        let attn_prefill: usize = (1..=ctx).map(|c| model.attention_macs(c)).sum();
        let prefill_flops = 2.0 * (model.body_macs_per_token() * ctx + attn_prefill + model.lm_head_macs()) as f64;
        println!(
            "prefill      {ctx} tokens in {:.2} s: {:.0} tokens/s, {:.1} GFLOP/s",
            prefill_time.as_secs_f64(),
            ctx as f64 / prefill_time.as_secs_f64(),
            gflops(prefill_flops, prefill_time)
        );
        Ok(SharedContext { pool, cache, table, slot })
    }

    /// A block table and a slot for each of `m` sequences: each shares the context's full
    /// blocks (and starts from a snapshot of its recurrent state), with blocks of its own for
    /// `steps` more tokens (the context's partial last block copied into its own).
    fn fork(
        &mut self,
        model: &Model,
        ctx: usize,
        m: usize,
        steps: usize,
    ) -> Result<(Vec<BlockTable>, Vec<Option<SlotId>>)> {
        let bs = BLOCK_SIZE;
        let full = if model.needs_blocks() { ctx / bs } else { 0 };
        let mut tables: Vec<BlockTable> = (0..m)
            .map(|_| {
                let mut t = BlockTable::new();
                for &b in &self.table.blocks()[..full] {
                    self.pool.share(b);
                    t.push(b);
                }
                t
            })
            .collect();
        if model.needs_blocks() {
            for t in tables.iter_mut() {
                t.grow_to(ctx + steps + 1, bs, &mut self.pool, 0)?;
                if !ctx.is_multiple_of(bs) {
                    // The partial last block is copied: each sequence writes its own tokens into it.
                    self.cache.kv.copy_block(self.table.blocks()[full], t.blocks()[full]);
                }
            }
        }
        let mut slots: Vec<Option<SlotId>> = vec![None; m];
        if let Some(shared_slot) = self.slot {
            self.cache.states.snapshot_into(shared_slot, 0);
            for (i, s) in slots.iter_mut().enumerate() {
                self.cache.states.restore(0, i as SlotId);
                *s = Some(i as SlotId);
            }
        }
        Ok((tables, slots))
    }
}

/// 3. Decodes every sequence on its own after the shared context: two warm-up steps, then
/// `args.decode_steps` measured. Prints the figures and gives back every block; the decode's
/// tokens/s and GFLOP/s.
fn decode(model: &Model, context: &mut SharedContext, args: &ModelBenchArgs) -> Result<(f64, f64)> {
    let (ctx, m) = (args.context, args.batch);
    let steps = args.decode_steps + 2;
    let (mut tables, slots) = context.fork(model, ctx, m, steps)?;
    let mut last: Vec<u32> = (0..m).map(|i| ((i * 997 + 13) % model.vocab_size) as u32).collect();
    let mut measured = Duration::ZERO;
    let mut decode_flops = 0.0;
    for step in 0..steps {
        let pos = ctx + step;
        let toks: Vec<[u32; 1]> = last.iter().map(|&t| [t]).collect();
        let batch: Vec<SeqInput> = tables
            .iter()
            .zip(&toks)
            .zip(&slots)
            .map(|((t, tok), &slot)| SeqInput {
                tokens: tok,
                start_pos: pos,
                block_table: t.blocks(),
                slot,
                prompt_len: ctx,
                logits: LogitsWanted::Last,
            })
            .collect();
        let t = Instant::now();
        let out = model.forward(&batch, &mut context.cache);
        let dt = t.elapsed();
        if step >= 2 {
            measured += dt;
            decode_flops +=
                2.0 * (m * (model.body_macs_per_token() + model.lm_head_macs() + model.attention_macs(pos + 1))) as f64;
        }
        last = (0..m).map(|i| argmax(out.last(i).expect("asked"))).collect();
    }
    let decode = gflops(decode_flops, measured);
    let tokens_per_s = (m * args.decode_steps) as f64 / measured.as_secs_f64();
    println!("decode       batch {m}, context {ctx}: {tokens_per_s:.0} tokens/s, {decode:.1} GFLOP/s ({} steps measured after 2 warm-up)", args.decode_steps);
    for t in tables.iter_mut().chain(std::iter::once(&mut context.table)) {
        t.release_all(&mut context.pool);
    }
    assert!(context.pool.all_free(), "bench leaked KV blocks");
    Ok((tokens_per_s, decode))
}

/// llama.cpp's batch-1 decode on the same GGUF, one thread (llama-cpp-python, when installed),
/// beside kvflow's `tokens_per_s` at batch `batch`.
fn llama_cpp_beside(gguf: &std::path::Path, batch: usize, context: usize, steps: usize, tokens_per_s: f64) {
    const SCRIPT: &str = "import sys, time\nfrom llama_cpp import Llama\n\
        llm = Llama(model_path=sys.argv[1], n_threads=1, n_ctx=int(sys.argv[2]) + int(sys.argv[3]) + 8, verbose=False)\n\
        llm.eval(list(range(100, 100 + int(sys.argv[2]))))\n\
        token = llm.sample(temp=0.0)\n\
        start = time.perf_counter()\n\
        for _ in range(int(sys.argv[3])):\n    llm.eval([token])\n    token = llm.sample(temp=0.0)\n\
        print(int(sys.argv[3]) / (time.perf_counter() - start))\n";
    let out = std::process::Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(gguf)
        .args([context.to_string(), steps.max(16).to_string()])
        .output();
    let measured = out
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse::<f64>().ok());
    match measured {
        Some(llama) => println!(
            "llama.cpp    batch 1, context {context}, one thread, same GGUF: {llama:.1} tokens/s; kvflow batch {batch} / llama.cpp batch 1 = {:.2}×",
            tokens_per_s / llama
        ),
        None => println!(
            "llama.cpp    not measured: llama-cpp-python is not installed (issue 19's figures for SmolLM2 on a 2-core \
             machine, batch 1, one thread: 56 tokens/s Q4_1, 24.5 tokens/s f32; kvflow batch {batch} / 24.5 = {:.2}×, / 56 = {:.2}×)",
            tokens_per_s / 24.5,
            tokens_per_s / 56.0
        ),
    }
}
