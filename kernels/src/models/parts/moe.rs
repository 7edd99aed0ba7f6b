//! Mixture-of-experts blocks: a router, routed SwiGLU experts and optional shared experts.
//!
//! Routing is computed per token from that token's router logits alone; experts run as one
//! batch-invariant product per expert over the tokens routed to it; each token then sums its
//! experts' outputs in ascending expert order (as transformers' `index_add_` loop does) and adds
//! the shared experts. A token's result therefore never depends on the other tokens.
//!
//! Expert parallelism splits the same block three ways without changing a bit: the token's own
//! rank routes it ([`MoeBlock::route_rows`]) and computes its shared experts, the ranks owning its
//! experts run them ([`MoeBlock::run_expert`], a block may hold only a contiguous range of its
//! experts, [`expert_range`]), and the token's rank sums what comes back ([`MoeBlock::combine`])
//! in ascending expert order — the order [`MoeBlock::forward`] uses, through the same code.

use super::layers::{Linear, Mlp};
use crate::checkpoint::{LoadError, WeightSource};
use crate::cpu::activation::sigmoid;
use std::ops::Range;

/// The experts rank `rank` of `ranks` owns: the contiguous range `rank·n/ranks .. (rank+1)·n/ranks`,
/// so ranges differ by at most one expert when the count does not divide (a rank owns none when
/// there are fewer experts than ranks).
pub fn expert_range(num_experts: usize, rank: usize, ranks: usize) -> Range<usize> {
    let ranks = ranks.max(1);
    rank * num_experts / ranks..(rank + 1) * num_experts / ranks
}

/// The rank of `ranks` owning `expert` (the inverse of [`expert_range`]).
pub fn expert_owner(num_experts: usize, expert: usize, ranks: usize) -> usize {
    (0..ranks).find(|&r| expert_range(num_experts, r, ranks).contains(&expert)).unwrap_or(0)
}

/// The weights one rank of an expert-parallel pool loads: everything `inner` holds except the
/// routed experts of other ranks (each MoE layer's experts split in contiguous ranges,
/// [`expert_range`]).
pub struct ExpertShard<'a> {
    pub inner: &'a dyn WeightSource,
    pub rank: usize,
    pub ranks: usize,
}

impl WeightSource for ExpertShard<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, LoadError> {
        self.inner.tensor(name, shape)
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn shapes_only(&self) -> bool {
        self.inner.shapes_only()
    }

    fn experts_to_load(&self, num_experts: usize) -> std::ops::Range<usize> {
        expert_range(num_experts, self.rank, self.ranks)
    }
}

/// How router logits become expert scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    /// `sigmoid(logit)` per expert (DeepSeek-V3, Kimi).
    Sigmoid,
    /// `softmax(logits)` over experts (Qwen MoE).
    Softmax,
}

/// The routing rule of a MoE layer.
#[derive(Clone, Debug)]
pub struct Routing {
    pub num_experts: usize,
    pub top_k: usize,
    pub scoring: Scoring,
    /// Added to the scores for choosing experts only (`e_score_correction_bias`).
    pub correction_bias: Option<Vec<f32>>,
    /// Experts are split into `n_group` groups; a token may only use the `topk_group` groups
    /// with the largest sum of their two best scores.
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    /// Multiplies the final weights (`routed_scaling_factor`).
    pub scaling: f32,
}

/// Indices of the `k` largest values (ties: lower index first).
fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

