//! The measured step cost (issue 44's calibration): step times measured on a device over two
//! grids — decode steps over rows × context per row, and prefill chunks over tokens × the
//! positions already cached before the chunk (its prefix: a chunk late in a long prompt attends
//! to all of them) — and a step between grid points priced by interpolating linearly along each
//! axis. Beyond the last point of an axis the last two points' slope carries on (a larger batch
//! costs more than the largest measured, never the same); below the first point the first
//! point's value holds (but for a prefill of fewer tokens than measured: below). A step mixing both is priced as its prefill part plus its decode part
//! less one pass over the weights (the step reads them once; the lightest decode step stands
//! for that pass), never below the larger part.
//!
//! Beside the device's time, the host's: what launching a step took the rank's thread on each
//! grid (`*_launch_seconds`, a mixed step's the larger part's: it is one launch), and what the
//! engine's own operators take a step over the rows it batches (`engine`, measured with an
//! executor that does no math). A rank's thread does both one step after another, so a step
//! reaches the device no sooner than they allow.
//!
//! A prefill chunk's attention grows with the positions each of its tokens attends to: a chunk
//! late in a long prompt attends to all of the prompt's cached positions, and a step of several
//! short prompts to fewer than one prompt of as many tokens (each prompt is a sequence of its own
//! to the kernels). So within a row of the prefill grid (one token count) the points are placed
//! by the positions attended per token — one prompt after each prefix, and `prefill_split`'s
//! steps split evenly among a few prompts without one — and a step's prefill part is
//! interpolated along that axis at its own positions per token, then between the token counts
//! (below the first count, between that row and a step of no tokens: one pass over the weights)
//! (on an H100, llama-1b's 4,096 tokens took 56 ms over 4 prompts, 68 ms over one and 99 ms
//! after 4,096 cached positions: 1.85 ms per million positions attended, alike at each point).
//!
//! A save reads its chunk's blocks off the device on a stream of its own while the rank's steps
//! run, and steps are slower meanwhile. `save_reads` holds the device's read rate and a step's
//! time beside reads back to back against alone; a step beside a save is priced by the share of
//! the save's time that reads the device (the save's rate over the read rate).
//!
//! And the device's wake-up: a step that starts after the device sat idle takes longer than one
//! behind another (a GPU lowers its clocks when idle: on an H100 the first 2,048-token prefill
//! after 0.7 s of idle took 60 ms, the ones behind it 35 ms). `idle` holds the extra time over
//! the idle gap before the step, measured; past its last gap the last extra holds.

use super::StepShape;

/// Measured step times, in seconds.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MeasuredTable {
    /// Decode steps: `decode_seconds[r * context.len() + c]` for `decode_rows[r]` rows of
    /// `context[c]` positions each.
    pub decode_rows: Vec<usize>,
    pub context: Vec<usize>,
    pub decode_seconds: Vec<f64>,
    /// Prefill chunks: `prefill_seconds[p * prefill_prefix.len() + x]` for a chunk of
    /// `prefill_tokens[p]` tokens after `prefill_prefix[x]` cached positions.
    pub prefill_tokens: Vec<usize>,
    pub prefill_prefix: Vec<usize>,
    pub prefill_seconds: Vec<f64>,
    /// The host's time to launch each point, indexed as the grid's seconds (empty: not
    /// measured, none charged).
    #[serde(default)]
    pub decode_launch_seconds: Vec<f64>,
    #[serde(default)]
    pub prefill_launch_seconds: Vec<f64>,
    /// The engine's host time a step, over the rows it batches (none: not measured).
    #[serde(default)]
    pub engine: Option<EngineHost>,
    /// The extra time of a step that starts after the device was idle (none: not measured).
    #[serde(default)]
    pub idle: Option<IdleCost>,
    /// Prefill steps split among several prompts (none: not measured, nothing charged).
    #[serde(default)]
    pub prefill_split: Option<PrefillSplit>,
    /// What a save's device reads cost the steps beside them (none: not measured, nothing).
    #[serde(default)]
    pub save_reads: Option<SaveReads>,
    /// The memory store's rates as a rank's save and load threads moved chunks (not a step's
    /// cost: what `store = "sim"` takes as `save_gbps` and `load_gbps` to stand for that store).
    #[serde(default)]
    pub store: Option<StoreRates>,
}

