//! A simulated rank's side of expert parallelism (issue 44): the real `dispatch`, `experts` and
//! `combine` operators move its messages between ranks, and it times them on the virtual clock.
//! A step's own part (attention, dense and shared weights, the head) is cut into equal segments
//! around its MoE layers; at each layer its rows route to `top_k` distinct experts by a seeded
//! draw, and each message carries, instead of floats, its bytes and the virtual instant it reaches
//! its receiver (a rank's sends at a layer share its link: latency plus all its remote bytes at the
//! link's rate). A rank runs its experts once every sender's rows have arrived and its device is
//! free, for the experts touched (their weights read) or the rows' FLOPs, whichever is longer; the
//! results go back the same way, and the step goes on once the last of them is in. So a layer
//! waits for its slowest rank, as a real exchange does, and the step ends when its last segment
//! does.
//!
//! Which time it holds: one step of the rank, from launch to the end of its last segment.
//! Which guarantee it carries: every (row, expert) pair dispatched gets its result or fails its
//! request by name; a step completes once, after its last MoE layer.

use super::contract::ExpertPlacement;
use crate::messages::{ExpertPair, ExpertRows, Payload};
use crate::sim::clock::ns_of_seconds;
use crate::sim::roofline::{Efficiency, Hardware, ModelShape};
use crate::step::{SeqKey, StepCompletion};
use kvflow_kernels::hash;
use kvflow_kernels::models::parts::moe::expert_owner;
use std::collections::BTreeSet;

/// The link a rank's expert exchanges cross.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExchangeLink {
    pub bytes_per_s: f64,
    pub latency_s: f64,
}

/// A rank's simulated experts.
pub struct SimExperts {
    pub place: ExpertPlacement,
    /// Routed experts of each MoE layer (by index among them), then of each draft pass.
    pub experts: Vec<usize>,
    /// How many of `experts` are the model's MoE layers (the rest are draft passes).
    pub model_layers: usize,
    pub top_k: usize,
    /// Bytes of one row (the hidden size at the KV dtype).
    pub row_bytes: usize,
    pub shape: ModelShape,
    pub hardware: Hardware,
    pub efficiency: Efficiency,
    pub link: ExchangeLink,
    pub seed: u64,
    /// When this rank's device is free for expert work while it has no step of its own.
    pub free_ns: u64,
    pub current: Option<InStep>,
}

/// The rank's step between its launch and its last MoE layer.
pub struct InStep {
    /// Where the step is on the rank's device.
    pub cursor_ns: u64,
    /// One segment of its own part.
    pub segment_ns: u64,
    pub started_ns: u64,
    /// Each token row's sequence and position; the sampled sequences' last rows (draft passes).
    pub rows: Vec<(SeqKey, usize)>,
    pub sampled_rows: Vec<(SeqKey, usize)>,
    pub completion: StepCompletion,
}

impl SimExperts {
    /// Starts `step`, its own part of `own_ns` cut into segments around its MoE layers.
    pub fn begin(&mut self, own_ns: u64, step: InStep) {
        let segment_ns = own_ns / (self.experts.len() as u64 + 1);
        self.current = Some(InStep { segment_ns, ..step });
    }

    /// Which `top_k` distinct experts of `n` a row routes to at layer `moe`.
    fn route(&self, (key, position): (SeqKey, usize), moe: usize, n: usize) -> Vec<usize> {
        let k = (key.index as u64) << 32 | key.generation as u64;
        let mut chosen = BTreeSet::new();
        let mut draw =
            hash::mix(hash::mix(hash::mix(hash::mix(hash::EMPTY, self.seed), k), position as u64), moe as u64);
        while chosen.len() < self.top_k.min(n) {
            chosen.insert((draw % n as u64) as usize);
            draw = hash::mix(draw, 3);
        }
        chosen.into_iter().collect()
    }

