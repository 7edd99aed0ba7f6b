//! `kvflow plan`: sweeps a simulated graph's knobs (the ranks of every pool — or of a P/D graph's
//! prefill and decode pools apart — and the prefill chunk) through simulated runs of the same
//! trace and seed, and prints each configuration's goodput per GPU under the SLO, best first
//! (issue 44). Every run's report is kept under the output folder; `--plot` draws goodput per GPU
//! over the chunk, one line per layout of ranks.

use super::run::{checked_graph, RunFlags};
use anyhow::{anyhow, Context, Result};
use clap::Args;
use kvflow::graph::{Graph, PoolRole};
use kvflow::runtime;
use kvflow::signals::Interrupts;
use serde_json::{json, Value};
use std::path::PathBuf;

/// `kvflow plan`'s own arguments (the run flags apply to every simulated run).
#[derive(Args)]
pub struct PlanArgs {
    /// A graph whose every pool has `executor = "sim"`.
    pub graph: PathBuf,
    /// Ranks of every pool to try.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub sweep_ranks: Vec<usize>,
    /// A P/D graph: ranks of its prefill pools to try (each with every `--sweep-decode-ranks`;
    /// the one not given takes `--sweep-ranks`).
    #[arg(long, value_delimiter = ',')]
    pub sweep_prefill_ranks: Vec<usize>,
    /// A P/D graph: ranks of its decode pools to try.
    #[arg(long, value_delimiter = ',')]
    pub sweep_decode_ranks: Vec<usize>,
    /// Prefill chunks (`chunk_tokens`) to try (default: the graph's, half and double it).
    #[arg(long, value_delimiter = ',')]
    pub sweep_chunk_tokens: Vec<usize>,
    /// The SLO goodput counts requests within (overrides the graph's `[slo]`).
    #[arg(long)]
    pub ttft_ms: Option<f64>,
    #[arg(long)]
    pub tpot_ms: Option<f64>,
    #[command(flatten)]
    pub flags: RunFlags,
}

/// The ranks a configuration gives the pools: every pool the same, or prefill and decode pools
/// apart.
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    Every(usize),
    PrefillDecode(usize, usize),
}

impl Layout {
    fn ranks_of(self, role: PoolRole) -> usize {
        match (self, role) {
            (Layout::Every(r), _) => r,
            (Layout::PrefillDecode(p, _), PoolRole::Prefill) => p,
            (Layout::PrefillDecode(_, d), _) => d,
        }
    }

    /// Its name in folders and tables: `ranks2`, `2P4D`.
    fn name(self) -> String {
        match self {
            Layout::Every(r) => format!("ranks{r}"),
            Layout::PrefillDecode(p, d) => format!("{p}P{d}D"),
        }
    }
}

/// One configuration tried, and what its run gave.
struct Tried {
    layout: Layout,
    chunk_tokens: usize,
    gpus: usize,
    report: Value,
}

impl Tried {
    fn goodput_per_gpu(&self) -> f64 {
        self.report["goodput_rps"].as_f64().unwrap_or(0.0) / self.gpus.max(1) as f64
    }
}

