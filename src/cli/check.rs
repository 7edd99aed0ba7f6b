//! `kvflow check`: validates a graph and prints what the runtime would build — a one-line summary
//! of its pools, or the operator graph as Graphviz DOT.

use anyhow::Result;
use kvflow::graph::Graph;
use kvflow::registry::Registry;
use std::path::Path;

/// `kvflow check GRAPH [--dot]`.
pub fn run(path: &Path, dot: bool) -> Result<()> {
    let registry = Registry::default();
    let graph = Graph::load_with(path, &registry.names())?;
    kvflow::runtime::pick_pools(&graph, None)?; // what `run` would refuse, `check` refuses
    if dot {
        print!("{}", kvflow::runtime::dot::render(&graph, &registry, None)?);
        return Ok(());
    }
    let pools: Vec<String> =
        graph.pools.iter().map(|p| format!("{} ({}, {} ranks)", p.name, p.role, p.ranks)).collect();
    println!(
        "{}: ok — model {}, {} pool(s): {}",
        graph.path.display(),
        graph.model.display(),
        graph.pools.len(),
        pools.join(", ")
    );
    Ok(())
}
