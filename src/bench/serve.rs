//! `kvflow bench serve`: requests/s and TTFT p50/p99 of `kvflow serve` on SmolLM2 over loopback,
//! at each concurrency (closed loop: that many clients, each sending its next streamed chat request
//! when the last one ends), a bounded number of requests per level. When `llama-cpp-python`'s
//! server is installed, the same load against it on the same GGUF in the same run, and the ratio.
//! TTFT is measured by the client: from sending the request to the first chunk carrying text.

use crate::runtime::{self, RunOptions};
use crate::server::Serving;
use anyhow::{anyhow, bail, Context, Result};
use parking_lot::Mutex;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct ServeBenchArgs {
    /// The GGUF (default: where tools/fetch_smollm2.sh caches SmolLM2).
    pub model: Option<PathBuf>,
    pub requests: usize,
    pub concurrency: Vec<usize>,
    pub max_tokens: usize,
}

const MODEL_NAME: &str = "SmolLM2-135M-Instruct";
const PROMPTS: [&str; 6] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU cache is in one sentence.",
    "Give me a short tip for learning to cook.",
    "Why is the sky blue?",
];

/// One load level's figures.
struct Level {
    concurrency: usize,
    requests: usize,
    failed: usize,
    wall: Duration,
    ttft_ms: Vec<f64>,
    chunks: usize,
}

impl Level {
    /// Requests completed per second (failed ones do not count).
    fn per_s(&self) -> f64 {
        (self.requests - self.failed) as f64 / self.wall.as_secs_f64()
    }

    fn ttft(&self, p: f64) -> f64 {
        let mut v = self.ttft_ms.clone();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return f64::NAN;
        }
        v[((p / 100.0) * (v.len() - 1) as f64).round() as usize]
    }
}

pub fn run(args: &ServeBenchArgs) -> Result<()> {
    if args.requests == 0 || args.max_tokens == 0 || args.concurrency.contains(&0) {
        bail!("--requests, --max-tokens and every --concurrency must be at least 1");
    }
    let model = match &args.model {
        Some(m) => m.clone(),
        None => default_model()?,
    };
    if !model.is_file() {
        bail!("--model: {} is not a file (bash tools/fetch_smollm2.sh fetches SmolLM2)", model.display());
    }
    println!(
        "kvflow bench serve: {} on loopback, closed loop, {} streamed chat requests per level, max_tokens {}",
        model.display(),
        args.requests,
        args.max_tokens
    );
    let kvflow = with_kvflow_server(&model, |address| measure(address, args))?;
    let llama = match llama_cpp_server(&model)? {
        Some(mut server) => {
            let figures = measure(&server.address, args);
            let _ = server.child.kill();
            let _ = server.child.wait();
            Some(figures?)
        }
        None => {
            println!(
                "llama-cpp-python's server is not installed: no comparison in this run (pip install \
                 'llama-cpp-python[server]==0.3.36' builds llama.cpp, about 8 minutes on 2 cores)"
            );
            None
        }
    };
    println!(
        "{:>11} {:>8} {:>7} {:>9} {:>11} {:>11} {:>13}",
        "concurrency", "requests", "failed", "req/s", "TTFT p50", "TTFT p99", "chunks/req"
    );
    for (i, k) in kvflow.iter().enumerate() {
        print_level("kvflow", k);
        if let Some(l) = llama.as_ref().map(|l| &l[i]) {
            print_level("llama.cpp", l);
            println!(
                "  ratio kvflow/llama.cpp: req/s {:.2}×, TTFT p50 {:.2}×",
                k.per_s() / l.per_s(),
                k.ttft(50.0) / l.ttft(50.0)
            );
        }
    }
    Ok(())
}

fn print_level(who: &str, l: &Level) {
    println!(
        "{:>11} {:>8} {:>7} {:>9.2} {:>8.1} ms {:>8.1} ms {:>13.1}  {who}",
        l.concurrency,
        l.requests,
        l.failed,
        l.per_s(),
        l.ttft(50.0),
        l.ttft(99.0),
        l.chunks as f64 / l.requests.max(1) as f64
    );
}

fn default_model() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KVFLOW_SMOLLM2") {
        return Ok(PathBuf::from(p));
    }
    let cache = match std::env::var_os("KVFLOW_CACHE") {
        Some(c) => PathBuf::from(c),
        None => PathBuf::from(std::env::var_os("HOME").ok_or_else(|| anyhow!("HOME is not set; pass --model"))?)
            .join(".cache/kvflow"),
    };
    Ok(cache.join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
}

