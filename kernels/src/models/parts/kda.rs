//! Kimi Delta Attention (KDA, Moonshot's Kimi Linear), one token at a time: a delta rule like
//! [Gated DeltaNet](super::gated_delta)'s, whose forget gate decays each key channel on its own
//! instead of one scalar per head.
//!
//! Per token (state per request and layer: the conv window `[3·H·D × (K−1)]` of the pre-conv
//! `[q | k | v]`, then `S` `[H × D × D]`):
//! 1. `q, k, v` projections, each through its own causal conv + SiLU;
//! 2. forget gate `g = −exp(A_log[h])·softplus(f_b(f_a(x)) + dt_bias)`, one per key channel;
//!    `β = sigmoid(b_proj(x))`; output gate `g_b(g_a(x))`;
//! 3. per head: L2-normalised q (× D^-½) and k, delta rule decaying each key row by `exp(g)`;
//! 4. `o = rmsnorm(o)·w·sigmoid(gate)` per head, then `o_proj`.

use super::gated_delta::L2_NORM_EPS;
use super::layers::{Linear, RmsNorm};
use crate::checkpoint::{LoadError, WeightSource};
use crate::cpu::activation::sigmoid;
use crate::cpu::norm::inverse_rms;
use crate::cpu::recurrent::{causal_conv_step, delta_rule_step, l2_normalize, softplus, DeltaInputs};
use crate::kv::StatePool;
use crate::models::batch::BatchLayout;

/// One Kimi Delta Attention layer.
pub struct KimiDeltaAttention {
    /// `[q; k; v; f_a; g_a; b]`, one product.
    pub(crate) in_proj: Linear,
    pub(crate) f_b: Linear,
    pub(crate) g_b: Linear,
    /// `[q | k | v]` conv kernels, `[3·H·D × K]`.
    pub(crate) conv_weight: Vec<f32>,
    /// `−exp(A_log)` per head.
    pub(crate) neg_a: Vec<f32>,
    /// Per channel `[H·D]`.
    pub(crate) dt_bias: Vec<f32>,
    pub(crate) o_norm: RmsNorm,
    pub(crate) o_proj: Linear,
    pub(crate) heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) kernel: usize,
}

impl KimiDeltaAttention {
    pub(crate) fn conv_state_width(&self) -> usize {
        3 * self.heads * self.head_dim * (self.kernel - 1)
    }

    /// Floats of state per request: the conv window, then `S` per head.
    pub fn state_width(&self) -> usize {
        self.conv_state_width() + self.heads * self.head_dim * self.head_dim
    }

    pub fn forward(&self, x: &[f32], layout: &BatchLayout, states: &mut StatePool, offset: usize) -> Vec<f32> {
        let t = layout.rows;
        let (h, d) = (self.heads, self.head_dim);
        let hd = h * d;
        let width = 3 * hd + 2 * d + h;
        // 1. projections and low-rank gates for every row
        let proj = self.in_proj.forward(x, t);
        let gather = |from: usize, n: usize| -> Vec<f32> {
            (0..t).flat_map(|r| proj[r * width + from..r * width + from + n].iter().copied()).collect()
        };
        let forget = self.f_b.forward(&gather(3 * hd, d), t);
        let gate = self.g_b.forward(&gather(3 * hd + d, d), t);
        let mut out = vec![0.0f32; t * hd];
        let mut conv = vec![0.0f32; 3 * hd];
        let (mut decay, mut o, mut mem) = (vec![0.0f32; hd], vec![0.0f32; d], vec![0.0f32; d]);
        let q_scale = (d as f32).powf(-0.5);
        // 2. each row in order advances its request's state
        for r in 0..t {
            let p = &proj[r * width..(r + 1) * width];
            let state = &mut states.slot_mut(layout.slot(r))[offset..offset + self.state_width()];
            let (conv_state, s) = state.split_at_mut(self.conv_state_width());
            causal_conv_step(&p[..3 * hd], &self.conv_weight, self.kernel, conv_state, &mut conv);
            for (c, dc) in decay.iter_mut().enumerate() {
                *dc = (self.neg_a[c / d] * softplus(forget[r * hd + c] + self.dt_bias[c])).exp();
            }
            let (q_all, rest) = conv.split_at_mut(hd);
            let (k_all, v_all) = rest.split_at_mut(hd);
            for head in 0..h {
                let q = &mut q_all[head * d..(head + 1) * d];
                l2_normalize(q, L2_NORM_EPS);
                q.iter_mut().for_each(|v| *v *= q_scale);
                l2_normalize(&mut k_all[head * d..(head + 1) * d], L2_NORM_EPS);
                let beta = sigmoid(p[3 * hd + 2 * d + head]);
                let inputs = DeltaInputs {
                    q: &q_all[head * d..(head + 1) * d],
                    k: &k_all[head * d..(head + 1) * d],
                    v: &v_all[head * d..(head + 1) * d],
                    beta,
                    decay: &decay[head * d..(head + 1) * d],
                };
                delta_rule_step(&mut s[head * d * d..(head + 1) * d * d], inputs, &mut o, &mut mem);
                // gated RMSNorm: rmsnorm(o)·w·sigmoid(gate)
                let inv = inverse_rms(&o, self.o_norm.eps);
                let dst = &mut out[r * hd + head * d..r * hd + (head + 1) * d];
                for (i, v) in dst.iter_mut().enumerate() {
                    *v = self.o_norm.weight[i] * (o[i] * inv) * sigmoid(gate[r * hd + head * d + i]);
                }
            }
            states.keep_row(layout.slot(r), layout.positions[r], offset..offset + self.state_width());
        }
        // 3. output projection                                        [t × hidden]
        self.o_proj.forward(&out, t)
    }

