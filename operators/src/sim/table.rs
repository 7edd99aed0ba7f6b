//! The measured step cost (issue 44's calibration): step times measured on a device over a grid of
//! prefill tokens, decode rows and context per decode row, and a step between grid points priced
//! by interpolating linearly along each axis (trilinear). Beyond the last point of an axis the
//! last two points' slope carries on (a larger batch costs more than the largest measured, never
//! the same); below the first point the first point's value holds.
//!
//! Beside the device's time, the host's: what launching a step took the rank's thread at each
//! grid point (`host_seconds`), and what the engine's own operators take a step over the rows it
//! batches (`engine`, measured with an executor that does no math). A rank's thread does both
//! one step after another, so a step reaches the device no sooner than they allow.

use super::StepShape;

/// A grid of measured step times, in seconds.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MeasuredTable {
    pub prefill_tokens: Vec<usize>,
    pub decode_rows: Vec<usize>,
    pub context: Vec<usize>,
    /// `seconds[(p * decode_rows.len() + r) * context.len() + c]`.
    pub seconds: Vec<f64>,
    /// The host's time to launch the step at each point, indexed as `seconds` (empty: not
    /// measured, none charged).
    #[serde(default)]
    pub host_seconds: Vec<f64>,
    /// The engine's host time a step, over the rows it batches (none: not measured).
    #[serde(default)]
    pub engine: Option<EngineHost>,
}

/// The engine's own host time a step (scheduling, bookkeeping, the dataflow's exchanges) over
/// the rows a step batches, in seconds.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineHost {
    pub rows: Vec<usize>,
    pub seconds: Vec<f64>,
}

/// Why a table cannot price steps.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum TableError {
    #[error("axis `{0}` is empty or not strictly increasing")]
    Axis(&'static str),
    #[error("{got} times for a grid of {expected} points")]
    Size { expected: usize, got: usize },
    #[error("time {0} at point {1} is not a finite, non-negative number of seconds")]
    Time(f64, usize),
}

impl MeasuredTable {
    /// Checks the axes and the times.
    pub fn validate(&self) -> Result<(), TableError> {
        for (name, axis) in
            [("prefill_tokens", &self.prefill_tokens), ("decode_rows", &self.decode_rows), ("context", &self.context)]
        {
            if axis.is_empty() || axis.windows(2).any(|w| w[0] >= w[1]) {
                return Err(TableError::Axis(name));
            }
        }
        let expected = self.prefill_tokens.len() * self.decode_rows.len() * self.context.len();
        if self.seconds.len() != expected {
            return Err(TableError::Size { expected, got: self.seconds.len() });
        }
        if !self.host_seconds.is_empty() && self.host_seconds.len() != expected {
            return Err(TableError::Size { expected, got: self.host_seconds.len() });
        }
        if let Some(engine) = &self.engine {
            if engine.rows.is_empty() || engine.rows.windows(2).any(|w| w[0] >= w[1]) {
                return Err(TableError::Axis("engine.rows"));
            }
            if engine.seconds.len() != engine.rows.len() {
                return Err(TableError::Size { expected: engine.rows.len(), got: engine.seconds.len() });
            }
        }
        let engine = self.engine.iter().flat_map(|e| &e.seconds);
        let times = self.seconds.iter().chain(&self.host_seconds).chain(engine);
        match times.enumerate().find(|(_, s)| !s.is_finite() || **s < 0.0) {
            Some((i, s)) => Err(TableError::Time(*s, i)),
            None => Ok(()),
        }
    }

    /// The host's time for `step` on the rank's thread: its launch and the engine's work.
    pub fn host_step_seconds(&self, step: &StepShape) -> f64 {
        let launch = if self.host_seconds.is_empty() {
            0.0
        } else {
            let context = step.context_positions.checked_div(step.decode_rows).unwrap_or(0);
            interpolate(self, &self.host_seconds, step.prefill_tokens, step.decode_rows, context)
        };
        let engine = self.engine.as_ref().map_or(0.0, |e| {
            let s = span(&e.rows, step.prefill_rows + step.decode_rows);
            s.weights().map(|(i, w)| w * e.seconds[i]).sum::<f64>().max(0.0)
        });
        launch + engine
    }

    /// The time of `step` (the table must be valid).
    pub fn step_seconds(&self, step: &StepShape) -> f64 {
        let context = step.context_positions.checked_div(step.decode_rows).unwrap_or(0);
        self.at(step.prefill_tokens, step.decode_rows, context)
    }

    /// The time at (`prefill`, `rows`, `context`), interpolated.
    pub fn at(&self, prefill: usize, rows: usize, context: usize) -> f64 {
        interpolate(self, &self.seconds, prefill, rows, context)
    }
}

