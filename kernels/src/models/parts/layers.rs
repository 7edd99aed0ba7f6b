//! Parts shared by every family: linear layers on packed weights, RMSNorm weights, the SwiGLU
//! MLP. Each is built from a [`WeightSource`] under its Hugging Face tensor names.

use crate::checkpoint::{LoadError, WeightSource};
use crate::cpu::activation::swiglu_fused;
use crate::cpu::gemm::PackedMatrix;
use crate::cpu::norm::rms_norm_inplace;

/// `y = x·Wᵀ + b` on a packed weight; several HF projections may be fused into one (their rows
/// stacked), which changes no value since each output column is its own reduction.
pub struct Linear {
    pub(crate) weight: PackedMatrix,
    pub(crate) bias: Option<Vec<f32>>,
}

impl Linear {
    /// Loads `{prefix}.weight` (`[out × in]`) and, when `bias`, `{prefix}.bias`.
    pub fn load(
        w: &dyn WeightSource,
        prefix: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Self, LoadError> {
        Self::fused(w, &[prefix], in_dim, &[out_dim], bias)
    }

    /// Stacks the rows of several projections reading the same input.
    pub fn fused(
        w: &dyn WeightSource,
        prefixes: &[&str],
        in_dim: usize,
        out_dims: &[usize],
        bias: bool,
    ) -> Result<Self, LoadError> {
        let mut rows = Vec::new();
        let mut biases = Vec::new();
        let out: usize = out_dims.iter().sum();
        if w.shapes_only() {
            let bias = bias.then(|| vec![0.0; out]);
            return Ok(Linear { weight: PackedMatrix::shape_only(out, in_dim), bias });
        }
        for (prefix, &out) in prefixes.iter().zip(out_dims) {
            rows.extend(w.tensor(&format!("{prefix}.weight"), &[out, in_dim])?);
            if bias {
                biases.extend(w.tensor(&format!("{prefix}.bias"), &[out])?);
            }
        }
        Ok(Self::from_parts(&rows, out, in_dim, bias.then_some(biases)))
    }

    pub fn from_parts(rows: &[f32], out_dim: usize, in_dim: usize, bias: Option<Vec<f32>>) -> Self {
        Linear { weight: PackedMatrix::from_rows(rows, out_dim, in_dim), bias }
    }

    pub fn out_dim(&self) -> usize {
        self.weight.out_dim()
    }

    pub fn in_dim(&self) -> usize {
        self.weight.in_dim()
    }

    /// `m` rows of input → `m` rows of output.
    pub fn forward(&self, x: &[f32], m: usize) -> Vec<f32> {
        let mut y = self.weight.apply(x, m);
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(b.len()) {
                for (v, bb) in row.iter_mut().zip(b) {
                    *v += bb;
                }
            }
        }
        y
    }

    /// Multiply-adds per input row (for FLOP counts).
    pub fn macs_per_row(&self) -> usize {
        self.out_dim() * self.in_dim()
    }
}

/// An RMSNorm's weight and epsilon.
pub struct RmsNorm {
    pub weight: Vec<f32>,
    pub eps: f32,
}

impl RmsNorm {
    pub fn load(w: &dyn WeightSource, name: &str, dim: usize, eps: f32) -> Result<Self, LoadError> {
        Ok(RmsNorm { weight: w.tensor(name, &[dim])?, eps })
    }

    /// A zero-centred norm (`(1 + w) · x̂`, Qwen3-Next), stored as the plain norm of `1 + w`.
    pub fn load_zero_centred(w: &dyn WeightSource, name: &str, dim: usize, eps: f32) -> Result<Self, LoadError> {
        let mut norm = Self::load(w, name, dim, eps)?;
        norm.weight.iter_mut().for_each(|v| *v += 1.0);
        Ok(norm)
    }

    pub fn forward_inplace(&self, x: &mut [f32]) {
        rms_norm_inplace(x, &self.weight, self.eps);
    }

    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut y = x.to_vec();
        self.forward_inplace(&mut y);
        y
    }
}

/// The SwiGLU MLP: `down(silu(gate(x)) · up(x))`, gate and up fused into one product.
pub struct Mlp {
    pub(crate) gate_up: Linear,
    pub(crate) down: Linear,
    pub(crate) inter: usize,
}

impl Mlp {
    /// `{prefix}.gate_proj`, `{prefix}.up_proj`, `{prefix}.down_proj`.
    pub fn load(
        w: &dyn WeightSource,
        prefix: &str,
        hidden: usize,
        inter: usize,
        bias: bool,
    ) -> Result<Self, LoadError> {
        Self::load_named(w, prefix, ["gate_proj", "up_proj", "down_proj"], hidden, inter, bias)
    }

    /// Same, with other projection names (e.g. Mixtral-style `w1`, `w3`, `w2`).
    pub fn load_named(
        w: &dyn WeightSource,
        prefix: &str,
        [gate, up, down]: [&str; 3],
        hidden: usize,
        inter: usize,
        bias: bool,
    ) -> Result<Self, LoadError> {
        let gate_up =
            Linear::fused(w, &[&format!("{prefix}.{gate}"), &format!("{prefix}.{up}")], hidden, &[inter, inter], bias)?;
        let down = Linear::load(w, &format!("{prefix}.{down}"), inter, hidden, bias)?;
        Ok(Mlp { gate_up, down, inter })
    }

    /// From already-stacked `[gate; up]` rows (`2·inter × hidden`) and `down` (`hidden × inter`).
    pub fn from_parts(gate_up: &[f32], down: &[f32], hidden: usize, inter: usize) -> Self {
        Mlp {
            gate_up: Linear::from_parts(gate_up, 2 * inter, hidden, None),
            down: Linear::from_parts(down, hidden, inter, None),
            inter,
        }
    }

    pub fn forward(&self, x: &[f32], m: usize) -> Vec<f32> {
        let gu = self.gate_up.forward(x, m);
        let mut act = vec![0.0; m * self.inter];
        swiglu_fused(&gu, self.inter, &mut act);
        self.down.forward(&act, m)
    }

    pub fn macs_per_row(&self) -> usize {
        self.gate_up.macs_per_row() + self.down.macs_per_row()
    }
}
