//! Model families (one file each), the shared decoder stack and parts, and loading by
//! `model_type` from a checkpoint folder or a seeded spec.
//!
//! Dependencies point one way: [`parts`] (attention, linear-attention, MoE and basic layers) ←
//! `decoder` (the layer stack and the step) ← the family files (`mha`, `deepseek`, `qwen3_next`,
//! `kimi_linear`), which turn a `config.json` into parts and a [`Model`] and never import each
//! other; `config` holds what several families' configs share. Each family's `Config::read`
//! validates its config once, before any weight is read, and `size` estimates the model's
//! parameters from it, checked against the memory available. This file dispatches by family.

mod batch;
mod config;
pub(crate) mod decoder;
pub mod deepseek;
#[cfg(test)]
mod expert_parallel_tests;
mod family;
pub mod kimi_linear;
#[cfg(test)]
mod load_tests;
pub mod mha;
pub mod parts;
pub mod qwen3_next;
mod size;

pub use batch::{BatchLayout, ForwardOutput, LogitsWanted, SeqInput};
pub use decoder::{check_context, Model, ModelCache, Phase, RoutedRows, StepActivations};
pub use family::{Family, FamilyInfo, FAMILIES};
pub use size::{available_memory, human_bytes, ModelSize};

use crate::checkpoint::{ConfigSource, ExpertShard, LoadError, ModelSpec, SafetensorsDir, WeightSource};
use std::path::Path;

/// The family of a config's `model_type`.
fn family_of(cfg: &ConfigSource) -> Result<Family, LoadError> {
    let model_type = cfg.model_type()?;
    Family::for_model_type(model_type).ok_or_else(|| LoadError::UnknownModelType {
        path: cfg.path.clone(),
        found: model_type.to_string(),
        supported: Family::supported_model_types(),
    })
}

/// Every check [`build`] makes before it reads a weight: the family's config read and validated
/// (sizes, divisibility, epsilons, rope, per-layer lists; in a spec, no unknown keys), and the
/// model's estimated size against the memory available. Allocates no weight; any JSON value
/// gives a result or an error, never a panic.
pub fn check(cfg: &ConfigSource) -> Result<ModelSize, LoadError> {
    let size = match family_of(cfg)? {
        Family::Mha => mha::Config::read(cfg)?.size(),
        family @ (Family::Mla | Family::SparseMla) => {
            let sparse = family == Family::SparseMla;
            deepseek::Config::read(cfg, sparse)?.size(cfg, sparse)?
        }
        Family::HybridGdn | Family::Gdn => qwen3_next::Config::read(cfg)?.size(cfg)?,
        Family::HybridKda => kimi_linear::Config::read(cfg)?.size(cfg)?,
    };
    max_positions(cfg)?;
    size.check_fits(&cfg.path)?;
    Ok(size)
}

/// Builds the model a config describes from `weights`, once [`check`] passes.
pub fn build(cfg: &ConfigSource, weights: &dyn WeightSource) -> Result<Model, LoadError> {
    check(cfg)?;
    let max_positions = max_positions(cfg)?;
    let mut model = match family_of(cfg)? {
        Family::Mha => mha::build(cfg, weights),
        Family::Mla => deepseek::build(cfg, weights, false),
        Family::SparseMla => deepseek::build(cfg, weights, true),
        Family::HybridGdn | Family::Gdn => qwen3_next::build(cfg, weights),
        Family::HybridKda => kimi_linear::build(cfg, weights),
    }?;
    model.max_positions = max_positions;
    Ok(model)
}

/// The model's context from the first of [`crate::checkpoint::CONTEXT_KEYS`] the config sets (`None`: no limit).
fn max_positions(cfg: &ConfigSource) -> Result<Option<usize>, LoadError> {
    for key in crate::checkpoint::CONTEXT_KEYS {
        match cfg.value.get(key) {
            None | Some(serde_json::Value::Null) => continue,
            Some(v) => {
                return match v.as_u64() {
                    Some(n) if n > 0 => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
                    _ => Err(cfg.error(key, format!("expected a whole number ≥ 1, got {v}"))),
                }
            }
        }
    }
    Ok(None)
}

/// Loads a model from a Hugging Face checkpoint folder (or its `config.json`), or builds a
/// seeded random one when `source` is a TOML model spec file.
pub fn load(source: &Path) -> Result<Model, LoadError> {
    load_for(source, None)
}

/// [`load`] for rank `rank` of an expert-parallel pool of `ranks`: every MoE layer holds only
/// that rank's routed experts ([`parts::moe::expert_range`]); the rest of the model is whole.
pub fn load_expert_shard(source: &Path, rank: usize, ranks: usize) -> Result<Model, LoadError> {
    load_for(source, Some((rank, ranks)))
}

fn load_for(source: &Path, shard: Option<(usize, usize)>) -> Result<Model, LoadError> {
    let build_from = |cfg: &ConfigSource, weights: &dyn WeightSource| match shard {
        None => build(cfg, weights),
        Some((rank, ranks)) => build(cfg, &ExpertShard { inner: weights, rank, ranks }),
    };
    let load_checkpoint = |dir: &Path| -> Result<Model, LoadError> {
        let cfg = ConfigSource::read(dir)?;
        check(&cfg)?;
        let weights = SafetensorsDir::open(dir)?;
        build_from(&cfg, &weights)
    };
    if source.is_file() {
        if source.file_name().is_some_and(|n| n == "config.json") {
            // The checkpoint is the folder the config sits in.
            let dir = source.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
            return load_checkpoint(dir);
        }
        if source.extension().is_some_and(|e| e.eq_ignore_ascii_case("json")) {
            return Err(LoadError::NotAModel {
                path: source.to_path_buf(),
                message: "a JSON file is neither model source kvflow loads: a model spec is a TOML file, and a \
                          checkpoint is a folder holding config.json and safetensors (give the folder)"
                    .into(),
            });
        }
        let spec = ModelSpec::read(source)?;
        return build_from(&spec.config, &spec.weights);
    }
    // A checkpoint folder: its config is checked in full before a safetensors file is opened.
    load_checkpoint(source)
}
