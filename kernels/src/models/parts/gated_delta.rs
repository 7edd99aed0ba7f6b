//! Gated DeltaNet (Yang et al., "Gated Delta Networks"), as transformers'
//! `Qwen3NextGatedDeltaNet` computes it one token at a time: the linear-attention mixer of
//! Qwen3-Next.
//!
//! Per token (state per request and layer: the conv window `[C × (K−1)]` of the pre-conv
//! `[q | k | v]`, then `S` `[v_heads × d_k × d_v]`):
//! 1. `in_proj_qkvz` and `in_proj_ba`, grouped per key head: `[q | k | v (r heads) | z (r heads)]`
//!    and `[b (r) | a (r)]` with `r = v_heads / k_heads`;
//! 2. causal conv + SiLU over `[q | k | v]`;
//! 3. `β = sigmoid(b)`, `g = −exp(A_log)·softplus(a + dt_bias)`;
//! 4. per value head `h` (key head `h / r`): L2-normalised q (× d_k^-½) and k, delta rule with decay
//!    `exp(g)`;
//! 5. `o = rmsnorm(o)·w·silu(z)` per head, then `out_proj`.
//!
//! Rows advance their request's state in row order, so a request's rows must appear in position
//! order within a step (as [`BatchLayout`] lays them out).

use super::layers::{Linear, RmsNorm};
use crate::checkpoint::{LoadError, WeightSource};
use crate::cpu::activation::{sigmoid, silu};
use crate::cpu::norm::inverse_rms;
use crate::cpu::recurrent::{causal_conv_step, delta_rule_step, l2_normalize, softplus, DeltaInputs};
use crate::kv::StatePool;
use crate::models::batch::BatchLayout;

/// transformers' `l2norm` eps in the linear-attention kernels (added to the sum of squares).
pub(crate) const L2_NORM_EPS: f32 = 1e-6;

/// One Gated DeltaNet layer.
pub struct GatedDeltaNet {
    /// `[in_proj_qkvz; in_proj_ba]`, one product.
    pub(crate) in_proj: Linear,
    pub(crate) conv_weight: Vec<f32>,
    /// `−exp(A_log)` per value head.
    pub(crate) neg_a: Vec<f32>,
    pub(crate) dt_bias: Vec<f32>,
    pub(crate) norm: RmsNorm,
    pub(crate) out_proj: Linear,
    pub(crate) k_heads: usize,
    pub(crate) v_heads: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
    pub(crate) kernel: usize,
}

impl GatedDeltaNet {
    pub(crate) fn conv_channels(&self) -> usize {
        2 * self.k_heads * self.dk + self.v_heads * self.dv
    }

    pub(crate) fn conv_state_width(&self) -> usize {
        self.conv_channels() * (self.kernel - 1)
    }

    /// Floats of state per request: the conv window, then `S` per value head.
    pub fn state_width(&self) -> usize {
        self.conv_state_width() + self.v_heads * self.dk * self.dv
    }

