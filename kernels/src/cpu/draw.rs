//! The arithmetic of a seeded draw from a logits row, written so that the CUDA kernel
//! `sample_drawn` (`kernels/cuda/model.cu`) gives the same token from the same row: only IEEE
//! operations that round the same everywhere (division, multiplication, addition, fma, floor),
//! an exponential built from them ([`exp_det`]), and sums in one fixed order ([`Weights`]).
//!
//! The rule, for temperature `t`: each token weighs `w = exp(l/t − l_max/t)`. Tokens are ranked by
//! [`rank_key`] (most likely first, ties by id). Top-k keeps the `k` highest keys; top-p then keeps
//! the fewest highest keys whose weight sums to at least `top_p` × the top-k set's. The draw is
//! the first kept token, in id order, whose running sum (the fixed order: segments of
//! [`segment_len`] ids summed in id order, then a pairwise tree over the segments, walked from the
//! root) passes `u` × the kept set's sum.

/// A logit's place in the order "most likely first, ties by id": larger keys are likelier.
pub fn rank_key(logit: f32, id: usize) -> u64 {
    let b = logit.to_bits();
    let ordered = if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 };
    ((ordered as u64) << 32) | (u32::MAX - id as u32) as u64
}

/// 1/n! for n = 0..=13 (each the previous divided by n; a test checks the bits).
const INVERSE_FACTORIALS: [u64; 14] = [
    0x3ff0000000000000,
    0x3ff0000000000000,
    0x3fe0000000000000,
    0x3fc5555555555555,
    0x3fa5555555555555,
    0x3f81111111111111,
    0x3f56c16c16c16c17,
    0x3f2a01a01a01a01a,
    0x3efa01a01a01a01a,
    0x3ec71de3a556c734,
    0x3e927e4fb7789f5d,
    0x3e5ae64567f544e4,
    0x3e21eed8eff8d898,
    0x3de6124613a86d0a,
];
const LOG2_E: u64 = 0x3ff71547652b82fe;
/// ln 2 in two parts (Cody and Waite): the high part has its last 21 bits zero, so k × it is exact.
const LN2_HI: u64 = 0x3fe62e42fee00000;
const LN2_LO: u64 = 0x3dea39ef35793c76;

/// e^x for x ≤ 0 (0 below −745), from basic operations alone: x = k ln 2 + r, e^r by its
/// Taylor series to r^13 (Horner, one fma a term), times 2^k. Within 2 ulp of e^x.
pub fn exp_det(x: f64) -> f64 {
    if !(x >= -745.0) {
        return 0.0;
    }
    let k = (x * f64::from_bits(LOG2_E) + 0.5).floor();
    let r = (-k).mul_add(f64::from_bits(LN2_HI), x);
    let r = (-k).mul_add(f64::from_bits(LN2_LO), r);
    let mut p = f64::from_bits(INVERSE_FACTORIALS[13]);
    for c in INVERSE_FACTORIALS[..13].iter().rev() {
        p = p.mul_add(r, f64::from_bits(*c));
    }
    let k = k as i64;
    if k >= -1022 {
        p * f64::from_bits(((k + 1023) as u64) << 52)
    } else {
        p * f64::from_bits(((k + 64 + 1023) as u64) << 52) * f64::from_bits((1023 - 64) << 52)
    }
}

/// The most segments a row's sums are cut into.
pub const MAX_SEGMENTS: usize = 2048;

/// Ids per segment of a row of `vocab` logits.
pub fn segment_len(vocab: usize) -> usize {
    64usize.max(vocab.div_ceil(MAX_SEGMENTS))
}

/// A row's weights and keys at one temperature.
pub struct Weights {
    pub w: Vec<f64>,
    pub keys: Vec<u64>,
    segment: usize,
}

impl Weights {
    /// `w_i = exp_det(l_i/t − l_max/t)` (every logit finite, `t > 0`).
    pub fn new(logits: &[f32], temperature: f32) -> Weights {
        let t = temperature as f64;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let m = max as f64 / t;
        Weights {
            w: logits.iter().map(|&l| exp_det(l as f64 / t - m)).collect(),
            keys: logits.iter().enumerate().map(|(i, &l)| rank_key(l, i)).collect(),
            segment: segment_len(logits.len()),
        }
    }

    /// The fixed-order sums over the tokens `kept` says: the segments' sums, then each level of
    /// the pairwise tree over them, up to the root.
    pub fn tree(&self, kept: impl Fn(usize) -> bool) -> Vec<Vec<f64>> {
        let mut level: Vec<f64> = (0..self.w.len().div_ceil(self.segment))
            .map(|j| {
                let ids = j * self.segment..((j + 1) * self.segment).min(self.w.len());
                ids.filter(|&i| kept(i)).fold(0.0, |s, i| s + self.w[i])
            })
            .collect();
        let mut levels = Vec::new();
        while level.len() > 1 {
            let next = level.chunks(2).map(|p| if p.len() == 2 { p[0] + p[1] } else { p[0] }).collect();
            levels.push(std::mem::replace(&mut level, next));
        }
        levels.push(level);
        levels
    }

