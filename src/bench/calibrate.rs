//! `kvflow bench calibrate`: the step table a simulated run prices its steps with (issue 44,
//! `executor_settings.table` of executor `sim`), measured on the GPU with the cuda executor as a
//! rank drives it (`cuda_batch.rs`). Decode steps are timed over `rows` × `context` (deferred
//! output, two steps in flight, CUDA graphs: the device's time a step when the host keeps it
//! busy); prefill steps over `prefill` tokens, one prompt each, launch to token. A step mixing
//! both is priced as the prefill plus the decode less one pass over the weights (the step reads
//! them once): measured only at its ends.
//!
//! The host's side too: the time the executor's `launch` took the thread at each point (a mixed
//! step is one launch: the larger part's), and the engine's own time a step over the rows it
//! batches — a one-rank pool of the real operators with an executor that does no math
//! (`bench step`'s pool) — so a simulated rank hands the device a step no sooner than a real one.

use super::cuda_batch::CudaBatch;
use super::step::engine_seconds_per_step;
use anyhow::{anyhow, Context, Result};
use kvflow_kernels::cuda::Dtype;
use kvflow_kernels::models;
use kvflow_operators::executor::CudaSettings;
use kvflow_operators::sim::table::{EngineHost, MeasuredTable};
use std::path::PathBuf;
use std::sync::Arc;

pub struct CalibrateArgs {
    pub model: PathBuf,
    pub gpu: usize,
    pub dtype: Dtype,
    pub prefill: Vec<usize>,
    pub rows: Vec<usize>,
    pub context: Vec<usize>,
    /// Decode steps timed at each point (after as many warm-up steps).
    pub steps: usize,
    pub out: PathBuf,
    pub emulate: bool,
}

/// Prefill timings at each point: the fastest of this many after a warm-up.
const PREFILL_ROUNDS: usize = 3;

pub fn run(args: &CalibrateArgs) -> Result<()> {
    let increasing = |v: &[usize]| !v.is_empty() && v.windows(2).all(|w| w[0] < w[1]) && v[0] > 0;
    if !increasing(&args.prefill) || !increasing(&args.rows) || !increasing(&args.context) || args.steps == 0 {
        return Err(anyhow!(
            "--prefill, --rows and --context take increasing whole numbers of at least 1; --steps at least 1"
        ));
    }
    let model = Arc::new(models::load(&args.model).with_context(|| format!("loading {}", args.model.display()))?);
    let settings = CudaSettings::on_gpu(args.gpu, args.emulate, args.dtype);
    println!("== calibrate {} in {}", args.model.display(), args.dtype.name());
    let (mut decode, mut decode_host) = (Vec::new(), Vec::new()); // [r][c]
    for &rows in &args.rows {
        let (mut line, mut host_line) = (Vec::new(), Vec::new());
        for &context in &args.context {
            let mut b = CudaBatch::new(&model, &settings, rows, context, 2 * args.steps)?;
            b.prefill()?;
            b.decode(args.steps, true)?; // warm-up: the shape's CUDA graph is captured
            b.launch_seconds = 0.0;
            let (seconds, _) = b.decode(args.steps, true)?;
            let (step, host) = (seconds / args.steps as f64, b.launch_seconds / args.steps as f64);
            println!(
                "decode       rows {rows:>4} context {context:>6}: {:.3} ms a step, launch {:.3} ms",
                step * 1e3,
                host * 1e3
            );
            line.push(step);
            host_line.push(host);
        }
        decode.push(line);
        decode_host.push(host_line);
    }
    let (mut prefill, mut prefill_host) = (Vec::new(), Vec::new());
    for &tokens in &args.prefill {
        let mut b = CudaBatch::new(&model, &settings, 1, tokens, 1)?;
        b.prefill()?;
        let (mut best, mut host) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..PREFILL_ROUNDS {
            b.launch_seconds = 0.0;
            best = best.min(b.prefill()?);
            host = host.min(b.launch_seconds);
        }
        println!(
            "prefill      {tokens:>6} tokens: {:.3} ms ({:.0} tokens/s), launch {:.3} ms",
            best * 1e3,
            tokens as f64 / best,
            host * 1e3
        );
        prefill.push(best);
        prefill_host.push(host);
    }
    let mut engine = EngineHost { rows: args.rows.clone(), seconds: Vec::new() };
    for &rows in &args.rows {
        let seconds = engine_seconds_per_step(rows)?;
        println!("engine       rows {rows:>4}: {:.3} ms a step (the pool's own work, no math)", seconds * 1e3);
        engine.seconds.push(seconds);
    }
    let mut table = table_of(args, &prefill, &decode);
    table.host_seconds = grid(args, &prefill_host, &decode_host, f64::max);
    table.engine = Some(engine);
    table.validate().map_err(|e| anyhow!("the measured table: {e}"))?;
    let text = serde_json::to_string_pretty(&serde_json::json!({
        "prefill_tokens": table.prefill_tokens,
        "decode_rows": table.decode_rows,
        "context": table.context,
        "seconds": table.seconds,
        "host_seconds": table.host_seconds,
        "engine": table.engine,
        "model": args.model.display().to_string(),
        "dtype": args.dtype.name(),
        "measured": "kvflow bench calibrate (cuda executor, deferred output, CUDA graphs)",
    }))?;
    std::fs::write(&args.out, text).with_context(|| format!("cannot write {}", args.out.display()))?;
    println!("wrote        {}", args.out.display());
    Ok(())
}

