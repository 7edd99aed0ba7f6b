//! Mutation fuzzing of every parser on stable Rust: each target starts from its seed corpus
//! (`tests/fuzz-corpus/TARGET/`), and for a time budget feeds seeded mutations of those seeds —
//! bytes flipped, inserted, deleted, duplicated, spliced from another seed, numbers swapped for
//! hostile ones — to the same entry point `kvflow` uses. No input may panic: each must parse or
//! be an error. A panicking input is written to `target/fuzz-crashes/` and fails the test.
//!
//! CI gives each target a few seconds (all together under 90 s); for a longer run:
//! `KVFLOW_FUZZ_SECONDS=300 cargo test --release --test integration -- fuzz:: --test-threads 1`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::{fixture, repo};

/// Seconds each target runs for (after its seeds).
fn budget() -> Duration {
    let seconds = std::env::var("KVFLOW_FUZZ_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(6.0);
    Duration::from_secs_f64(seconds)
}

/// A seeded random stream (splitmix64): the same seed, the same inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let z = kvflow::trace::splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Values that break careless parsers: limits, signs, non-finite numbers, odd syntax.
const HOSTILE: &[&str] = &[
    "0",
    "-1",
    "-0",
    "1e309",
    "-1e309",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "1e-320",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "4294967296",
    "100000000000",
    "0.5",
    "\"\"",
    "\"x\"",
    "[]",
    "{}",
    "[[",
    "]]",
    "{",
    "}",
    "null",
    "true",
    ",",
    ":",
    "=",
    "\n",
    "\"",
    "'",
    "\\",
    "#",
    "\u{0}",
    "\u{feff}",
    "é",
    "[[pool]]",
    "[pool.memory]",
    "1970-01-01 00:00:00",
    "2023-13-45 25:61:61.99",
];

/// One mutation of `input` (sometimes several in a row).
fn mutate(input: &[u8], seeds: &[Vec<u8>], rng: &mut Rng) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(out.len() + 1);
        match rng.below(8) {
            0 if !out.is_empty() => {
                let i = rng.below(out.len());
                out[i] ^= 1 << rng.below(8);
            }
            1 => out.insert(at, rng.next() as u8),
            2 if !out.is_empty() => {
                let end = (at + 1 + rng.below(16)).min(out.len());
                out.drain(at.min(end)..end);
            }
            3 if !out.is_empty() => {
                let start = rng.below(out.len());
                let end = (start + 1 + rng.below(64)).min(out.len());
                let piece = out[start..end].to_vec();
                out.splice(at..at, piece);
            }
            4 => {
                let other = &seeds[rng.below(seeds.len())];
                if !other.is_empty() {
                    let start = rng.below(other.len());
                    let end = (start + 1 + rng.below(128)).min(other.len());
                    out.splice(at..at, other[start..end].iter().copied());
                }
            }
            5 => out.truncate(at),
            _ => {
                // Replace the number (or word) around `at` with a hostile value.
                let is_word = |b: u8| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'+';
                let (mut start, mut end) = (at.min(out.len()), at.min(out.len()));
                while start > 0 && is_word(out[start - 1]) {
                    start -= 1;
                }
                while end < out.len() && is_word(out[end]) {
                    end += 1;
                }
                out.splice(start..end, HOSTILE[rng.below(HOSTILE.len())].bytes());
            }
        }
    }
    out
}

/// The seed corpus of `target`.
fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = repo().join("tests/fuzz-corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{}: no seeds", dir.display());
    files.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// Runs `target`'s seeds, then mutations for the time budget, through `parse`; fails listing
/// every input that panicked (each saved under target/fuzz-crashes/).
fn fuzz(target: &str, seed: u64, mut parse: impl FnMut(&[u8])) {
    let seeds = corpus(target);
    let mut rng = Rng(seed);
    let mut crashes = Vec::new();
    let mut runs = 0u64;
    let started = Instant::now();
    // Quiet only for this thread's panics (the inputs that crash): a test running beside it
    // still prints why it failed.
    type Hook = dyn Fn(&std::panic::PanicHookInfo<'_>) + Send + Sync;
    let previous: std::sync::Arc<Hook> = std::sync::Arc::from(std::panic::take_hook());
    let fuzzing = std::thread::current().id();
    let others = previous.clone();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().id() != fuzzing {
            others(info)
        }
    }));
    let mut one = |input: &[u8], crashes: &mut Vec<PathBuf>| {
        runs += 1;
        if catch_unwind(AssertUnwindSafe(|| parse(input))).is_err() {
            let dir = repo().join("target/fuzz-crashes");
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(format!("{target}-{}-{}", crashes.len(), kvflow_kernels::hash::mix(0, runs)));
            std::fs::write(&path, input).unwrap();
            crashes.push(path);
        }
    };
    for s in &seeds {
        one(s, &mut crashes);
    }
    while started.elapsed() < budget() && crashes.len() < 10 {
        let base = &seeds[rng.below(seeds.len())];
        let input = mutate(base, &seeds, &mut rng);
        one(&input, &mut crashes);
    }
    let _ = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| previous(info)));
    eprintln!("fuzz {target}: {runs} inputs in {:.1} s", started.elapsed().as_secs_f64());
    assert!(
        crashes.is_empty(),
        "fuzz {target}: {} input(s) panicked (rerun one to see where): {crashes:#?}",
        crashes.len()
    );
}

