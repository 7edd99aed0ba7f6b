//! `kvflow check GRAPH --dot`: the operator graph the runtime builds for each pool (DESIGN §4),
//! as Graphviz DOT — drawn from the dataflow itself, not from a description of it. For each pool
//! the runtime's own [`build_pool_graph`] builds one rank's dataflow on a throwaway worker, and
//! timely's logs of that build (every operator with its name, every channel with its ports and
//! record type) become the nodes and edges. An operator the runtime adds shows up by itself.
//!
//! Operators kvflow knows get a label saying which step they work at and what they carry
//! (`forward(t)` and its executor, `align(t)` and its broadcast, the router inside it); edges
//! are labelled with the record type they carry and, for `forward` and `verify`, which
//! completion.

use crate::graph::{Graph, PoolConfig, WorkloadMode};
use crate::registry::Registry;
use anyhow::{anyhow, Result};
use kvflow_operators::executor::{Delay, NullExecutor};
use kvflow_operators::policy::memory::MemoryLayout;
use kvflow_operators::policy::router::RouterContext;
use kvflow_operators::pool::align::{Collectives, RoutingKeys};
use kvflow_operators::pool::wake::RankWaker;
use kvflow_operators::pool::{build_pool_graph, PoolParts, PoolStreams};
use kvflow_operators::rank::{Rank, TestSwitches};
use parking_lot::Mutex;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;
use timely::logging::{TimelyEvent, TimelyEventBuilder};

