//! Tests of the [`Validator`]: the defaults it fills in, how it resolves paths, and every check of
//! a value, each error naming its key and line.

use super::*;
use crate::graph::test_support::{assert_key_error, link, linked_plus, minimal_plus, pools_plus, Fixture, MINIMAL};
use crate::graph::{Endpoint, FaultsConfig, LinkConfig, TransferBackend, TransferConfig};

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
        admission: AdmissionPolicy::Optimistic,
        spec: None,
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
            disaggregation: DisaggregationConfig { remote_prefill_min_tokens: 0, max_prefill_queue: None },
            expert_parallel: false,
            hosts: Vec::new(),
        }]
    );
    assert_eq!(graph.links, vec![]);
    assert_eq!(graph.transfer, TransferConfig { deployment_token: None, checksum: true, connections: 2 });
    assert_eq!(graph.faults, FaultsConfig::default());
    assert_eq!(graph.faults.seed, 0);
    assert!(!graph.faults.any());
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
    assert_eq!(graph.model, root.path().join("models/tiny"));
    assert_eq!(graph.workload.trace, Some(root.path().join("t.jsonl")));
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
    let validator = Validator::new(Path::new("g.toml"), "", &names, Default::default());
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
         [[pool]]\nname = \"d\"\nrole = \"decode\"\nrouter = \"round-robin\"\n\
         [[link]]\nfrom = \"p\"\nto = \"d\"\n",
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

// --- prefill/decode: roles, links, disaggregation ----------------------------------------

#[test]
fn a_linked_pair_gets_every_default() {
    let graph = Fixture::new().graph(&linked_plus(""));
    let inproc = LinkConfig {
        from: "p".to_string(),
        to: "d".to_string(),
        backend: TransferBackend::Inproc,
        endpoint: None,
        bandwidth: None,
        stream_min_tokens: None,
    };
    assert_eq!(graph.links, vec![inproc]);
    assert!(graph.is_disaggregated());
    assert!(graph.pools.iter().all(|pool| pool.disaggregation == DisaggregationConfig::default()));
    assert_eq!(graph.transfer, TransferConfig::default());
    assert_eq!(graph.faults, FaultsConfig::default());
}

#[test]
fn a_graph_mixing_aggregated_and_disaggregated_pools_is_an_error() {
    let fixture = Fixture::new();
    let text =
        pools_plus(&[("p", "prefill"), ("d", "decode")], &format!("{}[[pool]]\nname = \"main\"\n", link("p", "d")));
    let error = fixture.error(&text);
    assert_key_error(
        &error,
        "pool.role",
        12,
        &[
            "pool `main` is aggregated (the default role)",
            "also has prefill and decode pools (`p`, `d`)",
            "all aggregated",
        ],
    );
    let error =
        fixture.error(&pools_plus(&[("main", "aggregated"), ("p", "prefill"), ("d", "decode")], &link("p", "d")));
    assert_key_error(&error, "pool.role", 5, &["pool `main` is aggregated, but"]);
}

#[test]
fn prefill_pools_need_decode_pools_and_the_other_way_round() {
    let fixture = Fixture::new();
    let error = fixture.error(&pools_plus(&[("p", "prefill")], ""));
    assert_key_error(&error, "pool.role", 5, &["prefill pool `p` has no decode pool", "role = \"decode\""]);
    let error = fixture.error(&pools_plus(&[("d1", "decode"), ("d2", "decode")], ""));
    assert_key_error(&error, "pool.role", 5, &["decode pool `d1` has no prefill pool", "role = \"aggregated\""]);
}

#[test]
fn a_link_to_an_unknown_pool_names_it_and_lists_the_pools() {
    let fixture = Fixture::new();
    let error = fixture.error(&pools_plus(&[("p", "prefill"), ("d", "decode")], &link("p", "decoder")));
    assert_key_error(&error, "link.to", 11, &["no pool named `decoder`; the pools are `p`, `d`"]);
    let error = fixture.error(&pools_plus(&[("p", "prefill"), ("d", "decode")], &link("q", "d")));
    assert_key_error(&error, "link.from", 10, &["no pool named `q`; the pools are `p`, `d`"]);
}

