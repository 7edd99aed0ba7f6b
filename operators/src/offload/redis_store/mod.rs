//! `redis`: the store shared by every process and host that names it — Redis, or Valkey (the
//! same protocol), through the `redis` crate's blocking client. What it keeps in the database:
//! - `<key>`, a chunk's object (`object.rs`), and `<key>#m`, its manifest (`manifest.rs`), both
//!   with a lease of `lease_ms`, written in one MULTI/EXEC with an entry on the log: a chunk is
//!   visible whole or not at all. A load renews the leases of the chunks it read, and only those.
//! - `kvflow1:log`, a capped stream of publications and renewals, which every process tails into
//!   its own index (`index.rs`, `tail.rs`). `contains` answers from that index and never asks the
//!   store, so an admission never waits for the network.
//! - `kvflow1:epoch`, a token the first process sets. With the server's run id it tells a restart
//!   or a flush: the index is dropped at once, and a manifest written to another run of the server
//!   is a miss.
//!
//! A store that is down, slower than `timeout_ms` or full makes saves fail (the save thread drops
//! them) and loads miss; while it is down `contains` is false, so no load is started; each kind is
//! counted and logged once (`faults.rs`), and the tail retries with a back-off.

mod connection;
mod faults;
mod index;
mod local;
mod manifest;
mod tail;
#[cfg(test)]
mod tests;
mod wire;

use super::{
    decode_object, encode_object, read_object, ChunkKey, ChunkObject, ObjectError, ObjectStore, StoreError, StoreFaults,
};
pub use connection::RedisConfig;
use connection::{log_entry, run_id, Shared};
use faults::{Failure, FaultKind, Faults};
use index::Index;
pub use local::{LocalRedis, LocalRedisError};
use manifest::Manifest;
use parking_lot::{Condvar, Mutex};
use redis::IntoConnectionInfo;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use wire::Reply;

pub struct RedisStore {
    shared: Arc<Shared>,
    tail: Option<std::thread::JoinHandle<()>>,
}

impl RedisStore {
    /// Connects to the store at `config.url` and reads its log into this process's index. A store
    /// that cannot be reached now is not an error (it may come up later: the tail retries), but a
    /// URL the client cannot use, or a password it refuses, is.
    pub fn open(config: RedisConfig) -> Result<Self, StoreError> {
        let mut info = config
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| StoreError::Io(format!("`{}` is not a Redis URL the client can use: {e}", config.url)))?;
        if let Some(password) = &config.password {
            let settings = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(settings);
        }
        let client = redis::Client::open(info).map_err(|e| StoreError::Io(format!("{}: {e}", config.url)))?;
        let shared = Arc::new(Shared {
            client,
            config,
            idle: Mutex::new(Vec::new()),
            idle_wires: Mutex::new(Vec::new()),
            index: Mutex::new(Index::default()),
            run_id: Mutex::new(String::new()),
            down: AtomicBool::new(false),
            faults: Faults::default(),
            trust_earlier_runs: AtomicBool::new(false),
            stop: Mutex::new(false),
            wake: Condvar::new(),
        });
        let mut tail = tail::Tail::default();
        match tail.poll(&shared) {
            Ok(()) => {}
            Err(Failure::Refused(why)) => {
                return Err(StoreError::Io(format!("{} refused kvflow: {why}", shared.config.url)))
            }
            Err(Failure::Fault(kind, why)) => {
                shared.down.store(true, Ordering::Relaxed);
                shared.faults.note(kind, || format!("{} at start ({why}); retrying", shared.config.url));
            }
        }
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("offload-redis-tail".into())
                .spawn(move || tail.run(&shared))
                .map_err(|e| StoreError::Io(format!("cannot start the store's tail thread: {e}")))?
        };
        Ok(RedisStore { shared, tail: Some(thread) })
    }

    /// Test switch: trusts a chunk written to an earlier run of the server (removes the run-id
    /// check of loads, which `a_restarted_or_flushed_store_is_trusted_for_nothing_it_held` needs).
    #[doc(hidden)]
    pub fn trust_earlier_runs(&self) {
        self.shared.trust_earlier_runs.store(true, Ordering::Relaxed);
    }
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        *self.shared.stop.lock() = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.tail.take() {
            let _ = t.join();
        }
    }
}

