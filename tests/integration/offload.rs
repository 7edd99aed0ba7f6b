//! The offload tier's save side (DESIGN §9): full prompt chunks are saved, fenced — a save reads
//! its blocks only after the step that wrote them completed and holds them until it is stored —
//! to a memory or disk store; a failing store drops saves and keeps every block accounted for.
//! (Loads from the store are not built yet.)

use crate::common::{load, repo};
use crate::runtime::{request_lines, run_graph, write_graph_with};
use kvflow::graph::Overrides;
use kvflow_kernels::models::{LogitsWanted, Model, SeqInput};
use kvflow_operators::offload::{chunk_digests, decode_object};
use kvflow_operators::rank::TestSwitches;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

const CHUNK: usize = 32;
const BLOCK: usize = 16;

fn offload_graph(dir: &Path, model: &str, store: &str, budget: &str) -> std::path::PathBuf {
    let pools = format!("[[pool]]\nname = \"main\"\nranks = 2\n\n[offload]\n{store}\nchunk_tokens = {CHUNK}\n");
    let workload = "mode = \"concurrency\"\nconcurrency = 12\nlimit = 40";
    write_graph_with(dir, model, "mooncake_conversation_first5min.jsonl", workload, budget, &pools)
}

/// The KV of chunk `k` of `prompt`, computed alone by the reference path, packed by layer as a
/// save stores it.
fn recomputed_chunk(model: &Model, prompt: &[u32], k: usize) -> Vec<f32> {
    let n = (k + 1) * CHUNK;
    let blocks = n / BLOCK;
    let mut cache = model.new_cache(BLOCK, blocks, 1, 0);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let seq = SeqInput {
        tokens: &prompt[..n],
        start_pos: 0,
        block_table: &table,
        slot: model.needs_slots().then_some(0),
        prompt_len: prompt.len(),
        logits: LogitsWanted::Last,
    };
    model.forward(&[seq], &mut cache);
    let mut out = Vec::new();
    cache.kv.export_blocks(&table[k * CHUNK / BLOCK..], &mut out);
    out
}

/// (objects checked, objects whose KV differs from the reference) over every stored chunk of
/// the run's requests.
fn compare_store(dir: &Path, store: &Path, model: &Model) -> (usize, usize) {
    let files: HashMap<String, std::path::PathBuf> = std::fs::read_dir(store)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kvc"))
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().to_string();
            (name.rsplit('_').next().unwrap().to_string(), p)
        })
        .collect();
    let (mut checked, mut differ) = (0, 0);
    let mut seen = std::collections::HashSet::new();
    for line in request_lines(&dir.join("out")) {
        let prompt: Vec<u32> =
            line["prompt_tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        for (k, d) in chunk_digests(&prompt, CHUNK, 0).iter().enumerate() {
            let hex = format!("{:016x}{:016x}", d.0[0], d.0[1]);
            let Some(path) = files.get(&hex) else { continue };
            if !seen.insert(hex) {
                continue;
            }
            let object = decode_object(&std::fs::read(path).unwrap()).unwrap();
            checked += 1;
            let expected = recomputed_chunk(model, &prompt, k);
            if object.kv.len() != expected.len()
                || object.kv.iter().zip(&expected).any(|(a, b)| a.to_bits() != b.to_bits())
            {
                differ += 1;
            }
        }
    }
    (checked, differ)
}

#[test]
fn saves_are_fenced_and_without_the_fence_the_stored_kv_is_another_requests() {
    // Guarantee "save fencing" (tests/GUARANTEES.md). A slow store (each save waits 30 ms before
    // it reads) and little KV memory: blocks are reused soon after a request lets them go.
    let model = load(&repo().join("fixtures/hf/llama"));
    for fenced in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        let spec = format!("store = \"disk\"\npath = \"{}\"", store.display());
        let graph = offload_graph(dir.path(), "hf/llama", &spec, "3 MiB");
        let switches = TestSwitches { slow_saves_ms: 30, release_saves_early: !fenced, ..Default::default() };
        let report = run_graph(&graph, Overrides::default(), switches);
        assert_eq!(report["failed"], 0);
        assert_eq!(report["verify"]["mismatched"], 0, "saves never change what is computed");
        assert!(report["offload"]["saved_chunks"].as_u64().unwrap() > 10, "{}", report["offload"]);
        let (checked, differ) = compare_store(dir.path(), &store, &model);
        assert!(checked > 10, "stored chunks were checked: {checked}");
        if fenced {
            assert_eq!(differ, 0, "with the fence every stored chunk is the KV its tokens give");
        } else {
            assert!(differ > 0, "without the fence some stored chunk holds blocks another request overwrote");
        }
    }
}

