//! The stall watchdog's look at what a pool waits on (`src/runtime/watchdog.rs`, `Awaited`): a
//! pool that waits on a request the run already saw end is named, with that request, within
//! `--stall-timeout`, and the process exits with status 3 — in `kvflow serve` too, where not every
//! request has ever ended, so nothing else notices it. Test switch `prefill-drops-silently=ID`
//! provokes such a pool: the prefill rank ends the request without the abort that tells its decode
//! rank, which waits for its handoff for good; `watchdog-ignores-what-pools-await` removes the check.

use crate::common::repo;
use crate::runtime::{write_graph_with, HEAVY};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One prefill and one decode pool of one rank each, in process.
const PD: &str = "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n\
    [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n\n\
    [[link]]\nfrom = \"prefill\"\nto = \"decode\"\n";

fn run_cli(args: &[&str]) -> std::process::Output {
    let _one_at_a_time = HEAVY.lock();
    Command::new(env!("CARGO_BIN_EXE_kvflow")).args(args).output().unwrap()
}

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
        let out = run_cli(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Once every request has ended, the pool that has not stalls the run either way; only
        // the check says what it waits on.
        assert_eq!(out.status.code(), Some(3), "check {check}: {stderr}");
        assert_eq!(stderr.contains(named), check, "check {check}: expected {named:?} or not in:\n{stderr}");
    }
}

/// A `kvflow serve` process (its stderr read on a thread) and the address it listens on.
struct Server {
    child: Child,
    address: String,
    stderr: std::thread::JoinHandle<String>,
}

impl Server {
    fn start(graph: &Path, out: &Path, args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvflow"))
            .args(["serve", graph.to_str().unwrap(), "--port", "0", "--out", out.to_str().unwrap()])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let listening =
            |l: std::io::Result<String>| l.ok()?.strip_prefix("kvflow serve: listening on http://").map(String::from);
        let Some(address) = lines.find_map(listening) else {
            let _ = child.wait();
            panic!("kvflow serve ended before listening: {}", stderr.join().unwrap());
        };
        std::thread::spawn(move || lines.for_each(drop));
        Server { child, address, stderr }
    }

    /// Posts `body` to `/v1/completions` and reads the whole answer (its first line: the status).
    fn complete(&self, body: &Value) -> String {
        let mut s = TcpStream::connect(&self.address).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let body = body.to_string();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            self.address,
            body.len()
        )
        .unwrap();
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    }

    /// Its exit status and stderr if it exits within `bound`; else it is killed and `None`.
    fn exits_within(mut self, bound: Duration) -> Option<(Option<i32>, String)> {
        let deadline = Instant::now() + bound;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some((status.code(), self.stderr.join().unwrap()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
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
        let server = Server::start(&graph, &dir.path().join(format!("out-{check}")), &args);
        let answer = server.complete(&request);
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
