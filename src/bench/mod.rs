//! `kvflow bench …`: benchmarks that print figures beside a baseline measured in the same run.

pub mod device;
pub mod model;
pub mod step;
pub mod transfer;
