//! `kvflow bench calibrate`: the step table a simulated run prices its steps with (issue 44,
//! `executor_settings.table` of executor `sim`; `kvflow_operators::sim::table`), measured on the
//! GPU with the cuda executor as a rank drives it (`cuda_batch.rs`):
//! - decode steps over `rows` × `context` (deferred output, two steps in flight, CUDA graphs: the
//!   device's time a step when the host keeps it busy);
//! - prefill chunks over `prefill` tokens × `prefix` positions cached before the chunk, one
//!   prompt each, launch to token (a chunk late in a long prompt attends to all its prefix);
//! - prefill steps without a prefix split evenly among `prompts` prompts (what a step's prompt
//!   count costs apart from its tokens);
//! - the host's side: the time the executor's `launch` took the thread at each point, and the
//!   engine's own time a step over the rows it batches — a one-rank pool of the real operators
//!   with an executor that does no math (`bench step`'s pool) — so a simulated rank hands the
//!   device a step no sooner than a real one.
//!
//! - a save's device reads: the rate a chunk's blocks are read off the device at (as the save
//!   thread reads them, on a stream of its own), and a prefill's time beside such reads running
//!   back to back against alone;
//! - the offload tier's memory store: chunks of `STORE_CHUNK_TOKENS` saved and loaded through the
//!   rank's own save and load threads, their rates as a run reports them (bytes over the threads'
//!   time; `store`, which `store = "sim"` takes as `save_gbps` and `load_gbps`);
//! - the device's wake-up: a prefill after an idle gap against one right behind another, over a
//!   few gaps.
//!
//! A step mixing prefill and decode is priced from both grids when the table is read. Every
//! point takes its turn on one executor, sized for the largest (the model is uploaded once).

use super::cuda_batch::{CudaBatch, Turns};
use super::step::engine_seconds_per_step;
use anyhow::{anyhow, Context, Result};
use kvflow_kernels::cuda::Dtype;
use kvflow_kernels::models;
use kvflow_operators::executor::CudaSettings;
use kvflow_operators::sim::table::{EngineHost, IdleCost, MeasuredTable, PrefillSplit, SaveReads, StoreRates};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub struct CalibrateArgs {
    pub model: PathBuf,
    pub gpu: usize,
    pub dtype: Dtype,
    pub prefill: Vec<usize>,
    pub prefix: Vec<usize>,
    pub prompts: Vec<usize>,
    pub rows: Vec<usize>,
    pub context: Vec<usize>,
    /// Decode steps timed at each point (after as many warm-up steps).
    pub steps: usize,
    /// The idle gaps (ms, increasing from 0) the wake-up is measured after.
    pub idle_gaps_ms: Vec<usize>,
    pub out: PathBuf,
    pub emulate: bool,
}

/// Prefill timings at each point: the fastest of this many after a warm-up.
const PREFILL_ROUNDS: usize = 3;

/// The prompt the wake-up is measured on (at most; no longer than the longest prefill point), and
/// the rounds at each gap (the median counts).
const IDLE_PROMPT: usize = 1024;
const IDLE_ROUNDS: usize = 5;

/// The store's chunks: up to `STORE_CHUNKS` of `STORE_CHUNK_TOKENS` out of one prompt, as many
/// as the longest prefill point holds (at least one).
const STORE_CHUNK_TOKENS: usize = 256;
const STORE_CHUNKS: usize = 16;

/// The one executor every point takes its turn on.
struct Device {
    turns: Option<Turns>,
    model: Arc<models::Model>,
}

impl Device {
    /// A batch on the executor (given back with `done`).
    fn batch(&mut self, batch: usize, prompt_len: usize, max_decode: usize) -> Result<CudaBatch> {
        let turns = self.turns.take().ok_or_else(|| anyhow!("two calibration batches on one executor at once"))?;
        CudaBatch::on(turns, &self.model, batch, prompt_len, max_decode)
    }

    fn done(&mut self, batch: CudaBatch) {
        self.turns = Some(batch.done());
    }
}

