//! Bad input gets a clear error naming what is wrong and a non-zero exit, never a panic:
//! unknown model_type, missing tensor, wrong shape or dtype, truncated safetensors, a prompt token
//! outside the vocabulary, an empty prompt, a malformed prompt line.

use crate::common::{assert_clean_failure, fixture, kvflow};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::Path;

/// A copy of the llama fixture in a temp dir whose tensors are edited by `edit`.
fn edited_llama(edit: impl FnOnce(&mut HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>)) -> tempfile::TempDir {
    let src = fixture("hf/llama");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec()))).collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView)> =
        tensors.iter().map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

fn prompts_file(dir: &Path, text: &str) -> String {
    let p = dir.join("prompts.jsonl");
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().to_string()
}

fn generate_with(model: &Path, prompts: &str) -> std::process::Output {
    kvflow(&["generate", "--model", &model.to_string_lossy(), "--prompts", prompts, "--max-new-tokens", "2"])
}

#[test]
fn an_unknown_model_type_lists_the_supported_ones() {
    let dir = edited_llama(|_| {});
    let cfg = std::fs::read_to_string(dir.path().join("config.json")).unwrap().replace("\"llama\"", "\"gpt2\"");
    std::fs::write(dir.path().join("config.json"), cfg).unwrap();
    let p = prompts_file(dir.path(), "{\"prompt\": [1, 2]}\n");
    assert_clean_failure(&generate_with(dir.path(), &p), &["gpt2", "llama", "qwen3", "deepseek_v3", "config.json"]);
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = edited_llama(|t| {
        t.remove("model.layers.2.mlp.up_proj.weight");
    });
    let p = prompts_file(dir.path(), "{\"prompt\": [1, 2]}\n");
    assert_clean_failure(&generate_with(dir.path(), &p), &["missing tensor", "model.layers.2.mlp.up_proj.weight"]);
}

#[test]
fn a_wrong_shape_names_the_tensor_and_both_shapes() {
    let dir = edited_llama(|t| {
        let e = t.get_mut("model.norm.weight").unwrap();
        e.1 = vec![32];
        e.2.truncate(32 * 4);
    });
    let p = prompts_file(dir.path(), "{\"prompt\": [1, 2]}\n");
    assert_clean_failure(&generate_with(dir.path(), &p), &["model.norm.weight", "[64]", "[32]"]);
}

#[test]
fn a_wrong_dtype_names_the_tensor_and_the_dtype() {
    let dir = edited_llama(|t| {
        t.get_mut("model.norm.weight").unwrap().0 = Dtype::I32;
    });
    let p = prompts_file(dir.path(), "{\"prompt\": [1, 2]}\n");
    assert_clean_failure(&generate_with(dir.path(), &p), &["model.norm.weight", "I32", "F32, BF16 or F16"]);
}

#[test]
fn a_truncated_safetensors_file_is_an_error() {
    let dir = edited_llama(|_| {});
    let f = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
    file.set_len(len - 100).unwrap();
    let p = prompts_file(dir.path(), "{\"prompt\": [1, 2]}\n");
    assert_clean_failure(&generate_with(dir.path(), &p), &["model.safetensors", "not a valid safetensors file"]);
}

#[test]
fn a_token_outside_the_vocabulary_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts_file(dir.path(), "{\"prompt\": [1, 2]}\n{\"prompt\": [3, 512]}\n");
    assert_clean_failure(&generate_with(&fixture("hf/llama"), &p), &["prompts.jsonl:2", "512", "vocabulary"]);
}

#[test]
fn an_empty_prompt_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts_file(dir.path(), "{\"prompt\": []}\n");
    assert_clean_failure(&generate_with(&fixture("hf/llama"), &p), &["prompts.jsonl:1", "empty"]);
}

#[test]
fn a_malformed_prompt_line_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts_file(dir.path(), "{\"prompt\": [1]}\n{\"prompt\": [1,\n");
    assert_clean_failure(&generate_with(&fixture("hf/llama"), &p), &["prompts.jsonl:2"]);
}

