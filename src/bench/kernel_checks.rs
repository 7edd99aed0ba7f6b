//! Checks of the tensor-core kernels that `bench device` runs on the GPU and the tests run under
//! the emulation: the same launches, compared bit for bit where the design promises the same bits
//! and against a float64 reference where it promises closeness.
//!
//! - [`attention_check`] (`kernels/cuda/attention.cu`, heads of 32, 64 and 80 wide — the last on
//!   the 128-wide kernel, zero-padded): a row's output is the same bits whole, in a
//!   chunk, alone with its parts split over blocks and merged, and among other sequences — with
//!   and without a sliding window — and within 1e-2 (relative L2) of a float64 softmax over the
//!   same bf16 keys and values.
//! - [`product_check`] (`kernels/cuda/bf16.cu`): `linear_bf16`, `linear_bf16_wide` and the split
//!   (summed by `linear_chunks_sum`, or by each tile's last block) give every element the same
//!   bits, within 1e-4 of a float64 product of the same bf16 values.

use anyhow::{bail, Result};
use kvflow_kernels::cuda::sources::{flash_shared, WIDE_SHARED};
use kvflow_kernels::cuda::{bf16_bits, Arg, DeviceBuf, Gpu};

const KV_HEADS: usize = 2;
const Q_HEADS: usize = 8;
const BLOCK: usize = 16;
/// attention.cu's mma rows a warp, and FA_PART.
const WARP_ROWS: usize = 16;
const FA_PART: usize = 256;

/// The head width `d` and the kernel instance (the widest head it holds) a case runs.
#[derive(Clone, Copy)]
struct Heads {
    d: usize,
    kernel_width: usize,
}

impl Heads {
    /// A cache row: every kv head's key, then every kv head's value.
    fn row_width(&self) -> usize {
        2 * KV_HEADS * self.d
    }

    /// Floats of q (and of the output) per row.
    fn per_row(&self) -> usize {
        Q_HEADS * self.d
    }
}

fn lcg(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 33) % 2001) as f32 / 1000.0 - 1.0
    }
}

fn widen(b: u16) -> f64 {
    f32::from_bits((b as u32) << 16) as f64
}

/// How many of `a` and `b` differ in their bits, and the first (None: the same bits).
fn differ(a: &[f32], b: &[f32]) -> Option<String> {
    let n = a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
    let first = a.iter().zip(b).position(|(x, y)| x.to_bits() != y.to_bits());
    (n > 0 || a.len() != b.len())
        .then(|| format!("{n} of {} values differ (the first at {first:?})", a.len().max(b.len())))
}

fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (*g as f64 - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// A paged bf16 cache and the sequences' block tables (scattered blocks).
struct Cache {
    data: DeviceBuf<u16>,
    host: Vec<u16>,
    tables: Vec<Vec<u32>>,
    heads: Heads,
}

impl Cache {
    fn new(gpu: &Gpu, lengths: &[usize], heads: Heads) -> Result<Cache> {
        let blocks: usize = lengths.iter().map(|l| l.div_ceil(BLOCK)).sum();
        let mut draw = lcg(3);
        let host: Vec<u16> = (0..blocks * BLOCK * heads.row_width()).map(|_| bf16_bits(draw())).collect();
        let mut order: Vec<u32> = (0..blocks as u32).map(|b| (b * 7 + 3) % blocks as u32).collect();
        let tables = lengths.iter().map(|l| order.drain(..l.div_ceil(BLOCK)).collect()).collect();
        Ok(Cache { data: gpu.upload(&host)?, host, tables, heads })
    }

    /// The float64 softmax attention of one row at `pos` of sequence `seq` (q rounded to bf16).
    fn reference(&self, seq: usize, pos: usize, window: usize, q: &[f32]) -> Vec<f64> {
        let (width, row_width) = (self.heads.d, self.heads.row_width());
        let lo = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
        let at = |key: usize| (self.tables[seq][key / BLOCK] as usize * BLOCK + key % BLOCK) * row_width;
        let mut out = vec![0.0f64; Q_HEADS * width];
        for h in 0..Q_HEADS {
            let g = h / (Q_HEADS / KV_HEADS);
            let qh: Vec<f64> = q[h * width..(h + 1) * width].iter().map(|&x| widen(bf16_bits(x))).collect();
            let scores: Vec<f64> = (lo..=pos)
                .map(|k| {
                    (0..width).map(|col| qh[col] * widen(self.host[at(k) + g * width + col])).sum::<f64>()
                        / (width as f64).sqrt()
                })
                .collect();
            let big = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - big).exp()).collect();
            let total: f64 = weights.iter().sum();
            for col in 0..width {
                let v: f64 = (lo..=pos)
                    .zip(&weights)
                    .map(|(k, w)| w * widen(self.host[at(k) + (KV_HEADS + g) * width + col]))
                    .sum();
                out[h * width + col] = v / total;
            }
        }
        out
    }
}

