//! Graph files: the TOML a user writes to describe what kvflow serves and how (DESIGN §3).
//!
//! A graph file names the model, sizes memory and the scheduler, lists the pools (role, ranks,
//! executor, router) and the links between them (which prefill pools hand off to which decode
//! pools, over which transfer backend), and says which trace to replay, with which SLO and where to
//! write the report.
//! It never wires operators: the runtime builds the per-pool operator graph of DESIGN §4 from it,
//! and `kvflow check --dot` prints the graph it builds so users see the dataflow they run.
//!
//! Loading happens in three layers, each used once:
//! 1. *raw*: serde structs mirroring the file (`#[serde(deny_unknown_fields)]`, every value kept
//!    with its byte span), so an unknown key or a wrong type is a TOML error with a position;
//! 2. *validation*: every value is checked once, defaults are filled in and relative paths are
//!    resolved; each error names the file, the line of the key and the dotted key
//!    (`graphs/x.toml:14: key `scheduler.chunk_tokens`: 4096 is larger than
//!    scheduler.max_batched_tokens (512)`);
//! 3. *use*: [`Graph`] and its parts are plain immutable values. Command-line flags
//!    ([`Overrides`]) are written into the raw layer before validation
//!    ([`Graph::load_overridden`]), so they go through the same checks and stand in for a value
//!    the file lacks or gets wrong.
//!
//! Relative paths in the file (`model.path`, `workload.trace`, `report.out`) resolve against the
//! folder holding the graph file; paths given as overrides are used as given (relative to the
//! working directory). Operators with a choice (executor, router) are chosen by name from the
//! registries [`ComponentNames`].
//!
//! A graph is *aggregated* (every pool prefills and decodes its own requests) or *disaggregated*
//! (prefill pools hand off to decode pools over `[[link]]`s). docs/graph-format.md is the manual:
//! every table and key, with its default, an example of each, and the rules between pools;
//! tests/integration/graph_format.rs keeps it complete.

mod config;
mod error;
mod overrides;
mod raw;
mod rules;
#[cfg(test)]
mod test_support;
mod validate;

use std::path::Path;

pub use config::*;
pub use error::{GraphError, Location};
pub use overrides::Overrides;
pub use rules::{host_port, parse_byte_size, parse_endpoint, parse_link_rate, MAX_DEPLOYMENT_TOKEN_BYTES};

use error::toml_error;
use raw::RawGraph;
use validate::Validator;

// ---------------------------------------------------------------------------------------------
// Loading, overrides, lookup.

impl Graph {
    /// Reads, parses and validates a graph file.
    pub fn load(path: &Path) -> Result<Graph, GraphError> {
        Graph::load_with(path, &ComponentNames::builtin())
    }

    /// [`Graph::load`], checking component choices against `names` (a registry's).
    pub fn load_with(path: &Path, names: &ComponentNames) -> Result<Graph, GraphError> {
        Graph::load_overridden(path, names, &Overrides::default())
    }

