//! Default values of `config.json` fields shared by several families (serde `default = "…"`).

pub(crate) fn one() -> usize {
    1
}

pub(crate) fn one_f64() -> f64 {
    1.0
}

pub(crate) fn yes() -> bool {
    true
}

/// transformers' `rms_norm_eps` default for most families.
pub(crate) fn rms_norm_eps() -> f64 {
    1e-6
}
