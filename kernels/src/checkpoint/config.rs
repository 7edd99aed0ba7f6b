//! Reading a Hugging Face `config.json`: the text with its path (so every error names the file),
//! the `model_type`, and the rope parameters in both layouts published configs use —
//! transformers 5's `rope_parameters`, and the older top-level `rope_theta` plus `rope_scaling`
//! (with `type` or `rope_type`). Family-specific fields are read by each family's own serde
//! `Config`, whose field names are those of `config.json`.

use super::fields::{from_map, keys_of};
use super::LoadError;
use crate::cpu::rope::{RopeParams, RopeScaling};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// Who wrote a config, which decides what an unread key means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigOrigin {
    /// A Hugging Face `config.json`: published configs carry many keys that do not change the
    /// math, so keys no family reads are ignored.
    Checkpoint,
    /// A kvflow model spec: every key is meant for the family, so a key it does not read is a
    /// typo and an error.
    Spec,
}

/// A parsed `config.json` (or model spec) and where it came from.
#[derive(Clone, Debug)]
pub struct ConfigSource {
    pub path: PathBuf,
    pub value: Value,
    pub origin: ConfigOrigin,
}

/// The top-level keys [`parse_rope`] reads.
/// The keys that give a model's context (prompt + output tokens): `max_position_embeddings`,
/// or Kimi Linear's `model_max_length`. Every family accepts them.
pub const CONTEXT_KEYS: [&str; 2] = ["max_position_embeddings", "model_max_length"];

pub const ROPE_KEYS: &[&str] = &[
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "original_max_position_embeddings",
    "max_position_embeddings",
];

/// The keys [`parse_rope`] reads inside `rope_parameters` / `rope_scaling`.
const ROPE_TABLE_KEYS: &[&str] = &[
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "original_max_position_embeddings",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "beta_fast",
    "beta_slow",
    "truncate",
];

/// Keys of a model spec that are not the family's: [`ModelSpec`](super::ModelSpec) reads them.
const SPEC_KEYS: &[&str] = &["seed", "init_std"];

impl ConfigSource {
    /// Reads `DIR/config.json`.
    pub fn read(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| LoadError::Io { path: path.clone(), source })?;
        Self::parse(path, &text)
    }

    /// Parses the text of a `config.json` (any text: errors, never a panic).
    pub fn parse(path: PathBuf, text: &str) -> Result<Self, LoadError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| LoadError::Parse { path: path.clone(), message: e.to_string() })?;
        Self::from_value(path, value, ConfigOrigin::Checkpoint)
    }

    /// A config from an already parsed value, which must be an object.
    pub fn from_value(path: PathBuf, value: Value, origin: ConfigOrigin) -> Result<Self, LoadError> {
        if !value.is_object() {
            return Err(LoadError::Parse { path, message: "expected a JSON object".into() });
        }
        Ok(ConfigSource { path, value, origin })
    }

    /// The top-level object (an error, not a panic, for a hand-built source holding another value).
    pub fn object(&self) -> Result<&Map<String, Value>, LoadError> {
        self.value
            .as_object()
            .ok_or_else(|| LoadError::Parse { path: self.path.clone(), message: "expected a JSON object".into() })
    }

    pub fn model_type(&self) -> Result<&str, LoadError> {
        self.value
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| LoadError::config(&self.path, "model_type", "missing or not a string"))
    }

    /// Deserialises the whole object into a family's `Config`; an error names the key whose value
    /// failed. A checkpoint's keys that `T` does not read are ignored (published configs carry
    /// many that do not change the math); a spec's are an error unless listed in `also_read`
    /// (keys the family reads outside `T`, such as [`ROPE_KEYS`]).
    pub fn family_config<T: DeserializeOwned>(&self, also_read: &[&str]) -> Result<T, LoadError> {
        let map = self.object()?;
        let known: Vec<&str> = keys_of::<T>().iter().chain(also_read).chain(&CONTEXT_KEYS).copied().collect();
        self.reject_unknown_keys(None, map, &known)?;
        from_map(map).map_err(|(key, message)| match key {
            Some(key) => self.error(&key, message),
            None => self.error(&missing_field(&message).unwrap_or_else(|| "?".into()), message),
        })
    }

    /// In a spec, an error naming the first key of the table `table` that is not in `known`.
    pub fn check_table_keys(&self, table: &str, known: &[&str]) -> Result<(), LoadError> {
        match self.value.get(table) {
            Some(Value::Object(map)) => self.reject_unknown_keys(Some(table), map, known),
            _ => Ok(()),
        }
    }

    fn reject_unknown_keys(
        &self,
        table: Option<&str>,
        map: &Map<String, Value>,
        known: &[&str],
    ) -> Result<(), LoadError> {
        if self.origin != ConfigOrigin::Spec {
            return Ok(());
        }
        let Some(unknown) = map.keys().find(|k| !known.contains(&k.as_str())) else { return Ok(()) };
        let mut listed: Vec<&str> = known.to_vec();
        if table.is_none() {
            listed.extend(SPEC_KEYS);
        }
        listed.sort_unstable();
        listed.dedup();
        let field = table.map_or(unknown.clone(), |t| format!("{t}.{unknown}"));
        let kind = self.model_type().unwrap_or("?");
        Err(self.error(
            &field,
            format!(
                "unknown key for model_type {kind:?} (a spec holds only keys its family reads); known keys: {}",
                listed.join(", ")
            ),
        ))
    }

    pub fn error(&self, field: &str, message: impl Into<String>) -> LoadError {
        LoadError::config(&self.path, field, message)
    }
}

