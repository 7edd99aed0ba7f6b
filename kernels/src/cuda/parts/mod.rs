//! The host side of each model part on the device, one file per part as `models/parts/` holds the
//! CPU's: the part's weights in device memory (`Dev*`), their upload from the CPU model, and its
//! launches within one step (methods of [`Step`], enqueued on the rank's stream, never waited for).
//!
//! - `layers`: products with their bias, RMSNorm, rope, the SwiGLU MLP.
//! - `attention`: paged attention, shared by `gqa` and `mla`.
//! - `gqa`, `mla`: the attention mixers; `indexer`: DeepSeek-V3.2's key selection.
//! - `gated_delta`, `kda`: linear attention over state slots.
//! - `moe`: routing, expert products, shared experts.

use super::gpu::Gpu;
use super::kv::DeviceKv;
use super::rows::RowsOnDevice;
use super::state::DeviceState;

pub mod attention;
pub mod gated_delta;
pub mod gqa;
pub mod indexer;
pub mod kda;
pub mod layers;
pub mod mla;
pub mod moe;

/// What every launch of one step reads: the device, the cache and state the step writes, its sizes
/// and where its rows sit on the device.
pub(crate) struct Step<'a> {
    pub(crate) gpu: &'a Gpu,
    pub(crate) kv: &'a DeviceKv,
    pub(crate) state: Option<&'a DeviceState>,
    pub(crate) rows: usize,
    pub(crate) seqs: usize,
    pub(crate) at: RowsOnDevice,
    /// The longest index row (DeepSeek-V3.2's indexer scores): max(prompt, position + 1).
    pub(crate) index_row: usize,
}
