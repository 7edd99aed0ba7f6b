//! Families `hybrid_gdn` and `gdn`: Qwen3-Next (`model_type` qwen3_next). Gated DeltaNet
//! linear-attention layers, and — unless every layer is linear (`gdn`) — gated full-attention
//! layers (`layer_types`); zero-centred RMSNorms `(1 + w)·x̂`; a softmax-routed MoE with a
//! sigmoid-gated shared expert.
//!
//! Gated DeltaNet, per token (state per request and layer: the conv window `[C × (K−1)]` of the
//! pre-conv `[q | k | v]`, then `S` `[v_heads × d_k × d_v]`):
//! 1. `in_proj_qkvz` and `in_proj_ba`, grouped per key head: `[q | k | v (r heads) | z (r heads)]`
//!    and `[b (r) | a (r)]` with `r = v_heads / k_heads`;
//! 2. causal conv + SiLU over `[q | k | v]`;
//! 3. `β = sigmoid(b)`, `g = −exp(A_log)·softplus(a + dt_bias)`;
//! 4. per value head `h` (key head `h / r`): L2-normalised q (× d_k^-½) and k, delta rule with decay
//!    `exp(g)`;
//! 5. `o = rmsnorm(o)·w·silu(z)` per head, then `out_proj`.

use super::batch::BatchLayout;
use super::decoder::{DecoderLayer, Ffn, Mixer, Model};
use super::layers::{Linear, Mlp, RmsNorm};
use super::mha::{check_silu, load_gqa, QkNorm};
use super::moe::{load_experts, MoeBlock, Routing, Scoring};
use super::Family;
use crate::checkpoint::{parse_rope, ConfigSource, LoadError, WeightSource};
use crate::cpu::activation::{sigmoid, silu};
use crate::cpu::norm::inverse_rms;
use crate::cpu::recurrent::{causal_conv_step, delta_rule_step, l2_normalize, softplus, DeltaInputs};
use crate::cpu::rope::{Rope, RopeStyle};
use crate::kv::StatePool;
use serde::Deserialize;

/// transformers' `l2norm` eps in the linear-attention kernels (added to the sum of squares).
pub(crate) const L2_NORM_EPS: f32 = 1e-6;

/// The `config.json` fields of qwen3_next.
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default = "default_head_dim")]
    pub head_dim: usize,
    #[serde(default = "super::defaults::rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    pub layer_types: Option<Vec<String>>,
    pub full_attention_interval: Option<usize>,
    #[serde(default = "default_conv")]
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    #[serde(default)]
    pub num_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: usize,
    #[serde(default = "super::defaults::yes")]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub shared_expert_intermediate_size: usize,
    #[serde(default = "super::defaults::one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
}

fn default_head_dim() -> usize {
    256
}
fn default_conv() -> usize {
    4
}

/// One Gated DeltaNet layer.
pub struct GatedDeltaNet {
    /// `[in_proj_qkvz; in_proj_ba]`, one product.
    in_proj: Linear,
    conv_weight: Vec<f32>,
    /// `−exp(A_log)` per value head.
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: RmsNorm,
    out_proj: Linear,
    k_heads: usize,
    v_heads: usize,
    dk: usize,
    dv: usize,
    kernel: usize,
}

impl GatedDeltaNet {
    fn conv_channels(&self) -> usize {
        2 * self.k_heads * self.dk + self.v_heads * self.dv
    }

    fn conv_state_width(&self) -> usize {
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

fn load_gdn(w: &dyn WeightSource, p: &str, c: &Config, eps: f32) -> Result<GatedDeltaNet, LoadError> {
    let (nk, nv, dk, dv, kernel) = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
        c.linear_conv_kernel_dim,
    );
    let channels = 2 * nk * dk + nv * dv;
    let a_log = w.tensor(&format!("{p}.A_log"), &[nv])?;
    Ok(GatedDeltaNet {
        in_proj: Linear::fused(
            w,
            &[&format!("{p}.in_proj_qkvz"), &format!("{p}.in_proj_ba")],
            c.hidden_size,
            &[2 * nk * dk + 2 * nv * dv, 2 * nv],
            false,
        )?,
        conv_weight: w.tensor(&format!("{p}.conv1d.weight"), &[channels, 1, kernel])?,
        neg_a: a_log.iter().map(|a| -a.exp()).collect(),
        dt_bias: w.tensor(&format!("{p}.dt_bias"), &[nv])?,
        norm: RmsNorm::load(w, &format!("{p}.norm.weight"), dv, eps)?,
        out_proj: Linear::load(w, &format!("{p}.out_proj"), nv * dv, c.hidden_size, false)?,
        k_heads: nk,
        v_heads: nv,
        dk,
        dv,
        kernel,
    })
}

/// Each layer's kind: `layer_types` when present (legacy names remapped), else full attention
/// every `full_attention_interval` (default 4) layers.
pub fn layer_types(cfg: &ConfigSource, c: &Config) -> Result<Vec<&'static str>, LoadError> {
    let n = c.num_hidden_layers;
    let types: Vec<&'static str> = match &c.layer_types {
        Some(t) => t
            .iter()
            .map(|k| match k.as_str() {
                "linear_attention" | "mamba" => Ok("linear_attention"),
                "full_attention" | "attention" => Ok("full_attention"),
                other => Err(cfg.error("layer_types", format!("{other:?} is not linear_attention or full_attention"))),
            })
            .collect::<Result<_, _>>()?,
        None => {
            let every = c.full_attention_interval.unwrap_or(4).max(1);
            (0..n).map(|i| if (i + 1) % every == 0 { "full_attention" } else { "linear_attention" }).collect()
        }
    };
    if types.len() != n {
        return Err(cfg.error("layer_types", format!("{} entries for {n} layers", types.len())));
    }
    Ok(types)
}

