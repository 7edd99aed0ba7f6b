//! `kvflow bench speed`: the CUDA executor's prefill and decode speed on one model, beside
//! transformers' on the same GPU, weights and dtype measured in the same device run
//! (`benches/device/speed.sh` writes its figures with `benches/device/transformers_speed.py`),
//! and beside the step's lower bound: max(bytes a decode step must move / the device-to-device
//! copy rate, its FLOPs / the dtype's matrix rate), both rates measured in the same run.
//! Ends with where a decode step's device time goes, kernel by kernel.

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
    pub batch: usize,
    pub prompt: usize,
    pub steps: usize,
    /// transformers' figures (JSON from `benches/device/transformers_speed.py`), if measured.
    pub baseline: Option<PathBuf>,
    pub emulate: bool,
    /// The dtypes to measure, in order.
    pub dtypes: Vec<Dtype>,
}

/// transformers' figures for one dtype.
#[derive(serde::Deserialize, Default)]
struct TorchFigures {
    prefill_tokens_per_s: f64,
    decode_ms_per_step: f64,
}

/// `benches/device/transformers_speed.py`'s output.
#[derive(serde::Deserialize)]
struct Baseline {
    transformers: String,
    torch: String,
    float32: TorchFigures,
    bfloat16: TorchFigures,
    /// torch.matmul of two 8192² matrices, TFLOP/s (float32 without TF32; bfloat16).
    matmul_tflops_float32: f64,
    matmul_tflops_bfloat16: f64,
}

pub fn run(args: &SpeedBenchArgs) -> Result<()> {
    if args.batch == 0 || args.prompt == 0 || args.steps == 0 {
        return Err(anyhow!("--batch, --prompt and --steps must be positive"));
    }
    let baseline: Option<Baseline> = match &args.baseline {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            Some(
                serde_json::from_str(&text)
                    .with_context(|| format!("{}: not transformers_speed.py's JSON", path.display()))?,
            )
        }
        None => None,
    };
    let model = Arc::new(models::load(&args.model).with_context(|| format!("loading {}", args.model.display()))?);
    let mut copy_gbps = None;
    for &dtype in &args.dtypes {
        measure(args, &model, dtype, baseline.as_ref(), &mut copy_gbps)?;
    }
    Ok(())
}

/// Decode steps before the timed rounds, timed rounds (each figure is their median), and
/// decode steps profiled kernel by kernel.
const WARMUP: usize = 4;
const ROUNDS: usize = 3;
const PROFILED: usize = 8;

/// transformers' figures for the dtype being measured.
#[derive(Clone, Copy)]
struct Theirs {
    prefill_tokens_per_s: f64,
    decode_ms_per_step: f64,
    matmul_tflops: f64,
}

impl Theirs {
    fn of(baseline: &Baseline, dtype: Dtype) -> Theirs {
        let f = if dtype == Dtype::Bfloat16 { &baseline.bfloat16 } else { &baseline.float32 };
        let rate =
            if dtype == Dtype::Bfloat16 { baseline.matmul_tflops_bfloat16 } else { baseline.matmul_tflops_float32 };
        Theirs {
            prefill_tokens_per_s: f.prefill_tokens_per_s,
            decode_ms_per_step: f.decode_ms_per_step,
            matmul_tflops: rate,
        }
    }
}

/// Prefill, decode, the bound and the profile of one dtype. The copy rate is measured once, on
/// the first dtype's GPU.
fn measure(
    args: &SpeedBenchArgs,
    model: &Arc<models::Model>,
    dtype: Dtype,
    baseline: Option<&Baseline>,
    copy_gbps: &mut Option<f64>,
) -> Result<()> {
    let t0 = Instant::now();
    let settings = CudaSettings {
        gpus: Some(vec![args.gpu]),
        deferred_output: true,
        emulate: args.emulate,
        dtype,
        cuda_graphs: true,
        test_stale_ring_slot: false,
    };
    // the timed rounds, then one round launched directly (no graphs), then the profiled steps
    let decode_steps = WARMUP + (ROUNDS + 1) * args.steps + PROFILED;
    let mut b = CudaBatch::new(model, &settings, args.batch, args.prompt, decode_steps)?;
    let gpu = b.ex.gpu().clone();
    let weight_bytes = b.ex.device_model().weight_bytes;
    let name = dtype.name();
    println!("== {name}");
    println!("gpu          {} ({})", gpu.name(), gpu.arch());
    println!(
        "model        {}: family {}, {} layers, hidden {}, vocab {}; {:.2} GB of weights read whole each step, products' in {name} (loaded in {:.1} s)",
        args.model.display(),
        model.family,
        model.num_layers(),
        model.hidden_size,
        model.vocab_size,
        weight_bytes as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    let copy_gbps = copy_rate_once(&gpu, baseline, copy_gbps)?;
    let theirs = baseline.map(|bl| Theirs::of(bl, dtype));
    measure_prefill(args, &mut b, name, theirs)?;
    let step_ms = measure_decode(args, &mut b, name, theirs)?;
    measure_host_launches(args, &mut b, name, step_ms)?;
    print_bound(args, model, dtype, weight_bytes, copy_gbps, theirs, step_ms);
    // where a decode step's device time goes, then a prefill's
    if !gpu.is_emulated() {
        gpu.start_profile();
        b.decode(PROFILED, true)?;
        print_profile(&format!("{PROFILED} decode steps"), PROFILED, &gpu.take_profile()?);
        gpu.start_profile();
        b.prefill()?;
        print_profile("1 prefill step", 1, &gpu.take_profile()?);
    }
    Ok(())
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
        println!(
            "limits       torch.matmul 8192²: float32 {:.1} TFLOP/s, bfloat16 {:.1} TFLOP/s [transformers {}, torch {}]",
            bl.matmul_tflops_float32, bl.matmul_tflops_bfloat16, bl.transformers, bl.torch
        );
    }
    *measured = Some(rate);
    Ok(rate)
}

