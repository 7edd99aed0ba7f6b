//! Reading a Hugging Face `config.json`: the text with its path (so every error names the file),
//! the `model_type`, and the rope parameters in both layouts published configs use —
//! transformers 5's `rope_parameters`, and the older top-level `rope_theta` plus `rope_scaling`
//! (with `type` or `rope_type`). Family-specific fields are read by each family's own serde
//! `Config`, whose field names are those of `config.json`.

use super::LoadError;
use crate::cpu::rope::{RopeParams, RopeScaling};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// A parsed `config.json` and where it came from.
#[derive(Clone, Debug)]
pub struct ConfigSource {
    pub path: PathBuf,
    pub value: Value,
}

impl ConfigSource {
    /// Reads `DIR/config.json`.
    pub fn read(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| LoadError::Io { path: path.clone(), source })?;
        Self::parse(path, &text)
    }

    pub fn parse(path: PathBuf, text: &str) -> Result<Self, LoadError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| LoadError::Parse { path: path.clone(), message: e.to_string() })?;
        if !value.is_object() {
            return Err(LoadError::Parse { path, message: "expected a JSON object".into() });
        }
        Ok(ConfigSource { path, value })
    }

    pub fn model_type(&self) -> Result<&str, LoadError> {
        self.value
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| LoadError::config(&self.path, "model_type", "missing or not a string"))
    }

    /// Deserialises the whole object into a family's `Config` (unknown fields are ignored:
    /// published configs carry many that do not change the math).
    pub fn family_config<T: DeserializeOwned>(&self) -> Result<T, LoadError> {
        serde_json::from_value(self.value.clone())
            .map_err(|e| LoadError::Parse { path: self.path.clone(), message: e.to_string() })
    }

    pub fn error(&self, field: &str, message: impl Into<String>) -> LoadError {
        LoadError::config(&self.path, field, message)
    }
}

fn number(map: &Map<String, Value>, key: &str) -> Option<f64> {
    map.get(key).and_then(Value::as_f64)
}

/// The rope of a config, in either layout. `max_position_embeddings` is the fallback for
/// `original_max_position_embeddings`, as transformers standardises it.
pub fn parse_rope(cfg: &ConfigSource) -> Result<RopeParams, LoadError> {
    let top = cfg.value.as_object().expect("checked at parse");
    let (field, params) = match (top.get("rope_parameters"), top.get("rope_scaling")) {
        (Some(Value::Object(p)), _) => ("rope_parameters", p.clone()),
        (_, Some(Value::Object(p))) => ("rope_scaling", p.clone()),
        _ => ("rope_parameters", Map::new()),
    };
    let theta = number(&params, "rope_theta").or_else(|| number(top, "rope_theta")).unwrap_or(10_000.0);
    let partial =
        number(&params, "partial_rotary_factor").or_else(|| number(top, "partial_rotary_factor")).unwrap_or(1.0);
    let kind =
        params.get("rope_type").or_else(|| params.get("type")).and_then(Value::as_str).unwrap_or("default").to_string();
    let original_max = || -> Result<f64, LoadError> {
        // A top-level value wins, as in transformers' `standardize_rope_params`.
        number(top, "original_max_position_embeddings")
            .or_else(|| number(&params, "original_max_position_embeddings"))
            .or_else(|| number(top, "max_position_embeddings"))
            .ok_or_else(|| cfg.error(&format!("{field}.original_max_position_embeddings"), "missing"))
    };
    let need = |key: &str| -> Result<f64, LoadError> {
        number(&params, key).ok_or_else(|| cfg.error(&format!("{field}.{key}"), "missing or not a number"))
    };
    let scaling = match kind.as_str() {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: need("factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: original_max()?,
        },
        "yarn" => {
            let original = original_max()?;
            let factor = match number(&params, "factor") {
                Some(f) => f,
                None => {
                    let max = number(top, "max_position_embeddings")
                        .ok_or_else(|| cfg.error(&format!("{field}.factor"), "missing"))?;
                    max / original
                }
            };
            let nonzero = |key: &str, default: f64| number(&params, key).filter(|v| *v != 0.0).unwrap_or(default);
            RopeScaling::Yarn {
                factor,
                attention_factor: number(&params, "attention_factor"),
                mscale: number(&params, "mscale"),
                mscale_all_dim: number(&params, "mscale_all_dim"),
                beta_fast: nonzero("beta_fast", 32.0),
                beta_slow: nonzero("beta_slow", 1.0),
                original_max_position_embeddings: original,
                truncate: params.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            }
        }
        other => {
            return Err(cfg.error(
                &format!("{field}.rope_type"),
                format!("rope type {other:?} is not supported (default, linear, llama3, yarn)"),
            ))
        }
    };
    Ok(RopeParams { theta, scaling, partial_rotary_factor: partial })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope_of(json: &str) -> Result<RopeParams, LoadError> {
        parse_rope(&ConfigSource::parse("config.json".into(), json).unwrap())
    }

    #[test]
    fn both_layouts_give_the_same_rope() {
        let new = rope_of(r#"{"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}"#).unwrap();
        let old = rope_of(r#"{"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}"#).unwrap();
        let old2 = rope_of(r#"{"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}"#).unwrap();
        assert_eq!(new, old);
        assert_eq!(new, old2);
        assert_eq!(new.theta, 5e5);
    }

    #[test]
    fn no_rope_fields_mean_the_default_rope() {
        let r = rope_of("{}").unwrap();
        assert_eq!(r.scaling, RopeScaling::Default);
        assert_eq!(r.theta, 10_000.0);
    }

    #[test]
    fn original_context_falls_back_to_max_positions() {
        let r = rope_of(
            r#"{"max_position_embeddings": 4096, "rope_scaling": {"type": "llama3", "factor": 8,
            "low_freq_factor": 1, "high_freq_factor": 4}}"#,
        )
        .unwrap();
        match r.scaling {
            RopeScaling::Llama3 { original_max_position_embeddings, .. } => {
                assert_eq!(original_max_position_embeddings, 4096.0)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_unsupported_rope_type_names_the_field() {
        let e = rope_of(r#"{"rope_scaling": {"type": "longrope"}}"#).unwrap_err().to_string();
        assert!(e.contains("rope_scaling.rope_type") && e.contains("longrope"), "{e}");
    }
}
