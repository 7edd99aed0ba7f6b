//! Faults on purpose (`[faults]`) and cancellation across a P/D handoff: whatever strikes the
//! transfer engine — a connection dropped mid-transfer, a delay, damaged bytes, a completion
//! delivered twice — and wherever a request is cancelled, every request ends completed (and
//! exact) or failed with a named cause, none hangs, and every block and slot is free on both
//! sides at the end (the run checks it and reports `accounting_errors`).

use crate::common::records;
use crate::runtime::{run_graph, write_graph_with};
use kvflow::graph::Overrides;
use kvflow_operators::rank::TestSwitches;
use serde_json::Value;
use std::path::Path;

fn pools(backend: &str, faults: &str) -> String {
    let link = if backend == "tcp" { "backend = \"tcp\"\nendpoint = \"127.0.0.1:0\"\n" } else { "" };
    format!(
        "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n\
         [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n\n\
         [[link]]\nfrom = \"prefill\"\nto = \"decode\"\n{link}\n[faults]\nseed = 11\n{faults}\n"
    )
}

fn run(model: &str, backend: &str, faults: &str, switches: TestSwitches) -> (tempfile::TempDir, Value) {
    let dir = tempfile::tempdir().unwrap();
    let graph = write_graph_with(
        dir.path(),
        model,
        "mooncake_conversation_head.jsonl",
        "mode = \"concurrency\"\nconcurrency = 6\nwarmup = 0\nlimit = 12",
        "32 MiB",
        &pools(backend, faults),
    );
    let report = run_graph(&graph, Overrides::default(), switches);
    (dir, report)
}

/// Every request completed exactly or ended with a named cause; nothing leaked on either side.
fn assert_all_accounted(report: &Value, dir: &Path, what: &str) {
    assert!(report["accounting_errors"].as_array().unwrap().is_empty(), "{what}: {}", report["accounting_errors"]);
    assert_eq!(report["verify"]["mismatched"], 0, "{what}: {}", report["verify"]);
    let (requests, completed, failed, cancelled) = (
        report["requests"].as_u64().unwrap(),
        report["completed"].as_u64().unwrap(),
        report["failed"].as_u64().unwrap(),
        report["cancelled"].as_u64().unwrap(),
    );
    assert_eq!(completed + failed + cancelled, requests, "{what}");
    assert_eq!(report["verify"]["checked"].as_u64().unwrap(), completed, "{what}: every completed request verified");
    for r in records(dir) {
        if !r["error"].is_null() {
            assert!(r["failure"].is_string() && !r["error"].as_str().unwrap().is_empty(), "{what}: {r}");
        }
    }
}

#[test]
fn the_fault_matrix_ends_every_request_completed_and_exact_or_failed_with_its_cause() {
    // Each fault alone (often enough to strike several transfers of 12), then all together.
    let matrix: [(&str, &str, &str); 8] = [
        ("tcp", "drop_connection = 0.4", "faults_dropped"),
        ("tcp", "corrupt = 0.4", "faults_corrupted"),
        ("tcp", "duplicate_completion = 0.5", "faults_duplicated"),
        ("tcp", "delay_ms = 20.0\ndelay_probability = 0.5", "faults_delayed"),
        (
            "tcp",
            "drop_connection = 0.2\ncorrupt = 0.2\nduplicate_completion = 0.3\ndelay_ms = 5.0\ndelay_probability = 0.3",
            "retries",
        ),
        ("inproc", "drop_connection = 0.4", "faults_dropped"),
        ("inproc", "duplicate_completion = 0.5", "faults_duplicated"),
        ("inproc", "delay_ms = 20.0\ndelay_probability = 0.5", "faults_delayed"),
    ];
    for model in ["hf/llama", "hf/qwen3_next"] {
        for (backend, faults, struck) in matrix {
            let what = format!("{model} over {backend} with {faults:?}");
            let (dir, report) = run(model, backend, faults, TestSwitches::default());
            assert_all_accounted(&report, dir.path(), &what);
            let h = &report["handoff"];
            assert!(h[struck].as_u64().unwrap() > 0, "{what}: the fault struck: {h}");
            // A failure is the transfer's, and names it.
            for (cause, _) in report["failures"].as_object().unwrap() {
                assert_eq!(cause, "handoff", "{what}: {}", report["failures"]);
            }
            if faults.starts_with("drop") || faults.starts_with("corrupt") {
                assert!(h["retries"].as_u64().unwrap() > 0, "{what}: a dropped or damaged transfer is retried: {h}");
                // Retried once: some of those that struck twice fail, the rest complete.
                assert!(report["completed"].as_u64().unwrap() > 0, "{what}");
            }
            if faults.starts_with("duplicate") {
                assert_eq!(report["failed"], 0, "{what}: a duplicate harms nothing");
                assert!(h["duplicates_dropped"].as_u64().unwrap() > 0, "{what}: the consumer dropped one: {h}");
                assert!(h["stale_acks"].as_u64().unwrap() > 0, "{what}: the producer dropped one: {h}");
            }
            if faults.starts_with("delay") {
                assert_eq!(report["failed"], 0, "{what}: a delay harms nothing");
            }
        }
    }
}