#[test]
fn a_link_against_the_roles_names_the_pools_role() {
    let fixture = Fixture::new();
    let pools = [("p", "prefill"), ("d", "decode")];
    let error = fixture.error(&pools_plus(&pools, &link("d", "d")));
    assert_key_error(&error, "link.from", 10, &["pool `d` is a decode pool", "`from` names a prefill pool"]);
    let error = fixture.error(&pools_plus(&pools, &link("p", "p")));
    assert_key_error(&error, "link.to", 11, &["pool `p` is a prefill pool", "`to` names a decode pool"]);
    // Aggregated pools cannot be linked, in either direction.
    let error = fixture.error(&minimal_plus(&link("main", "main")));
    assert_key_error(&error, "link.from", 7, &["pool `main` is aggregated", "cannot be linked"]);
}

#[test]
fn a_link_without_from_or_to_is_an_error_at_its_header() {
    let fixture = Fixture::new();
    let pools = [("p", "prefill"), ("d", "decode")];
    let error = fixture.error(&pools_plus(&pools, "[[link]]\nto = \"d\"\n"));
    assert_key_error(&error, "link.from", 9, &["missing", "prefill pool"]);
    let error = fixture.error(&pools_plus(&pools, "[[link]]\nfrom = \"p\"\n"));
    assert_key_error(&error, "link.to", 9, &["missing", "decode pool"]);
}

#[test]
fn a_duplicate_link_names_the_first() {
    let error = Fixture::new().error(&linked_plus(&format!("\n{}", link("p", "d"))));
    assert_key_error(&error, "link.to", 15, &["the link from `p` to `d` is already defined at line 9"]);
}

#[test]
fn a_prefill_pool_without_a_link_out_is_an_error() {
    let pools = [("p1", "prefill"), ("p2", "prefill"), ("d", "decode")];
    let error = Fixture::new().error(&pools_plus(&pools, &link("p1", "d")));
    assert_key_error(&error, "pool.role", 8, &["prefill pool `p2` has no [[link]] out", "from = \"p2\"", "(`d`)"]);
}

#[test]
fn a_decode_pool_without_a_link_in_is_an_error() {
    let pools = [("p", "prefill"), ("d1", "decode"), ("d2", "decode")];
    let error = Fixture::new().error(&pools_plus(&pools, &link("p", "d2")));
    assert_key_error(&error, "pool.role", 8, &["decode pool `d1` has no [[link]] in", "to = \"d1\"", "(`p`)"]);
}

#[test]
fn a_single_bracket_link_table_hints_at_double_brackets() {
    let error = Fixture::new().error(&pools_plus(&[("p", "prefill"), ("d", "decode")], "[link]\nfrom = \"p\"\n"));
    assert_key_error(&error, "link", 9, &["written [[link]]"]);
}

#[test]
fn unknown_backend_lists_the_backends() {
    let error = Fixture::new().error(&linked_plus("backend = \"rdma\"\n"));
    assert_key_error(&error, "link.backend", 12, &["`rdma` is not a transfer backend", "`inproc`, `tcp`"]);
}

#[test]
fn tcp_links_listen_on_loopback_with_a_kernel_port_by_default() {
    let fixture = Fixture::new();
    let graph = fixture.graph(&linked_plus("backend = \"tcp\"\n"));
    assert_eq!(graph.links[0].backend, TransferBackend::Tcp);
    assert_eq!(graph.links[0].endpoint, Some(Endpoint { host: "127.0.0.1".to_string(), port: 0 }));
    for (text, host, port) in
        [("127.0.0.1:0", "127.0.0.1", 0), ("[::1]:0", "::1", 0), ("localhost:7000", "localhost", 7000)]
    {
        let graph = fixture.graph(&linked_plus(&format!("backend = \"tcp\"\nendpoint = \"{text}\"\n")));
        let endpoint = graph.links[0].endpoint.clone().expect("tcp has an endpoint");
        assert_eq!(endpoint, Endpoint { host: host.to_string(), port });
        assert_eq!(endpoint.to_string(), text);
    }
}

#[test]
fn bad_endpoints_name_the_key_and_line() {
    let fixture = Fixture::new();
    let cases = [
        ("::1:0", "expected host:port, got \"::1:0\": an IPv6 address goes in brackets"),
        ("host", "expected host:port, got \"host\""),
        ("host:99999", "port 99999 is out of range"),
        (":80", "a host name or IP address before the colon, got \":80\""),
    ];
    for (text, message) in cases {
        let error = fixture.error(&linked_plus(&format!("backend = \"tcp\"\nendpoint = \"{text}\"\n")));
        assert_key_error(&error, "link.endpoint", 13, &[message]);
    }
}

