//! The tensor-core attention (`kernels/cuda/attention.cu`) under the CPU emulation: a row's output
//! is the same bits whole, in chunks, alone with its parts split over blocks and merged, and among
//! other sequences — with and without a sliding window — and within bf16's rounding of a float64
//! softmax over the same bf16 keys and values. Through the executor, the bf16 families whose
//! attention takes it keep `bench device`'s checks: batch invariance and agreement with f32.

use kvflow_kernels::cuda::{bf16_bits, Arg, DeviceBuf, Gpu};

const D: usize = 64;
const KV_HEADS: usize = 2;
const Q_HEADS: usize = 8;
const BLOCK: usize = 16;
/// attention.cu's FA_ROWS and FA_PART.
const FA_ROWS: usize = 64;
const FA_PART: usize = 256;
const ROW_WIDTH: usize = 2 * KV_HEADS * D;

/// A paged bf16 cache of `blocks` blocks and the sequences' block tables (scattered blocks).
struct Cache {
    data: DeviceBuf<u16>,
    host: Vec<u16>,
    tables: Vec<Vec<u32>>,
}

/// One launch's rows: per sequence, its table and the positions of its rows (consecutive).
struct Launch<'a> {
    seqs: Vec<(usize, std::ops::Range<usize>)>,
    window: usize,
    split: bool,
    q: &'a [f32],
}

fn lcg(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 33) % 2001) as f32 / 1000.0 - 1.0
    }
}

fn cache(gpu: &Gpu, lengths: &[usize]) -> Cache {
    let blocks: usize = lengths.iter().map(|l| l.div_ceil(BLOCK)).sum();
    let mut draw = lcg(3);
    let host: Vec<u16> = (0..blocks * BLOCK * ROW_WIDTH).map(|_| bf16_bits(draw())).collect();
    // block b of the pool goes to sequences in a scattered order
    let mut order: Vec<u32> = (0..blocks as u32).map(|b| (b * 7 + 3) % blocks as u32).collect();
    let tables = lengths.iter().map(|l| order.drain(..l.div_ceil(BLOCK)).collect()).collect();
    Cache { data: gpu.upload(&host).unwrap(), host, tables }
}

/// q for `rows` rows (`[row][head][d]` f32).
fn queries(rows: usize, seed: u64) -> Vec<f32> {
    let mut draw = lcg(seed);
    (0..rows * Q_HEADS * D).map(|_| draw()).collect()
}

