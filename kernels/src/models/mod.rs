//! Model families (one file each), the shared decoder stack and parts, and loading by
//! `model_type` from a checkpoint folder or a seeded spec.

mod batch;
mod decoder;
mod defaults;
mod family;
pub mod kimi_linear;
mod layers;
pub mod mha;
pub mod mla;
pub mod moe;
pub mod qwen3_next;
pub mod sparse_mla;

pub use batch::{BatchLayout, ForwardOutput, LogitsWanted, SeqInput};
pub use decoder::{Model, ModelCache};
pub use family::{Family, FamilyInfo, FAMILIES};

use crate::checkpoint::{ConfigSource, LoadError, ModelSpec, SafetensorsDir, WeightSource};
use std::path::Path;

/// Builds the model a config describes from `weights`.
pub fn build(cfg: &ConfigSource, weights: &dyn WeightSource) -> Result<Model, LoadError> {
    let model_type = cfg.model_type()?;
    match Family::for_model_type(model_type) {
        Some(Family::Mha) => mha::build(cfg, weights),
        Some(Family::Mla) => mla::build(cfg, weights, false),
        Some(Family::SparseMla) => mla::build(cfg, weights, true),
        Some(Family::HybridGdn | Family::Gdn) => qwen3_next::build(cfg, weights),
        Some(Family::HybridKda) => kimi_linear::build(cfg, weights),
        None => Err(LoadError::UnknownModelType {
            path: cfg.path.clone(),
            found: model_type.to_string(),
            supported: Family::supported_model_types(),
        }),
    }
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
