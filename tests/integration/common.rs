//! Helpers shared by the integration tests: fixture paths, expected outputs, the comparison rule
//! of fixtures/hf/README.md, running the CLI the way a user does, a run's report and records,
//! waiting for a child process with a deadline, and `kvflow serve` started, spoken to over plain
//! HTTP/1.1 and stopped. Each helper here has one copy: a test that needs one uses it from here.

use kvflow::generate::{generate, GenerateOptions, Generation};
use kvflow_kernels::models::{self, Model};
use serde::Deserialize;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// The seven fixture checkpoints of `fixtures/hf` (six families), as `hf/<name>`.
pub const FIXTURES: [&str; 7] = [
    "hf/llama",
    "hf/qwen3",
    "hf/deepseek_v3",
    "hf/deepseek_v32",
    "hf/qwen3_next",
    "hf/qwen3_next_gdn",
    "hf/kimi_linear",
];

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixture(name: &str) -> PathBuf {
    repo().join("fixtures").join(name)
}

#[derive(Deserialize)]
pub struct Case {
    pub prompt: Vec<u32>,
    pub greedy: Vec<u32>,
    pub last_logits: Vec<f32>,
    pub decode_logits: Vec<Vec<f32>>,
    pub greedy_gaps: Vec<f32>,
}

#[derive(Deserialize)]
pub struct Expected {
    pub cases: Vec<Case>,
}

pub fn expected(dir: &Path) -> Expected {
    expected_named(dir, "expected.json")
}

pub fn expected_named(dir: &Path, name: &str) -> Expected {
    let text = std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{}/{name}: {e}", dir.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}/{name}: {e}", dir.display()))
}

pub fn load(dir: &Path) -> Model {
    models::load(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Checks a generation against a fixture case by the README's rule: greedy tokens exact except
/// after a near tie (gap < 1e-3), every logits vector before that point within 1e-4 relative.
/// Returns the largest relative error seen.
pub fn check_case(what: &str, case: &Case, got: &Generation) -> f64 {
    let mut upto = case.greedy.len();
    assert_eq!(got.tokens.len(), case.greedy.len(), "{what}: token count");
    for (j, (a, b)) in got.tokens.iter().zip(&case.greedy).enumerate() {
        if a != b {
            assert!(
                case.greedy_gaps[j] < 1e-3,
                "{what}: token {j} is {a}, expected {b} (gap {:.1e})",
                case.greedy_gaps[j]
            );
            upto = j;
            break;
        }
    }
    let mut worst = rel_err(&got.last_logits, &case.last_logits);
    assert!(worst < 1e-4, "{what}: prompt logits relative error {worst:.2e}");
    let decode = got.decode_logits.as_ref().expect("decode logits were asked for");
    for (j, (a, b)) in decode.iter().zip(&case.decode_logits).enumerate() {
        if j + 1 >= upto {
            break;
        }
        let e = rel_err(a, b);
        assert!(e < 1e-4, "{what}: logits choosing token {}: relative error {e:.2e}", j + 1);
        worst = worst.max(e);
    }
    worst
}

/// Runs every case of a fixture folder through `generate` and checks it; returns the worst error.
pub fn reproduce_fixture(dir: &Path, chunk_tokens: usize) -> f64 {
    let exp = expected(dir);
    let model = load(dir);
    let prompts: Vec<Vec<u32>> = exp.cases.iter().map(|c| c.prompt.clone()).collect();
    let n = exp.cases[0].greedy.len();
    let k = exp.cases[0].decode_logits.len();
    let opts = GenerateOptions { max_new_tokens: n, chunk_tokens, decode_logits: k, ..Default::default() };
    let got = generate(&model, &prompts, &opts).expect("generate");
    let mut worst = 0.0f64;
    for (i, (case, g)) in exp.cases.iter().zip(&got).enumerate() {
        worst = worst.max(check_case(&format!("{} case {i}", dir.display()), case, g));
    }
    worst
}

/// Runs the kvflow binary.
pub fn kvflow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvflow")).args(args).output().expect("kvflow runs")
}

/// Asserts a run failed cleanly (non-zero exit, no panic) with a message containing each of
/// `needles`; returns stderr.
pub fn assert_clean_failure(out: &Output, needles: &[&str]) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "expected failure, got success; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panicked: {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "stderr lacks {n:?}: {stderr}");
    }
    stderr
}

