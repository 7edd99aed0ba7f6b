//! `sim`: a simulated rank (issue 44). A step computes nothing: its duration comes from a cost
//! model over its shape (`crate::sim`: a roofline over the model's config and a machine, or a
//! table measured on a device), and it completes when the run's virtual clock reaches its end.
//! Steps run one after another on the simulated device, as on a GPU's stream: a step launched
//! while another runs starts when that one ends. Before the device, a step takes the rank's host
//! thread: launching it and the engine's own work a step (measured into the table by
//! `kvflow bench calibrate`, plus `host_us_per_step`), one step after another, so a step reaches
//! the device no sooner than the host has it ready; one that starts after the device sat idle
//! takes the wake-up the table measured, and one beside the rank's simulated saves (which read
//! its blocks off the device) is slower by what the table measured for such reads. Its tokens
//! are a seeded draw per (sequence, position), the same every run.
//!
//! Settings: `table = "calibration.json"` (a measured table; else the roofline, with
//! `bandwidth_gbps` (4800), `matrix_tflops` (989), `step_overhead_us` (30),
//! `efficiency_bandwidth` (0.8), `efficiency_matrix` (0.6) — an H200's figures by default),
//! `host_us_per_step` (0: host time a step beyond what the table measured),
//! `dtype = "bfloat16" | "float32"` (the bytes a weight and a KV element take; bfloat16),
//! `seed` (0), `draft_acceptance` (0.7: the chance a draft holds, under speculative decoding),
//! and for an expert-parallel pool (`sim_experts.rs`; costed by the roofline)
//! `expert_link_gbps` (450: a rank's link for its expert exchanges) and `expert_link_latency_us`
//! (5).
//!
//! Which time it holds: the rank's step, from launch to its completion's virtual instant.
//! Which guarantee it carries: completions in launch order, each once, never before their time.

use super::contract::{Executor, ExecutorContext, ExecutorKind, ExpertParallel};
use super::settings::{SettingError, Settings};
use super::sim_experts::{ExchangeLink, InStep, SimExperts};
use crate::messages::{ExpertPair, ExpertRows};
use crate::pool::wake::RankWaker;
use crate::sim::clock::{ns_of_seconds, VirtualClock};
use crate::sim::roofline::{step_seconds, Efficiency, Hardware, ModelShape};
use crate::sim::table::MeasuredTable;
use crate::sim::StepShape;
use crate::step::{DraftCheck, Exported, Sampled, StepCompletion, StepLaunch};
use crate::transfer::SimulatedPayload;
use kvflow_kernels::hash;
use std::collections::VecDeque;
use std::sync::Arc;

const KEYS: &[&str] = &[
    "table",
    "bandwidth_gbps",
    "matrix_tflops",
    "step_overhead_us",
    "host_us_per_step",
    "efficiency_bandwidth",
    "efficiency_matrix",
    "dtype",
    "seed",
    "draft_acceptance",
    "expert_link_gbps",
    "expert_link_latency_us",
];

/// What a step costs.
pub enum StepCost {
    Roofline { model: ModelShape, hardware: Hardware, efficiency: Efficiency },
    Measured(Box<MeasuredTable>),
}

impl StepCost {
    /// The device's time.
    pub fn seconds(&self, step: &StepShape) -> f64 {
        match self {
            StepCost::Roofline { model, hardware, efficiency } => step_seconds(model, hardware, efficiency, step),
            StepCost::Measured(table) => table.step_seconds(step),
        }
    }

    /// The host's time (what the table measured; the roofline knows none).
    pub fn host_seconds(&self, step: &StepShape) -> f64 {
        match self {
            StepCost::Roofline { .. } => 0.0,
            StepCost::Measured(table) => table.host_step_seconds(step),
        }
    }

    /// The device's extra time for a step that starts after `gap_ns` idle (what the table
    /// measured; the roofline knows none).
    pub fn idle_seconds(&self, gap_ns: u64) -> f64 {
        match self {
            StepCost::Roofline { .. } => 0.0,
            StepCost::Measured(table) => table.idle_seconds(gap_ns),
        }
    }

