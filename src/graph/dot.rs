//! [`Graph::to_dot`]: the operator graph the runtime builds for each pool (DESIGN §4), as Graphviz
//! DOT, for `kvflow check GRAPH --dot`.
//!
//! Each pool is a cluster with one node per operator, named as the runtime names them and labelled
//! with the step it works at: `admit` → `schedule(t)` → `align(t)` → `forward(t)` → `emit(t)`,
//! with the feedback edge `forward(t)` → `schedule(t+1)` that carries the *launched* record. A
//! `workload` node (the trace) feeds each pool's `admit`; the router chooses ranks inside
//! `align`. Prefill and decode
//! pools draw the same per-pool graph; the links between them are not drawn yet.

use super::{Graph, PoolConfig, WorkloadMode};

pub(super) fn render(graph: &Graph) -> String {
    let mut dot = Dot::default();
    dot.line("digraph kvflow {");
    dot.line("  rankdir=LR;");
    dot.line(format!("  label={};", quote(&format!("kvflow graph {}", graph.path.display()))));
    dot.line("  labelloc=t;");
    dot.line("  fontname=\"Helvetica\";");
    dot.line("  node [shape=box, style=rounded, fontname=\"Helvetica\"];");
    dot.line("  edge [fontname=\"Helvetica\", fontsize=10];");
    dot.line(format!("  workload [shape=note, label={}];", quote(&workload_label(graph))));
    for pool in &graph.pools {
        render_pool(&mut dot, pool);
    }
    dot.line("}");
    dot.text
}

fn render_pool(dot: &mut Dot, pool: &PoolConfig) {
    let id = |operator: &str| quote(&format!("{}/{operator}", pool.name));
    let ranks = if pool.ranks == 1 { "1 rank".to_string() } else { format!("{} ranks", pool.ranks) };
    dot.line("");
    dot.line(format!("  subgraph {} {{", quote(&format!("cluster_{}", pool.name))));
    dot.line(format!("    label={};", quote(&format!("pool {} ({}, {ranks})", pool.name, pool.role))));
    dot.line("    style=rounded;");
    dot.line(format!("    {} [shape=ellipse, label={}];", id("router"), quote(&format!("router\n{}", pool.router))));
    dot.line(format!("    {} [label=\"admit\"];", id("admit")));
    dot.line(format!("    {} [label=\"schedule(t)\"];", id("schedule")));
    dot.line(format!("    {} [label={}];", id("align"), quote(&format!("align(t)\nbroadcast × {}", pool.ranks))));
    dot.line(format!("    {} [label={}];", id("forward"), quote(&format!("forward(t)\nexecutor: {}", pool.executor))));
    dot.line(format!("    {} [label=\"emit(t)\"];", id("emit")));
    dot.line(format!("    {} -> {} [label=\"routes admissions\", style=dotted];", id("router"), id("align")));
    dot.line(format!("    {} -> {} [label=\"wake\"];", id("admit"), id("schedule")));
    dot.line(format!("    {} -> {} [label=\"batch\"];", id("schedule"), id("align")));
    dot.line(format!("    {} -> {} [label=\"StepPlan(t)\"];", id("align"), id("forward")));
    dot.line(format!("    {} -> {} [label=\"finished\"];", id("forward"), id("emit")));
    dot.line(format!(
        "    {} -> {} [label=\"launched (t+1)\", style=dashed, constraint=false];",
        id("forward"),
        id("schedule")
    ));
    dot.line(format!(
        "    {} -> {} [label=\"launched / parked (t+1)\", style=dashed, constraint=false];",
        id("forward"),
        id("admit")
    ));
    dot.line("  }");
    dot.line(format!("  workload -> {} [label=\"requests\"];", id("admit")));
}

fn workload_label(graph: &Graph) -> String {
    let workload = &graph.workload;
    let trace = match &workload.trace {
        Some(path) => path.file_name().map(|name| name.to_string_lossy().into_owned()).unwrap_or_default(),
        None => "(no trace)".to_string(),
    };
    let mode = match workload.mode {
        WorkloadMode::Timestamps { time_scale } => format!("timestamps × {time_scale}"),
        WorkloadMode::Concurrency(requests) => format!("concurrency {requests}"),
        WorkloadMode::Rate { per_second } => format!("rate {per_second}/s"),
    };
    format!("workload\n{trace}\n{} · {mode}", workload.format)
}

