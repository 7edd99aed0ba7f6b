//! Scaling and token synthesis: [`synthesize`] turns [`TraceRecord`]s into replayable
//! [`Request`]s, scaling lengths to `block_tokens` per 512-token trace block and filling prompts
//! with deterministic pseudo-random tokens ([`synthetic_token`], built on [`splitmix64`]) so that
//! equal Mooncake hash ids give equal blocks.

use super::record::{TraceError, TraceRecord, TRACE_BLOCK_TOKENS};
use kvflow_kernels::cpu::sampling::{RequestSampling, SamplingParams};

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
    /// Its trace line's sampling, over the graph's `[sampling]`.
    pub sampling: Option<SamplingParams>,
}

impl Request {
    /// How it picks its tokens: its trace line's sampling, or else the graph's `default`, keyed
    /// on the graph's seed.
    pub fn sampling(&self, default: RequestSampling) -> RequestSampling {
        RequestSampling { params: self.sampling.unwrap_or(default.params), seed: default.seed }
    }
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
            sampling: record.sampling,
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
    use crate::trace::test_support::repo_trace;
    use crate::trace::{read_trace, TraceFormat};

    fn options(block_tokens: usize) -> SynthOptions {
        SynthOptions { block_tokens, seed: 7, vocab_size: 32_000, max_output_tokens: None }
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
            sampling: None,
        };
        let requests = synthesize(&[record(1, vec![5, 9]), record(2, vec![9, 5])], &options(8)).unwrap();
        assert_eq!(requests[0].prompt[..8], requests[1].prompt[8..]);
        assert_eq!(requests[0].prompt[8..], requests[1].prompt[..8]);
        assert_ne!(requests[0].prompt[..8], requests[0].prompt[8..]);
    }

    #[test]
    fn last_hash_block_is_cut_at_the_scaled_prompt_length() {
        // 600 tokens at N = 16: ceil(600·16/512) = 19 tokens, one full block and 3 tokens of the next.
        let record = TraceRecord {
            line: 1,
            arrival_ms: 0.0,
            input_len: 600,
            output_len: 1,
            hash_ids: Some(vec![1, 2]),
            sampling: None,
        };
        let request = &synthesize(&[record], &options(16)).unwrap()[0];
        assert_eq!(request.prompt.len(), 19);
        let block_two_start: Vec<u32> =
            (0..3).map(|j| synthetic_token(7, TokenStream::HashBlock, 2, j, 32_000)).collect();
        assert_eq!(request.prompt[16..], block_two_start[..]);
    }

    #[test]
    fn requests_without_hash_ids_get_distinct_deterministic_tokens() {
        let record = |line| TraceRecord {
            line,
            arrival_ms: 0.0,
            input_len: 512,
            output_len: 512,
            hash_ids: None,
            sampling: None,
        };
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
        let record =
            TraceRecord { line: 1, arrival_ms: 0.0, input_len: 4096, output_len: 1, hash_ids: None, sampling: None };
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
        let record = |output_len| TraceRecord {
            line: 1,
            arrival_ms: 0.0,
            input_len: 0,
            output_len,
            hash_ids: None,
            sampling: None,
        };
        let capped = SynthOptions { max_output_tokens: Some(20), ..options(16) };
        let requests = synthesize(&[record(0), record(512), record(5120)], &capped).unwrap();
        let outputs: Vec<usize> = requests.iter().map(|request| request.max_output_tokens).collect();
        assert_eq!(outputs, [1, 16, 20]);
        assert_eq!(requests[0].prompt.len(), 1, "an empty recorded prompt still gets one token");
    }

    #[test]
    fn invalid_synthesis_options_are_rejected() {
        let records =
            [TraceRecord { line: 1, arrival_ms: 0.0, input_len: 5, output_len: 5, hash_ids: None, sampling: None }];
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
        let record = TraceRecord {
            line: 4,
            arrival_ms: 0.0,
            input_len: 1500,
            output_len: 5,
            hash_ids: Some(vec![1, 2]),
            sampling: None,
        };
        let error = synthesize(&[record], &options(16)).unwrap_err();
        let message = error.to_string();
        assert!(matches!(error, TraceError::NotEnoughHashIds { line: 4, needed: 3, available: 2, .. }), "{message}");
        assert!(message.contains("line 4") && message.contains("hash_ids"), "{message}");
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
