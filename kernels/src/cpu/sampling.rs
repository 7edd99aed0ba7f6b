//! Choosing the next token from a logits row: greedy argmax, or temperature / top-k / top-p
//! sampling whose randomness is a pure function of `(seed, request id, position)`. A request
//! therefore samples the same tokens whatever batch, rank or pool it runs in.

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
}

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

/// Picks a token from `logits` under `params`, with the randomness of `key`.
pub fn sample(logits: &[f32], params: &SamplingParams, key: SampleKey) -> u32 {
    if params.is_greedy() {
        return argmax(logits);
    }
    let t = params.temperature as f64;
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    if params.top_k > 0 {
        order.truncate(params.top_k);
    }
    let max = logits[order[0] as usize] as f64 / t;
    let mut probs: Vec<f64> = order.iter().map(|&i| (logits[i as usize] as f64 / t - max).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if params.top_p < 1.0 {
        let mut cumulative = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            cumulative += p;
            if cumulative >= params.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        order.truncate(keep);
    }
    let total: f64 = probs.iter().sum();
    let target = key.uniform() * total;
    let mut cumulative = 0.0;
    for (&tok, p) in order.iter().zip(&probs) {
        cumulative += p;
        if target < cumulative {
            return tok;
        }
    }
    *order.last().expect("at least one candidate")
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
    fn uniform_draws_fill_the_unit_interval() {
        let mean: f64 = (0..10_000).map(|i| key(i).uniform()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
    }
}
