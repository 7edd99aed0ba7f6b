//! Batch-invariant f32 matrix product `out[m × n] = x[m × k] · Wᵀ` against a weight packed once
//! at load time.
//!
//! Every output element is one fused multiply-add chain over `k` in increasing order, started at
//! zero: row `r` of `out` depends only on row `r` of `x` and on `W`, never on `m`, on which other
//! rows share the call, or on where the row falls in a register tile. That is what lets a token's
//! logits be bit-identical whatever batch or chunk it ran in (DESIGN §6).
//!
//! Layout: `W` is stored as panels of `NR` output columns; panel `p` holds, for each `kk` in
//! `0..k`, the `NR` weights `W[p·NR + j][kk]` side by side (zero past `n`). The micro-kernel keeps
//! an `R × NR` tile of accumulators (R ≤ `MR`) in registers and streams the panel once per tile.

use super::simd::{Best, Lanes};

/// Output columns per packed panel (two 8-lane vectors).
pub const NR: usize = 16;
/// Rows per register tile.
pub const MR: usize = 6;
/// Rows per cache block: the block of `x` stays in L2 while every panel streams past it.
const MC: usize = 96;

/// A weight matrix `[n × k]` (Hugging Face `nn.Linear` layout: out × in) packed for [`matmul`].
#[derive(Clone)]
pub struct PackedMatrix {
    n: usize,
    k: usize,
    panels: Vec<f32>,
}

impl PackedMatrix {
    /// Packs a row-major `[n × k]` weight.
    pub fn from_rows(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weight has {} values, expected {n} × {k}", w.len());
        let num_panels = n.div_ceil(NR);
        let mut panels = vec![0.0f32; num_panels * k * NR];
        for p in 0..num_panels {
            let panel = &mut panels[p * k * NR..(p + 1) * k * NR];
            for j in 0..NR.min(n - p * NR) {
                let row = &w[(p * NR + j) * k..(p * NR + j + 1) * k];
                for (kk, &v) in row.iter().enumerate() {
                    panel[kk * NR + j] = v;
                }
            }
        }
        PackedMatrix { n, k, panels }
    }

    /// A matrix of `[n × k]` that holds no values (a model built from its shapes alone): it can
    /// be measured, not applied.
    pub fn shape_only(n: usize, k: usize) -> Self {
        PackedMatrix { n, k, panels: Vec::new() }
    }

    /// Packs the transpose of a row-major `[k × n]` matrix, i.e. computes `x · M` for `M[k × n]`.
    pub fn from_columns(m: &[f32], k: usize, n: usize) -> Self {
        assert_eq!(m.len(), n * k);
        let mut rows = vec![0.0f32; n * k];
        for kk in 0..k {
            for j in 0..n {
                rows[j * k + kk] = m[kk * n + j];
            }
        }
        Self::from_rows(&rows, n, k)
    }

    /// The row-major `[n × k]` weight it was packed from.
    pub fn to_rows(&self) -> Vec<f32> {
        let mut rows = vec![0.0f32; self.n * self.k];
        for (j, row) in rows.chunks_exact_mut(self.k.max(1)).enumerate().take(self.n) {
            let (p, c) = (j / NR, j % NR);
            let panel = &self.panels[p * self.k * NR..(p + 1) * self.k * NR];
            for (kk, v) in row.iter_mut().enumerate() {
                *v = panel[kk * NR + c];
            }
        }
        rows
    }

    /// Output width `n`.
    pub fn out_dim(&self) -> usize {
        self.n
    }

    /// Input width `k`.
    pub fn in_dim(&self) -> usize {
        self.k
    }

    /// Bytes of the packed panels (what a matrix of its shape holds, also when it holds none).
    pub fn bytes(&self) -> usize {
        self.n.div_ceil(NR) * NR * self.k * 4
    }

    /// `out[m × n] = x[m × k] · Wᵀ` (overwrites `out`).
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        assert_eq!(x.len(), m * self.k, "input has {} values, expected {m} × {}", x.len(), self.k);
        assert_eq!(out.len(), m * self.n, "output has {} values, expected {m} × {}", out.len(), self.n);
        matmul_lanes::<Best>(self, x, m, out);
    }

    /// Allocating form of [`PackedMatrix::matmul`].
    pub fn apply(&self, x: &[f32], m: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * self.n];
        self.matmul(x, m, &mut out);
        out
    }
}

