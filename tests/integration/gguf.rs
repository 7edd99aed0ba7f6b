//! GGUF checkpoints. The llama fixture written as GGUF by tools/gguf_from_hf.py (llama.cpp's
//! layout: q/k rows permuted, F32 or Q8_0) reproduces transformers' outputs through `generate`.
//! SmolLM2-135M-Instruct (Q4_1, fetched by tools/fetch_smollm2.sh; CI fetches it and sets
//! `KVFLOW_REQUIRE_SMOLLM2`) reproduces tools/smollm2_reference.py — an implementation of its own
//! (the `gguf` package's dequantization, a numpy forward on GGUF's own rope layout) — greedy
//! tokens exact and logits within 1e-4; its tokenizer and chat template, read from the GGUF
//! metadata, give the reference's prompt ids, rendered prompts and decoded text.

use crate::common::{check_case, expected, fixture, load, rel_err, repo};
use kvflow::generate::{generate, GenerateOptions};
use serde::Deserialize;
use std::path::PathBuf;

#[test]
fn the_llama_fixture_as_gguf_reproduces_transformers() {
    let exp = expected(&fixture("hf/llama"));
    let model = load(&fixture("gguf/llama-f32.gguf"));
    let prompts: Vec<Vec<u32>> = exp.cases.iter().map(|c| c.prompt.clone()).collect();
    let (n, k) = (exp.cases[0].greedy.len(), exp.cases[0].decode_logits.len());
    let opts = GenerateOptions { max_new_tokens: n, chunk_tokens: 64, decode_logits: k, ..Default::default() };
    let got = generate(&model, &prompts, &opts).expect("generate");
    for (i, (case, g)) in exp.cases.iter().zip(&got).enumerate() {
        check_case(&format!("llama-f32.gguf case {i}"), case, g);
    }
}

#[derive(Deserialize)]
struct SmolCase {
    kind: String,
    #[serde(default)]
    messages: Vec<kvflow::text::ChatMessage>,
    eos_at: Option<usize>,
    text: String,
    rendered: String,
    prompt: Vec<u32>,
    greedy: Vec<u32>,
    last_logits: Vec<f32>,
    decode_logits: Vec<f32>,
}

#[derive(Deserialize)]
struct SmolExpected {
    cases: Vec<SmolCase>,
}

/// The SmolLM2 GGUF: `KVFLOW_SMOLLM2`, else `$KVFLOW_CACHE`'s copy, else the test fetches it
/// itself (tools/fetch_smollm2.sh, once per test process, into `target/test-deps/cache`, where
/// tools/test.sh puts it too). `None` (after saying why) only when the fetch failed — no network
/// to PyPI — and `KVFLOW_REQUIRE_SMOLLM2` is not set.
pub fn smollm2() -> Option<PathBuf> {
    static FETCHED: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    const FILE: &str = "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
    let given = std::env::var_os("KVFLOW_SMOLLM2")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("KVFLOW_CACHE").map(|c| PathBuf::from(c).join(FILE)))
        .filter(|p| p.is_file());
    let found = match given {
        Some(path) => Ok(path),
        None => FETCHED.get_or_init(|| fetch_smollm2(&repo().join("target/test-deps/cache"))).clone(),
    };
    match found {
        Ok(path) => Some(path),
        Err(why) => {
            assert!(std::env::var_os("KVFLOW_REQUIRE_SMOLLM2").is_none(), "KVFLOW_REQUIRE_SMOLLM2 is set, but {why}");
            println!("skipped: {why}");
            None
        }
    }
}

/// Runs tools/fetch_smollm2.sh with its cache at `cache`; the GGUF's path, or why not.
fn fetch_smollm2(cache: &std::path::Path) -> Result<PathBuf, String> {
    let out = std::process::Command::new("bash")
        .arg(repo().join("tools/fetch_smollm2.sh"))
        .env("KVFLOW_CACHE", cache)
        .output()
        .map_err(|e| format!("tools/fetch_smollm2.sh could not start: {e}"))?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if out.status.success() && path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "the SmolLM2 GGUF could not be fetched (tools/fetch_smollm2.sh: {})",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

#[test]
fn smollm2_q4_1_reproduces_its_reference() {
    let Some(path) = smollm2() else { return };
    let text = std::fs::read_to_string(fixture("smollm2/expected.json")).unwrap();
    let exp: SmolExpected = serde_json::from_str(&text).unwrap();
    let model = load(&path);
    let prompts: Vec<Vec<u32>> = exp.cases.iter().map(|c| c.prompt.clone()).collect();
    let opts = GenerateOptions { max_new_tokens: exp.cases[0].greedy.len(), decode_logits: 1, ..Default::default() };
    let got = generate(&model, &prompts, &opts).expect("generate");
    for (case, g) in exp.cases.iter().zip(&got) {
        let what = format!("{:?}", case.rendered);
        assert_eq!(g.tokens, case.greedy, "{what}: greedy tokens");
        let kept = case.last_logits.len();
        let e = rel_err(&g.last_logits[..kept], &case.last_logits);
        assert!(e < 1e-4, "{what}: prompt logits relative error {e:.2e}");
        let decode = &g.decode_logits.as_ref().expect("asked for")[0];
        let e = rel_err(&decode[..kept], &case.decode_logits);
        assert!(e < 1e-4, "{what}: first decode logits relative error {e:.2e}");
    }
}

#[test]
fn smollm2_tokenizer_and_chat_template_give_the_references_prompts_and_text() {
    use kvflow::text::TextModel;
    let Some(path) = smollm2() else { return };
    let text = std::fs::read_to_string(fixture("smollm2/expected.json")).unwrap();
    let exp: SmolExpected = serde_json::from_str(&text).unwrap();
    let model = TextModel::load(&path).unwrap();
    assert_eq!(model.eos(), Some(2), "<|im_end|>");
    // The same tokenizer and template served from a checkpoint folder (tokenizer.json and
    // tokenizer_config.json) give the same.
    let dir = tempfile::tempdir().unwrap();
    model.save_tokenizer_json(&dir.path().join("tokenizer.json")).unwrap();
    let f = kvflow_kernels::checkpoint::gguf::GgufFile::open(&path).unwrap();
    let template = f.get("tokenizer.chat_template").and_then(|v| v.as_str()).unwrap().to_string();
    let config = serde_json::json!({"chat_template": template, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let from_folder = TextModel::load(dir.path()).unwrap();
    for m in [&model, &from_folder] {
        for case in &exp.cases {
            if case.kind == "chat" {
                assert_eq!(m.render_chat(&case.messages, true).unwrap(), case.rendered);
            }
            assert_eq!(m.encode(&case.rendered).unwrap(), case.prompt, "{:?}", case.rendered);
            let end = case.eos_at.unwrap_or(case.greedy.len());
            assert_eq!(m.decode(&case.greedy[..end]).unwrap(), case.text);
        }
        assert_eq!(m.eos(), Some(2));
    }
}

#[test]
fn a_gguf_without_a_tokenizer_or_a_folder_without_tokenizer_json_is_a_clear_error() {
    use kvflow::text::TextModel;
    let e = TextModel::load(&fixture("gguf/llama-f32.gguf")).err().unwrap().to_string();
    assert!(e.contains("llama-f32.gguf") && e.contains("`tokenizer.ggml.model`") && e.contains("no tokenizer"), "{e}");
    let e = TextModel::load(&fixture("hf/llama")).err().unwrap().to_string();
    assert!(e.contains("hf/llama") && e.contains("no tokenizer.json"), "{e}");
}