pub fn run(args: &CalibrateArgs) -> Result<()> {
    let increasing = |v: &[usize], from: usize| !v.is_empty() && v.windows(2).all(|w| w[0] < w[1]) && v[0] >= from;
    if !increasing(&args.prefill, 1)
        || !increasing(&args.rows, 1)
        || !increasing(&args.context, 1)
        || !increasing(&args.prefix, 0)
        || !increasing(&args.prompts, 1)
        || args.prompts[0] != 1
        || !increasing(&args.idle_gaps_ms, 0)
        || args.idle_gaps_ms[0] != 0
        || args.steps == 0
    {
        return Err(anyhow!(
            "--prefill, --rows and --context take increasing whole numbers of at least 1, --prefix increasing whole \
             numbers from 0, --prompts increasing from 1, --idle-gaps increasing from 0; --steps at least 1"
        ));
    }
    let model = Arc::new(models::load(&args.model).with_context(|| format!("loading {}", args.model.display()))?);
    let settings = CudaSettings::on_gpu(args.gpu, args.emulate, args.dtype);
    println!("== calibrate {} in {}", args.model.display(), args.dtype.name());
    let idle_prompt = IDLE_PROMPT.min(args.prefill.last().copied().unwrap_or(IDLE_PROMPT));
    let store_chunks = (args.prefill.last().copied().unwrap_or(0) / STORE_CHUNK_TOKENS).clamp(1, STORE_CHUNKS);
    let mut shapes: Vec<(usize, usize, usize)> = vec![(1, idle_prompt, 1), (1, store_chunks * STORE_CHUNK_TOKENS, 1)];
    shapes.extend(args.rows.iter().flat_map(|&r| args.context.iter().map(move |&c| (r, c, 2 * args.steps))));
    shapes.extend(args.prefill.iter().flat_map(|&t| args.prefix.iter().map(move |&x| (1, x + t, 1))));
    shapes.extend(args.prefill.iter().flat_map(|&t| args.prompts.iter().map(move |&n| (n, (t / n).max(1), 1))));
    let mut device = Device { turns: Some(Turns::new(&model, &settings, &shapes)?), model: model.clone() };
    let mut table = MeasuredTable {
        decode_rows: args.rows.clone(),
        context: args.context.clone(),
        decode_seconds: Vec::new(),
        prefill_tokens: args.prefill.clone(),
        prefill_prefix: args.prefix.clone(),
        prefill_seconds: Vec::new(),
        decode_launch_seconds: Vec::new(),
        prefill_launch_seconds: Vec::new(),
        engine: None,
        idle: None,
        prefill_split: None,
        save_reads: None,
        store: None,
    };
    for &rows in &args.rows {
        for &context in &args.context {
            let mut b = device.batch(rows, context, 2 * args.steps)?;
            b.prefill()?;
            b.decode(args.steps, true)?; // warm-up: the shape's CUDA graph is captured
            b.launch_seconds = 0.0;
            let (seconds, _) = b.decode(args.steps, true)?;
            let (step, launch) = (seconds / args.steps as f64, b.launch_seconds / args.steps as f64);
            println!(
                "decode   rows {rows:>5} context {context:>6}: {:8.3} ms a step, launch {:.3} ms",
                step * 1e3,
                launch * 1e3
            );
            table.decode_seconds.push(step);
            table.decode_launch_seconds.push(launch);
            device.done(b);
        }
    }
    for &tokens in &args.prefill {
        for &prefix in &args.prefix {
            let mut b = device.batch(1, prefix + tokens, 1)?;
            if prefix > 0 {
                b.prefill_prefix(prefix)?;
            }
            b.prefill_rest(prefix)?; // warm-up
            let (mut best, mut launch) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..PREFILL_ROUNDS {
                b.launch_seconds = 0.0;
                best = best.min(b.prefill_rest(prefix)?);
                launch = launch.min(b.launch_seconds);
            }
            println!(
                "prefill {tokens:>6} tokens after {prefix:>6}: {:8.3} ms ({:.0} tokens/s), launch {:.3} ms",
                best * 1e3,
                tokens as f64 / best,
                launch * 1e3
            );
            table.prefill_seconds.push(best);
            table.prefill_launch_seconds.push(launch);
            device.done(b);
        }
    }
    table.prefill_split = Some(prefill_split(&mut device, &args.prefill, &args.prompts)?);
    let mut engine = EngineHost { rows: args.rows.clone(), seconds: Vec::new() };
    for &rows in &args.rows {
        let seconds = engine_seconds_per_step(rows)?;
        println!("engine   rows {rows:>5}: {:.3} ms a step (the pool's own work, no math)", seconds * 1e3);
        engine.seconds.push(seconds);
    }
    table.engine = Some(engine);
    table.idle = Some(idle_cost(&mut device, idle_prompt, &args.idle_gaps_ms)?);
    if model.needs_blocks() {
        table.save_reads = Some(save_reads(&mut device, idle_prompt)?);
        table.store = Some(store_rates(&mut device, store_chunks)?);
    }
    table.validate().map_err(|e| anyhow!("the measured table: {e}"))?;
    let mut json = serde_json::to_value(&table)?;
    json["model"] = args.model.display().to_string().into();
    json["dtype"] = args.dtype.name().into();
    json["measured"] = "kvflow bench calibrate (cuda executor, deferred output, CUDA graphs)".into();
    let text = serde_json::to_string_pretty(&json)?;
    std::fs::write(&args.out, text).with_context(|| format!("cannot write {}", args.out.display()))?;
    println!("wrote    {}", args.out.display());
    Ok(())
}

