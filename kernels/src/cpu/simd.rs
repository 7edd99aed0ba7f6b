//! Eight-lane f32 vectors behind one trait, so each kernel is written once: AVX2+FMA where the
//! build targets x86-64-v3, portable arrays elsewhere (`Best` names the one in use).
//!
//! Batch invariance rests on this module: every kernel built on it reduces in a fixed order that
//! depends only on the shapes of one row, never on how many rows run together. `hsum` always adds
//! lanes in the same tree, and `fma` is a fused multiply-add on AVX2 and `a * b + c` in the
//! fallback; a given binary on a given CPU type always takes the same path.

/// Eight f32 lanes.
pub trait Lanes: Copy {
    type V: Copy;
    fn zero() -> Self::V;
    fn splat(x: f32) -> Self::V;
    /// # Safety
    /// `p` must be valid for reading 8 floats.
    unsafe fn load(p: *const f32) -> Self::V;
    /// # Safety
    /// `p` must be valid for writing 8 floats.
    unsafe fn store(p: *mut f32, v: Self::V);
    /// `a * b + c`, lane by lane.
    fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    fn add(a: Self::V, b: Self::V) -> Self::V;
    fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// Sum of the eight lanes: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
    fn hsum(v: Self::V) -> f32;
}

/// Portable fallback: plain arrays, `a * b + c` (unfused).
#[derive(Clone, Copy)]
pub struct Portable;