#[test]
fn a_bad_link_rate_names_the_key_the_line_and_the_form_expected() {
    let fixture = Fixture::new();
    for (text, message) in [("100 MB", "a rate such as \"100 MB/s\""), ("0 Gbit/s", "more than 0 bytes a second")] {
        let error = fixture.error(&linked_plus(&format!("bandwidth = \"{text}\"\n")));
        assert_key_error(&error, "link.bandwidth", 12, &[message]);
    }
}

#[test]
fn an_inproc_link_with_an_endpoint_is_an_error() {
    let fixture = Fixture::new();
    let error = fixture.error(&linked_plus("endpoint = \"127.0.0.1:0\"\n"));
    assert_key_error(&error, "link.endpoint", 12, &["\"inproc\" (the default), which has no endpoint", "\"tcp\""]);
    let error = fixture.error(&linked_plus("backend = \"inproc\"\nendpoint = \"127.0.0.1:0\"\n"));
    assert_key_error(&error, "link.endpoint", 13, &["the backend is \"inproc\", which has no endpoint"]);
}

#[test]
fn two_decode_pools_cannot_listen_on_one_fixed_port() {
    let fixture = Fixture::new();
    let pools = [("p", "prefill"), ("d1", "decode"), ("d2", "decode")];
    let tcp = |from: &str, to: &str, endpoint: &str| {
        format!("{}backend = \"tcp\"\nendpoint = \"{endpoint}\"\n", link(from, to))
    };
    let text = pools_plus(&pools, &format!("{}{}", tcp("p", "d1", "10.0.0.1:7000"), tcp("p", "d2", "10.0.0.1:7000")));
    let error = fixture.error(&text);
    assert_key_error(
        &error,
        "link.endpoint",
        21,
        &["`10.0.0.1:7000` is already where decode pool `d1` listens", "line 12"],
    );
    // Port 0 (each picks its own), or one decode pool fed by two links, is fine.
    let text = pools_plus(&pools, &format!("{}{}", tcp("p", "d1", "10.0.0.1:0"), tcp("p", "d2", "10.0.0.1:0")));
    assert_eq!(fixture.graph(&text).links.len(), 2);
    let pools = [("p1", "prefill"), ("p2", "prefill"), ("d", "decode")];
    let text = pools_plus(&pools, &format!("{}{}", tcp("p1", "d", "10.0.0.1:7000"), tcp("p2", "d", "10.0.0.1:7000")));
    assert_eq!(fixture.graph(&text).links.len(), 2);
}

#[test]
fn every_tcp_link_into_a_decode_pool_names_its_one_endpoint() {
    let fixture = Fixture::new();
    let pools = [("p1", "prefill"), ("p2", "prefill"), ("d", "decode")];
    let tcp = |from: &str, endpoint: &str| format!("{}backend = \"tcp\"\n{endpoint}", link(from, "d"));
    let text = pools_plus(
        &pools,
        &format!("{}{}", tcp("p1", "endpoint = \"[::1]:7000\"\n"), tcp("p2", "endpoint = \"[::1]:7001\"\n")),
    );
    let error = fixture.error(&text);
    assert_key_error(
        &error,
        "link.endpoint",
        21,
        &["`[::1]:7001` differs from `[::1]:7000`", "decode pool `d`", "line 12"],
    );
    // A defaulted endpoint differs too; the error then names the backend's line.
    let text = pools_plus(&pools, &format!("{}{}", tcp("p1", "endpoint = \"[::1]:7000\"\n"), tcp("p2", "")));
    assert_key_error(&fixture.error(&text), "link.endpoint", 20, &["`127.0.0.1:0` differs from `[::1]:7000`"]);
    // An inproc link beside a tcp one is fine: that prefill pool runs in the decode pool's process.
    let text = pools_plus(&pools, &format!("{}{}", tcp("p1", "endpoint = \"[::1]:7000\"\n"), link("p2", "d")));
    let graph = fixture.graph(&text);
    assert_eq!(
        graph.links.iter().map(|l| l.backend).collect::<Vec<_>>(),
        [TransferBackend::Tcp, TransferBackend::Inproc]
    );
}