/// A `flash_attention_*` kernel (blocks of `warps` warps: 4, or 1 for `…x1`) over one launch's
/// rows — per sequence, its table and the positions of its (consecutive) rows — as
/// parts/attention.rs launches it (grid bound; split and merged or not): the output,
/// `[row][head][d]`.
#[allow(clippy::too_many_arguments)]
fn attend(
    gpu: &Gpu,
    cache: &Cache,
    seqs: &[(usize, std::ops::Range<usize>)],
    window: usize,
    split: bool,
    warps: usize,
    q: &[f32],
) -> Result<Vec<f32>> {
    let (mut positions, mut row_at, mut tables, mut table_at) = (vec![], vec![], vec![], vec![]);
    for (seq, range) in seqs {
        row_at.push(positions.len() as u32);
        table_at.push(tables.len() as u32);
        tables.extend_from_slice(&cache.tables[*seq]);
        positions.extend(range.clone().map(|p| p as i32));
    }
    let heads = cache.heads;
    let (width, per_row) = (heads.d, heads.per_row());
    let rows = positions.len();
    let tiles = seqs.len() + (rows - seqs.len()) / (WARP_ROWS * warps / (Q_HEADS / KV_HEADS));
    let parts = seqs.iter().map(|(_, r)| r.end).max().unwrap_or(1).div_ceil(FA_PART);
    let out = gpu.zeros::<f32>(rows * per_row)?;
    let scratch = gpu.zeros::<f32>(rows * Q_HEADS * parts * (width + 2))?;
    let q = gpu.upload(&q[..rows * per_row])?;
    let (tables, table_at, row_at) = (gpu.upload(&tables)?, gpu.upload(&table_at)?, gpu.upload(&row_at)?);
    let positions = gpu.upload(&positions)?;
    let args = [
        Arg::Ptr(out.ptr()),
        Arg::Ptr(scratch.ptr()),
        Arg::Ptr(q.ptr()),
        Arg::I64(per_row as i64),
        Arg::Ptr(cache.data.ptr()),
        Arg::Ptr(tables.ptr()),
        Arg::Ptr(table_at.ptr()),
        Arg::Ptr(positions.ptr()),
        Arg::Ptr(row_at.ptr()),
        Arg::I32(seqs.len() as i32),
        Arg::I32(rows as i32),
        Arg::I32(Q_HEADS as i32),
        Arg::I32(KV_HEADS as i32),
        Arg::I32(width as i32),
        Arg::I32(0),
        Arg::I32((KV_HEADS * width) as i32),
        Arg::I32(heads.row_width() as i32),
        Arg::I32(BLOCK as i32),
        Arg::I32(window as i32),
        Arg::F32(1.0 / (width as f32).sqrt()),
        Arg::I32((Q_HEADS / KV_HEADS) as i32),
        Arg::I32(split as i32),
    ];
    let grid = (tiles as u32, KV_HEADS as u32, if split { parts as u32 } else { 1 });
    let kernel = format!("flash_attention_{}", heads.kernel_width);
    let kernel = if warps == 1 { format!("{kernel}x1") } else { kernel };
    gpu.launch(&kernel, grid, 32 * warps as u32, flash_shared(heads.kernel_width, warps == 1), &args)?;
    if split {
        let merge = [Arg::Ptr(out.ptr()), Arg::Ptr(scratch.ptr()), Arg::I32(width as i32), Arg::I32(parts as i32)];
        gpu.launch("flash_attention_merge", ((rows * Q_HEADS) as u32, 1, 1), 64, 0, &merge)?;
    }
    Ok(gpu.download(&out, rows * per_row)?)
}

/// Row `i` of an attention output (every head), `per_row` floats a row.
fn row(out: &[f32], per_row: usize, i: usize) -> &[f32] {
    &out[i * per_row..(i + 1) * per_row]
}