/// `values` (laid out over `table`'s grid) at (`prefill`, `rows`, `context`), interpolated.
fn interpolate(table: &MeasuredTable, values: &[f64], prefill: usize, rows: usize, context: usize) -> f64 {
    let (p, r, c) =
        (span(&table.prefill_tokens, prefill), span(&table.decode_rows, rows), span(&table.context, context));
    let (nr, nc) = (table.decode_rows.len(), table.context.len());
    let mut total = 0.0;
    for (pi, pw) in p.weights() {
        for (ri, rw) in r.weights() {
            for (ci, cw) in c.weights() {
                total += pw * rw * cw * values[(pi * nr + ri) * nc + ci];
            }
        }
    }
    total.max(0.0)
}

/// Where a value falls on an axis: two points and the weight of the second (beyond the ends the
/// weight leaves [0, 1], which extrapolates).
struct Span {
    low: usize,
    high: usize,
    t: f64,
}

impl Span {
    fn weights(&self) -> impl Iterator<Item = (usize, f64)> {
        let one = self.low == self.high;
        [(self.low, if one { 1.0 } else { 1.0 - self.t })].into_iter().chain((!one).then_some((self.high, self.t)))
    }
}

fn span(axis: &[usize], x: usize) -> Span {
    let n = axis.len();
    if n == 1 || x <= axis[0] {
        return Span { low: 0, high: 0, t: 0.0 };
    }
    let high = axis.iter().position(|&a| a >= x).unwrap_or(n - 1).max(1);
    let low = high - 1;
    let t = (x as f64 - axis[low] as f64) / (axis[high] as f64 - axis[low] as f64);
    Span { low, high, t }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table of a cost linear in each axis: interpolation and extrapolation reproduce it.
    fn linear() -> (MeasuredTable, impl Fn(usize, usize, usize) -> f64) {
        let cost = |p: usize, r: usize, c: usize| 1e-3 + 2e-6 * p as f64 + 5e-5 * r as f64 + 1e-9 * (r * c) as f64;
        let (prefill_tokens, decode_rows, context) = (vec![0, 256, 1024], vec![1, 8, 64], vec![128, 4096]);
        let mut seconds = Vec::new();
        for &p in &prefill_tokens {
            for &r in &decode_rows {
                for &c in &context {
                    seconds.push(cost(p, r, c));
                }
            }
        }
        let table =
            MeasuredTable { prefill_tokens, decode_rows, context, seconds, host_seconds: Vec::new(), engine: None };
        (table, cost)
    }

    #[test]
    fn points_between_and_beyond_the_grid_follow_its_slopes() {
        let (table, cost) = linear();
        table.validate().unwrap();
        for (p, r, c) in [(0, 1, 128), (256, 8, 4096), (600, 20, 1000), (2048, 64, 4096), (1024, 128, 4096)] {
            let (got, want) = (table.at(p, r, c), cost(p, r, c));
            // r·c is not linear in each axis separately only inside a cell of both: allow that.
            assert!((got - want).abs() <= 0.02 * want, "({p}, {r}, {c}): {got} vs {want}");
        }
        assert!(table.at(4096, 64, 4096) > table.at(1024, 64, 4096), "beyond the grid costs more");
        assert_eq!(table.at(0, 0, 0), table.at(0, 1, 128), "below the grid, its first point");
        let step = StepShape { decode_rows: 8, context_positions: 8 * 4096, ..StepShape::prefill(256, 256) };
        assert_eq!(table.step_seconds(&step), table.at(256, 8, 4096));
    }

    #[test]
    fn a_table_that_cannot_price_steps_is_refused_naming_why() {
        let (mut table, _) = linear();
        table.decode_rows = vec![1, 64, 8];
        assert_eq!(table.validate(), Err(TableError::Axis("decode_rows")));
        let (mut table, _) = linear();
        table.seconds.pop();
        assert!(matches!(table.validate(), Err(TableError::Size { expected: 18, got: 17 })));
        let (mut table, _) = linear();
        table.seconds[3] = f64::NAN;
        assert!(matches!(table.validate(), Err(TableError::Time(_, 3))));
        let (mut table, _) = linear();
        table.host_seconds = vec![0.0; 5];
        assert!(matches!(table.validate(), Err(TableError::Size { expected: 18, got: 5 })));
        let (mut table, _) = linear();
        table.engine = Some(EngineHost { rows: vec![8, 1], seconds: vec![0.0, 0.0] });
        assert_eq!(table.validate(), Err(TableError::Axis("engine.rows")));
    }

    #[test]
    fn the_host_time_is_the_launch_at_the_point_and_the_engine_over_the_rows() {
        let (mut table, cost) = linear();
        let step = StepShape::decode(8, 8 * 4096);
        assert_eq!(table.host_step_seconds(&step), 0.0, "nothing measured, nothing charged");
        table.host_seconds = table.seconds.iter().map(|s| s / 10.0).collect();
        table.engine = Some(EngineHost { rows: vec![1, 64], seconds: vec![1e-4, 8e-4] });
        table.validate().unwrap();
        let want = cost(0, 8, 4096) / 10.0 + 1e-4 + 7.0 / 63.0 * 7e-4;
        assert!((table.host_step_seconds(&step) - want).abs() < 1e-9);
    }
}