/// The kernel over one launch's rows, as parts/attention.rs launches it (grid bound, split).
fn attend(gpu: &Gpu, cache: &Cache, launch: &Launch) -> Vec<f32> {
    let (mut positions, mut row_at, mut tables, mut table_at) = (vec![], vec![], vec![], vec![]);
    for (seq, range) in &launch.seqs {
        row_at.push(positions.len() as u32);
        table_at.push(tables.len() as u32);
        tables.extend_from_slice(&cache.tables[*seq]);
        positions.extend(range.clone().map(|p| p as i32));
    }
    let (rows, seqs) = (positions.len(), launch.seqs.len());
    let per_tile = FA_ROWS / (Q_HEADS / KV_HEADS);
    let tiles = seqs + (rows - seqs) / per_tile;
    let longest = launch.seqs.iter().map(|(_, r)| r.end).max().unwrap();
    let parts = longest.div_ceil(FA_PART);
    let out = gpu.zeros::<f32>(rows * Q_HEADS * D).unwrap();
    let scratch = gpu.zeros::<f32>(rows * Q_HEADS * parts * (D + 2)).unwrap();
    let q = gpu.upload(&launch.q[..rows * Q_HEADS * D]).unwrap();
    let dev = |v: &[u32]| gpu.upload(v).unwrap();
    let (tables, table_at, row_at) = (dev(&tables), dev(&table_at), dev(&row_at));
    let positions = gpu.upload(&positions).unwrap();
    let args = [
        Arg::Ptr(out.ptr()),
        Arg::Ptr(scratch.ptr()),
        Arg::Ptr(q.ptr()),
        Arg::I64((Q_HEADS * D) as i64),
        Arg::Ptr(cache.data.ptr()),
        Arg::Ptr(tables.ptr()),
        Arg::Ptr(table_at.ptr()),
        Arg::Ptr(positions.ptr()),
        Arg::Ptr(row_at.ptr()),
        Arg::I32(seqs as i32),
        Arg::I32(rows as i32),
        Arg::I32(Q_HEADS as i32),
        Arg::I32(KV_HEADS as i32),
        Arg::I32(D as i32),
        Arg::I32(0),
        Arg::I32((KV_HEADS * D) as i32),
        Arg::I32(ROW_WIDTH as i32),
        Arg::I32(BLOCK as i32),
        Arg::I32(launch.window as i32),
        Arg::F32(1.0 / (D as f32).sqrt()),
        Arg::I32((Q_HEADS / KV_HEADS) as i32),
        Arg::I32(launch.split as i32),
    ];
    let z = if launch.split { parts as u32 } else { 1 };
    let shared = kvflow_kernels::cuda::sources::flash_shared(D);
    gpu.launch("flash_attention_64", (tiles as u32, KV_HEADS as u32, z), 128, shared, &args).unwrap();
    if launch.split {
        let merge = [Arg::Ptr(out.ptr()), Arg::Ptr(scratch.ptr()), Arg::I32(D as i32), Arg::I32(parts as i32)];
        gpu.launch("flash_attention_merge", ((rows * Q_HEADS) as u32, 1, 1), 64, 0, &merge).unwrap();
    }
    gpu.download(&out, rows * Q_HEADS * D).unwrap()
}

/// `a` and `b` are the same bits (else: how many of them differ, and the first).
fn assert_same_bits(a: &[f32], b: &[f32], what: &str) {
    let differ: Vec<usize> = (0..a.len()).filter(|&i| a[i].to_bits() != b[i].to_bits()).collect();
    assert!(
        a.len() == b.len() && differ.is_empty(),
        "{what}: {} of {} values differ (the first at {:?}: {:?} vs {:?})",
        differ.len(),
        a.len(),
        differ.first(),
        differ.first().map(|&i| a[i]),
        differ.first().map(|&i| b[i])
    );
}

/// Row `i` of a launch's output (every head).
fn row(out: &[f32], i: usize) -> &[f32] {
    &out[i * Q_HEADS * D..(i + 1) * Q_HEADS * D]
}

/// The float64 softmax attention of one row (q rounded to bf16, as the kernel rounds it).
fn reference(cache: &Cache, seq: usize, pos: usize, window: usize, q: &[f32]) -> Vec<f32> {
    let widen = |b: u16| f32::from_bits((b as u32) << 16) as f64;
    let lo = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
    let at = |key: usize| (cache.tables[seq][key / BLOCK] as usize * BLOCK + key % BLOCK) * ROW_WIDTH;
    let mut out = vec![0.0f32; Q_HEADS * D];
    for h in 0..Q_HEADS {
        let g = h / (Q_HEADS / KV_HEADS);
        let qh: Vec<f64> = q[h * D..(h + 1) * D].iter().map(|&x| widen(bf16_bits(x))).collect();
        let scores: Vec<f64> = (lo..=pos)
            .map(|k| (0..D).map(|d| qh[d] * widen(cache.host[at(k) + g * D + d])).sum::<f64>() / (D as f64).sqrt())
            .collect();
        let big = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - big).exp()).collect();
        let total: f64 = weights.iter().sum();
        for d in 0..D {
            let v: f64 =
                (lo..=pos).zip(&weights).map(|(k, w)| w * widen(cache.host[at(k) + (KV_HEADS + g) * D + d])).sum();
            out[h * D + d] = (v / total) as f32;
        }
    }
    out
}

