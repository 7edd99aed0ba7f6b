//! Rules of graph validation: one small function per check, shared by the file (`validate`) and
//! the command line (`Graph::apply_overrides`). Each returns the accepted value, or what is wrong
//! with it (the caller adds where it came from).

use std::path::PathBuf;

use super::error::quoted_list;

const MAX_SNAPSHOT_FRACTION: f64 = 0.9;

pub(super) fn at_least_one(value: usize) -> Result<usize, String> {
    if value == 0 {
        Err("must be at least 1, got 0".to_string())
    } else {
        Ok(value)
    }
}

/// Most ranks one pool may have: each is a dataflow worker thread with its own memory budget.
pub const MAX_RANKS: usize = 1024;

pub(super) fn rank_count(value: usize) -> Result<usize, String> {
    if value == 0 || value > MAX_RANKS {
        Err(format!("must be at least 1 and at most {MAX_RANKS} (one dataflow worker thread each), got {value}"))
    } else {
        Ok(value)
    }
}

/// Most tokens a size key may name (a block, a chunk, a step's batch): beyond it one step's
/// buffers cannot fit a machine.
pub const MAX_TOKENS: usize = 1 << 24;

pub(super) fn token_count(value: usize) -> Result<usize, String> {
    if value == 0 || value > MAX_TOKENS {
        Err(format!("must be at least 1 and at most {MAX_TOKENS}, got {value}"))
    } else {
        Ok(value)
    }
}

pub(super) fn measured_limit(value: usize) -> Result<usize, String> {
    if value == 0 {
        Err("must be at least 1, got 0 (leave it out to measure the rest of the trace)".to_string())
    } else {
        Ok(value)
    }
}

pub(super) fn more_than_zero(value: f64) -> Result<f64, String> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(format!("must be a number more than 0, got {value}"))
    }
}

pub(super) fn zero_or_more(value: f64) -> Result<f64, String> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(format!("must be a number of at least 0, got {value}"))
    }
}

pub(super) fn snapshot_fraction(value: f64) -> Result<f64, String> {
    if (0.0..=MAX_SNAPSHOT_FRACTION).contains(&value) {
        Ok(value)
    } else {
        Err(format!("must be between 0 and {MAX_SNAPSHOT_FRACTION}, got {value}"))
    }
}

pub(super) fn one_of(value: &str, known: &[impl AsRef<str>], what: &str) -> Result<String, String> {
    if known.iter().any(|k| k.as_ref() == value) {
        Ok(value.to_string())
    } else {
        Err(format!("`{value}` is not a known {what}; known: {}", quoted_list(known)))
    }
}

pub(super) fn existing_path(path: PathBuf) -> Result<PathBuf, String> {
    if path.exists() {
        Ok(path)
    } else {
        Err(format!("`{}` does not exist", path.display()))
    }
}

pub(super) fn pool_name(name: &str) -> Result<String, String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
    if !name.is_empty() && name.chars().all(allowed) {
        Ok(name.to_string())
    } else {
        Err(format!("`{name}` is not a pool name: use letters, digits, '-' and '_'"))
    }
}

pub(super) fn byte_budget(value: &toml::Value) -> Result<u64, String> {
    let bytes = match value {
        toml::Value::Integer(bytes) => {
            u64::try_from(*bytes).map_err(|_| format!("must be more than 0 bytes, got {bytes}"))?
        }
        toml::Value::String(text) => parse_byte_size(text)?,
        other => {
            return Err(format!(
                "expected a byte count: an integer, or a string with a unit such as \"64 MiB\"; got a {}",
                other.type_str()
            ))
        }
    };
    if bytes == 0 {
        return Err("must be more than 0 bytes".to_string());
    }
    Ok(bytes)
}

/// Parses a byte count: a number with an optional unit, such as `"64 MiB"`, `"2GiB"`, `"500 MB"`,
/// `"1.5 GiB"` or `"4096"`. Units (any letter case): B, KB, MB, GB, TB (powers of 1000) and KiB,
/// MiB, GiB, TiB (powers of 1024). A fractional result is rounded down to whole bytes.
pub fn parse_byte_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let unit_start = trimmed.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(trimmed.len());
    let (number, unit) = (&trimmed[..unit_start], trimmed[unit_start..].trim());
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(format!("\"{text}\": unknown unit `{unit}`; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")),
    };
    let too_large = || format!("\"{text}\" is too large");
    if let Ok(whole) = number.parse::<u64>() {
        return whole.checked_mul(multiplier).ok_or_else(too_large);
    }
    let fractional: f64 =
        number.parse().map_err(|_| format!("\"{text}\" is not a byte count such as \"64 MiB\" or \"4096\""))?;
    let bytes = (fractional * multiplier as f64).floor();
    if bytes >= u64::MAX as f64 {
        return Err(too_large());
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_byte_size("64 MiB"), Ok(64 << 20));
        assert_eq!(parse_byte_size("2 GiB"), Ok(2 << 30));
        assert_eq!(parse_byte_size("500 MB"), Ok(500_000_000));
        assert_eq!(parse_byte_size("512 KiB"), Ok(512 << 10));
        assert_eq!(parse_byte_size("1 TiB"), Ok(1 << 40));
        assert_eq!(parse_byte_size("3 kb"), Ok(3_000));
        assert_eq!(parse_byte_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_byte_size(" 4096 "), Ok(4096));
        assert_eq!(parse_byte_size("4096 B"), Ok(4096));
        assert_eq!(parse_byte_size("1.5 GiB"), Ok(3 << 29));
    }

    #[test]
    fn byte_sizes_reject_bad_units_and_numbers() {
        assert!(parse_byte_size("64 MiX").unwrap_err().contains("unknown unit `MiX`"));
        assert!(parse_byte_size("MiB").is_err());
        assert!(parse_byte_size("").is_err());
        assert!(parse_byte_size("1.2.3 MB").is_err());
        assert!(parse_byte_size("-1 MB").is_err());
        assert!(parse_byte_size("99999999999 TiB").unwrap_err().contains("too large"));
    }
}
