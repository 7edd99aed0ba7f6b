//! Expert parallelism on cuda ranks (emulated: the same kernels on the CPU): every MoE family
//! exact against the cuda plain path with its experts over several ranks, aggregated and 1P1D;
//! each rank holds only its own experts and exchanges rows device to device.

use crate::common::repo;
use crate::runtime::{assert_exact, run_graph, write_graph_with};
use kvflow::graph::Overrides;
use kvflow_kernels::models::{load, load_expert_shard};
use serde_json::Value;

const WORKLOAD: &str = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 6";

fn ep_cuda_pool(name: &str, role: &str, ranks: usize) -> String {
    format!(
        "[[pool]]\nname = \"{name}\"\nrole = \"{role}\"\nranks = {ranks}\nexpert_parallel = true\n\
         admission = \"reserve\"\nexecutor = \"cuda\"\n[pool.scheduler]\nchunk_tokens = 16\n\
         [pool.executor_settings]\nemulate = true\n"
    )
}

/// Every rank holds exactly its own share of the experts and sent rows to the others.
fn assert_device_exchange(report: &Value, model: &str, ranks: usize, what: &str) {
    let dir = repo().join("fixtures").join(model);
    let whole = load(&dir).unwrap().expert_bytes() as u64;
    for s in report["rank_stats"].as_array().unwrap() {
        let rank = s["rank"].as_u64().unwrap() as usize;
        let share = load_expert_shard(&dir, rank, ranks).unwrap().expert_bytes() as u64;
        assert_eq!(s["expert_bytes"].as_u64(), Some(share), "{what}: rank {rank}: {s}");
        assert!(share < whole, "{what}: rank {rank} holds every expert");
        assert!(s["exchange_bytes"].as_u64().unwrap() > 0, "{what}: rank {rank} exchanged nothing: {s}");
    }
}

#[test]
fn moe_families_on_expert_parallel_cuda_ranks_are_exact_against_the_cuda_plain_path() {
    for (model, ranks) in [("hf/deepseek_v3", 2), ("hf/qwen3_next", 4), ("hf/kimi_linear", 2), ("hf/deepseek_v32", 2)] {
        let dir = tempfile::tempdir().unwrap();
        let pools = ep_cuda_pool("main", "aggregated", ranks);
        let graph = write_graph_with(dir.path(), model, "mooncake_conversation_head.jsonl", WORKLOAD, "32 MiB", &pools);
        let report = run_graph(&graph, Overrides::default(), Default::default());
        let what = format!("{model} aggregated on {ranks} expert-parallel cuda ranks");
        assert_exact(&report, &what);
        assert_device_exchange(&report, model, ranks, &what);
    }
}
