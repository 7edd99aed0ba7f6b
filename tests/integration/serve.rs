//! `kvflow serve`, run as a user runs it (the binary, a port the kernel picks, SIGTERM to stop)
//! and spoken to over plain HTTP/1.1 sockets: served greedy tokens equal `generate`'s on an
//! aggregated and a P/D graph (streamed and whole, with usage), SmolLM2 answers with its
//! reference's tokens and text, bad bodies get a 400 naming the field, a full server a 429, a
//! draining one a 503; a client gone mid-stream cancels its request (the end-of-run check then
//! finds everything freed); SIGTERM lets in-flight requests finish; `/metrics` agrees with the
//! report; the `openai` Python client and a Prometheus parser accept what the server says.

use crate::common::{fixture, one_llama_rank_to_serve, records_in, repo, report_in, Served, SERVE_EXIT_BOUND};
use crate::runtime::HEAVY;
use kvflow::generate::{generate, GenerateOptions};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// The token ids and finish reason of each chunk of a stream (its last payload is `[DONE]`).
fn stream_ids(chunks: &[String]) -> (Vec<u32>, Option<String>, Option<Value>) {
    assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"), "{chunks:?}");
    let (mut ids, mut finish, mut usage) = (Vec::new(), None, None);
    for c in &chunks[..chunks.len() - 1] {
        let v: Value = serde_json::from_str(c).unwrap();
        if let Some(u) = v.get("usage") {
            usage = Some(u.clone());
        }
        for choice in v["choices"].as_array().unwrap() {
            ids.extend(ids_of(choice));
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (ids, finish, usage)
}

/// A JSON list of token ids.
fn u32s(list: &Value) -> Vec<u32> {
    list.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

fn ids_of(choice: &Value) -> Vec<u32> {
    u32s(&choice["token_ids"])
}

/// A metric's value by its exact series name (`name{labels}`), from the text format.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

const PROMPTS: [&[u32]; 3] =
    [&[1, 5, 9, 200, 31, 7], &[3, 3, 3, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54], &[7]];

#[test]
fn served_greedy_tokens_equal_generate_on_an_aggregated_and_a_pd_graph() {
    let _one_at_a_time = HEAVY.lock();
    let model = crate::common::load(&fixture("hf/llama"));
    let max_tokens = 12;
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| p.to_vec()).collect();
    let opts = GenerateOptions { max_new_tokens: max_tokens, chunk_tokens: 64, ..Default::default() };
    let expected: Vec<Vec<u32>> = generate(&model, &prompts, &opts).unwrap().into_iter().map(|g| g.tokens).collect();
    for graph in ["graphs/aggregated-2.toml", "graphs/pd-1p1d.toml"] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let served = Served::start(&repo().join(graph), &out, &[]);
        for (prompt, want) in prompts.iter().zip(&expected) {
            let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
            let (status, v) = served.post("/v1/completions", &body);
            assert_eq!(status, 200, "{graph}: {v}");
            assert_eq!(v["object"], "text_completion");
            assert_eq!(&ids_of(&v["choices"][0]), want, "{graph}: whole answer");
            assert_eq!(v["choices"][0]["finish_reason"], "length");
            let usage = json!({"prompt_tokens": prompt.len(), "completion_tokens": max_tokens, "total_tokens": prompt.len() + max_tokens});
            assert_eq!(v["usage"], usage, "{graph}");
            let mut body = body.clone();
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
            let chunks = served.stream("/v1/completions", &body);
            let (ids, finish, got_usage) = stream_ids(&chunks);
            assert_eq!(&ids, want, "{graph}: streamed");
            assert_eq!(finish.as_deref(), Some("length"));
            assert_eq!(got_usage, Some(usage));
            // Streamed as the steps completed: more than one chunk carried tokens.
            assert!(chunks.len() >= 4, "{graph}: {} chunks", chunks.len());
        }
        let (code, stderr) = served.stop();
        assert_eq!(code, 0, "{graph}: {stderr}");
        let r = report_in(&out);
        assert_eq!((r["requests"].as_u64(), r["completed"].as_u64()), (Some(6), Some(6)), "{graph}: {r}");
        if graph.contains("pd") {
            // Each request went through both pools: prefilled in one, decoded in the other.
            for rec in records_in(&out) {
                assert_eq!(rec["pools"], json!(["prefill", "decode"]), "{rec}");
            }
        }
    }
}

#[test]
fn bad_bodies_get_a_400_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let served = Served::start(&repo().join("graphs/aggregated-2.toml"), &out, &[]);
    let cases = [
        (json!({"prompt": [1, 2], "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": [1, 2], "max_tokens": "ten"}), "max_tokens"),
        (json!({"prompt": [1, 2], "max_tokens": 100000}), "max_tokens"),
        (json!({"prompt": [1, 999999]}), "prompt"),
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": "text, and this model has no tokenizer"}), "prompt"),
        (json!({"max_tokens": 3}), "prompt"),
        (json!({"prompt": [1], "temperature": 9}), "temperature"),
        (json!({"prompt": [1], "top_p": 0}), "top_p"),
        (json!({"prompt": [1], "n": 2}), "n"),
        (json!({"prompt": [1], "stream": "yes"}), "stream"),
        (json!({"prompt": [1], "logprobs": 3}), "logprobs"),
        (json!({"prompt": [1], "stop": 7}), "stop"),
    ];
    for (body, field) in &cases {
        let (status, v) = served.post("/v1/completions", body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], *field, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].as_str().unwrap().starts_with(field), "{v}");
    }
    let (status, v) = served.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages")), "{v}");
    let (status, v) = served.post("/v1/chat/completions", &json!({"messages": [{"role": "wizard", "content": "hi"}]}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages[0].role")), "{v}");
    let (status, v) = served.post("/v1/completions", &json!({"model": "gpt-9", "prompt": [1]}));
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("model_not_found")), "{v}");
    let (status, text) = served.request("POST", "/v1/completions", "{not json");
    assert_eq!(status, 400, "{text}");
    let (status, models) = served.request("GET", "/v1/models", "");
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_str::<Value>(&models).unwrap()["data"][0]["id"], "llama");
    let metrics = served.metrics();
    let refused =
        |status: &str| metric(&metrics, &format!("kvflow:http_requests_refused_total{{status=\"{status}\"}}"));
    assert_eq!((refused("400"), refused("404")), (Some((cases.len() + 3) as f64), Some(1.0)), "{metrics}");
    let (code, stderr) = served.stop();
    assert_eq!(code, 0, "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(report_in(&out)["requests"], 0, "nothing entered a pool");
}