impl Routing {
    /// `(expert, weight)` pairs for one token, in ascending expert order.
    pub fn route(&self, logits: &[f32]) -> Vec<(usize, f32)> {
        let n = self.num_experts;
        let scores: Vec<f32> = match self.scoring {
            Scoring::Sigmoid => logits.iter().map(|&l| sigmoid(l)).collect(),
            Scoring::Softmax => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
                let sum: f32 = exps.iter().sum();
                exps.iter().map(|e| e / sum).collect()
            }
        };
        let mut choice: Vec<f32> = match &self.correction_bias {
            Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
            None => scores.clone(),
        };
        if self.n_group > 1 {
            let per = n / self.n_group;
            let group_scores: Vec<f32> =
                choice.chunks_exact(per).map(|g| top_k_indices(g, 2).iter().map(|&i| g[i]).sum()).collect();
            let keep = top_k_indices(&group_scores, self.topk_group);
            for (g, chunk) in choice.chunks_exact_mut(per).enumerate() {
                if !keep.contains(&g) {
                    chunk.fill(f32::NEG_INFINITY);
                }
            }
        }
        let mut chosen = top_k_indices(&choice, self.top_k);
        let mut weights: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
        if self.norm_topk_prob {
            let denominator: f32 =
                weights.iter().sum::<f32>() + if self.scoring == Scoring::Sigmoid { 1e-20 } else { 0.0 };
            weights.iter_mut().for_each(|w| *w /= denominator);
        }
        weights.iter_mut().for_each(|w| *w *= self.scaling);
        let mut pairs: Vec<(usize, f32)> = chosen.drain(..).zip(weights).collect();
        pairs.sort_by_key(|p| p.0);
        pairs
    }
}

/// A MoE feed-forward block.
pub struct MoeBlock {
    pub router: Linear,
    pub routing: Routing,
    /// The experts this block holds: `first_expert..first_expert + experts.len()` of
    /// `routing.num_experts` (all of them, unless it was loaded for one rank of an
    /// expert-parallel pool).
    pub experts: Vec<Mlp>,
    pub first_expert: usize,
    pub shared: Option<Mlp>,
    /// Qwen-style scalar gate on the shared expert: `sigmoid(x·g) · shared(x)`.
    pub shared_gate: Option<Linear>,
}

impl MoeBlock {
    pub fn forward(&self, x: &[f32], t: usize) -> Vec<f32> {
        assert!(self.holds_every_expert(), "a block holding experts {:?} runs only expert parallel", self.held());
        let hidden = self.router.in_dim();
        // 1. router logits and per-token routes                    [t × experts]
        let routes = self.route_rows(x, t);
        // 2. each expert runs once over the tokens routed to it
        let mut tokens_of: Vec<Vec<usize>> = vec![Vec::new(); self.experts.len()];
        for (r, route) in routes.iter().enumerate() {
            for &(e, _) in route {
                tokens_of[e].push(r);
            }
        }
        let outputs: Vec<Vec<f32>> = tokens_of
            .iter()
            .enumerate()
            .map(|(e, rows)| {
                if rows.is_empty() {
                    return Vec::new();
                }
                let gathered: Vec<f32> =
                    rows.iter().flat_map(|&r| x[r * hidden..(r + 1) * hidden].iter().copied()).collect();
                self.experts[e].forward(&gathered, rows.len())
            })
            .collect();
        // 3. each token sums its experts in ascending order, then adds the shared experts
        let mut cursor = vec![0usize; self.experts.len()];
        let mut at = Vec::with_capacity(routes.len());
        for route in &routes {
            at.push(
                route
                    .iter()
                    .map(|&(e, _)| {
                        cursor[e] += 1;
                        cursor[e] - 1
                    })
                    .collect::<Vec<_>>(),
            );
        }
        self.combine(x, t, &routes, |r, k| {
            let (e, i) = (routes[r][k].0, at[r][k]);
            &outputs[e][i * hidden..(i + 1) * hidden]
        })
    }

    /// Each row's `(expert, weight)` pairs, ascending by expert (the router on the row alone).
    pub fn route_rows(&self, x: &[f32], t: usize) -> Vec<Vec<(usize, f32)>> {
        let logits = self.router.forward(x, t);
        logits.chunks_exact(self.routing.num_experts).map(|l| self.routing.route(l)).collect()
    }

    /// Runs expert `expert` over `n` rows `[n × hidden]`, or `None` when this block does not hold
    /// it. A row's output does not depend on the other rows.
    pub fn run_expert(&self, expert: usize, rows: &[f32], n: usize) -> Option<Vec<f32>> {
        let mlp = self.experts.get(expert.checked_sub(self.first_expert)?)?;
        Some(mlp.forward(rows, n))
    }