/// A run's requests.jsonl (in `dir/out`), a record per line.
pub fn records(dir: &Path) -> Vec<serde_json::Value> {
    records_in(&dir.join("out"))
}

/// The requests.jsonl in the output folder `out`, a record per line.
pub fn records_in(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("requests.jsonl"))
        .unwrap_or_else(|e| panic!("{}: {e}", out.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A run's report.json (in `dir/out`).
pub fn report(dir: &Path) -> serde_json::Value {
    report_in(&dir.join("out"))
}

/// The report.json in the output folder `out`.
pub fn report_in(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap()
}

/// How `child` ended, if it exits within `limit` (looked at every 20 ms); `None` if it still runs
/// then, and it is left running.
pub fn wait_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// [`wait_within`], but a child still running at `limit` is killed and reaped before `None` comes
/// back, so that a test failing on the `None` leaves no process behind.
pub fn wait_within_or_kill(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let status = wait_within(child, limit);
    if status.is_none() {
        kill_and_reap(child);
    }
    status
}

/// SIGKILLs `child` and reaps it (one that already ended is only reaped).
pub fn kill_and_reap(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// What is left of `child`'s piped stderr, read to its end ("" if it was not piped or is taken).
pub fn rest_of_stderr(child: &mut Child) -> String {
    let mut text = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = pipe.read_to_string(&mut text);
    }
    text
}

/// Reads `child`'s piped stderr on a thread to its end, handing each line to `on_line` and then
/// to the returned receiver (the thread reads on once the receiver is dropped, so the child never
/// blocks on a full pipe).
pub fn stderr_lines(child: &mut Child, on_line: impl Fn(&str) + Send + 'static) -> Receiver<String> {
    let (tx, lines) = std::sync::mpsc::channel();
    let pipe = child.stderr.take().expect("the child's stderr is piped");
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            on_line(&line);
            let _ = tx.send(line);
        }
    });
    lines
}

/// The rest of the first line from `lines` that starts with `prefix`, waiting at most `limit`
/// for it; `None` if the lines end (the child closed its stderr) or the time runs out first.
pub fn first_line_after(lines: &Receiver<String>, prefix: &str, limit: Duration) -> Option<String> {
    let deadline = Instant::now() + limit;
    loop {
        let line = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())).ok()?;
        if let Some(rest) = line.strip_prefix(prefix) {
            return Some(rest.to_string());
        }
    }
}

/// A graph of one aggregated CPU rank on the Llama fixture (64 MiB of KV) for `kvflow serve`,
/// written to `dir/serve.toml`: its `[serve]` table has `max_context = 4096` and `serve_lines`.
pub fn one_llama_rank_to_serve(dir: &Path, serve_lines: &str) -> PathBuf {
    let graph = format!(
        "[model]\npath = \"{}\"\n\n[memory]\nbudget_bytes = \"64 MiB\"\n\n[[pool]]\nname = \"main\"\nrole = \"aggregated\"\n\
         ranks = 1\nexecutor = \"cpu\"\n\n[serve]\n{serve_lines}max_context = 4096\n",
        fixture("hf/llama").display()
    );
    let path = dir.join("serve.toml");
    std::fs::write(&path, graph).unwrap();
    path
}

/// How long [`Served::stop`] waits for `kvflow serve` to exit after SIGTERM.
pub const SERVE_EXIT_BOUND: Duration = Duration::from_secs(120);

/// `kvflow serve GRAPH --port 0 --out OUT ARGS…` (the kernel picks the port), not yet started.
pub fn serve_command(graph: &Path, out: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kvflow"));
    command.args(["serve", graph.to_str().unwrap(), "--port", "0", "--out", out.to_str().unwrap()]).args(args);
    command
}