/// A scratch file the file-reading parsers read each input from.
struct Scratch {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        Scratch { _dir: dir, path }
    }

    fn holding(&self, input: &[u8]) -> &Path {
        std::fs::write(&self.path, input).unwrap();
        &self.path
    }
}

#[test]
fn graph_files() {
    // Parsed as if it sat in graphs/, so the seeds' relative paths reach real fixtures and the
    // mutations get past the first checks.
    let path = repo().join("graphs/fuzzed.toml");
    let names = kvflow::registry::Registry::default().names();
    fuzz("graph", 1, |input| {
        let text = String::from_utf8_lossy(input);
        if let Ok(graph) = kvflow::graph::Graph::parse_with(&path, &text, &names) {
            let _ = kvflow::runtime::pick_pools(&graph, None);
        }
        let overrides = kvflow::graph::Overrides { ranks: Some(2), limit: Some(3), ..Default::default() };
        let _ = kvflow::graph::Graph::parse_overridden(&path, &text, &names, &overrides);
    });
}

fn trace_target(target: &str, format: kvflow::trace::TraceFormat, seed: u64) {
    let scratch = Scratch::new(&format!("trace.{target}"));
    fuzz(target, seed, |input| {
        if let Ok(records) = kvflow::trace::read_trace(scratch.holding(input), format) {
            let opts =
                kvflow::trace::SynthOptions { block_tokens: 16, seed: 1, vocab_size: 1000, max_output_tokens: Some(8) };
            let _ = kvflow::trace::synthesize(&records, &opts);
        }
    });
}

#[test]
fn mooncake_traces() {
    trace_target("mooncake", kvflow::trace::TraceFormat::Mooncake, 2);
}

#[test]
fn azure_traces() {
    trace_target("azure", kvflow::trace::TraceFormat::Azure, 3);
}

#[test]
fn vidur_traces() {
    trace_target("vidur", kvflow::trace::TraceFormat::Vidur, 4);
}

#[test]
fn prompt_files() {
    let model = kvflow_kernels::models::load(&fixture("hf/llama")).unwrap();
    let scratch = Scratch::new("prompts.jsonl");
    fuzz("prompts", 5, |input| {
        let _ = kvflow::generate::read_prompts(scratch.holding(input), &model);
    });
}

#[test]
fn checkpoint_configs() {
    use kvflow_kernels::checkpoint::ConfigSource;
    fuzz("config_json", 6, |input| {
        let text = String::from_utf8_lossy(input);
        if let Ok(cfg) = ConfigSource::parse("config.json".into(), &text) {
            // Every check a load makes before it reads a weight (it allocates none).
            let _ = kvflow_kernels::models::check(&cfg);
        }
    });
}

#[test]
fn model_specs() {
    use kvflow_kernels::checkpoint::ModelSpec;
    fuzz("model_spec", 7, |input| {
        let text = String::from_utf8_lossy(input);
        if let Ok(spec) = ModelSpec::parse("spec.toml".into(), &text) {
            let _ = kvflow_kernels::models::check(&spec.config);
        }
    });
}

#[test]
fn safetensors_headers() {
    fuzz("safetensors", 8, |input| {
        let _ = kvflow_kernels::checkpoint::parse_safetensors_header(Path::new("model.safetensors"), input);
    });
}

#[test]
fn gguf_files() {
    // The whole load: header, metadata to config, every tensor dequantized, the model built and
    // one step run (a mutation that loads must give finite logits or an error, never a panic).
    let scratch = Scratch::new("fuzzed.gguf");
    fuzz("gguf", 9, |input| {
        if let Ok(model) = kvflow_kernels::models::load(scratch.holding(input)) {
            let prompts = vec![vec![1u32, 2, 3]];
            let opts = kvflow::generate::GenerateOptions { max_new_tokens: 2, ..Default::default() };
            let _ = kvflow::generate::generate(&model, &prompts, &opts);
        }
    });
}

#[test]
fn openai_bodies() {
    // Request bodies of `kvflow serve`, checked for both endpoints without a tokenizer (token ids
    // only) and, when SmolLM2 is fetched, with its tokenizer and chat template (hostile message
    // text rendered and tokenized): a 400 or an accepted request, never a panic.
    use kvflow::server::openai::{parse, Endpoint, Limits};
    let text = crate::gguf::smollm2().map(|p| kvflow::text::TextModel::load(&p).expect("SmolLM2's tokenizer"));
    fn limits(text: Option<&kvflow::text::TextModel>) -> Limits<'_> {
        let max_prompt_bytes = text.and_then(|t| t.max_prompt_bytes(64));
        Limits {
            text,
            model_name: "m",
            vocab_size: 100,
            max_context: 64,
            max_tokens: 16,
            sampling: Default::default(),
            max_prompt_bytes,
        }
    }
    let (plain, with_text) = (limits(None), limits(text.as_ref()));
    fuzz("openai", 10, |input| {
        for limits in [&plain, &with_text] {
            for endpoint in [Endpoint::Completions, Endpoint::Chat] {
                if let Ok(ask) = parse(endpoint, input, limits) {
                    assert!(!ask.prompt.is_empty() && ask.prompt.len() + ask.max_tokens <= limits.max_context);
                }
            }
        }
    });
}
