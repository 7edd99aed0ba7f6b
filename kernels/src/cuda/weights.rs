//! How a model's weights are held in device memory: the [`Dtype`] of the products' weights (f32, or
//! bf16 rounded by [`bf16_bits`]), one product's weights ([`DevWeight`]), and the GPU they are
//! uploaded to in that dtype (`Up`). Each part's weights and their upload are in `parts/`, the
//! model's in `model.rs`.

use super::error::CudaError;
use super::gpu::{DeviceBuf, Gpu};

/// How a model's products hold their weights on the device (the cuda executor's `dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dtype {
    #[default]
    Float32,
    /// bf16 weights (rounded to nearest even) for every product but the narrow ones (routers,
    /// low-rank projections, MLA's absorbed heads), which stay f32; inputs rounded to bf16 at each
    /// bf16 product, tensor-core products with f32 accumulation (`kernels/cuda/bf16.cu`), the
    /// paged KV cache in bf16 (`kernels/src/cuda/kv.rs`), f32 everywhere else.
    Bfloat16,
}

impl Dtype {
    /// `float32` or `bfloat16`.
    pub fn parse(s: &str) -> Option<Dtype> {
        match s {
            "float32" => Some(Dtype::Float32),
            "bfloat16" => Some(Dtype::Bfloat16),
            _ => None,
        }
    }

    /// Bytes of one value.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::Float32 => 4,
            Dtype::Bfloat16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Float32 => "float32",
            Dtype::Bfloat16 => "bfloat16",
        }
    }
}

/// The bf16 bits of `f`, rounded to nearest even (a NaN stays a NaN): `kernels/cuda/common.cuh`'s
/// bf16_bits.
pub fn bf16_bits(f: f32) -> u16 {
    let u = f.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// A product's weights on the device.
pub(crate) enum DevWeight {
    F32(DeviceBuf<f32>),
    Bf16(DeviceBuf<u16>),
}

impl DevWeight {
    pub fn ptr(&self) -> u64 {
        match self {
            DevWeight::F32(b) => b.ptr(),
            DevWeight::Bf16(b) => b.ptr(),
        }
    }

    pub fn is_bf16(&self) -> bool {
        matches!(self, DevWeight::Bf16(_))
    }
}

/// The GPU weights go to, and how the products' weights are held there.
pub(crate) struct Up<'a> {
    pub(crate) gpu: &'a Gpu,
    pub(crate) dtype: Dtype,
}

impl std::ops::Deref for Up<'_> {
    type Target = Gpu;
    fn deref(&self) -> &Gpu {
        self.gpu
    }
}

impl Up<'_> {
    /// `rows` (a product's weights) as the dtype says; `narrow` products always in f32.
    pub(crate) fn weight(&self, rows: &[f32], narrow: bool) -> Result<DevWeight, CudaError> {
        if self.dtype == Dtype::Bfloat16 && !narrow {
            let bits: Vec<u16> = rows.iter().map(|&v| bf16_bits(v)).collect();
            return Ok(DevWeight::Bf16(self.gpu.upload(&bits)?));
        }
        Ok(DevWeight::F32(self.gpu.upload(rows)?))
    }
}
