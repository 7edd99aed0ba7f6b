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
