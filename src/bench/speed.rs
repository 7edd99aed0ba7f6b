//! `kvflow bench speed`: the CUDA executor's prefill and decode speed on one model at each shape
//! (`--shapes`: batch × prompt tokens), beside the anchors measured on the same GPU, weights and
//! dtype in the same device call (`benches/device/speed.sh` writes them with
//! `benches/device/transformers_speed.py`: transformers eager, transformers with a static cache
//! and a compiled decode step, the step's weight products alone through cuBLAS, SDPA prefill,
//! the flash-linear-attention kernels), and beside the decode step's lower bound: max(bytes a
//! decode step must move / the device-to-device copy rate, its FLOPs / the dtype's matrix rate),
//! both rates measured in the same run. Prefill is also given as a fraction of the matrix rate.
//! Ends each shape with where a decode step's and a prefill's device time goes, kernel by kernel.

pub use crate::bench::speed_baseline::{Anchor, Baseline, Shape};

use crate::bench::cuda_batch::CudaBatch;
use crate::bench::median;
use anyhow::{anyhow, Context, Result};
use kvflow_kernels::cuda::{Dtype, Gpu, KernelTimes};
use kvflow_kernels::models;
use kvflow_operators::executor::CudaSettings;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

pub struct SpeedBenchArgs {
    /// A checkpoint folder or a TOML model spec.
    pub model: PathBuf,
    pub gpu: usize,
    /// The shapes to measure, in order (each dtype measures every shape).
    pub shapes: Vec<Shape>,
    pub steps: usize,
    /// The anchors' figures (JSON from `benches/device/transformers_speed.py`), if measured.
    pub baseline: Option<PathBuf>,
    pub emulate: bool,
    /// The dtypes to measure, in order.
    pub dtypes: Vec<Dtype>,
}

/// Decode steps before the timed rounds, timed rounds (each figure is their median), and
/// decode steps profiled kernel by kernel.
const WARMUP: usize = 4;
const ROUNDS: usize = 3;
const PROFILED: usize = 8;

/// A prefill whose warm-up takes longer than this is timed in one round, not `ROUNDS` (a
/// 32,768-token prompt: the device call's time is better spent elsewhere).
const LONG_PREFILL_S: f64 = 2.0;

pub fn run(args: &SpeedBenchArgs) -> Result<()> {
    if args.shapes.is_empty() || args.steps == 0 || args.dtypes.is_empty() {
        return Err(anyhow!("--shapes (or --batch and --prompt), --steps and --dtype must name something to measure"));
    }
    let baseline = args.baseline.as_deref().map(Baseline::read).transpose()?;
    let model = Arc::new(models::load(&args.model).with_context(|| format!("loading {}", args.model.display()))?);
    // every shape must fit the model's context before any is measured
    for shape in &args.shapes {
        model.check_context(shape.prompt, decode_steps(args)).map_err(|e| {
            anyhow!("--shapes {}: {e} (with the bench's {} decode steps)", shape.key(), decode_steps(args))
        })?;
    }
    let mut copy_gbps = None;
    for &dtype in &args.dtypes {
        for &shape in &args.shapes {
            measure(args, &model, dtype, shape, baseline.as_ref(), &mut copy_gbps)
                .with_context(|| format!("{} at {shape}", dtype.name()))?;
        }
    }
    Ok(())
}

/// Decode steps a shape's batch makes room for: the warm-up, the timed rounds, one round launched
/// directly (no graphs), then the profiled steps.
fn decode_steps(args: &SpeedBenchArgs) -> usize {
    WARMUP + (ROUNDS + 1) * args.steps + PROFILED
}

/// What one shape's lines are printed against.
struct Against<'a> {
    dtype: Dtype,
    shape: Shape,
    anchors: &'a [Anchor],
    /// torch.matmul's rate in the dtype (same run), TFLOP/s.
    matmul_tflops: Option<f64>,
}

