//! The analytic step cost (issue 44's cost model for models and machines one does not have): a
//! step's time is its launch overhead plus the larger of the bytes it must move through memory
//! at the machine's bandwidth and the FLOPs it must do at the machine's matrix rate, each scaled
//! by an efficiency fitted on measured steps ([`Efficiency::fit`]).
//!
//! The bytes: every dense weight once a step; each MoE layer's experts the step's tokens route to
//! (the expected count of distinct experts under uniform routing, so a decode of few rows reads
//! few experts and a long prefill reads them all); each row's KV up to its context; each
//! recurrent row's state, read and written. The FLOPs: two per active weight per token, plus
//! attention's two products over each token's context.

use super::StepShape;
use kvflow_kernels::models::Model;

/// What one step of a model costs, by the parts that scale differently.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    /// Weights every step reads whole (attention, dense MLPs, norms, LM head), in bytes.
    pub dense_bytes: f64,
    /// MoE layers, their experts each, the experts a token routes to, and one expert's bytes.
    pub moe_layers: usize,
    pub experts: usize,
    pub experts_per_token: usize,
    pub expert_bytes: f64,
    /// One routed expert's parameters.
    pub expert_params: f64,
    /// Weights a token computes with (dense and its routed experts), in parameters.
    pub active_params: f64,
    /// KV bytes one position holds over all layers.
    pub kv_bytes_per_position: f64,
    /// Attention FLOPs one token spends per position of its context (over all layers).
    pub attention_flops_per_position: f64,
    /// Recurrent state bytes of one row (0 without recurrent layers).
    pub state_bytes_per_row: f64,
}

/// The machine: memory bandwidth (bytes/s), matrix rate (FLOP/s) and a fixed cost a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hardware {
    pub bandwidth: f64,
    pub matrix_flops: f64,
    pub step_overhead_s: f64,
}

/// The fractions of the bandwidth and of the matrix rate real steps reach.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Efficiency {
    pub bandwidth: f64,
    pub matrix: f64,
}

impl Default for Efficiency {
    fn default() -> Self {
        Efficiency { bandwidth: 1.0, matrix: 1.0 }
    }
}

impl ModelShape {
    /// The shape of `model` with its weights in `weight_bytes` bytes each and its KV cache in
    /// `kv_bytes` (the recurrent state stays f32). Routed experts count apart from the dense
    /// weights: a step reads only those its tokens route to.
    pub fn of(model: &Model, weight_bytes: usize, kv_bytes: usize) -> ModelShape {
        let moe = model.moe_layers();
        let experts = moe.iter().map(|&(_, n)| n).max().unwrap_or(0);
        let total_experts: usize = moe.iter().map(|&(_, n)| n).sum();
        let per_token = model.experts_per_token();
        // f32 bytes of the experts held, so params of one expert:
        let expert_params = (model.expert_bytes() / 4).checked_div(total_experts).unwrap_or(0) as f64;
        let active = (model.body_macs_per_token() + model.lm_head_macs()) as f64;
        let routed_active = (moe.len() * per_token) as f64 * expert_params;
        let ctx = 4096;
        ModelShape {
            dense_bytes: (active - routed_active).max(0.0) * weight_bytes as f64,
            moe_layers: moe.len(),
            experts,
            experts_per_token: per_token,
            expert_bytes: expert_params * weight_bytes as f64,
            expert_params,
            active_params: active,
            kv_bytes_per_position: (model.kv_row_widths().iter().sum::<usize>() * kv_bytes) as f64,
            attention_flops_per_position: 2.0 * model.attention_macs(ctx) as f64 / ctx as f64,
            state_bytes_per_row: (model.state_width() * 4) as f64,
        }
    }

    /// The step without its routed experts (an expert-parallel rank's own part: its experts run
    /// over the rows every rank sends them, costed apart).
    pub fn without_routed_experts(&self) -> ModelShape {
        let routed = (self.moe_layers * self.experts_per_token) as f64 * self.expert_params;
        ModelShape { moe_layers: 0, active_params: (self.active_params - routed).max(0.0), ..self.clone() }
    }

    /// Expected distinct experts `tokens` tokens route to in one MoE layer (uniform routing).
    pub fn experts_touched(&self, tokens: usize) -> f64 {
        if self.experts == 0 || tokens == 0 {
            return 0.0;
        }
        let e = self.experts as f64;
        let miss = 1.0 - (self.experts_per_token.min(self.experts) as f64 / e);
        e * (1.0 - miss.powf(tokens as f64))
    }