#[test]
fn a_missing_checkpoint_folder_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts_file(dir.path(), "{\"prompt\": [1]}\n");
    assert_clean_failure(&generate_with(&dir.path().join("nowhere"), &p), &["nowhere", "config.json"]);
}

// ---- Hostile input, one case per class (issue "hostile input, limits and signals") ----

use crate::runtime::write_graph;

/// A trace of `lines` (Mooncake JSON) in `dir`; its path.
fn trace_file(dir: &Path, lines: &[String]) -> String {
    let p = dir.join("trace.jsonl");
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p.to_string_lossy().to_string()
}

fn mooncake_line(timestamp_ms: u64, input_length: usize, output_length: usize) -> String {
    let ids: Vec<usize> = (0..input_length.div_ceil(512).max(1)).map(|i| timestamp_ms as usize * 1000 + i).collect();
    format!(
        "{{\"timestamp\": {timestamp_ms}, \"input_length\": {input_length}, \"output_length\": {output_length}, \"hash_ids\": {ids:?}}}"
    )
}

fn quick_graph(dir: &Path) -> String {
    write_graph(dir, "hf/llama", "mooncake_conversation_head.jsonl", "", "16 MiB").to_string_lossy().to_string()
}

#[test]
fn sizes_are_bounded_before_anything_is_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let g = quick_graph(dir.path());
    assert_clean_failure(&kvflow(&["run", &g, "--ranks", "10000"]), &["pool.ranks", "1024"]);
    let huge = std::fs::read_to_string(&g).unwrap().replace("\"16 MiB\"", "\"900 TiB\"");
    std::fs::write(&g, huge).unwrap();
    assert_clean_failure(&kvflow(&["run", &g]), &["memory.budget_bytes", "available"]);
    let p = prompts_file(dir.path(), "{\"prompt\": [1, 2]}\n");
    let llama = fixture("hf/llama").to_string_lossy().to_string();
    let zero_block = ["generate", "--model", &llama, "--prompts", &p, "--max-new-tokens", "2", "--block-size", "0"];
    assert_clean_failure(&kvflow(&zero_block), &["--block-size", "between 1 and"]);
    let spec = dir.path().join("huge.toml");
    std::fs::write(&spec, "model_type = \"llama\"\nseed = 1\nvocab_size = 16000000\nhidden_size = 16000000\nintermediate_size = 64\nnum_hidden_layers = 2\nnum_attention_heads = 4\n").unwrap();
    assert_clean_failure(&generate_with(&spec, &p), &["huge.toml"]);
}

#[test]
fn impossible_model_specs_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts_file(dir.path(), "{\"prompt\": [1, 2]}\n");
    let base = "model_type = \"llama\"\nseed = 1\nvocab_size = 64\nintermediate_size = 32\nnum_attention_heads = 2\n";
    for (extra, key) in [
        ("hidden_size = 0\nnum_hidden_layers = 1\n", "hidden_size"),
        ("hidden_size = 16\nnum_hidden_layers = 0\n", "num_hidden_layers"),
        ("hidden_size = 16\nnum_hidden_layers = 1\nhiden_size = 16\n", "hiden_size"),
    ] {
        let spec = dir.path().join("spec.toml");
        std::fs::write(&spec, format!("{base}{extra}")).unwrap();
        assert_clean_failure(&generate_with(&spec, &p), &["spec.toml", key]);
    }
}

