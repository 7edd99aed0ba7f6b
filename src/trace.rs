//! Request traces: reading them and turning them into replayable requests (DESIGN.md §11).
//!
//! Three recorded formats are read into [`TraceRecord`]s, one per non-empty line, in file order:
//! - Mooncake JSONL: `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [..]}`,
//!   where each hash id names one 512-token block of the prompt (equal ids are equal blocks, so the
//!   trace encodes prefix sharing);
//! - Azure CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps like
//!   `2023-11-16 18:17:03.9799600` (no time zone; parsed here with civil-date arithmetic);
//! - Vidur CSV: `arrived_at` (seconds), `num_prefill_tokens`, `num_decode_tokens`, other columns
//!   ignored.
//!
//! Arrival times are made relative to the first record (the first record arrives at 0 ms); a
//! record stamped before the first one is an error, because replay keeps trace order.
//!
//! [`synthesize`] then scales the lengths down by `block_tokens` N (a 512-token block becomes N
//! tokens: a length L becomes `max(1, ceil(L·N/512))`) and fills prompts with deterministic
//! pseudo-random tokens. For Mooncake, the tokens of hash block i are a pure function of
//! `(seed, hash_ids[i], position in block)`, so the run shares exactly the prefixes the trace
//! shares; for the other formats, token j of request k is a pure function of `(seed, k, j)`.
//!
//! Nothing here panics on malformed input: every problem is a [`TraceError`] naming the file, the
//! 1-based line, the field and what was expected.

use std::fmt;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// Tokens in one block of the recorded traces (Mooncake hash ids name 512-token blocks).
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// The recorded trace formats kvflow can replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TraceFormat {
    /// Mooncake JSONL with per-block hash ids (prefix sharing encoded).
    Mooncake,
    /// Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).
    Azure,
    /// Vidur processed-trace CSV (`arrived_at`, `num_prefill_tokens`, `num_decode_tokens`).
    Vidur,
}

impl TraceFormat {
    /// Every format, in the order the CLI lists them.
    pub const ALL: [TraceFormat; 3] = [TraceFormat::Mooncake, TraceFormat::Azure, TraceFormat::Vidur];

    /// The lowercase name used on the command line and in configs.
    pub fn name(self) -> &'static str {
        match self {
            TraceFormat::Mooncake => "mooncake",
            TraceFormat::Azure => "azure",
            TraceFormat::Vidur => "vidur",
        }
    }
}

impl fmt::Display for TraceFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A trace format name that is not one of [`TraceFormat::ALL`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown trace format `{given}`: expected one of mooncake, azure, vidur")]
pub struct UnknownTraceFormat {
    /// The name as given.
    pub given: String,
}

impl FromStr for TraceFormat {
    type Err = UnknownTraceFormat;

    /// Parses `mooncake`, `azure` or `vidur` (case-insensitive, surrounding spaces ignored).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let wanted = text.trim();
        TraceFormat::ALL
            .into_iter()
            .find(|format| format.name().eq_ignore_ascii_case(wanted))
            .ok_or_else(|| UnknownTraceFormat { given: text.to_string() })
    }
}

/// One trace line, as recorded (lengths unscaled).
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRecord {
    /// 1-based line number in the trace file (a CSV header is line 1).
    pub line: usize,
    /// Arrival in milliseconds relative to the first record (the first record has 0.0; never negative).
    pub arrival_ms: f64,
    /// Prompt length in tokens, as recorded.
    pub input_len: usize,
    /// Output length in tokens, as recorded.
    pub output_len: usize,
    /// Mooncake only: one hash id per 512-token prompt block (at least `ceil(input_len / 512)`).
    pub hash_ids: Option<Vec<u64>>,
}

/// Everything that can go wrong reading a trace or synthesising requests from it.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("{}: cannot read the trace: {source}", .path.display())]
    Io {
        /// The trace file.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A line is not parseable at all (bad JSON, bad CSV, not UTF-8).
    #[error("{}:{line}: {message}", .path.display())]
    Malformed {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A field is present but holds the wrong kind of value.
    #[error("{}:{line}: field `{field}`: expected {expected}, found {found}", .path.display())]
    BadField {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Field (JSON key or CSV column) name.
        field: String,
        /// What the field should hold.
        expected: String,
        /// What it holds.
        found: String,
    },
    /// A record lacks a required field.
    #[error("{}:{line}: field `{field}` is missing: expected {expected}", .path.display())]
    MissingField {
        /// The trace file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Field (JSON key or CSV column) name.
        field: String,
        /// What the field should hold.
        expected: String,
    },
    /// A CSV header lacks a required column.
    #[error("{}:1: header has no column `{column}` (the header is `{header}`)", .path.display())]
    MissingColumn {
        /// The trace file.
        path: PathBuf,
        /// The column looked for.
        column: String,
        /// The header as read, comma-joined.
        header: String,
    },
    /// The file holds no records.
    #[error("{}: the trace has no records", .path.display())]
    Empty {
        /// The trace file.
        path: PathBuf,
    },
    /// [`SynthOptions`] out of range.
    #[error("invalid synthesis options: {0}")]
    InvalidOptions(String),
    /// A Mooncake record has fewer hash ids than its scaled prompt has blocks.
    #[error(
        "trace line {line}: field `hash_ids`: a prompt of {scaled_tokens} scaled tokens at block_tokens \
         {block_tokens} needs {needed} hash ids, found {available}"
    )]
    NotEnoughHashIds {
        /// 1-based line number of the record.
        line: usize,
        /// Scaled prompt length.
        scaled_tokens: usize,
        /// The `block_tokens` in use.
        block_tokens: usize,
        /// Hash blocks the scaled prompt spans.
        needed: usize,
        /// Hash ids the record has.
        available: usize,
    },
}

/// Reads every record of a trace file in file order, skipping empty lines.
///
/// Arrival times are relative to the first record; a record stamped before the first is an error.
/// An empty trace (no records) is an error too.
pub fn read_trace(path: &Path, format: TraceFormat) -> Result<Vec<TraceRecord>, TraceError> {
    let records = match format {
        TraceFormat::Mooncake => read_mooncake(path)?,
        TraceFormat::Azure => read_azure(path)?,
        TraceFormat::Vidur => read_vidur(path)?,
    };
    if records.is_empty() {
        return Err(TraceError::Empty { path: path.to_path_buf() });
    }
    Ok(records)
}