#[inline(always)]
fn matmul_lanes<L: Lanes>(w: &PackedMatrix, x: &[f32], m: usize, out: &mut [f32]) {
    let (n, k) = (w.n, w.k);
    let num_panels = n.div_ceil(NR);
    for m0 in (0..m).step_by(MC) {
        let m1 = (m0 + MC).min(m);
        for p in 0..num_panels {
            let panel = &w.panels[p * k * NR..(p + 1) * k * NR];
            let cols = NR.min(n - p * NR);
            let mut r0 = m0;
            while r0 < m1 {
                let rows = MR.min(m1 - r0);
                let xs = &x[r0 * k..(r0 + rows) * k];
                let dst = &mut out[r0 * n + p * NR..];
                match rows {
                    6 => tile::<L, 6>(panel, xs, k, dst, n, cols),
                    5 => tile::<L, 5>(panel, xs, k, dst, n, cols),
                    4 => tile::<L, 4>(panel, xs, k, dst, n, cols),
                    3 => tile::<L, 3>(panel, xs, k, dst, n, cols),
                    2 => tile::<L, 2>(panel, xs, k, dst, n, cols),
                    _ => tile::<L, 1>(panel, xs, k, dst, n, cols),
                }
                r0 += rows;
            }
        }
    }
}

/// One `R × NR` tile: `dst[r][j] = Σ_kk xs[r][kk] · panel[kk][j]`, `kk` ascending.
#[inline(always)]
fn tile<L: Lanes, const R: usize>(panel: &[f32], xs: &[f32], k: usize, dst: &mut [f32], ldd: usize, cols: usize) {
    debug_assert!(panel.len() >= k * NR && xs.len() >= R * k);
    let mut acc = [[L::zero(); 2]; R];
    let pp = panel.as_ptr();
    let px = xs.as_ptr();
    for kk in 0..k {
        // SAFETY: kk < k, and the slices hold k·NR panel values and R·k inputs (asserted above).
        unsafe {
            let b0 = L::load(pp.add(kk * NR));
            let b1 = L::load(pp.add(kk * NR + 8));
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = L::splat(*px.add(r * k + kk));
                a[0] = L::fma(xv, b0, a[0]);
                a[1] = L::fma(xv, b1, a[1]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        let row = &mut dst[r * ldd..];
        if cols == NR {
            // SAFETY: the row has at least NR values left (cols == NR of them are in range).
            unsafe {
                L::store(row.as_mut_ptr(), a[0]);
                L::store(row.as_mut_ptr().add(8), a[1]);
            }
        } else {
            let mut tmp = [0.0f32; NR];
            // SAFETY: tmp holds NR floats.
            unsafe {
                L::store(tmp.as_mut_ptr(), a[0]);
                L::store(tmp.as_mut_ptr().add(8), a[1]);
            }
            row[..cols].copy_from_slice(&tmp[..cols]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2000) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn matches_a_naive_product() {
        let (m, n, k) = (13, 37, 29);
        let x = pseudo(m * k, 1);
        let w = pseudo(n * k, 2);
        let got = PackedMatrix::from_rows(&w, n, k).apply(&x, m);
        for r in 0..m {
            for c in 0..n {
                let want: f64 = (0..k).map(|i| x[r * k + i] as f64 * w[c * k + i] as f64).sum();
                assert!((got[r * n + c] as f64 - want).abs() < 1e-4, "({r},{c})");
            }
        }
    }

    #[test]
    fn a_row_is_bit_identical_whatever_else_is_in_the_batch() {
        let (n, k) = (50, 33);
        let w = PackedMatrix::from_rows(&pseudo(n * k, 3), n, k);
        let x = pseudo(200 * k, 4);
        let all = w.apply(&x, 200);
        for (start, len) in [(0, 1), (5, 7), (17, 100), (199, 1), (90, 13)] {
            let part = w.apply(&x[start * k..(start + len) * k], len);
            assert_eq!(part, all[start * n..(start + len) * n].to_vec(), "rows {start}..+{len}");
        }
    }

    #[test]
    fn from_columns_is_the_transpose() {
        let (k, n) = (5, 3);
        let m = pseudo(k * n, 9);
        let x = pseudo(2 * k, 8);
        let got = PackedMatrix::from_columns(&m, k, n).apply(&x, 2);
        for r in 0..2 {
            for c in 0..n {
                let want: f32 = (0..k).map(|i| x[r * k + i] * m[i * n + c]).sum();
                assert!((got[r * n + c] - want).abs() < 1e-5);
            }
        }
    }
}