#[test]
fn non_finite_numbers_never_become_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts_file(dir.path(), "{\"prompt\": [1, 2]}\n");
    // A negative epsilon in the config, a NaN in a weight: refused at load, by name.
    let eps = edited_llama(|_| {});
    let cfg = std::fs::read_to_string(eps.path().join("config.json")).unwrap();
    let cfg = cfg.replace("\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": -1e-06");
    std::fs::write(eps.path().join("config.json"), cfg).unwrap();
    assert_clean_failure(&generate_with(eps.path(), &p), &["rms_norm_eps"]);
    let nan = edited_llama(|t| {
        let e = t.get_mut("model.norm.weight").unwrap();
        e.2[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    assert_clean_failure(&generate_with(nan.path(), &p), &["model.norm.weight"]);
    // Finite weights whose products overflow: the logits are not finite, so no token is sampled
    // and the prompt fails, naming why (generate writes the line with its error, exits 2).
    let big = edited_llama(|t| {
        let (dtype, _, bytes) = t.get_mut("model.norm.weight").unwrap();
        assert_eq!(*dtype, Dtype::F32);
        for chunk in bytes.chunks_mut(4) {
            chunk.copy_from_slice(&3.0e38f32.to_le_bytes());
        }
    });
    let out = generate_with(big.path(), &p);
    let stderr = assert_clean_failure(&out, &["NaN or infinite"]);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"error\""));
    // And in a run, the request fails with its cause.
    let g = quick_graph(dir.path());
    let out = kvflow(&["run", &g, "--model", &big.path().to_string_lossy(), "--limit", "2", "--warmup", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = std::fs::read_to_string(dir.path().join("out/requests.jsonl")).unwrap();
    assert!(lines.lines().all(|l| l.contains("non-finite-logits")), "{lines}");
}

#[test]
fn durations_are_checked_and_zero_turns_the_watchdog_off() {
    let dir = tempfile::tempdir().unwrap();
    let g = quick_graph(dir.path());
    for (flag, value) in
        [("--stall-timeout", "NaN"), ("--stall-timeout", "inf"), ("--stall-timeout", "-1"), ("--grace-period", "nan")]
    {
        assert_clean_failure(&kvflow(&["run", &g, flag, value]), &[flag, "seconds"]);
    }
    let out = kvflow(&["run", &g, "--stall-timeout", "0", "--limit", "2", "--warmup", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.contains("stall watchdog off"), "{stderr}");
}

#[test]
fn requests_beyond_the_context_fail_at_admission_and_the_rest_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let g = quick_graph(dir.path());
    // llama's context is 8192 positions; the second request asks for more.
    let t = trace_file(dir.path(), &[mooncake_line(0, 100, 4), mooncake_line(1, 9000, 4), mooncake_line(2, 60, 4)]);
    let out = kvflow(&["run", &g, "--trace", &t, "--block-tokens", "512", "--warmup", "0", "--verify"]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = crate::common::records(dir.path());
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[1]["failure"], "exceeds-context", "{}", lines[1]);
    assert!(lines[1]["error"].as_str().unwrap().contains("8192"));
    assert!(lines[0]["error"].is_null() && lines[2]["error"].is_null());
    // generate: the others' outputs are written, and it exits 2.
    let long: Vec<u32> = (0..9000).map(|i| i % 100).collect();
    let p = prompts_file(dir.path(), &format!("{{\"prompt\": [1, 2]}}\n{{\"prompt\": {long:?}}}\n"));
    let out = generate_with(&fixture("hf/llama"), &p);
    assert_eq!(out.status.code(), Some(2));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let outputs: Vec<&str> = stdout.lines().collect();
    assert_eq!(outputs.len(), 2);
    assert!(outputs[0].contains("\"tokens\":[") && !outputs[0].contains("error"), "{}", outputs[0]);
    assert!(outputs[1].contains("context"), "{}", outputs[1]);
}

#[test]
fn an_unwritable_output_folder_is_found_before_serving() {
    let dir = tempfile::tempdir().unwrap();
    let g = quick_graph(dir.path());
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let started = std::time::Instant::now();
    assert_clean_failure(&kvflow(&["run", &g, "--out", &file.to_string_lossy()]), &["--out", "not a folder"]);
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "found only after serving");
    let p = prompts_file(dir.path(), "{\"prompt\": [1, 2]}\n");
    let llama = fixture("hf/llama").to_string_lossy().to_string();
    let into_folder = ["generate", "--model", &llama, "--prompts", &p, "--max-new-tokens", "2", "--out"];
    let out = kvflow(&[&into_folder[..], &[&dir.path().to_string_lossy()]].concat());
    assert_clean_failure(&out, &["--out"]);
}

#[test]
fn long_waits_are_announced_and_a_gap_beyond_max_wait_fails_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let g = quick_graph(dir.path());
    let t = trace_file(dir.path(), &[mooncake_line(0, 40, 2), mooncake_line(3_000_000_000, 40, 2)]);
    let started = std::time::Instant::now();
    let out = kvflow(&["run", &g, "--trace", &t, "--warmup", "0"]);
    assert_clean_failure(&out, &["request 1", "--max-wait"]);
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    // A gap of 11 s (22 s of trace at half speed) is waited, and said.
    let t = trace_file(dir.path(), &[mooncake_line(0, 40, 2), mooncake_line(22_000, 40, 2)]);
    let out = kvflow(&["run", &g, "--trace", &t, "--warmup", "0", "--max-wait", "30"]);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let graph_text = std::fs::read_to_string(&g).unwrap();
    assert!(graph_text.contains("block_tokens"), "the graph replays at trace speed");
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("waiting ") && stderr.contains(" s for request 1"), "{stderr}");
}

