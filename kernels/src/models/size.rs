//! A model's size before it is built: its parameter count from the validated config, kept as
//! named terms (so an error can say which keys make it large), and the check against the memory
//! the machine has, so that a huge config is an error at load instead of an allocation abort.

use crate::checkpoint::LoadError;
use std::path::Path;

/// Bytes a model may never exceed, whatever the machine reports: it bounds every product of
/// sizes the kernels form when `/proc/meminfo` cannot be read.
const MAX_MODEL_BYTES: u128 = 1 << 48;

/// How many terms an error names.
const TERMS_NAMED: usize = 3;

/// A model's parameters, by term (`"vocab_size × hidden_size × 2 (embeddings, LM head)"`).
#[derive(Clone, Debug, Default)]
pub struct ModelSize {
    terms: Vec<(String, u128)>,
}

impl ModelSize {
    /// Adds `count` parameters of `per_item` each under `label` (saturating: no overflow).
    pub fn add(&mut self, label: impl Into<String>, count: usize, per_item: u128) -> &mut Self {
        self.terms.push((label.into(), (count as u128).saturating_mul(per_item)));
        self
    }

    pub fn params(&self) -> u128 {
        self.terms.iter().fold(0u128, |sum, (_, n)| sum.saturating_add(*n))
    }

    /// Bytes of the weights in f32.
    pub fn bytes(&self) -> u128 {
        self.params().saturating_mul(4)
    }

    /// The terms, largest first.
    pub fn terms(&self) -> Vec<(&str, u128)> {
        let mut terms: Vec<(&str, u128)> = self.terms.iter().map(|(l, n)| (l.as_str(), *n)).collect();
        terms.sort_by_key(|t| std::cmp::Reverse(t.1));
        terms
    }

    /// An error naming `path`, the estimate, the limit and the biggest terms when the weights do
    /// not fit in the memory available now (or, that unknown, in [`MAX_MODEL_BYTES`]).
    pub fn check_fits(&self, path: &Path) -> Result<(), LoadError> {
        let (limit, limit_source) = match available_memory() {
            Some(m) => (m.min(MAX_MODEL_BYTES), "of memory available (MemAvailable in /proc/meminfo)"),
            None => (MAX_MODEL_BYTES, "kvflow loads at most"),
        };
        self.check_within(path, limit, limit_source)
    }

    fn check_within(&self, path: &Path, limit: u128, limit_source: &str) -> Result<(), LoadError> {
        if self.bytes() <= limit {
            return Ok(());
        }
        let biggest: Vec<String> = self
            .terms()
            .iter()
            .take(TERMS_NAMED)
            .map(|(label, n)| format!("{label} = {} ({n} parameters)", human_bytes(n.saturating_mul(4))))
            .collect();
        Err(LoadError::TooLarge {
            path: path.to_path_buf(),
            estimate: human_bytes(self.bytes()),
            limit: human_bytes(limit),
            limit_source: limit_source.to_string(),
            biggest: biggest.join("; "),
        })
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes, if it can be read.
pub fn available_memory() -> Option<u128> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// `n` bytes in the largest binary unit that keeps it ≥ 1, with the exact count beside it.
pub fn human_bytes(n: u128) -> String {
    const UNITS: [&str; 6] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} bytes")
    } else {
        format!("{v:.1} {} ({n} bytes)", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_over_the_limit_names_its_biggest_terms() {
        let mut size = ModelSize::default();
        size.add("vocab_size × hidden_size × 2", 1_000_000_000, 4096 * 2).add("norms", 1, 4096);
        let e = size.check_within(Path::new("m.toml"), 1 << 30, "of memory").unwrap_err().to_string();
        assert!(e.contains("m.toml") && e.contains("vocab_size × hidden_size") && e.contains("1.0 GiB"), "{e}");
    }

    #[test]
    fn products_saturate_instead_of_overflowing() {
        let mut size = ModelSize::default();
        size.add("huge", usize::MAX, u128::MAX);
        assert_eq!(size.bytes(), u128::MAX);
        assert!(size.check_fits(Path::new("m.toml")).is_err());
    }
}
