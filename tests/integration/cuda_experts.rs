//! Expert parallelism on cuda ranks (emulated: the same kernels on the CPU; the GPU's runs are
//! `benches/device/run.sh`'s `experts` part): MoE families exact against the cuda plain path with
//! their experts over several ranks, aggregated and 1P1D, each rank holding only its own experts
//! and exchanging rows device to device (no float crosses in host memory); an expert result that
//! never comes back fails the requests that lost it, never a silent zero.

use crate::common::{records, repo};
use crate::runtime::{assert_exact, run_graph, write_graph_with};
use kvflow::graph::Overrides;
use kvflow_kernels::models::{load, load_expert_shard};
use kvflow_operators::rank::TestSwitches;
use serde_json::Value;

const WORKLOAD: &str = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 4";

fn ep_cuda_pool(name: &str, role: &str, ranks: usize) -> String {
    format!(
        "[[pool]]\nname = \"{name}\"\nrole = \"{role}\"\nranks = {ranks}\nexpert_parallel = true\n\
         admission = \"reserve\"\nexecutor = \"cuda\"\n[pool.scheduler]\nchunk_tokens = 16\n\
         [pool.executor_settings]\nemulate = true\n"
    )
}

/// Every rank holds exactly its own share of the experts, sent rows to the others, and none of
/// the floats it sent crossed in host memory.
fn assert_device_exchange(report: &Value, model: &str, ranks: usize, what: &str) {
    let dir = repo().join("fixtures").join(model);
    let whole = load(&dir).unwrap().expert_bytes() as u64;
    for s in report["rank_stats"].as_array().unwrap() {
        let rank = s["rank"].as_u64().unwrap() as usize;
        let share = load_expert_shard(&dir, rank, ranks).unwrap().expert_bytes() as u64;
        assert_eq!(s["expert_bytes"].as_u64(), Some(share), "{what}: rank {rank}: {s}");
        assert!(share < whole, "{what}: rank {rank} holds every expert");
        assert!(s["exchange_bytes"].as_u64().unwrap() > 0, "{what}: rank {rank} exchanged nothing: {s}");
        assert_eq!(s["exchange_host_bytes"].as_u64(), Some(0), "{what}: rank {rank} sent floats through the host: {s}");
    }
}

#[test]
fn moe_families_on_expert_parallel_cuda_ranks_are_exact_against_the_cuda_plain_path() {
    let aggregated = ep_cuda_pool("main", "aggregated", 2);
    let pd = format!(
        "{}\n{}\n[[link]]\nfrom = \"prefill\"\nto = \"decode\"\n",
        ep_cuda_pool("prefill", "prefill", 2),
        ep_cuda_pool("decode", "decode", 2)
    );
    for (model, pools, what) in [("hf/deepseek_v3", &aggregated, "aggregated"), ("hf/kimi_linear", &pd, "1P1D")] {
        let dir = tempfile::tempdir().unwrap();
        let graph = write_graph_with(dir.path(), model, "mooncake_conversation_head.jsonl", WORKLOAD, "32 MiB", pools);
        let report = run_graph(&graph, Overrides::default(), Default::default());
        let what = format!("{model} {what} on expert-parallel cuda ranks of 2");
        assert_exact(&report, &what);
        assert_device_exchange(&report, model, 2, &what);
    }
}

#[test]
fn a_cuda_rank_left_without_expert_results_fails_the_requests_that_lost_them() {
    let dir = tempfile::tempdir().unwrap();
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 6";
    let pools = ep_cuda_pool("main", "aggregated", 2);
    let graph =
        write_graph_with(dir.path(), "hf/deepseek_v3", "mooncake_conversation_head.jsonl", workload, "32 MiB", &pools);
    let switches = TestSwitches { send_no_expert_results: Some((1, 3, 0)), ..Default::default() };
    let report = run_graph(&graph, Overrides::default(), switches);
    let lines = records(dir.path());
    let failed: Vec<&Value> = lines.iter().filter(|r| !r["failure"].is_null()).collect();
    assert!(!failed.is_empty(), "requests whose tokens met rank 1's experts at step 3 fail");
    for r in &failed {
        assert_eq!(r["failure"], "expert-combine", "{r}");
        let error = r["error"].as_str().unwrap();
        assert!(error.contains("step 3") && error.contains("on rank 1") && error.contains("no result"), "{error}");
    }
    assert_eq!(report["completed"].as_u64().unwrap() + failed.len() as u64, 6, "every request ends");
    assert_eq!(report["verify"]["mismatched"], 0, "no request completed with a silent zero");
    assert_ne!(report["stalled"], true, "the watchdog never fired");
}

/// The seed's hang on cuda ranks: P/D pools of 2 expert-parallel cuda ranks with the MTP drafter,
/// whose MoE block makes each draft pass an exchange of its experts (device to device, as the
/// model's); prompt chunks of 16 tokens, so a producer rank often runs only a middle chunk
/// (nothing sampled, nothing to draft) while its peer samples T0 and drafts. It still joins every
/// draft pass: the run ends exact, drafts fed and handed off. With the test switch a rank that
/// samples nothing skips them, and the watchdog names `dispatch[mtp.0]` in the producer pool.
#[test]
fn cuda_ranks_join_every_mtp_draft_pass_and_a_rank_that_skips_them_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = crate::spec::mtp_checkpoint(dir.path());
    let pools = format!(
        "{}\n{}\n[[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"inproc\"\n",
        ep_cuda_pool("prefill", "prefill", 2),
        ep_cuda_pool("decode", "decode", 2)
    );
    let edits = [("draft_tokens = 4", "draft_tokens = 3"), ("limit = 8", "limit = 6")];
    let graph = crate::spec::mtp_graph(dir.path(), &ckpt.to_string_lossy(), &pools, &edits);
    let outputs = Overrides { max_output_tokens: Some(24), ..Default::default() };
    let report = run_graph(&graph, outputs, TestSwitches::default());
    assert_exact(&report, "P/D expert-parallel cuda ranks with MTP draft passes");
    let spec = &report["spec"];
    assert!(spec["drafted_tokens"].as_u64().unwrap() > 0, "MTP drafts were fed: {spec}");
    let sent = spec["handed_off_drafts"].as_u64().unwrap();
    assert!(sent > 0 && spec["first_decode_drafts"] == sent, "the producer's drafts from T0 handed off: {spec}");
    let ranks = report["rank_stats"].as_array().unwrap();
    let prefill: Vec<&Value> = ranks.iter().filter(|r| r["pool"] == "prefill").collect();
    let joined_idle: u64 = prefill.iter().map(|r| r["draft_passes_without_samples"].as_u64().unwrap()).sum();
    assert!(joined_idle > 0, "producer ranks joined draft passes with nothing sampled: {prefill:?}");
    for r in ranks {
        assert!(r["exchange_bytes"].as_u64().unwrap() > 0, "experts really exchanged: {r}");
        assert_eq!(r["exchange_host_bytes"].as_u64(), Some(0), "no float crossed in host memory: {r}");
    }

    let (culprit, stderr) = crate::spec::stall_culprit(&graph, "skip-draft-passes-without-samples", "5", "prefill");
    assert!(culprit.contains("holding the pool back: operator `dispatch[mtp.0]`"), "in:\n{stderr}");
}
