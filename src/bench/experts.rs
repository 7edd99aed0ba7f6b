//! `kvflow bench step --expert-parallel`: what align and the MoE exchanges cost per step. A
//! seeded DeepSeek-style MoE model (one dense layer, three MoE layers of 8 experts, hidden size
//! 16: the math is small next to the coordination) decodes on the cpu executor with its experts
//! split over `R` ranks — per step `align`'s broadcast and a dispatch and a combine per MoE layer
//! — beside the same pool on 1 rank (the same model, every exchange to itself) and the same `R`
//! ranks without expert parallelism (align only), measured in the same run, alternating. Each
//! figure is the least of three runs. Last line `ep_ratio=<R ranks over 1 rank>`.

use super::step::{pool_run, PoolRun};
use crate::runtime::ExpertParallelJob;
use anyhow::{Context, Result};
use kvflow_kernels::models;
use std::sync::Arc;

const SPEC: &str = r#"
model_type = "deepseek_v3"
seed = 5
vocab_size = 64
hidden_size = 16
intermediate_size = 16
moe_intermediate_size = 8
num_hidden_layers = 4
num_attention_heads = 2
q_lora_rank = 8
kv_lora_rank = 8
qk_nope_head_dim = 4
qk_rope_head_dim = 4
v_head_dim = 4
n_routed_experts = 8
num_experts_per_tok = 2
n_group = 1
topk_group = 1
first_k_dense_replace = 1
"#;

const RUNS: usize = 3;

/// (ms per step, steps) of one pool of `ranks` ranks, `seqs` decoding requests each.
fn one(spec: &std::path::Path, ranks: usize, seqs: usize, outputs: usize, expert_parallel: bool) -> Result<(f64, u64)> {
    let model = Arc::new(models::load(spec)?);
    let moe_layers = model.moe_layers().into_iter().map(|(layer, _)| layer).collect();
    let experts = expert_parallel.then(|| ExpertParallelJob {
        simulated: false,
        checkpoint: spec.to_path_buf(),
        moe_layers,
        draft_passes: 0,
        mtp_layer: 0,
        spec_width: 1,
    });
    pool_run(PoolRun { ranks, seqs, outputs, model, executor: "cpu", settings: toml::Table::new(), experts })
}

pub fn run(ranks: usize, seqs: usize, steps: usize) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("kvflow-bench-experts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let spec = dir.join("moe.toml");
    std::fs::write(&spec, SPEC).with_context(|| format!("cannot write {}", spec.display()))?;
    let moe_layers = models::load(&spec)?.moe_layers().len();
    println!(
        "expert_parallel  a seeded MoE model ({moe_layers} MoE layers of 8 experts), cpu executor, {seqs} decoding \
         requests per rank, {} cores here",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let (mut ep, mut single, mut dense, mut n) = (Vec::new(), Vec::new(), Vec::new(), 0);
    for _ in 0..RUNS {
        let (ms, steps_run) = one(&spec, ranks, seqs, steps, true)?;
        n = steps_run;
        ep.push(ms);
        single.push(one(&spec, 1, seqs, steps, true)?.0);
        dense.push(one(&spec, ranks, seqs, steps, false)?.0);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let least = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let (e, s, d) = (least(&ep), least(&single), least(&dense));
    println!(
        "expert_parallel  {ranks} ranks: align + {moe_layers} × (dispatch, experts, combine) {e:.3} ms per step over {n} \
         steps (runs {ep:.3?})"
    );
    println!("expert_parallel  1 rank, same pool: {s:.3} ms per step (runs {single:.3?})");
    println!(
        "expert_parallel  {ranks} ranks, experts not split (align only, each rank runs every expert): {d:.3} ms per \
         step (runs {dense:.3?})"
    );
    println!("exchange_ms_per_step={:.3}", e - d);
    println!("ep_ratio={:.3}", e / s);
    Ok(())
}
