//! CRC32C (Castagnoli), the checksum every transfer and every stored offload object carries. It
//! is updated while bytes are sent and while they are received — never in a second pass over
//! them. On x86-64 with AVX-512 and VPCLMULQDQ it folds 256 bytes at a time by carry-less
//! multiplication (about 3× the `crc32` instruction, which tops out at 8 bytes a cycle); with
//! SSE4.2 alone it uses the `crc32` instruction on three interleaved lanes; elsewhere a table,
//! one byte at a time.

/// A running CRC32C.
#[derive(Clone, Copy, Debug)]
pub struct Crc32c {
    state: u32,
}

impl Default for Crc32c {
    fn default() -> Self {
        Crc32c { state: !0 }
    }
}

const POLY: u32 = 0x82F6_3B78; // reflected Castagnoli polynomial

const TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

impl Crc32c {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        #[cfg(target_arch = "x86_64")]
        {
            if bytes.len() >= FOLD_MIN && has_vpclmulqdq() {
                // SAFETY: the CPU has AVX-512F, VPCLMULQDQ, PCLMULQDQ and SSE4.2 (checked).
                self.state = unsafe { update_folding(self.state, bytes) };
                return;
            }
            if std::arch::is_x86_feature_detected!("sse4.2") {
                // SAFETY: the CPU supports SSE4.2 (checked just above).
                self.state = unsafe { update_sse42(self.state, bytes) };
                return;
            }
        }
        self.state = update_table(self.state, bytes);
    }

    /// The checksum of everything added so far.
    pub fn value(&self) -> u32 {
        !self.state
    }

    /// The checksum of `bytes` alone.
    pub fn of(bytes: &[u8]) -> u32 {
        let mut c = Crc32c::new();
        c.update(bytes);
        c.value()
    }
}

fn update_table(mut state: u32, bytes: &[u8]) -> u32 {
    for &b in bytes {
        state = TABLE[((state ^ b as u32) & 0xFF) as usize] ^ (state >> 8);
    }
    state
}

/// Bytes per lane of the three-lane loop: a block of `3 × LANE` bytes runs as three independent
/// chains of `crc32` instructions (one alone waits on its own latency), joined by shifting.
const LANE: usize = 8192;

/// A linear map on CRC states: the image of each of the 32 basis bits.
type Shift = [u32; 32];

fn apply(op: &Shift, v: u32) -> u32 {
    let mut out = 0;
    let mut bits = v;
    while bits != 0 {
        out ^= op[bits.trailing_zeros() as usize];
        bits &= bits - 1;
    }
    out
}

/// `a` after `b`.
fn compose(a: &Shift, b: &Shift) -> Shift {
    std::array::from_fn(|i| apply(a, b[i]))
}

/// The state after `n` zero bytes, as a map (by squaring the one-byte map).
fn shift_by(mut n: usize) -> Shift {
    let mut byte: Shift = std::array::from_fn(|i| update_table(1 << i, &[0]));
    let mut out: Shift = std::array::from_fn(|i| 1 << i);
    while n > 0 {
        if n & 1 == 1 {
            out = compose(&byte, &out);
        }
        byte = compose(&byte, &byte);
        n >>= 1;
    }
    out
}

/// The maps for one and two lanes.
fn lane_shifts() -> &'static (Shift, Shift) {
    static SHIFTS: std::sync::OnceLock<(Shift, Shift)> = std::sync::OnceLock::new();
    SHIFTS.get_or_init(|| (shift_by(LANE), shift_by(2 * LANE)))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn update_sse42(state: u32, bytes: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let word = |c: &[u8], i: usize| u64::from_le_bytes(c[i..i + 8].try_into().expect("8 bytes"));
    let mut s = state;
    let mut blocks = bytes.chunks_exact(3 * LANE);
    if bytes.len() >= 3 * LANE {
        let (one, two) = lane_shifts();
        for block in &mut blocks {
            let (mut a, mut b, mut c) = (s as u64, 0u64, 0u64);
            let mut i = 0;
            while i < LANE {
                a = _mm_crc32_u64(a, word(block, i));
                b = _mm_crc32_u64(b, word(block, LANE + i));
                c = _mm_crc32_u64(c, word(block, 2 * LANE + i));
                i += 8;
            }
            s = apply(two, a as u32) ^ apply(one, b as u32) ^ c as u32;
        }
    }
    let rest = blocks.remainder();
    let mut chunks = rest.chunks_exact(8);
    let mut w = s as u64;
    for c in &mut chunks {
        w = _mm_crc32_u64(w, word(c, 0));
    }
    let mut s = w as u32;
    for &b in chunks.remainder() {
        s = _mm_crc32_u8(s, b);
    }
    s
}

/// Bytes below which folding does not pay (its set-up and final reduction).
#[cfg(target_arch = "x86_64")]
const FOLD_MIN: usize = 256;

#[cfg(target_arch = "x86_64")]
fn has_vpclmulqdq() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx512f") && has!("vpclmulqdq") && has!("pclmulqdq") && has!("sse4.2")
}

/// x^n mod P, with P the Castagnoli polynomial in its plain (not reflected) form.
#[cfg(target_arch = "x86_64")]
const fn x_pow_mod(n: u32) -> u32 {
    let mut r: u64 = 1;
    let mut i = 0;
    while i < n {
        r <<= 1;
        if r & (1 << 32) != 0 {
            r ^= 0x1_1EDC_6F41;
        }
        i += 1;
    }
    r as u32
}

