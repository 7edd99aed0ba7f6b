//! kvflow's timely operators (admit, schedule, align, forward, the expert exchanges, verify,
//! propose, save, load, emit), one per file, the per-rank state each owns (`rank`), the
//! executors that run a rank's steps (`executor`) and the vocabulary of a step between them
//! (`step`), built around the plain scheduling policy in `policy`. A request's own small types
//! (`request`) are shared by the policy's sequences, the records between operators (`messages`)
//! and the transfer engine (`transfer`); the policy imports neither of the last two. See
//! docs/design.md §4 for the per-pool graph they form; `kvflow::runtime` wires them.

pub mod admit;
pub mod align;
pub mod checksum;
pub mod emit;
pub mod executor;
pub mod experts;
pub mod forward;
pub mod kv_source;
pub mod load;
pub mod messages;
pub mod offload;
pub mod policy;
pub mod pool;
pub mod propose;
pub mod rank;
pub mod request;
pub mod save;
pub mod schedule;
pub mod step;
pub mod transfer;
pub mod verify;
pub mod wake;
