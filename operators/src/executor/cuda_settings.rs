//! What a `cuda` pool's `[pool.executor_settings]` say (the keys are listed in `cuda.rs`'s
//! header), and the GPU each rank of the pool opens.

use super::settings::{SettingError, Settings};
use kvflow_kernels::cuda::{visible_gpus, CudaError, Dtype, Gpu};
use std::sync::Arc;

const KEYS: &[&str] = &["gpus", "deferred_output", "emulate", "dtype", "cuda_graphs"];

/// What a `cuda` pool's settings say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaSettings {
    pub gpus: Option<Vec<usize>>,
    pub deferred_output: bool,
    /// Run the kernels on the CPU (checks without a GPU; slow).
    pub emulate: bool,
    /// How the products' weights sit on the GPU.
    pub dtype: Dtype,
    /// Replay a step shape's captured launches (kvflow_kernels::cuda::graph) for steps without
    /// handoffs.
    pub cuda_graphs: bool,
    /// Test only (no graph key sets it): a token in flight is fed from the ring slot of the
    /// sequence's sample before the one it names — deferred output without its mechanism.
    pub test_stale_ring_slot: bool,
    /// Test only: a row draws keyed on its place in the batch, not its request — seeded sampling
    /// without the key that makes it batch-invariant.
    pub test_draws_keyed_on_row: bool,
}

impl CudaSettings {
    /// A bench's settings: one GPU, the defaults a graph gets (deferred output, CUDA graphs) in
    /// `dtype`, on the CPU when `emulate`.
    pub fn on_gpu(gpu: usize, emulate: bool, dtype: Dtype) -> Self {
        CudaSettings {
            gpus: Some(vec![gpu]),
            deferred_output: true,
            emulate,
            dtype,
            cuda_graphs: true,
            test_stale_ring_slot: false,
            test_draws_keyed_on_row: false,
        }
    }

    pub fn read(table: &toml::Table) -> Result<Self, SettingError> {
        let s = Settings::new(table, KEYS)?;
        Ok(CudaSettings {
            gpus: s.counts("gpus")?,
            deferred_output: s.flag("deferred_output", true)?,
            emulate: s.flag("emulate", false)?,
            dtype: Dtype::parse(s.choice("dtype", &["float32", "bfloat16"], "float32")?).unwrap_or_default(),
            cuda_graphs: s.flag("cuda_graphs", true)?,
            test_stale_ring_slot: false,
            test_draws_keyed_on_row: false,
        })
    }

    /// The GPU rank `rank` of the pool runs on (or the CPU emulation).
    pub fn open(&self, rank: usize) -> Result<Arc<Gpu>, CudaError> {
        if self.emulate {
            return Gpu::emulated();
        }
        Gpu::open(self.gpu_of(rank)?)
    }

    /// The GPU of rank `rank` of the pool.
    pub fn gpu_of(&self, rank: usize) -> Result<usize, CudaError> {
        match &self.gpus {
            Some(list) => Ok(list[rank % list.len()]),
            None => Ok(rank % visible_gpus()?.max(1)),
        }
    }
}
