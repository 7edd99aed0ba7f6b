//! Choosing the next token from a logits row: greedy argmax, or temperature / top-k / top-p
//! sampling whose randomness is a pure function of `(seed, request id, position)`. A request
//! therefore samples the same tokens whatever batch, rank or pool it runs in.

use super::draw::Weights;
use serde::{Deserialize, Serialize};

/// How a request picks tokens. `temperature == 0` means greedy.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingParams {
    #[serde(default)]
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    #[serde(default)]
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`.
    #[serde(default = "one")]
    pub top_p: f32,
}

fn one() -> f32 {
    1.0
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0 }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }

    /// `Err` naming the first setting out of range (what a graph, a trace line and a handoff
    /// are checked against).
    pub fn check(&self) -> Result<(), String> {
        check_temperature(self.temperature as f64)?;
        check_top_p(self.top_p as f64)?;
        Ok(())
    }
}

/// A temperature from 0 (greedy) to [`MAX_TEMPERATURE`].
pub fn check_temperature(t: f64) -> Result<f32, String> {
    if t.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&t) {
        Ok(t as f32)
    } else {
        Err(format!("temperature {t}; expected 0 (greedy) to {MAX_TEMPERATURE}"))
    }
}

/// A top-p in (0, 1].
pub fn check_top_p(p: f64) -> Result<f32, String> {
    if p > 0.0 && p <= 1.0 {
        Ok(p as f32)
    } else {
        Err(format!("top_p {p}; expected more than 0 and at most 1"))
    }
}

/// The highest temperature accepted.
pub const MAX_TEMPERATURE: f64 = 100.0;

/// What keys a sampled token's randomness.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleKey {
    pub seed: u64,
    pub request_id: u64,
    /// Position of the token being chosen.
    pub position: u64,
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SampleKey {
    /// A uniform draw in `[0, 1)` fixed by the key.
    pub fn uniform(&self) -> f64 {
        let h = splitmix64(splitmix64(splitmix64(self.seed) ^ self.request_id) ^ self.position);
        (h >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The greedy token, or `None` when the row holds a NaN or an infinity: then no token can be
/// trusted (a NaN compares false with everything, so argmax alone would answer token 0).
pub fn finite_argmax(logits: &[f32]) -> Option<u32> {
    logits.iter().all(|v| v.is_finite()).then(|| argmax(logits))
}

/// Index of the largest logit (the first one on a tie).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Picks a token from `logits` (every value finite) under `params`, with the randomness of
/// `key`: the rule of [`super::draw`], which the device kernel `sample_drawn` follows bit for bit.
pub fn sample(logits: &[f32], params: &SamplingParams, key: SampleKey) -> u32 {
    if params.is_greedy() {
        return argmax(logits);
    }
    let w = Weights::new(logits, params.temperature);
    let threshold = w.threshold(params.top_k, params.top_p);
    let kept = |i: usize| w.keys[i] >= threshold;
    draw(&w, kept, key.uniform(), logits)
}

/// The token of the kept set at the draw `u` (its most likely one when rounding leaves none).
fn draw(w: &Weights, kept: impl Fn(usize) -> bool + Copy, u: f64, logits: &[f32]) -> u32 {
    let tree = w.tree(kept);
    let total = tree.last().map_or(0.0, |root| root[0]);
    w.walk(&tree, kept, u * total)
        .unwrap_or_else(|| (0..logits.len()).filter(|&i| kept(i)).max_by_key(|&i| w.keys[i]).unwrap_or(0) as u32)
}

/// A request's sampling: its parameters and the seed its draws are keyed on (with its id).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestSampling {
    pub params: SamplingParams,
    pub seed: u64,
}

/// What picks one request's tokens: every draw is keyed on (seed, request id, position), so a
/// request samples the same tokens in any batch, rank or pool, and on the reference path.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sampler {
    pub sampling: RequestSampling,
    pub request_id: u64,
}

/// Mixed into the seed for the draw that accepts or rejects a draft (so it is independent of
/// the draw that picks a token at the same position).
const ACCEPT_STREAM: u64 = 0x5EC5_A11D_D4AF_7000;

impl Sampler {
    pub fn new(sampling: RequestSampling, request_id: u64) -> Self {
        Sampler { sampling, request_id }
    }

    pub fn is_greedy(&self) -> bool {
        self.sampling.params.is_greedy()
    }

    fn key(&self, position: usize, stream: u64) -> SampleKey {
        SampleKey { seed: self.sampling.seed ^ stream, request_id: self.request_id, position: position as u64 }
    }

    /// The token at `position` from the logits row before it, or `None` when the row holds a
    /// NaN or an infinity (no token can be trusted).
    pub fn pick(&self, logits: &[f32], position: usize) -> Option<u32> {
        let greedy = finite_argmax(logits)?;
        if self.is_greedy() {
            return Some(greedy); // one pass over the row, as before sampling existed
        }
        Some(sample(logits, &self.sampling.params, self.key(position, 0)))
    }

    /// Speculative sampling of `draft`, proposed for `position` with certainty (the n-gram
    /// drafter, or any greedy drafter): the draft is kept with probability p(draft) under this
    /// request's parameters; otherwise a token is drawn from p with the draft removed,
    /// renormalised — the standard acceptance rule min(1, p/q) with residual max(0, p − q) for
    /// q = 1 at the draft. The token at `position` is distributed as p either way. Greedy keeps
    /// the draft exactly when it is the argmax. Returns the token and whether it is the draft;
    /// `None` when the row is not finite.
    pub fn check_draft(&self, logits: &[f32], position: usize, draft: u32) -> Option<(u32, bool)> {
        if self.is_greedy() {
            let token = finite_argmax(logits)?;
            return Some((token, token == draft));
        }
        finite_argmax(logits)?;
        let params = &self.sampling.params;
        let w = Weights::new(logits, params.temperature);
        let threshold = w.threshold(params.top_k, params.top_p);
        let kept = |i: usize| w.keys[i] >= threshold;
        let total = w.tree(kept).last().map_or(0.0, |root| root[0]);
        let p_draft = logits.get(draft as usize).filter(|_| kept(draft as usize)).map_or(0.0, |_| w.w[draft as usize]);
        if self.key(position, ACCEPT_STREAM).uniform() * total < p_draft {
            return Some((draft, true));
        }
        let others = |i: usize| kept(i) && i != draft as usize;
        if !(0..logits.len()).any(others) {
            return Some((draft, true));
        }
        Some((draw(&w, others, self.key(position, 0).uniform(), logits), false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(position: u64) -> SampleKey {
        SampleKey { seed: 7, request_id: 3, position }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.0, 2.0, 2.0, 1.0]), 1);
        assert_eq!(sample(&[0.0, 2.0, 1.0], &SamplingParams::greedy(), key(0)), 1);
    }

    #[test]
    fn the_same_key_gives_the_same_token_and_keys_differ() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0 };
        let a: Vec<u32> = (0..20).map(|i| sample(&logits, &p, key(i))).collect();
        let b: Vec<u32> = (0..20).map(|i| sample(&logits, &p, key(i))).collect();
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]), "twenty draws were all {}", a[0]);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let logits = [5.0, 4.9, 0.0, -1.0, 4.8];
        let k2 = SamplingParams { temperature: 1.0, top_k: 2, top_p: 1.0 };
        let p_small = SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.01 };
        for i in 0..200 {
            assert!(sample(&logits, &k2, key(i)) <= 1);
            assert_eq!(sample(&logits, &p_small, key(i)), 0);
        }
    }

    #[test]
    fn a_checked_draft_leaves_the_token_distributed_as_the_target() {
        // Speculative sampling with a certain draft: over many request ids the token at the
        // position is distributed as p (chi-square over every candidate, 5 degrees of freedom,
        // far below the 0.1% critical value 20.5), whichever draft is proposed.
        let logits = [1.0f32, 0.2, -0.5, 0.7, 1.3, -2.0];
        let params = SamplingParams { temperature: 0.8, top_k: 0, top_p: 1.0 };
        let w = Weights::new(&logits, params.temperature);
        let order: Vec<u32> = (0..logits.len() as u32).collect();
        let probs: Vec<f64> = w.w.iter().map(|x| x / w.w.iter().sum::<f64>()).collect();
        let n = 40_000;
        for draft in [4u32, 2, 5] {
            let mut counts = [0usize; 6];
            let mut kept = 0;
            for request_id in 0..n {
                let sampler = Sampler::new(RequestSampling { params, seed: 11 }, request_id);
                let (token, accepted) = sampler.check_draft(&logits, 9, draft).unwrap();
                counts[token as usize] += 1;
                kept += usize::from(accepted);
            }
            let chi2: f64 = order
                .iter()
                .zip(&probs)
                .map(|(&t, &p)| (counts[t as usize] as f64 - p * n as f64).powi(2) / (p * n as f64))
                .sum();
            assert!(chi2 < 20.5, "draft {draft}: chi-square {chi2}, counts {counts:?}, p {probs:?}");
            let p_draft = probs[order.iter().position(|&t| t == draft).unwrap()];
            let rate = kept as f64 / n as f64;
            assert!((rate - p_draft).abs() < 0.01, "draft {draft} kept at {rate}, p {p_draft}");
        }
    }

    #[test]
    fn greedy_checks_keep_the_draft_only_when_it_is_the_argmax() {
        let sampler = Sampler::default();
        assert_eq!(sampler.check_draft(&[0.0, 3.0, 1.0], 4, 1), Some((1, true)));
        assert_eq!(sampler.check_draft(&[0.0, 3.0, 1.0], 4, 2), Some((1, false)));
        assert_eq!(sampler.check_draft(&[0.0, f32::NAN, 1.0], 4, 2), None);
        assert_eq!(sampler.pick(&[0.0, f32::INFINITY], 4), None);
    }

    #[test]
    fn uniform_draws_fill_the_unit_interval() {
        let mean: f64 = (0..10_000).map(|i| key(i).uniform()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
    }
}
