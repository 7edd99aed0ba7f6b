//! The GGUF pre-tokenizers of Llama 3 (`tokenizer.ggml.pre = "llama-bpe"`) and Qwen 2.5/3
//! (`"qwen2"`): a GGUF file written here with the vocabulary of fixtures/tokenizers/pretokenizers.json
//! encodes every string of that fixture — unicode, digits, whitespace runs, contractions, code —
//! to the ids the Python `tokenizers` library gave with those models' tokenizer.json settings
//! (tools/pretokenizer_fixture.py). A name kvflow does not know is refused under its key.

use crate::common::repo;
use kvflow::text::TextModel;
use std::path::Path;

/// A GGUF (version 3) holding no tensors and a gpt2 tokenizer: `tokens`, `merges`, every token
/// normal, pre-tokenizer `pre`.
fn write_tokenizer_gguf(path: &Path, tokens: &[String], merges: &[String], pre: &str) {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    const STRING: u32 = 8;
    const ARRAY: u32 = 9;
    const I32: u32 = 5;
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes()); // tensors
    out.extend(5u64.to_le_bytes()); // metadata entries
    let strings = |out: &mut Vec<u8>, key: &str, items: &[String]| {
        string(out, key);
        out.extend(ARRAY.to_le_bytes());
        out.extend(STRING.to_le_bytes());
        out.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|s| string(out, s));
    };
    string(&mut out, "tokenizer.ggml.model");
    out.extend(STRING.to_le_bytes());
    string(&mut out, "gpt2");
    string(&mut out, "tokenizer.ggml.pre");
    out.extend(STRING.to_le_bytes());
    string(&mut out, pre);
    strings(&mut out, "tokenizer.ggml.tokens", tokens);
    strings(&mut out, "tokenizer.ggml.merges", merges);
    string(&mut out, "tokenizer.ggml.token_type");
    out.extend(ARRAY.to_le_bytes());
    out.extend(I32.to_le_bytes());
    out.extend((tokens.len() as u64).to_le_bytes());
    tokens.iter().for_each(|_| out.extend(1i32.to_le_bytes()));
    std::fs::write(path, out).unwrap();
}

#[test]
fn llama_bpe_and_qwen2_pre_tokenizers_encode_as_the_tokenizers_library() {
    let text = std::fs::read_to_string(repo().join("fixtures/tokenizers/pretokenizers.json")).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
    let list = |key: &str| -> Vec<String> {
        fixture[key].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect()
    };
    let (tokens, merges) = (list("tokens"), list("merges"));
    let dir = tempfile::tempdir().unwrap();
    for pre in ["llama-bpe", "qwen2"] {
        let path = dir.path().join(format!("{pre}.gguf"));
        write_tokenizer_gguf(&path, &tokens, &merges, pre);
        let model = TextModel::load(&path).unwrap_or_else(|e| panic!("{pre}: {e}"));
        let cases = fixture["cases"][pre].as_array().unwrap();
        assert!(cases.len() >= 300, "{pre}: a few hundred strings");
        let mut differ = Vec::new();
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let want: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect();
            let got = model.encode(text).unwrap();
            if got != want {
                differ.push(format!("{text:?}: kvflow {got:?}, tokenizers {want:?}"));
            }
        }
        assert!(differ.is_empty(), "{pre}: {} of {} strings differ:\n{}", differ.len(), cases.len(), differ.join("\n"));
    }
    // The two differ where they should (digits one at a time under qwen2, NFC), so neither passes
    // as the other.
    let same = |a: &str, b: &str| fixture["cases"][a] == fixture["cases"][b];
    assert!(!same("llama-bpe", "qwen2"));

    let path = dir.path().join("unknown.gguf");
    write_tokenizer_gguf(&path, &tokens, &merges, "deepseek-llm");
    let e = TextModel::load(&path).err().expect("an unknown pre-tokenizer is refused").to_string();
    for needle in ["unknown.gguf", "`tokenizer.ggml.pre`", "\"deepseek-llm\"", "llama-bpe, qwen2"] {
        assert!(e.contains(needle), "{e}");
    }
}
