//! `kvflow launch GRAPH`: starts every process of a graph on this machine, as the graph places
//! them, and waits for the run to end.
//!
//! - A decode pool that a tcp link reaches runs in a process of its own (`run --pools D`); it is
//!   started first, and the address it prints when it listens is handed to the producers
//!   (`--endpoint D=ADDR`).
//! - A pool that lists several processes (`hosts`) runs as that many processes (`run --pools P
//!   --process I`), timely's cluster over the listed addresses; process 0 drives the workload. It
//!   is the graph's only pool, or a prefill pool beside decode pools reached over tcp (every one
//!   of its processes gets their addresses).
//! - Every other pool runs in the driving process, which replays the workload and writes the
//!   report; its exit code is `launch`'s.
//!
//! The other processes' output comes through line by line, prefixed with `[pool]` or
//! `[pool/process]`. The same run flags go to every process.

use crate::graph::{Graph, PoolConfig, PoolRole, TransferBackend};
use anyhow::{anyhow, bail, Context, Result};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a decode process may take to say where it listens.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the other processes may take to end after the driving one has.
const END_TIMEOUT: Duration = Duration::from_secs(60);

/// One process of the plan: its label and its `kvflow` arguments after the graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedProcess {
    pub label: String,
    pub args: Vec<String>,
    /// A decode pool serving tcp handoffs: the name whose address the producers need.
    pub listens_for: Option<String>,
}

/// The processes `launch` starts, in order; the last one drives the workload.
pub fn plan(graph: &Graph) -> Result<Vec<PlannedProcess>> {
    let served: Vec<&str> = graph
        .pools
        .iter()
        .filter(|p| {
            p.role == PoolRole::Decode
                && graph.links.iter().any(|l| l.to == p.name && l.backend == TransferBackend::Tcp)
                && graph.links.iter().filter(|l| l.to == p.name).all(|l| l.backend == TransferBackend::Tcp)
        })
        .map(|p| p.name.as_str())
        .collect();
    let mut processes: Vec<PlannedProcess> = served
        .iter()
        .map(|d| PlannedProcess {
            label: d.to_string(),
            args: vec!["--pools".into(), d.to_string()],
            listens_for: Some(d.to_string()),
        })
        .collect();
    let driving: Vec<&PoolConfig> = graph.pools.iter().filter(|p| !served.contains(&p.name.as_str())).collect();
    if driving.is_empty() {
        bail!("{}: every pool is a decode pool; nothing replays the workload", graph.path.display());
    }
    if let Some(p) = driving.iter().find(|p| p.hosts.len() > 1) {
        if driving.len() > 1 {
            bail!(
                "{}: pool `{}` lists {} processes (hosts), so the driving process runs that pool only; the others \
                 ({}) would have to run in it too (a spread pool runs alone, or as a prefill pool beside decode \
                 pools reached over tcp)",
                graph.path.display(),
                p.name,
                p.hosts.len(),
                driving.iter().filter(|q| q.name != p.name).map(|q| q.name.as_str()).collect::<Vec<_>>().join(", ")
            );
        }
        let name = p.name.clone();
        // Process 0 drives the workload: started last, once the others wait for it.
        for i in (1..p.hosts.len()).chain([0]) {
            processes.push(PlannedProcess {
                label: format!("{name}/{i}"),
                args: vec!["--pools".into(), name.clone(), "--process".into(), i.to_string()],
                listens_for: None,
            });
        }
        return Ok(processes);
    }
    let names: Vec<&str> = driving.iter().map(|p| p.name.as_str()).collect();
    processes.push(PlannedProcess {
        label: names.join(","),
        args: if served.is_empty() { Vec::new() } else { vec!["--pools".into(), names.join(",")] },
        listens_for: None,
    });
    Ok(processes)
}

/// A started process and the thread forwarding its output.
struct Running {
    label: String,
    child: Child,
}

/// Forwards `pipe` line by line with `label`; lines naming where a decode pool listens are also
/// sent to `addresses`.
fn forward(
    pipe: impl std::io::Read + Send + 'static,
    label: String,
    addresses: Option<mpsc::Sender<(String, String)>>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            if let (Some(tx), Some(rest)) = (&addresses, line.strip_prefix("decode pool `")) {
                if let Some((pool, addr)) = rest.split_once("` listening on ") {
                    let _ = tx.send((pool.to_string(), addr.trim().to_string()));
                }
            }
            eprintln!("[{label}] {line}");
        }
    });
}