/// The two constants that fold a 128-bit chunk onto the chunk `bits` later, in the reflected
/// domain: a register's low half holds the chunk's high-degree half, whose image is
/// (that half)·x^(bits+64) ≡ (that half)·(x^(bits+32) mod P)·x^32, and a carry-less product of
/// reflected operands supplies the ·x^32 when the constant is reflected in 33 bits.
#[cfg(target_arch = "x86_64")]
const fn fold_pair(bits: u32) -> [i64; 2] {
    [
        ((x_pow_mod(bits + 32).reverse_bits() as u64) << 1) as i64,
        ((x_pow_mod(bits - 32).reverse_bits() as u64) << 1) as i64,
    ]
}

#[cfg(target_arch = "x86_64")]
const FOLD_2048: [i64; 2] = fold_pair(2048);
#[cfg(target_arch = "x86_64")]
const FOLD_512: [i64; 2] = fold_pair(512);
#[cfg(target_arch = "x86_64")]
const FOLD_384: [i64; 2] = fold_pair(384);
#[cfg(target_arch = "x86_64")]
const FOLD_256: [i64; 2] = fold_pair(256);
#[cfg(target_arch = "x86_64")]
const FOLD_128: [i64; 2] = fold_pair(128);

/// Four 512-bit accumulators (four 128-bit chunks each) fold 256 bytes a step onto the next
/// 256; then they fold into one, its four chunks into one, and that chunk's 128 bits go through
/// the `crc32` instruction from a zero state (which reduces them mod P), leaving the tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
unsafe fn update_folding(state: u32, bytes: &[u8]) -> u32 {
    use std::arch::x86_64::*;
    debug_assert!(bytes.len() >= FOLD_MIN);
    let wide = |[lo, hi]: [i64; 2]| _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo);
    let narrow = |[lo, hi]: [i64; 2]| _mm_set_epi64x(hi, lo);
    let (k2048, k512) = (wide(FOLD_2048), wide(FOLD_512));
    let load = |i: usize| {
        debug_assert!(i + 64 <= bytes.len());
        // SAFETY: every call below reads 64 bytes inside `bytes` (unaligned loads).
        unsafe { _mm512_loadu_si512(bytes.as_ptr().add(i).cast()) }
    };
    let fold = |x: __m512i, k: __m512i, next: __m512i| {
        let (lo, hi) = (_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11));
        _mm512_ternarylogic_epi64(lo, hi, next, 0x96) // lo ^ hi ^ next
    };
    // The running state enters as the message's first 32 bits, xored in.
    let mut a0 = _mm512_xor_si512(load(0), _mm512_zextsi128_si512(_mm_cvtsi32_si128(state as i32)));
    let (mut a1, mut a2, mut a3) = (load(64), load(128), load(192));
    let mut i = 256;
    while i + 256 <= bytes.len() {
        a0 = fold(a0, k2048, load(i));
        a1 = fold(a1, k2048, load(i + 64));
        a2 = fold(a2, k2048, load(i + 128));
        a3 = fold(a3, k2048, load(i + 192));
        i += 256;
    }
    a3 = fold(fold(fold(a0, k512, a1), k512, a2), k512, a3);
    while i + 64 <= bytes.len() {
        a3 = fold(a3, k512, load(i));
        i += 64;
    }
    let fold_chunk = |v: __m128i, k: [i64; 2]| {
        let k = narrow(k);
        _mm_xor_si128(_mm_clmulepi64_si128(v, k, 0x00), _mm_clmulepi64_si128(v, k, 0x11))
    };
    let last = _mm_xor_si128(
        _mm_xor_si128(_mm512_extracti32x4_epi32(a3, 3), fold_chunk(_mm512_extracti32x4_epi32(a3, 0), FOLD_384)),
        _mm_xor_si128(
            fold_chunk(_mm512_extracti32x4_epi32(a3, 1), FOLD_256),
            fold_chunk(_mm512_extracti32x4_epi32(a3, 2), FOLD_128),
        ),
    );
    let (lo, hi) = (_mm_cvtsi128_si64(last) as u64, _mm_extract_epi64(last, 1) as u64);
    let reduced = _mm_crc32_u64(_mm_crc32_u64(0, lo), hi) as u32;
    update_sse42(reduced, &bytes[i..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_and_both_paths_agree() {
        // The CRC32C check value (RFC 3720): "123456789" → 0xE3069283.
        assert_eq!(Crc32c::of(b"123456789"), 0xE306_9283);
        assert_eq!(Crc32c::of(b""), 0);
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        assert_eq!(!update_table(!0, &data), Crc32c::of(&data));
        let mut split = Crc32c::new();
        split.update(&data[..333]);
        split.update(&data[333..]);
        assert_eq!(split.value(), Crc32c::of(&data), "streaming gives the same value");
        // Long enough for the three-lane loop, at lengths around its block size.
        let long: Vec<u8> = (0..200_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [3 * LANE - 1, 3 * LANE, 3 * LANE + 5, 6 * LANE + 17, long.len()] {
            assert_eq!(Crc32c::of(&long[..len]), !update_table(!0, &long[..len]), "length {len}");
        }
        // Each hardware path on its own, where this CPU has it, at lengths around the folding
        // loop's steps (256 and 64 bytes) and from a running state.
        #[cfg(target_arch = "x86_64")]
        for len in [256, 257, 319, 320, 511, 512, 1000, 4109, 100_000, long.len()] {
            let want = update_table(0x1234_5678, &long[..len]);
            if std::arch::is_x86_feature_detected!("sse4.2") {
                assert_eq!(unsafe { update_sse42(0x1234_5678, &long[..len]) }, want, "crc32 instruction, length {len}");
            }
            if has_vpclmulqdq() {
                assert_eq!(unsafe { update_folding(0x1234_5678, &long[..len]) }, want, "folding, length {len}");
            }
        }
    }
}
