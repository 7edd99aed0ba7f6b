//! Scheduling policy of one rank, as plain structs with plain tests: the sequences, their
//! memory, the prefix cache, the batch policy, and the router in front of the ranks. The timely
//! operators are thin adapters around these. `kv_index` is the exception: the KV-aware routing
//! index, a differential-dataflow computation of its own beside the pools (the control plane).

pub mod drafter;
pub mod kv_index;
pub mod kv_router;
pub mod memory;
pub mod prefix_cache;
pub mod routed_blocks;
pub mod router;
pub mod routers;
pub mod scheduler;
pub mod sequence;