#[test]
fn links_from_links_to_and_entry_pools() {
    let pools = [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode")];
    let links = [link("p1", "d1"), link("p1", "d2"), link("p2", "d2")].concat();
    let graph = Fixture::new().graph(&pools_plus(&pools, &links));
    let ends = |links: Vec<&LinkConfig>| links.iter().map(|l| format!("{}>{}", l.from, l.to)).collect::<Vec<_>>();
    assert_eq!(ends(graph.links_from("p1")), ["p1>d1", "p1>d2"]);
    assert_eq!(ends(graph.links_from("p2")), ["p2>d2"]);
    assert_eq!(ends(graph.links_to("d2")), ["p1>d2", "p2>d2"]);
    assert!(graph.links_from("d1").is_empty() && graph.links_to("nowhere").is_empty());
    let names = |pools: Vec<&PoolConfig>| pools.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(graph.entry_pools()), ["d1", "d2"]);
    // Aggregated: every pool is an entry.
    let graph = Fixture::new().graph(&minimal_plus("[[pool]]\nname = \"second\"\n"));
    assert!(!graph.is_disaggregated());
    assert_eq!(names(graph.entry_pools()), ["main", "second"]);
}

#[test]
fn a_decode_pool_takes_a_disaggregation_table() {
    let fixture = Fixture::new();
    let text = linked_plus("[[pool]]\nname = \"d2\"\nrole = \"decode\"\n[pool.disaggregation]\nremote_prefill_min_tokens = 64\nmax_prefill_queue = 8\n");
    let text = format!("{text}{}", link("p", "d2"));
    let graph = fixture.graph(&text);
    let d2 = graph.pool("d2").expect("d2");
    assert_eq!(d2.disaggregation, DisaggregationConfig { remote_prefill_min_tokens: 64, max_prefill_queue: Some(8) });
    assert_eq!(graph.pool("d").expect("d").disaggregation, DisaggregationConfig::default());
    let partial = fixture.graph(&pools_plus(
        &[("p", "prefill"), ("d", "decode")],
        &format!("[pool.disaggregation]\nmax_prefill_queue = 1\n{}", link("p", "d")),
    ));
    assert_eq!(
        partial.pools[1].disaggregation,
        DisaggregationConfig { remote_prefill_min_tokens: 0, max_prefill_queue: Some(1) }
    );
}

#[test]
fn a_disaggregation_table_on_another_role_is_an_error() {
    let fixture = Fixture::new();
    let error = fixture.error(&minimal_plus("[pool.disaggregation]\nremote_prefill_min_tokens = 16\n"));
    assert_key_error(&error, "pool.disaggregation", 6, &["only decode pools", "pool `main` is aggregated"]);
    let text = pools_plus(
        &[("p", "prefill")],
        &format!("[pool.disaggregation]\n[[pool]]\nname = \"d\"\nrole = \"decode\"\n{}", link("p", "d")),
    );
    let error = fixture.error(&text);
    assert_key_error(&error, "pool.disaggregation", 6, &["pool `p` is prefill"]);
}

#[test]
fn bad_disaggregation_values_name_the_key_and_line() {
    let fixture = Fixture::new();
    let pools = [("p", "prefill"), ("d", "decode")];
    let table = |body: &str| pools_plus(&pools, &format!("[pool.disaggregation]\n{body}{}", link("p", "d")));
    let error = fixture.error(&table("max_prefill_queue = 0\n"));
    assert_key_error(&error, "pool.disaggregation.max_prefill_queue", 10, &["at least 1", "no limit"]);
    let error = fixture.error(&table("remote_prefill_min_tokens = -1\n"));
    assert_key_error(&error, "pool.disaggregation.remote_prefill_min_tokens", 10, &["-1"]);
    let error = fixture.error(&table("min_tokens = 3\n"));
    assert_key_error(&error, "pool.disaggregation.min_tokens", 10, &["unknown field `min_tokens`"]);
}

// --- transfer and faults -----------------------------------------------------------------

#[test]
fn the_transfer_table_parses() {
    let graph = Fixture::new()
        .graph(&linked_plus("[transfer]\ndeployment_token = \"t0k3n\"\nchecksum = false\nconnections = 3\n"));
    assert_eq!(
        graph.transfer,
        TransferConfig { deployment_token: Some("t0k3n".to_string()), checksum: false, connections: 3 }
    );
    let shown = format!("{graph:?}");
    assert!(!shown.contains("t0k3n"), "Debug shows the token: {shown}");
}