/// Prefill, decode, the bound, the anchors and the profiles of one dtype at one shape, on an
/// executor whose KV pool and state slots are sized for this shape alone (dropped before the
/// next). The copy rate is measured once, on the first shape's GPU.
fn measure(
    args: &SpeedBenchArgs,
    model: &Arc<models::Model>,
    dtype: Dtype,
    shape: Shape,
    baseline: Option<&Baseline>,
    copy_gbps: &mut Option<f64>,
) -> Result<()> {
    let t0 = Instant::now();
    let settings = CudaSettings::on_gpu(args.gpu, args.emulate, dtype);
    let mut b = CudaBatch::new(model, &settings, shape.batch, shape.prompt, decode_steps(args))?;
    let gpu = b.ex.gpu().clone();
    let weight_bytes = b.ex.device_model().weight_bytes;
    let name = dtype.name();
    println!("== {name} {shape}");
    println!("gpu          {} ({})", gpu.name(), gpu.arch());
    println!(
        "model        {}: family {}, {} layers, hidden {}, vocab {}; {:.2} GB of weights read whole each step, products' in {name}; KV pool for {} × {} tokens (loaded in {:.1} s)",
        args.model.display(),
        model.family,
        model.num_layers(),
        model.hidden_size,
        model.vocab_size,
        weight_bytes as f64 / 1e9,
        shape.batch,
        shape.prompt + decode_steps(args),
        t0.elapsed().as_secs_f64()
    );
    let copy_gbps = copy_rate_once(&gpu, baseline, copy_gbps)?;
    let against = Against {
        dtype,
        shape,
        anchors: baseline.map_or(&[], |bl| bl.anchors(shape, dtype)),
        matmul_tflops: baseline.and_then(|bl| bl.matmul_tflops(dtype)),
    };
    if let Some(bl) = baseline.filter(|_| against.anchors.is_empty()) {
        println!(
            "anchors      {}: no {name} figures at {} (it has {name} at {})",
            args.baseline.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            shape.key(),
            bl.shape_keys(dtype).join(", ")
        );
    }
    let (prefill_profile, prefill_tps, matrix_fraction) = measure_prefill(&mut b, model, &against)?;
    let step_ms = measure_decode(args, &mut b, &against)?;
    measure_host_launches(args, &mut b, name, step_ms)?;
    let bound_ms = print_bound(args, model, &against, weight_bytes, copy_gbps, step_ms);
    print_decode_anchors(&against, step_ms, bound_ms);
    // where a decode step's device time goes, then a prefill's
    if !gpu.is_emulated() {
        gpu.start_profile();
        b.decode(PROFILED, true)?;
        print_profile(&format!("{PROFILED} decode steps at {shape}"), PROFILED, &gpu.take_profile()?);
    }
    if let Some(times) = prefill_profile {
        print_profile(&format!("1 prefill step of {shape} tokens (the warm-up)"), 1, &times);
    }
    print_summary(&against, prefill_tps, matrix_fraction, step_ms, bound_ms);
    Ok(())
}

/// The shape's figures on one line (`grep ^summary` gives the table of a run): prefill, its
/// fraction of the matrix rate, decode, the bound and the fraction reached, each decode anchor.
fn print_summary(on: &Against, prefill_tps: f64, matrix_fraction: Option<f64>, step_ms: f64, bound_ms: f64) {
    let anchors: Vec<String> = on
        .anchors
        .iter()
        .filter_map(|a| {
            let ms = a.decode_ms_per_step.filter(|ms| *ms > 0.0)?;
            let short = a.name.split([',', '(']).next().unwrap_or(&a.name).trim();
            Some(format!("{short} {ms:.2} ms (ratio={:.2})", ms / step_ms))
        })
        .collect();
    println!(
        "summary      {} {}: prefill {prefill_tps:.0} tokens/s ({} of the matmul rate); decode {step_ms:.2} ms/step, bound {bound_ms:.2} ms, {:.3} of it; {}",
        on.dtype.name(),
        on.shape,
        matrix_fraction.map_or("?".into(), |f| format!("{f:.3}")),
        bound_ms / step_ms,
        if anchors.is_empty() { "no decode anchor".into() } else { format!("vs {}", anchors.join(", ")) }
    );
}

/// The device-to-device copy rate: measured (and printed, with the baseline's matmul rates) the
/// first time, then the same.
fn copy_rate_once(gpu: &Arc<Gpu>, baseline: Option<&Baseline>, measured: &mut Option<f64>) -> Result<f64> {
    if let Some(rate) = *measured {
        return Ok(rate);
    }
    let rate = copy_rate(gpu)?;
    println!("limits       device-to-device copy {rate:.0} GB/s (read + write, median of 5 rounds)");
    if let Some(bl) = baseline {
        let shown = |r: Option<f64>| r.map_or("not measured".to_string(), |r| format!("{r:.1} TFLOP/s"));
        println!(
            "limits       torch.matmul 8192²: float32 {}, bfloat16 {} [transformers {}, torch {}]",
            shown(bl.matmul_tflops_float32),
            shown(bl.matmul_tflops_bfloat16),
            bl.transformers,
            bl.torch
        );
    }
    *measured = Some(rate);
    Ok(rate)
}

/// Floating-point operations of one prefill of `shape`: 2 × the products' multiply-adds (every
/// prompt token through the body, the last one of each prompt through the LM head) plus 2 × the
/// causal attention's (the token at position p attends to p + 1 keys).
fn prefill_flops(model: &models::Model, shape: Shape) -> (f64, f64) {
    let products = shape.batch * (shape.prompt * model.body_macs_per_token() + model.lm_head_macs());
    let attention: usize = shape.batch * (1..=shape.prompt).map(|ctx| model.attention_macs(ctx)).sum::<usize>();
    (2.0 * products as f64, 2.0 * attention as f64)
}

