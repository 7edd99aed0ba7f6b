//! Tests of the [`Validator`]: the defaults it fills in, how it resolves paths, and every check of
//! a value, each error naming its key and line.

use super::*;
use crate::graph::test_support::{assert_key_error, minimal_plus, Fixture, MINIMAL};

#[test]
fn minimal_graph_gets_every_default() {
    let fixture = Fixture::new();
    let graph = fixture.graph(MINIMAL);
    assert_eq!(graph.path, fixture.graph_path());
    assert_eq!(graph.model, fixture.dir.path().join("model"));
    assert_eq!(graph.memory, MemoryConfig { budget_bytes: 256 << 20, block_size: 16, snapshot_fraction: 0.25 });
    let scheduler = SchedulerConfig {
        max_running: 64,
        max_batched_tokens: 512,
        chunk_tokens: 64,
        prefix_cache: true,
        snapshot_interval_blocks: 4,
    };
    assert_eq!(graph.scheduler, scheduler);
    assert_eq!(
        graph.pools,
        vec![PoolConfig {
            name: "main".to_string(),
            role: PoolRole::Aggregated,
            ranks: 1,
            executor: "cpu".to_string(),
            executor_settings: toml::Table::new(),
            router: "least-outstanding".to_string(),
            memory: graph.memory.clone(),
            scheduler,
        }]
    );
    assert_eq!(
        graph.workload,
        WorkloadConfig {
            trace: None,
            format: "mooncake".to_string(),
            mode: WorkloadMode::Timestamps { time_scale: 1.0 },
            warmup: 0,
            limit: None,
            block_tokens: 512,
            max_output_tokens: None,
            seed: 0,
            ignore_eos: true,
            cancel_fraction: 0.0,
            cancel_after_ms: 0.0,
            pool_choice: PoolChoice::Seeded,
        }
    );
    assert_eq!(graph.slo, SloConfig { ttft_ms: None, tpot_ms: None });
    assert_eq!(graph.report_dir, PathBuf::from("out/graph"));
}

#[test]
fn concurrency_and_rate_modes_parse() {
    let fixture = Fixture::new();
    let graph = fixture.graph(&minimal_plus("[workload]\nmode = \"concurrency\"\nconcurrency = 8\n"));
    assert_eq!(graph.workload.mode, WorkloadMode::Concurrency(8));
    let graph = fixture.graph(&minimal_plus("[workload]\nmode = \"rate\"\nrate = 4\n"));
    assert_eq!(graph.workload.mode, WorkloadMode::Rate { per_second: 4.0 });
    let graph = fixture.graph(&minimal_plus("[workload]\ntime_scale = 0\n"));
    assert_eq!(graph.workload.mode, WorkloadMode::Timestamps { time_scale: 0.0 });
}

#[test]
fn relative_paths_resolve_against_the_graph_folder() {
    let root = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir_all(root.path().join("graphs/nested")).expect("graphs");
    std::fs::create_dir_all(root.path().join("models/tiny")).expect("model");
    std::fs::write(root.path().join("t.jsonl"), "").expect("trace");
    let path = root.path().join("graphs/nested/g.toml");
    let text = "[model]\npath = \"../../models/tiny\"\n[[pool]]\nname = \"p\"\n\
                [workload]\ntrace = \"../../t.jsonl\"\n[report]\nout = \"results\"\n";
    let graph = Graph::parse(&path, text).unwrap_or_else(|error| panic!("{error}"));
    let folder = root.path().join("graphs/nested");
    assert_eq!(graph.model, folder.join("../../models/tiny"));
    assert_eq!(graph.workload.trace, Some(folder.join("../../t.jsonl")));
    assert_eq!(graph.report_dir, folder.join("results"));
}

#[test]
fn absolute_paths_are_kept() {
    let fixture = Fixture::new();
    let model = fixture.dir.path().join("model");
    let graph = Graph::parse(
        Path::new("elsewhere/g.toml"),
        &format!("[model]\npath = {:?}\n[[pool]]\nname = \"p\"\n", model.display().to_string()),
    )
    .unwrap_or_else(|error| panic!("{error}"));
    assert_eq!(graph.model, model);
}