/// A DOT double-quoted string: backslashes and quotes escaped, newlines as DOT's `\n`.
fn quote(text: &str) -> String {
    let mut quoted = String::with_capacity(text.len() + 2);
    quoted.push('"');
    for c in text.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            '\n' => quoted.push_str("\\n"),
            _ => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

#[derive(Default)]
struct Dot {
    text: String,
}

impl Dot {
    fn line(&mut self, line: impl AsRef<str>) {
        self.text.push_str(line.as_ref());
        self.text.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::graph::{MemoryConfig, PoolRole, SchedulerConfig, SloConfig, WorkloadConfig};

    fn graph_with_pools(pools: &[(&str, PoolRole, usize)]) -> Graph {
        Graph {
            path: PathBuf::from("graphs/pd.toml"),
            model: PathBuf::from("fixtures/hf/llama"),
            memory: MemoryConfig {
                budget_bytes: 1 << 20,
                block_size: 16,
                snapshot_fraction: 0.25,
                snapshot_interval_blocks: 4,
            },
            scheduler: SchedulerConfig { max_running: 8, max_batched_tokens: 64, chunk_tokens: 16, prefix_cache: true },
            pools: pools
                .iter()
                .map(|&(name, role, ranks)| PoolConfig {
                    name: name.to_string(),
                    role,
                    ranks,
                    executor: "cpu".to_string(),
                    router: "round-robin".to_string(),
                })
                .collect(),
            workload: WorkloadConfig {
                trace: Some(PathBuf::from("traces/my \"quoted\" trace.jsonl")),
                format: "mooncake".to_string(),
                mode: WorkloadMode::Concurrency(8),
                warmup: 0,
                limit: None,
                block_tokens: 16,
                max_output_tokens: None,
                seed: 0,
                ignore_eos: true,
                cancel_fraction: 0.0,
                cancel_after_ms: 0.0,
            },
            slo: SloConfig { ttft_ms: None, tpot_ms: None },
            report_dir: PathBuf::from("out/pd"),
        }
    }

    #[test]
    fn each_pool_is_one_cluster_with_the_feedback_edge() {
        let dot = graph_with_pools(&[("prefill", PoolRole::Prefill, 2), ("decode", PoolRole::Decode, 3)]).to_dot();
        assert_eq!(dot.matches("subgraph \"cluster_").count(), 2, "{dot}");
        for pool in ["prefill", "decode"] {
            assert!(dot.contains(&format!("subgraph \"cluster_{pool}\"")), "{dot}");
            assert!(
                dot.contains(&format!(
                    "\"{pool}/forward\" -> \"{pool}/schedule\" [label=\"launched (t+1)\", style=dashed"
                )),
                "{dot}"
            );
            assert!(dot.contains(&format!("\"{pool}/admit\" -> \"{pool}/schedule\" [label=\"wake\"]")), "{dot}");
            assert!(dot.contains(&format!("workload -> \"{pool}/admit\"")), "{dot}");
            assert!(dot.contains(&format!("\"{pool}/router\" -> \"{pool}/align\"")), "{dot}");
        }
    }

    #[test]
    fn nodes_name_the_operators_with_their_time_ranks_executor_and_router() {
        let dot = graph_with_pools(&[("main", PoolRole::Aggregated, 4)]).to_dot();
        for label in [
            "\"admit\"",
            "\"schedule(t)\"",
            "\"align(t)\\nbroadcast × 4\"",
            "\"forward(t)\\nexecutor: cpu\"",
            "\"emit(t)\"",
        ] {
            assert!(dot.contains(label), "missing {label} in {dot}");
        }
        assert!(dot.contains("\"router\\nround-robin\""), "{dot}");
        assert!(dot.contains("pool main (aggregated, 4 ranks)"), "{dot}");
    }

    #[test]
    fn workload_label_names_the_trace_file_and_mode_with_quotes_escaped() {
        let dot = graph_with_pools(&[("main", PoolRole::Aggregated, 1)]).to_dot();
        assert!(dot.contains("workload\\nmy \\\"quoted\\\" trace.jsonl\\nmooncake · concurrency 8"), "{dot}");
    }

    #[test]
    fn dot_braces_balance() {
        let dot = graph_with_pools(&[("a", PoolRole::Aggregated, 1), ("b", PoolRole::Aggregated, 2)]).to_dot();
        assert_eq!(dot.matches('{').count(), dot.matches('}').count(), "{dot}");
        assert!(dot.starts_with("digraph kvflow {") && dot.trim_end().ends_with('}'));
    }
}
