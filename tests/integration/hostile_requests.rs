//! `kvflow serve` against hostile requests and chat templates, on the Llama fixture given a
//! byte-level tokenizer: prompt text over the byte bound is refused before it is tokenized, while
//! `/health` answers as fast as when idle; a template that does not parse (or fails on a small
//! chat) refuses startup naming where it came from; one that loops without bound fails its
//! request within its budget while `/health` answers, and SIGTERM still drains; a seed of
//! 2^64 − 1 is taken.

use crate::common::{fixture, rest_of_stderr, serve_command, wait_within_or_kill, Served};
use crate::runtime::HEAVY;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A chat template in the style of SmolLM2's.
const CHAT_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                             {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// [`CHAT_TEMPLATE`], looping 10^10 times for a message that says "loop" (so the startup check,
/// whose chat says no such thing, passes).
const LOOPING_TEMPLATE: &str = "{% for m in messages %}{% if m.content == 'loop' %}{% for i in range(100000) %}\
                                {% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}<|im_start|>{{ m.role }}\n\
                                {{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n\
                                {% endif %}";

/// The Llama fixture's checkpoint with a byte-level BPE tokenizer (the 256 byte tokens, no
/// merges, and `<|im_end|>`: ids below its vocabulary of 512) and `chat_template` in
/// `tokenizer_config.json`.
fn model_with_text(dir: &Path, chat_template: &str) -> PathBuf {
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, Tokenizer};
    let model = dir.join("llama-with-text");
    std::fs::create_dir_all(&model).unwrap();
    for file in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(fixture("hf/llama").join(file), model.join(file)).unwrap();
    }
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort();
    let vocab: tokenizers::models::bpe::Vocab =
        alphabet.iter().enumerate().map(|(i, c)| (c.to_string(), i as u32)).collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, Vec::new()).build().unwrap();
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    tokenizer.add_special_tokens([AddedToken::from("<|im_end|>", true)]).unwrap();
    tokenizer.save(model.join("tokenizer.json"), false).unwrap();
    let config = json!({"chat_template": chat_template, "eos_token": "<|im_end|>"});
    std::fs::write(model.join("tokenizer_config.json"), config.to_string()).unwrap();
    model
}

/// One aggregated CPU rank serving `model` with a context of 1,024 tokens.
fn graph(dir: &Path, model: &Path) -> PathBuf {
    let graph = format!(
        "[model]\npath = \"{}\"\n\n[memory]\nbudget_bytes = \"64 MiB\"\n\n[[pool]]\nname = \"main\"\nrole = \"aggregated\"\n\
         ranks = 1\nexecutor = \"cpu\"\n\n[serve]\nmax_context = 1024\n",
        model.display()
    );
    let path = dir.join("graph.toml");
    std::fs::write(&path, graph).unwrap();
    path
}

/// Status and body of one request on its own connection.
fn request(address: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(address).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or(String::new(), |(_, b)| b.to_string());
    (status, body)
}

/// The median of `n` `/health` round trips, 20 ms apart, in milliseconds.
fn health_median_ms(address: &str, n: usize) -> f64 {
    let mut times: Vec<f64> = (0..n)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(20));
            let start = Instant::now();
            let (status, body) = request(address, "GET", "/health", "");
            assert_eq!(status, 200, "{body}");
            start.elapsed().as_secs_f64() * 1000.0
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[n / 2]
}

/// `clients` threads each sending `body` to `path` again and again until `stop`; every answer
/// (status, body) they got.
fn hammer(
    address: &str,
    path: &'static str,
    body: String,
    clients: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<Vec<(u16, String, Duration)>>> {
    (0..clients)
        .map(|_| {
            let (address, body, stop) = (address.to_string(), body.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut answers = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let start = Instant::now();
                    let (status, text) = request(&address, "POST", path, &body);
                    answers.push((status, text, start.elapsed()));
                }
                answers
            })
        })
        .collect()
}

/// `/health`'s median under load stays within this many times the idle median (at least 1 ms):
/// generous for a loaded machine, far below a server whose async workers are busy tokenizing or
/// rendering (hundreds of milliseconds and more).
const HEALTH_SLOWDOWN: f64 = 50.0;

#[test]
fn huge_prompts_are_refused_by_their_size_while_health_answers() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let model = model_with_text(dir.path(), CHAT_TEMPLATE);
    let served = Served::start(&graph(dir.path(), &model), &dir.path().join("out"), &[]);
    let address = served.address.clone();
    let idle = health_median_ms(&address, 21);
    // 1.9 MB of text: the context of 1,024 tokens, each at most 10 bytes (`<|im_end|>`), takes
    // at most 10,240 bytes.
    let huge = "Lorem ipsum dolor sit amet. ".repeat(1_900_000 / 28);
    let stop = Arc::new(AtomicBool::new(false));
    let clients = hammer(&address, "/v1/completions", json!({"prompt": huge}).to_string(), 4, &stop);
    std::thread::sleep(Duration::from_millis(300));
    let loaded = health_median_ms(&address, 21);
    stop.store(true, Ordering::SeqCst);
    let answers: Vec<_> = clients.into_iter().flat_map(|c| c.join().unwrap()).collect();
    eprintln!("/health median: {idle:.2} ms idle, {loaded:.2} ms beside {} huge prompts", answers.len());
    assert!(
        loaded < HEALTH_SLOWDOWN * idle.max(1.0),
        "/health took {loaded:.1} ms (median) beside {} huge prompts, {idle:.1} ms idle",
        answers.len()
    );
    assert!(!answers.is_empty());
    for (status, body, _) in &answers {
        let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert_eq!((*status, v["error"]["param"].as_str()), (400, Some("prompt")), "{v}");
        assert!(message.contains("bytes of prompt text") && message.contains("at most 10240 bytes"), "{message}");
    }
    // A prompt within the byte bound is tokenized, and refused by its tokens when too many.
    let (status, body) = request(&address, "POST", "/v1/completions", &json!({"prompt": "a".repeat(5000)}).to_string());
    assert!(status == 400 && body.contains("5000 prompt tokens"), "{status} {body}");
    let (status, body) =
        request(&address, "POST", "/v1/completions", &json!({"prompt": "Hello", "max_tokens": 2}).to_string());
    assert_eq!(status, 200, "{body}");
    let (code, stderr) = served.stop();
    assert_eq!(code, 0, "{stderr}");
}