#[test]
fn a_graph_file_in_the_working_directory_resolves_paths_from_it() {
    let names = ComponentNames::builtin();
    let validator = Validator::new(Path::new("g.toml"), "", &names);
    assert_eq!(validator.resolve("model"), PathBuf::from("model"));
}

// --- model -------------------------------------------------------------------------------

#[test]
fn missing_model_is_an_error() {
    let error = Fixture::new().error("[[pool]]\nname = \"main\"\n");
    assert_eq!(error.key(), Some("model.path"));
    assert!(error.to_string().contains("missing"), "{error}");
}

#[test]
fn model_path_that_does_not_exist_names_the_resolved_path() {
    let fixture = Fixture::new();
    let error = fixture.error("\n[model]\npath = \"no_such_model\"\n[[pool]]\nname = \"a\"\n");
    let resolved = fixture.dir.path().join("no_such_model");
    assert_key_error(&error, "model.path", 3, &[&format!("`{}` does not exist", resolved.display())]);
}

// --- pools -------------------------------------------------------------------------------

#[test]
fn a_graph_without_pools_is_an_error() {
    let error = Fixture::new().error("[model]\npath = \"model\"\n");
    assert_eq!(error.key(), Some("pool"));
    assert!(error.to_string().contains("at least one [[pool]]"), "{error}");
}

#[test]
fn duplicate_pool_names_are_an_error() {
    let error = Fixture::new().error(&minimal_plus("\n[[pool]]\nname = \"main\"\n"));
    assert_key_error(&error, "pool.name", 8, &["`main` is already defined at line 5"]);
}

#[test]
fn a_pool_without_a_name_is_an_error_at_its_header() {
    let error = Fixture::new().error(&minimal_plus("[[pool]]\nranks = 2\n"));
    assert_key_error(&error, "pool.name", 6, &["missing"]);
}

#[test]
fn pool_names_must_be_identifiers() {
    let error = Fixture::new().error("[model]\npath = \"model\"\n[[pool]]\nname = \"my pool\"\n");
    assert_key_error(&error, "pool.name", 4, &["letters, digits"]);
}

#[test]
fn zero_ranks_is_an_error() {
    let error = Fixture::new().error(&minimal_plus("ranks = 0\n"));
    assert_key_error(&error, "pool.ranks", 6, &["at least 1"]);
}

#[test]
fn unknown_role_lists_the_roles() {
    let error = Fixture::new().error(&minimal_plus("role = \"verify\"\n"));
    assert_key_error(&error, "pool.role", 6, &["`verify`", "`aggregated`, `prefill`, `decode`"]);
}

#[test]
fn prefill_and_decode_roles_parse() {
    let fixture = Fixture::new();
    let graph = fixture.graph(
        "[model]\npath = \"model\"\n[[pool]]\nname = \"p\"\nrole = \"prefill\"\n\
         [[pool]]\nname = \"d\"\nrole = \"decode\"\nrouter = \"round-robin\"\n",
    );
    assert_eq!(graph.pools[0].role, PoolRole::Prefill);
    assert_eq!(graph.pools[1].role, PoolRole::Decode);
    assert_eq!(graph.pools[1].router, "round-robin");
}

#[test]
fn executor_must_be_in_the_registry() {
    let error = Fixture::new().error(&minimal_plus("executor = \"tpu\"\n"));
    assert_key_error(&error, "pool.executor", 6, &["`tpu` is not a known executor", "`cpu`"]);
}

#[test]
fn router_must_be_in_the_registry() {
    let error = Fixture::new().error(&minimal_plus("router = \"random\"\n"));
    assert_key_error(&error, "pool.router", 6, &["`random`", "`least-outstanding`, `round-robin`"]);
}

// --- memory and scheduler ----------------------------------------------------------------

#[test]
fn zero_block_size_is_an_error() {
    let error = Fixture::new().error(&minimal_plus("[memory]\nblock_size = 0\n"));
    assert_key_error(&error, "memory.block_size", 7, &["at least 1"]);
}

