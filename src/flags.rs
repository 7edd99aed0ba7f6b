//! Command-line values that clap's own parsers accept too widely: durations (finite, not
//! negative, bounded) and sizes (at least one, bounded). Each parser returns what is wrong in
//! words clap prints after the flag's name, so `--stall-timeout nan` says which flag and what was
//! expected instead of panicking later in `Duration::from_secs_f64`.

use std::time::Duration;

/// The longest duration a flag takes: about eleven days. (A longer one is almost surely a typo,
/// and `Duration::from_secs_f64` panics beyond `u64::MAX` seconds.)
pub const MAX_SECONDS: f64 = 1e6;

/// The largest count a size flag takes (tokens, requests, ranks, sequences): beyond it the
/// allocation the flag sizes cannot fit a machine.
pub const MAX_COUNT: usize = 1 << 24;

/// Seconds as a finite number in `0..=MAX_SECONDS`.
pub fn seconds(text: &str) -> Result<Duration, String> {
    let value: f64 = text.trim().parse().map_err(|_| format!("expected a number of seconds, got {text:?}"))?;
    if !value.is_finite() || !(0.0..=MAX_SECONDS).contains(&value) {
        return Err(format!("expected a number of seconds between 0 and {MAX_SECONDS}, got {text}"));
    }
    Ok(Duration::from_secs_f64(value))
}

/// A count in `1..=MAX_COUNT`.
pub fn count(text: &str) -> Result<usize, String> {
    let value: usize = text.trim().parse().map_err(|_| format!("expected a whole number, got {text:?}"))?;
    if value == 0 || value > MAX_COUNT {
        return Err(format!("expected a whole number between 1 and {MAX_COUNT}, got {value}"));
    }
    Ok(value)
}

/// A count in `0..=MAX_COUNT` (for flags where 0 means "none").
pub fn count_or_zero(text: &str) -> Result<usize, String> {
    let value: usize = text.trim().parse().map_err(|_| format!("expected a whole number, got {text:?}"))?;
    if value > MAX_COUNT {
        return Err(format!("expected a whole number between 0 and {MAX_COUNT}, got {value}"));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_must_be_finite_not_negative_and_bounded() {
        assert_eq!(seconds("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(seconds("0"), Ok(Duration::ZERO));
        for bad in ["nan", "NaN", "inf", "-inf", "-1", "1e300", "", "ten"] {
            assert!(seconds(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn counts_are_at_least_one_and_bounded() {
        assert_eq!(count("4"), Ok(4));
        assert!(count("0").unwrap_err().contains("between 1 and"));
        assert!(count("100000000000").is_err());
        assert!(count("-3").is_err());
        assert_eq!(count_or_zero("0"), Ok(0));
    }
}
