//! `kvflow bench offload`: saving and loading chunk objects through each store, beside the plain
//! operation on the same bytes, measured in the same run. A save is what the save thread does
//! after reading a chunk's blocks: encode the object (magic, lengths, floats, CRC32C) and put it;
//! a load is `get_object` (the object read and decoded, checksum checked; the disk store reads
//! the file straight into the floats). The memory store is set beside a copy of the
//! same bytes into fresh buffers (what a put and a get each must do at least once); the disk
//! store beside writing the same bytes to files with one `write_all` and `sync_data` each (save)
//! and reading them back (load). Each figure is the median of
//! `--rounds` rounds, the two ways taking turns within a round; each ratio is the median of the
//! rounds' own ratios. Target ≥ 0.7.

use super::median;
use anyhow::{Context, Result};
use kvflow_operators::offload::{
    chunk_digests, encode_object, ChunkKey, ChunkObject, DiskStore, MemoryStore, Namespace, ObjectStore,
};
use std::io::Write;
use std::time::Instant;

/// The largest chunk object `--chunk-bytes` takes: a chunk of 2^24 tokens (the graphs' bound on
/// a token count) of a small model's KV is far below it, and the bench holds several copies.
pub const MAX_CHUNK_BYTES: u64 = 1 << 30;

/// The most bytes of chunks one round may hold (`--chunk-bytes` × `--chunks`): the bench keeps
/// about five copies of them (the objects, the memory store's, encoded ones, plain files' bytes).
pub const MAX_ROUND_BYTES: u64 = 4 << 30;

/// `--chunk-bytes`: a size (`4 MiB`, `4194304`) from 4 bytes (one float) to [`MAX_CHUNK_BYTES`].
pub fn chunk_bytes(text: &str) -> Result<usize, String> {
    let bytes = crate::graph::parse_byte_size(text)?;
    if !(4..=MAX_CHUNK_BYTES).contains(&bytes) {
        return Err(format!("expected from 4 bytes to {} MiB per chunk, got {bytes} bytes", MAX_CHUNK_BYTES >> 20));
    }
    Ok(bytes as usize)
}

pub struct OffloadBenchArgs {
    /// Bytes of KV per chunk object.
    pub chunk_bytes: usize,
    /// Chunks per round.
    pub chunks: usize,
    pub rounds: usize,
    /// Folder for the disk store and its baseline (default: a temporary folder).
    pub dir: Option<std::path::PathBuf>,
}

