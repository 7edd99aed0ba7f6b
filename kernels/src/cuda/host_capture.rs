//! An emulated step capture (`graph.rs` under the CPU emulation): what the device would have
//! enqueued, recorded in order instead of run, and the scratch memory the record names. The device
//! (`gpu.rs`) records into it while a capture is open; `graph.rs` replays it.

use super::launch::Arg;

/// What an emulated capture recorded, in order.
pub(super) enum HostOp {
    Launch { name: String, grid: (u32, u32, u32), block: u32, smem: u32, args: Vec<Arg> },
    Zero { ptr: u64, bytes: usize },
    Copy { dst: u64, src: u64, bytes: usize },
}

/// An emulated capture: its record and the scratch memory the record names.
#[derive(Default)]
pub(super) struct HostCapture {
    pub(super) ops: Vec<HostOp>,
    pub(super) memory: Vec<Vec<u128>>,
}
