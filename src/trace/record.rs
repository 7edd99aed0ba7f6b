//! What reading a trace yields, whatever its format: the records (`TraceRecord`), the errors
//! (`TraceError`), and the steps every format's reader shares — arrivals made relative to the
//! first record, counts checked, long values cut in messages. The format readers (`mooncake`,
//! `csv`) build on this; `read_trace` (the module's root) picks one.

use std::path::{Path, PathBuf};

/// Tokens in one block of the recorded traces (Mooncake hash ids name 512-token blocks).
pub const TRACE_BLOCK_TOKENS: usize = 512;

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
    /// Mooncake only: the line's `"sampling"` object (`temperature`, `top_k`, `top_p`), which
    /// overrides the graph's `[sampling]` for this request.
    pub sampling: Option<kvflow_kernels::cpu::sampling::SamplingParams>,
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
    /// [`SynthOptions`](super::SynthOptions) out of range.
    #[error("invalid synthesis options: {0}")]
    InvalidOptions(String),
    /// A Mooncake record has fewer hash ids than its scaled prompt has blocks.
    #[error(
        "line {line}: field `hash_ids`: a prompt of {scaled_tokens} scaled tokens at block_tokens \
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

/// The longest prompt or output a trace line may ask for, in tokens: no model's context is
/// longer, and synthesising a prompt allocates it.
pub const MAX_TRACE_TOKENS: usize = 1 << 24;

pub(super) const EXPECTED_COUNT: &str = "a non-negative integer of at most 16777216 tokens";

/// A record before its arrival is made relative: the absolute stamp is format-specific.
pub(super) struct StampedRecord<Stamp> {
    pub(super) line: usize,
    pub(super) stamp: Stamp,
    pub(super) input_len: usize,
    pub(super) output_len: usize,
    pub(super) hash_ids: Option<Vec<u64>>,
    pub(super) sampling: Option<kvflow_kernels::cpu::sampling::SamplingParams>,
}

/// Makes arrivals relative to the first record, rejecting records stamped before it.
pub(super) fn relative_to_first<Stamp: Copy>(
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
                sampling: record.sampling,
            })
        })
        .collect()
}

/// A float holding a non-negative integer exactly representable (≤ 2^53), as a `usize`.
pub(super) fn integral_f64_count(number: f64) -> Option<usize> {
    const LARGEST_EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    if number.is_finite() && number >= 0.0 && number.fract() == 0.0 && number <= LARGEST_EXACT {
        usize::try_from(number as u64).ok()
    } else {
        None
    }
}

/// Long values are cut in error messages so one bad line does not flood the terminal.
pub(super) fn truncated(text: &str) -> String {
    const LIMIT: usize = 80;
    match text.char_indices().nth(LIMIT) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}
