//! kvflow-kernels: the CPU reference kernels (batch-invariant), model families, checkpoint
//! loading and paged KV memory. Nothing here knows about dataflow; operators build on it.

pub mod checkpoint;
pub mod cpu;
pub mod cuda;
pub mod hash;
pub mod kv;
pub mod models;