    pub fn forward(&self, x: &[f32], layout: &BatchLayout, states: &mut StatePool, offset: usize) -> Vec<f32> {
        let t = layout.rows;
        let (nk, nv, dk, dv) = (self.k_heads, self.v_heads, self.dk, self.dv);
        let r_per_k = nv / nk;
        let group = 2 * dk + 2 * r_per_k * dv;
        let qkvz_width = nk * group;
        let proj_width = qkvz_width + 2 * nv;
        let channels = self.conv_channels();
        // 1. projections for every row                              [t × (qkvz + ba)]
        let proj = self.in_proj.forward(x, t);
        let mut out = vec![0.0f32; t * nv * dv];
        let (mut mixed, mut conv) = (vec![0.0f32; channels], vec![0.0f32; channels]);
        let (mut z, mut beta, mut decay) = (vec![0.0f32; nv * dv], vec![0.0f32; nv], vec![0.0f32; nv]);
        let (mut o, mut mem) = (vec![0.0f32; dv], vec![0.0f32; dv]);
        // 2. each row in order advances its request's state
        for r in 0..t {
            let p = &proj[r * proj_width..(r + 1) * proj_width];
            for g in 0..nk {
                let base = g * group;
                mixed[g * dk..(g + 1) * dk].copy_from_slice(&p[base..base + dk]);
                mixed[nk * dk + g * dk..nk * dk + (g + 1) * dk].copy_from_slice(&p[base + dk..base + 2 * dk]);
                let v_at = 2 * nk * dk + g * r_per_k * dv;
                mixed[v_at..v_at + r_per_k * dv].copy_from_slice(&p[base + 2 * dk..base + 2 * dk + r_per_k * dv]);
                z[g * r_per_k * dv..(g + 1) * r_per_k * dv]
                    .copy_from_slice(&p[base + 2 * dk + r_per_k * dv..base + group]);
                let ba = &p[qkvz_width + g * 2 * r_per_k..qkvz_width + (g + 1) * 2 * r_per_k];
                for j in 0..r_per_k {
                    let h = g * r_per_k + j;
                    beta[h] = sigmoid(ba[j]);
                    decay[h] = (self.neg_a[h] * softplus(ba[r_per_k + j] + self.dt_bias[h])).exp();
                }
            }
            let state = &mut states.slot_mut(layout.slot(r))[offset..offset + self.state_width()];
            let (conv_state, s) = state.split_at_mut(self.conv_state_width());
            causal_conv_step(&mixed, &self.conv_weight, self.kernel, conv_state, &mut conv);
            let (q_all, rest) = conv.split_at_mut(nk * dk);
            let (k_all, v_all) = rest.split_at_mut(nk * dk);
            for g in 0..nk {
                l2_normalize(&mut q_all[g * dk..(g + 1) * dk], L2_NORM_EPS);
                l2_normalize(&mut k_all[g * dk..(g + 1) * dk], L2_NORM_EPS);
            }
            let q_scale = 1.0 / (dk as f32).sqrt();
            q_all.iter_mut().for_each(|v| *v *= q_scale);
            for h in 0..nv {
                let kh = h / r_per_k;
                let decays = vec![decay[h]; dk];
                let inputs = DeltaInputs {
                    q: &q_all[kh * dk..(kh + 1) * dk],
                    k: &k_all[kh * dk..(kh + 1) * dk],
                    v: &v_all[h * dv..(h + 1) * dv],
                    beta: beta[h],
                    decay: &decays,
                };
                delta_rule_step(&mut s[h * dk * dv..(h + 1) * dk * dv], inputs, &mut o, &mut mem);
                // gated RMSNorm: rmsnorm(o)·w·silu(z)
                let inv = inverse_rms(&o, self.norm.eps);
                let dst = &mut out[(r * nv + h) * dv..(r * nv + h + 1) * dv];
                for (i, d) in dst.iter_mut().enumerate() {
                    *d = self.norm.weight[i] * (o[i] * inv) * silu(z[h * dv + i]);
                }
            }
            states.keep_row(layout.slot(r), layout.positions[r], offset..offset + self.state_width());
        }
        // 3. output projection                                        [t × hidden]
        self.out_proj.forward(&out, t)
    }

    pub fn macs_per_row(&self) -> usize {
        self.in_proj.macs_per_row() + self.out_proj.macs_per_row()
    }

    /// Multiply-adds of the state update per token (decay, read, write, output).
    pub fn state_macs(&self) -> usize {
        4 * self.v_heads * self.dk * self.dv
    }
}

/// The sizes of a Gated DeltaNet layer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GdnDims {
    pub hidden: usize,
    pub k_heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
    /// Causal conv kernel size.
    pub kernel: usize,
}

impl GdnDims {
    /// Parameters of one Gated DeltaNet layer of these sizes.
    pub(crate) fn params(&self) -> u128 {
        let [h, nk, nv, dk, dv, kernel] =
            [self.hidden, self.k_heads, self.v_heads, self.dk, self.dv, self.kernel].map(|x| x as u128);
        let channels = 2 * nk * dk + nv * dv;
        h * (channels + nv * dv + 2 * nv) + channels * kernel + 2 * nv + dv + nv * dv * h
    }
}

/// Loads the Gated DeltaNet of layer prefix `p` (`model.layers.{l}.linear_attn`).
pub(crate) fn load_gdn(w: &dyn WeightSource, p: &str, dims: GdnDims, eps: f32) -> Result<GatedDeltaNet, LoadError> {
    let GdnDims { hidden, k_heads: nk, v_heads: nv, dk, dv, kernel } = dims;
    let channels = 2 * nk * dk + nv * dv;
    let a_log = w.tensor(&format!("{p}.A_log"), &[nv])?;
    Ok(GatedDeltaNet {
        in_proj: Linear::fused(
            w,
            &[&format!("{p}.in_proj_qkvz"), &format!("{p}.in_proj_ba")],
            hidden,
            &[2 * nk * dk + 2 * nv * dv, 2 * nv],
            false,
        )?,
        conv_weight: w.tensor(&format!("{p}.conv1d.weight"), &[channels, 1, kernel])?,
        neg_a: a_log.iter().map(|a| -a.exp()).collect(),
        dt_bias: w.tensor(&format!("{p}.dt_bias"), &[nv])?,
        norm: RmsNorm::load(w, &format!("{p}.norm.weight"), dv, eps)?,
        out_proj: Linear::load(w, &format!("{p}.out_proj"), nv * dv, hidden, false)?,
        k_heads: nk,
        v_heads: nv,
        dk,
        dv,
        kernel,
    })
}
