//! Model families (one file each), the shared decoder stack and parts, and loading by
//! `model_type` from a checkpoint folder or a seeded spec.
//!
//! Dependencies point one way: [`parts`] (attention, linear-attention, MoE and basic layers) ←
//! `layer` (one decoder layer) ← `mtp` (the drafter) ← `decoder` (the model) ← `step` (a step
//! through it, whole or in phases) and the family files (`mha`, `deepseek`, `qwen3_next`,
//! `kimi_linear`), which turn a `config.json` into parts and a [`Model`] and never import each
//! other; `config` holds what several families' configs share, `mla_moe` what
//! the two latent-attention families (`deepseek`, `kimi_linear`) read alike. Each family's `Config::read`
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
pub(crate) mod layer;
#[cfg(test)]
mod load_tests;
pub mod mha;
mod mla_moe;
pub mod mtp;
pub mod parts;
pub mod qwen3_next;
mod size;
mod step;

pub use batch::{BatchLayout, ForwardOutput, LogitsWanted, SeqInput};
pub use decoder::{check_context, Model};
pub use family::{Family, FamilyInfo, FAMILIES};
pub use layer::{ModelCache, RoutedRows};
pub use size::{available_memory, human_bytes, ModelSize};
pub use step::{Phase, StepActivations};

use crate::checkpoint::gguf::{gguf_config, GgufFile, GgufWeights};
use crate::checkpoint::{ConfigSource, LoadError, ModelSpec, SafetensorsDir, ShapesOnly, WeightSource};
use parts::moe::ExpertShard;
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
    let size = check_config(cfg)?;
    size.check_fits(&cfg.path)?;
    Ok(size)
}

/// [`check`] without the memory: the config read and validated, the model's size estimated.
fn check_config(cfg: &ConfigSource) -> Result<ModelSize, LoadError> {
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
    Ok(size)
}

/// Builds the model a config describes from `weights`, once [`check`] passes (a source of
/// shapes alone holds nothing, so its model need not fit this machine's memory).
pub fn build(cfg: &ConfigSource, weights: &dyn WeightSource) -> Result<Model, LoadError> {
    match weights.shapes_only() {
        true => check_config(cfg)?,
        false => check(cfg)?,
    };
    let max_positions = max_positions(cfg)?;
    let mut model = match family_of(cfg)? {
        Family::Mha => mha::build(cfg, weights),
        Family::Mla => deepseek::build(cfg, weights, false),
        Family::SparseMla => deepseek::build(cfg, weights, true),
        Family::HybridGdn | Family::Gdn => qwen3_next::build(cfg, weights),
        Family::HybridKda => kimi_linear::build(cfg, weights),
    }?;
    model.max_positions = max_positions;
    model.config_fingerprint = config_fingerprint(&cfg.value);
    Ok(model)
}

/// A hash of a config, its objects' keys in sorted order (the same config written in another
/// order hashes the same).
fn config_fingerprint(value: &serde_json::Value) -> u64 {
    use serde_json::Value;
    let text =
        |h: u64, s: &str| s.bytes().fold(crate::hash::mix(h, s.len() as u64), |h, b| crate::hash::mix(h, b as u64));
    fn walk(h: u64, v: &Value, text: &dyn Fn(u64, &str) -> u64) -> u64 {
        match v {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                keys.into_iter().fold(crate::hash::mix(h, 1), |h, k| walk(text(h, k), &map[k], text))
            }
            Value::Array(items) => items.iter().fold(crate::hash::mix(h, 2), |h, v| walk(h, v, text)),
            other => text(crate::hash::mix(h, 3), &other.to_string()),
        }
    }
    walk(crate::hash::EMPTY, value, &text)
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

/// Loads a model from a Hugging Face checkpoint folder (or its `config.json`) or a llama GGUF
/// file (`.gguf`, dequantized to f32), or builds a seeded random one when `source` is a TOML
/// model spec file.
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
        if source.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            let file = GgufFile::open(source)?;
            let cfg = gguf_config(&file)?;
            check(&cfg)?;
            return build_from(&cfg, &GgufWeights::new(&file, &cfg));
        }
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

