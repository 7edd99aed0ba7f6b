//! Pieces of `config.json` handling shared by several families: serde defaults of common fields
//! (`default = "super::config::…"`) and checks of fields every family reads the same way. Each
//! family's own `Config` lives in its family file.

use crate::checkpoint::{parse_rope, ConfigSource, LoadError};
use crate::cpu::rope::RopeParams;

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

/// A norm epsilon: finite and > 0 (0 divides by zero on an all-zero row, a negative one takes
/// the square root of a negative number).
pub(crate) fn check_eps(cfg: &ConfigSource, eps: f64) -> Result<f32, LoadError> {
    Ok(cfg.positive("rms_norm_eps", eps)? as f32)
}

/// The config's rope (checked by [`parse_rope`]), for heads of `head_dim` (named `head_field`)
/// of which the default variant rotates `default_dim`: the rotated dims must pair up within the
/// head.
pub(crate) fn checked_rope(
    cfg: &ConfigSource,
    head_field: &str,
    head_dim: usize,
    default_dim: usize,
) -> Result<RopeParams, LoadError> {
    let rope = parse_rope(cfg)?;
    let rotated = rope.rotated_dims(head_dim, default_dim);
    if rotated % 2 != 0 || rotated > head_dim {
        return Err(cfg.error(
            head_field,
            format!(
                "{head_field} = {head_dim} with partial_rotary_factor {} rotates {rotated} dims; expected an even \
                 number of at most {head_dim} (dims rotate in pairs)",
                rope.partial_rotary_factor
            ),
        ));
    }
    Ok(rope)
}

/// The names of a family's routing fields: experts, experts per token, groups, groups kept.
pub(crate) type RoutingFields = [&'static str; 4];

/// Expert routing: `top_k` of `experts` experts, chosen within the best `topk_group` of
/// `n_group` equal groups (so `n_group` divides `experts` and the kept groups hold `top_k`).
pub(crate) fn check_routing(
    cfg: &ConfigSource,
    [experts_f, top_k_f, group_f, kept_f]: RoutingFields,
    experts: usize,
    top_k: usize,
    n_group: usize,
    topk_group: usize,
) -> Result<(), LoadError> {
    cfg.dim(experts_f, experts)?;
    cfg.dim(top_k_f, top_k)?;
    cfg.dim(group_f, n_group)?;
    cfg.dim(kept_f, topk_group)?;
    cfg.divides(group_f, n_group, experts_f, experts)?;
    cfg.at_most(kept_f, topk_group, group_f, n_group)?;
    let reachable = topk_group * (experts / n_group);
    cfg.at_most(top_k_f, top_k, &format!("{kept_f} × {experts_f} / {group_f}"), reachable)
}
