//! Model families (one file each), the shared decoder stack and parts, and loading by
//! `model_type` from a checkpoint folder or a seeded spec.
//!
//! Dependencies point one way: [`parts`] (attention, linear-attention, MoE and basic layers) ←
//! `decoder` (the layer stack and the step) ← the family files (`mha`, `deepseek`, `qwen3_next`,
//! `kimi_linear`), which turn a `config.json` into parts and a [`Model`] and never import each
//! other; `config` holds what several families' configs share. This file dispatches by family.

mod batch;
mod config;
mod decoder;
pub mod deepseek;
mod family;
pub mod kimi_linear;
pub mod mha;
pub mod parts;
pub mod qwen3_next;

pub use batch::{BatchLayout, ForwardOutput, LogitsWanted, SeqInput};
pub use decoder::{check_context, Model, ModelCache, Phase, StepActivations};
pub use family::{Family, FamilyInfo, FAMILIES};

use crate::checkpoint::{ConfigSource, LoadError, ModelSpec, SafetensorsDir, WeightSource};
use std::path::Path;

/// Builds the model a config describes from `weights`.
pub fn build(cfg: &ConfigSource, weights: &dyn WeightSource) -> Result<Model, LoadError> {
    let model_type = cfg.model_type()?;
    // The context: `max_position_embeddings`, or Kimi Linear's `model_max_length`.
    let mut max_positions = None;
    for key in ["max_position_embeddings", "model_max_length"] {
        match cfg.value.get(key) {
            None | Some(serde_json::Value::Null) => continue,
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => max_positions = Some(usize::try_from(n).unwrap_or(usize::MAX)),
                _ => return Err(cfg.error(key, format!("expected a whole number ≥ 1, got {v}"))),
            },
        }
        break;
    }
    let mut model = match Family::for_model_type(model_type) {
        Some(Family::Mha) => mha::build(cfg, weights),
        Some(Family::Mla) => deepseek::build(cfg, weights, false),
        Some(Family::SparseMla) => deepseek::build(cfg, weights, true),
        Some(Family::HybridGdn | Family::Gdn) => qwen3_next::build(cfg, weights),
        Some(Family::HybridKda) => kimi_linear::build(cfg, weights),
        None => Err(LoadError::UnknownModelType {
            path: cfg.path.clone(),
            found: model_type.to_string(),
            supported: Family::supported_model_types(),
        }),
    }?;
    model.max_positions = max_positions;
    Ok(model)
}

/// Loads a model from a Hugging Face checkpoint folder, or builds a seeded random one when
/// `source` is a TOML model spec file.
pub fn load(source: &Path) -> Result<Model, LoadError> {
    if source.is_file() {
        let spec = ModelSpec::read(source)?;
        return build(&spec.config, &spec.weights);
    }
    let cfg = ConfigSource::read(source)?;
    // Reject an unknown model_type before touching the weights.
    let model_type = cfg.model_type()?;
    if Family::for_model_type(model_type).is_none() {
        return Err(LoadError::UnknownModelType {
            path: cfg.path.clone(),
            found: model_type.to_string(),
            supported: Family::supported_model_types(),
        });
    }
    let weights = SafetensorsDir::open(source)?;
    build(&cfg, &weights)
}