/// Prefill: every prompt in one step; a warm-up (profiled kernel by kernel on a GPU), then the
/// median of `ROUNDS` (one round for a long prefill). Returns the warm-up's profile, tokens/s
/// and the fraction of the matrix rate reached (when the rate was measured).
fn measure_prefill(
    b: &mut CudaBatch,
    model: &models::Model,
    on: &Against,
) -> Result<(Option<KernelTimes>, f64, Option<f64>)> {
    let gpu = b.ex.gpu().clone();
    if !gpu.is_emulated() {
        gpu.start_profile();
    }
    let warmup_s = b.prefill()?;
    let profile = if gpu.is_emulated() { None } else { Some(gpu.take_profile()?) };
    let rounds = if warmup_s > LONG_PREFILL_S { 1 } else { ROUNDS };
    let prefill_s = median((0..rounds).map(|_| b.prefill()).collect::<Result<Vec<f64>>>()?);
    let (name, shape) = (on.dtype.name(), on.shape);
    let tokens = (shape.batch * shape.prompt) as f64;
    let prefill_tps = tokens / prefill_s;
    let how = if rounds == 1 {
        format!("1 round after a warm-up of {warmup_s:.1} s: prefills over {LONG_PREFILL_S} s are timed once")
    } else {
        format!("median of {rounds} rounds after a warm-up")
    };
    let (products, attention) = prefill_flops(model, shape);
    let tflops = (products + attention) / prefill_s / 1e12;
    let rate = match on.matmul_tflops {
        Some(r) => format!("{:.3} of the {name} matmul rate ({r:.1} TFLOP/s, torch 8192², same run)", tflops / r),
        None => format!("{name} matmul rate not measured"),
    };
    println!(
        "prefill      kvflow {name}: {shape} tokens in {:.1} ms = {prefill_tps:.0} tokens/s ({how}); {:.2} TFLOP (products {:.2}, attention {:.2}) at {tflops:.1} TFLOP/s = {rate}",
        prefill_s * 1e3,
        (products + attention) / 1e12,
        products / 1e12,
        attention / 1e12,
    );
    let mut any = false;
    for a in on.anchors {
        if let Some(t) = a.prefill_tokens_per_s.filter(|t| *t > 0.0) {
            println!("prefill      vs {}: {t:.0} tokens/s{}, ratio={:.2}", a.name, note(a), prefill_tps / t);
            any = true;
        }
    }
    if !any {
        println!("prefill      vs transformers: not measured at {}", shape.key());
    }
    Ok((profile, prefill_tps, on.matmul_tflops.map(|r| tflops / r)))
}

/// `; NOTE` when the anchor has a note.
fn note(a: &Anchor) -> String {
    a.note.as_deref().map_or(String::new(), |n| format!(" ({n})"))
}

/// Decode: warm-up, then the timed rounds; the median ms per step.
fn measure_decode(args: &SpeedBenchArgs, b: &mut CudaBatch, on: &Against) -> Result<f64> {
    b.decode(WARMUP, true)?;
    let (mut round_ms, mut waits) = (Vec::new(), 0);
    for _ in 0..ROUNDS {
        let (secs, w) = b.decode(args.steps, true)?;
        round_ms.push(secs * 1e3 / args.steps as f64);
        waits += w;
    }
    let shown: Vec<String> = round_ms.iter().map(|ms| format!("{ms:.2}")).collect();
    let step_ms = median(round_ms);
    let (batch, prompt) = (on.shape.batch, on.shape.prompt);
    println!(
        "decode       kvflow {}: {step_ms:.2} ms/step = {:.0} tokens/s (batch {batch}, context {}..{}, median of {ROUNDS} rounds of {} steps: {} ms; {waits} host waits)",
        on.dtype.name(),
        batch as f64 * 1e3 / step_ms,
        prompt + WARMUP,
        prompt + WARMUP + ROUNDS * args.steps,
        args.steps,
        shown.join(", "),
    );
    Ok(step_ms)
}

/// Each anchor's decode step against kvflow's `step_ms` (ratio > 1: kvflow is faster) and the
/// fraction of the bound it reaches; then the anchors that measured nothing, and why.
fn print_decode_anchors(on: &Against, step_ms: f64, bound_ms: f64) {
    let mut any = false;
    for a in on.anchors {
        if let Some(ms) = a.decode_ms_per_step.filter(|ms| *ms > 0.0) {
            println!(
                "decode       vs {}: {ms:.2} ms/step, {:.3} of the bound{}, ratio={:.2}",
                a.name,
                bound_ms / ms,
                note(a),
                ms / step_ms
            );
            any = true;
        }
    }
    if !any {
        println!("decode       vs transformers: not measured at {}", on.shape.key());
    }
    for a in on.anchors.iter().filter(|a| a.prefill_tokens_per_s.is_none() && a.decode_ms_per_step.is_none()) {
        println!(
            "anchors      {}: measured nothing: {}",
            a.name,
            a.error.as_deref().unwrap_or("no figure and no reason given")
        );
    }
}

