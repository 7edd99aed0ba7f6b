//! Domain checks of config values, shared by every family's `validate` and by the rope parser:
//! each names the field and says what was expected. Sizes are bounded by [`MAX_DIM`] so that a
//! product of two never overflows `usize` (larger products are bounded by the size estimate).

use super::{ConfigSource, LoadError};

/// The largest size or count a config may hold (2^24: above every published dimension).
pub const MAX_DIM: usize = 1 << 24;

/// The most decoder layers a config may hold (published models have at most a few hundred).
pub const MAX_LAYERS: usize = 4096;

impl ConfigSource {
    /// A size the math needs at least one of: `1..=MAX_DIM`.
    pub fn dim(&self, field: &str, v: usize) -> Result<usize, LoadError> {
        if (1..=MAX_DIM).contains(&v) {
            Ok(v)
        } else {
            Err(self.error(field, format!("expected an integer in 1..={MAX_DIM}, found {v}")))
        }
    }

    /// A layer count: `1..=MAX_LAYERS`.
    pub fn layers(&self, field: &str, v: usize) -> Result<usize, LoadError> {
        if (1..=MAX_LAYERS).contains(&v) {
            Ok(v)
        } else {
            Err(self.error(field, format!("expected an integer in 1..={MAX_LAYERS}, found {v}")))
        }
    }

    /// A count that may be zero: `0..=MAX_DIM`.
    pub fn count(&self, field: &str, v: usize) -> Result<usize, LoadError> {
        if v <= MAX_DIM {
            Ok(v)
        } else {
            Err(self.error(field, format!("expected an integer in 0..={MAX_DIM}, found {v}")))
        }
    }

    /// An optional size: `1..=MAX_DIM` when present.
    pub fn opt_dim(&self, field: &str, v: Option<usize>) -> Result<Option<usize>, LoadError> {
        v.map(|v| self.dim(field, v)).transpose()
    }

    /// A size that must be even (rotated in pairs).
    pub fn even(&self, field: &str, v: usize) -> Result<usize, LoadError> {
        if v.is_multiple_of(2) {
            Ok(v)
        } else {
            Err(self.error(field, format!("expected an even number (rotary dims rotate in pairs), found {v}")))
        }
    }

    /// `divisor` (of `field`) divides `of` (of `of_field`).
    pub fn divides(&self, field: &str, divisor: usize, of_field: &str, of: usize) -> Result<(), LoadError> {
        if divisor > 0 && of.is_multiple_of(divisor) {
            Ok(())
        } else {
            Err(self.error(field, format!("expected a divisor of {of_field} = {of}, found {divisor}")))
        }
    }

    /// `v` (of `field`) is at most `max` (of `max_field`).
    pub fn at_most(&self, field: &str, v: usize, max_field: &str, max: usize) -> Result<(), LoadError> {
        if v <= max {
            Ok(())
        } else {
            Err(self.error(field, format!("expected at most {max_field} = {max}, found {v}")))
        }
    }

    /// A per-layer list has one entry per layer.
    pub fn one_per_layer(&self, field: &str, len: usize, layers: usize) -> Result<(), LoadError> {
        if len == layers {
            Ok(())
        } else {
            Err(self.error(field, format!("expected {layers} entries (num_hidden_layers), found {len}")))
        }
    }

    /// A finite number above `min`, still finite and above `min` as the f32 the kernels use.
    pub fn above(&self, field: &str, v: f64, min: f64) -> Result<f64, LoadError> {
        let as_f32 = v as f32;
        if v.is_finite() && v > min && as_f32.is_finite() && as_f32 as f64 > min {
            Ok(v)
        } else {
            Err(self.error(field, format!("expected a finite number > {min}, found {v}")))
        }
    }

    /// A finite number > 0 (an epsilon, a theta, a scaling factor).
    pub fn positive(&self, field: &str, v: f64) -> Result<f64, LoadError> {
        self.above(field, v, 0.0)
    }

    /// A finite number ≥ 0.
    pub fn non_negative(&self, field: &str, v: f64) -> Result<f64, LoadError> {
        if v.is_finite() && v >= 0.0 && (v as f32).is_finite() {
            Ok(v)
        } else {
            Err(self.error(field, format!("expected a finite number ≥ 0, found {v}")))
        }
    }

    /// A fraction in `(0, 1]`.
    pub fn fraction(&self, field: &str, v: f64) -> Result<f64, LoadError> {
        if v > 0.0 && v <= 1.0 {
            Ok(v)
        } else {
            Err(self.error(field, format!("expected a number in (0, 1], found {v}")))
        }
    }
}