/// Prefill: every prompt in one step, the median of three after a warm-up.
fn measure_prefill(args: &SpeedBenchArgs, b: &mut CudaBatch, name: &str, theirs: Option<Theirs>) -> Result<()> {
    b.prefill()?;
    let prefill_s = median((0..ROUNDS).map(|_| b.prefill()).collect::<Result<Vec<f64>>>()?);
    let prefill_tps = (args.batch * args.prompt) as f64 / prefill_s;
    println!(
        "prefill      kvflow {name}: {} × {} tokens in {:.1} ms = {prefill_tps:.0} tokens/s; {}",
        args.batch,
        args.prompt,
        prefill_s * 1e3,
        match theirs.map(|t| t.prefill_tokens_per_s) {
            Some(t) if t > 0.0 => format!("transformers {name} {t:.0} tokens/s, ratio={:.2}", prefill_tps / t),
            _ => "transformers not measured".to_string(),
        }
    );
    Ok(())
}

/// Decode: warm-up, then the timed rounds; the median ms per step.
fn measure_decode(args: &SpeedBenchArgs, b: &mut CudaBatch, name: &str, theirs: Option<Theirs>) -> Result<f64> {
    b.decode(WARMUP, true)?;
    let (mut round_ms, mut waits) = (Vec::new(), 0);
    for _ in 0..ROUNDS {
        let (secs, w) = b.decode(args.steps, true)?;
        round_ms.push(secs * 1e3 / args.steps as f64);
        waits += w;
    }
    let shown: Vec<String> = round_ms.iter().map(|ms| format!("{ms:.2}")).collect();
    let step_ms = median(round_ms);
    let tps = args.batch as f64 * 1e3 / step_ms;
    let vs = match theirs.map(|t| t.decode_ms_per_step) {
        Some(ms) if ms > 0.0 => {
            let theirs = args.batch as f64 * 1e3 / ms;
            format!("transformers {name} {theirs:.0} tokens/s ({ms:.1} ms/step), ratio={:.2}", tps / theirs)
        }
        _ => "transformers not measured".into(),
    };
    println!(
        "decode       kvflow {name}: {step_ms:.2} ms/step = {tps:.0} tokens/s (batch {}, context {}..{}, median of {ROUNDS} rounds of {} steps: {} ms; {waits} host waits); {}",
        args.batch,
        args.prompt + WARMUP,
        args.prompt + WARMUP + ROUNDS * args.steps,
        args.steps,
        shown.join(", "),
        vs
    );
    Ok(step_ms)
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
fn print_bound(
    args: &SpeedBenchArgs,
    model: &models::Model,
    dtype: Dtype,
    weight_bytes: usize,
    copy_gbps: f64,
    theirs: Option<Theirs>,
    step_ms: f64,
) {
    let name = dtype.name();
    let ctx = args.prompt + WARMUP + ROUNDS * args.steps / 2;
    // the KV cache is in the dtype (kernels/src/cuda/kv.rs); the state stays f32
    let kv_bytes = ctx * model.kv_row_widths().iter().sum::<usize>() * dtype.bytes();
    let state_bytes = 2 * model.state_width() * 4; // read and written
    let bytes = (weight_bytes + args.batch * (kv_bytes + state_bytes)) as f64;
    let flops = 2.0
        * args.batch as f64
        * (model.body_macs_per_token() + model.lm_head_macs() + model.attention_macs(ctx)) as f64;
    let bytes_ms = bytes / (copy_gbps * 1e9) * 1e3;
    let flops_ms = theirs.map(|t| flops / (t.matmul_tflops * 1e12) * 1e3);
    let bound = bytes_ms.max(flops_ms.unwrap_or(0.0));
    println!(
        "bound        {name} decode step: {:.2} GB moved (weights {:.2}, KV {:.2}, state {:.2}) / copy rate = {bytes_ms:.2} ms; {:.1} GFLOP / matmul rate = {}; bound {bound:.2} ms, reached {:.3} of it",
        bytes / 1e9,
        weight_bytes as f64 / 1e9,
        (args.batch * kv_bytes) as f64 / 1e9,
        (args.batch * state_bytes) as f64 / 1e9,
        flops / 1e9,
        flops_ms.map_or("not measured".into(), |ms| format!("{ms:.2} ms")),
        bound / step_ms,
    );
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