/// Runs `graphs/smollm2.toml` (with `model` in it) in this process, serving on a loopback port,
/// for as long as `work` runs; then drains it.
fn with_kvflow_server<T>(model: &Path, work: impl FnOnce(&str) -> Result<T>) -> Result<T> {
    let dir = std::env::temp_dir().join(format!("kvflow-bench-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let template = include_str!("../../graphs/smollm2.toml");
    let graph_text: String = template
        .lines()
        .map(
            |l| {
                if l.starts_with("path = ") {
                    format!("path = {:?}", model.display().to_string())
                } else {
                    l.to_string()
                }
            },
        )
        .map(|l| if l.starts_with("out = ") { format!("out = {:?}", dir.join("out").display().to_string()) } else { l })
        .collect::<Vec<_>>()
        .join("\n");
    let graph_path = dir.join("smollm2.toml");
    std::fs::write(&graph_path, graph_text)?;
    let registry = crate::registry::Registry::default();
    let graph = crate::graph::Graph::load_with(&graph_path, &registry.names())?;
    let text = crate::server::command::text_of(&graph.model)?.map(Arc::new);
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?.to_string();
    let interrupt = Arc::new(AtomicBool::new(false));
    let opts = RunOptions {
        interrupt: Some(interrupt.clone()),
        grace: Some(Duration::from_secs(30)),
        front_end: Some(Arc::new(Serving { listener, text, access: Default::default() })),
        ..Default::default()
    };
    let server = std::thread::spawn(move || runtime::run(&graph, &opts, &registry));
    wait_until_up(&address, Duration::from_secs(120))?;
    let result = work(&address);
    interrupt.store(true, Ordering::SeqCst);
    let outcome = server.join().map_err(|_| anyhow!("the server thread panicked"))??;
    let _ = std::fs::remove_dir_all(&dir);
    if outcome.exit_code != 0 {
        bail!("kvflow serve ended with status {}", outcome.exit_code);
    }
    result
}

struct External {
    child: std::process::Child,
    address: String,
}

/// llama-cpp-python's OpenAI server on `model`, two threads, if it is installed.
fn llama_cpp_server(model: &Path) -> Result<Option<External>> {
    let probe = std::process::Command::new("python3").args(["-c", "import llama_cpp.server"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        return Ok(None);
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let child = std::process::Command::new("python3")
        .args(["-m", "llama_cpp.server", "--host", "127.0.0.1", "--port", &port.to_string()])
        // Requests wait their turn (by default a new request interrupts the one streaming).
        .args(["--n_threads", "2", "--n_ctx", "2048", "--interrupt_requests", "False"])
        .args(["--model_alias", MODEL_NAME, "--model"])
        .arg(model)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("cannot start llama_cpp.server")?;
    let server = External { child, address: format!("127.0.0.1:{port}") };
    wait_until_up(&server.address, Duration::from_secs(120))?;
    Ok(Some(server))
}

fn wait_until_up(address: &str, patience: Duration) -> Result<()> {
    let deadline = Instant::now() + patience;
    loop {
        if let Ok(mut s) = TcpStream::connect(address) {
            let _ = write!(s, "GET /v1/models HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
            let mut status = String::new();
            if BufReader::new(s).read_line(&mut status).is_ok() && status.contains(" 200") {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("the server at {address} did not answer /v1/models within {patience:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every concurrency level against the server at `address`.
fn measure(address: &str, args: &ServeBenchArgs) -> Result<Vec<Level>> {
    // One request first, so neither server's first-request costs land in a level.
    stream_chat(address, PROMPTS[0], args.max_tokens)?;
    let bar = indicatif::ProgressBar::new((args.requests * args.concurrency.len()) as u64);
    let mut levels = Vec::new();
    for &concurrency in &args.concurrency {
        let next = AtomicUsize::new(0);
        let results: Mutex<Vec<Result<(f64, usize)>>> = Mutex::new(Vec::new());
        let started = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..concurrency {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= args.requests {
                        break;
                    }
                    let r = stream_chat(address, PROMPTS[i % PROMPTS.len()], args.max_tokens);
                    bar.inc(1);
                    results.lock().push(r);
                });
            }
        });
        let wall = started.elapsed();
        let results = results.into_inner();
        let failed = results.iter().filter(|r| r.is_err()).count();
        if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
            eprintln!("a request failed at concurrency {concurrency}: {e}");
        }
        let ok: Vec<(f64, usize)> = results.into_iter().filter_map(Result::ok).collect();
        levels.push(Level {
            concurrency,
            requests: args.requests,
            failed,
            wall,
            ttft_ms: ok.iter().map(|r| r.0).collect(),
            chunks: ok.iter().map(|r| r.1).sum(),
        });
    }
    bar.finish_and_clear();
    Ok(levels)
}

/// One streamed chat request: (ms to the first chunk carrying text, chunks carrying text).
fn stream_chat(address: &str, prompt: &str, max_tokens: usize) -> Result<(f64, usize)> {
    let body = serde_json::json!({
        "model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0, "stream": true,
    })
    .to_string();
    let started = Instant::now();
    let mut s = TcpStream::connect(address)?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut first = None;
    let mut chunks = 0;
    let mut status = None;
    for line in BufReader::new(s).lines() {
        let line = line?;
        if status.is_none() {
            status = Some(line.clone());
            if !line.contains(" 200") {
                bail!("{line}");
            }
        }
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data.trim() == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(data).with_context(|| format!("chunk {data:?}"))?;
        if v.get("error").is_some() {
            bail!("{data}");
        }
        let content = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        if !content.is_empty() {
            chunks += 1;
            first.get_or_insert_with(|| started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    Ok((first.ok_or_else(|| anyhow!("no text came back"))?, chunks))
}
