//! Mooncake JSONL traces: one JSON object per line with `timestamp` (milliseconds),
//! `input_length`, `output_length` and `hash_ids`, one id per 512-token prompt block (equal ids are
//! equal blocks), and optionally `sampling` (`{"temperature": 0.8, "top_k": 0, "top_p": 1.0}`:
//! this request's sampling, over the graph's `[sampling]`). Extra keys are ignored; every missing or ill-typed field is a [`TraceError`]
//! naming the line and the field.

use std::io::BufRead;
use std::path::Path;

use super::record::{
    integral_f64_count, relative_to_first, truncated, StampedRecord, TraceError, TraceRecord, EXPECTED_COUNT,
    TRACE_BLOCK_TOKENS,
};

pub(super) fn read_mooncake(path: &Path) -> Result<Vec<TraceRecord>, TraceError> {
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
            .ok_or_else(|| bad_field(&format!("hash_ids[{position}]"), "a non-negative integer", hash_id_value))?;
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
    const EXPECTED_SAMPLING: &str =
        "an object with temperature (0 to 100), top_k (0: all) and top_p (more than 0, at most 1)";
    let sampling = match object.get("sampling") {
        None => None,
        Some(value) => {
            let params: kvflow_kernels::cpu::sampling::SamplingParams =
                serde_json::from_value(value.clone()).map_err(|_| bad_field("sampling", EXPECTED_SAMPLING, value))?;
            if params.check().is_err() {
                return Err(bad_field("sampling", EXPECTED_SAMPLING, value));
            }
            Some(params)
        }
    };
    Ok(StampedRecord { line, stamp: timestamp, input_len, output_len, hash_ids: Some(hash_ids), sampling })
}

/// A JSON number that is a non-negative integer (`7` or `7.0`), as a `usize`.
fn json_count(value: &serde_json::Value) -> Option<usize> {
    let count = match value.as_u64() {
        Some(whole) => usize::try_from(whole).ok(),
        None => value.as_f64().and_then(integral_f64_count),
    };
    count.filter(|&n| n <= super::MAX_TRACE_TOKENS)
}

#[cfg(test)]
mod tests {
    use crate::trace::test_support::{read_error, ScratchFile};
    use crate::trace::{read_trace, TraceFormat};

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
            message.ends_with("negative.jsonl:1: field `input_length`: expected a non-negative integer of at most 16777216 tokens, found -3"),
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
}