    /// How much slower a step runs beside saves at `save_bytes_per_s` (what the table measured;
    /// the roofline knows nothing of it).
    pub fn beside_saves(&self, save_bytes_per_s: f64) -> f64 {
        match self {
            StepCost::Roofline { .. } => 1.0,
            StepCost::Measured(table) => table.beside_saves(save_bytes_per_s),
        }
    }
}

/// The end of a step of `work_ns` starting at `start` when it runs `slowdown` times slower until
/// `slow_until` (the rank's saves reading the device).
fn end_beside_saves(start: u64, work_ns: u64, slow_until: u64, slowdown: f64) -> u64 {
    let slow = slow_until.saturating_sub(start) as f64;
    if slow == 0.0 || slowdown <= 1.0 {
        return start + work_ns;
    }
    let done_while_slow = slow / slowdown;
    if done_while_slow >= work_ns as f64 {
        return start + (work_ns as f64 * slowdown).round() as u64;
    }
    slow_until + (work_ns as f64 - done_while_slow).round() as u64
}

/// The settings, read.
struct SimSettings {
    table: Option<String>,
    hardware: Hardware,
    efficiency: Efficiency,
    host_s_per_step: f64,
    element_bytes: usize,
    seed: u64,
    draft_acceptance: f64,
    expert_link: ExchangeLink,
}

fn read_settings(table: &toml::Table) -> Result<SimSettings, SettingError> {
    let s = Settings::new(table, KEYS)?;
    let acceptance = s.number("draft_acceptance", 0.7)?;
    if acceptance > 1.0 {
        let message = format!("expected a chance between 0 and 1, got {acceptance}");
        return Err(SettingError { key: "draft_acceptance".into(), message });
    }
    Ok(SimSettings {
        table: s.text("table")?.map(str::to_string),
        hardware: Hardware {
            bandwidth: s.number("bandwidth_gbps", 4800.0)? * 1e9,
            matrix_flops: s.number("matrix_tflops", 989.0)? * 1e12,
            step_overhead_s: s.number("step_overhead_us", 30.0)? * 1e-6,
        },
        efficiency: Efficiency {
            bandwidth: s.number("efficiency_bandwidth", 0.8)?.min(1.0),
            matrix: s.number("efficiency_matrix", 0.6)?.min(1.0),
        },
        host_s_per_step: s.number("host_us_per_step", 0.0)? * 1e-6,
        element_bytes: if s.choice("dtype", &["bfloat16", "float32"], "bfloat16")? == "float32" { 4 } else { 2 },
        seed: s.count("seed", 0)?,
        draft_acceptance: acceptance,
        expert_link: ExchangeLink {
            bytes_per_s: s.number("expert_link_gbps", 450.0)? * 1e9,
            latency_s: s.number("expert_link_latency_us", 5.0)? * 1e-6,
        },
    })
}

/// Reads a measured table (JSON, as `kvflow bench calibrate` writes it), checked.
pub fn read_table(path: &str) -> Result<MeasuredTable, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("executor_settings.table: cannot read {path}: {e}"))?;
    let table: MeasuredTable =
        serde_json::from_str(&text).map_err(|e| format!("executor_settings.table: {path} is not a step table: {e}"))?;
    table.validate().map_err(|e| format!("executor_settings.table: {path}: {e}"))?;
    Ok(table)
}

pub struct SimKind;

impl ExecutorKind for SimKind {
    fn check(&self, settings: &toml::Table) -> Result<(), SettingError> {
        read_settings(settings).map(|_| ())
    }