impl Shared {
    /// The object under `key` if the store holds it whole, on this run of the server, as its
    /// manifest describes it. Anything else is a miss, counted by kind. The leases of the object
    /// and its manifest are renewed in the same round trip as the read (a miss renews nothing:
    /// the keys are gone, or no process will read them again once the index forgets them).
    /// Over a wire the object is decoded as its bytes arrive, straight into its floats.
    fn load(&self, key: &ChunkKey) -> Option<ChunkObject> {
        if self.down.load(Ordering::Relaxed) {
            return None;
        }
        let (name, lease) = (key.to_string(), self.lease_ms());
        let LoadRead { info, manifest, object } = match self.read(&load_pipe(&name, lease)) {
            Ok(r) => r,
            Err(failure) => {
                self.note("loading", key, failure);
                return None;
            }
        };
        let run_id = run_id(&info).unwrap_or_default();
        let checked = match (manifest.as_deref().map(Manifest::decode), object) {
            (None, _) => Err((FaultKind::Missing, "no manifest (expired, evicted, or never published)".to_string())),
            (Some(None), _) => Err((FaultKind::Damaged, "its manifest is not one".to_string())),
            (Some(Some(_)), None) => Err((FaultKind::Missing, "a manifest without its data".to_string())),
            (Some(Some(_)), Some(Err(e))) => Err((FaultKind::Damaged, format!("not a sound object ({e})"))),
            (Some(Some(m)), Some(Ok((object, len, crc)))) => {
                let now = if self.trust_earlier_runs.load(Ordering::Relaxed) { &m.run_id } else { &run_id };
                match m.mismatch(len, crc, now) {
                    Some(why) => Err((FaultKind::Damaged, why)),
                    None => Ok(object),
                }
            }
        };
        let mut index = self.index.lock();
        match checked {
            Err((kind, why)) => {
                self.faults.note(kind, || format!("{name}: {why}; a miss, the request recomputes"));
                index.forget(key);
                None
            }
            Ok(object) => {
                let until = index.store_now_ms() + lease;
                index.renew(*key, until);
                Some(object)
            }
        }
    }

    /// Runs a load's `pipe` (INFO, the manifest's GET, the object's GET, then renewals): over a
    /// wire, decoding the object as its bytes arrive; through the crate where there is none.
    fn read(&self, pipe: &redis::Pipeline) -> Result<LoadRead, Failure> {
        let over_wire = self.with_wire(|wire| {
            let (replies, object) =
                wire.round_trip_streaming(&pipe.get_packed_pipeline(), pipe.len(), 2, |r, len| {
                    read_object(&mut { r }, len).map(|(object, crc)| (object, len as u64, crc))
                })?;
            let (info, manifest) = load_replies(replies)?;
            Ok(LoadRead { info, manifest, object })
        });
        over_wire.unwrap_or_else(|| self.read_through_crate(pipe))
    }

    /// [`Shared::read`] through the `redis` crate: the whole reply, then the object decoded.
    fn read_through_crate(&self, pipe: &redis::Pipeline) -> Result<LoadRead, Failure> {
        let (info, manifest, bytes) = self.with(|con| pipe.query::<(String, Option<Vec<u8>>, Option<Vec<u8>>)>(con))?;
        let object = bytes.map(|b| decode_object(&b).map(|o| (o, b.len() as u64, manifest::trailer_crc(&b))));
        Ok(LoadRead { info, manifest, object })
    }
}

/// A load of chunk `name`: the server's INFO, the manifest, the object, the two leases renewed
/// for `lease` ms, and the renewal on the log.
fn load_pipe(name: &str, lease: u64) -> redis::Pipeline {
    let manifest_name = format!("{name}#m");
    let mut pipe = redis::pipe();
    pipe.cmd("INFO").arg("server").get(&manifest_name).get(name);
    pipe.cmd("PEXPIRE").arg(name).arg(lease).ignore();
    pipe.cmd("PEXPIRE").arg(&manifest_name).arg(lease).ignore();
    log_entry(&mut pipe, name, "r", None, lease);
    pipe
}

