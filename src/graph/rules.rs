//! Rules of graph validation: one small function per check. Command-line overrides are written
//! into the raw graph before validation (`overrides.rs`), so these rules check them as well. Each
//! returns the accepted value, or what is wrong with it (the caller adds where it came from).

use std::net::Ipv6Addr;
use std::path::PathBuf;
use std::str::FromStr;

use super::error::quoted_list;
use super::Endpoint;

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

/// A pool's process addresses: at least one, each `host:port`, none twice, and the ranks divided
/// evenly over them.
pub(super) fn pool_hosts(hosts: Vec<String>, ranks: usize) -> Result<Vec<String>, String> {
    if hosts.is_empty() {
        return Err("expected at least one \"host:port\" (leave hosts out for one process)".to_string());
    }
    for (i, h) in hosts.iter().enumerate() {
        host_port(h).map_err(|why| format!("entry {i}: {why}"))?;
        if hosts[..i].contains(h) {
            return Err(format!("entry {i}: {h:?} is listed twice (one address per process)"));
        }
    }
    if !ranks.is_multiple_of(hosts.len()) {
        return Err(format!(
            "{} processes cannot share the pool's {ranks} ranks evenly (each process runs the same number)",
            hosts.len()
        ));
    }
    Ok(hosts)
}

/// `host:port` with a host and a port number from 1 to 65535.
pub fn host_port(text: &str) -> Result<(), String> {
    let Some((host, port)) = text.rsplit_once(':') else {
        return Err(format!("expected host:port, got {text:?}"));
    };
    if host.is_empty() || host.chars().any(char::is_whitespace) {
        return Err(format!("expected host:port with a host name or address before the colon, got {text:?}"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(format!("expected a port number from 1 to 65535 after the colon, got {port:?} in {text:?}")),
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

/// The longest duration a key takes, in milliseconds: the duration flags' bound
/// ([`crate::flags::MAX_SECONDS`], about eleven days), so no duration key can overflow the
/// `Duration` it becomes.
pub const MAX_MILLISECONDS: f64 = crate::flags::MAX_SECONDS * 1000.0;

/// A duration in milliseconds: finite, in `0..=MAX_MILLISECONDS`.
pub(super) fn milliseconds(value: f64) -> Result<f64, String> {
    if value.is_finite() && (0.0..=MAX_MILLISECONDS).contains(&value) {
        Ok(value)
    } else {
        Err(format!("must be a number of milliseconds at least 0 and at most {MAX_MILLISECONDS}, got {}", shown(value)))
    }
}

/// A duration in milliseconds more than 0 and at most `MAX_MILLISECONDS`.
pub(super) fn positive_milliseconds(value: f64) -> Result<f64, String> {
    match milliseconds(value) {
        Ok(ms) if ms > 0.0 => Ok(ms),
        _ => Err(format!(
            "must be a number of milliseconds more than 0 and at most {MAX_MILLISECONDS}, got {}",
            shown(value)
        )),
    }
}

/// `value` as it was most likely written: a huge one in exponent form (`1e300`, not its 301 digits).
fn shown(value: f64) -> String {
    if value.is_finite() && value.abs() >= 1e15 {
        format!("{value:e}")
    } else {
        value.to_string()
    }
}

pub(super) fn probability(value: f64) -> Result<f64, String> {
    if (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(format!("must be a probability between 0 and 1, got {value}"))
    }
}

/// Longest `transfer.deployment_token`, in bytes.
pub const MAX_DEPLOYMENT_TOKEN_BYTES: usize = 256;

/// A deployment token: 1 to [`MAX_DEPLOYMENT_TOKEN_BYTES`] bytes of printable ASCII (space to
/// `~`). Messages never quote the token: it is a secret shared by a deployment's processes.
pub(super) fn deployment_token(token: String) -> Result<String, String> {
    if token.is_empty() {
        return Err("must not be empty (leave the key out for no token)".to_string());
    }
    if token.len() > MAX_DEPLOYMENT_TOKEN_BYTES {
        return Err(format!("must be at most {MAX_DEPLOYMENT_TOKEN_BYTES} bytes, got {} bytes", token.len()));
    }
    if let Some(position) = token.chars().position(|c| !(' '..='~').contains(&c)) {
        return Err(format!(
            "must be printable ASCII (space to '~'), but character {} is not (the token is not shown)",
            position + 1
        ));
    }
    Ok(token)
}

/// Parses a listen address `host:port`, as a link's `endpoint` and a `--endpoint` flag write it:
/// a host name or IPv4 address, or an IPv6 address in brackets (`[::1]:0`, stored without them),
/// and a port from 0 to 65535 (0: the kernel picks one, which the consumer publishes).
pub fn parse_endpoint(text: &str) -> Result<Endpoint, String> {
    let (host, port) = if let Some(bracketed) = text.strip_prefix('[') {
        let Some((host, port)) = bracketed.split_once("]:") else {
            return Err(format!("expected [IPv6 address]:port, got {text:?}"));
        };
        if host.parse::<Ipv6Addr>().is_err() {
            return Err(format!("expected an IPv6 address in the brackets of [host]:port, got {host:?} in {text:?}"));
        }
        (host, port)
    } else {
        let Some((host, port)) = text.rsplit_once(':') else {
            return Err(format!("expected host:port, got {text:?}"));
        };
        if host.contains(':') {
            return Err(format!(
                "expected host:port, got {text:?}: an IPv6 address goes in brackets, as in \"[::1]:0\""
            ));
        }
        let allowed = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_';
        if host.is_empty() || !host.chars().all(allowed) {
            return Err(format!("expected host:port with a host name or IP address before the colon, got {text:?}"));
        }
        (host, port)
    };
    if port.is_empty() || !port.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("expected a port number from 0 to 65535 after the colon, got {port:?} in {text:?}"));
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("port {port} is out of range: ports are 0 to 65535 (0: the kernel picks), in {text:?}"))?;
    Ok(Endpoint { host: host.to_string(), port })
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

/// `path` with `~/` at its start and `${VAR}` / `${VAR:-default}` replaced (so a graph can name
/// a model kept in a cache outside the repository).
pub(super) fn expand_path(path: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = path;
    while let Some(at) = rest.find("${") {
        out.push_str(&rest[..at]);
        let body = &rest[at + 2..];
        let end = body.find('}').ok_or_else(|| format!("`${{` without its `}}` in {path:?}"))?;
        let (name, default) = match body[..end].split_once(":-") {
            Some((name, default)) => (name, Some(default)),
            None => (&body[..end], None),
        };
        match (std::env::var(name).ok().filter(|v| !v.is_empty()), default) {
            (Some(value), _) => out.push_str(&value),
            (None, Some(default)) => out.push_str(default),
            (None, None) => return Err(format!("environment variable {name} (named in {path:?}) is not set")),
        }
        rest = &body[end + 1..];
    }
    out.push_str(rest);
    if let Some(under_home) = out.strip_prefix("~/") {
        let home = std::env::var("HOME").map_err(|_| format!("{path:?} starts with `~/`, and HOME is not set"))?;
        out = format!("{home}/{under_home}");
    }
    Ok(out)
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

/// Parses a link rate in bytes per second: a byte count per second, such as `"100 MB/s"` or
/// `"1.5 GiB/s"` (the units of [`parse_byte_size`]), or bits per second, `"10 Gbit/s"`,
/// `"400 Mbit/s"` (kbit, Mbit, Gbit, Tbit: powers of 1000). More than 0.
pub fn parse_link_rate(text: &str) -> Result<u64, String> {
    let expected = || format!("\"{text}\" is not a rate such as \"100 MB/s\" or \"10 Gbit/s\"");
    let trimmed = text.trim();
    let per_second = match trimmed.len().checked_sub(2).and_then(|at| trimmed.get(at..)) {
        Some(suffix) if suffix.eq_ignore_ascii_case("/s") => &trimmed[..trimmed.len() - 2],
        _ => return Err(expected()),
    };
    let bits: Option<(&str, f64)> =
        ["kbit", "mbit", "gbit", "tbit"].iter().zip([1e3, 1e6, 1e9, 1e12]).find_map(|(unit, m)| {
            let lower = per_second.to_ascii_lowercase();
            lower.strip_suffix(unit).map(|n| (&per_second[..n.len()], m / 8.0))
        });
    let bytes = match bits {
        Some((number, bytes_per_unit)) => {
            let n: f64 = number.trim().parse().ok().filter(|n: &f64| n.is_finite()).ok_or_else(expected)?;
            let bytes = (n * bytes_per_unit).floor();
            if !bytes.is_finite() || bytes >= u64::MAX as f64 {
                return Err(format!("\"{text}\" is too large"));
            }
            bytes as u64
        }
        None => parse_byte_size(per_second).map_err(|e| format!("{}: {e}", expected()))?,
    };
    if bytes == 0 {
        return Err(format!("\"{text}\" is no rate: it must be more than 0 bytes a second"));
    }
    Ok(bytes)
}

/// `host:port` (IPv6 as `[addr]:port`), as [`parse_endpoint`] reads it.
impl FromStr for Endpoint {
    type Err = String;

    /// [`parse_endpoint`].
    fn from_str(text: &str) -> Result<Endpoint, String> {
        parse_endpoint(text)
    }
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

    #[test]
    fn link_rates_parse_bytes_and_bits_per_second() {
        assert_eq!(parse_link_rate("100 MB/s"), Ok(100_000_000));
        assert_eq!(parse_link_rate("1.5 GiB/s"), Ok(3 << 29));
        assert_eq!(parse_link_rate("10 Gbit/s"), Ok(1_250_000_000));
        assert_eq!(parse_link_rate("400Mbit/s"), Ok(50_000_000));
        assert_eq!(parse_link_rate("4096/s"), Ok(4096));
        assert_eq!(parse_link_rate("100 MB/S"), Ok(100_000_000));
        for bad in ["100 MB", "fast/s", "0 MB/s", "-1 MB/s", "10 Gbits/s", "1e400 Gbit/s", "NaN Gbit/s", "/s"] {
            let e = parse_link_rate(bad).expect_err(bad);
            assert!(e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn endpoints_parse_host_names_ipv4_and_bracketed_ipv6() {
        let endpoint = |host: &str, port| Endpoint { host: host.to_string(), port };
        assert_eq!(parse_endpoint("127.0.0.1:0"), Ok(endpoint("127.0.0.1", 0)));
        assert_eq!(parse_endpoint("[::1]:0"), Ok(endpoint("::1", 0)));
        assert_eq!(parse_endpoint("localhost:7000"), Ok(endpoint("localhost", 7000)));
        assert_eq!(parse_endpoint("decode-0.cluster.local:65535"), Ok(endpoint("decode-0.cluster.local", 65535)));
        assert_eq!(parse_endpoint("[fe80::1:2]:9"), Ok(endpoint("fe80::1:2", 9)));
    }

    #[test]
    fn endpoints_display_as_they_are_written() {
        for text in ["127.0.0.1:0", "[::1]:0", "localhost:7000", "[2001:db8::5]:443"] {
            let endpoint = parse_endpoint(text).expect(text);
            assert_eq!(endpoint.to_string(), text);
            assert_eq!(text.parse::<Endpoint>(), Ok(endpoint));
        }
    }

    #[test]
    fn endpoints_reject_what_is_not_host_colon_port() {
        let error = |text: &str| parse_endpoint(text).expect_err(text);
        let unbracketed = error("::1:0");
        assert!(
            unbracketed.contains("expected host:port, got \"::1:0\"") && unbracketed.contains("[::1]:0"),
            "{unbracketed}"
        );
        assert_eq!(error("host"), "expected host:port, got \"host\"");
        let out_of_range = error("host:99999");
        assert!(
            out_of_range.contains("port 99999 is out of range") && out_of_range.contains("0 to 65535"),
            "{out_of_range}"
        );
        assert!(error(":80").contains("a host name or IP address before the colon, got \":80\""));
        assert!(error("host:").contains("expected a port number"));
        assert!(error("host:+80").contains("expected a port number"));
        assert!(error("host:http").contains("expected a port number"));
        assert!(error(" host:80").contains("before the colon"));
        assert!(error("[::1]").contains("expected [IPv6 address]:port"));
        assert!(error("[127.0.0.1]:80").contains("an IPv6 address in the brackets"));
        assert!(error("[]:80").contains("an IPv6 address in the brackets"));
        assert!(error("").contains("expected host:port"));
    }

    #[test]
    fn probabilities_are_finite_and_between_zero_and_one() {
        assert_eq!(probability(0.0), Ok(0.0));
        assert_eq!(probability(1.0), Ok(1.0));
        for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
            assert!(probability(bad).unwrap_err().contains("between 0 and 1"), "{bad}");
        }
    }

    #[test]
    fn deployment_tokens_are_short_printable_ascii_and_never_shown() {
        assert_eq!(deployment_token("s3cret token~".to_string()), Ok("s3cret token~".to_string()));
        assert_eq!(deployment_token("x".repeat(256)).map(|t| t.len()), Ok(256));
        assert!(deployment_token(String::new()).unwrap_err().contains("must not be empty"));
        assert!(deployment_token("x".repeat(257)).unwrap_err().contains("at most 256 bytes, got 257"));
        for bad in ["tab\there", "new\nline", "caf\u{e9}"] {
            let message = deployment_token(bad.to_string()).unwrap_err();
            assert!(message.contains("printable ASCII") && !message.contains(bad), "{message}");
        }
    }
}