/// A graph of one aggregated rank on the Llama fixture that takes one request at a time.
fn one_at_a_time(dir: &Path) -> std::path::PathBuf {
    one_llama_rank_to_serve(dir, "max_requests = 1\n")
}

#[test]
fn a_full_server_answers_429_and_sigterm_lets_the_request_in_flight_finish() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let served = Served::start(&one_at_a_time(dir.path()), &out, &["--grace-period", "120"]);
    let long = json!({"prompt": [1, 2, 3], "max_tokens": 3000, "stream": true});
    let mut first = served.send("POST", "/v1/completions", &long.to_string());
    let mut reader = BufReader::new(first.try_clone().unwrap());
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }
    let (status, v) = served.post("/v1/completions", &json!({"prompt": [4], "max_tokens": 2}));
    assert_eq!((status, v["error"]["code"].as_str()), (429, Some("queue_full")), "{v}");
    // SIGTERM: new requests get 503, the one in flight runs to its end.
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(served.pid() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, body) = served.request("GET", "/health", "");
        if status == 503 {
            let (status, v) = served.post("/v1/completions", &json!({"prompt": [4], "max_tokens": 2}));
            assert_eq!((status, v["error"]["code"].as_str()), (503, Some("draining")), "{v}");
            break;
        }
        assert!(Instant::now() < deadline, "never drained: {status} {body}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap();
    drop(first.flush());
    let data: Vec<&str> = rest.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let last: Value = serde_json::from_str(data[data.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length", "it finished, not cancelled: {last}");
    let (code, stderr) = served.exits_within(SERVE_EXIT_BOUND).expect("kvflow serve exits after its drain");
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("draining: 1 request(s) in flight"), "{stderr}");
    let r = report_in(&out);
    assert_eq!((r["requests"].as_u64(), r["completed"].as_u64()), (Some(1), Some(1)), "{r}");
    assert_eq!(records_in(&out)[0]["output_tokens"].as_array().unwrap().len(), 3000);
}

#[test]
fn a_client_gone_mid_stream_cancels_its_request_and_everything_is_freed() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let served = Served::start(&repo().join("graphs/pd-1p1d.toml"), &out, &[]);
    let long = json!({"prompt": [1, 2, 3, 4, 5], "max_tokens": 3000, "stream": true});
    let stream = served.send("POST", "/v1/completions", &long.to_string());
    let mut reader = BufReader::new(stream);
    let mut seen = 0;
    let mut line = String::new();
    while seen < 3 {
        line.clear();
        reader.read_line(&mut line).unwrap();
        seen += usize::from(line.starts_with("data: "));
    }
    drop(reader); // the client goes away mid-stream
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(&served.metrics(), "kvflow:requests_total{outcome=\"cancelled\"}") != Some(1.0) {
        assert!(Instant::now() < deadline, "the request was not cancelled: {}", served.metrics());
        std::thread::sleep(Duration::from_millis(20));
    }
    // The server goes on serving.
    let (status, _) = served.post("/v1/completions", &json!({"prompt": [9, 9], "max_tokens": 4}));
    assert_eq!(status, 200);
    let (code, stderr) = served.stop();
    // The end-of-run check found every block and slot of both pools free (else exit 4).
    assert_eq!(code, 0, "{stderr}");
    let records = records_in(&out);
    let cancelled = &records[0];
    assert_eq!(cancelled["failure"], "cancelled", "{cancelled}");
    assert!(cancelled["output_tokens"].as_array().unwrap().len() < 3000);
    assert_eq!(records[1]["output_tokens"].as_array().unwrap().len(), 4);
}

