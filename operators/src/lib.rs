//! kvflow's timely operators (admit, schedule, align, forward, the expert exchanges, verify,
//! propose, save, load, emit), one per file in `pool/` beside `build_pool_graph`, which wires them
//! into one rank's loop; the per-rank state each works on (`rank`), the executors that run a
//! rank's steps (`executor`) and the vocabulary of a step between them (`step`), built around the
//! plain scheduling policy in `policy`. A request's own small types (`request`) are shared by the
//! policy's sequences, the records between operators (`messages`) and the transfer engine
//! (`transfer`); the policy imports neither of the last two. See docs/design.md §4 for the
//! per-pool graph; `kvflow::runtime` starts the workers that build it.

pub mod checksum;
pub mod executor;
pub mod kv_source;
pub mod messages;
pub mod offload;
pub mod policy;
pub mod pool;
pub mod rank;
pub mod request;
pub mod sim;
pub mod step;
pub mod transfer;