#[test]
fn a_template_that_loops_fails_its_request_while_health_answers_and_sigterm_drains() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let model = model_with_text(dir.path(), LOOPING_TEMPLATE);
    let out = dir.path().join("out");
    let served = Served::start(&graph(dir.path(), &model), &out, &[]);
    let address = served.address.clone();
    let hi = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (status, body) = request(&address, "POST", "/v1/chat/completions", &hi.to_string());
    assert_eq!(status, 200, "an ordinary chat renders: {body}");
    // Any integer OpenAI takes is a seed, 2^64 − 1 included.
    let seeded = json!({"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 1, "seed": u64::MAX});
    let (status, body) = request(&address, "POST", "/v1/completions", &seeded.to_string());
    assert_eq!(status, 200, "{body}");
    let idle = health_median_ms(&address, 21);
    let looping = json!({"messages": [{"role": "user", "content": "loop"}], "max_tokens": 2}).to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let clients = hammer(&address, "/v1/chat/completions", looping.clone(), 2, &stop);
    std::thread::sleep(Duration::from_millis(300));
    let loaded = health_median_ms(&address, 21);
    stop.store(true, Ordering::SeqCst);
    let answers: Vec<_> = clients.into_iter().flat_map(|c| c.join().unwrap()).collect();
    let slowest = answers.iter().map(|a| a.2).max().unwrap_or_default();
    eprintln!(
        "/health median: {idle:.2} ms idle, {loaded:.2} ms beside {} looping renders (slowest {slowest:?})",
        answers.len()
    );
    assert!(
        loaded < HEALTH_SLOWDOWN * idle.max(1.0),
        "/health took {loaded:.1} ms (median) beside {} looping renders, {idle:.1} ms idle",
        answers.len()
    );
    for (status, body, took) in &answers {
        assert_eq!(*status, 400, "{body}");
        assert!(body.contains("budget of 1000000 fuel"), "{body}");
        assert!(*took < Duration::from_secs(30), "a looping render took {took:?}");
    }
    // SIGTERM while a looping render runs: the server drains and writes its report.
    let late = {
        let address = address.clone();
        std::thread::spawn(move || request(&address, "POST", "/v1/chat/completions", &looping))
    };
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    let (code, stderr) = served.stop();
    assert_eq!(code, 0, "{stderr}");
    assert!(start.elapsed() < Duration::from_secs(10), "drained in {:?}", start.elapsed());
    let (status, _) = late.join().unwrap();
    assert!(status == 400 || status == 503, "{status}");
    assert!(out.join("report.json").is_file(), "{stderr}");
}

/// Runs `kvflow serve` expecting it to refuse to start: its stderr (killed and failed if it is
/// still running after 60 s).
fn refused_serve(graph: &Path, out: &Path, args: &[&str]) -> String {
    let mut child = serve_command(graph, out, args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let status = wait_within_or_kill(&mut child, Duration::from_secs(60))
        .unwrap_or_else(|| panic!("kvflow serve {args:?} started with a broken chat template"));
    let stderr = rest_of_stderr(&mut child);
    assert!(!status.success() && !stderr.contains("panicked"), "{status}: {stderr}");
    stderr
}

#[test]
fn a_broken_chat_template_refuses_startup_naming_where_it_came_from() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_with_text(dir.path(), "{% for m in messages %}{{ m.content }}");
    let graph = graph(dir.path(), &model);
    let stderr = refused_serve(&graph, &dir.path().join("out"), &[]);
    let config = model.join("tokenizer_config.json");
    assert!(stderr.contains(&format!("{}: field `chat_template`", config.display())), "{stderr}");
    assert!(stderr.contains("syntax error"), "{stderr}");
    // A template given with --chat-template that fails on an ordinary chat: named by the flag.
    let template = dir.path().join("strict.jinja");
    std::fs::write(&template, "{{ raise_exception('Conversation roles must alternate system/user') }}").unwrap();
    let stderr = refused_serve(&graph, &dir.path().join("out"), &["--chat-template", template.to_str().unwrap()]);
    assert!(stderr.contains(&format!("--chat-template {}", template.display())), "{stderr}");
    assert!(stderr.contains("roles must alternate"), "{stderr}");
    // ... while a good one given so replaces the model's broken one.
    std::fs::write(&template, CHAT_TEMPLATE).unwrap();
    let served = Served::start(&graph, &dir.path().join("out"), &["--chat-template", template.to_str().unwrap()]);
    let hi = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (status, body) = request(&served.address, "POST", "/v1/chat/completions", &hi.to_string());
    assert_eq!(status, 200, "{body}");
    let (code, stderr) = served.stop();
    assert_eq!(code, 0, "{stderr}");
}