    /// [`Graph::load_with`] with command-line overrides written in before anything is checked:
    /// a flag stands in for a value the file lacks or gets wrong.
    pub fn load_overridden(path: &Path, names: &ComponentNames, overrides: &Overrides) -> Result<Graph, GraphError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| GraphError::Read { file: path.to_path_buf(), source })?;
        Graph::parse_overridden(path, &text, names, overrides)
    }

    /// Parses and validates `text` as the graph file `path` (which names the file in errors and
    /// anchors relative paths; it is not read).
    pub fn parse(path: &Path, text: &str) -> Result<Graph, GraphError> {
        Graph::parse_with(path, text, &ComponentNames::builtin())
    }

    /// [`Graph::parse`], checking component choices against `names`.
    pub fn parse_with(path: &Path, text: &str, names: &ComponentNames) -> Result<Graph, GraphError> {
        Graph::parse_overridden(path, text, names, &Overrides::default())
    }

    /// [`Graph::parse_with`] with `overrides` written into the file as read, then checked with it.
    pub fn parse_overridden(
        path: &Path,
        text: &str,
        names: &ComponentNames,
        overrides: &Overrides,
    ) -> Result<Graph, GraphError> {
        let mut raw: RawGraph = toml::from_str(text).map_err(|error| toml_error(path, text, &error))?;
        let command_line = overrides.write_into(&mut raw);
        Validator::new(path, text, names, command_line).graph(raw)
    }

    /// The pool named `name`; the error lists the graph's pools.
    pub fn pool(&self, name: &str) -> Result<&PoolConfig, GraphError> {
        self.pools.iter().find(|pool| pool.name == name).ok_or_else(|| GraphError::UnknownPool {
            file: self.path.clone(),
            name: name.to_string(),
            known: self.pools.iter().map(|pool| pool.name.clone()).collect(),
        })
    }

    /// Whether the graph has prefill and decode pools (then it has no aggregated pool).
    pub fn is_disaggregated(&self) -> bool {
        self.pools.iter().any(|pool| pool.role != PoolRole::Aggregated)
    }

    /// The links out of pool `pool` (a prefill pool's decode pools), in file order; empty for
    /// another role or an unknown name.
    pub fn links_from(&self, pool: &str) -> Vec<&LinkConfig> {
        self.links.iter().filter(|link| link.from == pool).collect()
    }

    /// The links into pool `pool` (a decode pool's prefill pools), in file order; empty for
    /// another role or an unknown name.
    pub fn links_to(&self, pool: &str) -> Vec<&LinkConfig> {
        self.links.iter().filter(|link| link.to == pool).collect()
    }

    /// The pools new requests enter, in file order: the decode pools when the graph is
    /// disaggregated (a new request is first routed to a decode rank, which prefills it locally or
    /// has a linked prefill pool do it: DESIGN §8), else every pool (all aggregated).
    pub fn entry_pools(&self) -> Vec<&PoolConfig> {
        let entry = if self.is_disaggregated() { PoolRole::Decode } else { PoolRole::Aggregated };
        self.pools.iter().filter(|pool| pool.role == entry).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::test_support::{linked_plus, minimal_plus, Fixture, MINIMAL};
    use super::*;

    /// The TOML examples in this module's documentation, so the docs cannot drift from the parser.
    fn documented_examples() -> Vec<String> {
        let source = include_str!("../../docs/graph-format.md");
        let mut examples = Vec::new();
        let mut example: Option<String> = None;
        for line in source.lines() {
            match (&mut example, line) {
                (None, "```toml") => example = Some(String::new()),
                (Some(_), "```") => examples.extend(example.take()),
                (Some(text), _) => {
                    text.push_str(line);
                    text.push('\n');
                }
                _ => {}
            }
        }
        examples
    }

    fn documented_example() -> String {
        documented_examples()[0].clone()
    }

    #[test]
    fn documented_example_parses_with_every_value() {
        let root = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(root.path().join("graphs")).expect("graphs");
        std::fs::create_dir_all(root.path().join("fixtures/hf/kimi_linear")).expect("model");
        std::fs::create_dir_all(root.path().join("traces")).expect("traces");
        std::fs::write(root.path().join("traces/mooncake_conversation_head.jsonl"), "").expect("trace");
        let path = root.path().join("graphs/quickstart.toml");
        std::fs::write(&path, documented_example()).expect("graph file");

        let graph = Graph::load(&path).unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(graph.model, root.path().join("fixtures/hf/kimi_linear"));
        assert_eq!(graph.memory, MemoryConfig { budget_bytes: 64 << 20, block_size: 16, snapshot_fraction: 0.25 });
        let scheduler = SchedulerConfig {
            max_running: 32,
            max_batched_tokens: 256,
            chunk_tokens: 64,
            prefix_cache: true,
            snapshot_interval_blocks: 4,
            admission: AdmissionPolicy::Optimistic,
            spec: Some(kvflow_operators::policy::scheduler::SpecConfig {
                draft_tokens: 4,
                drafter: kvflow_operators::policy::drafter::Drafter::Ngram(
                    kvflow_operators::policy::drafter::NgramDrafter { min_n: 1, max_n: 3 },
                ),
                widen_buckets: false,
            }),
        };
        assert_eq!(graph.scheduler, scheduler);
        assert_eq!(graph.pools.len(), 2);
        assert_eq!(graph.pools[0].ranks, 2);
        assert_eq!(graph.pools[0].role, PoolRole::Aggregated);
        assert_eq!(graph.pools[0].router, "least-outstanding");
        assert_eq!((graph.pools[0].memory.clone(), graph.pools[0].scheduler), (graph.memory.clone(), scheduler));
        let second = &graph.pools[1];
        assert_eq!(second.executor, "cpu-deferred");
        assert_eq!(second.executor_settings.get("delay_steps").and_then(|v| v.as_integer()), Some(1));
        assert_eq!(second.memory.budget_bytes, 32 << 20, "the pool's own [pool.memory] key");
        assert_eq!(second.memory.block_size, 16, "the rest from [memory]");
        assert_eq!(second.scheduler, SchedulerConfig { max_running: 8, ..scheduler });
        assert_eq!(
            graph.workload,
            WorkloadConfig {
                trace: Some(root.path().join("traces/mooncake_conversation_head.jsonl")),
                format: "mooncake".to_string(),
                mode: WorkloadMode::Timestamps { time_scale: 0.01 },
                warmup: 2,
                limit: Some(40),
                block_tokens: 16,
                max_output_tokens: Some(32),
                seed: 1,
                ignore_eos: true,
                cancel_fraction: 0.0,
                cancel_after_ms: 0.0,
                pool_choice: PoolChoice::Seeded,
            }
        );
        assert_eq!(graph.slo, SloConfig { ttft_ms: Some(2000.0), tpot_ms: Some(200.0) });
        assert_eq!(graph.report_dir, root.path().join("out/quickstart"));
    }

    #[test]
    fn documented_serve_example_parses_with_every_value() {
        let fixture = Fixture::new();
        let graph = fixture.graph(&minimal_plus(&documented_examples()[2]));
        let serve = ServeConfig {
            model_name: "SmolLM2-135M-Instruct".to_string(),
            max_requests: 256,
            max_tokens: 256,
            max_context: Some(1024),
        };
        assert_eq!(graph.serve, serve);
    }

    #[test]
    fn documented_disaggregated_example_parses_with_every_value() {
        let examples = documented_examples();
        assert_eq!(examples.len(), 3, "the aggregated, disaggregated and [serve] examples");
        let root = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(root.path().join("graphs")).expect("graphs");
        std::fs::create_dir_all(root.path().join("fixtures/hf/llama")).expect("model");
        let path = root.path().join("graphs/pd.toml");
        std::fs::write(&path, &examples[1]).expect("graph file");

        let graph = Graph::load(&path).unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(graph.model, root.path().join("fixtures/hf/llama"));
        let roles: Vec<_> = graph.pools.iter().map(|p| (p.name.as_str(), p.role, p.ranks)).collect();
        assert_eq!(roles, [("prefill", PoolRole::Prefill, 2), ("decode", PoolRole::Decode, 1)]);
        assert_eq!(graph.pools[0].disaggregation, DisaggregationConfig::default());
        assert_eq!(
            graph.pools[1].disaggregation,
            DisaggregationConfig { remote_prefill_min_tokens: 32, max_prefill_queue: Some(16) }
        );
        assert_eq!(
            graph.links,
            [LinkConfig {
                from: "prefill".to_string(),
                to: "decode".to_string(),
                backend: TransferBackend::Tcp,
                endpoint: Some(Endpoint { host: "127.0.0.1".to_string(), port: 0 }),
                bandwidth: Some(100_000_000),
                stream_min_tokens: Some(1024),
            }]
        );
        assert_eq!(
            graph.transfer,
            TransferConfig { deployment_token: Some("change-me".to_string()), checksum: true, connections: 2 }
        );
        assert_eq!(
            graph.faults,
            FaultsConfig {
                seed: 7,
                drop_connection: 0.01,
                delay_ms: 5.0,
                delay_probability: 0.1,
                corrupt: 0.001,
                duplicate_completion: 0.001,
            }
        );
    }

    #[test]
    fn transfer_backends_round_trip_their_names() {
        for backend in TransferBackend::ALL {
            assert_eq!(TransferBackend::from_name(backend.name()), Some(backend));
            assert_eq!(backend.to_string(), backend.name());
        }
        assert_eq!(TransferBackend::from_name("rdma"), None);
        assert_eq!(TransferBackend::default(), TransferBackend::Inproc);
    }

    #[test]
    fn load_names_a_missing_graph_file() {
        let error = Graph::load(Path::new("/nonexistent/kvflow/graph.toml")).expect_err("no such file");
        assert!(matches!(error, GraphError::Read { .. }));
        assert!(error.to_string().starts_with("/nonexistent/kvflow/graph.toml: cannot read the graph file"), "{error}");
    }

    #[test]
    fn pool_lookup_lists_the_pools_it_has() {
        let fixture = Fixture::new();
        let graph = fixture.graph(&linked_plus(""));
        assert_eq!(graph.pool("d").map(|pool| pool.role).ok(), Some(PoolRole::Decode));
        let error = graph.pool("prefill").expect_err("no such pool");
        assert!(error.to_string().contains("no pool named `prefill`; the pools are `p`, `d`"), "{error}");
    }

    // --- overrides ---------------------------------------------------------------------------

    #[test]
    fn concurrency_override_switches_the_mode() {
        let fixture = Fixture::new();
        let text = minimal_plus("[workload]\nmode = \"rate\"\nrate = 2.0\n");
        let graph = fixture.parse_overridden(&text, &Overrides { concurrency: Some(4), ..Overrides::default() });
        assert_eq!(graph.expect("valid").workload.mode, WorkloadMode::Concurrency(4));
    }

    #[test]
    fn ranks_override_applies_to_every_pool() {
        let fixture = Fixture::new();
        let text = minimal_plus("[[pool]]\nname = \"second\"\nranks = 3\n");
        let graph =
            fixture.parse_overridden(&text, &Overrides { ranks: Some(2), ..Overrides::default() }).expect("valid");
        assert!(graph.pools.iter().all(|pool| pool.ranks == 2), "{:?}", graph.pools);
    }

    #[test]
    fn overrides_set_their_fields_and_leave_the_rest() {
        let fixture = Fixture::new();
        let before = fixture.graph(MINIMAL);
        let trace = fixture.dir.path().join("trace.jsonl");
        let graph = fixture
            .parse_overridden(
                MINIMAL,
                &Overrides {
                    model: Some(fixture.dir.path().to_path_buf()),
                    trace: Some(trace.clone()),
                    format: Some("azure".to_string()),
                    limit: Some(10),
                    warmup: Some(3),
                    block_tokens: Some(8),
                    max_output_tokens: Some(5),
                    out: Some(PathBuf::from("results/run1")),
                    ..Overrides::default()
                },
            )
            .expect("valid");
        assert_eq!(graph.model, fixture.dir.path());
        assert_eq!(graph.workload.trace, Some(trace));
        assert_eq!(graph.workload.format, "azure");
        assert_eq!(graph.workload.limit, Some(10));
        assert_eq!(graph.workload.warmup, 3);
        assert_eq!(graph.workload.block_tokens, 8);
        assert_eq!(graph.workload.max_output_tokens, Some(5));
        assert_eq!(graph.report_dir, PathBuf::from("results/run1"));
        assert_eq!((graph.memory, graph.scheduler, graph.pools), (before.memory, before.scheduler, before.pools));
        assert_eq!(graph.workload.mode, before.workload.mode);
    }

    #[test]
    fn no_overrides_change_nothing() {
        let fixture = Fixture::new();
        assert_eq!(fixture.parse_overridden(MINIMAL, &Overrides::default()).expect("valid"), fixture.graph(MINIMAL));
    }

    #[test]
    fn an_override_stands_in_for_a_value_the_graph_lacks_or_gets_wrong() {
        let fixture = Fixture::new();
        let model = fixture.dir.path().join("model");
        // No model at the graph's path, a trace that is not there, a limit of 0 and no pool ranks
        // that the validator would take: each flag replaces its value before anything is checked.
        let text = "[model]\npath = \"missing-model\"\n\n[[pool]]\nname = \"main\"\nranks = 0\n\n\
                    [workload]\ntrace = \"missing.jsonl\"\nlimit = 0\nmode = \"rate\"\nrate = -1.0\n";
        let error = fixture.error(text);
        assert_eq!(error.key(), Some("model.path"), "{error}");
        let overrides = Overrides {
            model: Some(model.clone()),
            trace: Some(fixture.dir.path().join("trace.jsonl")),
            limit: Some(5),
            ranks: Some(2),
            concurrency: Some(3),
            ..Overrides::default()
        };
        let graph = fixture.parse_overridden(text, &overrides).expect("every wrong value is overridden");
        assert_eq!(graph.model, model);
        assert_eq!((graph.workload.limit, graph.pools[0].ranks), (Some(5), 2));
        assert_eq!(graph.workload.mode, WorkloadMode::Concurrency(3));
        // A wrong value that no flag replaces is still an error naming its line.
        let error =
            fixture.parse_overridden(text, &Overrides { model: Some(model), ..Overrides::default() }).unwrap_err();
        assert_eq!((error.key(), error.line()), (Some("pool.ranks"), Some(6)), "{error}");
    }

    #[test]
    fn invalid_overrides_are_errors_that_name_the_command_line() {
        let fixture = Fixture::new();
        let cases: Vec<(Overrides, &str)> = vec![
            (Overrides { concurrency: Some(0), ..Overrides::default() }, "workload.concurrency"),
            (Overrides { ranks: Some(0), ..Overrides::default() }, "pool.ranks"),
            (Overrides { block_tokens: Some(0), ..Overrides::default() }, "workload.block_tokens"),
            (Overrides { limit: Some(0), ..Overrides::default() }, "workload.limit"),
            (Overrides { max_output_tokens: Some(0), ..Overrides::default() }, "workload.max_output_tokens"),
            (Overrides { format: Some("csv".to_string()), ..Overrides::default() }, "workload.format"),
            (Overrides { model: Some(PathBuf::from("/nonexistent/model")), ..Overrides::default() }, "model.path"),
            (
                Overrides { trace: Some(PathBuf::from("/nonexistent/t.jsonl")), ..Overrides::default() },
                "workload.trace",
            ),
        ];
        for (overrides, key) in cases {
            let overrides = Overrides { warmup: Some(7), ..overrides };
            let error = fixture.parse_overridden(MINIMAL, &overrides).expect_err(key);
            assert_eq!(error.key(), Some(key), "{error}");
            assert_eq!(error.line(), None, "{error}");
            assert!(error.to_string().contains("(set on the command line)"), "{error}");
        }
    }

    #[test]
    fn paths_in_a_graph_are_written_as_a_person_would_type_them() {
        use super::validate::lexically_normal;
        let fixture = Fixture::new();
        let graph = fixture.graph(&minimal_plus("[report]\nout = \"../out/./quickstart\"\n"));
        let parent = fixture.dir.path().parent().unwrap();
        assert_eq!(graph.report_dir, parent.join("out/quickstart"));
        let cases =
            [("graphs/../out/q", "out/q"), ("./a/b/../c", "a/c"), ("../x", "../x"), ("a/..", "."), ("/../a", "/a")];
        for (given, tidy) in cases {
            assert_eq!(lexically_normal(std::path::Path::new(given)), PathBuf::from(tidy), "{given}");
        }
    }
}
