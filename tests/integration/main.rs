//! kvflow's integration tests, one binary (each test file would relink everything).

mod asynchronous;
mod bad_input;
mod batch_invariance;
mod common;
mod cuda_emulated;
mod disaggregated;
mod docs;
mod expert_parallel;
mod faults;
mod fuzz;
mod gguf;
mod handoff;
mod hf_fixtures;
mod hosts;
mod offload;
mod operability;
mod plots;
mod processes;
mod recurrent_state;
mod registry;
mod routing;
mod runtime;
mod sampling;
mod seeded_models;
mod serve;
mod spec;
