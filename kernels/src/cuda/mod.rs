//! The CUDA side of the executor (DESIGN §4, §6): kernels in `kernels/cuda/*.cu` compiled at run
//! time by NVRTC through cudarc (dynamic loading: the build needs no CUDA, and a machine without
//! a driver gets an error naming what is missing), a model's weights and paged KV in device
//! memory, and a step enqueued on a rank's stream without the host ever waiting for it.
//!
//! Dependencies point one way: `error`, `sources`, `launch` ← `emulate`, `host_capture` ← `gpu`
//! ← `weights` (← `kv`), `product`, `rows`, `state` ← `parts` ← `model` ← `forward` ← `mtp`, `experts`,
//! `graph`, `plain`. The device records an emulated capture into `host_capture`, which `graph` replays: the
//! device never imports the graph code, nor the emulation the device.
//!
//! - [`error`]: what can go wrong ([`CudaError`]).
//! - [`sources`]: the kernel sources, their kernels' names, NVRTC compilation.
//! - [`launch`]: a launch's arguments and grid arithmetic.
//! - [`gpu`]: the device, its stream, compiled kernels, buffers, the host-wait counter.
//! - [`emulate`]: the same kernels on the CPU, for checks without a GPU.
//! - `host_capture`: what an emulated capture records (the emulation's CUDA graph).
//! - [`rows`]: a step's rows and shape, packed as the kernels read them.
//! - [`product`]: how a product is launched.
//! - [`weights`]: the dtype weights are held in on the device.
//! - [`parts`]: one file per model part — its weights, their upload, its launches in a step.
//! - [`model`]: a [`crate::models::Model`] uploaded (families mha, mla, sparse_mla, gdn, hybrid_gdn, hybrid_kda).
//! - [`forward`]: one step enqueued, sampling on the device.
//! - [`mtp`]: a pass of DeepSeek's MTP drafter layer, enqueued after a step.
//! - [`experts`]: a step split at its MoE blocks, their experts served by other ranks (expert
//!   parallelism), the rows moving device to device.
//! - [`graph`]: a step shape's launches captured once into a CUDA graph, then replayed.
//! - [`kv`]: the paged cache, pack/unpack/copy of a request's blocks.
//! - [`state`]: recurrent state slots and snapshots.
//! - [`plain`]: one step at a time, waited for (the `--verify` reference).

pub mod emulate;
pub mod error;
pub mod experts;
pub mod forward;
pub mod gpu;
pub mod graph;
mod host_capture;
pub mod kv;
pub mod landing;
pub mod launch;
pub mod model;
pub mod mtp;
pub mod parts;
mod pinned_pool;
pub mod plain;
pub mod product;
pub mod rows;
pub mod sources;
pub mod state;
pub mod weights;

pub use error::CudaError;
pub use experts::{DeviceRows, SplitStep};
pub use gpu::{driver_present, visible_gpus, DeviceBuf, Event, Gpu, KernelTimes, PinnedBuf};
pub use graph::{process_graph_counts, GraphCounts, GraphKey, StepGraph, StepGraphs};
pub use kv::{DeviceKv, LayerMarks, SharedKv};
pub use landing::{LandedKv, Landing, LandingKv};
pub use launch::Arg;
pub use model::{unsupported, DeviceModel};
/// DeepSeek-V3.2's key selection on the device (`cuda::indexer::torch_topk_on_device`).
pub use parts::indexer;
pub use pinned_pool::{PinnedPool, SharedPinned};
pub use plain::{PlainGeneration, PlainRunner, PlainSample};
pub use rows::{RowsOnDevice, StepRows, StepShape, FROM_RING, NO_SLOT, RESULT_WORDS};
pub use state::DeviceState;
pub use weights::{bf16_bits, Dtype};