/// (save GB/s, load GB/s) through `store` for `objects`.
fn through(store: &dyn ObjectStore, keys: &[ChunkKey], objects: &[ChunkObject]) -> Result<(f64, f64)> {
    let bytes: usize = objects.iter().map(|o| o.kv.len() * 4).sum();
    let started = Instant::now();
    for (k, o) in keys.iter().zip(objects) {
        store.put(k, &encode_object(o)).map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let save = bytes as f64 / started.elapsed().as_secs_f64() / 1e9;
    let started = Instant::now();
    let mut floats = 0usize;
    for k in keys {
        let object =
            store.get_object(k).map_err(|e| anyhow::anyhow!("{e}"))?.context("a chunk just stored is missing")?;
        floats += object.kv.len();
    }
    let load = bytes as f64 / started.elapsed().as_secs_f64() / 1e9;
    anyhow::ensure!(floats * 4 == bytes, "loaded {} of {bytes} bytes", floats * 4);
    Ok((save, load))
}

/// GB/s of copying every object's bytes once into a fresh buffer (the memory store's baseline).
fn memcpy(objects: &[ChunkObject]) -> f64 {
    let bytes: usize = objects.iter().map(|o| o.kv.len() * 4).sum();
    let started = Instant::now();
    let copies: Vec<Vec<f32>> = objects.iter().map(|o| o.kv.clone()).collect();
    let secs = started.elapsed().as_secs_f64();
    std::hint::black_box(copies);
    bytes as f64 / secs / 1e9
}

/// (write GB/s, read GB/s) of plain files holding the same bytes (the disk store's baseline).
fn plain_files(dir: &std::path::Path, objects: &[ChunkObject]) -> Result<(f64, f64)> {
    let bytes: usize = objects.iter().map(|o| o.kv.len() * 4).sum();
    let raw: Vec<Vec<u8>> = objects.iter().map(|o| o.kv.iter().flat_map(|v| v.to_le_bytes()).collect()).collect();
    let started = Instant::now();
    for (i, r) in raw.iter().enumerate() {
        let mut f = std::fs::File::create(dir.join(format!("plain-{i}")))?;
        f.write_all(r)?;
        f.sync_data()?;
    }
    let write = bytes as f64 / started.elapsed().as_secs_f64() / 1e9;
    let started = Instant::now();
    let mut got = 0;
    for i in 0..raw.len() {
        got += std::fs::read(dir.join(format!("plain-{i}")))?.len();
    }
    let read = bytes as f64 / started.elapsed().as_secs_f64() / 1e9;
    anyhow::ensure!(got == bytes, "read {got} of {bytes} bytes");
    Ok((write, read))
}

pub fn run(args: &OffloadBenchArgs) -> Result<()> {
    anyhow::ensure!(
        args.chunk_bytes >= 4 && args.chunks > 0 && args.rounds > 0,
        "--chunk-bytes ≥ 4, --chunks and --rounds ≥ 1"
    );
    let round_bytes = (args.chunk_bytes as u64).saturating_mul(args.chunks as u64);
    anyhow::ensure!(
        round_bytes <= MAX_ROUND_BYTES,
        "--chunk-bytes {} × --chunks {} is {} MiB a round; expected at most {} MiB (the bench holds several copies \
         of a round's chunks in memory): lower either",
        args.chunk_bytes,
        args.chunks,
        round_bytes >> 20,
        MAX_ROUND_BYTES >> 20
    );
    let floats = args.chunk_bytes / 4;
    let objects: Vec<ChunkObject> = (0..args.chunks)
        .map(|c| ChunkObject { kv: (0..floats).map(|i| ((i * 31 + c) % 997) as f32 * 1e-3).collect(), state: None })
        .collect();
    let ns = Namespace::of(&[("bench", "offload")]);
    let tokens: Vec<u32> = (0..args.chunks as u32 * 4).collect();
    let keys: Vec<ChunkKey> = chunk_digests(&tokens, 4, 0)
        .into_iter()
        .map(|digest| ChunkKey { namespace: ns, shard: 0, shards: 1, digest })
        .collect();
    let temp = std::env::temp_dir().join(format!("kvflow-bench-offload-{}", std::process::id()));
    let dir = args.dir.clone().unwrap_or(temp);
    let total = args.chunk_bytes * args.chunks;
    println!(
        "offload      {} chunks of {} KiB ({} MiB a round), {} rounds; disk store in {}",
        args.chunks,
        args.chunk_bytes >> 10,
        total >> 20,
        args.rounds,
        dir.display()
    );
    let (mut rows, mut ratios): (Vec<[f64; 8]>, Vec<[f64; 4]>) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let memory = MemoryStore::new(2 * total as u64 + (1 << 20));
        let (m_save, m_load) = through(&memory, &keys, &objects)?;
        let copy = memcpy(&objects);
        let store_dir = dir.join(format!("store-{round}"));
        let plain_dir = dir.join(format!("plain-{round}"));
        std::fs::create_dir_all(&plain_dir).with_context(|| format!("cannot create {}", plain_dir.display()))?;
        let disk = DiskStore::open(&store_dir).map_err(|e| anyhow::anyhow!("{e}"))?;
        let (d_save, d_load) = through(&disk, &keys, &objects)?;
        let (f_write, f_read) = plain_files(&plain_dir, &objects)?;
        let _ = std::fs::remove_dir_all(&store_dir);
        let _ = std::fs::remove_dir_all(&plain_dir);
        rows.push([m_save, m_load, copy, d_save, d_load, f_write, f_read, 0.0]);
        ratios.push([m_save / copy, m_load / copy, d_save / f_write, d_load / f_read]);
    }
    if args.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let col = |i: usize| median(rows.iter().map(|r| r[i]).collect());
    let ratio = |i: usize| median(ratios.iter().map(|r| r[i]).collect());
    println!("memory       save {:.2} GB/s, load {:.2} GB/s; memcpy {:.2} GB/s", col(0), col(1), col(2));
    println!(
        "disk         save {:.2} GB/s, load {:.2} GB/s; plain file write+sync {:.2} GB/s, read {:.2} GB/s",
        col(3),
        col(4),
        col(5),
        col(6)
    );
    println!("memory_save_ratio={:.3}", ratio(0));
    println!("memory_load_ratio={:.3}", ratio(1));
    println!("disk_save_ratio={:.3}", ratio(2));
    println!("disk_load_ratio={:.3}", ratio(3));
    Ok(())
}