/// A prompt of 600 tokens (three parts of keys for its last rows): its rows' outputs whole, in a
/// chunk of 7, alone (its parts split over blocks, then merged) and in a launch with other
/// sequences are the same bits; and each is within 1e-2 (relative L2) of a float64 softmax.
#[test]
fn tensor_core_attention_gives_a_row_the_same_bits_however_the_step_is_cut() {
    let gpu = Gpu::emulated().unwrap_or_else(|e| panic!("{e}"));
    let lengths = [600, 40, 300, 5];
    let cache = cache(&gpu, &lengths);
    let q = queries(600, 5);
    for window in [0, 100] {
        let whole = attend(&gpu, &cache, &Launch { seqs: vec![(0, 0..600)], window, split: false, q: &q });
        // a chunk of 7 rows (positions 593..600), unsplit and split
        for split in [false, true] {
            let chunk =
                attend(&gpu, &cache, &Launch { seqs: vec![(0, 593..600)], window, split, q: &q[593 * Q_HEADS * D..] });
            for i in 0..7 {
                let what = format!("window {window}, split {split}: row {}", 593 + i);
                assert_same_bits(row(&chunk, i), row(&whole, 593 + i), &what);
            }
        }
        // the last row as a decode alone (split) and among other sequences' rows (unsplit)
        let last = &q[599 * Q_HEADS * D..600 * Q_HEADS * D];
        let alone = attend(&gpu, &cache, &Launch { seqs: vec![(0, 599..600)], window, split: true, q: last });
        assert_same_bits(&alone, row(&whole, 599), &format!("window {window}: a decode alone"));
        let mut mixed_q = queries(40 + 1 + 3, 9);
        mixed_q[40 * Q_HEADS * D..41 * Q_HEADS * D].copy_from_slice(last);
        let seqs = vec![(1, 0..40), (0, 599..600), (2, 297..300)];
        let mixed = attend(&gpu, &cache, &Launch { seqs, window, split: false, q: &mixed_q });
        assert_same_bits(row(&mixed, 40), row(&whole, 599), &format!("window {window}: among other sequences"));
        // values: a float64 softmax over the same bf16 keys and values
        for pos in [0, 17, 255, 256, 599] {
            let want = reference(&cache, 0, pos, window, &q[pos * Q_HEADS * D..(pos + 1) * Q_HEADS * D]);
            let got = row(&whole, pos);
            let err: f64 = want.iter().zip(got).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt()
                / want.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
            assert!(err < 1e-2, "window {window}, position {pos}: {err:.2e} relative from a float64 softmax");
        }
    }
}

/// The families whose attention takes the tensor-core kernel in bf16 (grouped-query heads of 16:
/// llama, qwen3, qwen3_next's gated attention) keep `bench device`'s bf16 checks through the
/// executor: a prompt alone = in a batch of 64 = in chunks of 7, a decode alone = in a batch of
/// 64, bit for bit; greedy tokens and logits within the bf16 tolerance of the f32 path.
#[test]
fn bf16_families_on_tensor_core_attention_keep_the_device_checks() {
    let gpu = Gpu::emulated().unwrap_or_else(|e| panic!("{e}"));
    let gaps = crate::common::repo().join("benches/results/2026-12-03-h200-transformers-bf16-gap.json");
    for family in ["llama", "qwen3", "qwen3_next"] {
        let dir = crate::common::fixture(&format!("hf/{family}"));
        let (before, old_before) =
            (gpu.emulated_launches("flash_attention_16"), gpu.emulated_launches("paged_attention"));
        let failures = kvflow::bench::device::bf16_checks(&gpu, &dir, family, &gaps).unwrap();
        assert!(failures.is_empty(), "{family}: {failures:#?}");
        // the f32 model keeps model.cu's kernel; the bf16 one took the tensor cores
        assert!(
            gpu.emulated_launches("flash_attention_16") > before,
            "{family}: bf16 attention did not take flash_attention_16"
        );
        assert!(
            gpu.emulated_launches("paged_attention") > old_before,
            "{family}: f32 attention did not take paged_attention"
        );
    }
}