#[test]
fn smaller_cases_get_clear_messages() {
    let dir = tempfile::tempdir().unwrap();
    let g = quick_graph(dir.path());
    // model.path at a config.json loads its checkpoint.
    let cfg = fixture("hf/llama").join("config.json").to_string_lossy().to_string();
    let p = prompts_file(dir.path(), "{\"prompt\": [1, 2]}\n");
    let out = kvflow(&["generate", "--model", &cfg, "--prompts", &p, "--max-new-tokens", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // check refuses the roles run refuses.
    let prefill =
        std::fs::read_to_string(&g).unwrap().replace("name = \"main\"", "name = \"main\"\nrole = \"prefill\"");
    let pg = dir.path().join("prefill.toml");
    std::fs::write(&pg, prefill).unwrap();
    assert_clean_failure(&kvflow(&["check", &pg.to_string_lossy()]), &["prefill"]);
    // A trace error names the file.
    let t = dir.path().join("zero.jsonl");
    std::fs::write(&t, "{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 5, \"hash_ids\": []}\n").unwrap();
    assert_clean_failure(&kvflow(&["run", &g, "--trace", &t.to_string_lossy(), "--warmup", "0"]), &["zero.jsonl"]);
    // A warmup that leaves nothing to measure is an error, not an empty success.
    assert_clean_failure(&kvflow(&["run", &g, "--warmup", "100000", "--limit", "5"]), &["nothing to measure"]);
    // A bad hostfile line is named by file and line.
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "127.0.0.1:7000\nlocalhost\n").unwrap();
    let h = hosts.to_string_lossy().to_string();
    let out = kvflow(&["run", &g, "--process", "0", "--processes", "2", "--hostfile", &h]);
    assert_clean_failure(&out, &["hosts:2", "host:port"]);
    // An OS error is printed once, and stderr carries no colour codes.
    let out = kvflow(&["generate", "--model", "/no/such/model", "--prompts", &p, "--max-new-tokens", "2"]);
    let stderr = assert_clean_failure(&out, &["/no/such/model"]);
    assert_eq!(stderr.matches("os error 2").count(), 1, "{stderr}");
    assert!(!stderr.contains('\u{1b}'), "{stderr:?}");
}

#[test]
fn a_peer_that_never_connects_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let g = quick_graph(dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, format!("127.0.0.1:{port}\n127.0.0.1:{}\n", port + 1)).unwrap();
    let h = hosts.to_string_lossy().to_string();
    let out = kvflow(&["run", &g, "--process", "0", "--processes", "2", "--hostfile", &h, "--stall-timeout", "1"]);
    assert_clean_failure(&out, &["waited", "process 1 at 127.0.0.1", "connect"]);
}

