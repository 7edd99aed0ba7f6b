//! `kvflow bench spec`: decode speed with n-gram drafting beside the same workload without it,
//! in the same run. The workload repeats itself on purpose (each prompt is a few trace blocks
//! repeated, so prompt lookup has something to find): the same graph and trace run through the
//! runtime once without `[speculative]` and once with it, taking turns for `--rounds` rounds.
//! Figures: output tokens per second of decode (from the first output token to the last, summed
//! over requests) and end to end, the acceptance rate and the mean accepted length (tokens a
//! verification step gives). `--verify` stays off: the tests show the outputs are the same.
//! `--executor cuda` runs both on a cuda pool (deferred output, CUDA graphs, `--dtype`), where the
//! drafts are scored on the device.

use super::median;
use crate::graph::Graph;
use crate::runtime::{self, RunOptions};
use anyhow::{Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

pub struct SpecBenchArgs {
    /// A checkpoint folder or a TOML model spec.
    pub model: PathBuf,
    pub requests: usize,
    pub outputs: usize,
    pub draft_tokens: usize,
    pub rounds: usize,
    pub executor: SpecExecutor,
    /// The KV pool's bytes, as `[memory] budget_bytes` takes them.
    pub kv_budget: String,
}

/// The pool's executor: `cpu`, or `cuda` with deferred output and CUDA graphs in `dtype`
/// (`emulate`: its kernels on the CPU).
pub struct SpecExecutor {
    pub name: String,
    pub dtype: String,
    pub emulate: bool,
}

impl SpecExecutor {
    /// The pool's `executor` line and, for cuda, its `[pool.executor_settings]`.
    fn toml(&self) -> String {
        if self.name != "cuda" {
            return format!("executor = \"{}\"\n", self.name);
        }
        format!(
            "executor = \"cuda\"\n\n[pool.executor_settings]\ndeferred_output = true\ncuda_graphs = true\n\
             dtype = \"{}\"\nemulate = {}\n",
            self.dtype, self.emulate
        )
    }

    /// The executor as the bench's first line names it.
    fn describe(&self) -> String {
        match (self.name.as_str(), self.emulate) {
            ("cuda", true) => format!("cuda ({}, emulated on the CPU: its figures say nothing of a GPU's)", self.dtype),
            ("cuda", false) => format!("cuda ({}, deferred output, CUDA graphs)", self.dtype),
            (name, _) => name.to_string(),
        }
    }
}

/// A Mooncake trace of `requests` prompts, each 2 distinct trace blocks repeated 4 times (16
/// tokens a block once scaled), asking for `outputs` tokens: a repetitive workload.
fn write_trace(dir: &Path, requests: usize, outputs: usize) -> Result<PathBuf> {
    let lines: Vec<String> = (0..requests)
        .map(|r| {
            let (a, b) = (2 * r as u64 + 1, 2 * r as u64 + 2);
            let ids: Vec<String> = [a, b, a, b, a, b, a, b].iter().map(u64::to_string).collect();
            format!(
                "{{\"timestamp\": 0, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": [{}]}}",
                8 * 512,
                outputs * 512 / 16, // scaled by block_tokens = 16: `outputs` tokens
                ids.join(", ")
            )
        })
        .collect();
    let path = dir.join("trace.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

fn write_graph(dir: &Path, args: &SpecBenchArgs, trace: &Path, spec: bool) -> Result<PathBuf> {
    let model = std::fs::canonicalize(&args.model).with_context(|| format!("--model {}", args.model.display()))?;
    let speculative = if spec {
        format!("[speculative]\ndrafter = \"ngram\"\ndraft_tokens = {}\n", args.draft_tokens)
    } else {
        String::new()
    };
    let text = format!(
        "[model]\npath = \"{model}\"\n\n[memory]\nbudget_bytes = \"{budget}\"\n\n[scheduler]\nmax_running = 8\n\
         max_batched_tokens = 256\n\n[[pool]]\nname = \"main\"\nranks = 1\n{executor}\n{speculative}\n[workload]\n\
         trace = \"{trace}\"\nmode = \"concurrency\"\nconcurrency = 4\nblock_tokens = 16\nmax_output_tokens = {outputs}\n\
         seed = 1\n\n[report]\nout = \"{out}\"\n",
        model = model.display(),
        budget = args.kv_budget,
        executor = args.executor.toml(),
        trace = trace.display(),
        outputs = args.outputs,
        out = dir.join(if spec { "out-spec" } else { "out-plain" }).display(),
    );
    let path = dir.join(if spec { "spec.toml" } else { "plain.toml" });
    std::fs::write(&path, text)?;
    Ok(path)
}

/// (decode tokens/s, output tokens/s end to end, the report, how its cuda steps went through
/// CUDA graphs: captured, replayed, launched directly).
fn run_once(graph: &Path) -> Result<(f64, f64, Value, [u64; 3])> {
    let graph = Graph::load(graph).map_err(|e| anyhow::anyhow!("{e}"))?;
    let before = kvflow_kernels::cuda::process_graph_counts();
    let outcome = runtime::run(&graph, &RunOptions::default(), &Default::default())?;
    let after = kvflow_kernels::cuda::process_graph_counts();
    let graphs = [after.captured - before.captured, after.replayed - before.replayed, after.launched - before.launched];
    let report = outcome.report.context("the run wrote no report")?;
    anyhow::ensure!(report["failed"] == 0, "requests failed: {}", report["failures"]);
    let lines = std::fs::read_to_string(outcome.out_dir.join("requests.jsonl"))?;
    let (mut tokens, mut seconds) = (0.0, 0.0);
    for line in lines.lines() {
        let r: Value = serde_json::from_str(line)?;
        let n = r["output_tokens"].as_array().map_or(0, Vec::len);
        if let (Some(tpot), true) = (r["tpot_ms"].as_f64(), n > 1) {
            tokens += (n - 1) as f64;
            seconds += tpot * (n - 1) as f64 / 1e3;
        }
    }
    let decode = if seconds > 0.0 { tokens / seconds } else { 0.0 };
    Ok((decode, report["output_tokens_per_s"].as_f64().unwrap_or(0.0), report, graphs))
}

pub fn run(args: &SpecBenchArgs) -> Result<()> {
    anyhow::ensure!(
        args.requests > 0 && args.outputs > 1 && args.rounds > 0,
        "--requests ≥ 1, --outputs ≥ 2, --rounds ≥ 1"
    );
    anyhow::ensure!((1..=16).contains(&args.draft_tokens), "--draft-tokens is 1 to 16");
    let dir = tempfile_dir()?;
    let trace = write_trace(&dir, args.requests, args.outputs)?;
    let (plain, spec) = (write_graph(&dir, args, &trace, false)?, write_graph(&dir, args, &trace, true)?);
    println!(
        "spec         {} requests of 128 repetitive prompt tokens and {} outputs, n-gram drafts of {}, {} rounds, model {}, \
         executor {}",
        args.requests,
        args.outputs,
        args.draft_tokens,
        args.rounds,
        args.model.display(),
        args.executor.describe()
    );
    let mut rows: Vec<[f64; 6]> = Vec::new();
    let mut last = Value::Null;
    let mut graphs = [[0; 3]; 2];
    for _ in 0..args.rounds {
        let (p_decode, p_e2e, _, p_graphs) = run_once(&plain)?;
        let (s_decode, s_e2e, report, s_graphs) = run_once(&spec)?;
        graphs = [p_graphs, s_graphs];
        let rate = report["spec"]["acceptance_rate"].as_f64().unwrap_or(0.0);
        let len = report["spec"]["mean_accepted_len"].as_f64().unwrap_or(0.0);
        rows.push([p_decode, s_decode, p_e2e, s_e2e, rate, len]);
        last = report;
    }
    let _ = std::fs::remove_dir_all(&dir);
    let col = |i: usize| median(rows.iter().map(|r| r[i]).collect());
    println!("plain        decode {:.1} tokens/s, end to end {:.1} output tokens/s", col(0), col(2));
    println!("n-gram       decode {:.1} tokens/s, end to end {:.1} output tokens/s", col(1), col(3));
    println!(
        "drafts       acceptance rate {:.3}, mean accepted length {:.2} ({} verification steps in the last round)",
        col(4),
        col(5),
        last["spec"]["verify_steps"]
    );
    if args.executor.name == "cuda" {
        for (run, [captured, replayed, launched]) in ["plain", "n-gram"].iter().zip(graphs) {
            println!(
                "graphs       {run} (last round): {replayed} steps replayed, {captured} captured, {launched} launched \
                 directly"
            );
        }
    }
    println!("decode_ratio={:.3}", median(rows.iter().map(|r| r[1] / r[0]).collect()));
    println!("e2e_ratio={:.3}", median(rows.iter().map(|r| r[3] / r[2]).collect()));
    Ok(())
}

fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("kvflow-bench-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}
