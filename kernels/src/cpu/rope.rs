//! Rotary position embeddings: the inverse frequencies of each scaling variant a Hugging Face
//! config can name (default, linear, llama3, yarn), computed in f32 as transformers 5 computes
//! them, and their application in the two layouts published models use.
//!
//! - `Neox` (rotate-half): pairs `(x[i], x[i + d/2])`.
//! - `Interleaved` (DeepSeek's `rope_interleave`): pairs `(x[2i], x[2i+1])`, written back
//!   de-interleaved (`[even′ | odd′]`), exactly as transformers does; queries and keys get the same
//!   permutation, so their dot products are those of the interleaved form.

/// The scaling variant of a rope, with its parameters.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    Default,
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    Yarn {
        factor: f64,
        attention_factor: Option<f64>,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        beta_fast: f64,
        beta_slow: f64,
        original_max_position_embeddings: f64,
        truncate: bool,
    },
}

/// Everything that fixes a model's rotary frequencies.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeParams {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// Fraction of each head that rotates (scaled variants read it; see [`RopeParams::inv_freq`]).
    pub partial_rotary_factor: f64,
}

/// Pair layout of the rotated dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    Neox,
    Interleaved,
}

fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeParams {
    /// Dimensions the scaled variants rotate: `int(head_dim · partial_rotary_factor)`.
    fn scaled_dim(&self, head_dim: usize) -> usize {
        (head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Dimensions [`RopeParams::inv_freq`] rotates for these arguments (the two halves of a pair
    /// each; so it must be even).
    pub fn rotated_dims(&self, head_dim: usize, default_dim: usize) -> usize {
        match self.scaling {
            RopeScaling::Default => default_dim,
            _ => self.scaled_dim(head_dim),
        }
    }

    /// `(inv_freq, attention_scaling)` for heads of `head_dim`. The default variant rotates
    /// `default_dim` dimensions (families differ: llama's ignores `partial_rotary_factor`); the
    /// scaled variants rotate `int(head_dim · partial_rotary_factor)`, as transformers' shared
    /// rope functions do.
    pub fn inv_freq(&self, head_dim: usize, default_dim: usize) -> (Vec<f32>, f32) {
        let scaled_dim = self.scaled_dim(head_dim);
        let base_freqs = |dim: usize| -> Vec<f32> {
            // base ** (arange(0, dim, 2).float() / dim), then 1 / that, all in f32.
            (0..dim).step_by(2).map(|i| 1.0f32 / (self.theta as f32).powf(i as f32 / dim as f32)).collect()
        };
        match &self.scaling {
            RopeScaling::Default => (base_freqs(default_dim), 1.0),
            RopeScaling::Linear { factor } => {
                let f = *factor as f32;
                (base_freqs(scaled_dim).into_iter().map(|v| v / f).collect(), 1.0)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = (old / low_freq_factor) as f32;
                let high_wavelen = (old / high_freq_factor) as f32;
                let factor = *factor as f32;
                let inv = base_freqs(scaled_dim)
                    .into_iter()
                    .map(|f| {
                        let wavelen = (2.0 * std::f64::consts::PI) as f32 / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        // transformers: ~(wavelen < high) * ~(wavelen > low); frequencies are finite.
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                        if medium {
                            let smooth = ((*old as f32) / wavelen - *low_freq_factor as f32)
                                / (high_freq_factor - low_freq_factor) as f32;
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect();
                (inv, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                attention_factor,
                mscale,
                mscale_all_dim,
                beta_fast,
                beta_slow,
                original_max_position_embeddings: orig,
                truncate,
            } => {
                let dim = scaled_dim;
                let attention = attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                    (Some(m), Some(a)) if *m != 0.0 && *a != 0.0 => {
                        yarn_get_mscale(*factor, *m) / yarn_get_mscale(*factor, *a)
                    }
                    _ => yarn_get_mscale(*factor, 1.0),
                });
                let correction_dim = |rot: f64| {
                    (dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * self.theta.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim as f64 - 1.0);
                if low == high {
                    high += 0.001;
                }
                let pos_freqs: Vec<f32> =
                    (0..dim).step_by(2).map(|i| (self.theta as f32).powf(i as f32 / dim as f32)).collect();
                let f = *factor as f32;
                let inv = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        let extrapolation = 1.0 / p;
                        let interpolation = 1.0 / (f * p);
                        let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
                    })
                    .collect();
                (inv, attention as f32)
            }
        }
    }

    /// DeepSeek's softmax-scale correction (`yarn_apply_mscale`): with a scaled rope and a
    /// non-zero `mscale_all_dim`, the attention scale is multiplied by `mscale²`.
    pub fn softmax_scale_correction(&self) -> f32 {
        match &self.scaling {
            RopeScaling::Default => 1.0,
            RopeScaling::Yarn { factor, mscale_all_dim: Some(all), .. } if *all != 0.0 => {
                let m = yarn_get_mscale(*factor, *all);
                (m * m) as f32
            }
            _ => 1.0,
        }
    }
}

/// Precomputed frequencies for one model; rotates heads in place.
#[derive(Clone, Debug)]
pub struct Rope {
    pub(crate) inv_freq: Vec<f32>,
    pub(crate) attention_scaling: f32,
    pub(crate) style: RopeStyle,
}

impl Rope {
    pub fn new(inv_freq: Vec<f32>, attention_scaling: f32, style: RopeStyle) -> Self {
        Rope { inv_freq, attention_scaling, style }
    }

    /// Dimensions rotated per head.
    pub fn rotary_dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    /// `(cos, sin)` of every frequency at `pos`, already multiplied by the attention scaling.
    pub fn cos_sin(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let p = pos as f32;
        let s = self.attention_scaling;
        self.inv_freq.iter().map(|&f| ((p * f).cos() * s, (p * f).sin() * s)).unzip()
    }

    /// Rotates the first `rotary_dim` values of each `head_dim`-wide head in `x`.
    pub fn rotate_heads(&self, x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = self.inv_freq.len();
        for head in x.chunks_exact_mut(head_dim) {
            match self.style {
                RopeStyle::Neox => {
                    for i in 0..half {
                        let (a, b) = (head[i], head[i + half]);
                        head[i] = a * cos[i] + (-b) * sin[i];
                        head[i + half] = b * cos[i] + a * sin[i];
                    }
                }
                RopeStyle::Interleaved => {
                    // On the stack for every published rope width; on the heap beyond.
                    let (mut stack, mut heap) = ([0.0f32; 512], Vec::new());
                    let rotated = if 2 * half <= stack.len() {
                        &mut stack[..2 * half]
                    } else {
                        heap.resize(2 * half, 0.0);
                        &mut heap[..]
                    };
                    for i in 0..half {
                        let (a, b) = (head[2 * i], head[2 * i + 1]);
                        rotated[i] = a * cos[i] - b * sin[i];
                        rotated[half + i] = b * cos[i] + a * sin[i];
                    }
                    head[..2 * half].copy_from_slice(rotated);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(scaling: RopeScaling) -> RopeParams {
        RopeParams { theta: 10000.0, scaling, partial_rotary_factor: 1.0 }
    }

    #[test]
    fn default_frequencies_follow_the_base() {
        let (inv, s) = params(RopeScaling::Default).inv_freq(8, 8);
        assert_eq!(s, 1.0);
        assert_eq!(inv[0], 1.0);
        assert!((inv[1] - 0.1).abs() < 1e-7);
        assert!((inv[3] - 1e-3).abs() < 1e-9);
    }

    #[test]
    fn linear_scaling_divides_every_frequency() {
        let (base, _) = params(RopeScaling::Default).inv_freq(8, 8);
        let (inv, _) = params(RopeScaling::Linear { factor: 4.0 }).inv_freq(8, 8);
        for (a, b) in base.iter().zip(&inv) {
            assert_eq!(a / 4.0, *b);
        }
    }

    #[test]
    fn yarn_keeps_high_frequencies_and_interpolates_low_ones() {
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 64.0,
            truncate: true,
        };
        let (base, _) = params(RopeScaling::Default).inv_freq(64, 64);
        let (inv, s) = params(yarn).inv_freq(64, 64);
        assert_eq!(inv[0], base[0]);
        assert!((inv[31] - base[31] / 4.0).abs() < 1e-12);
        assert!((s - (0.1 * 4f64.ln() + 1.0) as f32).abs() < 1e-7);
    }

    #[test]
    fn rotation_preserves_the_norm_in_both_layouts() {
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            let (inv, s) = params(RopeScaling::Default).inv_freq(8, 8);
            let rope = Rope::new(inv, s, style);
            let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
            let norm0: f32 = x.iter().map(|v| v * v).sum();
            let (c, si) = rope.cos_sin(17);
            rope.rotate_heads(&mut x, 8, &c, &si);
            let norm1: f32 = x.iter().map(|v| v * v).sum();
            assert!((norm0 - norm1).abs() < 1e-3, "{style:?}");
        }
    }
}
