//! CRC32C (Castagnoli), the checksum every transfer carries. It is updated while bytes are sent
//! and while they are received — never in a second pass over them. On x86-64 with SSE4.2 it uses
//! the `crc32` instruction (8 bytes at a time); elsewhere a table, one byte at a time.

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
    }
}