    /// The block's output for `t` rows `x` routed as `routes`, given each row's expert outputs:
    /// `expert_out(r, k)` is the output `[hidden]` of row `r`'s `k`-th expert (ascending order).
    /// Each row sums `weight · output` in ascending expert order, then adds the shared experts.
    pub fn combine<'y>(
        &self,
        x: &[f32],
        t: usize,
        routes: &[Vec<(usize, f32)>],
        expert_out: impl Fn(usize, usize) -> &'y [f32],
    ) -> Vec<f32> {
        let hidden = self.router.in_dim();
        let mut out = vec![0.0f32; t * hidden];
        for (r, route) in routes.iter().enumerate() {
            let acc = &mut out[r * hidden..(r + 1) * hidden];
            for (k, &(_, w)) in route.iter().enumerate() {
                for (a, v) in acc.iter_mut().zip(expert_out(r, k)) {
                    *a += v * w;
                }
            }
        }
        if let Some(shared) = &self.shared {
            let s = shared.forward(x, t);
            let gates = self.shared_gate.as_ref().map(|g| g.forward(x, t));
            for r in 0..t {
                let gate = gates.as_ref().map_or(1.0, |g| sigmoid(g[r]));
                for (a, v) in out[r * hidden..(r + 1) * hidden].iter_mut().zip(&s[r * hidden..(r + 1) * hidden]) {
                    *a += if gates.is_some() { gate * v } else { *v };
                }
            }
        }
        out
    }

    /// The experts this block holds.
    pub fn held(&self) -> Range<usize> {
        self.first_expert..self.first_expert + self.experts.len()
    }

    pub fn holds_every_expert(&self) -> bool {
        self.held() == (0..self.routing.num_experts)
    }

    /// Bytes of the routed experts' weights this block holds.
    pub fn expert_bytes(&self) -> usize {
        self.experts.iter().map(|e| e.macs_per_row() * std::mem::size_of::<f32>()).sum()
    }

    /// Multiply-adds per token: router, the `top_k` routed experts, shared experts.
    pub fn macs_per_row(&self) -> usize {
        self.router.macs_per_row()
            + self.routing.top_k * self.experts.first().map_or(0, Mlp::macs_per_row)
            + self.shared.as_ref().map_or(0, Mlp::macs_per_row)
            + self.shared_gate.as_ref().map_or(0, Linear::macs_per_row)
    }
}

/// A DeepSeek-style MoE layer as stored under `{prefix}` (`gate` with its
/// `e_score_correction_bias`, `experts`, `shared_experts`): sigmoid scores, grouped top-k,
/// scaled weights, ungated shared experts. DeepSeek-V3/V3.2 and Kimi Linear use it.
pub(crate) struct SigmoidMoe<'a> {
    pub prefix: &'a str,
    pub hidden: usize,
    pub inter: usize,
    /// Expert projection names: `[gate, up, down]`.
    pub expert_names: [&'a str; 3],
    /// Intermediate size of the shared experts together (0: none).
    pub shared_inter: usize,
    /// `correction_bias` is read from the checkpoint; the other fields are the rule.
    pub routing: Routing,
}

impl SigmoidMoe<'_> {
    pub(crate) fn load(self, w: &dyn WeightSource) -> Result<MoeBlock, LoadError> {
        let (p, hidden, n) = (self.prefix, self.hidden, self.routing.num_experts);
        let shared = (self.shared_inter > 0)
            .then(|| Mlp::load(w, &format!("{p}.shared_experts"), hidden, self.shared_inter, false))
            .transpose()?;
        Ok(MoeBlock {
            router: Linear::load(w, &format!("{p}.gate"), hidden, n, false)?,
            routing: Routing {
                scoring: Scoring::Sigmoid,
                correction_bias: Some(w.tensor(&format!("{p}.gate.e_score_correction_bias"), &[n])?),
                ..self.routing
            },
            first_expert: w.experts_to_load(n).start,
            experts: load_experts(w, &format!("{p}.experts"), self.expert_names, n, hidden, self.inter)?,
            shared,
            shared_gate: None,
        })
    }
}