/// The cases: the common head width, the widest kernel (over 48 KiB of shared memory) with a
/// head it zero-pads, and a narrow one.
const ATTENTION_CASES: [Heads; 3] =
    [Heads { d: 64, kernel_width: 64 }, Heads { d: 80, kernel_width: 128 }, Heads { d: 32, kernel_width: 32 }];

/// Per case, a prompt of 600 tokens (three parts of keys for its last rows) among three other
/// sequences, and a decode at 4,200 keys (17 parts: more than flash_attention_merge reads at
/// once): see the module's header. Returns what failed.
pub fn attention_check(gpu: &Gpu) -> Result<Vec<String>> {
    let mut failures = Vec::new();
    let mut worst = 0.0f64;
    for heads in ATTENTION_CASES {
        worst = worst.max(attention_case(gpu, heads, &mut failures)?);
    }
    println!(
        "attention    tensor cores (flash_attention_{{32,64,128}} and their one-warp x1, d 32, 64, 80): a row whole = in a chunk = alone split = among other sequences, window 0 and 100: {}; max {worst:.2e} from a float64 softmax",
        if failures.is_empty() { "bit-identical" } else { "DIFFERENT" }
    );
    Ok(failures)
}

fn attention_case(gpu: &Gpu, heads: Heads, failures: &mut Vec<String>) -> Result<f64> {
    let cache = Cache::new(gpu, &[600, 40, 300, 5, 4200], heads)?;
    let per_row = heads.per_row();
    let mut draw = lcg(5);
    let q: Vec<f32> = (0..600 * per_row).map(|_| draw()).collect();
    let name = format!("attention (d {} on flash_attention_{})", heads.d, heads.kernel_width);
    let check = |failures: &mut Vec<String>, what: String, a: &[f32], b: &[f32]| {
        if let Some(why) = differ(a, b) {
            failures.push(format!("{name}: {what}: {why}"));
        }
    };
    let mut worst = 0.0f64;
    for window in [0, 100] {
        let whole = attend(gpu, &cache, &[(0, 0..600)], window, false, 4, &q)?;
        for (split, warps) in [(false, 4), (true, 4), (false, 1), (true, 1)] {
            let chunk = attend(gpu, &cache, &[(0, 593..600)], window, split, warps, &q[593 * per_row..])?;
            for i in 0..7 {
                let what = format!("window {window}, split {split}, {warps} warps: row {} in a chunk of 7", 593 + i);
                check(failures, what, row(&chunk, per_row, i), row(&whole, per_row, 593 + i));
            }
        }
        let last = &q[599 * per_row..600 * per_row];
        let alone = attend(gpu, &cache, &[(0, 599..600)], window, true, 1, last)?;
        check(failures, format!("window {window}: a decode alone"), &alone, row(&whole, per_row, 599));
        let mut mixed_q: Vec<f32> = (0..44 * per_row).map(|_| draw()).collect();
        mixed_q[40 * per_row..41 * per_row].copy_from_slice(last);
        let mixed = attend(gpu, &cache, &[(1, 0..40), (0, 599..600), (2, 297..300)], window, false, 4, &mixed_q)?;
        let what = format!("window {window}: among other sequences");
        check(failures, what, row(&mixed, per_row, 40), row(&whole, per_row, 599));
        let long_q: Vec<f32> = (0..per_row).map(|_| draw()).collect();
        let folded = attend(gpu, &cache, &[(4, 4199..4200)], window, false, 1, &long_q)?;
        let merged = attend(gpu, &cache, &[(4, 4199..4200)], window, true, 1, &long_q)?;
        check(failures, format!("window {window}: a decode at 4200 keys split over 17 parts"), &merged, &folded);
        let err = rel_l2(&folded, &cache.reference(4, 4199, window, &long_q));
        worst = worst.max(err);
        if err.is_nan() || err > 1e-2 {
            failures.push(format!("{name}: window {window}, a decode at 4200 keys: {err:.2e} from a float64 softmax"));
        }
        for pos in [0, 17, 255, 256, 599] {
            let want = cache.reference(0, pos, window, &q[pos * per_row..(pos + 1) * per_row]);
            let err = rel_l2(row(&whole, per_row, pos), &want);
            worst = worst.max(err);
            if err.is_nan() || err > 1e-2 {
                failures.push(format!(
                    "{name}: window {window}, position {pos}: {err:.2e} relative from a float64 softmax"
                ));
            }
        }
    }
    Ok(worst)
}