#[test]
fn cancelling_at_every_stage_of_a_handoff_frees_both_sides() {
    // Every transfer is held back 300 ms, so a request sits "in transfer" long enough for its
    // prefill rank to cancel it there; the abort reaches the consumer before the handoff does.
    let plain = [(7, "queued"), (0, "prefilling"), (2, "in transfer"), (4, "in transfer"), (1, "decoding")];
    // Streamed: request 3 is cancelled between two pieces of its handoff (reported "prefilling").
    let streamed = [plain.as_slice(), &[(3, "between pieces")]].concat();
    // The decode rank asked for each prefill, and its cancel travels to the prefill pool; also
    // with a rule of its own ([pool.disaggregation]); and with every handoff streamed.
    for (backend, rule, stream) in [
        ("inproc", false, false),
        ("tcp", false, false),
        ("inproc", true, false),
        ("inproc", false, true),
        ("tcp", false, true),
    ] {
        let stages = if stream { &streamed[..] } else { &plain[..] };
        let switches = TestSwitches {
            cancel_at_stage: stages.iter().map(|(id, s)| (*id, s.to_string())).collect(),
            ..Default::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let graph = write_graph_with(
            dir.path(),
            "hf/qwen3_next",
            "mooncake_conversation_head.jsonl",
            "mode = \"concurrency\"\nconcurrency = 8\nwarmup = 0\nlimit = 12",
            "32 MiB",
            &if rule {
                pools(backend, "delay_ms = 300.0\ndelay_probability = 1.0")
                    .replace("[[link]]", "[pool.disaggregation]\nmax_prefill_queue = 1000\n\n[[link]]")
            } else {
                pools(backend, "delay_ms = 300.0\ndelay_probability = 1.0")
            },
        );
        let text = std::fs::read_to_string(&graph)
            .unwrap()
            .replace("max_running = 16", "max_running = 2")
            .replace("chunk_tokens = 64", "chunk_tokens = 16")
            .replace(
                "to = \"decode\"\n",
                if stream { "to = \"decode\"\nstream_min_tokens = 1\n" } else { "to = \"decode\"\n" },
            );
        std::fs::write(&graph, text).unwrap();
        let report = run_graph(&graph, Overrides::default(), switches);
        let what = format!("cancel at every stage over {backend} (a rule of its own: {rule}, streamed: {stream})");
        assert_all_accounted(&report, dir.path(), &what);
        let mut errors: Vec<(u64, String)> = records(dir.path())
            .iter()
            .filter(|r| !r["error"].is_null())
            .map(|r| (r["id"].as_u64().unwrap(), r["error"].as_str().unwrap().to_string()))
            .collect();
        errors.sort();
        let reported = |s: &str| if s == "between pieces" { "prefilling".to_string() } else { s.to_string() };
        let mut expected: Vec<(u64, String)> =
            stages.iter().map(|(id, s)| (*id, format!("cancelled while {}", reported(s)))).collect();
        expected.sort();
        assert_eq!(errors, expected, "{what}");
        assert_eq!(report["cancelled"], stages.len(), "{what}");
        assert_eq!(report["failed"], 0, "{what}");
        let h = &report["handoff"];
        if stream {
            assert!(h["pieces"].as_u64().unwrap() > 0, "{what}: handoffs streamed: {h}");
            assert!(h["streams_dropped"].as_u64().unwrap() >= 1, "{what}: the pieces of request 3 were dropped: {h}");
        }
        // In process the abort reaches the inbox while the delivery is held back, so it is
        // aborted there. Over tcp the abort travels behind the delivery on the same connection:
        // whether the decode rank took the handoff in between (then it cancels it there) is a
        // race — measured at dbe21ac, before this check changed, 1 run in 6 had neither in-transfer
        // cancel aborted in the inbox. Both ways end in the errors and accounting checked above.
        if backend == "inproc" {
            assert!(h["aborted"].as_u64().unwrap() >= 1, "{what}: an in-transfer cancel was aborted explicitly: {h}");
        }
    }
}

/// Exactly-once take: a handoff delivered twice (`duplicate_completion`) is taken by a decode
/// rank once — each request handed off is received once, and none fails. Without the inbox's
/// check (test switch) a duplicate reaches a rank a second time.
#[test]
fn a_duplicate_handoff_is_taken_once_and_without_the_check_reaches_a_rank_again() {
    for backend in ["inproc", "tcp"] {
        let faults = "duplicate_completion = 0.6";
        let (_dir, with) = run("hf/llama", backend, faults, TestSwitches::default());
        let h = &with["handoff"];
        assert!(h["duplicates_dropped"].as_u64().unwrap() > 0, "{backend}: {h}");
        assert_eq!(h["received"], h["count"], "{backend}: every handoff taken once: {h}");
        assert_eq!(with["failed"], 0, "{backend}");
        let switches = TestSwitches { deliver_duplicate_handoffs: true, ..Default::default() };
        let (_dir, without) = run("hf/llama", backend, faults, switches);
        let h = &without["handoff"];
        // The second delivery reaches a rank: it runs the request again, or finds the handoff
        // already taken and fails the request.
        let twice = h["received"].as_u64().unwrap() > h["count"].as_u64().unwrap();
        assert!(
            twice || without["failed"].as_u64().unwrap() > 0,
            "{backend}: without the check a duplicate reaches a rank: {h} {}",
            without["failures"]
        );
    }
}

/// Producer frees after ack, and handoffs own their bytes. Every transfer here waits 100 ms
/// before it reaches the consumer, while the prefill pool goes on prefilling into blocks freed
/// at once (no prefix cache).
/// - A handoff read in place (test switch `read-handoffs-in-place`: inproc's one copy and tcp's
///   send read the producer's blocks, as the cuda executor's do on a stream of their own) is
///   exact because the producer holds the blocks until the ack; freeing them when the handoff is
///   sent (`free-before-ack`) lets the next prefills reuse them first, and outputs mismatch.
/// - A CPU handoff as it is carries the copy the step that completed its prompt made: even with
///   the blocks freed at send, every output is exact — the transfer reads nothing of the
///   producer's cache, so it never waits for the producer's later steps either.
#[test]
fn the_producer_frees_after_the_ack_and_a_handoff_owns_the_copy_its_step_made() {
    let faults = "delay_ms = 100.0\ndelay_probability = 1.0";
    let run_with = |switches: TestSwitches| {
        let dir = tempfile::tempdir().unwrap();
        let graph = write_graph_with(
            dir.path(),
            "hf/llama",
            "mooncake_conversation_head.jsonl",
            "mode = \"concurrency\"\nconcurrency = 6\nwarmup = 0\nlimit = 12",
            "32 MiB",
            &pools("inproc", faults),
        );
        // No prefix cache: a freed block is free at once (the cache would keep prompt blocks).
        let text = std::fs::read_to_string(&graph)
            .unwrap()
            .replace("chunk_tokens = 64", "chunk_tokens = 64\nprefix_cache = false");
        std::fs::write(&graph, text).unwrap();
        run_graph(&graph, Overrides::default(), switches)
    };
    let in_place = run_with(TestSwitches { read_handoffs_in_place: true, ..Default::default() });
    assert_eq!(in_place["verify"]["mismatched"], 0, "{}", in_place["verify"]);
    assert_eq!(in_place["completed"], 12);
    let in_place_freed =
        run_with(TestSwitches { read_handoffs_in_place: true, free_before_ack: true, ..Default::default() });
    assert!(
        in_place_freed["verify"]["mismatched"].as_u64().unwrap() > 0,
        "freeing before the ack lets an in-place reader read reused blocks: {}",
        in_place_freed["verify"]
    );
    let owned_freed = run_with(TestSwitches { free_before_ack: true, ..Default::default() });
    assert_eq!(owned_freed["completed"], 12);
    assert_eq!(
        owned_freed["verify"]["mismatched"], 0,
        "a handoff that owns its copy is exact whatever becomes of the producer's blocks: {}",
        owned_freed["verify"]
    );
}

/// A decode rank that sends a prefill away keeps the prefix blocks its cache already holds for
/// it (`reserve_prefix`; every prompt of the trace shares its first block). When that request is
/// cancelled in transfer and its handoff arrives with the abort right behind it (over tcp, after
/// a delay, on one connection), the rank takes the admission before it hears the cancel and finds
/// the handoff aborted: it gives those blocks back. Without that release (test switch) they stay
/// reserved for good, and the accounting check names them, request by request.
#[test]
fn a_handoff_found_aborted_gives_back_the_prefix_blocks_its_decode_rank_kept_for_it() {
    // One request at a time: 0 and 1 complete (the decode rank's cache holds the shared first
    // block), 2 to 9 are cancelled in transfer.
    let cancels: Vec<(u64, String)> = (2..10).map(|id| (id, "in transfer".to_string())).collect();
    let run_with = |keep_reserved: bool| {
        let dir = tempfile::tempdir().unwrap();
        let graph = write_graph_with(
            dir.path(),
            "hf/llama",
            "mooncake_conversation_head.jsonl",
            "mode = \"concurrency\"\nconcurrency = 1\nwarmup = 0\nlimit = 10",
            "32 MiB",
            &pools("tcp", "delay_ms = 50.0\ndelay_probability = 1.0")
                .replace("[[link]]", "[pool.disaggregation]\nmax_prefill_queue = 1000\n\n[[link]]"),
        );
        let switches = TestSwitches {
            cancel_at_stage: cancels.clone(),
            handoff_keeps_reserved_prefix_on_abort: keep_reserved,
            ..Default::default()
        };
        let report = run_graph(&graph, Overrides::default(), switches);
        (dir, report)
    };
    let (dir, report) = run_with(false);
    assert_all_accounted(&report, dir.path(), "with the release");
    assert_eq!(report["cancelled"], 8, "{}", report["failures"]);
    let h = &report["handoff"];
    assert!(h["saved_bytes"].as_u64().unwrap() > 0, "the decode rank kept prefix blocks: {h}");
    assert!(h["aborted"].as_u64().unwrap() > 0, "handoffs were aborted: {h}");
    // Whether the decode rank takes the admission before the abort reaches its inbox is a race
    // (then the cancel finds the request held, and frees it there). Measured when this test was
    // written, with the switch: of the 8 cancels, 2 to 8 were found aborted with their blocks
    // kept, in each of 30 runs (10 of them beside two busy loops on the same 2 cores). A run in
    // which none was is tried again, twice at most.
    let leaked = (0..3).find_map(|_| {
        let (_dir, report) = run_with(true);
        let lines: Vec<String> = report["accounting_errors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap().to_string())
            .filter(|e| e.contains("accounting check at the end of the run"))
            .collect();
        (!lines.is_empty()).then_some(lines)
    });
    let leaked = leaked.expect("without the release, prefix blocks stay reserved and the accounting check names them");
    for line in &leaked {
        assert!(line.starts_with("pool decode rank 0"), "{line}");
        assert!(line.contains("prefix block(s)") && line.contains("no longer awaits its handoff"), "{line}");
    }
}

/// A streamed handoff is all or nothing: pieces lost on the way (drop faults strike pieces
/// too) make the tcp consumer refuse the handoff that needs them, and the producer sends it
/// again whole — every output exact. Taking it with the missing blocks read as zeros (test
/// switch `accept_missing_pieces`) decodes from a partial prompt: outputs differ.
#[test]
fn a_streamed_handoff_lacking_a_piece_is_refused_and_sent_again_whole() {
    let run_with = |switches: TestSwitches| {
        let dir = tempfile::tempdir().unwrap();
        let graph = write_graph_with(
            dir.path(),
            "hf/llama",
            "mooncake_conversation_head.jsonl",
            "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 10",
            "32 MiB",
            &pools("tcp", "drop_connection = 0.2")
                .replace("to = \"decode\"\n", "to = \"decode\"\nstream_min_tokens = 1\n"),
        );
        run_graph(&graph, Overrides::default(), switches)
    };
    let report = run_with(TestSwitches::default());
    let h = &report["handoff"];
    assert!(h["refused_for_pieces"].as_u64().unwrap() > 0, "some handoff lacked a lost piece: {h}");
    // (A handoff itself lost twice fails, streamed or not: those are the only failures.)
    let lost_twice = h["transfer_failures"].as_u64().unwrap();
    assert_eq!(report["completed"].as_u64().unwrap() + lost_twice, 10, "each was sent again whole: {h}");
    assert_eq!(report["verify"]["mismatched"], 0, "{}", report["verify"]);
    let accepted = run_with(TestSwitches { accept_missing_pieces: true, ..Default::default() });
    assert!(
        accepted["verify"]["mismatched"].as_u64().unwrap() > 0,
        "a handoff taken without its pieces decodes from a partial prompt: {}",
        accepted["verify"]
    );
}
