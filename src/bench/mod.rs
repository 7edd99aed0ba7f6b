//! `kvflow bench …`: benchmarks that print figures beside a baseline measured in the same run.

pub mod cuda_batch;
pub mod device;
pub mod experts;
pub mod model;
pub mod offload;
pub mod router;
pub mod serve;
pub mod spec;
pub mod speed;
pub mod step;
pub mod transfer;

/// The median of `v` (NaN when empty): each bench's figure over its rounds.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}
