//! The stall watchdog's look at what a pool waits on (`src/runtime/watchdog.rs`, `Awaited`): a
//! pool that waits on a request the run already saw end is named, with that request, within
//! `--stall-timeout`, and the process exits with status 3 — in `kvflow serve` too, where not every
//! request has ever ended, so nothing else notices it. Test switch `prefill-drops-silently=ID`
//! provokes such a pool: the prefill rank ends the request without the abort that tells its decode
//! rank, which waits for its handoff for good; `watchdog-ignores-what-pools-await` removes the check.

use crate::common::{repo, Served};
use crate::runtime::{kvflow_heavy, write_graph_with, HEAVY};
use serde_json::json;
use std::time::Duration;

/// One prefill and one decode pool of one rank each, in process.
const PD: &str = "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n\
    [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n\n\
    [[link]]\nfrom = \"prefill\"\nto = \"decode\"\n";

#[test]
fn a_run_whose_decode_pool_waits_on_an_ended_request_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nwarmup = 0\nlimit = 12";
    let graph = write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", workload, "32 MiB", PD);
    let g = graph.to_string_lossy().to_string();
    let named = "pool decode waits in vain on request 3, which already ended (failed with dropped";
    for check in [true, false] {
        let mut args = vec!["run", &g, "--stall-timeout", "3", "--test-switch", "prefill-drops-silently=3"];
        if !check {
            args.extend(["--test-switch", "watchdog-ignores-what-pools-await"]);
        }
        let out = kvflow_heavy(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Once every request has ended, the pool that has not stalls the run either way; only
        // the check says what it waits on.
        assert_eq!(out.status.code(), Some(3), "check {check}: {stderr}");
        assert_eq!(stderr.contains(named), check, "check {check}: expected {named:?} or not in:\n{stderr}");
    }
}

#[test]
fn a_server_pool_waiting_on_an_ended_request_is_named_within_the_stall_timeout() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let graph = repo().join("graphs/pd-1p1d.toml");
    let request = json!({"prompt": [5, 6, 7, 8, 9], "max_tokens": 2});
    let stall_timeout = 2;
    for check in [true, false] {
        let mut args = vec!["--stall-timeout", "2", "--test-switch", "prefill-drops-silently=0"];
        if !check {
            args.extend(["--test-switch", "watchdog-ignores-what-pools-await"]);
        }
        let server = Served::start(&graph, &dir.path().join(format!("out-{check}")), &args);
        let answer = server.answer_text("POST", "/v1/completions", &request.to_string());
        assert!(answer.starts_with("HTTP/1.1 "), "the request ends: {answer}");
        // The request ended; its decode rank still waits for its handoff. A server never has
        // every request ended, so only the watchdog's look at what the pool awaits sees it.
        let bound = Duration::from_secs(4 * stall_timeout + 6);
        match (check, server.exits_within(bound)) {
            (true, Some((code, stderr))) => {
                assert_eq!(code, Some(3), "{stderr}");
                assert!(stderr.contains("pool decode waits in vain on request 0, which already ended"), "{stderr}");
            }
            (true, None) => panic!("the server outlived {bound:?} with its decode pool waiting on an ended request"),
            (false, exited) => assert!(exited.is_none(), "without the check nothing notices: {exited:?}"),
        }
    }
}
