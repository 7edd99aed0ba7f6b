//! Request traces: reading them and turning them into replayable requests (docs/design.md §11).
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

mod calendar;
mod csv;
mod mooncake;
mod record;
mod synth;
#[cfg(test)]
mod test_support;

use std::fmt;
use std::path::Path;
use std::str::FromStr;

pub use record::{TraceError, TraceRecord, MAX_TRACE_TOKENS, TRACE_BLOCK_TOKENS};
pub use synth::{scaled_len, splitmix64, synthesize, synthetic_token, Request, SynthOptions, TokenStream};

use self::csv::{read_azure, read_vidur};
use mooncake::read_mooncake;

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

#[cfg(test)]
mod tests {
    use super::test_support::{read_error, repo_trace};
    use super::*;

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
}