#[test]
fn metrics_agree_with_the_report() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let served = Served::start(&repo().join("graphs/pd-1p1d.toml"), &out, &[]);
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let (status, _) = served.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 3 + i}));
        assert_eq!(status, 200);
    }
    let text = served.metrics();
    let (code, stderr) = served.stop();
    assert_eq!(code, 0, "{stderr}");
    let r = report_in(&out);
    let get = |series: &str| metric(&text, series).unwrap_or_else(|| panic!("{series} missing:\n{text}"));
    assert_eq!(get("kvflow:requests_total{outcome=\"completed\"}"), r["completed"].as_f64().unwrap());
    assert_eq!(get("kvflow:requests_total{outcome=\"failed\"}"), r["failed"].as_f64().unwrap());
    assert_eq!(get("vllm:time_to_first_token_seconds_count"), r["completed"].as_f64().unwrap());
    assert_eq!(get("vllm:generation_tokens_total"), (3 + 4 + 5) as f64);
    assert_eq!(get("vllm:prompt_tokens_total"), PROMPTS.iter().map(|p| p.len()).sum::<usize>() as f64);
    assert_eq!(get("kvflow:handoffs_total"), r["handoff"]["sent"].as_f64().unwrap_or(3.0));
    assert_eq!(get("vllm:prefix_cache_hit_rate"), r["prefix_hit_rate"].as_f64().unwrap());
    let mean_ttft = get("vllm:time_to_first_token_seconds_sum") / 3.0 * 1000.0;
    assert!((mean_ttft - r["ttft_ms"]["mean"].as_f64().unwrap()).abs() < 1e-6, "{mean_ttft} {}", r["ttft_ms"]);
    // The rank gauges of both pools are there.
    assert!(get("kvflow:kv_blocks_total{pool=\"decode\",rank=\"0\"}") > 0.0);
    let (used, total) = (
        get("kvflow:kv_blocks_used{pool=\"prefill\",rank=\"0\"}"),
        get("kvflow:kv_blocks_total{pool=\"prefill\",rank=\"0\"}"),
    );
    assert!(used <= total && total > 0.0, "{used} of {total}");
    assert_eq!(get("vllm:num_requests_waiting{pool=\"decode\",rank=\"0\"}"), 0.0, "nothing queued once idle");
    assert_eq!(get("vllm:num_requests_running"), 0.0);
}

