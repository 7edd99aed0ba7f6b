//! kvflow's timely operators (admit, schedule, align, forward, emit), one per file, and the
//! per-rank state each owns (`rank`), built around the plain scheduling policy in `policy`.
//! See DESIGN.md §4 for the per-pool graph they form; `kvflow::runtime` wires them.

pub mod admit;
pub mod align;
pub mod emit;
pub mod forward;
pub mod messages;
pub mod policy;
pub mod rank;
pub mod schedule;
