//! The connection side of the shared store: its keys in the database, the state a store's
//! threads share (connections, index, faults), and how an operation runs on a connection and
//! what its failure means.

use super::super::ChunkKey;
use super::faults::{Failure, FaultKind, Faults};
use super::index::Index;
use super::wire::Wire;
use parking_lot::{Condvar, Mutex};
use redis::Connection;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How to reach the store and how long its chunks live.
#[derive(Clone, Debug)]
pub struct RedisConfig {
    /// `redis://host:port/db` or `rediss://…` (TLS), without a password.
    pub url: String,
    pub password: Option<String>,
    /// A chunk expires this long after it was saved or last loaded.
    pub lease: Duration,
    /// The longest an operation may take before it counts as failed.
    pub timeout: Duration,
}

/// The stream of publications and renewals every process tails.
pub const LOG: &str = "kvflow1:log";
/// The token that tells a flush (set by the first process to find it missing).
pub const EPOCH: &str = "kvflow1:epoch";
/// Entries the log keeps (about: trimmed with `MAXLEN ~`); a process that falls further behind
/// misses only hits.
pub const LOG_ENTRIES: usize = 1 << 20;
/// Connections kept open between operations.
pub const IDLE_CONNECTIONS: usize = 8;

pub struct Shared {
    pub client: redis::Client,
    pub config: RedisConfig,
    pub idle: Mutex<Vec<Connection>>,
    /// Idle wires for loads (none where the store is reached over TLS).
    pub idle_wires: Mutex<Vec<Wire>>,
    pub index: Mutex<Index>,
    /// The server's run id as last seen (written into each manifest).
    pub run_id: Mutex<String>,
    /// Set by a failed operation, cleared by the tail's next successful poll.
    pub down: AtomicBool,
    pub faults: Faults,
    /// Test switch: a manifest written to an earlier run of the server is trusted.
    pub trust_earlier_runs: AtomicBool,
    pub stop: Mutex<bool>,
    pub wake: Condvar,
}

impl Shared {
    /// Runs `op` on a connection (an idle one, or a new one), which goes back to the idle ones
    /// when `op` succeeds; a failure marks the store down when it is a connection's.
    pub fn with<T>(&self, op: impl FnOnce(&mut Connection) -> redis::RedisResult<T>) -> Result<T, Failure> {
        self.pooled(&self.idle, || self.connect().map_err(Failure::of), |con| op(con).map_err(Failure::of))
    }

    /// Runs `op` on an idle wire or a new one, as [`Shared::with`] does on a connection; `None`
    /// where the store has no wire (TLS).
    pub fn with_wire<T>(&self, op: impl FnOnce(&mut Wire) -> Result<T, Failure>) -> Option<Result<T, Failure>> {
        let info = self.client.get_connection_info();
        Wire::serves(info).then(|| self.pooled(&self.idle_wires, || Wire::connect(info, self.config.timeout), op))
    }

    fn pooled<C, T>(
        &self,
        idle: &Mutex<Vec<C>>,
        connect: impl FnOnce() -> Result<C, Failure>,
        op: impl FnOnce(&mut C) -> Result<T, Failure>,
    ) -> Result<T, Failure> {
        let taken = idle.lock().pop();
        let done = match taken {
            Some(con) => Ok(con),
            None => connect(),
        }
        .and_then(|mut con| op(&mut con).map(|v| (v, con)));
        match done {
            Ok((v, con)) => {
                let mut idle = idle.lock();
                if idle.len() < IDLE_CONNECTIONS {
                    idle.push(con);
                }
                Ok(v)
            }
            Err(failure) => {
                if matches!(failure, Failure::Fault(FaultKind::Down | FaultKind::Timeout, _)) {
                    self.down.store(true, Ordering::Relaxed);
                    self.idle.lock().clear();
                    self.idle_wires.lock().clear();
                }
                Err(failure)
            }
        }
    }

    fn connect(&self) -> redis::RedisResult<Connection> {
        let timeout = self.config.timeout;
        let con = self.client.get_connection_with_timeout(timeout)?;
        con.set_read_timeout(Some(timeout))?;
        con.set_write_timeout(Some(timeout))?;
        Ok(con)
    }

    pub fn lease_ms(&self) -> u64 {
        self.config.lease.as_millis().max(1) as u64
    }

    /// Counts `failure` by its kind and says what it was.
    pub fn note(&self, what: &str, key: &ChunkKey, failure: Failure) -> String {
        match failure {
            Failure::Fault(kind, why) => {
                let text = format!("{what} {key}: {why}");
                self.faults.note(kind, || text.clone());
                text
            }
            Failure::Refused(why) => format!("{what} {key}: the store refused it: {why}"),
        }
    }
}

/// Adds to `pipe` the log entry that tells every process `name` was published (`"p"`, with its
/// length and its blocks' prefix hashes) or renewed (`"r"`) with a lease of `lease` ms.
pub fn log_entry(pipe: &mut redis::Pipeline, name: &str, event: &str, published: Option<(usize, &[u64])>, lease: u64) {
    pipe.cmd("XADD").arg(LOG).arg("MAXLEN").arg("~").arg(LOG_ENTRIES).arg("*");
    pipe.arg("k").arg(name).arg("e").arg(event).arg("l").arg(lease);
    if let Some((bytes, hashes)) = published {
        let hashes: Vec<u8> = hashes.iter().flat_map(|h| h.to_le_bytes()).collect();
        pipe.arg("n").arg(bytes).arg("h").arg(hashes);
    }
    pipe.ignore();
}

/// The run id in an `INFO server` reply.
pub fn run_id(info: &str) -> Option<String> {
    info.lines().find_map(|l| l.strip_prefix("run_id:")).map(|s| s.trim().to_string())
}
