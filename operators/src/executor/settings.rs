//! An executor's settings: the optional `[pool.executor_settings]` table of a graph, read with
//! every unknown key and wrong value an error naming the key.

use std::fmt;

/// A setting that is unknown or has the wrong value; `key` is relative to the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettingError {
    pub key: String,
    pub message: String,
}

impl fmt::Display for SettingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "executor_settings.{}: {}", self.key, self.message)
    }
}

impl std::error::Error for SettingError {}

/// A settings table checked against the keys an executor knows.
pub struct Settings<'a> {
    table: &'a toml::Table,
}

impl<'a> Settings<'a> {
    /// Fails on the first key not in `known`.
    pub fn new(table: &'a toml::Table, known: &[&str]) -> Result<Self, SettingError> {
        if let Some(key) = table.keys().find(|k| !known.contains(&k.as_str())) {
            let message = if known.is_empty() {
                "unknown key: this executor takes no settings".to_string()
            } else {
                format!("unknown key; known: {}", known.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", "))
            };
            return Err(SettingError { key: key.clone(), message });
        }
        Ok(Settings { table })
    }

    /// A non-negative integer, `default` when absent.
    pub fn count(&self, key: &str, default: u64) -> Result<u64, SettingError> {
        match self.table.get(key) {
            None => Ok(default),
            Some(toml::Value::Integer(n)) if *n >= 0 => Ok(*n as u64),
            Some(other) => Err(SettingError {
                key: key.to_string(),
                message: format!("expected an integer of at least 0, got {other}"),
            }),
        }
    }
}

impl Settings<'_> {
    /// A boolean, `default` when absent.
    pub fn flag(&self, key: &str, default: bool) -> Result<bool, SettingError> {
        match self.table.get(key) {
            None => Ok(default),
            Some(toml::Value::Boolean(b)) => Ok(*b),
            Some(other) => {
                Err(SettingError { key: key.to_string(), message: format!("expected true or false, got {other}") })
            }
        }
    }

    /// One of `choices` (a string), `default` when absent.
    pub fn choice(
        &self,
        key: &str,
        choices: &[&'static str],
        default: &'static str,
    ) -> Result<&'static str, SettingError> {
        match self.table.get(key) {
            None => Ok(default),
            Some(toml::Value::String(s)) if choices.contains(&s.as_str()) => {
                Ok(choices[choices.iter().position(|c| *c == s.as_str()).unwrap_or(0)])
            }
            Some(other) => Err(SettingError {
                key: key.to_string(),
                message: format!(
                    "expected one of {}, got {other}",
                    choices.iter().map(|c| format!("\"{c}\"")).collect::<Vec<_>>().join(", ")
                ),
            }),
        }
    }

    /// A positive, finite number (an integer or a float), `default` when absent.
    pub fn number(&self, key: &str, default: f64) -> Result<f64, SettingError> {
        let value = match self.table.get(key) {
            None => return Ok(default),
            Some(toml::Value::Float(x)) => *x,
            Some(toml::Value::Integer(n)) => *n as f64,
            Some(other) => {
                return Err(SettingError { key: key.to_string(), message: format!("expected a number, got {other}") })
            }
        };
        if value.is_finite() && value > 0.0 {
            Ok(value)
        } else {
            Err(SettingError { key: key.to_string(), message: format!("expected a positive number, got {value}") })
        }
    }

    /// A string, `None` when absent.
    pub fn text(&self, key: &str) -> Result<Option<&str>, SettingError> {
        match self.table.get(key) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(s)),
            Some(other) => {
                Err(SettingError { key: key.to_string(), message: format!("expected a string, got {other}") })
            }
        }
    }

    /// A list of non-negative integers, `None` when absent.
    pub fn counts(&self, key: &str) -> Result<Option<Vec<usize>>, SettingError> {
        let bad = |other: &toml::Value| SettingError {
            key: key.to_string(),
            message: format!("expected a list of integers of at least 0, got {other}"),
        };
        match self.table.get(key) {
            None => Ok(None),
            Some(toml::Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    toml::Value::Integer(n) if *n >= 0 => Ok(*n as usize),
                    other => Err(bad(other)),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(other) => Err(bad(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        let table: toml::Table = toml::from_str("delay_steps = -1\n").unwrap();
        let s = Settings::new(&table, &["delay_steps"]).unwrap();
        let e = s.count("delay_steps", 1).unwrap_err();
        assert_eq!(e.to_string(), "executor_settings.delay_steps: expected an integer of at least 0, got -1");
        let table: toml::Table = toml::from_str("dealy_steps = 1\n").unwrap();
        let e = Settings::new(&table, &["delay_steps"]).err().unwrap();
        assert_eq!(e.key, "dealy_steps");
        assert!(e.message.contains("`delay_steps`"));
    }
}