/// A store's measured rates: bytes over the save and load threads' time, for chunks of
/// `chunk_tokens`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StoreRates {
    pub chunk_tokens: usize,
    pub save_bytes_per_s: f64,
    pub load_bytes_per_s: f64,
}

/// A save's device reads: the rate its chunk's blocks are read off the device at, and a step's
/// time beside reads back to back over its time alone (at least 1).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SaveReads {
    pub read_bytes_per_s: f64,
    pub step_slowdown: f64,
}

/// Prefill steps without a prefix split evenly among prompts: `seconds[p * prompts.len() + k]`
/// for `prefill_tokens[p]` tokens over `prompts[k]` prompts (`prompts` increasing from 1).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PrefillSplit {
    pub prompts: Vec<usize>,
    pub seconds: Vec<f64>,
}

/// A step's extra time over the idle gap before it (`gap_us`, increasing from 0).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct IdleCost {
    pub gap_us: Vec<usize>,
    pub extra_seconds: Vec<f64>,
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
    #[error("`{name}` holds {got} times for a grid of {expected} points")]
    Size { name: &'static str, expected: usize, got: usize },
    #[error("`{name}` holds {time} at point {at}: not a finite, non-negative number of seconds")]
    Time { name: &'static str, time: f64, at: usize },
}

/// One grid: two axes and a time at each point (`values[i * second.len() + j]`).
struct Grid<'a> {
    first: &'a [usize],
    second: &'a [usize],
    values: &'a [f64],
}

impl Grid<'_> {
    /// The time at (`a`, `b`), interpolated (0 for an empty grid).
    fn at(&self, a: usize, b: usize) -> f64 {
        if self.values.is_empty() {
            return 0.0;
        }
        let mut total = 0.0;
        for (i, wi) in span(self.first, a).weights() {
            for (j, wj) in span(self.second, b).weights() {
                total += wi * wj * self.values[i * self.second.len() + j];
            }
        }
        total.max(0.0)
    }
}