/// graphs/smollm2.toml served with `--model path`, the graph's own model path pointing at nothing:
/// the flag stands in for it (the graph is checked after its overrides are applied).
fn smollm2_served(dir: &Path, path: &Path) -> Served {
    let graph = std::fs::read_to_string(repo().join("graphs/smollm2.toml")).unwrap();
    let model_line = graph.lines().find(|l| l.starts_with("path = ")).unwrap();
    let graph = graph.replace(model_line, "path = \"no-model-here/SmolLM2-135M-Instruct.Q4_1.gguf\"");
    std::fs::write(dir.join("smollm2.toml"), graph).unwrap();
    assert!(!dir.join("no-model-here").exists());
    Served::start(&dir.join("smollm2.toml"), &dir.join("out"), &["--model", path.to_str().unwrap()])
}

#[test]
fn smollm2_served_answers_with_its_reference_tokens_and_text() {
    let Some(path) = crate::gguf::smollm2() else { return };
    let _one_at_a_time = HEAVY.lock();
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("smollm2/expected.json")).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let served = smollm2_served(dir.path(), &path);
    for case in expected["cases"].as_array().unwrap() {
        let greedy = u32s(&case["greedy"]);
        // Served requests stop at end-of-sequence (the reference ran on past it).
        let (want, finish) = match case["eos_at"].as_u64() {
            Some(at) => (greedy[..=at as usize].to_vec(), "stop"),
            None => (greedy.clone(), "length"),
        };
        let (path, mut body) = if case["kind"] == "chat" {
            ("/v1/chat/completions", json!({"messages": case["messages"]}))
        } else {
            ("/v1/completions", json!({"prompt": case["rendered"]}))
        };
        body["model"] = json!("SmolLM2-135M-Instruct");
        body["max_tokens"] = json!(greedy.len());
        body["temperature"] = json!(0);
        let (status, v) = served.post(path, &body);
        assert_eq!(status, 200, "{v}");
        let choice = &v["choices"][0];
        assert_eq!(ids_of(choice), want, "{body}");
        assert_eq!(choice["finish_reason"], finish, "{v}");
        let prompt_len = case["prompt"].as_array().unwrap().len();
        assert_eq!(v["usage"]["prompt_tokens"], prompt_len, "the prompt's tokens equal the reference's");
        assert_eq!(v["usage"]["completion_tokens"], want.len());
        let text = if case["kind"] == "chat" { &choice["message"]["content"] } else { &choice["text"] };
        assert_eq!(*text, case["text"], "the reference's text (its tokenizer's decode): {v}");
        body["stream"] = json!(true);
        let chunks = served.stream(path, &body);
        let (ids, stream_finish, _) = stream_ids(&chunks);
        assert_eq!(ids, want, "streamed {body}");
        assert_eq!(stream_finish.as_deref(), Some(finish));
        let streamed_text: String = chunks[..chunks.len() - 1]
            .iter()
            .map(|c| {
                let v: Value = serde_json::from_str(c).unwrap();
                let c = &v["choices"][0];
                c["delta"]["content"].as_str().or(c["text"].as_str()).unwrap_or("").to_string()
            })
            .collect();
        assert_eq!(streamed_text, *text, "the pieces add up to the whole answer");
    }
    // A stop string cuts the text before it, whole and streamed, and ends the request.
    let completion = expected["cases"].as_array().unwrap().iter().find(|c| c["kind"] == "completion").unwrap();
    let reference = completion["text"].as_str().unwrap();
    let cut = &reference[..reference.find('.').expect("the reference text has a period")];
    let body = json!({"prompt": completion["rendered"], "max_tokens": 24, "temperature": 0, "stop": ["."]});
    let (status, v) = served.post("/v1/completions", &body);
    assert_eq!(
        (status, v["choices"][0]["text"].as_str(), v["choices"][0]["finish_reason"].as_str()),
        (200, Some(cut), Some("stop")),
        "{v}"
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = served.stream("/v1/completions", &streamed);
    let text: String = chunks[..chunks.len() - 1]
        .iter()
        .map(|c| serde_json::from_str::<Value>(c).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(text, cut, "{chunks:?}");
    let (code, stderr) = served.stop();
    assert_eq!(code, 0, "{stderr}");
    // P/D: the stop token travels with the handoff; a chat ends at end-of-sequence on the decode
    // pool (the streamed T0 comes from the prefill pool).
    let pd_dir = tempfile::tempdir().unwrap();
    let served = smollm2_pd_served(pd_dir.path(), &path);
    for case in expected["cases"].as_array().unwrap().iter().filter(|c| c["eos_at"].is_u64()) {
        let greedy = u32s(&case["greedy"]);
        let want = greedy[..=case["eos_at"].as_u64().unwrap() as usize].to_vec();
        let body = json!({"messages": case["messages"], "max_tokens": 24, "temperature": 0, "stream": true});
        let (ids, finish, _) = stream_ids(&served.stream("/v1/chat/completions", &body));
        assert_eq!((ids, finish.as_deref()), (want, Some("stop")), "P/D {body}");
    }
    let (code, stderr) = served.stop();
    assert_eq!(code, 0, "{stderr}");
    for rec in records_in(&pd_dir.path().join("out")) {
        assert_eq!(rec["pools"], json!(["prefill", "decode"]), "{rec}");
    }
}

/// SmolLM2 on a prefill pool and a decode pool joined by an inproc link.
fn smollm2_pd_served(dir: &Path, path: &Path) -> Served {
    let graph = format!(
        "[model]\npath = {:?}\n\n[memory]\nbudget_bytes = \"512 MiB\"\n\n[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\n\
         ranks = 1\nexecutor = \"cpu\"\n\n[[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\nexecutor = \"cpu\"\n\n\
         [[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"inproc\"\n\n[serve]\nmax_context = 1024\n",
        path.display().to_string()
    );
    std::fs::write(dir.join("pd.toml"), graph).unwrap();
    Served::start(&dir.join("pd.toml"), &dir.join("out"), &[])
}

#[test]
fn the_openai_python_client_and_a_prometheus_parser_accept_the_server() {
    let Some(path) = crate::gguf::smollm2() else { return };
    let script = repo().join("tools/serve_client_check.py");
    let probe = Command::new("python3").args(["-c", "import openai, prometheus_client"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        assert!(
            std::env::var_os("KVFLOW_REQUIRE_PY_CLIENTS").is_none(),
            "KVFLOW_REQUIRE_PY_CLIENTS is set, but python3 lacks openai or prometheus_client"
        );
        println!("skipped: python3 lacks openai or prometheus_client (pip install openai prometheus-client)");
        return;
    }
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let served = smollm2_served(dir.path(), &path);
    let out = Command::new("python3")
        .arg(&script)
        .arg(format!("http://{}", served.address))
        .arg(fixture("smollm2/expected.json"))
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    let (code, stderr) = served.stop();
    assert_eq!(code, 0, "{stderr}");
    let report = report_in(&dir.path().join("out"));
    assert!(text.contains(&format!("completed={}", report["completed"])), "the client saw the report's count: {text}");
}

#[test]
fn an_idle_server_outlives_the_stall_timeout() {
    // Its pools park with nothing to do: no request is pending, so nothing has stalled.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let served = Served::start(&repo().join("graphs/pd-1p1d.toml"), &out, &["--stall-timeout", "1"]);
    std::thread::sleep(Duration::from_millis(2500));
    let (status, v) = served.post("/v1/completions", &json!({"prompt": [1, 2], "max_tokens": 3}));
    assert_eq!(status, 200, "{v}");
    std::thread::sleep(Duration::from_millis(2500));
    let (code, stderr) = served.stop();
    assert_eq!(code, 0, "{stderr}");
    assert!(!stderr.contains("stall"), "{stderr}");
}

/// The llama fixture served from an emulated cuda pool: whole and streamed completions are the
/// greedy tokens the CPU executor generates.
#[test]
fn served_from_a_cuda_pool_the_tokens_are_the_cpu_executors() {
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let graph = one_llama_rank_to_serve(dir.path(), "");
    let cuda = "executor = \"cuda\"\n\n[pool.executor_settings]\nemulate = true\n";
    let text = std::fs::read_to_string(&graph).unwrap().replacen("executor = \"cpu\"\n", cuda, 1);
    std::fs::write(&graph, text).unwrap();
    let model = crate::common::load(&fixture("hf/llama"));
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().take(2).map(|p| p.to_vec()).collect();
    let opts = GenerateOptions { max_new_tokens: 6, ..Default::default() };
    let expected = generate(&model, &prompts, &opts).unwrap();
    let served = Served::start(&graph, &dir.path().join("out"), &[]);
    for (prompt, want) in prompts.iter().zip(&expected) {
        let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0});
        let (status, v) = served.post("/v1/completions", &body);
        assert_eq!((status, ids_of(&v["choices"][0])), (200, want.tokens.clone()), "{v}");
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (ids, finish, _) = stream_ids(&served.stream("/v1/completions", &streamed));
        assert_eq!((ids, finish.as_deref()), (want.tokens.clone(), Some("length")));
    }
    let (code, stderr) = served.stop();
    assert_eq!(code, 0, "{stderr}");
}

