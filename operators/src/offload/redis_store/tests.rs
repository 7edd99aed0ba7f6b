//! The shared store against a real `redis-server` of this machine (skipped, saying so, where none
//! is installed; `KVFLOW_REQUIRE_REDIS` makes that a failure, as CI sets it).

use super::super::{chunk_digests, encode_object, ChunkKey, ChunkObject, Namespace, ObjectStore, StoreError};
use super::{LocalRedis, RedisConfig, RedisStore};
use std::time::{Duration, Instant};

fn server(args: &[&str]) -> Option<LocalRedis> {
    LocalRedis::start_or_skip(args)
}

fn store(server: &LocalRedis, lease_ms: u64) -> RedisStore {
    let config = RedisConfig {
        url: server.url(),
        password: None,
        lease: Duration::from_millis(lease_ms),
        timeout: Duration::from_millis(300),
    };
    RedisStore::open(config).unwrap()
}

fn keys(facts: &[(&str, &str)], n: usize) -> Vec<ChunkKey> {
    let ns = Namespace::of(facts);
    chunk_digests(&(0..8 * n as u32).collect::<Vec<u32>>(), 8, 0)
        .into_iter()
        .map(|digest| ChunkKey { namespace: ns, shard: 0, shards: 1, digest })
        .collect()
}

fn object(i: usize) -> Vec<u8> {
    encode_object(&ChunkObject { kv: vec![i as f32; 64], state: Some(vec![0.5; 3]) })
}