#[test]
fn bad_deployment_tokens_are_errors_that_do_not_show_them() {
    let fixture = Fixture::new();
    let token = |value: &str| fixture.error(&linked_plus(&format!("[transfer]\ndeployment_token = {value}\n")));
    assert_key_error(&token("\"\""), "transfer.deployment_token", 13, &["must not be empty"]);
    assert_key_error(
        &token(&format!("\"{}\"", "k".repeat(300))),
        "transfer.deployment_token",
        13,
        &["at most 256 bytes"],
    );
    let error = token("\"secret\\u0007bell\"");
    assert_key_error(&error, "transfer.deployment_token", 13, &["printable ASCII", "character 7"]);
    assert!(!error.to_string().contains("secret"), "{error}");
}

#[test]
fn connections_per_link_are_one_to_sixteen() {
    let fixture = Fixture::new();
    for bad in ["0", "17", "-2"] {
        let error = fixture.error(&linked_plus(&format!("[transfer]\nconnections = {bad}\n")));
        assert_key_error(&error, "transfer.connections", 13, &[bad, "expected 1 to 16"]);
    }
}

#[test]
fn a_transfer_table_without_links_is_an_error() {
    let error = Fixture::new().error(&minimal_plus("[transfer]\nchecksum = true\n"));
    assert_key_error(&error, "transfer", 6, &["no [[link]]"]);
}

#[test]
fn the_faults_table_parses() {
    let text = linked_plus(
        "[faults]\nseed = 9\ndrop_connection = 1\ndelay_ms = 2.5\ndelay_probability = 0.5\ncorrupt = 0.25\n\
         duplicate_completion = 0\n",
    );
    let graph = Fixture::new().graph(&text);
    let faults = FaultsConfig {
        seed: 9,
        drop_connection: 1.0,
        delay_ms: 2.5,
        delay_probability: 0.5,
        corrupt: 0.25,
        duplicate_completion: 0.0,
    };
    assert_eq!(graph.faults, faults);
    assert!(graph.faults.any());
}

#[test]
fn fault_chances_outside_zero_to_one_or_nan_are_errors() {
    let fixture = Fixture::new();
    for key in ["drop_connection", "delay_probability", "corrupt", "duplicate_completion"] {
        for value in ["1.5", "-0.1", "nan", "inf"] {
            let error = fixture.error(&minimal_plus(&format!("[faults]\ndelay_ms = 1\n{key} = {value}\n")));
            assert_key_error(&error, &format!("faults.{key}"), 8, &["must be a probability between 0 and 1"]);
        }
    }
    for value in ["-1.0", "nan", "inf"] {
        let error = fixture.error(&minimal_plus(&format!("[faults]\ndelay_ms = {value}\ndelay_probability = 1\n")));
        assert_key_error(&error, "faults.delay_ms", 7, &["at least 0"]);
    }
    let error = fixture.error(&minimal_plus("[faults]\nseed = -1\n"));
    assert_key_error(&error, "faults.seed", 7, &["-1"]);
}

#[test]
fn a_delay_without_its_chance_or_a_chance_without_its_delay_is_an_error() {
    let fixture = Fixture::new();
    let error = fixture.error(&minimal_plus("[faults]\ndelay_ms = 10\n"));
    assert_key_error(
        &error,
        "faults.delay_ms",
        7,
        &["delays nothing while faults.delay_probability is 0 (the default)"],
    );
    let error = fixture.error(&minimal_plus("[faults]\ndelay_probability = 0.5\n"));
    assert_key_error(&error, "faults.delay_probability", 7, &["faults.delay_ms is 0 (the default)"]);
    // Set to 0 on purpose, the other is fine.
    let graph = fixture.graph(&minimal_plus("[faults]\ndelay_ms = 10\ndelay_probability = 0\n"));
    assert!(!graph.faults.any());
}

#[test]
fn duration_keys_are_bounded_like_the_duration_flags() {
    // Beyond about eleven days (the flags' 1e6 s), `Duration::from_secs_f64` would panic on
    // some of them (faults.delay_ms did, after passing this check).
    let fixture = Fixture::new();
    let keys = [
        ("faults", "delay_ms", "delay_probability = 1\n"),
        ("workload", "cancel_after_ms", "cancel_fraction = 0.5\n"),
        ("slo", "ttft_ms", ""),
        ("slo", "tpot_ms", ""),
    ];
    for (table, key, other) in keys {
        for value in ["1e300", "1.5e9", "inf", "nan"] {
            let error = fixture.error(&minimal_plus(&format!("[{table}]\n{key} = {value}\n{other}")));
            assert_key_error(&error, &format!("{table}.{key}"), 7, &["milliseconds", "at most 1000000000"]);
        }
        fixture.graph(&minimal_plus(&format!("[{table}]\n{key} = 1e9\n{other}")));
    }
}