/// `y0 + x · Wᵀ + bias` (`m × n` over `k`, W bf16) through every bf16 product kernel, each from a
/// fresh copy of `y0`, all from x rounded once by `round_rows_bf16`: `linear_bf16`,
/// `linear_bf16_wide`, `linear_bf16_split` summed by `linear_chunks_sum`, and by each tile's last
/// block twice (the counters left zeroed by the first), then with two chunks a block. Each output
/// with the kernel's name.
pub fn bf16_product_outputs(
    gpu: &Gpu,
    (m, n, k): (usize, usize, usize),
    x: &[f32],
    w16: &[u16],
    bias: &[f32],
    y0: &[f32],
) -> Result<Vec<(&'static str, Vec<f32>)>> {
    let (xd, wd, bd) = (gpu.upload(x)?, gpu.upload(w16)?, gpu.upload(bias)?);
    let xb = gpu.zeros::<u16>(m * k)?;
    let round = [Arg::Ptr(xb.ptr()), Arg::Ptr(xd.ptr()), Arg::I32(m as i32), Arg::I32(k as i32), Arg::I64(k as i64)];
    gpu.launch("round_rows_bf16", (m as u32, k.div_ceil(256) as u32, 1), 256, 0, &round)?;
    let tail = [
        Arg::Ptr(bd.ptr()),
        Arg::I32(m as i32),
        Arg::I32(n as i32),
        Arg::I32(k as i32),
        Arg::I64(n as i64),
        Arg::I32(1),
    ];
    // every kernel reads the copy of x rounded once
    let run = |kernel: &str, tile: usize, threads: u32, shared: u32| -> Result<Vec<f32>> {
        let y = gpu.upload(y0)?;
        let head = [Arg::Ptr(y.ptr()), Arg::Ptr(xb.ptr()), Arg::Ptr(wd.ptr())];
        let grid = (n.div_ceil(tile) as u32, m.div_ceil(tile) as u32, 1);
        gpu.launch(kernel, grid, threads, shared, &[&head[..], &tail[..]].concat())?;
        Ok(gpu.download(&y, m * n)?)
    };
    let mut outputs = vec![
        ("linear_bf16", run("linear_bf16", 64, 128, 0)?),
        ("linear_bf16_wide", run("linear_bf16_wide", 128, 256, WIDE_SHARED)?),
    ];
    let chunks = k.div_ceil(256);
    let partial = gpu.zeros::<f32>(chunks * m * n)?;
    let arrivals = gpu.zeros::<u32>(n.div_ceil(64) * m.div_ceil(64))?;
    // `group` chunks a block (the last group shorter where it does not divide)
    let split = |y: u64, counters: u64, group: usize| -> Result<()> {
        let grid = (n.div_ceil(64) as u32, m.div_ceil(64) as u32, chunks.div_ceil(group) as u32);
        let args = [
            Arg::Ptr(partial.ptr()),
            Arg::Ptr(xb.ptr()),
            Arg::Ptr(wd.ptr()),
            Arg::I32(m as i32),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            Arg::Ptr(y),
            Arg::Ptr(bd.ptr()),
            Arg::I64(n as i64),
            Arg::I32(1),
            Arg::Ptr(counters),
            Arg::I32(group as i32),
        ];
        Ok(gpu.launch("linear_bf16_split", grid, 128, 0, &args)?)
    };
    split(0, 0, 1)?;
    let summed = sum_chunks(gpu, &partial, &bd, y0, (m, n, chunks))?;
    outputs.push(("linear_bf16_split + linear_chunks_sum", summed));
    for (what, group) in [
        ("linear_bf16_split, the last blocks adding", 1),
        ("linear_bf16_split, the last blocks adding, again", 1),
        ("linear_bf16_split, two chunks a block, the last blocks adding", 2),
    ] {
        let y = gpu.upload(y0)?;
        split(y.ptr(), arrivals.ptr(), group)?;
        outputs.push((what, gpu.download(&y, m * n)?));
    }
    Ok(outputs)
}