#[test]
fn a_disk_store_outlives_the_run_and_a_second_run_finds_its_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let spec = format!("store = \"disk\"\npath = \"{}\"", store.display());
    let graph = offload_graph(dir.path(), "hf/qwen3", &spec, "8 MiB");
    let first = run_graph(&graph, Overrides::default(), TestSwitches::default());
    let saved = first["offload"]["saved_chunks"].as_u64().unwrap();
    assert!(saved > 10, "{}", first["offload"]);
    let listing = || -> HashMap<std::path::PathBuf, std::time::SystemTime> {
        std::fs::read_dir(&store)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| {
                assert_eq!(p.extension().and_then(|x| x.to_str()), Some("kvc"), "no temporary file is left: {p:?}");
                let modified = std::fs::metadata(&p).unwrap().modified().unwrap();
                (p, modified)
            })
            .collect()
    };
    let after_first = listing();
    assert_eq!(after_first.len() as u64, saved, "one file per saved chunk");
    let second = run_graph(&graph, Overrides::default(), TestSwitches::default());
    assert!(
        second["offload"]["found_in_store"].as_u64().unwrap() > 0,
        "the second run finds the first's chunks: {}",
        second["offload"]
    );
    assert_eq!(second["verify"]["mismatched"], 0);
    let after_second = listing();
    for (path, modified) in &after_first {
        assert_eq!(after_second.get(path), Some(modified), "a chunk the store held is not written again: {path:?}");
    }
}

#[test]
fn a_store_that_refuses_every_put_drops_the_saves_and_the_run_ends_with_every_block_free() {
    let dir = tempfile::tempdir().unwrap();
    // Smaller than one object: every put is refused as full.
    let graph =
        offload_graph(dir.path(), "hf/llama", "store = \"memory\"\ncapacity_bytes = 1\nmax_retries = 2", "4 MiB");
    let report: Value = run_graph(&graph, Overrides::default(), TestSwitches::default());
    assert_eq!(report["completed"], report["requests"]);
    assert_eq!(report["verify"]["mismatched"], 0);
    assert_eq!(report["offload"]["saved_chunks"], 0);
    assert!(report["offload"]["dropped_saves"].as_u64().unwrap() > 0, "{}", report["offload"]);
    assert_eq!(report["accounting_errors"].as_array().unwrap().len(), 0, "every block came back");
}

#[test]
fn a_recurrent_family_saves_only_chunks_that_end_at_a_snapshot_boundary() {
    let dir = tempfile::tempdir().unwrap();
    // kimi_linear: the chunk size must be a multiple of 4 blocks of 16 (the snapshot interval).
    let graph = offload_graph(dir.path(), "hf/kimi_linear", "store = \"memory\"", "16 MiB");
    let mut graph_text = std::fs::read_to_string(&graph).unwrap();
    let out = crate::common::kvflow(&["run", &graph.to_string_lossy()]);
    crate::common::assert_clean_failure(&out, &["offload.chunk_tokens", "multiple of", "(64)"]);
    graph_text = graph_text.replace(&format!("chunk_tokens = {CHUNK}\n"), "chunk_tokens = 64\n");
    std::fs::write(&graph, graph_text).unwrap();
    let report = run_graph(&graph, Overrides::default(), TestSwitches::default());
    assert_eq!(report["verify"]["mismatched"], 0);
    assert!(report["offload"]["saved_chunks"].as_u64().unwrap() > 0, "{}", report["offload"]);
}
