//! The check that the device draws what the CPU draws: `sample_drawn` (`kernels/cuda/model.cu`)
//! against `kvflow_kernels::cpu::sampling::sample` on the same logits rows, token for token — and
//! against `Sampler::check_draft` when the rows check drafts (speculative sampling) — over
//! vocabularies from 1 to 140,000 (segments of 64 ids and wider), temperatures, top-k and top-p,
//! tied logits and rows that put nearly all their weight on a few tokens. `bench device` and
//! `bench kernels` run it on the GPU; the tests under the emulation.

use anyhow::Result;
use kvflow_kernels::cpu::sampling::{argmax, sample, RequestSampling, SampleKey, Sampler, SamplingParams};
use kvflow_kernels::cuda::{Gpu, StepRows};

/// One case's rows: `rows` logits rows of `vocab`, each drawn under `params` at its own key.
struct Case {
    vocab: usize,
    rows: usize,
    params: SamplingParams,
    /// Logits on a coarse grid (many ties) and with a few far above the rest.
    ties: bool,
}

fn logits(vocab: usize, row: usize, ties: bool) -> Vec<f32> {
    let mut state = 0x9E37_79B9u64 ^ (vocab as u64) << 20 ^ row as u64;
    (0..vocab)
        .map(|i| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = (state >> 40) as f32 / (1u64 << 24) as f32;
            match ties {
                true if i % 97 == 5 => 9.0 + (i % 3) as f32,
                true => (u * 8.0).floor() * 0.5 - 2.0,
                false => u * 12.0 - 6.0,
            }
        })
        .collect()
}

/// Tokens the device drew, row by row (`None`: not finite), each row checking its draft if it has
/// one.
fn device_draws(
    gpu: &Gpu,
    rows: &[Vec<f32>],
    draws: &[(Sampler, usize)],
    drafts: &[Option<u32>],
) -> Result<Vec<Option<u32>>> {
    // The plain path's own sampling launch: each row a one-token sequence whose logits are given.
    let vocab = rows[0].len();
    let mut step = StepRows::default();
    for (i, ((sampler, position), draft)) in draws.iter().zip(drafts).enumerate() {
        step.push_seq(&[0], 0, &[], 1, Some(i as u32)).drawn_by(sampler, *position);
        if let Some(d) = draft {
            step.row_checks_draft(i, *d);
        }
    }
    let flat: Vec<f32> = rows.concat();
    let samples = kvflow_kernels::cuda::forward::sample_rows(gpu, &step, &flat, vocab)?;
    Ok(samples)
}

/// Runs every case; a failure names the case, the row and both tokens.
pub fn draw_check(gpu: &Gpu) -> Result<Vec<String>> {
    let p = |temperature, top_k, top_p| SamplingParams { temperature, top_k, top_p };
    let cases = [
        Case { vocab: 1, rows: 2, params: p(0.8, 0, 0.9), ties: false },
        Case { vocab: 7, rows: 8, params: p(1.0, 0, 1.0), ties: true },
        Case { vocab: 300, rows: 8, params: p(0.8, 0, 0.9), ties: false },
        Case { vocab: 300, rows: 8, params: p(0.5, 20, 1.0), ties: true },
        Case { vocab: 5000, rows: 6, params: p(1.3, 40, 0.7), ties: true },
        Case { vocab: 32_000, rows: 4, params: p(0.8, 0, 0.9), ties: false },
        Case { vocab: 32_000, rows: 4, params: p(0.05, 0, 0.95), ties: true },
        Case { vocab: 140_000, rows: 2, params: p(0.7, 0, 0.6), ties: false },
        Case { vocab: 300, rows: 4, params: p(0.0, 0, 1.0), ties: false },
    ];
    let mut failures = Vec::new();
    let (mut drawn, mut off_the_argmax) = (0, 0);
    for (c, case) in cases.iter().enumerate() {
        let rows: Vec<Vec<f32>> = (0..case.rows).map(|r| logits(case.vocab, r, case.ties)).collect();
        let draws: Vec<(Sampler, usize)> = (0..case.rows)
            .map(|r| {
                let sampling = RequestSampling { params: case.params, seed: 17 + c as u64 };
                (Sampler::new(sampling, 1000 + r as u64), 40 + 3 * r)
            })
            .collect();
        let got = device_draws(gpu, &rows, &draws, &vec![None; case.rows])?;
        // the same rows checking drafts (speculative sampling): the argmax, or another token
        let drafts: Vec<Option<u32>> =
            (0..case.rows).map(|r| Some([argmax(&rows[r]), (r * 7) as u32 % case.vocab as u32][r % 2])).collect();
        let checked = device_draws(gpu, &rows, &draws, &drafts)?;
        for (r, (row, (sampler, position))) in rows.iter().zip(&draws).enumerate() {
            let draft = drafts[r].unwrap();
            let want_checked = match case.params.is_greedy() {
                true => Some(argmax(row)),
                false => sampler.check_draft(row, *position, draft).map(|(t, _)| t),
            };
            if checked[r] != want_checked {
                failures.push(format!(
                    "draft checks: vocab {} {:?}, row {r}, draft {draft}: the device chose {:?}, the CPU rule {want_checked:?}",
                    case.vocab, case.params, checked[r]
                ));
            }
            let key =
                SampleKey { seed: sampler.sampling.seed, request_id: sampler.request_id, position: *position as u64 };
            let want = sample(row, &case.params, key);
            drawn += 1;
            off_the_argmax += usize::from(want != argmax(row));
            if got[r] != Some(want) {
                failures.push(format!(
                    "draws: vocab {} {:?}, row {r}: the device drew {:?}, the CPU rule {want}",
                    case.vocab, case.params, got[r]
                ));
            }
        }
    }
    if off_the_argmax < drawn / 4 {
        failures.push(format!(
            "draws: only {off_the_argmax} of {drawn} rows drew off the argmax; the cases draw too little"
        ));
    }
    println!(
        "draws        seeded sampling and draft checks on the device = the CPU rule, {drawn} rows over 9 cases ({off_the_argmax} off the argmax): {}",
        if failures.is_empty() { "the same tokens" } else { "DIFFERENT" }
    );
    Ok(failures)
}