/// SmolLM2 served from a cuda pool (emulated here, so a short completion; `benches/device` serves
/// chats on the GPU): it streams the greedy tokens and text the CPU executor generates.
#[test]
#[ignore = "SmolLM2 under the CPU emulation of the kernels takes about two minutes: run it with --ignored"]
fn smollm2_served_on_a_cuda_pool_answers_as_the_cpu_executor() {
    let Some(path) = crate::gguf::smollm2() else { return };
    let _one_at_a_time = HEAVY.lock();
    let dir = tempfile::tempdir().unwrap();
    let graph = std::fs::read_to_string(repo().join("graphs/smollm2.toml")).unwrap();
    let cuda = "executor = \"cuda\"\n\n[pool.executor_settings]\nemulate = true\n";
    std::fs::write(dir.path().join("cuda.toml"), graph.replacen("executor = \"cpu\"\n", cuda, 1)).unwrap();
    let text = kvflow::text::TextModel::load(&path).unwrap();
    let (prompt, n) = ("The capital of France is", 3);
    let model = crate::common::load(&path);
    let opts = GenerateOptions { max_new_tokens: n, ..Default::default() };
    let want = generate(&model, &[text.encode(prompt).unwrap()], &opts).unwrap().remove(0).tokens;
    let served =
        Served::start(&dir.path().join("cuda.toml"), &dir.path().join("out"), &["--model", path.to_str().unwrap()]);
    let body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": true});
    let chunks = served.stream("/v1/completions", &body);
    let (ids, finish, _) = stream_ids(&chunks);
    assert_eq!((&ids, finish.as_deref()), (&want, Some("length")), "{chunks:?}");
    let streamed: String = chunks[..chunks.len() - 1]
        .iter()
        .map(|c| serde_json::from_str::<Value>(c).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(streamed, text.decode(&want).unwrap());
    let (code, stderr) = served.stop();
    assert_eq!(code, 0, "{stderr}");
}