    pub fn macs_per_row(&self) -> usize {
        self.in_proj.macs_per_row() + self.f_b.macs_per_row() + self.g_b.macs_per_row() + self.o_proj.macs_per_row()
    }

    /// Multiply-adds of the state update per token.
    pub fn state_macs(&self) -> usize {
        4 * self.heads * self.head_dim * self.head_dim
    }
}

/// Parameters of one KDA layer of these sizes.
pub(crate) fn kda_params(hidden: usize, heads: usize, d: usize, kernel: usize) -> u128 {
    let [h, heads, d, kernel] = [hidden, heads, d, kernel].map(|x| x as u128);
    let hd = heads * d;
    h * (3 * hd + 2 * d + heads) + 2 * d * hd + 3 * hd * kernel + heads + hd + d + hd * h
}

/// Loads the KDA of layer prefix `p` (`model.layers.{l}.self_attn`): `heads` heads of `d`
/// channels, convs of `kernel` taps (stored per projection or as one `conv1d`).
pub(crate) fn load_kda(
    w: &dyn WeightSource,
    p: &str,
    hidden: usize,
    heads: usize,
    d: usize,
    kernel: usize,
    eps: f32,
) -> Result<KimiDeltaAttention, LoadError> {
    let hd = heads * d;
    let conv_weight = if w.contains(&format!("{p}.q_conv1d.weight")) || !w.contains(&format!("{p}.conv1d.weight")) {
        let mut all = Vec::with_capacity(3 * hd * kernel);
        for name in ["q_conv1d", "k_conv1d", "v_conv1d"] {
            all.extend(w.tensor(&format!("{p}.{name}.weight"), &[hd, 1, kernel])?);
        }
        all
    } else {
        w.tensor(&format!("{p}.conv1d.weight"), &[3 * hd, 1, kernel])?
    };
    let a_log = w.tensor(&format!("{p}.A_log"), &[1, 1, heads, 1])?;
    Ok(KimiDeltaAttention {
        in_proj: Linear::fused(
            w,
            &[
                &format!("{p}.q_proj"),
                &format!("{p}.k_proj"),
                &format!("{p}.v_proj"),
                &format!("{p}.f_a_proj"),
                &format!("{p}.g_a_proj"),
                &format!("{p}.b_proj"),
            ],
            hidden,
            &[hd, hd, hd, d, d, heads],
            false,
        )?,
        f_b: Linear::load(w, &format!("{p}.f_b_proj"), d, hd, false)?,
        g_b: Linear::load(w, &format!("{p}.g_b_proj"), d, hd, false)?,
        conv_weight,
        neg_a: a_log.iter().map(|a| -a.exp()).collect(),
        dt_bias: w.tensor(&format!("{p}.dt_bias"), &[hd])?,
        o_norm: RmsNorm::load(w, &format!("{p}.o_norm.weight"), d, eps)?,
        o_proj: Linear::load(w, &format!("{p}.o_proj"), hd, hidden, false)?,
        heads,
        head_dim: d,
        kernel,
    })
}
