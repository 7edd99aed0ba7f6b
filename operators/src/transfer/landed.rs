//! A handoff's KV, or a streamed piece of it, in a cuda consumer's device memory, as its tcp
//! receiver landed it (`tcp/landing.rs`); the import unpacks it at its blocks.

/// KV landed in a cuda consumer's device memory (equal only to itself).
#[derive(Clone, Debug)]
pub struct Landed(pub std::sync::Arc<kvflow_kernels::cuda::LandedKv>);

impl Landed {
    /// A copy on the host (a consumer that cannot unpack it on its device; waits), empty when
    /// the device fails to give it back (the import then refuses it by its size).
    pub fn read_back(&self, request: u64) -> Vec<f32> {
        self.0.read().unwrap_or_else(|e| {
            tracing::error!(request, "reading landed KV back from the GPU: {e}");
            Vec::new()
        })
    }
}

impl PartialEq for Landed {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}
