//! Code outside the kvflow crates registers its own router and a graph runs it by name.

use crate::runtime::write_graph;
use kvflow::graph::{Graph, Overrides};
use kvflow::registry::Registry;
use kvflow::runtime::{self, RunOptions};
use kvflow_operators::policy::router::{RouteRequest, Router, RouterContext};
use serde_json::Value;

/// Sends every request to the last rank.
struct LastRank(usize);

impl Router for LastRank {
    fn route(&mut self, _req: &RouteRequest, _outstanding: &[usize]) -> usize {
        self.0 - 1
    }
}

#[test]
fn a_router_registered_outside_kvflow_runs_from_a_graph() {
    let dir = tempfile::tempdir().unwrap();
    let graph_path = write_graph(
        dir.path(),
        "hf/llama",
        "mooncake_conversation_head.jsonl",
        "mode = \"concurrency\"\nconcurrency = 4\nlimit = 8",
        "64 MiB",
    );
    let text = std::fs::read_to_string(&graph_path).unwrap().replace("ranks = 2", "ranks = 3\nrouter = \"last-rank\"");
    std::fs::write(&graph_path, text).unwrap();
    // Without the registration the graph is rejected by name.
    let e = Graph::load(&graph_path).unwrap_err().to_string();
    assert!(e.contains("last-rank") && e.contains("pool.router"), "{e}");
    let mut registry = Registry::default();
    registry.routers.register("last-rank", |ctx: RouterContext| Box::new(LastRank(ctx.ranks)) as Box<dyn Router>);
    let mut graph = Graph::load_with(&graph_path, &registry.names()).unwrap();
    graph.apply_overrides(&Overrides::default()).unwrap();
    let outcome = runtime::run(&graph, &RunOptions { verify: true, ..Default::default() }, &registry).unwrap();
    let report = outcome.report.unwrap();
    assert_eq!(report["verify"]["mismatched"], 0);
    let ranks: Vec<Value> = std::fs::read_to_string(dir.path().join("out/requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["rank"].clone())
        .collect();
    assert_eq!(ranks.len(), 8);
    assert!(ranks.iter().all(|r| r == 2), "every request ran on the last rank: {ranks:?}");
}