/// The grid: a 0 point on the prefill and rows axes (no work of that kind), the prefill times
/// along the first, the decode times over the other two, and mixed points as the sum less one
/// weight pass (the lightest decode step), never below either part.
fn table_of(args: &CalibrateArgs, prefill: &[f64], decode: &[Vec<f64>]) -> MeasuredTable {
    let axis = |v: &[usize]| std::iter::once(0).chain(v.iter().copied()).collect::<Vec<_>>();
    let weights = decode.iter().flatten().copied().fold(f64::INFINITY, f64::min);
    MeasuredTable {
        prefill_tokens: axis(&args.prefill),
        decode_rows: axis(&args.rows),
        context: args.context.clone(),
        seconds: grid(args, prefill, decode, |pre, dec| (pre + dec - weights).max(pre.max(dec))),
        host_seconds: Vec::new(),
        engine: None,
    }
}

/// The table's grid of `prefill` (over prefill tokens) and `decode` (over rows × context)
/// figures: 0 where a step has no work of a kind, `mix` of both where it has both.
fn grid(args: &CalibrateArgs, prefill: &[f64], decode: &[Vec<f64>], mix: impl Fn(f64, f64) -> f64) -> Vec<f64> {
    let mut values = Vec::new();
    for p in 0..=args.prefill.len() {
        for r in 0..=args.rows.len() {
            for c in 0..args.context.len() {
                let pre = if p == 0 { 0.0 } else { prefill[p - 1] };
                let dec = if r == 0 { 0.0 } else { decode[r - 1][c] };
                values.push(if p > 0 && r > 0 { mix(pre, dec) } else { pre + dec });
            }
        }
    }
    values
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mixed_step_is_priced_as_its_parts_less_one_weight_pass() {
        let args = CalibrateArgs {
            model: PathBuf::new(),
            gpu: 0,
            dtype: Dtype::Bfloat16,
            prefill: vec![64],
            rows: vec![1, 8],
            context: vec![256, 1024],
            steps: 1,
            out: PathBuf::new(),
            emulate: true,
        };
        // decode[r][c]: the lightest step (1 row, 256) is the weight pass
        let decode = vec![vec![1.0, 1.5], vec![2.0, 4.0]];
        let t = table_of(&args, &[3.0], &decode);
        t.validate().unwrap();
        assert_eq!((t.prefill_tokens.clone(), t.decode_rows.clone()), (vec![0, 64], vec![0, 1, 8]));
        assert_eq!(t.at(0, 8, 1024), 4.0, "a decode point as measured");
        assert_eq!(t.at(64, 0, 256), 3.0, "a prefill point as measured");
        assert_eq!(t.at(64, 8, 1024), 3.0 + 4.0 - 1.0, "both, one weight pass less");
        assert_eq!(t.at(64, 1, 256), 3.0, "never below the larger part");
    }
}