/// The model `source` describes (a checkpoint folder, its `config.json`, a GGUF file or a model
/// spec), built from its config alone with [`ShapesOnly`]: its geometry and cost, none of its
/// values (no safetensors file is opened). What a simulated run loads: the model need not fit
/// this machine, nor exist beyond its config.
pub fn load_shapes(source: &Path) -> Result<Model, LoadError> {
    let checkpoint = |dir: &Path| -> Result<Model, LoadError> {
        let config = ConfigSource::read(dir)?;
        // Its safetensors headers, when it has them, say which optional tensors it holds.
        let headers = SafetensorsDir::open(dir).ok();
        build(&config, &ShapesOnly { present: headers.as_ref().map(|h| h as &dyn WeightSource) })
    };
    let config_alone = |config: &ConfigSource| build(config, &ShapesOnly { present: None });
    if source.is_file() && source.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        let file = GgufFile::open(source)?;
        let config = gguf_config(&file)?;
        return build(&config, &ShapesOnly { present: Some(&GgufWeights::new(&file, &config)) });
    }
    if source.is_file() && source.file_name().is_some_and(|n| n == "config.json") {
        return checkpoint(source.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")));
    }
    if source.is_file() {
        return config_alone(&ModelSpec::read(source)?.config);
    }
    checkpoint(source)
}

/// Writes the seeded model of the spec at `spec` as a Hugging Face checkpoint in `dir`:
/// `config.json` (the spec's fields) and `model.safetensors` holding, in f32 under their
/// checkpoint names, exactly the tensors the model reads (with a DeepSeek spec of
/// `num_nextn_predict_layers = 1`, the MTP layer's too). Returns their names.
pub fn write_seeded_checkpoint(spec: &Path, dir: &Path) -> Result<Vec<String>, LoadError> {
    use std::cell::RefCell;
    /// A tensor read: its name, shape and values.
    type Read = (String, Vec<usize>, Vec<f32>);
    /// Hands out the spec's weights and keeps a copy of each.
    struct Recording<'a> {
        inner: &'a dyn WeightSource,
        seen: RefCell<Vec<Read>>,
    }
    impl WeightSource for Recording<'_> {
        fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
            let values = self.inner.tensor(name, shape)?;
            self.seen.borrow_mut().push((name.to_string(), shape.to_vec(), values.clone()));
            Ok(values)
        }
        fn contains(&self, name: &str) -> bool {
            self.inner.contains(name)
        }
    }
    let spec = ModelSpec::read(spec)?;
    let recording = Recording { inner: &spec.weights, seen: RefCell::new(Vec::new()) };
    build(&spec.config, &recording)?;
    let mut tensors = recording.seen.into_inner();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors.dedup_by(|a, b| a.0 == b.0);
    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LoadError + '_ {
        move |source| LoadError::Io { path: path.to_path_buf(), source }
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape, values) in &tensors {
        let end = offset + 4 * values.len();
        header.insert(name.clone(), serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, end]}));
        offset = end;
    }
    let mut head = serde_json::Value::Object(header).to_string().into_bytes();
    head.resize(head.len().next_multiple_of(8), b' ');
    let mut bytes = Vec::with_capacity(8 + head.len() + offset);
    bytes.extend_from_slice(&(head.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&head);
    for (_, _, values) in &tensors {
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    }
    let weights = dir.join("model.safetensors");
    std::fs::write(&weights, bytes).map_err(io(&weights))?;
    let config = dir.join("config.json");
    let text = serde_json::to_string_pretty(&spec.config.value).expect("a JSON value prints");
    std::fs::write(&config, text).map_err(io(&config))?;
    Ok(tensors.into_iter().map(|t| t.0).collect())
}