impl MeasuredTable {
    fn decode(&self) -> Grid<'_> {
        Grid { first: &self.decode_rows, second: &self.context, values: &self.decode_seconds }
    }

    fn prefill(&self) -> Grid<'_> {
        Grid { first: &self.prefill_tokens, second: &self.prefill_prefix, values: &self.prefill_seconds }
    }

    /// Checks the axes and the times.
    pub fn validate(&self) -> Result<(), TableError> {
        let axes: [(&'static str, &[usize]); 4] = [
            ("decode_rows", &self.decode_rows),
            ("context", &self.context),
            ("prefill_tokens", &self.prefill_tokens),
            ("prefill_prefix", &self.prefill_prefix),
        ];
        for (name, axis) in axes {
            if axis.is_empty() || axis.windows(2).any(|w| w[0] >= w[1]) {
                return Err(TableError::Axis(name));
            }
        }
        let (decode, prefill) =
            (self.decode_rows.len() * self.context.len(), self.prefill_tokens.len() * self.prefill_prefix.len());
        let mut times: Vec<(&'static str, &[f64], usize, bool)> = vec![
            ("decode_seconds", &self.decode_seconds, decode, false),
            ("prefill_seconds", &self.prefill_seconds, prefill, false),
            ("decode_launch_seconds", &self.decode_launch_seconds, decode, true),
            ("prefill_launch_seconds", &self.prefill_launch_seconds, prefill, true),
        ];
        if let Some(engine) = &self.engine {
            if engine.rows.is_empty() || engine.rows.windows(2).any(|w| w[0] >= w[1]) {
                return Err(TableError::Axis("engine.rows"));
            }
            times.push(("engine.seconds", &engine.seconds, engine.rows.len(), false));
        }
        if let Some(idle) = &self.idle {
            if idle.gap_us.first() != Some(&0) || idle.gap_us.windows(2).any(|w| w[0] >= w[1]) {
                return Err(TableError::Axis("idle.gap_us"));
            }
            times.push(("idle.extra_seconds", &idle.extra_seconds, idle.gap_us.len(), false));
        }
        if let Some(split) = &self.prefill_split {
            if split.prompts.first() != Some(&1) || split.prompts.windows(2).any(|w| w[0] >= w[1]) {
                return Err(TableError::Axis("prefill_split.prompts"));
            }
            let points = self.prefill_tokens.len() * split.prompts.len();
            times.push(("prefill_split.seconds", &split.seconds, points, false));
        }
        if let Some(reads) = &self.save_reads {
            if !(reads.read_bytes_per_s.is_finite() && reads.read_bytes_per_s > 0.0) {
                return Err(TableError::Time {
                    name: "save_reads.read_bytes_per_s",
                    time: reads.read_bytes_per_s,
                    at: 0,
                });
            }
            if !(reads.step_slowdown.is_finite() && reads.step_slowdown >= 1.0) {
                return Err(TableError::Time { name: "save_reads.step_slowdown", time: reads.step_slowdown, at: 0 });
            }
        }
        for (name, values, expected, optional) in times {
            if values.len() != expected && !(optional && values.is_empty()) {
                return Err(TableError::Size { name, expected, got: values.len() });
            }
            if let Some((at, &time)) = values.iter().enumerate().find(|(_, s)| !s.is_finite() || **s < 0.0) {
                return Err(TableError::Time { name, time, at });
            }
        }
        Ok(())
    }

    /// The device's time for `step` (the table must be valid).
    pub fn step_seconds(&self, step: &StepShape) -> f64 {
        let (_, decode) = self.parts(step, &self.prefill(), &self.decode());
        let prefill = match step.prefill_tokens {
            0 => 0.0,
            tokens => {
                // (a decode row attends to its context: what is left is the prompt tokens')
                let attended = step.attended_positions.saturating_sub(step.decode_context_positions);
                self.prefill_device_seconds(tokens, attended as f64 / tokens as f64)
            }
        };
        match (step.prefill_tokens > 0, step.decode_rows > 0) {
            (true, true) => {
                let weights = self.weights_pass();
                (prefill + decode - weights).max(prefill.max(decode))
            }
            (true, false) => prefill,
            (false, true) => decode,
            (false, false) => 0.0,
        }
    }

    /// A prefill part of `tokens` tokens attending to `per_token` positions each on average:
    /// interpolated along each measured token count's row at `per_token`, then between rows.
    fn prefill_device_seconds(&self, tokens: usize, per_token: f64) -> f64 {
        let first = self.prefill_tokens[0];
        if tokens < first {
            // Fewer tokens than the first row: between a step of none (one pass over the
            // weights: the lightest decode step) and that row, along the tokens (where the row
            // costs more than the pass, as on a device it does).
            let (weights, at_first) = (self.weights_pass(), along(&self.prefill_row(0), per_token));
            if at_first > weights {
                return weights + (at_first - weights) * tokens as f64 / first as f64;
            }
        }
        let total: f64 = span(&self.prefill_tokens, tokens)
            .weights()
            .map(|(row, w)| w * along(&self.prefill_row(row), per_token))
            .sum();
        total.max(0.0)
    }

    /// One pass over the weights: the lightest decode step measured.
    fn weights_pass(&self) -> f64 {
        self.decode_seconds.iter().copied().fold(f64::INFINITY, f64::min)
    }

    /// Row `row` of the prefill grid as (positions attended per token, seconds), by the first:
    /// one prompt after each prefix, and the steps split evenly among several prompts.
    fn prefill_row(&self, row: usize) -> Vec<(f64, f64)> {
        let tokens = self.prefill_tokens[row];
        let mut points: Vec<(f64, f64)> = self
            .prefill_prefix
            .iter()
            .enumerate()
            .map(|(j, &prefix)| {
                (attended_per_token(prefix, tokens), self.prefill_seconds[row * self.prefill_prefix.len() + j])
            })
            .collect();
        if let Some(split) = &self.prefill_split {
            // (one prompt is the grid's point after no prefix; calibrate gives each of `n`
            // prompts `tokens / n` tokens, at least one)
            for (k, &prompts) in split.prompts.iter().enumerate().filter(|&(_, &n)| n > 1) {
                let each = (tokens / prompts).max(1);
                points.push((attended_per_token(0, each), split.seconds[row * split.prompts.len() + k]));
            }
        }
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        points
    }

    /// The host's time for `step` on the rank's thread: its launch and the engine's work.
    pub fn host_step_seconds(&self, step: &StepShape) -> f64 {
        let prefill = Grid { values: &self.prefill_launch_seconds, ..self.prefill() };
        let decode = Grid { values: &self.decode_launch_seconds, ..self.decode() };
        let (prefill, decode) = self.parts(step, &prefill, &decode);
        let engine = self.engine.as_ref().map_or(0.0, |e| {
            let rows = Grid { first: &e.rows, second: &[0], values: &e.seconds };
            rows.at(step.prefill_rows + step.decode_rows, 0)
        });
        prefill.max(decode) + engine
    }

    /// How much longer a step takes beside saves at `save_bytes_per_s` running back to back: the
    /// slowdown over the share of a save's time that reads the device (1: not measured).
    pub fn beside_saves(&self, save_bytes_per_s: f64) -> f64 {
        self.save_reads.as_ref().map_or(1.0, |r| {
            let reading = (save_bytes_per_s / r.read_bytes_per_s).clamp(0.0, 1.0);
            1.0 + (r.step_slowdown - 1.0) * reading
        })
    }

    /// The extra time of a step that starts `gap_ns` after the device last ran one.
    pub fn idle_seconds(&self, gap_ns: u64) -> f64 {
        let Some(idle) = &self.idle else { return 0.0 };
        let last = idle.gap_us.last().copied().unwrap_or(0);
        let gap = Grid { first: &idle.gap_us, second: &[0], values: &idle.extra_seconds };
        gap.at(((gap_ns / 1000) as usize).min(last), 0)
    }

    /// The prefill part and the decode part of `step` on two grids (0 for a part it lacks).
    fn parts(&self, step: &StepShape, prefill: &Grid<'_>, decode: &Grid<'_>) -> (f64, f64) {
        let pre = match step.prefill_tokens {
            0 => 0.0,
            tokens => prefill.at(tokens, step.prefill_prefix_positions / tokens),
        };
        let dec = match step.decode_rows {
            0 => 0.0,
            rows => decode.at(rows, step.decode_context_positions / rows),
        };
        (pre, dec)
    }
}