/// Prefill steps of each of `tokens` split evenly among each of `prompts` (the fastest of
/// `PREFILL_ROUNDS` after a warm-up; a split leaving a prompt no token is timed as one token a
/// prompt).
fn prefill_split(device: &mut Device, tokens: &[usize], prompts: &[usize]) -> Result<PrefillSplit> {
    let mut seconds = Vec::new();
    for &total in tokens {
        for &n in prompts {
            let mut b = device.batch(n, (total / n).max(1), 1)?;
            b.prefill()?; // warm-up
            let best =
                (0..PREFILL_ROUNDS).map(|_| b.prefill()).try_fold(f64::INFINITY, |best, t| t.map(|t| best.min(t)))?;
            println!("prefill {total:>6} tokens over {n:>3} prompts: {:8.3} ms", best * 1e3);
            seconds.push(best);
            device.done(b);
        }
    }
    Ok(PrefillSplit { prompts: prompts.to_vec(), seconds })
}

/// A save's device reads (`SaveReads`): chunks of `SAVE_CHUNK_TOKENS` (or the prompt's blocks)
/// read back to back alone, then the median of `IDLE_ROUNDS` prefills of `prompt` tokens beside
/// such reads against alone.
fn save_reads(device: &mut Device, prompt: usize) -> Result<SaveReads> {
    const SAVE_CHUNK_TOKENS: usize = 256;
    const READS: usize = 20;
    let mut b = device.batch(1, prompt, 1)?;
    b.prefill()?;
    let kv = b.ex.shared_kv().clone();
    let blocks: Vec<u32> = (0..(SAVE_CHUNK_TOKENS.min(prompt) / 16).max(1) as u32).collect();
    let read = || kv.read(&blocks, None).map(|floats| floats.len() * 4).map_err(|e| anyhow!("a save's read: {e}"));
    read()?; // warm-up
    let t = Instant::now();
    let bytes: usize = (0..READS).map(|_| read()).sum::<Result<usize>>()?;
    let read_bytes_per_s = bytes as f64 / t.elapsed().as_secs_f64();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let alone = median((0..IDLE_ROUNDS).map(|_| b.prefill()).collect::<Result<_>>()?);
    let stop = AtomicBool::new(false);
    let beside = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                read()?;
            }
            Ok::<(), anyhow::Error>(())
        });
        let times = (0..IDLE_ROUNDS).map(|_| b.prefill()).collect::<Result<Vec<f64>>>();
        stop.store(true, Ordering::Relaxed);
        reader.join().map_err(|_| anyhow!("the save reader panicked"))??;
        times.map(median)
    })?;
    device.done(b);
    let step_slowdown = (beside / alone).max(1.0);
    println!(
        "save     reads at {:.2} GB/s; a {prompt}-token prefill beside them {:.3} ms, alone {:.3} ms ({step_slowdown:.2}x)",
        read_bytes_per_s / 1e9,
        beside * 1e3,
        alone * 1e3
    );
    Ok(SaveReads { read_bytes_per_s, step_slowdown })
}

