//! The offload tier (DESIGN §9): full prompt chunks are saved, fenced — a save reads its blocks
//! only after the step that wrote them completed and holds them until it is stored — to a memory
//! or disk store, and a request whose prefix left a rank's KV memory loads it back, exactly, on
//! any rank of any pool of the same layout; a restored prefix is published in the rank's prefix
//! cache; a failing or damaged store never loses a request or a block.

use crate::common::{load, records, repo};
use crate::runtime::{assert_exact, run_graph, write_graph_with};
use kvflow::graph::Overrides;
use kvflow_kernels::models::{LogitsWanted, Model, SeqInput};
use kvflow_operators::offload::{chunk_digests, decode_object};
use kvflow_operators::rank::TestSwitches;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const CHUNK: usize = 32;
const BLOCK: usize = 16;

fn offload_graph(dir: &Path, model: &str, store: &str, budget: &str) -> std::path::PathBuf {
    let pools = format!("[[pool]]\nname = \"main\"\nranks = 2\n\n[offload]\n{store}\nchunk_tokens = {CHUNK}\n");
    let workload = "mode = \"concurrency\"\nconcurrency = 12\nlimit = 40";
    write_graph_with(dir, model, "mooncake_conversation_first5min.jsonl", workload, budget, &pools)
}

/// The KV of `prompt`'s first `chunks` chunks, computed alone by the reference path, each packed
/// by layer as a save stores it.
fn recomputed_chunks(model: &Model, prompt: &[u32], chunks: usize) -> Vec<Vec<f32>> {
    let n = chunks * CHUNK;
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
    let per_chunk = CHUNK / BLOCK;
    (0..chunks)
        .map(|k| {
            let mut out = Vec::new();
            cache.kv.export_blocks(&table[k * per_chunk..(k + 1) * per_chunk], &mut out);
            out
        })
        .collect()
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
    for line in records(dir) {
        let prompt: Vec<u32> =
            line["prompt_tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let stored: Vec<(usize, &PathBuf)> = chunk_digests(&prompt, CHUNK, 0)
            .iter()
            .enumerate()
            .filter_map(|(k, d)| {
                let hex = format!("{:016x}{:016x}", d.0[0], d.0[1]);
                let path = files.get(&hex)?;
                seen.insert(hex).then_some((k, path))
            })
            .collect();
        let Some(deepest) = stored.iter().map(|(k, _)| k + 1).max() else { continue };
        let expected = recomputed_chunks(model, &prompt, deepest);
        for (k, path) in stored {
            let object = decode_object(&std::fs::read(path).unwrap()).unwrap();
            checked += 1;
            if object.kv.len() != expected[k].len()
                || object.kv.iter().zip(&expected[k]).any(|(a, b)| a.to_bits() != b.to_bits())
            {
                differ += 1;
            }
        }
    }
    (checked, differ)
}

#[test]
fn saves_are_fenced_and_without_the_fence_stored_kv_is_another_requests_and_loads_change_tokens() {
    // Guarantee "save fencing" (docs/design.md §5). A slow store (each save waits 10 ms before
    // it reads) and little KV memory: blocks are reused soon after a request lets them go. A
    // second run over the same store starts with empty KV memory, so it loads every prefix the
    // first one saved.
    let model = load(&repo().join("fixtures/hf/llama"));
    for fenced in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        let spec = format!("store = \"disk\"\npath = \"{}\"", store.display());
        let graph = offload_graph(dir.path(), "hf/llama", &spec, "3 MiB");
        let switches = TestSwitches { slow_saves_ms: 10, release_saves_early: !fenced, ..Default::default() };
        let report = run_graph(&graph, Overrides::default(), switches);
        assert_eq!(report["failed"], 0, "fenced {fenced}: {}", report["failures"]);
        assert!(report["offload"]["saved_chunks"].as_u64().unwrap() > 10, "{}", report["offload"]);
        let (checked, differ) = compare_store(dir.path(), &store, &model);
        assert!(checked > 10, "stored chunks were checked: {checked}");
        let again = run_graph(&graph, Overrides { limit: Some(20), ..Default::default() }, TestSwitches::default());
        let o = &again["offload"];
        assert!(o["offload_hit_tokens"].as_u64().unwrap() > 0, "the second run loads what the first saved: {o}");
        let mismatched = again["verify"]["mismatched"].as_u64().unwrap();
        if fenced {
            assert_eq!(differ, 0, "with the fence every stored chunk is the KV its tokens give");
            assert_eq!(report["verify"]["mismatched"], 0, "saves never change what is computed");
            assert_eq!(mismatched, 0, "and every load gives the tokens recomputing would");
        } else {
            assert!(differ > 0, "without the fence some stored chunk holds blocks another request overwrote");
            assert!(mismatched > 0, "and a request that loads one gets other tokens: {}", again["verify"]);
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
fn a_full_store_never_loses_a_request_or_a_block() {
    // Smaller than one object: every put is refused as full. Then room for about twenty chunks:
    // the store evicts all the time, so some chunks go between a rank's lookup and its load.
    for (capacity, refuses_all) in [(1, true), (20 * 33_000, false)] {
        let dir = tempfile::tempdir().unwrap();
        let spec = format!("store = \"memory\"\ncapacity_bytes = {capacity}\nmax_retries = 2");
        let graph = offload_graph(dir.path(), "hf/llama", &spec, "3 MiB");
        let report: Value = run_graph(&graph, Overrides::default(), TestSwitches::default());
        assert_exact(&report, &format!("capacity {capacity}"));
        assert_eq!(report["accounting_errors"].as_array().unwrap().len(), 0, "every block came back");
        let o = &report["offload"];
        if refuses_all {
            assert_eq!(o["saved_chunks"], 0, "{o}");
            assert!(o["dropped_saves"].as_u64().unwrap() > 0, "{o}");
            assert_eq!(o["loads"], 0, "{o}");
        } else {
            assert!(o["saved_chunks"].as_u64().unwrap() > 20, "it keeps storing as it evicts: {o}");
        }
    }
}

#[test]
fn recurrent_families_reuse_prefixes_from_the_store_with_the_state_at_their_end() {
    for model in ["hf/kimi_linear", "hf/qwen3_next_gdn"] {
        let dir = tempfile::tempdir().unwrap();
        let spec = format!("store = \"disk\"\npath = \"{}\"", dir.path().join("store").display());
        let graph = offload_graph(dir.path(), model, &spec, "16 MiB");
        // Their chunks carry the state at their end: the chunk size must be a multiple of 4 blocks
        // of 16 (the snapshot interval).
        let out = crate::common::kvflow(&["run", &graph.to_string_lossy()]);
        crate::common::assert_clean_failure(&out, &["offload.chunk_tokens", "multiple of", "(64)"]);
        let text = std::fs::read_to_string(&graph).unwrap();
        std::fs::write(&graph, text.replace(&format!("chunk_tokens = {CHUNK}\n"), "chunk_tokens = 64\n")).unwrap();
        let fewer = Overrides { limit: Some(16), ..Default::default() };
        let first = run_graph(&graph, fewer.clone(), TestSwitches::default());
        assert_exact(&first, model);
        assert!(first["offload"]["saved_chunks"].as_u64().unwrap() > 0, "{model}: {}", first["offload"]);
        // Empty KV memory: the second run's prefixes come from the store, KV and state together.
        let second = run_graph(&graph, fewer, TestSwitches::default());
        assert_exact(&second, model);
        let o = &second["offload"];
        assert!(o["loaded_chunks"].as_u64().unwrap() > 0, "{model}: {o}");
        assert!(o["offload_hit_tokens"].as_u64().unwrap() >= 64, "{model}: {o}");
        assert_eq!(o["failed_loads"], 0, "{model}: {o}");
    }
}

/// A Mooncake trace of `(timestamp ms, hash ids)` requests (16 tokens per hash id once scaled by
/// the graphs' `block_tokens = 16`), written into `dir`.
fn write_trace(dir: &Path, requests: &[(u64, &[u64])]) -> PathBuf {
    let lines: Vec<String> = requests
        .iter()
        .map(|(at, ids)| {
            let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
            format!(
                "{{\"timestamp\": {at}, \"input_length\": {}, \"output_length\": 100, \"hash_ids\": [{}]}}",
                ids.len() * 512,
                ids.join(", ")
            )
        })
        .collect();
    let path = dir.join("trace.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// Summed over `report`'s ranks: `field` of rank_stats.
fn ranks_sum(report: &Value, field: &str) -> u64 {
    report["rank_stats"].as_array().unwrap().iter().map(|r| r[field].as_u64().unwrap()).sum()
}

/// A one-rank pool over a disk store at `dir/store`, replaying `trace` at its timestamps.
fn disk_graph(dir: &Path, model: &str, trace: &Path, chunk: usize) -> PathBuf {
    let pools = format!(
        "[[pool]]\nname = \"main\"\nranks = 1\n\n[offload]\nstore = \"disk\"\npath = \"{}\"\nchunk_tokens = {chunk}\n",
        dir.join("store").display()
    );
    let workload = "mode = \"timestamps\"\ntime_scale = 1.0";
    write_graph_with(dir, model, &trace.to_string_lossy(), workload, "8 MiB", &pools)
}

#[test]
fn a_restarted_run_loads_its_prefixes_from_disk_and_publishes_them_in_hbm() {
    // Guarantee "restored prefixes published" (docs/design.md §5). Request A (112 tokens:
    // chunks 0-2 of 32 are full) and, a second later, C (80 tokens) share their first 64 tokens.
    let dir = tempfile::tempdir().unwrap();
    let trace = write_trace(dir.path(), &[(0, &[1, 2, 3, 4, 5, 6, 7]), (1000, &[1, 2, 3, 4, 9])]);
    let graph = disk_graph(dir.path(), "hf/llama", &trace, 32);
    let first = run_graph(&graph, Overrides::default(), TestSwitches::default());
    assert_exact(&first, "first run");
    assert_eq!(first["offload"]["loads"], 0, "an empty store: {}", first["offload"]);
    assert_eq!(first["offload"]["hbm_hit_tokens"], 64, "C reuses A's blocks: {}", first["offload"]);
    // A second process over the same folder: its KV memory starts empty.
    let second = run_graph(&graph, Overrides::default(), TestSwitches::default());
    assert_exact(&second, "second run");
    let o = &second["offload"];
    assert_eq!((o["loads"].as_u64(), o["offload_hit_tokens"].as_u64()), (Some(1), Some(96)), "A loads 3 chunks: {o}");
    assert_eq!(o["hbm_hit_tokens"], 64, "C hits A's restored blocks in HBM: {o}");
    assert_eq!(o["failed_loads"], 0);
    assert!(o["load_gb_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(
        ranks_sum(&first, "forward_tokens") - ranks_sum(&second, "forward_tokens"),
        96,
        "the loaded tokens are not recomputed"
    );
    // Without publication, C finds nothing in HBM and loads the prefix again.
    let switches = TestSwitches { skip_publishing_restored: true, ..Default::default() };
    let unpublished = run_graph(&graph, Overrides::default(), switches);
    assert_exact(&unpublished, "unpublished");
    let o = &unpublished["offload"];
    assert_eq!((o["loads"].as_u64(), o["hbm_hit_tokens"].as_u64()), (Some(2), Some(0)), "C loads again: {o}");
    // Cancelled while its load is in flight: nothing it held is left, and C loads instead.
    let switches =
        TestSwitches { slow_loads_ms: 300, cancel_at_stage: vec![(0, "loading".to_string())], ..Default::default() };
    let cancelled = run_graph(&graph, Overrides::default(), switches);
    assert_eq!(cancelled["cancelled"], 1, "A is cancelled: {cancelled}");
    assert_eq!(cancelled["verify"]["mismatched"], 0);
    assert_eq!(cancelled["offload"]["stale_loads"], 1, "its load's completion finds it gone: {}", cancelled["offload"]);
    assert_eq!(cancelled["offload"]["loads"], 2, "{}", cancelled["offload"]);
    assert_eq!(cancelled["accounting_errors"].as_array().unwrap().len(), 0);
}

#[test]
fn a_prefix_saved_by_one_rank_is_loaded_by_another_rank_and_by_another_pool_while_they_step() {
    // Pool a (2 ranks, round-robin) and pool b (1 rank) share one store; requests alternate
    // between the pools. Request 0 (pool a, rank 0) saves the 64-token prefix; request 2 (pool
    // a, rank 1) and request 3 (pool b) find none of it in their KV memory and load it — slowly
    // (200 ms), while pool b decodes request 1.
    let dir = tempfile::tempdir().unwrap();
    let long: Vec<u64> = (100..120).collect();
    let trace = write_trace(
        dir.path(),
        &[(0, &[1, 2, 3, 4, 5, 6]), (800, &long), (805, &[1, 2, 3, 4, 8, 9]), (810, &[1, 2, 3, 4, 7])],
    );
    let pools = format!(
        "[[pool]]\nname = \"a\"\nranks = 2\nrouter = \"round-robin\"\n\n[[pool]]\nname = \"b\"\nranks = 1\n\n\
         [offload]\nstore = \"memory\"\nchunk_tokens = {CHUNK}\n"
    );
    let workload = "mode = \"timestamps\"\ntime_scale = 1.0\npool_choice = \"round-robin\"";
    let graph = write_graph_with(dir.path(), "hf/qwen3", &trace.to_string_lossy(), workload, "8 MiB", &pools);
    let longer = Overrides { max_output_tokens: Some(80), ..Default::default() };
    let report = run_graph(&graph, longer, TestSwitches { slow_loads_ms: 200, ..Default::default() });
    assert_exact(&report, "two pools");
    let rank = |pool: &str, rank: u64| -> Value {
        let ranks = report["rank_stats"].as_array().unwrap();
        ranks.iter().find(|r| r["pool"] == pool && r["rank"] == rank).unwrap().clone()
    };
    let (saver, other_rank, other_pool) = (rank("a", 0), rank("a", 1), rank("b", 0));
    assert!(saver["saved_chunks"].as_u64().unwrap() >= 2, "{saver}");
    assert_eq!(saver["loaded_chunks"], 0, "{saver}");
    for loader in [&other_rank, &other_pool] {
        assert_eq!(loader["loaded_chunks"], 2, "{loader}");
        assert_eq!(loader["offload_hit_tokens"], 64, "{loader}");
    }
    let b = &report["pools"]["b"]["offload"];
    assert_eq!(b["loads"], 1, "{b}");
    assert!(b["steps_during_loads"].as_u64().unwrap() > 0, "pool b decodes request 1 while it loads: {b}");
}

#[test]
fn damaged_objects_are_misses_and_their_requests_recompute() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let spec = format!("store = \"disk\"\npath = \"{}\"", store.display());
    let graph = offload_graph(dir.path(), "hf/llama", &spec, "8 MiB");
    let fewer = Overrides { limit: Some(16), ..Default::default() };
    let first = run_graph(&graph, fewer.clone(), TestSwitches::default());
    assert_exact(&first, "first run");
    // Every object damaged: one in three truncated, the others with a flipped byte.
    let mut files: Vec<PathBuf> = std::fs::read_dir(&store).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    assert!(files.len() > 10, "{} objects", files.len());
    for (i, f) in files.iter().enumerate() {
        let mut bytes = std::fs::read(f).unwrap();
        if i % 3 == 0 {
            bytes.truncate(bytes.len() / 2);
        } else {
            let middle = bytes.len() / 2;
            bytes[middle] ^= 0x40;
        }
        std::fs::write(f, bytes).unwrap();
    }
    let second = run_graph(&graph, fewer, TestSwitches::default());
    assert_exact(&second, "over a damaged store");
    let o = &second["offload"];
    assert!(o["failed_loads"].as_u64().unwrap() > 0, "{o}");
    assert_eq!(o["loaded_chunks"], 0, "no damaged chunk is ever loaded: {o}");
    assert_eq!(second["accounting_errors"].as_array().unwrap().len(), 0);
}

#[test]
fn a_prefill_pool_loads_its_prefixes_from_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let pools = format!(
        "[[pool]]\nname = \"prefill\"\nrole = \"prefill\"\nranks = 1\n\n\
         [[pool]]\nname = \"decode\"\nrole = \"decode\"\nranks = 1\n\n\
         [[link]]\nfrom = \"prefill\"\nto = \"decode\"\nbackend = \"inproc\"\n\n\
         [offload]\nstore = \"disk\"\npath = \"{}\"\nchunk_tokens = 64\n",
        dir.path().join("store").display()
    );
    let workload = "mode = \"concurrency\"\nconcurrency = 4\nlimit = 12";
    let graph =
        write_graph_with(dir.path(), "hf/kimi_linear", "mooncake_conversation_head.jsonl", workload, "16 MiB", &pools);
    let first = run_graph(&graph, Overrides::default(), TestSwitches::default());
    assert_exact(&first, "first P/D run");
    assert!(first["pools"]["prefill"]["offload"]["saved_chunks"].as_u64().unwrap() > 0, "{}", first["offload"]);
    let second = run_graph(&graph, Overrides::default(), TestSwitches::default());
    assert_exact(&second, "second P/D run");
    let o = &second["pools"]["prefill"]["offload"];
    assert!(o["offload_hit_tokens"].as_u64().unwrap() > 0, "the producer loads: {o}");
    assert!(second["handoff"]["count"].as_u64().unwrap() > 0, "{}", second["handoff"]);
}

/// `kvflow run graph --verify` with `args` after it; the run's output and its report (if any).
fn run_cli(graph: &Path, args: &[&str]) -> (std::process::Output, Option<Value>) {
    let graph_arg = graph.to_string_lossy().to_string();
    let mut all = vec!["run", &graph_arg, "--verify"];
    all.extend_from_slice(args);
    let out = crate::common::kvflow(&all);
    let report = std::fs::read_to_string(graph.parent().unwrap().join("out/report.json"))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok());
    (out, report)
}

#[test]
fn a_rank_that_gives_back_loaded_prefixes_schedules_again_over_a_warm_store() {
    // Issue 39 §1b. A disk store an earlier run filled; then every request released at once
    // (concurrency above the count) to a one-rank pool of little KV memory: the loads of the
    // waiting requests' prefixes take the blocks the head of the queue needs, nothing can run,
    // and the rank gives the loaded prefixes back. Nothing else will ever wake it (no step, save
    // or load in flight, no request left to arrive): it must decide its step again at once.
    let dir = tempfile::tempdir().unwrap();
    let pools = format!(
        "[[pool]]\nname = \"main\"\nranks = 1\n\n[offload]\nstore = \"disk\"\npath = \"{}\"\nchunk_tokens = {CHUNK}\n",
        dir.path().join("store").display()
    );
    let workload = "mode = \"concurrency\"\nconcurrency = 64\nwarmup = 8\nlimit = 8";
    let graph =
        write_graph_with(dir.path(), "hf/llama", "mooncake_conversation_first5min.jsonl", workload, "4 MiB", &pools);
    let (fill, report) = run_cli(&graph, &["--stall-timeout", "20"]);
    assert!(fill.status.success(), "the run filling the store: {}", String::from_utf8_lossy(&fill.stderr));
    assert_exact(&report.unwrap(), "the run filling the store");
    // Whether a run gives prefixes back depends on when its loads complete: most do.
    let gave_back = |stderr: &str| stderr.contains("give back the prefixes they loaded");
    let pressure = ["--stall-timeout", "4"];
    let mut runs_giving_back = 0;
    for run in 0..3 {
        let (out, report) = run_cli(&graph, &pressure);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "run {run} over the warm store: {stderr}");
        let report = report.unwrap();
        assert_exact(&report, &format!("run {run} over the warm store"));
        assert!(report["offload"]["loads"].as_u64().unwrap() > 0, "run {run} loads: {}", report["offload"]);
        runs_giving_back += usize::from(gave_back(&stderr));
    }
    assert!(runs_giving_back > 0, "no run was short of memory: the test no longer tests anything");
    // Without the second pass a rank that gives prefixes back parks with its memory free,
    // until the watchdog ends the run.
    let mut unfixed = pressure.to_vec();
    unfixed.extend(["--test-switch", "no-reschedule-after-giving-back-prefixes"]);
    let mut stalled = 0;
    for _ in 0..3 {
        let (out, report) = run_cli(&graph, &unfixed);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !gave_back(&stderr) {
            assert!(out.status.success(), "a run that gives nothing back is not stuck: {stderr}");
            continue;
        }
        assert_eq!(out.status.code(), Some(3), "without the second pass the rank stalls: {stderr}");
        assert!(stderr.contains("stall") && stderr.contains("`admit` on rank 0"), "{stderr}");
        assert_eq!(report.unwrap()["stalled"], true);
        stalled += 1;
        break;
    }
    assert_eq!(stalled, 1, "no run without the second pass gave prefixes back");
}

#[test]
fn a_store_folder_that_cannot_be_written_is_found_before_serving() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("store");
    std::fs::create_dir(&folder).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&folder, std::fs::Permissions::from_mode(0o555)).unwrap();
    // Root writes into a read-only folder anyway: then sysfs's /sys/kernel, which nobody can
    // write files into, stands in for it.
    let unwritable = match std::fs::File::create(folder.join("probe")) {
        Ok(_) => PathBuf::from("/sys/kernel"),
        Err(_) => folder.clone(),
    };
    let spec = format!("store = \"disk\"\npath = \"{}\"", unwritable.display());
    let graph = offload_graph(dir.path(), "hf/llama", &spec, "3 MiB");
    let started = std::time::Instant::now();
    let out = crate::common::kvflow(&["run", &graph.to_string_lossy()]);
    let shown = unwritable.display().to_string();
    crate::common::assert_clean_failure(&out, &["graph.toml", "offload.path", &shown, "cannot be written"]);
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "found only after serving");
    assert!(!dir.path().join("out/requests.jsonl").exists(), "nothing was served");
    std::fs::set_permissions(&folder, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn a_prompt_with_no_chunk_to_load_is_never_looked_up_in_the_store() {
    // Prompts of 32 tokens (one chunk: a load must leave a token to compute, so none can load)
    // against prompts of 128; all share their first trace blocks.
    for (input_length, hash_ids, looked_up) in [(1024, "0", false), (4096, "0, 1, 2, 3, 4, 5, 6", true)] {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("trace.jsonl");
        let lines: String = (0..8)
            .map(|i| {
                format!(
                    "{{\"timestamp\": {i}, \"input_length\": {input_length}, \"output_length\": 4, \"hash_ids\": [{hash_ids}, {}]}}\n",
                    100 + i
                )
            })
            .collect();
        std::fs::write(&trace, lines).unwrap();
        let pools =
            format!("[[pool]]\nname = \"main\"\nranks = 1\n\n[offload]\nstore = \"memory\"\nchunk_tokens = {CHUNK}\n");
        let workload = "mode = \"concurrency\"\nconcurrency = 2\nlimit = 8";
        let graph = write_graph_with(dir.path(), "hf/llama", &trace.to_string_lossy(), workload, "3 MiB", &pools);
        let report = run_graph(&graph, Overrides::default(), TestSwitches::default());
        assert_exact(&report, &format!("{input_length}-token trace prompts"));
        let o = &report["offload"];
        assert_eq!(o["store_lookups"].as_u64().unwrap() > 0, looked_up, "{input_length}: {o}");
    }
}

#[test]
fn an_offload_chunk_longer_than_the_context_is_refused() {
    // 16384 tokens is a multiple of the block size and below 2^24, but the llama fixture's
    // context is 8192 positions: no prompt could fill a chunk, and the run would save nothing.
    let dir = tempfile::tempdir().unwrap();
    let graph = offload_graph(dir.path(), "hf/llama", "store = \"memory\"", "3 MiB");
    let text = std::fs::read_to_string(&graph).unwrap();
    std::fs::write(&graph, text.replace(&format!("chunk_tokens = {CHUNK}\n"), "chunk_tokens = 16384\n")).unwrap();
    let out = crate::common::kvflow(&["run", &graph.to_string_lossy()]);
    crate::common::assert_clean_failure(&out, &["graph.toml", "offload.chunk_tokens", "16384", "8192 positions"]);
}

#[test]
fn dropped_saves_are_logged_a_few_times_then_counted() {
    // A store smaller than one object refuses every save: each rank logs its first three drops,
    // then one count at the end of the run, not a line per chunk.
    let dir = tempfile::tempdir().unwrap();
    let graph =
        offload_graph(dir.path(), "hf/llama", "store = \"memory\"\ncapacity_bytes = 1\nmax_retries = 0", "3 MiB");
    let out = crate::common::kvflow(&["run", &graph.to_string_lossy(), "--limit", "16"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report = crate::common::report(dir.path());
    let dropped = report["offload"]["dropped_saves"].as_u64().unwrap();
    assert!(dropped > 20, "every save is dropped: {}", report["offload"]);
    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("offload:") && l.contains("dropped")).collect();
    assert!(
        lines.len() <= 2 * 5,
        "a rank logs at most three drops, that it counts the rest, and the count: {} lines of {dropped} drops",
        lines.len()
    );
    let counted: u64 = lines
        .iter()
        .filter_map(|l| {
            l.split("offload: ").last()?.split(" saves dropped on this rank in all").next()?.parse::<u64>().ok()
        })
        .sum();
    // A rank that dropped three or fewer logged each and gives no count.
    assert!(counted <= dropped && counted + 2 * 3 >= dropped, "the counts at the end add up to {dropped}: {lines:#?}");
    assert!(stderr.contains("further dropped saves on this rank are counted"), "{stderr}");
}