const EXPECTED_COUNT: &str = "a non-negative integer";

/// A record before its arrival is made relative: the absolute stamp is format-specific.
struct StampedRecord<Stamp> {
    line: usize,
    stamp: Stamp,
    input_len: usize,
    output_len: usize,
    hash_ids: Option<Vec<u64>>,
}

/// Makes arrivals relative to the first record, rejecting records stamped before it.
fn relative_to_first<Stamp: Copy>(
    path: &Path,
    field: &str,
    stamped: Vec<StampedRecord<Stamp>>,
    ms_between: impl Fn(Stamp, Stamp) -> f64,
    show: impl Fn(Stamp) -> String,
) -> Result<Vec<TraceRecord>, TraceError> {
    let Some(first_stamp) = stamped.first().map(|record| record.stamp) else { return Ok(Vec::new()) };
    stamped
        .into_iter()
        .map(|record| {
            let arrival_ms = ms_between(first_stamp, record.stamp);
            if arrival_ms.is_nan() || arrival_ms < 0.0 {
                return Err(TraceError::BadField {
                    path: path.to_path_buf(),
                    line: record.line,
                    field: field.to_string(),
                    expected: format!(
                        "a time not before the first record's ({}): replay keeps trace order",
                        show(first_stamp)
                    ),
                    found: show(record.stamp),
                });
            }
            Ok(TraceRecord {
                line: record.line,
                arrival_ms,
                input_len: record.input_len,
                output_len: record.output_len,
                hash_ids: record.hash_ids,
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Mooncake JSONL
// ---------------------------------------------------------------------------------------------

fn read_mooncake(path: &Path) -> Result<Vec<TraceRecord>, TraceError> {
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io { path: path.to_path_buf(), source })?;
    let mut stamped = Vec::new();
    for (index, line_text) in std::io::BufReader::new(file).lines().enumerate() {
        let line = index + 1;
        let line_text = line_text.map_err(|error| TraceError::Malformed {
            path: path.to_path_buf(),
            line,
            message: format!("cannot read the line: {error}"),
        })?;
        let text = line_text.trim_start_matches('\u{feff}').trim();
        if text.is_empty() {
            continue;
        }
        stamped.push(parse_mooncake_line(path, line, text)?);
    }
    relative_to_first(path, "timestamp", stamped, |first, this| this - first, |stamp| format!("{stamp} ms"))
}

fn parse_mooncake_line(path: &Path, line: usize, text: &str) -> Result<StampedRecord<f64>, TraceError> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|error| TraceError::Malformed {
        path: path.to_path_buf(),
        line,
        message: format!("not valid JSON: {error}"),
    })?;
    let serde_json::Value::Object(object) = value else {
        return Err(TraceError::Malformed {
            path: path.to_path_buf(),
            line,
            message: format!("expected a JSON object, found {}", truncated(&value.to_string())),
        });
    };
    let bad_field = |field: &str, expected: &str, found: &serde_json::Value| TraceError::BadField {
        path: path.to_path_buf(),
        line,
        field: field.to_string(),
        expected: expected.to_string(),
        found: truncated(&found.to_string()),
    };
    let required = |field: &str, expected: &str| {
        object.get(field).ok_or_else(|| TraceError::MissingField {
            path: path.to_path_buf(),
            line,
            field: field.to_string(),
            expected: expected.to_string(),
        })
    };

    const EXPECTED_TIMESTAMP: &str = "a number of milliseconds";
    let timestamp_value = required("timestamp", EXPECTED_TIMESTAMP)?;
    let timestamp = timestamp_value
        .as_f64()
        .filter(|ms| ms.is_finite())
        .ok_or_else(|| bad_field("timestamp", EXPECTED_TIMESTAMP, timestamp_value))?;

    let count = |field: &str| -> Result<usize, TraceError> {
        let value = required(field, EXPECTED_COUNT)?;
        json_count(value).ok_or_else(|| bad_field(field, EXPECTED_COUNT, value))
    };
    let input_len = count("input_length")?;
    let output_len = count("output_length")?;

    const EXPECTED_HASH_IDS: &str = "an array of non-negative integers";
    let hash_ids_value = required("hash_ids", EXPECTED_HASH_IDS)?;
    let serde_json::Value::Array(hash_id_values) = hash_ids_value else {
        return Err(bad_field("hash_ids", EXPECTED_HASH_IDS, hash_ids_value));
    };
    let mut hash_ids = Vec::with_capacity(hash_id_values.len());
    for (position, hash_id_value) in hash_id_values.iter().enumerate() {
        let hash_id = hash_id_value
            .as_u64()
            .ok_or_else(|| bad_field(&format!("hash_ids[{position}]"), EXPECTED_COUNT, hash_id_value))?;
        hash_ids.push(hash_id);
    }
    let needed = input_len.div_ceil(TRACE_BLOCK_TOKENS);
    if hash_ids.len() < needed {
        return Err(TraceError::BadField {
            path: path.to_path_buf(),
            line,
            field: "hash_ids".to_string(),
            expected: format!(
                "at least ceil(input_length / {TRACE_BLOCK_TOKENS}) = {needed} ids for input_length {input_len}"
            ),
            found: hash_ids.len().to_string(),
        });
    }
    Ok(StampedRecord { line, stamp: timestamp, input_len, output_len, hash_ids: Some(hash_ids) })
}

/// A JSON number that is a non-negative integer (`7` or `7.0`), as a `usize`.
fn json_count(value: &serde_json::Value) -> Option<usize> {
    if let Some(whole) = value.as_u64() {
        return usize::try_from(whole).ok();
    }
    value.as_f64().and_then(integral_f64_count)
}

/// A float holding a non-negative integer exactly representable (≤ 2^53), as a `usize`.
fn integral_f64_count(number: f64) -> Option<usize> {
    const LARGEST_EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    if number.is_finite() && number >= 0.0 && number.fract() == 0.0 && number <= LARGEST_EXACT {
        usize::try_from(number as u64).ok()
    } else {
        None
    }
}

/// Long values are cut in error messages so one bad line does not flood the terminal.
fn truncated(text: &str) -> String {
    const LIMIT: usize = 80;
    match text.char_indices().nth(LIMIT) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// CSV formats (Azure, Vidur)
// ---------------------------------------------------------------------------------------------

/// Reads a CSV trace: finds each of `columns` in the header (case-insensitive, surrounding spaces
/// ignored), then calls `on_row(path, line, fields)` for every non-blank data row, `fields` holding
/// the wanted columns in order, trimmed. `line` is the 1-based line the row starts on.
fn read_csv_rows(
    path: &Path,
    columns: &[&'static str],
    mut on_row: impl FnMut(&Path, usize, &[&str]) -> Result<(), TraceError>,
) -> Result<(), TraceError> {
    let bytes = std::fs::read(path).map_err(|source| TraceError::Io { path: path.to_path_buf(), source })?;
    let mut lines = LineCounter::new(&bytes);
    let mut reader = csv::ReaderBuilder::new().has_headers(true).flexible(true).from_reader(bytes.as_slice());
    let header = reader
        .headers()
        .map_err(|error| csv_error(path, error.position().map_or(1, |at| lines.line_at(at.byte())), error))?
        .clone();
    let mut column_indices = Vec::with_capacity(columns.len());
    for &column in columns {
        let index =
            header.iter().position(|name| name.trim_start_matches('\u{feff}').trim().eq_ignore_ascii_case(column));
        let Some(index) = index else {
            return Err(TraceError::MissingColumn {
                path: path.to_path_buf(),
                column: column.to_string(),
                header: truncated(&header.iter().collect::<Vec<_>>().join(",")),
            });
        };
        column_indices.push(index);
    }

    let mut row = csv::StringRecord::new();
    loop {
        let byte_before = reader.position().byte();
        let more = reader.read_record(&mut row).map_err(|error| {
            let line = lines.line_at(error.position().map_or(byte_before, |at| at.byte()));
            csv_error(path, line, error)
        })?;
        if !more {
            return Ok(());
        }
        // The csv crate positions a record where parsing began, which may be on a skipped blank line.
        let line = lines.line_at(row.position().map_or(byte_before, |at| at.byte()));
        if row.iter().all(|field| field.trim().is_empty()) {
            continue;
        }
        let mut fields: Vec<&str> = Vec::with_capacity(columns.len());
        for (&index, &name) in column_indices.iter().zip(columns) {
            let Some(field) = row.get(index) else {
                return Err(TraceError::MissingField {
                    path: path.to_path_buf(),
                    line,
                    field: name.to_string(),
                    expected: format!("a value in column {} (the row has {} fields)", index + 1, row.len()),
                });
            };
            fields.push(field.trim());
        }
        on_row(path, line, &fields)?;
    }
}

/// Maps byte offsets to 1-based line numbers, counting newlines incrementally (offsets mostly grow).
struct LineCounter<'a> {
    bytes: &'a [u8],
    offset: usize,
    line: usize,
}

impl<'a> LineCounter<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        LineCounter { bytes, offset: 0, line: 1 }
    }

    /// The line of the first non-blank byte at or after `offset` (blank: space, tab, CR, LF).
    fn line_at(&mut self, offset: u64) -> usize {
        let mut offset = usize::try_from(offset).unwrap_or(usize::MAX).min(self.bytes.len());
        while offset < self.bytes.len() && matches!(self.bytes[offset], b' ' | b'\t' | b'\r' | b'\n') {
            offset += 1;
        }
        if offset < self.offset {
            self.offset = 0;
            self.line = 1;
        }
        self.line += self.bytes[self.offset..offset].iter().filter(|&&byte| byte == b'\n').count();
        self.offset = offset;
        self.line
    }
}

fn csv_error(path: &Path, line: usize, error: csv::Error) -> TraceError {
    TraceError::Malformed { path: path.to_path_buf(), line, message: format!("not valid CSV: {error}") }
}

fn bad_csv_field(path: &Path, line: usize, field: &str, expected: &str, raw: &str) -> TraceError {
    TraceError::BadField {
        path: path.to_path_buf(),
        line,
        field: field.to_string(),
        expected: expected.to_string(),
        found: if raw.is_empty() { "an empty field".to_string() } else { format!("`{}`", truncated(raw)) },
    }
}

/// A CSV count field: a non-negative integer (`374`, or `374.0` as some tools write it).
fn csv_count(path: &Path, line: usize, field: &str, raw: &str) -> Result<usize, TraceError> {
    raw.parse::<usize>()
        .ok()
        .or_else(|| raw.parse::<f64>().ok().and_then(integral_f64_count))
        .ok_or_else(|| bad_csv_field(path, line, field, EXPECTED_COUNT, raw))
}

fn read_azure(path: &Path) -> Result<Vec<TraceRecord>, TraceError> {
    const COLUMNS: [&str; 3] = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"];
    let mut stamped = Vec::new();
    read_csv_rows(path, &COLUMNS, |path, line, fields| {
        let nanos = parse_civil_timestamp_nanos(fields[0]).ok_or_else(|| {
            bad_csv_field(path, line, COLUMNS[0], "a time `YYYY-MM-DD HH:MM:SS[.fraction]`", fields[0])
        })?;
        stamped.push(StampedRecord {
            line,
            stamp: nanos,
            input_len: csv_count(path, line, COLUMNS[1], fields[1])?,
            output_len: csv_count(path, line, COLUMNS[2], fields[2])?,
            hash_ids: None,
        });
        Ok(())
    })?;
    relative_to_first(
        path,
        COLUMNS[0],
        stamped,
        |first, this| (this - first) as f64 / 1e6,
        format_civil_timestamp_nanos,
    )
}

fn read_vidur(path: &Path) -> Result<Vec<TraceRecord>, TraceError> {
    const COLUMNS: [&str; 3] = ["arrived_at", "num_prefill_tokens", "num_decode_tokens"];
    let mut stamped = Vec::new();
    read_csv_rows(path, &COLUMNS, |path, line, fields| {
        let seconds = fields[0]
            .parse::<f64>()
            .ok()
            .filter(|seconds| seconds.is_finite())
            .ok_or_else(|| bad_csv_field(path, line, COLUMNS[0], "a number of seconds", fields[0]))?;
        stamped.push(StampedRecord {
            line,
            stamp: seconds,
            input_len: csv_count(path, line, COLUMNS[1], fields[1])?,
            output_len: csv_count(path, line, COLUMNS[2], fields[2])?,
            hash_ids: None,
        });
        Ok(())
    })?;
    relative_to_first(
        path,
        COLUMNS[0],
        stamped,
        |first, this| (this - first) * 1000.0,
        |seconds| format!("{seconds} s"),
    )
}

// ---------------------------------------------------------------------------------------------
// Civil timestamps (Azure)
// ---------------------------------------------------------------------------------------------

const NANOS_PER_SECOND: i128 = 1_000_000_000;

/// Parses `YYYY-MM-DD HH:MM:SS[.fraction]` (a `T` may separate date and time; the fraction may have
/// any number of digits, kept to nanoseconds) into nanoseconds since 1970-01-01 00:00:00 of the
/// same (unnamed) time zone. Returns `None` for anything else, including impossible dates.
fn parse_civil_timestamp_nanos(text: &str) -> Option<i128> {
    let (date, time) = text.split_once([' ', 'T'])?;
    let mut date_parts = date.split('-');
    let year = i64::from(parse_digits(date_parts.next()?, 1, 4)?);
    let month = parse_digits(date_parts.next()?, 1, 2)?;
    let day = parse_digits(date_parts.next()?, 1, 2)?;
    if date_parts.next().is_some() || !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return None;
    }

    let (clock, fraction) = match time.trim().split_once('.') {
        Some((clock, fraction)) => (clock, Some(fraction)),
        None => (time.trim(), None),
    };
    let mut clock_parts = clock.split(':');
    let hour = parse_digits(clock_parts.next()?, 1, 2)?;
    let minute = parse_digits(clock_parts.next()?, 1, 2)?;
    let second = parse_digits(clock_parts.next()?, 1, 2)?;
    if clock_parts.next().is_some() || hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let fraction_nanos = match fraction {
        None => 0,
        Some(digits) => {
            if digits.is_empty() || !digits.bytes().all(|byte| byte.is_ascii_digit()) {
                return None;
            }
            // Keep nanoseconds: the first nine digits, right-padded with zeros.
            let kept = &digits[..digits.len().min(9)];
            let value: i128 = kept.parse().ok()?;
            value * 10i128.pow(9 - kept.len() as u32)
        }
    };
    let days = days_from_civil(year, month, day) as i128;
    let seconds = days * 86_400 + (hour * 3600 + minute * 60 + second) as i128;
    Some(seconds * NANOS_PER_SECOND + fraction_nanos)
}

