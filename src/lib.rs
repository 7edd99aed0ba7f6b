//! kvflow: an LLM serving runtime whose stages are operators of a timely dataflow graph
//! (docs/design.md). This crate holds the graph spec, pool runtime, trace replay, reports and CLI;
//! model math lives in `kvflow-kernels`, operators in `kvflow-operators`.

pub mod bench;
pub mod flags;
pub mod generate;
pub mod graph;
pub mod launch;
pub mod plot;
pub mod registry;
pub mod report;
pub mod runtime;
pub mod server;
pub mod signals;
pub mod text;
pub mod trace;
pub mod workload;