/// Positions attended per token by a chunk of `tokens` tokens after `prefix` cached positions
/// (its `i`-th token attends to `prefix + i + 1`).
fn attended_per_token(prefix: usize, tokens: usize) -> f64 {
    prefix as f64 + (tokens as f64 + 1.0) / 2.0
}

/// The value at `x` on points sorted by their first: linear between two, the nearest two's
/// slope beyond either end (fewer positions attended cost less, more cost more).
fn along(points: &[(f64, f64)], x: f64) -> f64 {
    match points {
        [] => 0.0,
        [(_, y)] => *y,
        _ => {
            let high = points.iter().position(|p| p.0 >= x).unwrap_or(points.len() - 1).max(1);
            let ((x0, y0), (x1, y1)) = (points[high - 1], points[high]);
            if x1 <= x0 {
                return y1;
            }
            y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        }
    }
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

    /// Decode `1 ms + 50 µs a row + 1 ns a position`.
    fn decode_truth(rows: usize, context: usize) -> f64 {
        1e-3 + 5e-5 * rows as f64 + 1e-9 * (rows * context) as f64
    }

    /// Prefill `2 µs a token + 1 ns a position attended`.
    fn prefill_truth(tokens: usize, attended: usize) -> f64 {
        2e-6 * tokens as f64 + 1e-9 * attended as f64
    }

    /// Positions attended by a chunk of `tokens` after `prefix` cached ones.
    fn attended(tokens: usize, prefix: usize) -> usize {
        tokens * prefix + tokens * (tokens + 1) / 2
    }

    /// A table of costs linear in what steps compute: [`decode_truth`], [`prefill_truth`].
    fn linear() -> MeasuredTable {
        let decode = decode_truth;
        let prefill = |p: usize, x: usize| prefill_truth(p, attended(p, x));
        let (decode_rows, context) = (vec![1, 8, 64], vec![128, 4096]);
        let (prefill_tokens, prefill_prefix) = (vec![16, 256, 1024], vec![0, 4096]);
        MeasuredTable {
            decode_seconds: decode_rows.iter().flat_map(|&r| context.iter().map(move |&c| decode(r, c))).collect(),
            prefill_seconds: prefill_tokens
                .iter()
                .flat_map(|&p| prefill_prefix.iter().map(move |&x| prefill(p, x)))
                .collect(),
            decode_rows,
            context,
            prefill_tokens,
            prefill_prefix,
            decode_launch_seconds: Vec::new(),
            prefill_launch_seconds: Vec::new(),
            engine: None,
            idle: None,
            prefill_split: None,
            save_reads: None,
            store: None,
        }
    }

    fn step(prefill: usize, prefix: usize, rows: usize, context: usize) -> StepShape {
        let mut shape = prompts(&[(prefill, prefix)]);
        shape.decode_rows = rows;
        shape.decode_context_positions = rows * context;
        shape.attended_positions += rows * context;
        shape
    }

    /// A prefill step of prompt chunks, each (tokens, prefix).
    fn prompts(chunks: &[(usize, usize)]) -> StepShape {
        let mut shape = StepShape::default();
        for &(tokens, prefix) in chunks.iter().filter(|c| c.0 > 0) {
            shape.prefill_tokens += tokens;
            shape.prefill_rows += 1;
            shape.prefill_prefix_positions += tokens * prefix;
            shape.attended_positions += attended(tokens, prefix);
        }
        shape
    }

    #[test]
    fn steps_between_and_beyond_the_grid_follow_its_slopes_and_a_mixed_step_reads_the_weights_once() {
        let table = linear();
        table.validate().unwrap();
        let (decode, prefill) = (decode_truth, |p: usize, x: usize| prefill_truth(p, attended(p, x)));
        let close = |got: f64, want: f64| (got - want).abs() <= 0.02 * want;
        for (r, c) in [(1, 128), (8, 4096), (20, 1000), (128, 4096)] {
            // r·c is not linear in each axis separately inside a cell of both: allow that
            assert!(close(table.step_seconds(&step(0, 0, r, c)), decode(r, c)), "decode ({r}, {c})");
        }
        for (p, x) in [(16, 0), (600, 1000), (1024, 4096), (2048, 16384)] {
            assert!(close(table.step_seconds(&step(p, x, 0, 0)), prefill(p, x)), "prefill ({p}, {x})");
        }
        assert!(table.step_seconds(&step(512, 30_000, 0, 0)) > table.step_seconds(&step(512, 4096, 0, 0)));
        let weights = decode(1, 128);
        let mixed = table.step_seconds(&step(1024, 4096, 8, 4096));
        assert!(close(mixed, prefill(1024, 4096) + decode(8, 4096) - weights), "one weight pass less: {mixed}");
        let (small, decode_only) = (step(16, 0, 64, 4096), step(0, 0, 64, 4096));
        assert_eq!(table.step_seconds(&small), table.step_seconds(&decode_only), "never below the larger part");
        assert_eq!(table.step_seconds(&StepShape::default()), 0.0);
    }

    #[test]
    fn a_table_that_cannot_price_steps_is_refused_naming_why() {
        let mut table = linear();
        table.decode_rows = vec![1, 64, 8];
        assert_eq!(table.validate(), Err(TableError::Axis("decode_rows")));
        let mut table = linear();
        table.prefill_seconds.pop();
        assert!(matches!(table.validate(), Err(TableError::Size { name: "prefill_seconds", expected: 6, got: 5 })));
        let mut table = linear();
        table.decode_seconds[3] = f64::NAN;
        assert!(matches!(table.validate(), Err(TableError::Time { name: "decode_seconds", at: 3, .. })));
        let mut table = linear();
        table.decode_launch_seconds = vec![0.0; 5];
        assert!(matches!(table.validate(), Err(TableError::Size { name: "decode_launch_seconds", .. })));
        let mut table = linear();
        table.engine = Some(EngineHost { rows: vec![8, 1], seconds: vec![0.0, 0.0] });
        assert_eq!(table.validate(), Err(TableError::Axis("engine.rows")));
    }

    #[test]
    fn a_step_after_an_idle_gap_costs_the_extra_measured_for_that_gap_and_no_more_past_the_last() {
        let mut table = linear();
        assert_eq!(table.idle_seconds(1_000_000_000), 0.0, "nothing measured, nothing charged");
        table.idle = Some(IdleCost { gap_us: vec![0, 10_000, 500_000], extra_seconds: vec![0.0, 0.002, 0.025] });
        table.validate().unwrap();
        assert_eq!(table.idle_seconds(0), 0.0);
        assert!((table.idle_seconds(5_000_000) - 0.001).abs() < 1e-12, "half way to 10 ms");
        assert_eq!(table.idle_seconds(500_000_000), 0.025);
        assert_eq!(table.idle_seconds(30_000_000_000), 0.025, "past the last gap, its extra");
        table.idle = Some(IdleCost { gap_us: vec![10, 20], extra_seconds: vec![0.0, 0.0] });
        assert_eq!(table.validate(), Err(TableError::Axis("idle.gap_us")));
    }

    #[test]
    fn the_host_time_is_the_launch_at_the_point_and_the_engine_over_the_rows() {
        let mut table = linear();
        let decode = step(0, 0, 8, 4096);
        assert_eq!(table.host_step_seconds(&decode), 0.0, "nothing measured, nothing charged");
        table.decode_launch_seconds = table.decode_seconds.iter().map(|s| s / 10.0).collect();
        table.prefill_launch_seconds = vec![1e-4; 6];
        table.engine = Some(EngineHost { rows: vec![1, 64], seconds: vec![1e-4, 8e-4] });
        table.validate().unwrap();
        let engine = 1e-4 + 7.0 / 63.0 * 7e-4;
        let want = table.step_seconds(&decode) / 10.0 + engine;
        assert!((table.host_step_seconds(&decode) - want).abs() < 1e-9);
        let mixed = step(256, 0, 8, 4096);
        let want = (table.step_seconds(&decode) / 10.0).max(1e-4) + 1e-4 + 8.0 / 63.0 * 7e-4;
        assert!((table.host_step_seconds(&mixed) - want).abs() < 1e-9, "one launch: the larger part's");
    }

    #[test]
    fn a_prefill_is_priced_by_the_positions_its_tokens_attend_to_over_prompts_and_prefixes() {
        let mut table = linear();
        let close = |got: f64, want: f64| (got - want).abs() <= 1e-9;
        // four fresh prompts of 256 tokens attend to fewer positions than one of 1,024: with no
        // split measured, the row's slope over its prefixes carries below its first point
        let four = prompts(&[(256, 0); 4]);
        let truth = prefill_truth(1024, 4 * attended(256, 0));
        assert!(close(table.step_seconds(&four), truth), "{} against {truth}", table.step_seconds(&four));
        // measured: a step split among 4 prompts costs 1 ms more than that, among 16 2 ms (a
        // sequence each to the kernels); seconds by tokens × prompts
        let prompt_counts = vec![1, 4, 16];
        let seconds = table
            .prefill_tokens
            .iter()
            .flat_map(|&p| {
                prompt_counts.iter().map(move |&n: &usize| {
                    let each = (p / n).max(1);
                    prefill_truth(n * each, n * attended(each, 0)) + [0.0, 1e-3, 2e-3][n.ilog(4) as usize]
                })
            })
            .collect();
        table.prefill_split = Some(PrefillSplit { prompts: prompt_counts, seconds });
        table.validate().unwrap();
        assert!(close(table.step_seconds(&four), truth + 1e-3), "at the measured split");
        // a chunk late in a long prompt beside a fresh one attends to more than a prompt of
        // 1,024 from the start: priced between that and the prefixes, as its positions say
        let late = prompts(&[(768, 2048), (256, 0)]);
        let late_truth = prefill_truth(1024, late.attended_positions);
        assert!(close(table.step_seconds(&late), late_truth), "{} against {late_truth}", table.step_seconds(&late));
        // beside decode rows: what they attend to is theirs, not the prompts'
        let mut mixed = four;
        mixed.decode_rows = 8;
        mixed.decode_context_positions = 8 * 4096;
        mixed.attended_positions += 8 * 4096;
        let weights = decode_truth(1, 128);
        assert!(close(table.step_seconds(&mixed), truth + 1e-3 + decode_truth(8, 4096) - weights));
        // fewer tokens than the first row (16, at 4 and 5 ms here): between one pass over the
        // weights (the lightest decode step) and that row
        table.prefill_split = None;
        table.prefill_seconds[0] = 0.004;
        table.prefill_seconds[1] = 0.005;
        let weights = decode_truth(1, 128);
        let eight = table.step_seconds(&prompts(&[(8, 0)]));
        let row = 0.004 - 0.001 * 4.0 / 4096.0; // 8 tokens attend to fewer than 16 from the start
        assert!(close(eight, weights + (row - weights) / 2.0), "{eight}");
        assert!(close(table.step_seconds(&prompts(&[(16, 0)])), 0.004));
        table.prefill_split = Some(PrefillSplit { prompts: vec![2, 4], seconds: vec![0.0; 6] });
        assert_eq!(table.validate(), Err(TableError::Axis("prefill_split.prompts")));
        table.prefill_split = Some(PrefillSplit { prompts: vec![1, 4], seconds: vec![0.0; 5] });
        assert!(matches!(table.validate(), Err(TableError::Size { name: "prefill_split.seconds", .. })));
    }

    #[test]
    fn a_step_beside_saves_is_slowed_by_the_share_of_their_time_that_reads_the_device() {
        let mut table = linear();
        assert_eq!(table.beside_saves(1e9), 1.0, "nothing measured, nothing charged");
        table.save_reads = Some(SaveReads { read_bytes_per_s: 4e9, step_slowdown: 1.8 });
        table.validate().unwrap();
        assert!((table.beside_saves(1e9) - 1.2).abs() < 1e-12, "a quarter of the save reads the device");
        assert!((table.beside_saves(8e9) - 1.8).abs() < 1e-12, "never more than reads back to back");
        table.save_reads = Some(SaveReads { read_bytes_per_s: 4e9, step_slowdown: 0.5 });
        assert!(matches!(table.validate(), Err(TableError::Time { name: "save_reads.step_slowdown", .. })));
    }
}
