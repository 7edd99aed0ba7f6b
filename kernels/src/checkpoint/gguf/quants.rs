//! The ggml tensor types kvflow reads, dequantized to f32 at load: F32, F16, BF16, and the block
//! quantizations Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 elements a block) and Q4_K, Q6_K (256), as
//! ggml defines their layouts. A block's scale `d` (and `m`, its minimum) is an f16; its
//! quants are packed nibbles (and high bits) or bytes.

use half::f16;

/// A ggml tensor type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q6K,
}

impl GgmlType {
    /// The types read, for errors.
    pub const NAMES: &'static str = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K";

    /// The type of ggml's id `id`.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Bf16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    /// Elements per block.
    pub fn block_elements(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => 32,
            GgmlType::Q4K | GgmlType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4K => 144,
            GgmlType::Q6K => 210,
        }
    }

    /// The bytes a tensor of `dims` takes: `None` when its rows do not split into whole blocks
    /// (ggml blocks run along `dims[0]`) or the size overflows.
    pub fn bytes_for(self, dims: &[usize]) -> Option<usize> {
        let row = *dims.first()?;
        if !row.is_multiple_of(self.block_elements()) {
            return None;
        }
        let rows = dims[1..].iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
        (row / self.block_elements()).checked_mul(self.block_bytes())?.checked_mul(rows)
    }

    /// The f32 values of `bytes`, a whole number of blocks of this type.
    pub fn dequantize(self, bytes: &[u8]) -> Vec<f32> {
        let blocks = bytes.chunks_exact(self.block_bytes());
        let mut out = Vec::with_capacity(blocks.len() * self.block_elements());
        for b in blocks {
            match self {
                GgmlType::F32 => out.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                GgmlType::F16 => out.push(half_at(b, 0)),
                GgmlType::Bf16 => out.push(half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
                GgmlType::Q4_0 => q4(half_at(b, 0), 0.0, -8.0, &b[2..18], &mut out),
                GgmlType::Q4_1 => q4(half_at(b, 0), half_at(b, 2), 0.0, &b[4..20], &mut out),
                GgmlType::Q5_0 => q5(half_at(b, 0), 0.0, -16.0, &b[2..6], &b[6..22], &mut out),
                GgmlType::Q5_1 => q5(half_at(b, 0), half_at(b, 2), 0.0, &b[4..8], &b[8..24], &mut out),
                GgmlType::Q8_0 => {
                    let d = half_at(b, 0);
                    out.extend(b[2..34].iter().map(|&q| f32::from(q as i8) * d));
                }
                GgmlType::Q4K => q4_k(b, &mut out),
                GgmlType::Q6K => q6_k(b, &mut out),
            }
        }
        out
    }
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// 32 four-bit quants: element `j` in the low nibble of byte `j`, element `j + 16` in its high
/// nibble; value `(q + offset) × d + m`.
fn q4(d: f32, m: f32, offset: f32, qs: &[u8], out: &mut Vec<f32>) {
    out.extend(qs.iter().map(|&q| (f32::from(q & 0x0f) + offset) * d + m));
    out.extend(qs.iter().map(|&q| (f32::from(q >> 4) + offset) * d + m));
}

/// [`q4`] with a fifth bit per element from the 32-bit `qh` (bit `j` for element `j`).
fn q5(d: f32, m: f32, offset: f32, qh: &[u8], qs: &[u8], out: &mut Vec<f32>) {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let high = |j: usize| ((qh >> j) & 1) as u8 * 16;
    out.extend(qs.iter().enumerate().map(|(j, &q)| (f32::from((q & 0x0f) | high(j)) + offset) * d + m));
    out.extend(qs.iter().enumerate().map(|(j, &q)| (f32::from((q >> 4) | high(j + 16)) + offset) * d + m));
}

/// Q4_K's six-bit scale and minimum of sub-block `j` (of 8), packed in 12 bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    };
    (f32::from(sc), f32::from(m))
}

/// A Q4_K super-block: `d`, `dmin`, 12 bytes of scales, 128 bytes of nibbles; 256 values in 4
/// runs of 64, each two sub-blocks of 32 (low nibbles, then high nibbles of the same 32 bytes).
fn q4_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let scales = &b[4..16];
    for (run, qs) in b[16..144].chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * run, scales);
        let (sc2, m2) = scale_min_k4(2 * run + 1, scales);
        out.extend(qs.iter().map(|&q| d * sc1 * f32::from(q & 0x0f) - dmin * m1));
        out.extend(qs.iter().map(|&q| d * sc2 * f32::from(q >> 4) - dmin * m2));
    }
}

/// A Q6_K super-block: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales and `d`;
/// 256 values in 2 halves of 128, each four runs of 32.
fn q6_k(b: &[u8], out: &mut Vec<f32>) {
    let d = half_at(b, 208);
    let mut values = [0f32; 256];
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut values[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q = |low: u8, shift: u32| f32::from(((low | (((qh[l] >> shift) & 3) << 4)) as i8) - 32);
            y[l] = d * f32::from(sc[is] as i8) * q(ql[l] & 0x0f, 0);
            y[l + 32] = d * f32::from(sc[is + 2] as i8) * q(ql[l + 32] & 0x0f, 2);
            y[l + 64] = d * f32::from(sc[is + 4] as i8) * q(ql[l] >> 4, 4);
            y[l + 96] = d * f32::from(sc[is + 6] as i8) * q(ql[l + 32] >> 4, 6);
        }
    }
    out.extend_from_slice(&values);
}