/// The memory store's save and load rates: `chunks` chunks of a prefilled prompt saved through a
/// save thread (read off the device, encoded, stored) and loaded back through a load thread, as
/// a rank's are.
fn store_rates(device: &mut Device, chunks: usize) -> Result<StoreRates> {
    use kvflow_operators::kv_source::{BlockStore, KvSource};
    use kvflow_operators::offload::{spawn_loader, spawn_saver, ChunkKey, Digest, LoadJob, Namespace, SaveJob};
    use kvflow_operators::offload::{MemoryStore, ObjectStore, SaveOutcome, SavePayload};
    use kvflow_operators::pool::wake::RankWaker;
    let chunk_blocks = STORE_CHUNK_TOKENS / 16;
    let model = device.model.clone();
    let mut b = device.batch(1, chunks * STORE_CHUNK_TOKENS, 1)?;
    b.prefill()?;
    let kv = b.ex.shared_kv().clone();
    let floats_per_block = kv.read(&[0], None).map_err(|e| anyhow!("a save's read: {e}"))?.len();
    let store: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new(1 << 40));
    let waker = Arc::new(RankWaker::default());
    let key = |c: usize| ChunkKey { namespace: Namespace(1), shard: 0, shards: 1, digest: Digest([c as u64, 7]) };
    let zero = std::time::Duration::ZERO;
    let saver =
        spawn_saver(store.clone(), 0, waker.clone(), zero, "kvflow-calibrate-save".into()).map_err(|e| anyhow!(e))?;
    for c in 0..chunks {
        let blocks = (c * chunk_blocks..(c + 1) * chunk_blocks).map(|b| b as u32).collect();
        let source = KvSource { store: BlockStore::Device(kv.clone()), blocks, floats_per_block, marks: None };
        let state = model.needs_slots().then(|| vec![0.0f32; model.state_width()]);
        saver.submit(SaveJob {
            id: c as u64,
            key: key(c),
            payload: SavePayload::Blocks { source, state },
            hashes: vec![],
        });
    }
    let (mut saved, mut save_seconds) = (0u64, 0.0);
    for done in wait_for(|| saver.returns.take(), chunks)? {
        let SaveOutcome::Stored { bytes, seconds } = done.outcome else {
            return Err(anyhow!("a calibration save was not stored: {:?}", done.outcome));
        };
        (saved, save_seconds) = (saved + bytes, save_seconds + seconds);
    }
    let loader = spawn_loader(store, waker, zero, "kvflow-calibrate-load".into()).map_err(|e| anyhow!(e))?;
    for c in 0..chunks {
        loader.submit(LoadJob { id: c as u64, keys: vec![key(c)] });
    }
    let (mut loaded, mut load_seconds) = (0u64, 0.0);
    for done in wait_for(|| loader.returns.take(), chunks)? {
        let got = done.outcome.map_err(|e| anyhow!("a calibration load failed: {e}"))?;
        (loaded, load_seconds) = (loaded + got.bytes, load_seconds + got.seconds);
    }
    device.done(b);
    let rates = StoreRates {
        chunk_tokens: STORE_CHUNK_TOKENS,
        save_bytes_per_s: saved as f64 / save_seconds.max(1e-9),
        load_bytes_per_s: loaded as f64 / load_seconds.max(1e-9),
    };
    println!(
        "store    memory, {STORE_CHUNK_TOKENS}-token chunks of {} bytes: save {:.2} GB/s, load {:.2} GB/s",
        saved / chunks as u64,
        rates.save_bytes_per_s / 1e9,
        rates.load_bytes_per_s / 1e9
    );
    Ok(rates)
}

/// The first `n` records of a save or load thread, waited for (at most a minute).
fn wait_for<D>(mut take: impl FnMut() -> Vec<D>, n: usize) -> Result<Vec<D>> {
    let (mut got, since) = (Vec::new(), Instant::now());
    while got.len() < n {
        if since.elapsed().as_secs() > 60 {
            return Err(anyhow!("{} of {n} store operations finished within a minute", got.len()));
        }
        got.extend(take());
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Ok(got)
}

/// The extra time of a prefill that starts after the device sat idle `gaps_ms` (the first 0):
/// the median at each gap less the median right behind another step (never below 0).
fn idle_cost(device: &mut Device, prompt: usize, gaps_ms: &[usize]) -> Result<IdleCost> {
    let gaps_us: Vec<usize> = gaps_ms.iter().map(|ms| ms * 1000).collect();
    let mut b = device.batch(1, prompt, 1)?;
    b.prefill()?;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut at_gap = Vec::new();
    for &gap in &gaps_us {
        let mut times = Vec::new();
        for _ in 0..IDLE_ROUNDS {
            if gap == 0 {
                b.prefill()?; // right behind another
            } else {
                std::thread::sleep(std::time::Duration::from_micros(gap as u64));
            }
            times.push(b.prefill()?);
        }
        at_gap.push(median(times));
    }
    device.done(b);
    let warm = at_gap[0];
    let extra: Vec<f64> = at_gap.iter().map(|t| (t - warm).max(0.0)).collect();
    for (gap, extra) in gaps_us.iter().zip(&extra) {
        println!("idle     {:>6} ms before a {prompt}-token prefill: {:+.3} ms", gap / 1000, extra * 1e3);
    }
    Ok(IdleCost { gap_us: gaps_us, extra_seconds: extra })
}
