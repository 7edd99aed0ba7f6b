//! The kernel sources `kernels/cuda/*.cu` (each compiled after `common.cuh`), the kernels each
//! defines, and their compilation to PTX by NVRTC for a compute capability (no GPU needed). The
//! device (`gpu.rs`) loads the PTX; the emulation (`emulate.rs`) compiles the same sources for the
//! CPU.

use super::error::CudaError;

/// `kernels/cuda/common.cuh`: put before each source (see there).
pub const COMMON: &str = include_str!("../../cuda/common.cuh");

/// The kernel sources, compiled at run time (the build needs no CUDA).
pub const SOURCES: &[(&str, &str)] = &[
    ("model.cu", include_str!("../../cuda/model.cu")),
    ("bf16.cu", include_str!("../../cuda/bf16.cu")),
    ("kv.cu", include_str!("../../cuda/kv.cu")),
    ("linear.cu", include_str!("../../cuda/linear.cu")),
    ("indexer.cu", include_str!("../../cuda/indexer.cu")),
    ("attention.cu", include_str!("../../cuda/attention.cu")),
];

/// Kernels that take more dynamic shared memory than a launch may without asking (48 KiB), and
/// how much: the device raises their limit when it loads them.
pub const LARGE_SHARED: &[(&str, u32)] = &[
    ("linear_bf16_wide", WIDE_SHARED),
    ("flash_attention_16", flash_shared(16)),
    ("flash_attention_32", flash_shared(32)),
    ("flash_attention_64", flash_shared(64)),
    ("flash_attention_128", flash_shared(128)),
    ("flash_attention_16x1", flash_shared(16)),
    ("flash_attention_32x1", flash_shared(32)),
    ("flash_attention_64x1", flash_shared(64)),
    ("flash_attention_128x1", flash_shared(128)),
];

/// `kernels/cuda/attention.cu`'s dynamic shared memory for heads up to `width` wide: two stages
/// of K and V, 64 keys of (width / 2 + 4) u32 each.
pub const fn flash_shared(width: usize) -> u32 {
    (2 * 2 * 64 * (width / 2 + 4) * 4) as u32
}

/// `kernels/cuda/bf16.cu`'s linear_bf16_wide: WIDE_STAGES (3) × (128 W rows + 128 x rows) ×
/// WIDE_PAD (36) u32.
pub const WIDE_SHARED: u32 = 3 * 2 * 128 * 36 * 4;

/// Whether NVRTC can be loaded here (it needs no GPU).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles every source of [`SOURCES`] to PTX for `arch` (`compute_90`): needs NVRTC, not a GPU.
pub fn compile_sources(arch: &str) -> Result<Vec<(&'static str, cudarc::nvrtc::Ptx)>, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    SOURCES
        .iter()
        .map(|(file, source)| {
            let opts = cudarc::nvrtc::CompileOptions {
                options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string()],
                name: Some(file.to_string()),
                ..Default::default()
            };
            let source = format!("{COMMON}\n{source}");
            match std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(source, opts)) {
                Ok(Ok(ptx)) => Ok((*file, ptx)),
                Ok(Err(e)) => {
                    Err(CudaError::Compile { file: file.to_string(), arch: arch.to_string(), log: format!("{e:?}") })
                }
                Err(_) => Err(CudaError::NoNvrtc),
            }
        })
        .collect()
}

/// The `extern "C" __global__` functions a source defines, in order.
pub fn kernel_names(source: &str) -> Vec<String> {
    source
        .split("extern \"C\" __global__ void ")
        .skip(1)
        .filter_map(|rest| {
            // `__launch_bounds__(..) name(`: the name follows the bounds
            let rest = match rest.strip_prefix("__launch_bounds__(") {
                Some(bounded) => bounded.split_once(") ").map_or(bounded, |(_, after)| after),
                None => rest,
            };
            rest.split('(').next().map(|n| n.trim().to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sources compile under NVRTC for Hopper (no GPU needed). Where NVRTC cannot be loaded
    /// the check cannot run: it says so, and fails when `KVFLOW_REQUIRE_NVRTC` is set (CI sets
    /// it, after installing NVRTC from PyPI).
    #[test]
    fn the_cuda_sources_compile_under_nvrtc_for_hopper() {
        if !nvrtc_present() {
            assert!(
                std::env::var_os("KVFLOW_REQUIRE_NVRTC").is_none(),
                "KVFLOW_REQUIRE_NVRTC is set and libnvrtc.so cannot be loaded (LD_LIBRARY_PATH?)"
            );
            eprintln!("NOT RUN: libnvrtc.so cannot be loaded here, so the CUDA sources were not compiled");
            return;
        }
        let compiled = compile_sources("compute_90").unwrap_or_else(|e| panic!("{e}"));
        for (file, ptx) in compiled {
            let text = ptx.to_src();
            let source = SOURCES.iter().find(|(f, _)| *f == file).map(|(_, s)| *s).unwrap();
            for name in kernel_names(source) {
                assert!(text.contains(&format!(".entry {name}(")), "{file}: no entry {name} in the PTX");
            }
        }
    }

    #[test]
    fn kernel_names_are_read_from_the_sources() {
        let names: Vec<String> = SOURCES.iter().flat_map(|(_, s)| kernel_names(s)).collect();
        for expected in ["linear", "paged_attention", "sample_greedy", "pack_blocks", "unpack_blocks", "route"] {
            assert!(names.iter().any(|n| n == expected), "no kernel {expected} in {names:?}");
        }
    }
}