impl Lanes for Portable {
    type V = [f32; 8];
    #[inline(always)]
    fn zero() -> Self::V {
        [0.0; 8]
    }
    #[inline(always)]
    fn splat(x: f32) -> Self::V {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        unsafe { std::ptr::read_unaligned(p as *const [f32; 8]) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        unsafe { std::ptr::write_unaligned(p as *mut [f32; 8], v) }
    }
    #[inline(always)]
    fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    fn add(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    fn mul(a: Self::V, b: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    fn hsum(v: Self::V) -> f32 {
        let q = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
        (q[0] + q[2]) + (q[1] + q[3])
    }
}

#[cfg(target_arch = "x86_64")]
pub use avx2::Avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Lanes;
    use std::arch::x86_64::*;

    /// AVX2 with FMA (only the `Best` of builds that target them).
    #[derive(Clone, Copy)]
    pub struct Avx2;

    impl Lanes for Avx2 {
        type V = __m256;
        #[inline(always)]
        fn zero() -> __m256 {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        fn splat(x: f32) -> __m256 {
            unsafe { _mm256_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        fn add(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        fn mul(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        fn hsum(v: __m256) -> f32 {
            unsafe {
                let lo = _mm256_castps256_ps128(v);
                let hi = _mm256_extractf128_ps(v, 1);
                let q = _mm_add_ps(lo, hi); // [l0+l4, l1+l5, l2+l6, l3+l7]
                let sh = _mm_movehl_ps(q, q); // [q2, q3, ..]
                let p = _mm_add_ps(q, sh); // [q0+q2, q1+q3, ..]
                let p1 = _mm_shuffle_ps(p, p, 0b01);
                _mm_cvtss_f32(_mm_add_ss(p, p1))
            }
        }
    }
}

/// The lanes every kernel uses in this build: AVX2+FMA when the build targets it (see
/// `.cargo/config.toml`), the portable arrays otherwise.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
pub type Best = Avx2;
#[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")))]
pub type Best = Portable;

/// `Err` with a clear message when this binary was built for AVX2+FMA and the CPU lacks them
/// (the kernels would die on an illegal instruction).
pub fn check_cpu_supports_build() -> Result<(), String> {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
            return Err("this kvflow binary was built for x86-64-v3 (AVX2 + FMA) but this CPU lacks \
                        them; rebuild without `-C target-cpu=x86-64-v3` (see .cargo/config.toml)"
                .to_string());
        }
    }
    Ok(())
}

/// Dot product of two equal-length slices in a fixed order: two 8-lane accumulators over
/// 16-element steps, an 8-lane step, then a scalar tail.
#[inline(always)]
pub fn dot<L: Lanes>(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = L::zero();
    let mut acc1 = L::zero();
    let mut i = 0;
    unsafe {
        while i + 16 <= n {
            acc0 = L::fma(L::load(pa.add(i)), L::load(pb.add(i)), acc0);
            acc1 = L::fma(L::load(pa.add(i + 8)), L::load(pb.add(i + 8)), acc1);
            i += 16;
        }
        if i + 8 <= n {
            acc0 = L::fma(L::load(pa.add(i)), L::load(pb.add(i)), acc0);
            i += 8;
        }
    }
    let mut s = L::hsum(L::add(acc0, acc1));
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

/// `y += a * x`, lane by lane (no reduction, so no order question).
#[inline(always)]
pub fn axpy<L: Lanes>(y: &mut [f32], a: f32, x: &[f32]) {
    debug_assert_eq!(y.len(), x.len());
    let n = y.len();
    let (py, px) = (y.as_mut_ptr(), x.as_ptr());
    let va = L::splat(a);
    let mut i = 0;
    unsafe {
        while i + 8 <= n {
            L::store(py.add(i), L::fma(va, L::load(px.add(i)), L::load(py.add(i))));
            i += 8;
        }
    }
    while i < n {
        y[i] = fma_scalar::<L>(a, x[i], y[i]);
        i += 1;
    }
}

/// `y += a_k * x_k` for k in 0..n in order, where `term(k)` gives (a_k, x_k): the bits of n
/// `axpy` calls, but each 32-float tile of `y` stays in registers over all n terms instead of
/// being loaded and stored once a term.
#[inline(always)]
pub fn axpy_rows<'x, L: Lanes>(y: &mut [f32], n: usize, mut term: impl FnMut(usize) -> (f32, &'x [f32])) {
    let len = y.len();
    let py = y.as_mut_ptr();
    let mut i = 0;
    unsafe {
        while i + 32 <= len {
            let mut acc =
                [L::load(py.add(i)), L::load(py.add(i + 8)), L::load(py.add(i + 16)), L::load(py.add(i + 24))];
            for k in 0..n {
                let (a, x) = term(k);
                debug_assert_eq!(x.len(), len);
                let (va, px) = (L::splat(a), x.as_ptr().add(i));
                for (j, acc) in acc.iter_mut().enumerate() {
                    *acc = L::fma(va, L::load(px.add(8 * j)), *acc);
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                L::store(py.add(i + 8 * j), *acc);
            }
            i += 32;
        }
        while i + 8 <= len {
            let mut acc = L::load(py.add(i));
            for k in 0..n {
                let (a, x) = term(k);
                acc = L::fma(L::splat(a), L::load(x.as_ptr().add(i)), acc);
            }
            L::store(py.add(i), acc);
            i += 8;
        }
    }
    for (i, y) in y.iter_mut().enumerate().skip(i) {
        for k in 0..n {
            let (a, x) = term(k);
            *y = fma_scalar::<L>(a, x[i], *y);
        }
    }
}

/// One scalar `a * b + c` with the same rounding as the lanes of `L` (fused on AVX2).
#[inline(always)]
pub fn fma_scalar<L: Lanes>(a: f32, b: f32, c: f32) -> f32 {
    let mut out = [0.0f32; 8];
    unsafe {
        L::store(out.as_mut_ptr(), L::fma(L::splat(a), L::splat(b), L::splat(c)));
    }
    out[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_is_the_same_on_every_path_for_exact_inputs() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..37).map(|i| (i % 5) as f32).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert_eq!(dot::<Portable>(&a, &b), want);
        assert_eq!(dot::<Best>(&a, &b), want);
    }

    #[test]
    fn axpy_rows_gives_the_bits_of_one_axpy_a_row() {
        for len in [5, 8, 19, 32, 45, 64, 77] {
            let rows: Vec<Vec<f32>> =
                (0..7).map(|k| (0..len).map(|i| ((i * 7 + k * 13) % 11) as f32 * 0.37 - 1.1).collect()).collect();
            let weights: Vec<f32> = (0..7).map(|k| 0.1 + k as f32 * 0.173).collect();
            let mut one_by_one = vec![0.25f32; len];
            for (w, row) in weights.iter().zip(&rows) {
                axpy::<Best>(&mut one_by_one, *w, row);
            }
            let mut tiled = vec![0.25f32; len];
            axpy_rows::<Best>(&mut tiled, rows.len(), |k| (weights[k], &rows[k]));
            assert_eq!(
                tiled.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                one_by_one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "length {len}"
            );
        }
    }

    #[test]
    fn axpy_adds_a_scaled_row() {
        let mut y = vec![1.0f32; 19];
        let x: Vec<f32> = (0..19).map(|i| i as f32).collect();
        axpy::<Best>(&mut y, 2.0, &x);
        for (i, v) in y.iter().enumerate() {
            assert_eq!(*v, 1.0 + 2.0 * i as f32);
        }
    }
}