/// Starts the graph's processes with `run_flags` each, waits for the driving one and then the
/// others; returns the exit code of the run.
pub fn launch(graph: &Graph, graph_path: &Path, run_flags: &[String]) -> Result<i32> {
    let processes = plan(graph)?;
    let exe = std::env::current_exe().context("launch: cannot find this kvflow executable")?;
    let (tx, rx) = mpsc::channel();
    let mut started: Vec<Running> = Vec::new();
    let mut endpoints: Vec<String> = Vec::new();
    let result = (|| -> Result<i32> {
        let (last, others) = processes.split_last().ok_or_else(|| anyhow!("launch: no process to start"))?;
        for p in others {
            let mut command = Command::new(&exe);
            command.arg("run").arg(graph_path).args(&p.args).args(run_flags);
            if p.listens_for.is_none() {
                for e in &endpoints {
                    command.args(["--endpoint", e]);
                }
            }
            let mut child = command
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .with_context(|| format!("launch: cannot start the process of {}", p.label))?;
            forward(child.stdout.take().expect("piped"), p.label.clone(), None);
            forward(child.stderr.take().expect("piped"), p.label.clone(), Some(tx.clone()));
            eprintln!("launch: started {} (pid {})", p.label, child.id());
            started.push(Running { label: p.label.clone(), child });
            if let Some(pool) = &p.listens_for {
                let addr = wait_for_address(&rx, pool, started.last_mut().expect("just pushed"))?;
                endpoints.push(format!("{pool}={addr}"));
            }
        }
        let mut driver = Command::new(&exe);
        driver.arg("run").arg(graph_path).args(&last.args).args(run_flags);
        for e in &endpoints {
            driver.args(["--endpoint", e]);
        }
        let status = driver.status().with_context(|| format!("launch: cannot start the process of {}", last.label))?;
        let code = status.code().unwrap_or(1);
        let mut worst = code;
        for r in &mut started {
            match wait_ended(&mut r.child, END_TIMEOUT) {
                Some(0) => {}
                Some(c) => {
                    eprintln!("launch: the process of {} exited with code {c}", r.label);
                    if worst == 0 {
                        worst = c;
                    }
                }
                None => {
                    eprintln!(
                        "launch: the process of {} had not ended {} s after the driving process; stopped it",
                        r.label,
                        END_TIMEOUT.as_secs()
                    );
                    let _ = r.child.kill();
                    let _ = r.child.wait();
                    if worst == 0 {
                        worst = 1;
                    }
                }
            }
        }
        Ok(worst)
    })();
    if result.is_err() {
        for r in &mut started {
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
    }
    result
}

/// The address decode pool `pool` prints once it listens.
fn wait_for_address(rx: &mpsc::Receiver<(String, String)>, pool: &str, process: &mut Running) -> Result<String> {
    let deadline = Instant::now() + LISTEN_TIMEOUT;
    loop {
        if let Ok(Some(status)) = process.child.try_wait() {
            bail!("launch: the process of decode pool `{pool}` exited ({status}) before it listened");
        }
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok((p, addr)) if p == pool => return Ok(addr),
            Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => bail!("launch: lost the output of decode pool `{pool}`"),
        }
        if Instant::now() > deadline {
            bail!("launch: decode pool `{pool}` did not say where it listens within {} s", LISTEN_TIMEOUT.as_secs());
        }
    }
}

/// The child's exit code once it ends within `timeout` (a signal counts as 1); `None` if not.
fn wait_ended(child: &mut Child, timeout: Duration) -> Option<i32> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status.code().unwrap_or(1));
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(pools_and_links: &str) -> Graph {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model.toml");
        std::fs::write(&model, "family = \"llama\"\n").unwrap();
        let path = dir.path().join("g.toml");
        std::fs::write(&path, format!("[model]\npath = \"model.toml\"\n\n{pools_and_links}")).unwrap();
        let names = crate::registry::Registry::default().names();
        Graph::load_with(&path, &names).unwrap()
    }

    #[test]
    fn decode_pools_over_tcp_start_first_and_the_driver_last() {
        let g = graph(
            "[[pool]]\nname = \"p\"\nrole = \"prefill\"\n\n[[pool]]\nname = \"d\"\nrole = \"decode\"\n\n\
             [[link]]\nfrom = \"p\"\nto = \"d\"\nbackend = \"tcp\"\n",
        );
        let plan = plan(&g).unwrap();
        assert_eq!(plan.len(), 2);
        assert_eq!(plan[0].args, ["--pools", "d"]);
        assert_eq!(plan[0].listens_for.as_deref(), Some("d"));
        assert_eq!(plan[1].args, ["--pools", "p"]);
        // inproc: one process
        let g = graph(
            "[[pool]]\nname = \"p\"\nrole = \"prefill\"\n\n[[pool]]\nname = \"d\"\nrole = \"decode\"\n\n\
             [[link]]\nfrom = \"p\"\nto = \"d\"\n",
        );
        assert_eq!(plan_args(&g), vec![Vec::<String>::new()]);
    }

    #[test]
    fn a_prefill_pool_over_two_hosts_starts_after_its_decode_pool_and_drives_from_process_0() {
        let g = graph(
            "[[pool]]\nname = \"p\"\nrole = \"prefill\"\nranks = 2\nhosts = [\"127.0.0.1:7101\", \"127.0.0.1:7102\"]\n\n\
             [[pool]]\nname = \"d\"\nrole = \"decode\"\n\n[[link]]\nfrom = \"p\"\nto = \"d\"\nbackend = \"tcp\"\n",
        );
        assert_eq!(
            plan_args(&g),
            vec![vec!["--pools", "d"], vec!["--pools", "p", "--process", "1"], vec!["--pools", "p", "--process", "0"]]
        );
        // Another pool would have to run in the driving process beside it.
        let g = graph(
            "[[pool]]\nname = \"a\"\nranks = 2\nhosts = [\"127.0.0.1:7101\", \"127.0.0.1:7102\"]\n\n\
             [[pool]]\nname = \"b\"\n",
        );
        let err = plan(&g).unwrap_err().to_string();
        assert!(err.contains("pool `a` lists 2 processes") && err.contains("(b)"), "{err}");
    }

    #[test]
    fn a_pool_listing_its_hosts_runs_one_process_each() {
        let g = graph("[[pool]]\nname = \"main\"\nranks = 2\nhosts = [\"127.0.0.1:7101\", \"127.0.0.1:7102\"]\n");
        assert_eq!(
            plan_args(&g),
            vec![vec!["--pools", "main", "--process", "1"], vec!["--pools", "main", "--process", "0"]]
        );
    }

    fn plan_args(g: &Graph) -> Vec<Vec<String>> {
        plan(g).unwrap().into_iter().map(|p| p.args).collect()
    }
}
