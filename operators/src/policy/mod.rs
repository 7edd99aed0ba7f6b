//! Scheduling policy of one rank, as plain structs with plain tests: the sequences, their
//! memory, the prefix cache, the batch policy, and the router in front of the ranks. The timely
//! operators are thin adapters around these.

pub mod drafter;
pub mod memory;
pub mod prefix_cache;
pub mod router;
pub mod scheduler;
pub mod sequence;