/// The field serde's "missing field `name`" message names.
fn missing_field(message: &str) -> Option<String> {
    let rest = message.split_once('`')?.1;
    Some(rest.split_once('`')?.0.to_string())
}

/// Reads the numbers of a rope: from its table (`rope_parameters` or `rope_scaling`) and the top
/// level. Absent or null is `None`; anything else that is not a number is an error. Each value
/// comes with the field it was read from, for the domain checks.
struct RopeFields<'a> {
    cfg: &'a ConfigSource,
    top: &'a Map<String, Value>,
    params: &'a Map<String, Value>,
    table: &'static str,
}

impl RopeFields<'_> {
    fn read(&self, map: &Map<String, Value>, field: String, key: &str) -> Result<Option<(f64, String)>, LoadError> {
        match map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(n) => Ok(Some((n, field))),
                None => Err(self.cfg.error(&field, format!("expected a number, found {v}"))),
            },
        }
    }

    fn param(&self, key: &str) -> Result<Option<(f64, String)>, LoadError> {
        self.read(self.params, format!("{}.{key}", self.table), key)
    }

    fn top(&self, key: &str) -> Result<Option<(f64, String)>, LoadError> {
        self.read(self.top, key.to_string(), key)
    }

    fn param_or_top(&self, key: &str) -> Result<Option<(f64, String)>, LoadError> {
        Ok(self.param(key)?.or(self.top(key)?))
    }

    /// A required table value, finite and > 0.
    fn positive(&self, key: &str) -> Result<f64, LoadError> {
        match self.param(key)? {
            Some((v, field)) => self.cfg.positive(&field, v),
            None => Err(self.cfg.error(&format!("{}.{key}", self.table), "missing or not a number")),
        }
    }

    /// An optional table value, checked by `check` when present.
    fn optional(
        &self,
        key: &str,
        check: impl Fn(&ConfigSource, &str, f64) -> Result<f64, LoadError>,
    ) -> Result<Option<f64>, LoadError> {
        self.param(key)?.map(|(v, field)| check(self.cfg, &field, v)).transpose()
    }
}