    fn build(&self, settings: &toml::Table, ctx: ExecutorContext) -> Result<Box<dyn Executor>, String> {
        let s = read_settings(settings).map_err(|e| e.to_string())?;
        let clock = ctx.clock.clone().ok_or("executor sim runs only in a simulated run (every pool's executor sim)")?;
        let shape = ModelShape::of(&ctx.model, s.element_bytes, s.element_bytes);
        let cost = match &s.table {
            Some(_) if ctx.experts.is_some() => {
                return Err("executor_settings.table: an expert-parallel sim pool is costed by the roofline (a \
                            measured table times whole steps of one device); leave `table` out"
                    .into())
            }
            Some(path) => StepCost::Measured(Box::new(read_table(path)?)),
            None => StepCost::Roofline { model: shape.clone(), hardware: s.hardware, efficiency: s.efficiency },
        };
        let experts = ctx.experts.map(|place| {
            let mut experts: Vec<usize> = ctx.model.moe_layers().iter().map(|&(_, n)| n).collect();
            let model_layers = experts.len();
            let passes = super::draft_passes(&ctx.model, true, ctx.mtp_drafts);
            experts.extend(ctx.model.mtp().map(|m| vec![m.num_experts(); passes]).unwrap_or_default());
            SimExperts {
                place,
                experts,
                model_layers,
                top_k: ctx.model.experts_per_token(),
                row_bytes: ctx.model.hidden_size * s.element_bytes,
                shape,
                hardware: s.hardware,
                efficiency: s.efficiency,
                link: s.expert_link,
                seed: s.seed,
                free_ns: 0,
                current: None,
            }
        });
        Ok(Box::new(SimExecutor {
            clock,
            waker: ctx.waker.clone(),
            cost,
            host_s_per_step: s.host_s_per_step,
            vocab: ctx.model.vocab_size.max(1) as u64,
            seed: s.seed,
            acceptance: s.draft_acceptance,
            mtp_drafts: ctx.mtp_drafts,
            state_floats: if ctx.layout.keeps_state { ctx.model.state_width() } else { 0 },
            order: ctx.rank as u64,
            host_free_ns: 0,
            device_free_ns: 0,
            in_flight: VecDeque::new(),
            busy_ns: 0,
            experts,
            saves: ctx.saves.clone(),
            waiting: VecDeque::new(),
            start_wake_ns: 0,
        }))
    }
}

/// One rank's simulated device.
pub struct SimExecutor {
    clock: Arc<VirtualClock>,
    waker: Arc<RankWaker>,
    cost: StepCost,
    host_s_per_step: f64,
    vocab: u64,
    seed: u64,
    acceptance: f64,
    mtp_drafts: usize,
    /// The floats of a state slot an export would copy (0 without recurrent state).
    state_floats: usize,
    order: u64,
    /// When the host has launched the last step: the next launch starts then at the earliest.
    host_free_ns: u64,
    /// When the step last launched ends: the next one starts then at the earliest.
    device_free_ns: u64,
    /// Launched steps, in launch order, each with its end.
    in_flight: VecDeque<(u64, StepCompletion)>,
    /// Time the device spent on steps.
    busy_ns: u64,
    /// An expert-parallel rank's experts: its steps complete after their last MoE layer.
    experts: Option<SimExperts>,
    /// Until when the rank's simulated saves run (`store = "sim"`).
    saves: Option<Arc<crate::offload::SavesBusy>>,
    /// Beside saves: steps launched that have not started on the device, each with when the
    /// host has it ready and its shape. They are priced at their start, when the saves handed
    /// over by then are known (a step launched ahead of the device runs beside the saves of
    /// its start, not its launch).
    waiting: VecDeque<(u64, StepShape, StepCompletion)>,
    /// The instant a wake-up for the next waiting step's start is queued for (0: none).
    start_wake_ns: u64,
}

impl SimExecutor {
    /// A draw in `[0, 1)` keyed on the sequence, a position and what it is for.
    fn draw(&self, key: crate::step::SeqKey, position: usize, what: u64) -> u64 {
        let k = (key.index as u64) << 32 | key.generation as u64;
        hash::mix(hash::mix(hash::mix(hash::mix(hash::EMPTY, self.seed), k), position as u64), what)
    }