/// The inverse of [`parse_civil_timestamp_nanos`], for error messages.
fn format_civil_timestamp_nanos(nanos: i128) -> String {
    let seconds = nanos.div_euclid(NANOS_PER_SECOND);
    let fraction = nanos.rem_euclid(NANOS_PER_SECOND);
    let days = seconds.div_euclid(86_400) as i64;
    let second_of_day = seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{fraction:09}",
        second_of_day / 3600,
        second_of_day / 60 % 60,
        second_of_day % 60
    )
}

/// Parses `min_digits..=max_digits` ASCII digits.
fn parse_digits(text: &str, min_digits: usize, max_digits: usize) -> Option<u32> {
    if text.len() < min_digits || text.len() > max_digits || !text.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn is_leap_year(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: u32) -> u32 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap_year(year) => 29,
        2 => 28,
        _ => 0,
    }
}

/// Days from 1970-01-01 to the given proleptic-Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400; // [0, 399]
    let month_from_march = (i64::from(month) + 9) % 12; // March = 0
    let day_of_year = (153 * month_from_march + 2) / 5 + i64::from(day) - 1; // [0, 365]
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year; // [0, 146096]
    era * 146_097 + day_of_era - 719_468
}

/// The inverse of [`days_from_civil`]: `(year, month, day)`.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u32;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