pub fn plan(args: PlanArgs, interrupts: &Interrupts) -> Result<i32> {
    let (mut graph, mut opts) = checked_graph(&args.graph, &args.flags, interrupts)?;
    if graph.pools.iter().any(|p| p.executor != "sim") {
        return Err(anyhow!(
            "{}: kvflow plan sweeps simulated runs: every pool's executor must be \"sim\"",
            args.graph.display()
        ));
    }
    let sweeps = [&args.sweep_ranks, &args.sweep_prefill_ranks, &args.sweep_decode_ranks, &args.sweep_chunk_tokens];
    if sweeps.iter().any(|s| s.contains(&0)) {
        return Err(anyhow!("--sweep-ranks, --sweep-prefill-ranks, --sweep-decode-ranks and --sweep-chunk-tokens take whole numbers of at least 1"));
    }
    let apart = !args.sweep_prefill_ranks.is_empty() || !args.sweep_decode_ranks.is_empty();
    if apart && !graph.is_disaggregated() {
        return Err(anyhow!(
            "{}: --sweep-prefill-ranks and --sweep-decode-ranks sweep a P/D graph's pools; this graph's pools are \
             aggregated (use --sweep-ranks)",
            args.graph.display()
        ));
    }
    let or_every = |given: &Vec<usize>| if given.is_empty() { args.sweep_ranks.clone() } else { given.clone() };
    let layouts: Vec<Layout> = if apart {
        let decode = or_every(&args.sweep_decode_ranks);
        or_every(&args.sweep_prefill_ranks)
            .into_iter()
            .flat_map(|p| decode.iter().map(move |&d| Layout::PrefillDecode(p, d)))
            .collect()
    } else {
        args.sweep_ranks.iter().map(|&r| Layout::Every(r)).collect()
    };
    graph.slo.ttft_ms = args.ttft_ms.or(graph.slo.ttft_ms);
    graph.slo.tpot_ms = args.tpot_ms.or(graph.slo.tpot_ms);
    if graph.slo.ttft_ms.is_none() && graph.slo.tpot_ms.is_none() {
        return Err(anyhow!(
            "{}: goodput needs an SLO: give [slo] in the graph, or --ttft-ms / --tpot-ms",
            args.graph.display()
        ));
    }
    let chunks = match args.sweep_chunk_tokens.as_slice() {
        [] => {
            let c = graph.scheduler.chunk_tokens;
            let mut v = vec![(c / 2).max(1), c, c * 2];
            v.dedup();
            v
        }
        given => given.to_vec(),
    };
    opts.show_progress = false;
    let out = graph.report_dir.clone();
    let mut tried = Vec::new();
    for &layout in &layouts {
        for &chunk in &chunks {
            let g = configured(&graph, layout, chunk, &out);
            let outcome = runtime::run(&g, &opts, &kvflow::registry::Registry::default())
                .with_context(|| format!("simulating {}, chunk {chunk}", layout.name()))?;
            let report = outcome.report.unwrap_or_default();
            let gpus = g.pools.iter().map(|p| p.ranks).sum();
            tried.push(Tried { layout, chunk_tokens: chunk, gpus, report });
            if interrupts.exit_status().is_some() {
                break;
            }
        }
    }
    tried.sort_by(|a, b| b.goodput_per_gpu().total_cmp(&a.goodput_per_gpu()));
    print_table(&tried);
    let rows: Vec<Value> = tried.iter().map(row).collect();
    let path = out.join("plan.json");
    std::fs::write(&path, serde_json::to_string_pretty(&rows)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    if args.flags.plot {
        let series: Vec<(String, Vec<(f64, f64)>)> = layouts
            .iter()
            .map(|&layout| {
                let mut points: Vec<(f64, f64)> = tried
                    .iter()
                    .filter(|t| t.layout == layout)
                    .map(|t| (t.chunk_tokens as f64, t.goodput_per_gpu()))
                    .collect();
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                let label = match layout {
                    Layout::Every(r) => format!("{r} rank(s) a pool"),
                    Layout::PrefillDecode(..) => layout.name(),
                };
                (label, points)
            })
            .collect();
        let path = out.join("plan.png");
        kvflow::plot::line_chart(&path, "goodput per GPU", "chunk tokens", "requests/s per GPU", &series)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(interrupts.exit_status().unwrap_or(0))
}

/// The graph with the ranks of `layout` and prefill chunks of `chunk` tokens, reporting into its
/// own folder under `out`.
fn configured(graph: &Graph, layout: Layout, chunk: usize, out: &std::path::Path) -> Graph {
    let mut g = graph.clone();
    g.scheduler.chunk_tokens = chunk;
    for p in &mut g.pools {
        p.ranks = layout.ranks_of(p.role);
        p.scheduler.chunk_tokens = chunk;
    }
    g.report_dir = out.join(format!("{}-chunk{chunk}", layout.name()));
    g
}

fn row(t: &Tried) -> Value {
    let ranks = match t.layout {
        Layout::Every(r) => json!(r),
        Layout::PrefillDecode(p, d) => json!({"prefill": p, "decode": d}),
    };
    json!({
        "ranks": ranks,
        "chunk_tokens": t.chunk_tokens,
        "gpus": t.gpus,
        "goodput_rps": t.report["goodput_rps"],
        "goodput_per_gpu": t.goodput_per_gpu(),
        "ttft_ms": t.report["ttft_ms"],
        "tpot_ms": t.report["tpot_ms"],
        "completed": t.report["completed"],
        "requests": t.report["requests"],
    })
}

fn print_table(tried: &[Tried]) {
    println!(
        "{:>8} {:>6} {:>5} {:>12} {:>12} {:>10} {:>10} {:>10} {:>10} {:>9}",
        "ranks",
        "chunk",
        "GPUs",
        "goodput/GPU",
        "goodput r/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "completed"
    );
    for t in tried {
        let f = |k: &str, q: &str| t.report[k][q].as_f64().map_or("-".into(), |v| format!("{v:.2}"));
        println!(
            "{:>8} {:>6} {:>5} {:>12.3} {:>12.3} {:>10} {:>10} {:>10} {:>10} {:>9}",
            match t.layout {
                Layout::Every(r) => r.to_string(),
                Layout::PrefillDecode(..) => t.layout.name(),
            },
            t.chunk_tokens,
            t.gpus,
            t.goodput_per_gpu(),
            t.report["goodput_rps"].as_f64().unwrap_or(0.0),
            f("ttft_ms", "p50"),
            f("ttft_ms", "p99"),
            f("tpot_ms", "p50"),
            f("tpot_ms", "p99"),
            t.report["completed"]
        );
    }
}