/// What a load's round trip read: the server's INFO, the manifest, and the object decoded and
/// checked against its own checksum (with its length and that checksum), if they were there.
#[derive(Debug, PartialEq)]
struct LoadRead {
    info: String,
    manifest: Option<Vec<u8>>,
    object: Option<Result<(ChunkObject, u64, u32), ObjectError>>,
}

/// A load's (server info, manifest) from its replies on a wire (the object came streamed); any
/// error reply fails the load, as it does through the crate.
fn load_replies(replies: Vec<Reply>) -> Result<(String, Option<Vec<u8>>), Failure> {
    if let Some(Reply::Error(why)) = replies.iter().find(|r| matches!(r, Reply::Error(_))) {
        return Err(Failure::of_server(why.clone()));
    }
    let mut replies = replies.into_iter();
    let mut value = |what: &str| match replies.next() {
        Some(Reply::Bytes(b)) => Ok(Some(b)),
        Some(Reply::Nil) => Ok(None),
        _ => Err(Failure::Refused(format!("the store answered a load's {what} with neither a value nor nil"))),
    };
    let info = value("INFO")?.map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    Ok((info, value("manifest GET")?))
}

impl ObjectStore for RedisStore {
    fn put(&self, key: &ChunkKey, object: &[u8]) -> Result<(), StoreError> {
        self.put_chunk(key, object, &[])
    }

    fn put_chunk(&self, key: &ChunkKey, object: &[u8], hashes: &[u64]) -> Result<(), StoreError> {
        let s = &*self.shared;
        if s.down.load(Ordering::Relaxed) {
            return Err(StoreError::Io("the store is unreachable (retrying in the background)".into()));
        }
        let name = key.to_string();
        let manifest = Manifest::of(object, &s.run_id.lock()).encode();
        let lease = s.lease_ms();
        let written = s.with(|con| {
            let mut pipe = redis::pipe();
            pipe.atomic();
            pipe.cmd("SET").arg(&name).arg(object).arg("PX").arg(lease).ignore();
            pipe.cmd("SET").arg(format!("{name}#m")).arg(manifest).arg("PX").arg(lease).ignore();
            log_entry(&mut pipe, &name, "p", Some((object.len(), hashes)), lease);
            pipe.query::<()>(con)
        });
        match written {
            Ok(()) => {
                let mut index = s.index.lock();
                let until = index.store_now_ms() + lease;
                index.publish(*key, object.len() as u64, until);
                Ok(())
            }
            Err(Failure::Fault(FaultKind::Full, why)) => {
                s.faults.note(FaultKind::Full, || format!("saving {name}: {why}"));
                Err(StoreError::Full(why))
            }
            Err(failure) => Err(StoreError::Io(s.note("saving", key, failure))),
        }
    }

    /// The object's bytes, encoded again from the checked object a load returns (only tests and
    /// tools read a store's bytes; the loader reads objects).
    fn get(&self, key: &ChunkKey) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.shared.load(key).map(|object| encode_object(&object)))
    }

    fn get_object(&self, key: &ChunkKey) -> Result<Option<ChunkObject>, StoreError> {
        Ok(self.shared.load(key))
    }

    fn contains(&self, key: &ChunkKey) -> bool {
        !self.shared.down.load(Ordering::Relaxed) && self.shared.index.lock().holds(key)
    }

    fn bytes(&self) -> u64 {
        self.shared.index.lock().bytes()
    }

    fn evicted_since(&self, cursor: u64) -> (u64, Option<Vec<ChunkKey>>) {
        self.shared.index.lock().evicted.since(cursor)
    }

    fn published_since(&self, cursor: u64) -> (u64, Option<Vec<(ChunkKey, Vec<u64>)>>) {
        self.shared.index.lock().published.since(cursor)
    }

    fn generation(&self) -> u64 {
        self.shared.index.lock().generation
    }

    fn faults(&self) -> StoreFaults {
        self.shared.faults.snapshot()
    }
}
