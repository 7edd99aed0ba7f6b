//! A pool spread over processes (a cluster): where this process sits in it ([`ClusterPlace`]),
//! the timely configuration that connects its processes, and the wait for the peers to connect,
//! said aloud so a peer that never comes is reported rather than waited on in silence.

use anyhow::{anyhow, Result};

/// Where this process sits in a pool spread over several processes.
#[derive(Clone, Debug)]
pub struct ClusterPlace {
    pub process: usize,
    pub processes: usize,
    /// `host:port` of every process, in process order.
    pub addresses: Vec<String>,
    /// How long to wait for every process to connect before giving up (zero: wait for ever,
    /// saying so every 10 s).
    pub connect_timeout: std::time::Duration,
}

/// How often a process waiting for its peers says so.
const CONNECT_NOTICE: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs `start` (which connects the cluster's processes and then starts the workers) on a
/// thread of its own, so a peer that never connects is reported — every 10 s, and as an error
/// after the place's timeout — instead of blocking the run in silence.
pub fn connect_then<T: Send + 'static>(
    pool: &str,
    place: &ClusterPlace,
    start: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("kvflow-connect".into())
        .spawn(move || {
            let _ = tx.send(start());
        })
        .map_err(|e| anyhow!("pool {pool}: cannot start the connecting thread: {e}"))?;
    let waited = std::time::Instant::now();
    let peers: Vec<String> = (0..place.processes)
        .filter(|&p| p != place.process)
        .map(|p| format!("process {p} at {}", place.addresses[p]))
        .collect();
    loop {
        match rx.recv_timeout(CONNECT_NOTICE) {
            Ok(started) => return started.map_err(|e| anyhow!("cannot start pool {pool}: {e}")),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(anyhow!("pool {pool}: the connecting thread ended without starting the pool"))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        let secs = waited.elapsed().as_secs();
        let what = format!(
            "pool {pool}: process {} (listening on {}) has waited {secs} s for its peers to connect: {}",
            place.process,
            place.addresses[place.process],
            peers.join(", ")
        );
        if !place.connect_timeout.is_zero() && waited.elapsed() >= place.connect_timeout {
            return Err(anyhow!(
                "{what}; giving up after {} s (--stall-timeout). Is every process started, with the same \
                 hostfile, and can it reach these addresses?",
                place.connect_timeout.as_secs()
            ));
        }
        eprintln!("{what}");
    }
}

/// The timely configuration of pool `pool`'s `ranks` workers: threads of this process, or with
/// `cluster` this process's share of them, connected to the other processes.
pub fn timely_config(pool: &str, ranks: usize, cluster: Option<&ClusterPlace>) -> Result<timely::Config> {
    Ok(match cluster {
        None => timely::Config::process(ranks),
        Some(c) => {
            if !ranks.is_multiple_of(c.processes) {
                return Err(anyhow!(
                    "pool {}: {} ranks do not split evenly over {} processes",
                    pool,
                    ranks,
                    c.processes
                ));
            }
            timely::Config {
                communication: timely::CommunicationConfig::Cluster {
                    threads: ranks / c.processes,
                    process: c.process,
                    addresses: c.addresses.clone(),
                    report: false,
                    zerocopy: false,
                },
                worker: timely::WorkerConfig::default(),
            }
        }
    })
}
