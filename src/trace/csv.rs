//! CSV traces: Azure (`TIMESTAMP,ContextTokens,GeneratedTokens`, civil timestamps read by
//! `calendar`) and Vidur (`arrived_at` seconds, `num_prefill_tokens`, `num_decode_tokens`). Both
//! use one row reader that finds the wanted columns by header name, skips blank rows and knows the
//! 1-based line each row starts on, so every error names it.

use std::path::Path;

use super::calendar::{format_civil_timestamp_nanos, parse_civil_timestamp_nanos};
use super::record::{
    integral_f64_count, relative_to_first, truncated, StampedRecord, TraceError, TraceRecord, EXPECTED_COUNT,
};

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
        .filter(|&n| n <= super::MAX_TRACE_TOKENS)
        .ok_or_else(|| bad_csv_field(path, line, field, EXPECTED_COUNT, raw))
}

pub(super) fn read_azure(path: &Path) -> Result<Vec<TraceRecord>, TraceError> {
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
            sampling: None,
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

pub(super) fn read_vidur(path: &Path) -> Result<Vec<TraceRecord>, TraceError> {
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
            sampling: None,
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

#[cfg(test)]
mod tests {
    use crate::trace::test_support::{read_error, repo_trace, ScratchFile};
    use crate::trace::{read_trace, TraceFormat};

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
            message.ends_with("negative.csv:2: field `ContextTokens`: expected a non-negative integer of at most 16777216 tokens, found `-3`"),
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
}
