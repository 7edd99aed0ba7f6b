//! Seeded random models of any family, from a TOML model spec: the `config.json` fields of the
//! family (same names) plus `seed` and optionally `init_std` (in `0..=1`); any other key is an
//! error naming the keys the family reads (a typo must not fall back to a default). Weights are
//! drawn per tensor from a generator keyed by `(seed, tensor name)`, so a spec always builds the
//! same model, and norm weights sit around 1 (or around 0 for zero-centred norms) as trained
//! checkpoints' do.
//!
//! ```toml
//! model_type = "llama"
//! seed = 7
//! hidden_size = 1024
//! num_hidden_layers = 8
//! num_attention_heads = 16
//! num_key_value_heads = 4
//! head_dim = 64
//! intermediate_size = 2816
//! vocab_size = 32000
//! ```

use super::{ConfigOrigin, ConfigSource, LoadError, WeightSource};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A parsed model spec: the config it stands for and the weights' generator.
pub struct ModelSpec {
    pub config: ConfigSource,
    pub weights: RandomWeights,
}

impl ModelSpec {
    pub fn read(path: &Path) -> Result<Self, LoadError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| LoadError::Io { path: path.to_path_buf(), source })?;
        Self::parse(path.to_path_buf(), &text)
    }

    /// Parses the text of a spec (any text: errors, never a panic). Keys the family does not
    /// read are rejected when the model is built (see [`ConfigOrigin::Spec`]).
    pub fn parse(path: PathBuf, text: &str) -> Result<Self, LoadError> {
        let table: toml::Table =
            toml::from_str(text).map_err(|e| LoadError::Parse { path: path.clone(), message: e.to_string() })?;
        let value = serde_json::to_value(&table)
            .map_err(|e| LoadError::Parse { path: path.clone(), message: e.to_string() })?;
        let Value::Object(mut obj) = value else {
            return Err(LoadError::Parse { path, message: "expected a TOML table".into() });
        };
        let seed = match obj.remove("seed") {
            Some(v) => v.as_u64().ok_or_else(|| LoadError::config(&path, "seed", "expected a non-negative integer"))?,
            None => return Err(LoadError::config(&path, "seed", "missing: a model spec needs a seed")),
        };
        let std = match obj.remove("init_std") {
            Some(v) => match v.as_f64() {
                Some(s) if (0.0..=MAX_INIT_STD).contains(&s) => s as f32,
                _ => {
                    return Err(LoadError::config(
                        &path,
                        "init_std",
                        format!("expected a number in 0..={MAX_INIT_STD}, found {v}"),
                    ))
                }
            },
            None => 0.05,
        };
        let config = ConfigSource::from_value(path, Value::Object(obj), ConfigOrigin::Spec)?;
        config.model_type()?;
        Ok(ModelSpec { config, weights: RandomWeights::new(seed, std) })
    }
}

/// The widest weight distribution a spec may ask for: wider ones overflow f32 activations within
/// a few layers (NaN logits, not an error).
const MAX_INIT_STD: f64 = 1.0;

/// Deterministic random tensors.
#[derive(Clone, Debug)]
pub struct RandomWeights {
    seed: u64,
    std: f32,
    zero_centred_norms: bool,
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3))
}

impl RandomWeights {
    pub fn new(seed: u64, std: f32) -> Self {
        RandomWeights { seed, std, zero_centred_norms: false }
    }

    /// Norm weights around 0 instead of 1 (families whose norms compute `(1 + w)·x̂`).
    pub fn with_zero_centred_norms(mut self, yes: bool) -> Self {
        self.zero_centred_norms = yes;
        self
    }
}

impl WeightSource for RandomWeights {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        let path = || PathBuf::from("<random weights>");
        let n = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(|| LoadError::NotAModel {
            path: path(),
            message: format!("tensor `{name}`: shape {shape:?} has more elements than fit in memory"),
        })?;
        if !self.std.is_finite() {
            return Err(LoadError::NonFinite { path: path(), name: name.to_string(), index: 0, value: self.std });
        }
        let mut state = self.seed ^ fnv1a(name.as_bytes());
        // Uniform on [-√3·std, √3·std]: the requested standard deviation, cheap to draw.
        let half_width = self.std * 3f32.sqrt();
        let is_norm = name.contains("norm") && name.ends_with(".weight");
        let centre = if is_norm && !self.zero_centred_norms { 1.0 } else { 0.0 };
        Ok((0..n)
            .map(|_| {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                let u = (z >> 40) as f32 / (1u64 << 24) as f32;
                centre + (2.0 * u - 1.0) * half_width
            })
            .collect())
    }

    fn contains(&self, _name: &str) -> bool {
        true
    }
}
