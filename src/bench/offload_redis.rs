//! `kvflow bench offload --store redis`: saving and loading chunk objects through the shared
//! store, beside `redis-benchmark` SET and GET of values of the same size on the same server,
//! measured in the same run with the same number of clients (SET on distinct keys, as chunks
//! are). A save is `put` (the object and its manifest in one MULTI/EXEC with a log entry); a load
//! is `get_object` (manifest, object and the server's run id in one round trip, the checksum
//! checked, the floats decoded, then the leases renewed; over plain TCP the object is decoded as
//! its bytes arrive, `redis_store/wire.rs`). Without `--url` the bench starts its own
//! `redis-server` on loopback (`LocalRedis`). Each figure is the median of `--rounds`; each ratio
//! the median of the rounds' own ratios. Target ≥ 0.7 for loads.

use super::median;
use anyhow::{anyhow, bail, Context, Result};
use kvflow_operators::offload::{
    chunk_digests, encode_object, ChunkKey, ChunkObject, LocalRedis, Namespace, ObjectStore, RedisConfig, RedisStore,
};
use std::process::Command;
use std::time::{Duration, Instant};

pub struct RedisBenchArgs {
    pub chunk_bytes: usize,
    pub chunks: usize,
    pub rounds: usize,
    /// The server (default: one the bench starts).
    pub url: Option<String>,
    /// Threads saving and loading at once, and redis-benchmark's `-c`.
    pub clients: usize,
}

/// (save GB/s, load GB/s) with `clients` threads splitting the chunks.
fn through(
    store: &RedisStore,
    keys: &[ChunkKey],
    objects: &[Vec<u8>],
    floats: usize,
    clients: usize,
) -> Result<(f64, f64)> {
    let bytes = (objects.len() * floats * 4) as f64;
    let per = keys.len().div_ceil(clients);
    let started = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = keys
            .chunks(per)
            .zip(objects.chunks(per))
            .map(|(keys, objects)| {
                s.spawn(move || -> Result<()> {
                    for (k, o) in keys.iter().zip(objects) {
                        store.put(k, o).map_err(|e| anyhow!("saving {k}: {e}"))?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| w.join().map_err(|_| anyhow!("a saving thread panicked"))?)
    })?;
    let save = bytes / started.elapsed().as_secs_f64() / 1e9;
    let started = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = keys
            .chunks(per)
            .map(|keys| {
                s.spawn(move || -> Result<()> {
                    for k in keys {
                        let object = store
                            .get_object(k)
                            .map_err(|e| anyhow!("{e}"))?
                            .context("a chunk just saved is missing")?;
                        anyhow::ensure!(object.kv.len() == floats, "loaded {} of {floats} floats", object.kv.len());
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| w.join().map_err(|_| anyhow!("a loading thread panicked"))?)
    })?;
    let load = bytes / started.elapsed().as_secs_f64() / 1e9;
    Ok((save, load))
}

/// redis-benchmark's (SET GB/s, GET GB/s) for values of `bytes` on the server at `host:port`.
/// SET writes distinct keys (`-r`), as saves of distinct chunks do (a server that overwrites one
/// key reuses its memory, which new chunks cannot); GET reads one key it has set.
fn redis_benchmark(host: &str, port: u16, bytes: usize, requests: usize, clients: usize) -> Result<(f64, f64)> {
    let rate = |tests: &str, extra: &[&str], test: &str| -> Result<f64> {
        let out = Command::new("redis-benchmark")
            .args(["-h", host, "-p", &port.to_string(), "-t", tests, "--csv"])
            .args(["-d", &bytes.to_string(), "-n", &requests.to_string(), "-c", &clients.to_string()])
            .args(extra)
            .output()
            .context("cannot run redis-benchmark (Debian: apt-get install redis-tools)")?;
        if !out.status.success() {
            bail!("redis-benchmark failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("\"{test}\"")))
            .with_context(|| format!("redis-benchmark printed no {test} line: {text}"))?;
        let rps: f64 =
            line.split(',').nth(1).map(|v| v.trim_matches('"')).and_then(|v| v.parse().ok()).context("no rate")?;
        Ok(rps * bytes as f64 / 1e9)
    };
    Ok((rate("set", &["-r", "100000000"], "SET")?, rate("set,get", &[], "GET")?))
}

/// Host and port of a `redis://host:port/…` URL (for redis-benchmark).
fn host_port(url: &str) -> Result<(String, u16)> {
    let rest = url.strip_prefix("redis://").context("redis-benchmark takes a redis:// URL (no TLS) here")?;
    let authority = rest.split('/').next().unwrap_or("").rsplit('@').next().unwrap_or("");
    let (host, port) = authority.rsplit_once(':').unwrap_or((authority, "6379"));
    Ok((host.to_string(), port.parse().with_context(|| format!("`{port}` is not a port"))?))
}

pub fn run(args: &RedisBenchArgs) -> Result<()> {
    anyhow::ensure!(args.clients >= 1 && args.chunks >= args.clients, "--clients ≥ 1 and at most --chunks");
    let local = match &args.url {
        Some(_) => None,
        None => Some(LocalRedis::start(&[]).map_err(|e| anyhow!("--store redis without --url: {e}"))?),
    };
    let url = args.url.clone().unwrap_or_else(|| local.as_ref().expect("started").url());
    let (host, port) = host_port(&url)?;
    let store = RedisStore::open(RedisConfig {
        url: url.clone(),
        password: None,
        lease: Duration::from_secs(600),
        timeout: Duration::from_secs(30),
    })
    .map_err(|e| anyhow!("{url}: {e}"))?;
    let floats = args.chunk_bytes / 4;
    let objects: Vec<Vec<u8>> = (0..args.chunks)
        .map(|c| {
            let kv = (0..floats).map(|i| ((i * 31 + c) % 997) as f32 * 1e-3).collect();
            encode_object(&ChunkObject { kv, state: None })
        })
        .collect();
    println!(
        "redis        {} chunks of {} KiB, {} clients, {} rounds, on {url}{}",
        args.chunks,
        args.chunk_bytes >> 10,
        args.clients,
        args.rounds,
        if local.is_some() { " (started by the bench)" } else { "" }
    );
    let (mut rows, mut ratios): (Vec<[f64; 4]>, Vec<[f64; 2]>) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let ns = Namespace::of(&[("bench", "offload-redis"), ("round", &round.to_string())]);
        let tokens: Vec<u32> = (0..args.chunks as u32 * 4).collect();
        let keys: Vec<ChunkKey> = chunk_digests(&tokens, 4, 0)
            .into_iter()
            .map(|digest| ChunkKey { namespace: ns, shard: 0, shards: 1, digest })
            .collect();
        let (save, load) = through(&store, &keys, &objects, floats, args.clients)?;
        let (set, get) = redis_benchmark(&host, port, objects[0].len(), args.chunks.max(64), args.clients)?;
        rows.push([save, load, set, get]);
        ratios.push([save / set, load / get]);
        if let Some(local) = &local {
            local.flush();
        }
    }
    let col = |i: usize| median(rows.iter().map(|r| r[i]).collect());
    let ratio = |i: usize| median(ratios.iter().map(|r| r[i]).collect());
    println!(
        "redis        save {:.2} GB/s, load {:.2} GB/s; redis-benchmark SET {:.2} GB/s, GET {:.2} GB/s",
        col(0),
        col(1),
        col(2),
        col(3)
    );
    println!("redis_save_ratio={:.3}", ratio(0));
    println!("redis_load_ratio={:.3}", ratio(1));
    Ok(())
}