#[test]
fn snapshot_fraction_outside_zero_to_point_nine_is_an_error() {
    let fixture = Fixture::new();
    let error = fixture.error(&minimal_plus("[memory]\nsnapshot_fraction = 0.95\n"));
    assert_key_error(&error, "memory.snapshot_fraction", 7, &["between 0 and 0.9", "0.95"]);
    let error = fixture.error(&minimal_plus("[memory]\nsnapshot_fraction = -0.1\n"));
    assert_key_error(&error, "memory.snapshot_fraction", 7, &["-0.1"]);
    let error = fixture.error(&minimal_plus("[memory]\nsnapshot_fraction = nan\n"));
    assert_key_error(&error, "memory.snapshot_fraction", 7, &["NaN"]);
    assert_eq!(fixture.graph(&minimal_plus("[memory]\nsnapshot_fraction = 0\n")).memory.snapshot_fraction, 0.0);
}

#[test]
fn zero_snapshot_interval_is_an_error() {
    let error = Fixture::new().error(&minimal_plus("[memory]\nsnapshot_interval_blocks = 0\n"));
    assert_key_error(&error, "memory.snapshot_interval_blocks", 7, &["at least 1"]);
}

#[test]
fn budget_accepts_bytes_or_a_string_with_a_unit() {
    let fixture = Fixture::new();
    let budget = |value: &str| fixture.graph(&minimal_plus(&format!("[memory]\nbudget_bytes = {value}\n"))).memory;
    assert_eq!(budget("1048576").budget_bytes, 1 << 20);
    assert_eq!(budget("\"2 GiB\"").budget_bytes, 2 << 30);
}

#[test]
fn zero_or_unparsable_budget_is_an_error() {
    let fixture = Fixture::new();
    let error = fixture.error(&minimal_plus("[memory]\nbudget_bytes = 0\n"));
    assert_key_error(&error, "memory.budget_bytes", 7, &["more than 0 bytes"]);
    let error = fixture.error(&minimal_plus("[memory]\nbudget_bytes = \"0 MiB\"\n"));
    assert_key_error(&error, "memory.budget_bytes", 7, &["more than 0 bytes"]);
    let error = fixture.error(&minimal_plus("[memory]\nbudget_bytes = \"64 MiX\"\n"));
    assert_key_error(&error, "memory.budget_bytes", 7, &["unknown unit `MiX`"]);
    let error = fixture.error(&minimal_plus("[memory]\nbudget_bytes = -5\n"));
    assert_key_error(&error, "memory.budget_bytes", 7, &["-5"]);
    let error = fixture.error(&minimal_plus("[memory]\nbudget_bytes = 1.5\n"));
    assert_key_error(&error, "memory.budget_bytes", 7, &["expected a byte count", "float"]);
}

#[test]
fn chunk_larger_than_max_batched_tokens_is_an_error() {
    let error = Fixture::new().error(&minimal_plus("[scheduler]\nmax_batched_tokens = 512\nchunk_tokens = 4096\n"));
    assert_key_error(&error, "scheduler.chunk_tokens", 8, &["4096 is larger than scheduler.max_batched_tokens (512)"]);
}

#[test]
fn max_batched_tokens_below_the_default_chunk_blames_max_batched_tokens() {
    let error = Fixture::new().error(&minimal_plus("[scheduler]\nmax_batched_tokens = 32\n"));
    assert_key_error(&error, "scheduler.max_batched_tokens", 7, &["32 is smaller than scheduler.chunk_tokens (64"]);
}

#[test]
fn zero_scheduler_limits_are_errors() {
    let fixture = Fixture::new();
    for key in ["max_running", "max_batched_tokens", "chunk_tokens"] {
        let error = fixture.error(&minimal_plus(&format!("[scheduler]\n{key} = 0\n")));
        assert_key_error(&error, &format!("scheduler.{key}"), 7, &["at least 1"]);
    }
}

// --- workload ----------------------------------------------------------------------------

#[test]
fn concurrency_mode_needs_concurrency_of_at_least_one() {
    let fixture = Fixture::new();
    let error = fixture.error(&minimal_plus("[workload]\nmode = \"concurrency\"\n"));
    assert_key_error(&error, "workload.concurrency", 7, &["mode = \"concurrency\" needs `concurrency`"]);
    let error = fixture.error(&minimal_plus("[workload]\nmode = \"concurrency\"\nconcurrency = 0\n"));
    assert_key_error(&error, "workload.concurrency", 8, &["at least 1"]);
}

