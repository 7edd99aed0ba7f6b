//! Linear-attention kernels, token by token (DESIGN §6: chunked forms change bits, and a token's
//! result must not depend on how its prompt was chunked).
//!
//! - `causal_conv_step`: a depthwise causal conv1d of kernel `K` over one new input, reading and
//!   shifting the last `K − 1` inputs kept in the state, followed by SiLU.
//! - `delta_rule_step`: the gated delta rule on one head's state `S[k][v]` (`d_k × d_v`): decay
//!   the rows of `S` (one factor per key channel: Kimi's KDA; the same factor for every row:
//!   Qwen3-Next's GDN), read `mem = Sᵀk`, write `S += k·(β(v − mem))ᵀ`, output `o = Sᵀq` from
//!   the updated state — the order transformers' recurrent reference uses.

use super::activation::silu;
use super::simd::{axpy, Best};

/// One step of a depthwise causal conv1d with SiLU. `weight` is `[channels × k]` (tap `k − 1`
/// multiplies the current input); `state` is `[channels × (k − 1)]`, oldest input first, and is
/// shifted to end with `x`. Writes `silu(conv)` into `out`.
pub fn causal_conv_step(x: &[f32], weight: &[f32], k: usize, state: &mut [f32], out: &mut [f32]) {
    let channels = x.len();
    debug_assert_eq!(weight.len(), channels * k);
    debug_assert_eq!(state.len(), channels * (k - 1));
    for c in 0..channels {
        let w = &weight[c * k..(c + 1) * k];
        let s = &mut state[c * (k - 1)..(c + 1) * (k - 1)];
        let mut acc = 0.0f32;
        for j in 0..k - 1 {
            acc += w[j] * s[j];
        }
        acc += w[k - 1] * x[c];
        out[c] = silu(acc);
        if k > 1 {
            s.copy_within(1.., 0);
            s[k - 2] = x[c];
        }
    }
}

/// `x / sqrt(Σx² + eps)`, in place.
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let sum: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (sum + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// One token's inputs to a delta-rule step of one head.
#[derive(Clone, Copy, Debug)]
pub struct DeltaInputs<'a> {
    /// Query, already L2-normalised and scaled (`d_k`).
    pub q: &'a [f32],
    /// Key, L2-normalised (`d_k`).
    pub k: &'a [f32],
    /// Value (`d_v`).
    pub v: &'a [f32],
    pub beta: f32,
    /// Factor multiplying each row (key channel) of the state (`d_k`).
    pub decay: &'a [f32],
}

/// One gated delta-rule step on `state` (`d_k × d_v`, row = key channel). Writes the output into
/// `out` (`d_v`); `mem` is scratch of `d_v`.
pub fn delta_rule_step(state: &mut [f32], x: DeltaInputs, out: &mut [f32], mem: &mut [f32]) {
    let DeltaInputs { q, k, v, beta, decay } = x;
    let (dk, dv) = (k.len(), v.len());
    debug_assert_eq!(state.len(), dk * dv);
    // 1. decay
    for (row, &d) in state.chunks_exact_mut(dv).zip(decay) {
        row.iter_mut().for_each(|s| *s *= d);
    }
    // 2. read: mem = Sᵀk
    mem.fill(0.0);
    for (row, &kk) in state.chunks_exact(dv).zip(k) {
        axpy::<Best>(mem, kk, row);
    }
    // 3. delta and write: S += k ⊗ β(v − mem)
    for (m, &vv) in mem.iter_mut().zip(v) {
        *m = (vv - *m) * beta;
    }
    for (row, &kk) in state.chunks_exact_mut(dv).zip(k) {
        axpy::<Best>(row, kk, mem);
    }
    // 4. output from the updated state: o = Sᵀq
    out.fill(0.0);
    for (row, &qq) in state.chunks_exact(dv).zip(q) {
        axpy::<Best>(out, qq, row);
    }
}

/// torch's `softplus` (threshold 20).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_conv_sees_the_last_k_inputs_and_shifts_its_state() {
        // one channel, kernel [1, 10, 100]: out = silu(x[t-2] + 10·x[t-1] + 100·x[t])
        let w = [1.0, 10.0, 100.0];
        let mut state = vec![0.0; 2];
        let mut out = [0.0];
        causal_conv_step(&[0.01], &w, 3, &mut state, &mut out);
        assert_eq!(state, vec![0.0, 0.01]);
        causal_conv_step(&[0.02], &w, 3, &mut state, &mut out);
        assert!((out[0] - silu(10.0 * 0.01 + 100.0 * 0.02)).abs() < 1e-6);
        causal_conv_step(&[0.03], &w, 3, &mut state, &mut out);
        assert!((out[0] - silu(0.01 + 10.0 * 0.02 + 100.0 * 0.03)).abs() < 1e-6);
        assert_eq!(state, vec![0.02, 0.03]);
    }

    #[test]
    fn a_full_beta_step_stores_the_value_under_its_key() {
        // With S = 0, β = 1 and a unit key, the state becomes k vᵀ and reading with q = k gives v.
        let (k, v) = ([1.0, 0.0], [3.0, -2.0, 0.5]);
        let mut s = vec![0.0; 6];
        let (mut out, mut mem) = ([0.0; 3], [0.0; 3]);
        delta_rule_step(&mut s, DeltaInputs { q: &k, k: &k, v: &v, beta: 1.0, decay: &[1.0, 1.0] }, &mut out, &mut mem);
        assert_eq!(out, v);
        // Writing the same pair again changes nothing (the delta is zero).
        let before = s.clone();
        delta_rule_step(&mut s, DeltaInputs { q: &k, k: &k, v: &v, beta: 1.0, decay: &[1.0, 1.0] }, &mut out, &mut mem);
        assert_eq!(s, before);
    }

    #[test]
    fn decay_scales_rows_by_key_channel() {
        let mut s = vec![1.0, 1.0, 1.0, 1.0];
        let (mut out, mut mem) = ([0.0; 2], [0.0; 2]);
        let x = DeltaInputs { q: &[0.0, 1.0], k: &[0.0, 0.0], v: &[0.0, 0.0], beta: 0.0, decay: &[0.5, 0.25] };
        delta_rule_step(&mut s, x, &mut out, &mut mem);
        assert_eq!(s, vec![0.5, 0.5, 0.25, 0.25]);
        assert_eq!(out, [0.25, 0.25]);
    }
}
