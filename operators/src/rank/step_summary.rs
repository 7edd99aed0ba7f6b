//! What a rank keeps of its steps, in memory that does not grow with them: the step times that
//! the steady-state cost per step reads, and the distributions of its per-step utilization
//! samples (a server runs for weeks; a `Vec` per step would grow for as long).

use hdrhistogram::Histogram;
use std::collections::VecDeque;

/// Steps left out at each end of a run when measuring its steady state (start-up and the final
/// drain); at most a quarter of the steps at each end.
pub const STEADY_SKIP: usize = 10;

/// When a rank's steps ran: the first and the last `STEADY_SKIP + 1` times and their count,
/// which is all [`StepTimes::steady_ms_per_step`] reads (a fixed size however many steps run).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepTimes {
    /// The first times, up to `STEADY_SKIP + 1` of them.
    first: Vec<f64>,
    /// The latest times, up to `STEADY_SKIP + 1` of them, oldest first.
    last: VecDeque<f64>,
    count: u64,
}

impl StepTimes {
    const KEPT: usize = STEADY_SKIP + 1;

    /// Counts a step that ran at `ms` (its `wall_ms`).
    pub fn record(&mut self, ms: f64) {
        if self.first.len() < Self::KEPT {
            self.first.push(ms);
        }
        if self.last.len() == Self::KEPT {
            self.last.pop_front();
        }
        self.last.push_back(ms);
        self.count += 1;
    }

    /// Steps counted.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Mean gap between the step times of the middle of the run: the first and last
    /// `min(STEADY_SKIP, steps / 4)` steps are left out; 0 for one step, `None` for none.
    pub fn steady_ms_per_step(&self) -> Option<f64> {
        let n = usize::try_from(self.count).unwrap_or(usize::MAX);
        if n == 0 {
            return None;
        }
        let skip = STEADY_SKIP.min(n / 4);
        // The step at `skip` is among the first kept (skip ≤ STEADY_SKIP), the one at
        // `n - 1 - skip` among the last kept (there are `last.len() = min(n, KEPT)` of them).
        let from = self.first[skip];
        let to = self.last[self.last.len() - 1 - skip];
        Some((to - from) / (n - 2 * skip - 1).max(1) as f64)
    }
}

/// Scale at which a fraction is counted in a [`Distribution`]'s histogram (parts per million).
const FRACTION_SCALE: f64 = 1e6;

/// Significant digits the histograms tell apart: a percentile is within 0.1% of the value it
/// stands for, and integers below 2048 are counted exactly.
const SIGNIFICANT_DIGITS: u8 = 3;

/// The distribution of one per-step quantity (non-negative) in memory that does not grow with
/// the steps: an HDR histogram of its values (a fraction in parts per million, a count as it is)
/// for the percentiles, and the exact count, sum, minimum and maximum for the mean, the maximum
/// and bounds the percentiles never leave. The histogram resizes to the largest value counted,
/// which is at most a million for a fraction and a batch's size for a count, so its size is
/// bounded (at most 90 KB for a fraction, 190 KB for a count up to `u32::MAX`).
/// Distributions of the same quantity merge (ranks pooled in the report).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(into = "DistributionWire", from = "DistributionWire")]
pub struct Distribution {
    histogram: Histogram<u64>,
    /// What a value is multiplied by to count it in the histogram.
    scale: f64,
    sum: f64,
    min: f64,
    max: f64,
}

impl Distribution {
    fn with_scale(scale: f64) -> Distribution {
        Distribution {
            histogram: Histogram::new(SIGNIFICANT_DIGITS).expect("valid significant digits"),
            scale,
            sum: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        }
    }

    /// Of fractions in 0..=1, told apart to a millionth.
    pub fn of_fractions() -> Distribution {
        Distribution::with_scale(FRACTION_SCALE)
    }

    /// Of counts (whole numbers).
    pub fn of_counts() -> Distribution {
        Distribution::with_scale(1.0)
    }

    /// Counts one value (one that is not a number, or below 0, is left out: none is, here).
    pub fn record(&mut self, value: f64) {
        if !(value.is_finite() && value >= 0.0) {
            return;
        }
        count_in(&mut self.histogram, (value * self.scale).round() as u64, 1);
        self.sum += value;
        self.min = self.min.min(value);
        self.max = self.max.max(value);
    }

    pub fn count(&self) -> u64 {
        self.histogram.len()
    }

    pub fn mean(&self) -> Option<f64> {
        (self.count() > 0).then(|| self.sum / self.count() as f64)
    }

    /// The largest value counted; 0 when none was.
    pub fn max(&self) -> f64 {
        self.max.max(0.0)
    }

    /// The nearest-rank `p`th percentile, within the histogram's precision and never outside
    /// the values counted; `None` when empty.
    pub fn percentile(&self, p: f64) -> Option<f64> {
        if self.count() == 0 {
            return None;
        }
        let scaled = self.histogram.median_equivalent(self.histogram.value_at_quantile(p / 100.0));
        Some((scaled as f64 / self.scale).clamp(self.min, self.max))
    }