#[test]
fn rate_mode_needs_a_positive_rate() {
    let fixture = Fixture::new();
    let error = fixture.error(&minimal_plus("[workload]\nmode = \"rate\"\n"));
    assert_key_error(&error, "workload.rate", 7, &["needs `rate`"]);
    let error = fixture.error(&minimal_plus("[workload]\nmode = \"rate\"\nrate = 0.0\n"));
    assert_key_error(&error, "workload.rate", 8, &["more than 0"]);
    let error = fixture.error(&minimal_plus("[workload]\nmode = \"rate\"\nrate = inf\n"));
    assert_key_error(&error, "workload.rate", 8, &["more than 0"]);
}

#[test]
fn negative_time_scale_is_an_error() {
    let error = Fixture::new().error(&minimal_plus("[workload]\nmode = \"timestamps\"\ntime_scale = -1.0\n"));
    assert_key_error(&error, "workload.time_scale", 8, &["at least 0"]);
}

#[test]
fn a_key_of_another_mode_is_an_error_naming_its_mode() {
    let fixture = Fixture::new();
    let error = fixture.error(&minimal_plus("[workload]\nmode = \"timestamps\"\nrate = 4.0\n"));
    assert_key_error(&error, "workload.rate", 8, &["belongs to mode = \"rate\"", "the mode is \"timestamps\""]);
    let error = fixture.error(&minimal_plus("[workload]\nconcurrency = 8\n"));
    assert_key_error(&error, "workload.concurrency", 7, &["belongs to mode = \"concurrency\"", "(the default)"]);
    let error = fixture.error(&minimal_plus("[workload]\nmode = \"rate\"\nrate = 1.0\ntime_scale = 2.0\n"));
    assert_key_error(&error, "workload.time_scale", 9, &["belongs to mode = \"timestamps\""]);
}

#[test]
fn unknown_mode_is_an_error() {
    let error = Fixture::new().error(&minimal_plus("[workload]\nmode = \"burst\"\n"));
    assert_key_error(&error, "workload.mode", 7, &["`burst`", "`timestamps`, `concurrency`, `rate`"]);
}

#[test]
fn unknown_trace_format_is_an_error() {
    let error = Fixture::new().error(&minimal_plus("[workload]\nformat = \"sharegpt\"\n"));
    assert_key_error(&error, "workload.format", 7, &["`sharegpt`", "`mooncake`, `azure`, `vidur`"]);
}

#[test]
fn zero_block_tokens_is_an_error() {
    let error = Fixture::new().error(&minimal_plus("[workload]\nblock_tokens = 0\n"));
    assert_key_error(&error, "workload.block_tokens", 7, &["at least 1"]);
}

#[test]
fn zero_limit_and_zero_output_cap_are_errors() {
    let fixture = Fixture::new();
    assert_key_error(&fixture.error(&minimal_plus("[workload]\nlimit = 0\n")), "workload.limit", 7, &["at least 1"]);
    assert_key_error(
        &fixture.error(&minimal_plus("[workload]\nmax_output_tokens = 0\n")),
        "workload.max_output_tokens",
        7,
        &["at least 1"],
    );
}

#[test]
fn trace_that_does_not_exist_is_an_error() {
    let fixture = Fixture::new();
    let error = fixture.error(&minimal_plus("[workload]\ntrace = \"missing.jsonl\"\n"));
    let resolved = fixture.dir.path().join("missing.jsonl");
    assert_key_error(&error, "workload.trace", 7, &[&format!("`{}` does not exist", resolved.display())]);
    let graph = fixture.graph(&minimal_plus("[workload]\ntrace = \"trace.jsonl\"\n"));
    assert_eq!(graph.workload.trace, Some(fixture.dir.path().join("trace.jsonl")));
}

// --- slo ---------------------------------------------------------------------------------

#[test]
fn slo_values_must_be_positive() {
    let fixture = Fixture::new();
    let error = fixture.error(&minimal_plus("[slo]\nttft_ms = 0\n"));
    assert_key_error(&error, "slo.ttft_ms", 7, &["more than 0"]);
    let error = fixture.error(&minimal_plus("[slo]\nttft_ms = 100\ntpot_ms = -5.0\n"));
    assert_key_error(&error, "slo.tpot_ms", 8, &["more than 0"]);
}