#[test]
fn offload_chunk_tokens_are_bounded_like_other_token_counts() {
    let fixture = Fixture::new();
    for value in ["1000000000", "16777232"] {
        let error = fixture.error(&minimal_plus(&format!("[offload]\nchunk_tokens = {value}\n")));
        assert_key_error(&error, "offload.chunk_tokens", 7, &[value, "at most 16777216"]);
    }
    let graph = fixture.graph(&minimal_plus("[offload]\nchunk_tokens = 16777216\n"));
    assert_eq!(graph.offload.map(|o| o.chunk_tokens), Some(1 << 24));
}

#[test]
fn a_redis_store_needs_a_url_without_a_password_and_its_keys_stay_with_it() {
    let fixture = Fixture::new();
    let redis = |rest: &str| minimal_plus(&format!("[offload]\nstore = \"redis\"\n{rest}"));
    let error = fixture.error(&redis(""));
    assert_eq!(error.key(), Some("offload.url"), "{error}");
    assert!(error.to_string().contains("needs the server's URL"), "{error}");
    let error = fixture.error(&redis("url = \"redis://:s3cret@127.0.0.1:6379/0\"\n"));
    assert_key_error(&error, "offload.url", 8, &["holds a password", "offload.password_env"]);
    assert!(!error.to_string().contains("s3cret"), "the password is never shown: {error}");
    let error = fixture.error(&redis("url = \"http://127.0.0.1:6379\"\n"));
    assert_key_error(&error, "offload.url", 8, &["not a Redis URL", "redis://"]);
    let error = fixture.error(&redis("url = \"redis://127.0.0.1\"\nlease_ms = 0\n"));
    assert_key_error(&error, "offload.lease_ms", 9, &["positive lease"]);
    let error = fixture.error(&minimal_plus("[offload]\nstore = \"disk\"\npath = \"s\"\nurl = \"redis://h\"\n"));
    assert_key_error(&error, "offload.url", 9, &["only the redis store", "`disk`"]);
    let error = fixture.error(&redis("url = \"redis://h\"\ncapacity_bytes = 10\n"));
    assert_key_error(&error, "offload.capacity_bytes", 9, &["only the memory store"]);
    let error = fixture.error(&minimal_plus("[offload]\nmax_pending_saves = 0\n"));
    assert_key_error(&error, "offload.max_pending_saves", 7, &["at least 1"]);
    let graph = fixture.graph(&redis("url = \"rediss://user@cache.internal:6380/2\"\npassword_env = \"KV_PW\"\n"));
    let offload = graph.offload.unwrap();
    assert_eq!(offload.max_pending_saves, 64);
    let OffloadStore::Redis(r) = offload.store else { panic!("a redis store") };
    assert_eq!((r.url.as_str(), r.password_env.as_deref()), ("rediss://user@cache.internal:6380/2", Some("KV_PW")));
    assert_eq!((r.lease_ms, r.timeout_ms), (3_600_000, 2_000));
}

// --- the graphs the repository ships ------------------------------------------------------

fn shipped(name: &str) -> Graph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("graphs").join(name);
    Graph::load(&path).unwrap_or_else(|error| panic!("{error}"))
}

#[test]
fn the_aggregated_graphs_have_no_links() {
    for name in ["quickstart.toml", "two-pools.toml"] {
        let graph = shipped(name);
        assert!(graph.links.is_empty() && !graph.is_disaggregated(), "{name}");
        assert_eq!(graph.entry_pools().len(), graph.pools.len(), "{name}");
    }
}

