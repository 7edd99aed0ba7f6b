//! RMSNorm over rows, as transformers computes it: `w · (x · rsqrt(mean(x²) + eps))` in f32.
//! Each row is reduced on its own in a fixed order, so the result is batch-invariant.

use super::simd::{dot, Best};

/// Normalises each `weight.len()`-wide row of `x` in place.
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    assert_eq!(x.len() % d, 0, "rows of {} values do not tile {}", d, x.len());
    for row in x.chunks_exact_mut(d) {
        let inv = inverse_rms(row, eps);
        for (v, w) in row.iter_mut().zip(weight) {
            *v = w * (*v * inv);
        }
    }
}

/// Writes the normalised rows of `x` into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    out.copy_from_slice(x);
    rms_norm_inplace(out, weight, eps);
}

/// `1 / sqrt(mean(row²) + eps)`.
#[inline]
pub fn inverse_rms(row: &[f32], eps: f32) -> f32 {
    let mean_sq = dot::<Best>(row, row) / row.len() as f32;
    1.0 / (mean_sq + eps).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_rms_rows_pass_through_scaled_by_the_weight() {
        let mut x = vec![1.0, -1.0, 1.0, -1.0, 2.0, 2.0, 2.0, 2.0];
        rms_norm_inplace(&mut x, &[1.0, 2.0, 3.0, 4.0], 0.0);
        assert_eq!(x, vec![1.0, -2.0, 3.0, -4.0, 1.0, 2.0, 3.0, 4.0]);
    }
}
