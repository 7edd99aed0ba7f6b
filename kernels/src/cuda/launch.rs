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

/// Kernel launch shapes shared by the model and KV code.
pub(crate) fn blocks_for(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).max(1) as u32
}

/// Threads of a block that reduces `dim` values: a power of two from 32 to 256 fixed by `dim`
/// alone (never by the batch), so a row's reduction tree is the same in every step.
pub(super) fn reduce_threads(dim: usize) -> u32 {
    dim.next_power_of_two().clamp(32, 256) as u32
}