/// A `kvflow serve` process, the address it listens on (`host:port`) and the scheme it printed
/// (`http`, or `https` with TLS); its stderr is read to its end on a thread.
pub struct Served {
    child: Child,
    pub address: String,
    pub scheme: String,
    stderr: std::thread::JoinHandle<String>,
}

impl Served {
    /// Starts [`serve_command`]`(graph, out, args)` and waits until it listens on plain HTTP.
    pub fn start(graph: &Path, out: &Path, args: &[&str]) -> Served {
        let served = Served::spawn(serve_command(graph, out, args));
        assert_eq!(served.scheme, "http", "kvflow serve {args:?} listens on {}://{}", served.scheme, served.address);
        served
    }

    /// Spawns `command` (a `kvflow serve`) with its stdout and stderr piped and waits for the line
    /// saying where it listens (no bound: it prints it before serving, or ends, and then this
    /// panics with its stderr); its later stdout is read and dropped.
    pub fn spawn(mut command: Command) -> Served {
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("kvflow serve starts");
        let mut stderr = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text);
            text
        });
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let listening = |line: std::io::Result<String>| {
            let line = line.ok()?;
            let (scheme, address) = line.strip_prefix("kvflow serve: listening on ")?.split_once("://")?;
            Some((scheme.to_string(), address.to_string()))
        };
        let Some((scheme, address)) = lines.by_ref().find_map(listening) else {
            let _ = child.wait();
            panic!("kvflow serve ended before listening: {}", stderr.join().unwrap());
        };
        std::thread::spawn(move || lines.for_each(drop));
        Served { child, address, scheme, stderr }
    }

    /// The server process's id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A connection to the server, whose reads time out after 300 s.
    pub fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(&self.address).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
        s
    }

    /// Sends one request (a JSON body) on a fresh connection that closes after it; the stream to
    /// read its answer from.
    pub fn send(&self, method: &str, path: &str, body: &str) -> TcpStream {
        let mut s = self.connect();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            self.address,
            body.len()
        )
        .unwrap();
        s
    }

    /// Status and body (de-chunked).
    pub fn request(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        let mut raw = Vec::new();
        self.send(method, path, body).read_to_end(&mut raw).unwrap();
        parse_response(&raw)
    }

    /// The whole answer to one request as text, its head included, as far as it came before the
    /// connection ended or a read failed.
    pub fn answer_text(&self, method: &str, path: &str, body: &str) -> String {
        let mut raw = Vec::new();
        let _ = self.send(method, path, body).read_to_end(&mut raw);
        String::from_utf8_lossy(&raw).into_owned()
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let (status, text) = self.request("POST", path, &body.to_string());
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
    }

    /// A streamed answer's `data:` payloads, in order.
    pub fn stream(&self, path: &str, body: &serde_json::Value) -> Vec<String> {
        let (status, text) = self.request("POST", path, &body.to_string());
        assert_eq!(status, 200, "{text}");
        text.lines().filter_map(|l| l.strip_prefix("data: ")).map(String::from).collect()
    }

    pub fn metrics(&self) -> String {
        let (status, text) = self.request("GET", "/metrics", "");
        assert_eq!(status, 200);
        text
    }

    /// Its exit status and stderr if it exits by itself within `bound`; else it is killed and
    /// `None`.
    pub fn exits_within(mut self, bound: Duration) -> Option<(Option<i32>, String)> {
        let status = wait_within_or_kill(&mut self.child, bound)?;
        Some((status.code(), self.stderr.join().unwrap()))
    }

    /// SIGTERM; waits for the exit (failing, the server killed, after [`SERVE_EXIT_BOUND`]):
    /// (status code, stderr).
    pub fn stop(self) -> (i32, String) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let (code, stderr) = self
            .exits_within(SERVE_EXIT_BOUND)
            .unwrap_or_else(|| panic!("kvflow serve did not exit within {SERVE_EXIT_BOUND:?} of SIGTERM"));
        (code.unwrap_or(-1), stderr)
    }
}

/// An HTTP/1.1 answer's status and body (de-chunked when its head says chunked).
fn parse_response(raw: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return (status, body.to_string());
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    (status, out)
}
