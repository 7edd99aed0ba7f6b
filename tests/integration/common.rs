//! Helpers shared by the integration tests: fixture paths, expected outputs, the comparison rule
//! of fixtures/hf/README.md, and running the CLI the way a user does.

use kvflow::generate::{generate, GenerateOptions, Generation};
use kvflow_kernels::models::{self, Model};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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
    std::fs::read_to_string(dir.join("out/requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A run's report.json (in `dir/out`).
pub fn report(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("out/report.json")).unwrap()).unwrap()
}
