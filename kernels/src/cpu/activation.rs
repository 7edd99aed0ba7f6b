//! Activations. `silu(x) = x · sigmoid(x)`; SwiGLU multiplies it into the up projection.

/// `x · sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `sigmoid(x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SwiGLU over rows of a fused `[gate | up]` projection (`2·inter` wide) into `out` (`inter` wide
/// rows): `out = silu(gate) · up`.
pub fn swiglu_fused(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    assert_eq!(gate_up.len(), out.len() * 2);
    for (gu, o) in gate_up.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
        let (g, u) = gu.split_at(inter);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = silu(g) * u;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_of_zero_is_zero_and_large_inputs_pass() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(20.0) - 20.0).abs() < 1e-6);
        assert!(silu(-20.0).abs() < 1e-6);
    }
}