/// Parameters of one MoE block: `experts` SwiGLU experts of `inter`, their router, and shared
/// experts of `shared_inter` together.
pub(crate) fn moe_params(hidden: usize, experts: usize, inter: usize, shared_inter: usize) -> u128 {
    let [h, n, i, s] = [hidden, experts, inter, shared_inter].map(|x| x as u128);
    n * 3 * h * i + h * n + n + 3 * h * s + h
}

/// Loads the SwiGLU experts of `num_experts` under `prefix` that `w` serves
/// ([`WeightSource::experts_to_load`]: all of them, or one rank's range), stored either one module
/// per expert (`{prefix}.{e}.{gate}.weight`, …; only those are read) or fused as transformers 5
/// holds them in memory (`{prefix}.gate_up_proj` `[E × 2I × H]`, `{prefix}.down_proj`
/// `[E × H × I]`; read whole, the range kept).
pub fn load_experts(
    w: &dyn WeightSource,
    prefix: &str,
    names: [&str; 3],
    num_experts: usize,
    hidden: usize,
    inter: usize,
) -> Result<Vec<Mlp>, LoadError> {
    let range = w.experts_to_load(num_experts);
    if w.contains(&format!("{prefix}.0.{}.weight", names[0])) || !w.contains(&format!("{prefix}.gate_up_proj")) {
        return range.map(|e| Mlp::load_named(w, &format!("{prefix}.{e}"), names, hidden, inter, false)).collect();
    }
    let gate_up = w.tensor(&format!("{prefix}.gate_up_proj"), &[num_experts, 2 * inter, hidden])?;
    let down = w.tensor(&format!("{prefix}.down_proj"), &[num_experts, hidden, inter])?;
    Ok(range
        .map(|e| {
            let gu = &gate_up[e * 2 * inter * hidden..(e + 1) * 2 * inter * hidden];
            let d = &down[e * hidden * inter..(e + 1) * hidden * inter];
            Mlp::from_parts(gu, d, hidden, inter)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deepseek_like(n_group: usize, topk_group: usize) -> Routing {
        Routing {
            num_experts: 8,
            top_k: 2,
            scoring: Scoring::Sigmoid,
            correction_bias: None,
            n_group,
            topk_group,
            norm_topk_prob: true,
            scaling: 2.5,
        }
    }

    #[test]
    fn group_limits_keep_experts_inside_the_best_groups() {
        // group 0 = experts 0..4 holds the single best expert; group 1 has the better pair sum.
        let logits = [5.0, -5.0, -5.0, -5.0, 2.0, 2.0, 2.0, -5.0];
        let one_group = deepseek_like(2, 1).route(&logits);
        assert_eq!(one_group.iter().map(|p| p.0).collect::<Vec<_>>(), vec![4, 5]);
        let no_groups = deepseek_like(1, 1).route(&logits);
        assert_eq!(no_groups.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 4]);
    }

    #[test]
    fn normalised_weights_sum_to_the_scaling_factor() {
        let route = deepseek_like(1, 1).route(&[0.1, 0.9, -0.3, 0.4, 0.0, 0.2, 0.5, -1.0]);
        let sum: f32 = route.iter().map(|p| p.1).sum();
        assert!((sum - 2.5).abs() < 1e-6, "{sum}");
    }

    #[test]
    fn the_correction_bias_changes_the_choice_but_not_the_weight() {
        let mut r = deepseek_like(1, 1);
        r.norm_topk_prob = false;
        r.scaling = 1.0;
        r.correction_bias = Some(vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 10.0]);
        let route = r.route(&[1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(route, vec![(0, sigmoid(1.0)), (7, sigmoid(0.0))]);
    }
}