    fn token(&self, key: crate::step::SeqKey, position: usize) -> (u32, u64) {
        let d = self.draw(key, position, 1);
        ((d % self.vocab) as u32, d)
    }

    fn holds(&self, key: crate::step::SeqKey, position: usize) -> bool {
        ((self.draw(key, position, 2) >> 11) as f64 / (1u64 << 53) as f64) < self.acceptance
    }

    fn sampled(&self, step: &StepLaunch<'_>) -> Vec<Sampled> {
        let mut out = Vec::with_capacity(step.sampling.len());
        for seq in step.seqs().filter(|s| s.sample) {
            let first = seq.start_pos + seq.len() - seq.drafts.len();
            let (token, hash) = self.token(seq.key, first);
            let mut s = Sampled::one(seq.key, Some(token), hash);
            for (i, &draft) in seq.drafts.iter().enumerate() {
                let (next, next_hash) = self.token(seq.key, first + i + 1);
                s.checks.push(DraftCheck {
                    kept: draft == token || self.holds(seq.key, first + i),
                    next: Some(next),
                    next_hash,
                });
            }
            let last = first + s.kept_drafts();
            s.drafts = (0..self.mtp_drafts).map(|i| self.token(seq.key, last + 1 + i).0).collect();
            out.push(s);
        }
        out
    }

    /// Time the simulated device spent on steps.
    pub fn busy_ns(&self) -> u64 {
        self.busy_ns
    }

    /// A step's time on the device starting at `start`, the device free since `device_free`:
    /// its shape's cost, plus the wake-up after that idle gap (none before the first step).
    fn device_ns(&self, shape: &StepShape, start: u64, device_free: u64) -> u64 {
        let idle = if self.busy_ns == 0 { 0 } else { start - device_free };
        ns_of_seconds(self.cost.seconds(shape) + self.cost.idle_seconds(idle))
    }

    /// Starts the waiting steps whose start has come (the device free, the host done), each
    /// priced beside the saves running then; a wake-up for the next one's start otherwise.
    fn start_due(&mut self) {
        let now = self.clock.now_ns();
        while let Some(&(ready, shape, _)) = self.waiting.front() {
            let start = self.device_free_ns.max(ready);
            if start > now {
                if self.start_wake_ns != start {
                    self.start_wake_ns = start;
                    let waker = self.waker.clone();
                    self.clock.at(start, self.order, Box::new(move || waker.wake()));
                }
                return;
            }
            let took = self.device_ns(&shape, start, self.device_free_ns);
            let saves = self.saves.as_ref().map_or((0, 1.0), |s| (s.until_ns(), self.cost.beside_saves(s.bytes_per_s)));
            let end = end_beside_saves(start, took, saves.0, saves.1);
            let (_, _, completion) = self.waiting.pop_front().expect("the front was there");
            self.complete_at(start, end, completion);
        }
    }

    /// The step that ran from `start` completes at `end`.
    fn complete_at(&mut self, start: u64, end: u64, completion: StepCompletion) {
        self.device_free_ns = end;
        self.busy_ns += end - start;
        self.in_flight.push_back((end, completion));
        let waker = self.waker.clone();
        self.clock.at(end, self.order, Box::new(move || waker.wake()));
    }
}

impl ExpertParallel for SimExecutor {
    fn dispatch(&mut self, moe: usize) -> Vec<ExpertRows> {
        self.experts.as_mut().map_or_else(Vec::new, |e| e.dispatch(moe))
    }

    fn run_experts(&mut self, _moe: usize, rows: &[ExpertRows]) -> Vec<ExpertRows> {
        let now = self.clock.now_ns();
        self.experts.as_mut().map_or_else(Vec::new, |e| e.run_experts(now, rows))
    }

    fn combine(&mut self, moe: usize, results: Vec<ExpertRows>, missing: &[ExpertPair]) {
        if let Some((start, end, completion)) = self.experts.as_mut().and_then(|e| e.combine(moe, &results, missing)) {
            self.complete_at(start, end, completion);
        }
    }
}

