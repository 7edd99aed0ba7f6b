//! What a kernel launch is built from on the host: its arguments ([`Arg`]) and the block and thread
//! counts derived from the sizes of the work. Shared by the device, the emulated capture and every
//! launcher.

/// A kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A device pointer (0: null).
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    /// The argument's value in the 8 bytes a launch reads it from (low bytes first for 4-byte ones).
    pub(crate) fn bytes(&self) -> [u8; 8] {
        let mut v = [0u8; 8];
        match self {
            Arg::Ptr(p) => v.copy_from_slice(&p.to_ne_bytes()),
            Arg::I64(x) => v.copy_from_slice(&x.to_ne_bytes()),
            Arg::I32(x) => v[..4].copy_from_slice(&x.to_ne_bytes()),
            Arg::F32(x) => v[..4].copy_from_slice(&x.to_ne_bytes()),
        }
        v
    }
}

/// The kernels that start with `griddep_wait()` (kernels/cuda/common.cuh) and read nothing another
/// kernel writes, and write nothing, before it: the ones the host may launch with programmatic
/// stream serialization (the PDL tuning constant), so that each starts — its weights on their
/// way — while the kernel before it finishes.
pub(crate) const PDL_KERNELS: &[&str] =
    &["linear_bf16", "linear_bf16_split", "linear_chunks_sum", "round_rows_bf16", "rms_norm", "swiglu"];

/// Launches `f` on `stream` with programmatic stream serialization allowed (see [`PDL_KERNELS`]).
///
/// # Safety
/// `args` must match the kernel's parameters, and the kernel must be one of [`PDL_KERNELS`].
pub(crate) unsafe fn launch_programmatic(
    f: cudarc::driver::sys::CUfunction,
    stream: cudarc::driver::sys::CUstream,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    args: &[Arg],
) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    let mut values: Vec<[u8; 8]> = args.iter().map(Arg::bytes).collect();
    let mut params: Vec<*mut std::ffi::c_void> =
        values.iter_mut().map(|v| v.as_mut_ptr() as *mut std::ffi::c_void).collect();
    // SAFETY: an all-zero attribute is a valid value of the C union, then set field by field.
    let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream,
        attrs: &mut attribute,
        numAttrs: 1,
    };
    // SAFETY: the caller's promise; `values` and `attribute` outlive the call.
    unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }.result()
}

/// Kernel launch shapes shared by the model and KV code.
pub(crate) fn blocks_for(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).max(1) as u32
}

/// Threads of a block that reduces `dim` values: a power of two from 32 to 256 fixed by `dim`
/// alone (never by the batch), so a row's reduction tree is the same in every step.
pub(super) fn reduce_threads(dim: usize) -> u32 {
    dim.next_power_of_two().clamp(32, 256) as u32
}