// ---- Flags stand in for graph values; paths are printed as typed ----

#[test]
fn a_model_flag_stands_in_for_a_graph_model_path_that_does_not_exist() {
    let dir = tempfile::tempdir().unwrap();
    let graph = write_graph(dir.path(), "hf/llama", "mooncake_conversation_head.jsonl", "limit = 2", "32 MiB");
    let model = fixture("hf/llama").display().to_string();
    let text = std::fs::read_to_string(&graph).unwrap();
    std::fs::write(&graph, text.replace(&model, "/nonexistent/model")).unwrap();
    let graph = graph.to_string_lossy().to_string();
    // The graph alone names a model that is not there: that is the error, with its line.
    assert_clean_failure(&kvflow(&["run", &graph]), &["graph.toml:3", "model.path", "/nonexistent/model"]);
    // The flag is written in before the graph is checked, so the run serves the flag's model.
    let out = kvflow(&["run", &graph, "--model", &model, "--verify"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // A wrong flag is named as the command line's, not the file's.
    assert_clean_failure(
        &kvflow(&["run", &graph, "--model", "/also/missing"]),
        &["model.path", "/also/missing", "(set on the command line)"],
    );
}

#[test]
fn paths_are_printed_as_a_person_would_type_them() {
    // graphs/quickstart.toml names `../fixtures/...` and `../out/quickstart`: resolved against
    // the graph's folder, they read `fixtures/...` and `out/quickstart`, not `graphs/../...`.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvflow"))
        .current_dir(crate::common::repo())
        .args(["check", "graphs/quickstart.toml"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("model fixtures/hf/kimi_linear"), "{stdout}");
    assert!(!stdout.contains(".."), "{stdout}");
}

#[test]
fn a_test_switch_that_does_not_exist_or_has_a_bad_argument_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let g = quick_graph(dir.path());
    let unknown = kvflow(&["run", &g, "--test-switch", "hold-capabilty=align:1:6"]);
    assert_clean_failure(
        &unknown,
        &["\"hold-capabilty\"", "hold-capability=OPERATOR:RANK:STEP", "align-without-waiting"],
    );
    let bad = kvflow(&["run", &g, "--test-switch", "leak-blocks-of=seven"]);
    assert_clean_failure(&bad, &["leak-blocks-of=ID", "\"seven\""]);
    let extra = kvflow(&["run", &g, "--test-switch", "free-before-ack=1"]);
    assert_clean_failure(&extra, &["free-before-ack takes no argument"]);
}

#[test]
fn a_fault_delay_beyond_the_duration_bound_is_refused_by_the_graph_check() {
    // 1e300 ms used to pass the check and panic in `Duration::from_secs_f64` when the links
    // were wired.
    let dir = tempfile::tempdir().unwrap();
    let pools = "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n[[pool]]\nname = \"decode\"\n\
                 role = \"decode\"\nranks = 1\n\n[[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"inproc\"\n\n\
                 [faults]\ndelay_ms = 1e300\ndelay_probability = 0.5\n";
    let g = crate::runtime::write_graph_with(
        dir.path(),
        "hf/llama",
        "mooncake_conversation_head.jsonl",
        "",
        "16 MiB",
        pools,
    );
    let g = g.to_string_lossy();
    assert_clean_failure(&kvflow(&["run", &g]), &["graph.toml", "faults.delay_ms", "at most 1000000000", "1e300"]);
}

#[test]
fn bench_offload_chunk_sizes_are_bounded_before_anything_is_allocated() {
    let out = kvflow(&["bench", "offload", "--chunk-bytes", "1 TiB"]);
    assert_clean_failure(&out, &["--chunk-bytes", "1024 MiB", "1099511627776"]);
    let out = kvflow(&["bench", "offload", "--chunk-bytes", "512 MiB", "--chunks", "64"]);
    assert_clean_failure(&out, &["--chunk-bytes", "--chunks", "32768 MiB a round", "at most 4096 MiB"]);
}