/// Builds a qwen3_next model (`gdn` when no layer is full attention, else `hybrid_gdn`).
pub fn build(cfg: &ConfigSource, w: &dyn WeightSource) -> Result<Model, LoadError> {
    let c: Config = cfg.family_config()?;
    check_silu(cfg, &c.hidden_act)?;
    let (hidden, eps) = (c.hidden_size, c.rms_norm_eps as f32);
    if c.linear_num_key_heads == 0 || c.linear_num_value_heads % c.linear_num_key_heads != 0 {
        return Err(cfg.error("linear_num_value_heads", "must be a multiple of linear_num_key_heads"));
    }
    if c.linear_conv_kernel_dim == 0 {
        return Err(cfg.error("linear_conv_kernel_dim", "must be at least 1"));
    }
    let types = layer_types(cfg, &c)?;
    let rope_params = parse_rope(cfg)?;
    // Qwen3-Next's default rope rotates int(head_dim · partial_rotary_factor) dims, half-split.
    let rotary = (c.head_dim as f64 * rope_params.partial_rotary_factor) as usize;
    let (inv, scaling) = rope_params.inv_freq(c.head_dim, rotary);
    let rope = Rope::new(inv, scaling, RopeStyle::Neox);
    let mlp_only = c.mlp_only_layers.clone().unwrap_or_default();
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for (l, kind) in types.iter().enumerate() {
        let p = format!("model.layers.{l}");
        let mixer = if *kind == "full_attention" {
            Mixer::Gqa(load_gqa(
                w,
                &format!("{p}.self_attn"),
                hidden,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.attention_bias,
                QkNorm::ZeroCentred,
                true,
                eps,
                rope.clone(),
                None,
            )?)
        } else {
            Mixer::Gdn(load_gdn(w, &format!("{p}.linear_attn"), &c, eps)?)
        };
        let is_moe = !mlp_only.contains(&l) && c.num_experts > 0 && (l + 1) % c.decoder_sparse_step.max(1) == 0;
        let ffn = if is_moe {
            Ffn::Moe(Box::new(qwen_moe(cfg, w, &format!("{p}.mlp"), &c)?))
        } else {
            Ffn::Dense(Mlp::load(w, &format!("{p}.mlp"), hidden, c.intermediate_size, false)?)
        };
        layers.push(DecoderLayer {
            input_norm: RmsNorm::load_zero_centred(w, &format!("{p}.input_layernorm.weight"), hidden, eps)?,
            mixer,
            post_norm: RmsNorm::load_zero_centred(w, &format!("{p}.post_attention_layernorm.weight"), hidden, eps)?,
            ffn,
        });
    }
    let family = if types.iter().all(|t| *t == "linear_attention") { Family::Gdn } else { Family::HybridGdn };
    let final_norm = RmsNorm::load_zero_centred(w, "model.norm.weight", hidden, eps)?;
    Model::assemble_with_norm(family, &c.model_type, w, c.vocab_size, hidden, final_norm, c.tie_word_embeddings, layers)
}

fn qwen_moe(cfg: &ConfigSource, w: &dyn WeightSource, prefix: &str, c: &Config) -> Result<MoeBlock, LoadError> {
    let (hidden, n) = (c.hidden_size, c.num_experts);
    if c.num_experts_per_tok == 0 || c.num_experts_per_tok > n {
        return Err(cfg.error("num_experts_per_tok", format!("must be in 1..={n}")));
    }
    let shared = (c.shared_expert_intermediate_size > 0)
        .then(|| Mlp::load(w, &format!("{prefix}.shared_expert"), hidden, c.shared_expert_intermediate_size, false))
        .transpose()?;
    let shared_gate = (c.shared_expert_intermediate_size > 0)
        .then(|| Linear::load(w, &format!("{prefix}.shared_expert_gate"), hidden, 1, false))
        .transpose()?;
    Ok(MoeBlock {
        router: Linear::load(w, &format!("{prefix}.gate"), hidden, n, false)?,
        routing: Routing {
            num_experts: n,
            top_k: c.num_experts_per_tok,
            scoring: Scoring::Softmax,
            correction_bias: None,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: c.norm_topk_prob,
            scaling: 1.0,
        },
        experts: load_experts(
            w,
            &format!("{prefix}.experts"),
            ["gate_proj", "up_proj", "down_proj"],
            n,
            hidden,
            c.moe_intermediate_size,
        )?,
        shared,
        shared_gate,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn types(extra: &str) -> Vec<&'static str> {
        let text = format!(
            r#"{{"model_type": "qwen3_next", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "linear_key_head_dim": 2,
            "linear_value_head_dim": 2, "linear_num_key_heads": 1, "linear_num_value_heads": 2 {extra}}}"#
        );
        let cfg = ConfigSource::parse("config.json".into(), &text).unwrap();
        let c: Config = cfg.family_config().unwrap();
        layer_types(&cfg, &c).unwrap()
    }

    #[test]
    fn layer_types_win_over_the_interval() {
        let t = types(
            r#", "full_attention_interval": 2, "layer_types": ["linear_attention", "linear_attention", "linear_attention", "linear_attention"]"#,
        );
        assert!(t.iter().all(|k| *k == "linear_attention"));
    }

    #[test]
    fn the_interval_places_full_attention_on_every_nth_layer() {
        assert_eq!(
            types(r#", "full_attention_interval": 2"#),
            vec!["linear_attention", "full_attention", "linear_attention", "full_attention"]
        );
        assert_eq!(types("")[3], "full_attention");
    }
}