// ---------------------------------------------------------------------------------------------
// Scaling and token synthesis
// ---------------------------------------------------------------------------------------------

/// How [`synthesize`] scales lengths and makes tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynthOptions {
    /// N: tokens per trace block after scaling (512 replays the trace at full length). At least 1.
    pub block_tokens: usize,
    /// Seed of the token synthesis; the same seed gives the same prompts.
    pub seed: u64,
    /// Token ids are drawn from `[0, vocab_size)`. At least 1, at most 2^32.
    pub vocab_size: usize,
    /// Cap on each request's scaled output length (`None`: no cap). At least 1 when given.
    pub max_output_tokens: Option<usize>,
}

/// A request ready to replay.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Request {
    /// Index in trace order, 0-based.
    pub id: u64,
    /// Arrival in milliseconds relative to the first record (or, once released by the workload
    /// driver, to the start of the run).
    pub arrival_ms: f64,
    /// Synthesised prompt tokens (never empty).
    pub prompt: Vec<u32>,
    /// Scaled output length, capped by [`SynthOptions::max_output_tokens`] (never 0).
    pub max_output_tokens: usize,
    /// The record's 1-based line in the trace file.
    pub trace_line: usize,
}

/// Scales a recorded length to `block_tokens` N per 512-token block: `max(1, ceil(len·N / 512))`,
/// in exact integer arithmetic (saturating at `usize::MAX`).
pub fn scaled_len(len: usize, block_tokens: usize) -> usize {
    let scaled = (len as u128 * block_tokens as u128).div_ceil(TRACE_BLOCK_TOKENS as u128);
    usize::try_from(scaled).unwrap_or(usize::MAX).max(1)
}