/// `y0 + Σ_c partial[c] + bias` (`m × n`, `chunks` partial sums in `partial`) by
/// `linear_chunks_sum`, from a fresh copy of `y0`: the sum a split product's chunks go through.
pub fn sum_chunks(
    gpu: &Gpu,
    partial: &DeviceBuf<f32>,
    bias: &DeviceBuf<f32>,
    y0: &[f32],
    (m, n, chunks): (usize, usize, usize),
) -> Result<Vec<f32>> {
    let y = gpu.upload(y0)?;
    let args = [
        Arg::Ptr(y.ptr()),
        Arg::Ptr(partial.ptr()),
        Arg::Ptr(bias.ptr()),
        Arg::I32(m as i32),
        Arg::I32(n as i32),
        Arg::I32(chunks as i32),
        Arg::I64(n as i64),
        Arg::I64(0),
        Arg::I32(1),
    ];
    gpu.launch("linear_chunks_sum", ((m * n).div_ceil(256) as u32, 1, 1), 256, 0, &args)?;
    Ok(gpu.download(&y, m * n)?)
}

/// One bf16 product of `m × n` over `k` through every kernel: see the module's header.
fn product_case(gpu: &Gpu, (m, n, k): (usize, usize, usize), failures: &mut Vec<String>) -> Result<f64> {
    let mut draw = lcg((m * 7 + n * 13 + k) as u64);
    let mut values = |len: usize| -> Vec<f32> { (0..len).map(|_| draw()).collect() };
    let (x, w, bias, y0) = (values(m * k), values(n * k), values(n), values(m * n));
    let w16: Vec<u16> = w.iter().map(|&v| bf16_bits(v)).collect();
    let outputs = bf16_product_outputs(gpu, (m, n, k), &x, &w16, &bias, &y0)?;
    let (_, tile) = &outputs[0];
    for (what, got) in &outputs[1..] {
        if let Some(why) = differ(got, tile) {
            failures.push(format!("products {m} x {n} x {k}: {what} against linear_bf16: {why}"));
        }
    }
    let want: Vec<f64> = (0..m * n)
        .map(|i| {
            let (r, c) = (i / n, i % n);
            let dot: f64 = (0..k).map(|j| widen(bf16_bits(x[r * k + j])) * widen(w16[c * k + j])).sum();
            y0[i] as f64 + dot + bias[c] as f64
        })
        .collect();
    Ok(rel_l2(tile, &want))
}

/// bf16 products of odd sizes (edges, rows not 16-byte aligned, several tiles each way).
pub fn product_check(gpu: &Gpu) -> Result<Vec<String>> {
    let mut failures = Vec::new();
    let mut worst = 0.0f64;
    for shape in [(37, 50, 600), (37, 50, 601), (150, 140, 600), (300, 260, 1100)] {
        let err = product_case(gpu, shape, &mut failures)?;
        worst = worst.max(err);
        if err.is_nan() || err > 1e-4 {
            failures.push(format!("products {shape:?}: {err:.2e} relative from a float64 product"));
        }
    }
    println!(
        "products     bf16 tensor cores: linear_bf16 = linear_bf16_wide = split and summed (three ways), 4 shapes: {}; max {worst:.2e} from a float64 product",
        if failures.is_empty() { "bit-identical" } else { "DIFFERENT" }
    );
    Ok(failures)
}

/// `kvflow bench kernels`: the kernel checks alone (with the seeded draws', `draw_check`) on GPU `gpu` (or emulated), in seconds — for a
/// kernel variant set by `--tune` before the whole `bench device`. Fails when either fails.
pub fn run(gpu: usize, emulate: bool) -> Result<()> {
    let gpu = if emulate { Gpu::emulated()? } else { Gpu::open(gpu)? };
    println!("gpu          {} ({})", gpu.name(), if gpu.is_emulated() { "emulated" } else { gpu.arch() });
    let mut failures = attention_check(&gpu)?;
    failures.extend(product_check(&gpu)?);
    failures.extend(crate::bench::draw_check::draw_check(&gpu)?);
    conclude(&failures, "kernel")
}

/// Prints each failure and fails with their count (`what` check(s) failed), else prints that
/// every check passed: the end of `bench kernels` and `bench device`.
pub fn conclude(failures: &[String], what: &str) -> Result<()> {
    if !failures.is_empty() {
        for f in failures {
            println!("FAILED       {f}");
        }
        bail!("{} {what} check(s) failed", failures.len());
    }
    println!("checks       all passed");
    Ok(())
}