#[test]
fn the_prefill_decode_graphs_parse_with_their_links() {
    let ends = |graph: &Graph| graph.links.iter().map(|l| (l.from.clone(), l.to.clone())).collect::<Vec<_>>();
    let pair = |from: &str, to: &str| (from.to_string(), to.to_string());
    let roles = |graph: &Graph| graph.pools.iter().map(|p| (p.name.clone(), p.role, p.ranks)).collect::<Vec<_>>();

    for (name, backend, endpoint) in [
        ("pd-1p1d.toml", TransferBackend::Inproc, None),
        ("pd-1p1d-tcp.toml", TransferBackend::Tcp, Some(Endpoint { host: "127.0.0.1".to_string(), port: 0 })),
    ] {
        let graph = shipped(name);
        assert!(graph.model.ends_with("fixtures/hf/llama"), "{name}: {}", graph.model.display());
        assert_eq!(
            roles(&graph),
            [("prefill".to_string(), PoolRole::Prefill, 1), ("decode".to_string(), PoolRole::Decode, 1)],
            "{name}"
        );
        assert_eq!(ends(&graph), [pair("prefill", "decode")], "{name}");
        assert_eq!((graph.links[0].backend, graph.links[0].endpoint.clone()), (backend, endpoint), "{name}");
        let w = &graph.workload;
        assert!(w.trace.as_ref().is_some_and(|t| t.ends_with("traces/mooncake_conversation_head.jsonl")), "{name}");
        assert_eq!((w.block_tokens, w.max_output_tokens, w.limit, w.warmup), (16, Some(16), Some(40), 2), "{name}");
        assert_eq!(w.mode, WorkloadMode::Timestamps { time_scale: 0.6 }, "{name}");
        assert_eq!(graph.entry_pools().iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["decode"], "{name}");
    }

    let graph = shipped("pd-2p4d.toml");
    let prefill: Vec<_> = graph.pools.iter().filter(|p| p.role == PoolRole::Prefill).collect();
    let decode: Vec<_> = graph.pools.iter().filter(|p| p.role == PoolRole::Decode).collect();
    assert_eq!((prefill.len(), decode.len()), (2, 4));
    assert!(graph.pools.iter().all(|p| p.ranks == 1));
    assert!(graph.links.iter().all(|l| l.backend == TransferBackend::Inproc && l.endpoint.is_none()));
    // Every prefill pool feeds every decode pool.
    assert_eq!(graph.links.len(), 8);
    for p in &prefill {
        let to: Vec<&str> = graph.links_from(&p.name).iter().map(|l| l.to.as_str()).collect();
        assert_eq!(to, decode.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), "{}", p.name);
    }
    assert_eq!(graph.entry_pools().len(), 4);
}

#[test]
fn pool_hosts_that_cannot_run_name_the_key_and_why() {
    let fixture = Fixture::new();
    let pool = |role: &str, ranks: usize, hosts: &str| {
        format!(
            "[model]\npath = \"model\"\n[[pool]]\nname = \"p\"\nrole = \"{role}\"\nranks = {ranks}\nhosts = {hosts}\n"
        )
    };
    let error = fixture.error(&pool("aggregated", 2, "[]"));
    assert_key_error(&error, "pool.hosts", 7, &["expected at least one \"host:port\""]);
    let error = fixture.error(&pool("aggregated", 2, "[\"h:1\", \"h:1\"]"));
    assert_key_error(&error, "pool.hosts", 7, &["entry 1: \"h:1\" is listed twice"]);
    let error = fixture.error(&pool("aggregated", 3, "[\"h:1\", \"h:2\"]"));
    assert_key_error(&error, "pool.hosts", 7, &["2 processes cannot share the pool's 3 ranks evenly"]);
    let error = fixture.error(&pool("aggregated", 2, "[\"h\", \"h:2\"]"));
    assert_key_error(&error, "pool.hosts", 7, &["entry 0: expected host:port"]);
    // A decode pool is never spread; a spread prefill pool hands off over tcp only.
    let decode = format!(
        "{}[[pool]]\nname = \"q\"\nrole = \"prefill\"\n{}",
        pool("decode", 2, "[\"h:1\", \"h:2\"]"),
        link("q", "p")
    );
    let error = fixture.error(&decode);
    assert_key_error(&error, "pool.hosts", 7, &["decode pool `p` cannot be spread over processes"]);
    let inproc = format!(
        "{}[[pool]]\nname = \"d\"\nrole = \"decode\"\n{}",
        pool("prefill", 2, "[\"h:1\", \"h:2\"]"),
        link("p", "d")
    );
    let error = fixture.error(&inproc);
    assert_key_error(&error, "link.backend", 11, &["prefill pool `p` lists 2 processes", "backend = \"tcp\""]);
    let tcp = format!("{inproc}backend = \"tcp\"\n");
    fixture.graph(&tcp);
}