impl Executor for SimExecutor {
    fn phases(&self) -> usize {
        1
    }

    /// As many as the cuda executor it stands for.
    fn max_in_flight(&self) -> Option<usize> {
        Some(super::cuda::STEPS_IN_FLIGHT)
    }

    fn launch(&mut self, step: &StepLaunch<'_>, _phase: usize) {
        let shape = StepShape::of(step);
        let host = ns_of_seconds(self.cost.host_seconds(&shape) + self.host_s_per_step);
        self.host_free_ns = self.host_free_ns.max(self.clock.now_ns()) + host;
        let device_free = self.device_free_ns.max(self.experts.as_ref().map_or(0, |e| e.free_ns));
        let start = device_free.max(self.host_free_ns);
        let mut completion = StepCompletion::of(step.step, Ok(self.sampled(step)));
        // What a step copies out carries no bytes here (nothing was computed), only its sizes.
        let simulated = Some(SimulatedPayload { state_floats: self.state_floats });
        completion.exports = step
            .exports
            .iter()
            .map(|e| Exported { key: e.key, kv: Vec::new(), source: None, state: None, simulated })
            .collect();
        if let (Some(experts), StepCost::Roofline { model, hardware, efficiency }) = (&mut self.experts, &self.cost) {
            // Its own part now; its experts' part as its MoE layers' exchanges run.
            let own = ns_of_seconds(step_seconds(&model.without_routed_experts(), hardware, efficiency, &shape));
            let rows = step.seqs().flat_map(|s| (0..s.len()).map(move |i| (s.key, s.start_pos + i))).collect();
            let sampled_rows = step.seqs().filter(|s| s.sample).map(|s| (s.key, s.start_pos + s.len() - 1)).collect();
            let in_step = InStep { cursor_ns: start, segment_ns: 0, started_ns: start, rows, sampled_rows, completion };
            experts.begin(own, in_step);
            return;
        }
        if self.saves.is_some() {
            self.waiting.push_back((self.host_free_ns, shape, completion));
            self.start_due();
            return;
        }
        let took = self.device_ns(&shape, start, device_free);
        self.complete_at(start, start + took, completion);
    }

    fn poll(&mut self, out: &mut Vec<StepCompletion>) {
        self.start_due();
        let now = self.clock.now_ns();
        while self.in_flight.front().is_some_and(|(end, _)| *end <= now) {
            out.extend(self.in_flight.pop_front().map(|(_, c)| c));
        }
    }

    fn flush(&mut self) {}

    fn expert_parallel(&mut self) -> Option<&mut dyn ExpertParallel> {
        match self.experts {
            Some(_) => Some(self),
            None => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_beside_saves_runs_slower_only_while_they_run() {
        assert_eq!(end_beside_saves(100, 1_000, 0, 2.0), 1_100, "no saves");
        assert_eq!(end_beside_saves(100, 1_000, 5_000, 2.0), 2_100, "saves all along");
        // 400 ns beside saves do 200 ns of its work; the other 800 at full speed
        assert_eq!(end_beside_saves(100, 1_000, 500, 2.0), 1_300);
        assert_eq!(end_beside_saves(100, 1_000, 500, 1.0), 1_100, "saves that cost nothing");
    }

    #[test]
    fn settings_name_a_bad_key_and_the_roofline_is_the_default() {
        let bad: toml::Table = toml::from_str("draft_acceptance = 1.5\n").unwrap();
        assert_eq!(read_settings(&bad).err().unwrap().key, "draft_acceptance");
        let bad: toml::Table = toml::from_str("bandwidth_gbps = 0\n").unwrap();
        assert_eq!(read_settings(&bad).err().unwrap().key, "bandwidth_gbps");
        let s = read_settings(&toml::Table::new()).unwrap();
        assert!(s.table.is_none() && s.element_bytes == 2 && s.hardware.bandwidth == 4.8e12);
    }
}
