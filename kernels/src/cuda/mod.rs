//! The CUDA side of the executor (DESIGN §4, §6): kernels in `kernels/cuda/*.cu` compiled at run
//! time by NVRTC through cudarc (dynamic loading: the build needs no CUDA, and a machine without
//! a driver gets an error naming what is missing), a model's weights and paged KV in device
//! memory, and a step enqueued on a rank's stream without the host ever waiting for it.
//!
//! - [`gpu`]: the device, its stream, compiled kernels, buffers, the host-wait counter.
//! - [`weights`]: a [`crate::models::Model`] uploaded (families mha, mla, sparse_mla, gdn, hybrid_gdn, hybrid_kda).
//! - [`forward`]: one step enqueued, sampling on the device.
//! - [`graph`]: a step shape's launches captured once into a CUDA graph, then replayed.
//! - [`indexer`]: DeepSeek-V3.2's key selection within a step.
//! - [`emulate`]: the same kernels on the CPU, for checks without a GPU.
//! - [`kv`]: the paged cache, pack/unpack/copy of a request's blocks.
//! - [`state`]: recurrent state slots and snapshots.

pub mod emulate;
pub mod forward;
pub mod gpu;
pub mod graph;
pub mod indexer;
pub mod kv;
pub mod plain;
pub mod state;
pub mod weights;

pub use forward::{RowsOnDevice, StepRows, StepShape, FROM_RING, NO_SLOT, RESULT_WORDS};
pub use gpu::{driver_present, visible_gpus, Arg, CudaError, DeviceBuf, Event, Gpu, KernelTimes, PinnedBuf};
pub use graph::{GraphCounts, GraphKey, StepGraph, StepGraphs};
pub use kv::{DeviceKv, SharedKv};
pub use plain::{PlainGeneration, PlainRunner, PlainSample};
pub use state::DeviceState;
pub use weights::{bf16_bits, unsupported, DeviceModel, Dtype};