    /// Stamps `messages` (all sent by this rank at one instant `ready_ns`) with their arrival.
    fn send(&self, mut messages: Vec<ExpertRows>, ready_ns: u64) -> Vec<ExpertRows> {
        let remote: usize = messages.iter().filter(|m| m.to != m.from).map(|m| m.pairs.len() * self.row_bytes).sum();
        let crossing = ns_of_seconds(self.link.latency_s + remote as f64 / self.link.bytes_per_s);
        for m in &mut messages {
            let bytes = m.pairs.len() * self.row_bytes;
            let at_ns = if m.to == m.from { ready_ns } else { ready_ns + crossing };
            m.payload = Payload::Simulated { bytes, at_ns };
        }
        messages
    }

    pub fn dispatch(&mut self, moe: usize) -> Vec<ExpertRows> {
        let (Some(step), Some(&n)) = (self.current.as_mut(), self.experts.get(moe)) else { return Vec::new() };
        step.cursor_ns += step.segment_ns;
        let Some(step) = self.current.as_ref() else { return Vec::new() };
        let (ready, rows) = (step.cursor_ns, if moe < self.model_layers { &step.rows } else { &step.sampled_rows });
        let place = self.place;
        let mut out: Vec<ExpertRows> = (0..place.ranks)
            .map(|to| ExpertRows { moe, from: place.rank, to, pairs: Vec::new(), payload: Payload::Host(Vec::new()) })
            .collect();
        for (r, &row) in rows.iter().enumerate() {
            for e in self.route(row, moe, n) {
                out[expert_owner(n, e, place.ranks)].pairs.push((r as u32, e as u32));
            }
        }
        out.retain(|m| !m.pairs.is_empty());
        self.send(out, ready)
    }

    pub fn run_experts(&mut self, now_ns: u64, rows: &[ExpertRows]) -> Vec<ExpertRows> {
        if rows.is_empty() {
            return Vec::new();
        }
        let arrived = rows.iter().map(|m| arrival(&m.payload)).max().unwrap_or(0);
        let device = self.current.as_ref().map_or(self.free_ns, |s| s.cursor_ns);
        let start = device.max(now_ns).max(arrived);
        let touched: BTreeSet<u32> = rows.iter().flat_map(|m| m.pairs.iter().map(|p| p.1)).collect();
        let pairs: usize = rows.iter().map(|m| m.pairs.len()).sum();
        let memory =
            touched.len() as f64 * self.shape.expert_bytes / (self.hardware.bandwidth * self.efficiency.bandwidth);
        let matrix =
            2.0 * pairs as f64 * self.shape.expert_params / (self.hardware.matrix_flops * self.efficiency.matrix);
        let done = start + ns_of_seconds(memory.max(matrix));
        match self.current.as_mut() {
            Some(step) => step.cursor_ns = done,
            None => self.free_ns = done,
        }
        let results = rows.iter().map(|m| m.reply(self.place.rank, Payload::Host(Vec::new()))).collect();
        self.send(results, done)
    }

    /// Takes `moe`'s results; after the last MoE layer, the step's completion and its end.
    pub fn combine(
        &mut self,
        moe: usize,
        results: &[ExpertRows],
        missing: &[ExpertPair],
    ) -> Option<(u64, u64, StepCompletion)> {
        let step = self.current.as_mut()?;
        let back = results.iter().map(|m| arrival(&m.payload)).max().unwrap_or(0);
        step.cursor_ns = step.cursor_ns.max(back);
        let rows = if moe < self.model_layers { &step.rows } else { &step.sampled_rows };
        for miss in missing {
            let Some(&(key, _)) = rows.get(miss.row as usize) else { continue };
            if !step.completion.failed.iter().any(|(k, _)| *k == key) {
                let why = format!(
                    "MoE layer {moe}: expert {} on rank {} returned no result for this request's token (row {})",
                    miss.expert, miss.owner, miss.row
                );
                step.completion.failed.push((key, why));
            }
        }
        if moe + 1 < self.experts.len() {
            return None;
        }
        let step = self.current.take()?;
        let end = step.cursor_ns + step.segment_ns;
        self.free_ns = end;
        Some((step.started_ns, end, step.completion))
    }
}

/// When a simulated message is at its receiver (a message of another executor: at once).
fn arrival(payload: &Payload) -> u64 {
    match payload {
        Payload::Simulated { at_ns, .. } => *at_ns,
        _ => 0,
    }
}