    /// Adds what `other` counted (a distribution of the same quantity: the same scale).
    pub fn merge(&mut self, other: &Distribution) {
        debug_assert_eq!(self.scale, other.scale, "merging distributions of different quantities");
        for v in other.histogram.iter_recorded() {
            count_in(&mut self.histogram, v.value_iterated_to(), v.count_at_value());
        }
        self.sum += other.sum;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }
}

/// Counts `value` `count` times, growing the histogram to it (`saturating_record` would not
/// grow it but clamp); a value beyond what any histogram holds (2^62: never here) counts as
/// the largest it holds.
fn count_in(histogram: &mut Histogram<u64>, value: u64, count: u64) {
    if histogram.record_n(value, count).is_err() {
        histogram.saturating_record_n(value, count);
    }
}

/// A [`Distribution`] as it crosses processes (a pool spread over processes gathers its ranks'
/// counters on worker 0): the histogram's counted values and their counts.
#[derive(serde::Serialize, serde::Deserialize)]
struct DistributionWire {
    scale: f64,
    sum: f64,
    /// The least and the largest value counted (none when empty: JSON has no infinities).
    bounds: Option<(f64, f64)>,
    /// (a value in the histogram's scale, how many times it was counted), by value.
    counts: Vec<(u64, u64)>,
}

impl From<Distribution> for DistributionWire {
    fn from(d: Distribution) -> DistributionWire {
        let counts = d.histogram.iter_recorded().map(|v| (v.value_iterated_to(), v.count_at_value())).collect();
        let bounds = (d.count() > 0).then_some((d.min, d.max));
        DistributionWire { scale: d.scale, sum: d.sum, bounds, counts }
    }
}

impl From<DistributionWire> for Distribution {
    fn from(w: DistributionWire) -> Distribution {
        let mut d = Distribution::with_scale(w.scale);
        for (value, count) in w.counts {
            count_in(&mut d.histogram, value, count);
        }
        d.sum = w.sum;
        if let Some((min, max)) = w.bounds {
            (d.min, d.max) = (min, max);
        }
        d
    }
}

/// A rank's memory use and batch size at each step with work, as distributions.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Utilization {
    /// Fractions of the KV blocks, state slots and state snapshots in use.
    pub kv: Distribution,
    pub slots: Distribution,
    pub snapshots: Distribution,
    /// Sequences and tokens in the step's batch.
    pub batch_seqs: Distribution,
    pub batch_tokens: Distribution,
}

impl Default for Utilization {
    fn default() -> Utilization {
        Utilization {
            kv: Distribution::of_fractions(),
            slots: Distribution::of_fractions(),
            snapshots: Distribution::of_fractions(),
            batch_seqs: Distribution::of_counts(),
            batch_tokens: Distribution::of_counts(),
        }
    }
}

impl Utilization {
    /// Steps sampled.
    pub fn steps(&self) -> u64 {
        self.kv.count()
    }