/// Turns records into requests (ids = index in `records`), scaling lengths by
/// [`SynthOptions::block_tokens`] and synthesising prompt tokens with [`synthetic_token`].
///
/// Records with hash ids (Mooncake): scaled hash block i covers prompt tokens
/// `[i·N, min((i+1)·N, L'))`, and its j-th token is `synthetic_token(seed, HASH_BLOCK, hash_ids[i],
/// j)`, so equal hash ids give equal blocks wherever they appear. Other records: token j of request
/// k is `synthetic_token(seed, REQUEST, k, j)`.
pub fn synthesize(records: &[TraceRecord], opts: &SynthOptions) -> Result<Vec<Request>, TraceError> {
    validate_options(opts)?;
    let block_tokens = opts.block_tokens;
    let mut requests = Vec::with_capacity(records.len());
    for (index, record) in records.iter().enumerate() {
        let prompt_len = scaled_len(record.input_len, block_tokens);
        let prompt = match &record.hash_ids {
            Some(hash_ids) => {
                let needed = prompt_len.div_ceil(block_tokens);
                if hash_ids.len() < needed {
                    return Err(TraceError::NotEnoughHashIds {
                        line: record.line,
                        scaled_tokens: prompt_len,
                        block_tokens,
                        needed,
                        available: hash_ids.len(),
                    });
                }
                (0..prompt_len)
                    .map(|position| {
                        let hash_id = hash_ids[position / block_tokens];
                        let within_block = (position % block_tokens) as u64;
                        synthetic_token(opts.seed, TokenStream::HashBlock, hash_id, within_block, opts.vocab_size)
                    })
                    .collect()
            }
            None => (0..prompt_len)
                .map(|position| {
                    synthetic_token(opts.seed, TokenStream::Request, index as u64, position as u64, opts.vocab_size)
                })
                .collect(),
        };
        let scaled_output = scaled_len(record.output_len, block_tokens);
        let max_output_tokens = opts.max_output_tokens.map_or(scaled_output, |cap| scaled_output.min(cap)).max(1);
        requests.push(Request {
            id: index as u64,
            arrival_ms: record.arrival_ms,
            prompt,
            max_output_tokens,
            trace_line: record.line,
        });
    }
    Ok(requests)
}

fn validate_options(opts: &SynthOptions) -> Result<(), TraceError> {
    if opts.block_tokens == 0 {
        return Err(TraceError::InvalidOptions("block_tokens must be at least 1, found 0".to_string()));
    }
    if opts.vocab_size == 0 || opts.vocab_size as u128 > 1u128 << 32 {
        return Err(TraceError::InvalidOptions(format!(
            "vocab_size must be in 1..=4294967296 (token ids are u32), found {}",
            opts.vocab_size
        )));
    }
    if opts.max_output_tokens == Some(0) {
        return Err(TraceError::InvalidOptions("max_output_tokens must be at least 1, found 0".to_string()));
    }
    Ok(())
}

/// Which family of synthetic tokens: keeps hash-block tokens and per-request tokens apart even
/// where a hash id equals a request index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenStream {
    /// Tokens of a Mooncake hash block, keyed by hash id.
    HashBlock,
    /// Tokens of one request without hash ids, keyed by request index.
    Request,
}

impl TokenStream {
    fn domain(self) -> u64 {
        match self {
            TokenStream::HashBlock => 0x6861_7368_626c_6b00, // "hashblk"
            TokenStream::Request => 0x7265_7175_6573_7400,   // "request"
        }
    }
}