/// The rope of a config, in either layout, with every value checked for its domain (a negative
/// theta or factor would give NaN frequencies). `max_position_embeddings` is the fallback for
/// `original_max_position_embeddings`, as transformers standardises it.
pub fn parse_rope(cfg: &ConfigSource) -> Result<RopeParams, LoadError> {
    let top = cfg.object()?;
    let empty = Map::new();
    let (table, params) = match (top.get("rope_parameters"), top.get("rope_scaling")) {
        (Some(Value::Object(p)), _) => ("rope_parameters", p),
        (_, Some(Value::Object(p))) => ("rope_scaling", p),
        _ => ("rope_parameters", &empty),
    };
    cfg.check_table_keys(table, ROPE_TABLE_KEYS)?;
    let f = RopeFields { cfg, top, params, table };
    // theta ≤ 1 gives equal or growing frequencies (and yarn divides by ln θ).
    let theta = match f.param_or_top("rope_theta")? {
        Some((v, field)) => cfg.above(&field, v, 1.0)?,
        None => 10_000.0,
    };
    let partial = match f.param_or_top("partial_rotary_factor")? {
        Some((v, field)) => cfg.fraction(&field, v)?,
        None => 1.0,
    };
    let kind = match params.get("rope_type").or_else(|| params.get("type")) {
        None | Some(Value::Null) => "default",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => {
            return Err(cfg.error(&format!("{table}.rope_type"), format!("expected a string, found {other}")))
        }
    };
    let original_max = || -> Result<f64, LoadError> {
        // A top-level value wins, as in transformers' `standardize_rope_params`.
        let found = match f.top("original_max_position_embeddings")? {
            Some(v) => Some(v),
            None => f.param("original_max_position_embeddings")?.or(f.top("max_position_embeddings")?),
        };
        match found {
            Some((v, field)) => cfg.positive(&field, v),
            None => Err(cfg.error(&format!("{table}.original_max_position_embeddings"), "missing")),
        }
    };
    let scaling = match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: f.positive("factor")? },
        "llama3" => {
            let (low, high) = (f.positive("low_freq_factor")?, f.positive("high_freq_factor")?);
            if high <= low {
                return Err(cfg.error(
                    &format!("{table}.high_freq_factor"),
                    format!("expected more than low_freq_factor = {low}, found {high}"),
                ));
            }
            RopeScaling::Llama3 {
                factor: f.positive("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original_max()?,
            }
        }
        "yarn" => {
            let original = original_max()?;
            let factor = match f.param("factor")? {
                Some((v, field)) => cfg.positive(&field, v)?,
                None => {
                    let (max, field) = f
                        .top("max_position_embeddings")?
                        .ok_or_else(|| cfg.error(&format!("{table}.factor"), "missing"))?;
                    cfg.positive(&field, max)? / original
                }
            };
            // 0 means "unset" for the betas, as in transformers.
            let beta = |key: &str, default: f64| -> Result<f64, LoadError> {
                Ok(f.optional(key, ConfigSource::non_negative)?.filter(|v| *v != 0.0).unwrap_or(default))
            };
            RopeScaling::Yarn {
                factor,
                attention_factor: f.optional("attention_factor", ConfigSource::positive)?,
                mscale: f.optional("mscale", ConfigSource::non_negative)?,
                mscale_all_dim: f.optional("mscale_all_dim", ConfigSource::non_negative)?,
                beta_fast: beta("beta_fast", 32.0)?,
                beta_slow: beta("beta_slow", 1.0)?,
                original_max_position_embeddings: original,
                truncate: match params.get("truncate") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(b)) => *b,
                    Some(other) => {
                        return Err(
                            cfg.error(&format!("{table}.truncate"), format!("expected a boolean, found {other}"))
                        )
                    }
                },
            }
        }
        other => {
            return Err(cfg.error(
                &format!("{table}.rope_type"),
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
    fn a_negative_theta_is_rejected_by_name() {
        let e = rope_of(r#"{"rope_theta": -10000.0}"#).unwrap_err().to_string();
        assert!(e.contains("`rope_theta`") && e.contains("> 1"), "{e}");
        let e = rope_of(r#"{"rope_parameters": {"rope_theta": -1, "rope_type": "default"}}"#).unwrap_err().to_string();
        assert!(e.contains("rope_parameters.rope_theta"), "{e}");
    }

    #[test]
    fn a_scaling_factor_must_be_positive() {
        let e = rope_of(r#"{"rope_scaling": {"type": "linear", "factor": 0}}"#).unwrap_err().to_string();
        assert!(e.contains("rope_scaling.factor") && e.contains("> 0"), "{e}");
        let e =
            rope_of(r#"{"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": -4096}}"#)
                .unwrap_err()
                .to_string();
        assert!(e.contains("original_max_position_embeddings"), "{e}");
    }

    #[test]
    fn a_rope_value_of_the_wrong_type_is_an_error_not_a_default() {
        let e = rope_of(r#"{"rope_theta": "1e6"}"#).unwrap_err().to_string();
        assert!(e.contains("`rope_theta`") && e.contains("expected a number"), "{e}");
    }

    #[test]
    fn published_yarn_parameters_are_accepted() {
        // DeepSeek-V3.2's rope_scaling.
        let r = rope_of(
            r#"{"rope_theta": 10000, "max_position_embeddings": 163840, "rope_scaling": {"beta_fast": 32,
            "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "type": "yarn"}}"#,
        )
        .unwrap();
        assert!(matches!(r.scaling, RopeScaling::Yarn { factor, .. } if factor == 40.0));
    }

    #[test]
    fn an_unsupported_rope_type_names_the_field() {
        let e = rope_of(r#"{"rope_scaling": {"type": "longrope"}}"#).unwrap_err().to_string();
        assert!(e.contains("rope_scaling.rope_type") && e.contains("longrope"), "{e}");
    }
}
