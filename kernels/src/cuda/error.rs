//! What can go wrong bringing up or driving a GPU: one error type for the device, its CPU emulation
//! and every launch.

/// What can go wrong bringing up or driving a GPU.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "no CUDA driver: the library libcuda.so could not be loaded (is there an NVIDIA GPU and driver on this \
         machine? is LD_LIBRARY_PATH right?)"
    )]
    NoDriver,
    #[error(
        "no NVRTC: the library libnvrtc.so (CUDA 13) could not be loaded, and the kernels are compiled at run time"
    )]
    NoNvrtc,
    #[error("no GPU {asked}: this machine has {visible} visible (CUDA_VISIBLE_DEVICES)")]
    NoSuchGpu { asked: usize, visible: usize },
    #[error("GPU {gpu}: {what}: {message}")]
    Driver { gpu: usize, what: String, message: String },
    #[error("NVRTC could not compile kernels/cuda/{file} for {arch}: {log}")]
    Compile { file: String, arch: String, log: String },
    #[error("{0}")]
    Unsupported(String),
}
