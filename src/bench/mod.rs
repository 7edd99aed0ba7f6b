//! `kvflow bench …`: benchmarks that print figures beside a baseline measured in the same run.

pub mod calibrate;
pub mod cuda_batch;
pub mod device;
pub mod draw_check;
pub mod experts;
pub mod kernel_checks;
pub mod model;
pub mod offload;
pub mod offload_redis;
pub mod router;
pub mod serve;
pub mod spec;
pub mod speed;
pub mod speed_baseline;
pub mod step;
pub mod transfer;

/// A seeded stream for prompts and block choices (the trace synthesiser's splitmix64), shared by
/// the device benches (`device`, `cuda_batch`).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn draw(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        crate::trace::splitmix64(self.0)
    }
}

/// The median of `v` (NaN when empty): each bench's figure over its rounds.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}