    /// Adds another rank's samples (ranks pooled in the report).
    pub fn merge(&mut self, other: &Utilization) {
        self.kv.merge(&other.kv);
        self.slots.merge(&other.slots);
        self.snapshots.merge(&other.snapshots);
        self.batch_seqs.merge(&other.batch_seqs);
        self.batch_tokens.merge(&other.batch_tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `StepTimes` reads as the full list of times did: a mean gap over the middle of the run.
    #[test]
    fn step_times_give_the_steady_gap_the_full_list_gave() {
        let mut times = StepTimes::default();
        assert_eq!(times.steady_ms_per_step(), None, "no step, no figure");
        times.record(5.0);
        assert_eq!(times.steady_ms_per_step(), Some(0.0), "one step: no gap");
        // 8 steps at i²: a quarter (2) left out at each end, steps 2..=5: (25 − 4) / 3.
        let mut times = StepTimes::default();
        (0..8).for_each(|i| times.record((i * i) as f64));
        assert_eq!(times.steady_ms_per_step(), Some(7.0));
        // 100 steps 3 ms apart but for a slow start-up (the first 10) and drain (the last 10):
        // steps 10..=89 alone count, (267 − 30) / 79.
        let mut times = StepTimes::default();
        for i in 0..100 {
            let warm = if i < 10 {
                -100.0
            } else if i > 89 {
                1000.0
            } else {
                0.0
            };
            times.record(3.0 * i as f64 + warm);
        }
        assert_eq!(times.steady_ms_per_step(), Some(3.0));
        assert_eq!(times.count(), 100);
    }

    #[test]
    fn step_times_stay_a_fixed_size() {
        let mut times = StepTimes::default();
        for i in 0..1_000_000 {
            times.record(2.0 * i as f64);
        }
        assert_eq!((times.first.len(), times.last.len()), (STEADY_SKIP + 1, STEADY_SKIP + 1));
        assert!(times.first.capacity() <= 2 * (STEADY_SKIP + 1) && times.last.capacity() <= 2 * (STEADY_SKIP + 1));
        assert_eq!(times.count(), 1_000_000);
        assert_eq!(times.steady_ms_per_step(), Some(2.0));
    }

    /// The report's figures of a few samples, worked out by hand as the old per-step lists gave
    /// them (nearest rank over the sorted values; the mean; the maximum).
    #[test]
    fn a_distribution_gives_the_figures_the_samples_gave() {
        let mut kv = Distribution::of_fractions();
        assert_eq!((kv.percentile(50.0), kv.mean(), kv.max(), kv.count()), (None, None, 0.0, 0));
        for x in [0.25, 0.5, 0.75, 1.0, 0.5] {
            kv.record(x);
        }
        // sorted 0.25 0.5 0.5 0.75 1.0: p50 is the 3rd, p90 and p99 the 5th
        let near = |got: Option<f64>, want: f64| {
            let got = got.unwrap();
            assert!((got - want).abs() <= want / 1000.0, "{got} for {want}: beyond 0.1%");
        };
        near(kv.percentile(50.0), 0.5);
        assert_eq!((kv.percentile(90.0), kv.percentile(99.0)), (Some(1.0), Some(1.0)));
        assert_eq!((kv.mean(), kv.max(), kv.count()), (Some(0.6), 1.0, 5));
        // counts below 2048 are exact: sorted 1 2 2 3 … 9 (10 samples): p50 the 5th, p90 the 9th
        let mut seqs = Distribution::of_counts();
        for n in [9, 2, 1, 3, 2, 4, 5, 6, 7, 8] {
            seqs.record(n as f64);
        }
        let figures = [50.0, 90.0, 99.0].map(|p| seqs.percentile(p));
        assert_eq!(figures, [Some(4.0), Some(8.0), Some(9.0)]);
        assert_eq!((seqs.mean(), seqs.max()), (Some(4.7), 9.0));
        // a large count: within 0.1%, never above the largest
        let mut tokens = Distribution::of_counts();
        [100_000.0, 8192.0, 8193.0].into_iter().for_each(|n| tokens.record(n));
        near(tokens.percentile(50.0), 8193.0);
        assert_eq!(tokens.percentile(99.0), Some(100_000.0));
    }

    #[test]
    fn a_distribution_stays_a_fixed_size() {
        let mut kv = Distribution::of_fractions();
        [0.0, 1.0].into_iter().for_each(|x| kv.record(x));
        let size = kv.histogram.distinct_values();
        for i in 0..1_000_000u64 {
            kv.record((i % 997) as f64 / 996.0);
        }
        assert_eq!(kv.histogram.distinct_values(), size, "the histogram did not grow");
        assert_eq!(kv.count(), 1_000_002);
        let mut tokens = Distribution::of_counts();
        tokens.record(u32::MAX as f64);
        let size = tokens.histogram.distinct_values();
        (0..1_000_000u64).for_each(|i| tokens.record((i * 4099 % (1 << 32)) as f64));
        assert_eq!(tokens.histogram.distinct_values(), size, "a count is at most u32::MAX");
    }

    /// Ranks pooled: merging gives what one distribution of every sample gives, and a
    /// distribution crosses processes unchanged.
    #[test]
    fn distributions_merge_and_cross_processes_unchanged() {
        let (mut a, mut b, mut all) = (Utilization::default(), Utilization::default(), Utilization::default());
        for i in 0..300u32 {
            let (u, x) = (if i % 3 == 0 { &mut a } else { &mut b }, i as f64 / 299.0);
            for d in [&mut u.kv, &mut all.kv] {
                d.record(x);
            }
            for d in [&mut u.batch_tokens, &mut all.batch_tokens] {
                d.record((i * 37) as f64);
            }
        }
        a.merge(&b);
        for p in [50.0, 90.0, 99.0] {
            assert_eq!(a.kv.percentile(p), all.kv.percentile(p));
            assert_eq!(a.batch_tokens.percentile(p), all.batch_tokens.percentile(p));
        }
        assert_eq!((a.steps(), a.kv.max(), a.batch_tokens.max()), (300, 1.0, 299.0 * 37.0));
        assert!((a.kv.mean().unwrap() - 0.5).abs() < 1e-12);
        let back: Utilization = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        for (d, was) in [(&back.kv, &a.kv), (&back.batch_tokens, &a.batch_tokens), (&back.snapshots, &a.snapshots)] {
            assert_eq!((&d.histogram, d.min, d.max, d.scale), (&was.histogram, was.min, was.max, was.scale));
            assert!((d.sum - was.sum).abs() <= 1e-9 * was.sum.abs(), "the sum crosses (to JSON's precision)");
        }
        assert_eq!(back.snapshots.count(), 0);
    }
}
