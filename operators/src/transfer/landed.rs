//! A handoff's KV, or a streamed piece of it, in a cuda consumer's device memory, as its tcp
//! receiver landed it (`tcp/landing.rs`); the import unpacks it at its blocks.

/// KV landed in a cuda consumer's device memory (equal only to itself).
#[derive(Clone, Debug)]
pub struct Landed(pub std::sync::Arc<kvflow_kernels::cuda::LandedKv>);

impl PartialEq for Landed {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}
