//! The store's tail: a thread that polls the shared store every [`POLL`] and keeps this process's
//! index true — the server's run id and kvflow's epoch token (a change of either is a restart or
//! a flush: the index is dropped, and the log is read on from its end), the store's clock, and
//! the log's new publications and renewals. A poll that fails marks the store down and the next
//! is tried after a back-off that doubles from [`POLL`] to [`MAX_BACKOFF`]; one that succeeds
//! marks it up.

use super::super::ChunkKey;
use super::connection::{Shared, EPOCH, LOG};
use super::faults::{Failure, FaultKind};
use redis::streams::{StreamReadOptions, StreamReadReply};
use redis::Value;
use std::sync::atomic::Ordering;
use std::time::Duration;

const POLL: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Log entries read a round; a poll reads up to [`ROUNDS`] rounds (a process starting over a
/// long log catches up over several polls).
const BATCH: usize = 4096;
const ROUNDS: usize = 64;

#[derive(Default)]
pub struct Tail {
    /// The last log entry read (`None`: none yet, the log is read from its start).
    cursor: Option<String>,
    run_id: Option<String>,
    epoch: Option<String>,
}

impl Tail {
    /// Polls until the store is dropped.
    pub fn run(&mut self, shared: &Shared) {
        let mut wait = POLL;
        loop {
            {
                let mut stop = shared.stop.lock();
                if !*stop {
                    shared.wake.wait_for(&mut stop, wait);
                }
                if *stop {
                    return;
                }
            }
            match self.poll(shared) {
                Ok(()) => wait = POLL,
                Err(Failure::Fault(kind, why)) => {
                    shared.down.store(true, Ordering::Relaxed);
                    shared.faults.note(kind, || format!("polling {}: {why}; retrying", shared.config.url));
                    wait = (wait * 2).min(MAX_BACKOFF);
                }
                Err(Failure::Refused(why)) => {
                    shared.down.store(true, Ordering::Relaxed);
                    shared.faults.note(FaultKind::Down, || format!("polling {}: {why}", shared.config.url));
                    wait = (wait * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// One poll: restart and flush, the clock, the log.
    pub fn poll(&mut self, shared: &Shared) -> Result<(), Failure> {
        let (info, epoch, time): (String, Option<String>, (u64, u64)) =
            shared.with(|con| redis::pipe().cmd("INFO").arg("server").get(EPOCH).cmd("TIME").query(con))?;
        let run_id = super::connection::run_id(&info).unwrap_or_default();
        let epoch = match epoch {
            Some(e) => e,
            None => {
                let token = format!("{:016x}", fresh_token());
                shared
                    .with(|con| {
                        redis::cmd("SET").arg(EPOCH).arg(&token).arg("NX").query::<Option<String>>(con)?;
                        redis::cmd("GET").arg(EPOCH).query::<Option<String>>(con)
                    })?
                    .unwrap_or(token)
            }
        };
        let store_ms = time.0 * 1000 + time.1 / 1000;
        let restarted = self.run_id.as_ref().is_some_and(|r| *r != run_id);
        let flushed = self.epoch.as_ref().is_some_and(|e| *e != epoch);
        if restarted || flushed {
            let what = if restarted { "restarted (its run id changed)" } else { "flushed (kvflow's epoch token went)" };
            shared.faults.note(FaultKind::Restart, || {
                format!(
                    "{} {what}: this process's index of it is dropped; nothing it held before is trusted",
                    shared.config.url
                )
            });
            shared.index.lock().clear();
            // Read on from the log's end: what it holds from before is not trusted.
            let last: Vec<(String, Value)> =
                shared.with(|con| redis::cmd("XREVRANGE").arg(LOG).arg("+").arg("-").arg("COUNT").arg(1).query(con))?;
            self.cursor = Some(last.into_iter().next().map_or_else(|| "0-0".to_string(), |(id, _)| id));
        }
        self.run_id = Some(run_id.clone());
        self.epoch = Some(epoch);
        *shared.run_id.lock() = run_id;
        shared.index.lock().set_store_clock(store_ms);
        for _ in 0..ROUNDS {
            let from = self.cursor.clone().unwrap_or_else(|| "0-0".to_string());
            let options = StreamReadOptions::default().count(BATCH);
            let reply: Option<StreamReadReply> =
                shared.with(|con| redis::cmd("XREAD").arg(&options).arg("STREAMS").arg(LOG).arg(&from).query(con))?;
            let entries = reply.map(|r| r.keys.into_iter().flat_map(|k| k.ids).collect::<Vec<_>>()).unwrap_or_default();
            let read = entries.len();
            let mut index = shared.index.lock();
            for entry in entries {
                let at_ms: u64 = entry.id.split('-').next().and_then(|ms| ms.parse().ok()).unwrap_or(0);
                let field =
                    |name: &str| entry.map.get(name).and_then(|v| redis::from_redis_value::<String>(v.clone()).ok());
                let number = |name: &str| field(name).and_then(|v| v.parse::<u64>().ok());
                if let (Some(key), Some(lease)) = (field("k").as_deref().and_then(ChunkKey::parse), number("l")) {
                    match field("e").as_deref() {
                        Some("p") => {
                            index.publish(key, number("n").unwrap_or(0), at_ms + lease);
                            let hashes =
                                entry.map.get("h").and_then(|v| redis::from_redis_value::<Vec<u8>>(v.clone()).ok());
                            let hashes: Vec<u64> = hashes
                                .unwrap_or_default()
                                .chunks_exact(8)
                                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                                .collect();
                            if !hashes.is_empty() {
                                index.published.push((key, hashes));
                            }
                        }
                        Some("r") => index.renew(key, at_ms + lease),
                        _ => {}
                    }
                }
                self.cursor = Some(entry.id);
            }
            drop(index);
            if read < BATCH {
                break;
            }
        }
        if self.cursor.is_none() {
            self.cursor = Some("0-0".to_string());
        }
        shared.index.lock().expire();
        if shared.down.swap(false, Ordering::Relaxed) {
            shared.faults.reachable();
        }
        Ok(())
    }
}

/// A token no other process is likely to choose.
fn fresh_token() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    kvflow_kernels::hash::mix(kvflow_kernels::hash::mix(nanos, std::process::id() as u64), 0x6b76_666c_6f77)
}
