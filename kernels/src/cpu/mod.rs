//! The CPU reference kernels. Every kernel is batch-invariant: a row's result depends only on
//! that row's inputs (and, for attention, on the keys it reads), in a fixed reduction order.

pub mod activation;
pub mod attention;
pub mod draw;
pub mod gemm;
pub mod norm;
pub mod recurrent;
pub mod rope;
pub mod sampling;
pub mod simd;
pub mod torch_topk;