/// The splitmix64 finaliser (Steele, Lea & Flood 2014): a bijective 64-bit mix whose output bits
/// each depend on every input bit.
pub fn splitmix64(state: u64) -> u64 {
    let mut z = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A synthetic token: `splitmix64(splitmix64(splitmix64(seed ^ domain) ^ key) ^ position)`
/// mapped onto `[0, vocab_size)` by a 64×64→128-bit multiply-high (no modulo bias to speak of).
///
/// A pure function of its arguments: `key` is the hash id (for [`TokenStream::HashBlock`]) or the
/// request index (for [`TokenStream::Request`]), `position` the token's offset within the block or
/// request. `vocab_size` must be in `1..=2^32` (as [`synthesize`] checks).
pub fn synthetic_token(seed: u64, stream: TokenStream, key: u64, position: u64, vocab_size: usize) -> u32 {
    let mixed = splitmix64(splitmix64(splitmix64(seed ^ stream.domain()) ^ key) ^ position);
    ((mixed as u128 * vocab_size as u128) >> 64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn repo_trace(relative: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("traces").join(relative)
    }

    /// A temporary trace file, removed on drop.
    struct ScratchFile(PathBuf);

    impl ScratchFile {
        fn new(name: &str, contents: &str) -> Self {
            static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let unique = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!("kvflow-trace-test-{}-{unique}-{name}", std::process::id()));
            std::fs::File::create(&path).and_then(|mut file| file.write_all(contents.as_bytes())).unwrap();
            ScratchFile(path)
        }
    }

    impl Drop for ScratchFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn read_error(name: &str, format: TraceFormat, contents: &str) -> String {
        let file = ScratchFile::new(name, contents);
        let error = read_trace(&file.0, format).expect_err("malformed trace must be rejected");
        let message = error.to_string();
        assert!(message.contains(name), "message should name the file: {message}");
        message
    }

    fn options(block_tokens: usize) -> SynthOptions {
        SynthOptions { block_tokens, seed: 7, vocab_size: 32_000, max_output_tokens: None }
    }

    #[test]
    fn repository_traces_read_with_expected_counts_and_first_arrival_zero() {
        let mooncake = read_trace(&repo_trace("mooncake_conversation_head.jsonl"), TraceFormat::Mooncake).unwrap();
        let azure = read_trace(&repo_trace("azure2023_conv_head200.csv"), TraceFormat::Azure).unwrap();
        let vidur =
            read_trace(&repo_trace("format_samples/vidur_splitwise_conv_head200.csv"), TraceFormat::Vidur).unwrap();
        assert_eq!(mooncake.len(), 203);
        assert_eq!(azure.len(), 200);
        assert_eq!(vidur.len(), 200);
        for records in [&mooncake, &azure, &vidur] {
            assert_eq!(records[0].arrival_ms, 0.0);
            assert!(records.iter().all(|record| record.arrival_ms >= 0.0));
        }
        assert_eq!(mooncake[0].line, 1);
        assert_eq!(azure[0].line, 2, "the CSV header is line 1");
        assert_eq!(mooncake.last().unwrap().arrival_ms, 72_000.0);
        assert!(mooncake.iter().all(|record| record.hash_ids.is_some()));
        assert!(azure.iter().chain(&vidur).all(|record| record.hash_ids.is_none()));
    }

    #[test]
    fn azure_and_vidur_copies_of_the_same_requests_agree() {
        let azure = read_trace(&repo_trace("azure2023_conv_head200.csv"), TraceFormat::Azure).unwrap();
        let vidur =
            read_trace(&repo_trace("format_samples/vidur_splitwise_conv_head200.csv"), TraceFormat::Vidur).unwrap();
        assert_eq!(azure.len(), vidur.len());
        for (from_azure, from_vidur) in azure.iter().zip(&vidur) {
            assert_eq!(from_azure.input_len, from_vidur.input_len, "line {}", from_azure.line);
            assert_eq!(from_azure.output_len, from_vidur.output_len, "line {}", from_azure.line);
            assert!(
                (from_azure.arrival_ms - from_vidur.arrival_ms).abs() < 1.0,
                "line {}: azure {} ms vs vidur {} ms",
                from_azure.line,
                from_azure.arrival_ms,
                from_vidur.arrival_ms
            );
        }
        assert!(azure.last().unwrap().arrival_ms > 0.0);
    }

    #[test]
    fn mooncake_requests_sharing_a_first_hash_id_share_their_first_block_of_tokens() {
        let records = read_trace(&repo_trace("mooncake_conversation_head.jsonl"), TraceFormat::Mooncake).unwrap();
        let first_ids: Vec<&[u64]> = records.iter().map(|record| record.hash_ids.as_deref().unwrap()).collect();
        assert_eq!(first_ids[0][0], first_ids[1][0]);
        assert_ne!(first_ids[0][1], first_ids[1][1]);
        let requests = synthesize(&records, &options(16)).unwrap();
        assert_eq!(requests[0].prompt[..16], requests[1].prompt[..16]);
        assert_ne!(requests[0].prompt[16..32], requests[1].prompt[16..32]);
        assert_eq!(requests[0].prompt.len(), scaled_len(6758, 16));
        assert_eq!(requests[0].max_output_tokens, scaled_len(500, 16));
    }

    #[test]
    fn equal_hash_ids_give_equal_blocks_at_any_position() {
        let record = |line, hash_ids: Vec<u64>| TraceRecord {
            line,
            arrival_ms: 0.0,
            input_len: 512 * hash_ids.len(),
            output_len: 10,
            hash_ids: Some(hash_ids),
        };
        let requests = synthesize(&[record(1, vec![5, 9]), record(2, vec![9, 5])], &options(8)).unwrap();
        assert_eq!(requests[0].prompt[..8], requests[1].prompt[8..]);
        assert_eq!(requests[0].prompt[8..], requests[1].prompt[..8]);
        assert_ne!(requests[0].prompt[..8], requests[0].prompt[8..]);
    }

    #[test]
    fn last_hash_block_is_cut_at_the_scaled_prompt_length() {
        // 600 tokens at N = 16: ceil(600·16/512) = 19 tokens, one full block and 3 tokens of the next.
        let record =
            TraceRecord { line: 1, arrival_ms: 0.0, input_len: 600, output_len: 1, hash_ids: Some(vec![1, 2]) };
        let request = &synthesize(&[record], &options(16)).unwrap()[0];
        assert_eq!(request.prompt.len(), 19);
        let block_two_start: Vec<u32> =
            (0..3).map(|j| synthetic_token(7, TokenStream::HashBlock, 2, j, 32_000)).collect();
        assert_eq!(request.prompt[16..], block_two_start[..]);
    }

    #[test]
    fn requests_without_hash_ids_get_distinct_deterministic_tokens() {
        let record = |line| TraceRecord { line, arrival_ms: 0.0, input_len: 512, output_len: 512, hash_ids: None };
        let records = [record(2), record(3)];
        let first = synthesize(&records, &options(32)).unwrap();
        let again = synthesize(&records, &options(32)).unwrap();
        assert_eq!(first, again);
        assert_eq!(first[0].prompt.len(), 32);
        assert_ne!(first[0].prompt, first[1].prompt);
        assert_eq!(first[1].id, 1);
        assert_eq!(first[1].trace_line, 3);
        let other_seed = synthesize(&records, &SynthOptions { seed: 8, ..options(32) }).unwrap();
        assert_ne!(first[0].prompt, other_seed[0].prompt);
    }

    #[test]
    fn tokens_stay_inside_the_vocabulary() {
        let record = TraceRecord { line: 1, arrival_ms: 0.0, input_len: 4096, output_len: 1, hash_ids: None };
        for vocab_size in [1, 2, 3, 1000] {
            let request =
                &synthesize(std::slice::from_ref(&record), &SynthOptions { vocab_size, ..options(512) }).unwrap()[0];
            assert!(request.prompt.iter().all(|&token| (token as usize) < vocab_size));
        }
        let request = &synthesize(&[record], &SynthOptions { vocab_size: 3, ..options(512) }).unwrap()[0];
        for token in 0..3 {
            assert!(request.prompt.contains(&token), "token {token} never drawn from a vocabulary of 3");
        }
    }

    #[test]
    fn scaled_len_is_ceiling_of_len_times_block_tokens_over_512_and_never_zero() {
        assert_eq!(scaled_len(0, 16), 1);
        assert_eq!(scaled_len(1, 16), 1);
        assert_eq!(scaled_len(512, 16), 16);
        assert_eq!(scaled_len(513, 16), 17);
        assert_eq!(scaled_len(6758, 16), 212); // 6758·16/512 = 211.1875
        assert_eq!(scaled_len(6758, 512), 6758);
        assert_eq!(scaled_len(usize::MAX, 512), usize::MAX);
        assert_eq!(scaled_len(usize::MAX, 1024), usize::MAX);
    }

    #[test]
    fn output_length_is_scaled_then_capped_and_never_zero() {
        let record = |output_len| TraceRecord { line: 1, arrival_ms: 0.0, input_len: 0, output_len, hash_ids: None };
        let capped = SynthOptions { max_output_tokens: Some(20), ..options(16) };
        let requests = synthesize(&[record(0), record(512), record(5120)], &capped).unwrap();
        let outputs: Vec<usize> = requests.iter().map(|request| request.max_output_tokens).collect();
        assert_eq!(outputs, [1, 16, 20]);
        assert_eq!(requests[0].prompt.len(), 1, "an empty recorded prompt still gets one token");
    }

    #[test]
    fn invalid_synthesis_options_are_rejected() {
        let records = [TraceRecord { line: 1, arrival_ms: 0.0, input_len: 5, output_len: 5, hash_ids: None }];
        for bad in [
            SynthOptions { block_tokens: 0, ..options(16) },
            SynthOptions { vocab_size: 0, ..options(16) },
            SynthOptions { max_output_tokens: Some(0), ..options(16) },
        ] {
            assert!(matches!(synthesize(&records, &bad), Err(TraceError::InvalidOptions(_))), "{bad:?}");
        }
    }

    #[test]
    fn synthesis_rejects_records_with_too_few_hash_ids() {
        let record =
            TraceRecord { line: 4, arrival_ms: 0.0, input_len: 1500, output_len: 5, hash_ids: Some(vec![1, 2]) };
        let error = synthesize(&[record], &options(16)).unwrap_err();
        let message = error.to_string();
        assert!(matches!(error, TraceError::NotEnoughHashIds { line: 4, needed: 3, available: 2, .. }), "{message}");
        assert!(message.contains("trace line 4") && message.contains("hash_ids"), "{message}");
    }

    #[test]
    fn mooncake_bad_json_names_file_and_line() {
        let message = read_error(
            "bad_json.jsonl",
            TraceFormat::Mooncake,
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n\n{\"timestamp\": 1,\n",
        );
        assert!(message.contains("bad_json.jsonl:3:") && message.contains("JSON"), "{message}");
    }

    #[test]
    fn mooncake_negative_length_names_field_and_value() {
        let message = read_error(
            "negative.jsonl",
            TraceFormat::Mooncake,
            "{\"timestamp\": 0, \"input_length\": -3, \"output_length\": 1, \"hash_ids\": []}\n",
        );
        assert!(
            message.ends_with("negative.jsonl:1: field `input_length`: expected a non-negative integer, found -3"),
            "{message}"
        );
    }

    #[test]
    fn mooncake_fractional_length_is_rejected() {
        let message = read_error(
            "fraction.jsonl",
            TraceFormat::Mooncake,
            "{\"timestamp\": 0, \"input_length\": 3, \"output_length\": 2.5, \"hash_ids\": [1]}\n",
        );
        assert!(message.contains(":1: field `output_length`") && message.contains("found 2.5"), "{message}");
    }

    #[test]
    fn mooncake_missing_field_names_it() {
        let message = read_error(
            "missing.jsonl",
            TraceFormat::Mooncake,
            "{\"timestamp\": 0, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [1]}\n\
             {\"timestamp\": 5, \"input_length\": 3, \"hash_ids\": [1]}\n",
        );
        assert!(message.contains("missing.jsonl:2: field `output_length` is missing"), "{message}");
    }

    #[test]
    fn mooncake_non_numeric_timestamp_is_rejected() {
        let message = read_error(
            "timestamp.jsonl",
            TraceFormat::Mooncake,
            "{\"timestamp\": \"soon\", \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [1]}\n",
        );
        assert!(message.contains(":1: field `timestamp`") && message.contains("\"soon\""), "{message}");
    }

    #[test]
    fn mooncake_hash_ids_shorter_than_input_blocks_are_rejected() {
        let message = read_error(
            "short_hashes.jsonl",
            TraceFormat::Mooncake,
            "{\"timestamp\": 0, \"input_length\": 1025, \"output_length\": 1, \"hash_ids\": [1, 2]}\n",
        );
        assert!(
            message.contains("short_hashes.jsonl:1: field `hash_ids`") && message.ends_with("found 2"),
            "{message}"
        );
    }

    #[test]
    fn mooncake_negative_hash_id_names_its_position() {
        let message = read_error(
            "negative_hash.jsonl",
            TraceFormat::Mooncake,
            "{\"timestamp\": 0, \"input_length\": 1025, \"output_length\": 1, \"hash_ids\": [1, -2, 3]}\n",
        );
        assert!(message.contains(":1: field `hash_ids[1]`"), "{message}");
    }

    #[test]
    fn mooncake_record_stamped_before_the_first_is_rejected() {
        let message = read_error(
            "unsorted.jsonl",
            TraceFormat::Mooncake,
            "{\"timestamp\": 1000, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n\
             {\"timestamp\": 2000.5, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n\
             {\"timestamp\": 999, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n",
        );
        assert!(message.contains("unsorted.jsonl:3: field `timestamp`"), "{message}");
    }

    #[test]
    fn mooncake_keeps_trace_order_and_skips_empty_lines() {
        let file = ScratchFile::new(
            "order.jsonl",
            "{\"timestamp\": 1000, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n\n   \n\
             {\"timestamp\": 3000.5, \"input_length\": 2, \"output_length\": 1, \"hash_ids\": [1], \"extra\": true}\n\
             {\"timestamp\": 2000, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [1]}\n",
        );
        let records = read_trace(&file.0, TraceFormat::Mooncake).unwrap();
        let summary: Vec<(usize, f64, usize)> =
            records.iter().map(|record| (record.line, record.arrival_ms, record.input_len)).collect();
        assert_eq!(summary, [(1, 0.0, 1), (4, 2000.5, 2), (5, 1000.0, 3)]);
    }

    #[test]
    fn empty_trace_is_rejected() {
        let message = read_error("empty.jsonl", TraceFormat::Mooncake, "\n\n");
        assert!(message.contains("no records"), "{message}");
        let message = read_error("empty.csv", TraceFormat::Azure, "TIMESTAMP,ContextTokens,GeneratedTokens\n");
        assert!(message.contains("no records"), "{message}");
    }

    #[test]
    fn missing_file_is_an_io_error_naming_it() {
        let error = read_trace(Path::new("/nonexistent/kvflow/trace.jsonl"), TraceFormat::Mooncake).unwrap_err();
        assert!(matches!(error, TraceError::Io { .. }));
        assert!(error.to_string().contains("/nonexistent/kvflow/trace.jsonl"));
    }

    #[test]
    fn azure_bad_timestamp_names_file_and_line() {
        let message = read_error(
            "bad_time.csv",
            TraceFormat::Azure,
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-02-29 18:15:50.99,396,109\n",
        );
        assert!(message.contains("bad_time.csv:3: field `TIMESTAMP`") && message.contains("2023-02-29"), "{message}");
    }

    #[test]
    fn azure_negative_length_names_file_line_and_column() {
        let message = read_error(
            "negative.csv",
            TraceFormat::Azure,
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,-3,44\n",
        );
        assert!(
            message.ends_with("negative.csv:2: field `ContextTokens`: expected a non-negative integer, found `-3`"),
            "{message}"
        );
    }

    #[test]
    fn azure_timestamps_cross_day_month_and_year_boundaries() {
        let file = ScratchFile::new(
            "boundaries.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n\
             2023-12-31 23:59:59.5,1,1\n\
             \n\
             2024-01-01 00:00:00.25,2,1\n\
             2024-02-29 00:00:00,3,1\n\
             2024-03-01T00:00:00.000000000001,4,1\n",
        );
        let records = read_trace(&file.0, TraceFormat::Azure).unwrap();
        let lines: Vec<usize> = records.iter().map(|record| record.line).collect();
        assert_eq!(lines, [2, 4, 5, 6]);
        assert_eq!(records[1].arrival_ms, 750.0);
        // 2024-01-01 to 2024-02-29 is 59 days; 2024 is a leap year so 2024-03-01 follows a day later.
        assert_eq!(records[2].arrival_ms, 500.0 + 59.0 * 86_400_000.0);
        assert_eq!(records[3].arrival_ms, 500.0 + 60.0 * 86_400_000.0);
    }

    #[test]
    fn civil_timestamps_parse_to_unix_time_and_reject_impossible_dates() {
        assert_eq!(parse_civil_timestamp_nanos("1970-01-01 00:00:00"), Some(0));
        assert_eq!(
            parse_civil_timestamp_nanos("2023-11-16 18:17:03.9799600"),
            Some(1_700_158_623 * NANOS_PER_SECOND + 979_960_000)
        );
        assert_eq!(parse_civil_timestamp_nanos("1969-12-31 23:59:59.9"), Some(-100_000_000));
        assert_eq!(parse_civil_timestamp_nanos("2000-02-29 00:00:00").map(|n| n / NANOS_PER_SECOND), Some(951_782_400));
        for bad in [
            "1900-02-29 00:00:00",
            "2023-13-01 00:00:00",
            "2023-04-31 00:00:00",
            "2023-11-16 24:00:00",
            "2023-11-16 18:60:00",
            "2023-11-16 18:17:03.",
            "2023-11-16 18:17:03.12a",
            "2023-11-16",
            "2023-11-16 18:17",
            "16/11/2023 18:17:03",
            "",
        ] {
            assert_eq!(parse_civil_timestamp_nanos(bad), None, "{bad:?}");
        }
        for days in [-800_000, -1, 0, 19_677, 2_932_896] {
            let (year, month, day) = civil_from_days(days);
            assert_eq!(days_from_civil(year, month, day), days);
        }
        let nanos = parse_civil_timestamp_nanos("2023-11-16 18:17:03.9799600").unwrap();
        assert_eq!(format_civil_timestamp_nanos(nanos), "2023-11-16 18:17:03.979960000");
    }

    #[test]
    fn vidur_columns_are_found_by_header_name() {
        let file = ScratchFile::new(
            "vidur_extra.csv",
            "request_id,num_decode_tokens,arrived_at,other,num_prefill_tokens\n0,44,10.5,x,374\n1,109,10.75,y,396.0\n",
        );
        let records = read_trace(&file.0, TraceFormat::Vidur).unwrap();
        let summary: Vec<(usize, f64, usize, usize)> = records
            .iter()
            .map(|record| (record.line, record.arrival_ms, record.input_len, record.output_len))
            .collect();
        assert_eq!(summary, [(2, 0.0, 374, 44), (3, 250.0, 396, 109)]);
    }

    #[test]
    fn vidur_missing_column_is_named() {
        let message = read_error("vidur_missing.csv", TraceFormat::Vidur, "arrived_at,num_prefill_tokens\n0.0,374\n");
        assert!(message.contains("vidur_missing.csv:1: header has no column `num_decode_tokens`"), "{message}");
    }

    #[test]
    fn vidur_short_row_names_the_missing_field() {
        let message = read_error(
            "vidur_short.csv",
            TraceFormat::Vidur,
            "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,374,44\n1.0,396\n",
        );
        assert!(message.contains("vidur_short.csv:3: field `num_decode_tokens` is missing"), "{message}");
    }

    #[test]
    fn vidur_non_numeric_arrival_is_rejected() {
        let message = read_error(
            "vidur_nan.csv",
            TraceFormat::Vidur,
            "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,374,44\nNaN,396,1\n",
        );
        assert!(message.contains("vidur_nan.csv:3: field `arrived_at`: expected a number of seconds"), "{message}");
    }

    #[test]
    fn trace_format_parses_case_insensitively_and_lists_choices_on_error() {
        assert_eq!("mooncake".parse::<TraceFormat>().unwrap(), TraceFormat::Mooncake);
        assert_eq!(" Azure ".parse::<TraceFormat>().unwrap(), TraceFormat::Azure);
        assert_eq!("VIDUR".parse::<TraceFormat>().unwrap(), TraceFormat::Vidur);
        let error = "sharegpt".parse::<TraceFormat>().unwrap_err().to_string();
        assert_eq!(error, "unknown trace format `sharegpt`: expected one of mooncake, azure, vidur");
        for format in TraceFormat::ALL {
            assert_eq!(format.to_string().parse::<TraceFormat>().unwrap(), format);
            assert_eq!(serde_json::to_string(&format).unwrap(), format!("\"{format}\""));
        }
    }

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // Reference: the splitmix64 generator seeded with 0 yields these first outputs.
        let mut state = 0u64;
        let mut next = || {
            let output = splitmix64(state);
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            output
        };
        assert_eq!(next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(next(), 0x6E78_9E6A_A1B9_65F4);
    }
}