/// The same steps with every launch made from the host (no captured graphs), right after the
/// timed ones, against `step_ms`.
fn measure_host_launches(args: &SpeedBenchArgs, b: &mut CudaBatch, name: &str, step_ms: f64) -> Result<()> {
    let counts = b.ex.graph_counts().unwrap_or_default();
    b.ex.use_graphs(false);
    let (secs, _) = b.decode(args.steps, true)?;
    b.ex.use_graphs(true);
    let direct_ms = secs * 1e3 / args.steps as f64;
    println!(
        "graphs       kvflow {name}: {direct_ms:.2} ms/step with every kernel launched from the host, the {} steps after the timed ones; captured graphs ratio={:.2} ({} steps replayed from {} captured shapes, {} launched directly)",
        args.steps,
        direct_ms / step_ms,
        counts.replayed,
        counts.captured,
        counts.launched,
    );
    Ok(())
}

/// The decode step's lower bound at the mean context of the timed steps: bytes moved over the
/// copy rate, FLOPs over the matmul rate (when measured), and how much of it `step_ms` reaches.
/// Returns the bound in ms.
fn print_bound(
    args: &SpeedBenchArgs,
    model: &models::Model,
    on: &Against,
    weight_bytes: usize,
    copy_gbps: f64,
    step_ms: f64,
) -> f64 {
    let (name, batch) = (on.dtype.name(), on.shape.batch);
    let ctx = on.shape.prompt + WARMUP + ROUNDS * args.steps / 2;
    // the KV cache is in the dtype (kernels/src/cuda/kv.rs); the state stays f32
    let kv_bytes = ctx * model.kv_row_widths().iter().sum::<usize>() * on.dtype.bytes();
    let state_bytes = 2 * model.state_width() * 4; // read and written
    let bytes = (weight_bytes + batch * (kv_bytes + state_bytes)) as f64;
    let flops =
        2.0 * batch as f64 * (model.body_macs_per_token() + model.lm_head_macs() + model.attention_macs(ctx)) as f64;
    let bytes_ms = bytes / (copy_gbps * 1e9) * 1e3;
    let flops_ms = on.matmul_tflops.map(|rate| flops / (rate * 1e12) * 1e3);
    let bound = bytes_ms.max(flops_ms.unwrap_or(0.0));
    println!(
        "bound        {name} decode step at {}: {:.2} GB moved (weights {:.2}, KV {:.2}, state {:.2}) / copy rate = {bytes_ms:.2} ms; {:.1} GFLOP / matmul rate = {}; bound {bound:.2} ms, reached {:.3} of it",
        on.shape,
        bytes / 1e9,
        weight_bytes as f64 / 1e9,
        (batch * kv_bytes) as f64 / 1e9,
        (batch * state_bytes) as f64 / 1e9,
        flops / 1e9,
        flops_ms.map_or("not measured".into(), |ms| format!("{ms:.2} ms")),
        bound / step_ms,
    );
    bound
}

/// The twelve kernels that took longest over `what` (`steps` steps), per step.
fn print_profile(what: &str, steps: usize, times: &KernelTimes) {
    let total: f64 = times.iter().map(|t| t.2).sum();
    println!("profile      {what}: {:.2} ms of kernel time per step", total / steps as f64);
    for (name, launches, ms) in times.iter().take(12) {
        println!(
            "profile      {name:<22} {:>5} launches/step {:>8.3} ms/step {:>5.1}%",
            launches / steps,
            ms / steps as f64,
            100.0 * ms / total
        );
    }
}

/// Device-to-device copy of 1 GiB (16 MiB emulated), GB/s counting read and write.
fn copy_rate(gpu: &Arc<Gpu>) -> Result<f64> {
    let bytes = if gpu.is_emulated() { 1 << 24 } else { 1 << 30 };
    let (src, dst) = (gpu.zeros::<f32>(bytes / 4)?, gpu.zeros::<f32>(bytes / 4)?);
    let reps = if gpu.is_emulated() { 1 } else { 20 };
    let mut times = Vec::new();
    for _round in 0..5 {
        gpu.wait()?;
        let t = Instant::now();
        for _ in 0..reps {
            gpu.copy_on_device(dst.ptr(), src.ptr(), bytes)?;
        }
        gpu.wait()?;
        times.push(t.elapsed().as_secs_f64() / reps as f64);
    }
    Ok(2.0 * bytes as f64 / median(times) / 1e9)
}