    /// The sum of the weights of the tokens whose key is at least `threshold`.
    pub fn sum_from(&self, threshold: u64) -> f64 {
        self.tree(|i| self.keys[i] >= threshold).last().map_or(0.0, |root| root[0])
    }

    /// The first token, in id order, of those `kept` whose running sum passes `target` (walking
    /// `tree`'s levels from the root), or `None` when rounding leaves none.
    pub fn walk(&self, tree: &[Vec<f64>], kept: impl Fn(usize) -> bool, target: f64) -> Option<u32> {
        let (mut node, mut before) = (0usize, 0.0f64);
        for children in tree.iter().rev().skip(1) {
            let left = 2 * node;
            node = if left + 1 < children.len() {
                let through_left = before + children[left];
                if target < through_left {
                    left
                } else {
                    before = through_left;
                    left + 1
                }
            } else {
                left
            };
        }
        let mut running = before;
        for i in node * self.segment..((node + 1) * self.segment).min(self.w.len()) {
            if kept(i) {
                running += self.w[i];
                if target < running {
                    return Some(i as u32);
                }
            }
        }
        None
    }

    /// The lowest key a token needs to be kept: the `top_k`-th highest (0: all), then the
    /// highest key whose tokens from it up sum to at least `top_p` × those of the top-k.
    pub fn threshold(&self, top_k: usize, top_p: f32) -> u64 {
        let mut sorted = self.keys.clone();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let k = if top_k > 0 && top_k < sorted.len() { top_k } else { sorted.len() };
        let top_k_threshold = if k < sorted.len() { sorted[k - 1] } else { 0 };
        if top_p >= 1.0 {
            return top_k_threshold;
        }
        let target = top_p as f64 * self.sum_from(top_k_threshold);
        // the fewest ranks (the sum grows with each) whose sum reaches the target
        let (mut lo, mut hi) = (0, k - 1);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.sum_from(sorted[mid]) >= target {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        sorted[lo].max(top_k_threshold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inverse_factorials_are_each_the_one_before_divided_by_n() {
        for n in 1..INVERSE_FACTORIALS.len() {
            let expected = f64::from_bits(INVERSE_FACTORIALS[n - 1]) / n as f64;
            assert_eq!(INVERSE_FACTORIALS[n], expected.to_bits(), "1/{n}!");
        }
    }

    #[test]
    fn the_exponential_is_within_two_ulp_of_libm() {
        for i in 0..200_000 {
            let x = -(i as f64) * 0.003_7 - (i % 7) as f64 * 1e-9;
            let (ours, libm) = (exp_det(x), x.exp());
            if libm > f64::MIN_POSITIVE {
                let ulps = (ours.to_bits() as i64 - libm.to_bits() as i64).abs();
                assert!(ulps <= 2, "exp({x}): {ours:e} against {libm:e}, {ulps} ulp");
            } else {
                assert!((ours - libm).abs() <= 4.0 * f64::from_bits(1), "exp({x}) in the subnormals");
            }
        }
        assert_eq!(exp_det(0.0), 1.0);
        assert_eq!(exp_det(-800.0), 0.0);
        assert_eq!(exp_det(f64::NEG_INFINITY), 0.0);
    }

    #[test]
    fn keys_order_logits_then_ids() {
        assert!(rank_key(1.0, 5) > rank_key(0.5, 0));
        assert!(rank_key(-0.5, 5) > rank_key(-1.0, 0));
        assert!(rank_key(2.0, 1) > rank_key(2.0, 2), "ties: the lower id first");
        assert!(rank_key(0.0, 0) > rank_key(-0.0, 0));
    }

    #[test]
    fn the_tree_sums_to_the_total_and_the_walk_finds_every_token() {
        let logits: Vec<f32> = (0..5000).map(|i| ((i * 37 % 101) as f32) * 0.05).collect();
        let w = Weights::new(&logits, 1.0);
        let tree = w.tree(|_| true);
        let total = tree.last().unwrap()[0];
        assert!((total - w.w.iter().sum::<f64>()).abs() < 1e-9 * total);
        // just before the running sum after token i, the walk lands on i
        let mut running = 0.0;
        for i in 0..200 {
            running += w.w[i];
            assert_eq!(w.walk(&tree, |_| true, running * (1.0 - 1e-12)), Some(i as u32));
        }
    }
}