    /// Bytes `step` moves through memory.
    pub fn bytes(&self, step: &StepShape) -> f64 {
        let tokens = step.tokens();
        let experts = self.moe_layers as f64 * self.experts_touched(tokens) * self.expert_bytes;
        let rows = (step.decode_rows + step.prefill_rows) as f64;
        self.dense_bytes
            + experts
            + step.context_positions as f64 * self.kv_bytes_per_position
            + 2.0 * rows * self.state_bytes_per_row
    }

    /// FLOPs `step` does.
    pub fn flops(&self, step: &StepShape) -> f64 {
        2.0 * self.active_params * step.tokens() as f64
            + step.attended_positions as f64 * self.attention_flops_per_position
    }
}

/// The step's time on `hw` at `eff`, in seconds.
pub fn step_seconds(model: &ModelShape, hw: &Hardware, eff: &Efficiency, step: &StepShape) -> f64 {
    let (memory, matrix) = parts(model, hw, step);
    hw.step_overhead_s + (memory / eff.bandwidth).max(matrix / eff.matrix)
}

/// The step's memory time and matrix time at full efficiency.
fn parts(model: &ModelShape, hw: &Hardware, step: &StepShape) -> (f64, f64) {
    (model.bytes(step) / hw.bandwidth, model.flops(step) / hw.matrix_flops)
}

impl Efficiency {
    /// The efficiencies that explain `measured` steps (shape, seconds) best: each step is
    /// assigned to the side its roofline says bounds it, and each side's efficiency is the median
    /// of its steps' ideal time over their measured time (less the overhead). A side no step
    /// falls on keeps 1.0.
    pub fn fit(model: &ModelShape, hw: &Hardware, measured: &[(StepShape, f64)]) -> Efficiency {
        let (mut memory, mut matrix) = (Vec::new(), Vec::new());
        for (step, seconds) in measured {
            let busy = seconds - hw.step_overhead_s;
            if busy <= 0.0 {
                continue;
            }
            let (m, x) = parts(model, hw, step);
            if m >= x {
                memory.push(m / busy);
            } else {
                matrix.push(x / busy);
            }
        }
        Efficiency { bandwidth: median(memory).unwrap_or(1.0), matrix: median(matrix).unwrap_or(1.0) }
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe() -> ModelShape {
        ModelShape {
            dense_bytes: 2e9,
            moe_layers: 10,
            experts: 64,
            experts_per_token: 4,
            expert_bytes: 1e7,
            expert_params: 5e6,
            active_params: 1.2e9,
            kv_bytes_per_position: 1e5,
            attention_flops_per_position: 4e5,
            state_bytes_per_row: 0.0,
        }
    }

    const H200: Hardware = Hardware { bandwidth: 4.8e12, matrix_flops: 9.9e14, step_overhead_s: 2e-5 };

    #[test]
    fn a_decode_is_bound_by_memory_and_a_long_prefill_by_the_matrix_rate() {
        let m = moe();
        let decode = StepShape::decode(8, 8 * 1000);
        let prefill = StepShape::prefill(8192, 8192);
        let ((dm, dx), (pm, px)) = (parts(&m, &H200, &decode), parts(&m, &H200, &prefill));
        assert!(dm > dx, "decode: memory {dm} s, matrix {dx} s");
        assert!(px > pm, "prefill: memory {pm} s, matrix {px} s");
        // Few tokens read few experts, many read them all.
        assert!((m.experts_touched(1) - 4.0).abs() < 1e-9);
        assert!(m.experts_touched(8192) > 63.99);
        // More context costs more; time grows with the work.
        let longer = StepShape::decode(8, 8 * 4000);
        let e = Efficiency::default();
        assert!(step_seconds(&m, &H200, &e, &longer) > step_seconds(&m, &H200, &e, &decode));
    }

    #[test]
    fn fitted_efficiencies_recover_the_ones_that_made_the_measurements() {
        let m = moe();
        let truth = Efficiency { bandwidth: 0.62, matrix: 0.41 };
        let measured: Vec<(StepShape, f64)> = [(1, 100), (8, 8000), (64, 64_000), (0, 0)]
            .iter()
            .map(|&(rows, ctx)| StepShape::decode(rows, ctx))
            .chain([2048, 4096, 8192].iter().map(|&n| StepShape::prefill(n, n)))
            .filter(|s| s.tokens() > 0)
            .map(|s| {
                let t = step_seconds(&m, &H200, &truth, &s);
                (s, t)
            })
            .collect();
        let fitted = Efficiency::fit(&m, &H200, &measured);
        assert!((fitted.bandwidth - truth.bandwidth).abs() < 1e-9, "{fitted:?}");
        assert!((fitted.matrix - truth.matrix).abs() < 1e-9, "{fitted:?}");
    }
}
