//! Pieces of `config.json` handling shared by several families: serde defaults of common fields
//! (`default = "super::config::…"`) and checks of fields every family reads the same way. Each
//! family's own `Config` lives in its family file.

use crate::checkpoint::{ConfigSource, LoadError};

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

/// Rejects a `hidden_act` other than SiLU (the only one these families use).
pub(crate) fn check_silu(cfg: &ConfigSource, act: &Option<String>) -> Result<(), LoadError> {
    match act.as_deref() {
        None | Some("silu") | Some("swish") => Ok(()),
        Some(other) => Err(cfg.error("hidden_act", format!("{other:?} is not supported (silu)"))),
    }
}
