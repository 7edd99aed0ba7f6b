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
    let (warmup, rounds, profiled) = (4, 3, 8);
    // the timed rounds, then one round launched directly (no graphs), then the profiled steps
    let decode_steps = warmup + (rounds + 1) * args.steps + profiled;
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
    let copy_gbps = match *copy_gbps {
        Some(rate) => rate,
        None => {
            let rate = copy_rate(&gpu)?;
            println!("limits       device-to-device copy {rate:.0} GB/s (read + write, median of 5 rounds)");
            if let Some(bl) = baseline {
                println!(
                    "limits       torch.matmul 8192²: float32 {:.1} TFLOP/s, bfloat16 {:.1} TFLOP/s [transformers {}, torch {}]",
                    bl.matmul_tflops_float32, bl.matmul_tflops_bfloat16, bl.transformers, bl.torch
                );
            }
            *copy_gbps = Some(rate);
            rate
        }
    };
    let torch_figures = |bl: &Baseline| -> (f64, f64, f64) {
        let f = if dtype == Dtype::Bfloat16 { &bl.bfloat16 } else { &bl.float32 };
        let rate = if dtype == Dtype::Bfloat16 { bl.matmul_tflops_bfloat16 } else { bl.matmul_tflops_float32 };
        (f.prefill_tokens_per_s, f.decode_ms_per_step, rate)
    };
    let theirs = baseline.map(torch_figures);

    // prefill: every prompt in one step, the median of three after a warm-up
    b.prefill()?;
    let prefill_s = median((0..rounds).map(|_| b.prefill()).collect::<Result<Vec<f64>>>()?);
    let prefill_tps = (args.batch * args.prompt) as f64 / prefill_s;
    println!(
        "prefill      kvflow {name}: {} × {} tokens in {:.1} ms = {prefill_tps:.0} tokens/s; {}",
        args.batch,
        args.prompt,
        prefill_s * 1e3,
        match theirs {
            Some((t, _, _)) if t > 0.0 => format!("transformers {name} {t:.0} tokens/s, ratio={:.2}", prefill_tps / t),
            _ => "transformers not measured".to_string(),
        }
    );

    // decode: warm-up, then the timed rounds
    b.decode(warmup, true)?;
    let (mut round_ms, mut waits) = (Vec::new(), 0);
    for _ in 0..rounds {
        let (secs, w) = b.decode(args.steps, true)?;
        round_ms.push(secs * 1e3 / args.steps as f64);
        waits += w;
    }
    let shown: Vec<String> = round_ms.iter().map(|ms| format!("{ms:.2}")).collect();
    let step_ms = median(round_ms);
    let tps = args.batch as f64 * 1e3 / step_ms;
    let vs = match theirs {
        Some((_, ms, _)) if ms > 0.0 => {
            let theirs = args.batch as f64 * 1e3 / ms;
            format!("transformers {name} {theirs:.0} tokens/s ({ms:.1} ms/step), ratio={:.2}", tps / theirs)
        }
        _ => "transformers not measured".into(),
    };
    println!(
        "decode       kvflow {name}: {step_ms:.2} ms/step = {tps:.0} tokens/s (batch {}, context {}..{}, median of {rounds} rounds of {} steps: {} ms; {waits} host waits); {}",
        args.batch,
        args.prompt + warmup,
        args.prompt + warmup + rounds * args.steps,
        args.steps,
        shown.join(", "),
        vs
    );

    // the same steps with every launch made from the host (no captured graphs), right after
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

    // the decode step's lower bound at the mean context of the timed steps
    let ctx = args.prompt + warmup + rounds * args.steps / 2;
    // the KV cache is in the dtype (kernels/src/cuda/kv.rs); the state stays f32
    let kv_bytes = ctx * model.kv_row_widths().iter().sum::<usize>() * dtype.bytes();
    let state_bytes = 2 * model.state_width() * 4; // read and written
    let bytes = (weight_bytes + args.batch * (kv_bytes + state_bytes)) as f64;
    let flops = 2.0
        * args.batch as f64
        * (model.body_macs_per_token() + model.lm_head_macs() + model.attention_macs(ctx)) as f64;
    let bytes_ms = bytes / (copy_gbps * 1e9) * 1e3;
    let flops_ms = theirs.map(|(_, _, tflops)| flops / (tflops * 1e12) * 1e3);
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

    // where a decode step's device time goes, then a prefill's
    if !gpu.is_emulated() {
        gpu.start_profile();
        b.decode(profiled, true)?;
        print_profile(&format!("{profiled} decode steps"), profiled, &gpu.take_profile()?);
        gpu.start_profile();
        b.prefill()?;
        print_profile("1 prefill step", 1, &gpu.take_profile()?);
    }
    Ok(())
}

/// Device-to-device copy of 1 GiB (16 MiB emulated), GB/s counting read and write.
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