/// Waits up to 5 s for `cond` (the tail polls every 100 ms).
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let started = Instant::now();
    while !cond() {
        assert!(started.elapsed() < Duration::from_secs(5), "not within 5 s: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn raw(server: &LocalRedis) -> redis::Connection {
    redis::Client::open(server.url()).unwrap().get_connection().unwrap()
}

#[test]
fn another_process_finds_what_one_published_and_namespaces_stay_apart() {
    let Some(server) = server(&[]) else { return };
    let (a, b) = (store(&server, 60_000), store(&server, 60_000));
    let rope1 = keys(&[("model", "m"), ("rope_scaling", "linear 2")], 3);
    let rope2 = keys(&[("model", "m"), ("rope_scaling", "none")], 3);
    for (i, k) in rope1.iter().enumerate() {
        a.put(k, &object(i)).unwrap();
    }
    assert!(rope1.iter().all(|k| a.contains(k)), "the publisher knows at once");
    eventually("the other store's index learns of them from the log", || rope1.iter().all(|k| b.contains(k)));
    assert_eq!(b.get_object(&rope1[2]).unwrap().unwrap().kv[0], 2.0);
    assert!(rope2.iter().all(|k| !b.contains(k) && b.get(k).unwrap().is_none()), "another namespace reads nothing");
    // A third store opened now reads the log from its start.
    let c = store(&server, 60_000);
    assert!(rope1.iter().all(|k| c.contains(k)));
    assert_eq!(c.bytes(), 3 * object(0).len() as u64);
}

#[test]
fn a_torn_or_damaged_chunk_is_a_miss_never_bytes() {
    let Some(server) = server(&[]) else { return };
    let s = store(&server, 60_000);
    let k = keys(&[("model", "torn")], 4);
    let mut con = raw(&server);
    // Data without a manifest: never published, never read.
    redis::cmd("SET").arg(k[0].to_string()).arg(object(0)).query::<()>(&mut con).unwrap();
    assert!(!s.contains(&k[0]));
    assert_eq!(s.get(&k[0]).unwrap(), None);
    // A manifest without its data (the data went): a miss, forgotten by the index.
    s.put(&k[1], &object(1)).unwrap();
    redis::cmd("DEL").arg(k[1].to_string()).query::<()>(&mut con).unwrap();
    assert_eq!(s.get_object(&k[1]).unwrap(), None);
    assert!(!s.contains(&k[1]), "the index forgets a chunk a load missed");
    // A corrupted value.
    s.put(&k[2], &object(2)).unwrap();
    redis::cmd("SETRANGE").arg(k[2].to_string()).arg(40).arg("garbage").query::<()>(&mut con).unwrap();
    assert_eq!(s.get_object(&k[2]).unwrap(), None);
    // A value that is not an object from its first bytes: refused there, the rest of it drained,
    // so the connection reads the next load's replies in step.
    redis::cmd("SETRANGE").arg(k[2].to_string()).arg(0).arg("X").query::<()>(&mut con).unwrap();
    assert_eq!(s.get_object(&k[2]).unwrap(), None);
    s.put(&k[3], &object(3)).unwrap();
    assert_eq!(s.get_object(&k[3]).unwrap().map(|o| o.kv[0]), Some(3.0));
    let f = s.faults();
    assert_eq!((f.missing, f.damaged), (2, 2), "{f:?}");
}

#[test]
fn leases_expire_unless_a_load_renews_them_and_only_the_chunks_it_read() {
    let Some(server) = server(&[]) else { return };
    let s = store(&server, 600);
    let k = keys(&[("model", "lease")], 2);
    s.put(&k[0], &object(0)).unwrap();
    s.put(&k[1], &object(1)).unwrap();
    let mut con = raw(&server);
    std::thread::sleep(Duration::from_millis(350));
    assert!(s.get_object(&k[0]).unwrap().is_some());
    let pttl: i64 = redis::cmd("PTTL").arg(k[0].to_string()).query(&mut con).unwrap();
    assert!(pttl > 450, "the load renewed chunk 0's lease (PTTL {pttl} ms)");
    let pttl: i64 = redis::cmd("PTTL").arg(format!("{}#m", k[0])).query(&mut con).unwrap();
    assert!(pttl > 450, "and its manifest's (PTTL {pttl} ms)");
    let pttl: i64 = redis::cmd("PTTL").arg(k[1].to_string()).query(&mut con).unwrap();
    assert!(pttl < 300, "chunk 1 was not read: its lease runs on (PTTL {pttl} ms)");
    std::thread::sleep(Duration::from_millis(400));
    assert!(s.contains(&k[0]) && s.get(&k[0]).unwrap().is_some(), "renewed: still held");
    assert!(!s.contains(&k[1]), "expired in the index");
    assert_eq!(s.get(&k[1]).unwrap(), None, "and in the store");
    assert_eq!(s.evicted_since(0).1.unwrap(), vec![k[1]], "the routing index hears of the expiry");
}

#[test]
fn a_restarted_or_flushed_store_is_trusted_for_nothing_it_held() {
    let Some(mut server) = server(&[]) else { return };
    let s = store(&server, 60_000);
    let k = keys(&[("model", "restart")], 2);
    s.put(&k[0], &object(0)).unwrap();
    server.restart().unwrap();
    eventually("the restart is seen", || s.generation() == 1);
    assert!(!s.contains(&k[0]));
    assert_eq!(s.evicted_since(0).1.unwrap(), vec![k[0]]);
    s.put(&k[1], &object(1)).unwrap();
    assert!(s.contains(&k[1]) && s.get(&k[1]).unwrap().is_some(), "what is saved after the restart counts");
    redis::cmd("FLUSHALL").query::<()>(&mut raw(&server)).unwrap();
    eventually("the flush is seen", || s.generation() == 2);
    assert!(!s.contains(&k[1]));
    assert_eq!(s.faults().restarts, 2);
    // A chunk written to an earlier run of the server (its manifest's run id) is a miss, even
    // when its bytes are whole.
    let mut con = raw(&server);
    let manifest = super::Manifest::of(&object(0), "an-earlier-run").encode();
    redis::cmd("SET").arg(k[0].to_string()).arg(object(0)).query::<()>(&mut con).unwrap();
    redis::cmd("SET").arg(format!("{}#m", k[0])).arg(manifest).query::<()>(&mut con).unwrap();
    assert_eq!(s.get(&k[0]).unwrap(), None);
    assert_eq!(s.faults().damaged, 1);
    // Without the run-id check the stale chunk's bytes would be served.
    redis::cmd("SET")
        .arg(format!("{}#m", k[0]))
        .arg(super::Manifest::of(&object(0), "an-earlier-run").encode())
        .query::<()>(&mut con)
        .unwrap();
    s.trust_earlier_runs();
    assert_eq!(s.get(&k[0]).unwrap(), Some(object(0)));
}

#[test]
fn a_store_down_slow_or_full_drops_saves_misses_loads_and_comes_back() {
    let Some(mut server) = server(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]) else { return };
    let s = store(&server, 60_000);
    let k = keys(&[("model", "faults")], 4);
    s.put(&k[0], &object(0)).unwrap();
    // Full: an object larger than the server's memory.
    let big = encode_object(&ChunkObject { kv: vec![1.0; 1 << 20], state: None });
    assert!(matches!(s.put(&k[1], &big), Err(StoreError::Full(_))));
    assert_eq!(s.faults().full, 1);
    // Slow: a stopped server answers nothing within timeout_ms.
    server.pause(true);
    let started = Instant::now();
    assert!(s.get(&k[0]).unwrap().is_none());
    assert!(started.elapsed() < Duration::from_secs(2), "a slow store costs about timeout_ms, not more");
    assert!(!s.contains(&k[0]), "no load starts while the store is down: {:?}", s.faults());
    assert!(s.put(&k[2], &object(2)).is_err());
    assert!(s.faults().timeouts >= 1, "{:?}", s.faults());
    server.pause(false);
    eventually("the store is reachable again", || s.contains(&k[0]));
    // Down: a killed server refuses connections.
    server.kill();
    eventually("the tail sees it down", || !s.contains(&k[0]));
    assert!(s.put(&k[3], &object(3)).is_err() && s.get(&k[0]).unwrap().is_none());
    assert!(s.faults().down >= 1, "{:?}", s.faults());
    server.restart().unwrap();
    eventually("saves work again once it is back", || s.put(&k[3], &object(3)).is_ok());
    assert!(s.contains(&k[3]));
}

