//! GGUF: dequantization against the `gguf` package's own (fixtures/gguf/quant_vectors.json), the
//! llama fixture written as GGUF by `tools/gguf_from_hf.py` (llama.cpp's layout, q/k permuted)
//! loading to the same logits as its safetensors, and hostile bytes giving errors, never panics.

use super::{GgmlType, GgufFile};
use crate::models::{load, LogitsWanted, Model, SeqInput};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

#[test]
fn every_type_dequantizes_as_the_gguf_package_does() {
    let text = std::fs::read_to_string(fixtures().join("gguf/quant_vectors.json")).unwrap();
    let vectors: Value = serde_json::from_str(&text).unwrap();
    let types = vectors["types"].as_object().unwrap();
    assert_eq!(types.len(), 10, "every type kvflow reads has vectors");
    for (name, v) in types {
        let kind = GgmlType::from_id(v["id"].as_u64().unwrap() as u32).unwrap();
        assert_eq!(kind.name(), name);
        let hex = v["bytes"].as_str().unwrap();
        let bytes: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        let bytes = &bytes[..bytes.len() / kind.block_bytes() * kind.block_bytes()];
        let got = kind.dequantize(bytes);
        let want: Vec<f32> = v["values"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{name} value {i}: {g} against the gguf package's {w}");
        }
    }
}

/// The logits at the last position of `prompt`, one prefill step.
fn last_logits(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let blocks = prompt.len().div_ceil(16);
    let mut cache = model.new_cache(16, blocks, 1, 0);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let batch = [SeqInput {
        tokens: prompt,
        start_pos: 0,
        block_table: &table,
        slot: None,
        prompt_len: prompt.len(),
        logits: LogitsWanted::Last,
    }];
    model.forward(&batch, &mut cache).logits
}

fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (diff / norm).sqrt()
}

#[test]
fn the_llama_fixture_as_gguf_gives_the_logits_of_its_safetensors() {
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("hf/llama/expected.json")).unwrap()).unwrap();
    let safetensors = load(&fixtures().join("hf/llama")).unwrap();
    let f32_gguf = load(&fixtures().join("gguf/llama-f32.gguf")).unwrap();
    let q8_gguf = load(&fixtures().join("gguf/llama-q8_0.gguf")).unwrap();
    for case in expected["cases"].as_array().unwrap() {
        let prompt: Vec<u32> = case["prompt"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let theirs: Vec<f32> =
            case["last_logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        let want = last_logits(&safetensors, &prompt);
        // The same f32 weights, rows put back in place: the same bits.
        assert_eq!(last_logits(&f32_gguf, &prompt), want, "prompt of {} tokens", prompt.len());
        assert!(relative_error(&want, &theirs) < 1e-4);
        // Q8_0 weights: close to transformers' logits, not equal.
        let q8 = relative_error(&last_logits(&q8_gguf, &prompt), &theirs);
        assert!(q8 < 0.05 && q8 > 0.0, "Q8_0 relative error {q8}");
    }
}

#[test]
fn bad_gguf_bytes_are_errors_naming_the_file_never_panics() {
    let path = Path::new("bad.gguf");
    let good = std::fs::read(fixtures().join("gguf/llama-q8_0.gguf")).unwrap();
    let error = |bytes: &[u8]| match GgufFile::parse(path, bytes) {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    };
    assert!(GgufFile::parse(path, &good).is_ok());
    let e = error(b"GGML\x03\0\0\0");
    assert!(e.contains("bad.gguf") && e.contains("not a GGUF file"), "{e}");
    let mut v4 = good.clone();
    v4[4] = 4;
    assert!(error(&v4).contains("GGUF version 4"));
    // Every truncation of the header is an error.
    let (_, _, tensors) = GgufFile::parse(path, &good).unwrap();
    let data_start = tensors.values().map(|t| t.start).min().unwrap();
    for len in 0..data_start {
        let e = error(&good[..len]);
        assert!(e.contains("bad.gguf") && e.contains("not a valid GGUF file"), "truncated at {len}: {e}");
    }
    // Cut inside the data: the tensors that no longer fit are named.
    let e = error(&good[..good.len() - 1]);
    assert!(e.contains("are not inside the"), "{e}");
    // Seeded single-byte changes anywhere in the header: a result or an error, never a panic.
    let mut seed = 0x9e3779b97f4a7c15u64;
    for _ in 0..3000 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut bytes = good[..data_start + 64].to_vec();
        let at = (seed % data_start as u64) as usize;
        bytes[at] = (seed >> 32) as u8;
        let _ = GgufFile::parse(path, &bytes);
    }
}

#[test]
fn a_gguf_of_another_architecture_is_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("kvflow-gguf-arch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut bytes = std::fs::read(fixtures().join("gguf/llama-q8_0.gguf")).unwrap();
    // "llama" → "qwen2": same length, the metadata's first value
    let at = bytes.windows(5).position(|w| w == b"llama").unwrap();
    bytes[at..at + 5].copy_from_slice(b"qwen2");
    let path = dir.join("m.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let e = load(&path).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("m.gguf") && e.contains("general.architecture") && e.contains("\"qwen2\""), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_gguf_with_a_nan_or_negative_epsilon_is_refused_under_its_gguf_key() {
    let dir = std::env::temp_dir().join(format!("kvflow-gguf-eps-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = std::fs::read(fixtures().join("gguf/llama-q8_0.gguf")).unwrap();
    let key = b"llama.attention.layer_norm_rms_epsilon";
    let end = good.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(good[end..end + 4], 6u32.to_le_bytes(), "the fixture stores its epsilon as an f32");
    for (value, shown) in [(f32::NAN, "NaN"), (-1e-5, "-0.0000"), (f32::INFINITY, "inf")] {
        let mut bytes = good.clone();
        bytes[end + 4..end + 8].copy_from_slice(&value.to_le_bytes());
        let path = dir.join("m.gguf");
        std::fs::write(&path, &bytes).unwrap();
        let e = load(&path).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("m.gguf") && e.contains("llama.attention.layer_norm_rms_epsilon"), "{value}: {e}");
        assert!(e.contains(shown) && e.contains("expected a finite number above 0"), "{value}: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