/// Something that adds operators to a pool's graph (for programs and tests that extend it).
pub type Extension = Arc<dyn Fn(&PoolStreams<'_>) + Send + Sync>;

/// One channel: (source operator, output port) → (target operator, input port), with the record
/// type.
type Channel = ((usize, usize), (usize, usize), String);

/// The pool's dataflow as timely built it: operators by index, channels.
#[derive(Debug, Default)]
struct Built {
    operators: BTreeMap<usize, String>,
    channels: Vec<Channel>,
}

/// Builds one rank of `pool` on a worker of its own and records what timely built.
fn build(
    pool: &PoolConfig,
    collectives: Collectives,
    offload: Option<&crate::graph::OffloadConfig>,
    registry: &Registry,
    extend: Option<Extension>,
) -> Result<Built> {
    let offload = offload.cloned();
    let router =
        registry.routers.get(&pool.router).ok_or_else(|| anyhow!("router {:?} is not registered", pool.router))?;
    let (ranks, scheduler, name) = (pool.ranks, pool.scheduler, pool.name.clone());
    let seen: Arc<Mutex<Vec<TimelyEvent>>> = Arc::default();
    let log = seen.clone();
    timely::execute_directly(move |worker| {
        if let Some(mut registry) = worker.log_register() {
            registry.insert::<TimelyEventBuilder, _>("timely", move |_time, data| {
                if let Some(events) = data {
                    log.lock().extend(events.iter().map(|(_, e)| e.clone()));
                }
            });
        }
        let layout = MemoryLayout {
            block_size: 16,
            blocks: 1,
            slots: 0,
            snapshots: 0,
            keeps_kv: true,
            keeps_state: false,
            prefix_keyed_by_prompt_len: false,
            verify_rows: 0,
        };
        let waker = Arc::new(RankWaker::default());
        let executor = Box::new(NullExecutor::new(Delay::default()));
        let rank = Rc::new(RefCell::new(Rank::new(0, &name, layout, scheduler, executor, waker.clone())));
        let parts = PoolParts {
            rank,
            waker,
            ingress: None,
            router: router(RouterContext {
                ranks,
                max_batched_tokens: scheduler.max_batched_tokens,
                block_size: 16,
                blocks_per_rank: layout.blocks,
            }),
            keys: RoutingKeys { block_size: 16, keyed_by_prompt_len: false },
            collectives: collectives.clone(),
            offload: offload.is_some(),
            ranks,
            sink: None,
            cache_events: None,
            switches: TestSwitches::default(),
        };
        worker.dataflow::<u64, _, _>(move |scope| {
            let streams = build_pool_graph(scope, parts);
            if let Some(extend) = &extend {
                extend(&streams);
            }
        });
        if let Some(mut registry) = worker.log_register() {
            registry.flush();
            registry.remove("timely");
        }
        for id in worker.installed_dataflows() {
            worker.drop_dataflow(id);
        }
    });
    let mut built = Built::default();
    for event in seen.lock().drain(..) {
        match event {
            TimelyEvent::Operates(op) if op.addr.len() == 2 => {
                built.operators.insert(op.addr[1], op.name);
            }
            TimelyEvent::Channels(ch) if ch.scope_addr.len() == 1 => {
                built.channels.push((ch.source, ch.target, record_type(&ch.typ)));
            }
            _ => {}
        }
    }
    Ok(built)
}

/// Operators timely adds to implement `broadcast` (a flat map to every worker, an exchange, a
/// flat map back): drawn as one `broadcast` edge.
const PLUMBING: &[&str] = &["FlatMap", "Exchange"];

impl Built {
    fn is_plumbing(&self, node: usize) -> bool {
        self.operators.get(&node).is_some_and(|n| PLUMBING.contains(&n.as_str()))
    }

    /// Channels between kvflow's operators, a chain of plumbing drawn as one edge to each
    /// operator it reaches: (source, output port, target, label).
    fn edges(&self) -> Vec<(usize, usize, usize, String)> {
        let mut edges = Vec::new();
        for ((src, port), (dst, _), typ) in &self.channels {
            if self.is_plumbing(*src) {
                continue;
            }
            // (node, type of the channel into it, whether an exchange was crossed)
            let mut todo = vec![(*dst, typ.clone(), false)];
            while let Some((at, typ, exchanged)) = todo.pop() {
                if !self.is_plumbing(at) {
                    edges.push((*src, *port, at, if exchanged { format!("broadcast: {typ}") } else { typ }));
                    continue;
                }
                let exchanged = exchanged || self.operators[&at] == "Exchange";
                for ((_, _), (next, _), t) in self.channels.iter().filter(|((s, _), _, _)| *s == at) {
                    todo.push((*next, t.clone(), exchanged));
                }
            }
        }
        edges
    }
}

/// `alloc::vec::Vec<kvflow_operators::messages::StepPlan>` → `StepPlan`.
fn record_type(typ: &str) -> String {
    let inner = typ.strip_prefix("alloc::vec::Vec<").and_then(|t| t.strip_suffix('>')).unwrap_or(typ);
    inner.rsplit("::").next().unwrap_or(inner).to_string()
}

/// The label of an operator kvflow knows, or timely's own name.
fn label(name: &str, pool: &PoolConfig) -> String {
    match name {
        "admit" => "admit\nwakes the pool (any rank)".to_string(),
        "schedule" => "schedule(t)".to_string(),
        "align" => format!("align(t)\nbroadcast × {}\nrouter: {}", pool.ranks, pool.router),
        "forward" => format!("forward(t)\nexecutor: {}", pool.executor),
        "verify" => "verify(t)\napplies sampled tokens; decides which drafts hold".to_string(),
        "propose" => format!("propose(t)\ndrafter: {}", pool_drafter(pool)),
        "emit" => "emit(t)\nto the collector".to_string(),
        "save" => "save(t)\nafter the step completed; blocks held until stored".to_string(),
        "load" => "load(t)\nadmitted requests' prefixes from the store; completion admits to prefill".to_string(),
        other if other.starts_with("dispatch[") => format!("{other}(t)\nrows to expert owners"),
        other if other.starts_with("experts[") => format!("{other}(t)\nthis rank's experts"),
        other if other.starts_with("combine[") => format!("{other}(t)\nsum by expert, check every result"),
        "Feedback" => "feedback\n(t+1)".to_string(),
        other => other.to_string(),
    }
}

/// The pool's drafter and its draft width, for `propose`'s label.
fn pool_drafter(pool: &PoolConfig) -> String {
    use kvflow_operators::policy::drafter::Drafter;
    match pool.scheduler.spec {
        Some(spec) => {
            let name = match spec.drafter {
                Drafter::Ngram(_) => "ngram",
                Drafter::Mtp => "mtp",
            };
            format!("{name}, k = {}", spec.draft_tokens)
        }
        None => "none".to_string(),
    }
}

/// What an edge out of `source`'s `port` carries.
fn edge_label(source: &str, port: usize, typ: &str) -> String {
    match (source, port) {
        ("forward", 0) => format!("launched: {typ}"),
        ("forward", 2) => format!("loads: {typ}"),
        ("verify", 0) => format!("launched: {typ}"),
        ("verify", 1) => format!("sampled: {typ}"),
        ("verify", 2) => format!("saved: {typ}"),
        ("admit", _) => format!("wake: {typ}"),
        _ => typ.to_string(),
    }
}

/// The DOT text of every pool of `graph`, each built as the runtime builds it; `extend` adds
/// operators to each pool's graph.
pub fn render(graph: &Graph, registry: &Registry, extend: Option<Extension>) -> Result<String> {
    let mut dot = Dot::default();
    dot.line("digraph kvflow {");
    dot.line("  rankdir=LR;");
    dot.line(format!("  label={};", quote(&format!("kvflow graph {}", graph.path.display()))));
    dot.line("  labelloc=t;");
    dot.line("  fontname=\"Helvetica\";");
    dot.line("  node [shape=box, style=rounded, fontname=\"Helvetica\"];");
    dot.line("  edge [fontname=\"Helvetica\", fontsize=10];");
    dot.line(format!("  workload [shape=note, label={}];", quote(&workload_label(graph))));
    // Each pool's admit and forward, for the links between pools.
    let mut ends = std::collections::HashMap::new();
    let all: Vec<&PoolConfig> = graph.pools.iter().collect();
    // An expert-parallel pool's chain follows the model's MoE layers (and the MTP drafter's
    // passes): its shapes say them, no weight is read.
    let model = if graph.pools.iter().any(|p| p.expert_parallel) {
        Some(
            kvflow_kernels::models::load_shapes(&graph.model)
                .map_err(|e| anyhow!("cannot load model {} (for its MoE layers): {e}", graph.model.display()))?,
        )
    } else {
        None
    };
    for pool in &graph.pools {
        let job = match &model {
            Some(model) => super::jobs::expert_parallel_job(graph, pool, model)?,
            None => None,
        };
        let collectives = super::pool::collectives(job.as_ref());
        let built = build(pool, collectives, graph.offload.as_ref(), registry, extend.clone())?;
        let id = |node: usize| quote(&format!("{}/{node}", pool.name));
        let ranks = if pool.ranks == 1 { "1 rank".to_string() } else { format!("{} ranks", pool.ranks) };
        dot.line("");
        dot.line(format!("  subgraph {} {{", quote(&format!("cluster_{}", pool.name))));
        dot.line(format!("    label={};", quote(&format!("pool {} ({}, {ranks})", pool.name, pool.role))));
        dot.line("    style=rounded;");
        for (&node, name) in built.operators.iter().filter(|(n, _)| !built.is_plumbing(**n)) {
            let shape = if name == "Feedback" { ", shape=circle, fontsize=9" } else { "" };
            dot.line(format!("    {} [label={}{shape}];", id(node), quote(&label(name, pool))));
        }
        for (src, port, dst, label) in built.edges() {
            let Some(from) = built.operators.get(&src) else { continue };
            let style = if from == "Feedback" { ", style=dashed, constraint=false" } else { "" };
            let label = edge_label(from, port, &label);
            dot.line(format!("    {} -> {} [label={}{style}];", id(src), id(dst), quote(&label)));
        }
        dot.line("  }");
        let find = |name: &str| built.operators.iter().find(|(_, n)| n.as_str() == name).map(|(&node, _)| id(node));
        // Handoffs leave as T0 is applied: from `verify`.
        if let (Some(admit), Some(forward)) = (find("admit"), find("verify")) {
            if super::links::Wiring::entry_kind(graph, &all, pool).is_some() {
                dot.line(format!("  workload -> {admit} [label=\"requests (ingress)\"];"));
            }
            ends.insert(pool.name.clone(), (admit, forward));
        }
    }
    // Links: a decode rank sends a remote prefill to a prefill pool's admit (when requests enter
    // the decode pools); the prefill pool's verify hands off back to the decode pool's admit
    // (through its inbox).
    let decode_first = super::links::decode_first(graph, &all);
    for link in &graph.links {
        if let (Some((prefill_admit, forward)), Some((admit, _))) = (ends.get(&link.from), ends.get(&link.to)) {
            if decode_first {
                dot.line(format!("  {admit} -> {prefill_admit} [label=\"remote prefill\", style=dashed];"));
            }
            let label = format!("handoff ({}): KV + state + T0", link.backend.name());
            dot.line(format!("  {forward} -> {admit} [label={}, style=bold];", quote(&label)));
        }
    }
    dot.line("}");
    Ok(dot.text)
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
    use super::*;

    #[test]
    fn record_types_are_shortened_to_their_name() {
        assert_eq!(record_type("alloc::vec::Vec<kvflow_operators::messages::StepPlan>"), "StepPlan");
        assert_eq!(record_type("alloc::vec::Vec<u64>"), "u64");
        assert_eq!(quote("a \"b\"\nc\\"), "\"a \\\"b\\\"\\nc\\\\\"");
    }
}