#[test]
fn a_load_reads_over_its_wire_what_the_crate_reads_with_a_password_and_a_database() {
    let Some(server) = server(&["--requirepass", "kv-secret"]) else { return };
    let url = format!("redis://127.0.0.1:{}/3", server.port);
    let config = RedisConfig {
        url: url.clone(),
        password: Some("kv-secret".into()),
        lease: Duration::from_secs(60),
        timeout: Duration::from_secs(5),
    };
    let store = RedisStore::open(config).unwrap();
    let key = keys(&[("model", "wire")], 1)[0];
    let object = encode_object(&ChunkObject { kv: (0..300_000).map(|i| i as f32 * 0.25).collect(), state: None });
    store.put(&key, &object).unwrap();
    assert_eq!(store.get(&key).unwrap().as_deref(), Some(&object[..]), "the wire logged in and selected database 3");
    let client = redis::Client::open(format!("redis://:kv-secret@127.0.0.1:{}/3", server.port)).unwrap();
    let through_crate: Vec<u8> =
        redis::cmd("GET").arg(key.to_string()).query(&mut client.get_connection().unwrap()).unwrap();
    assert_eq!(through_crate, object);
    let info = client.get_connection_info();
    let mut wire = super::wire::Wire::connect(info, Duration::from_secs(5)).unwrap();
    let mut pipe = redis::pipe();
    pipe.get(key.to_string()).get("no such key").cmd("NO-SUCH-COMMAND");
    let replies = wire.round_trip(&pipe.get_packed_pipeline(), pipe.len()).unwrap();
    assert_eq!(replies[0], super::wire::Reply::Bytes(object.clone()));
    assert_eq!(replies[1], super::wire::Reply::Nil);
    assert!(matches!(&replies[2], super::wire::Reply::Error(e) if e.contains("unknown command")), "{:?}", replies[2]);
    // A load reads the same through the crate (the path of a TLS store) as over its wire.
    let pipe = super::load_pipe(&key.to_string(), 60_000);
    let (wired, through_crate) = (store.shared.read(&pipe).unwrap(), store.shared.read_through_crate(&pipe).unwrap());
    assert!(matches!(&wired.object, Some(Ok((o, len, _))) if *len == object.len() as u64 && o.kv[3] == 0.75));
    assert_eq!((wired.manifest, wired.object), (through_crate.manifest, through_crate.object));
    let wrong = redis::Client::open(format!("redis://:wrong@127.0.0.1:{}/3", server.port)).unwrap();
    assert!(
        super::wire::Wire::connect(wrong.get_connection_info(), Duration::from_secs(5)).is_err(),
        "a wrong password is refused"
    );
}
