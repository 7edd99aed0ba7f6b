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
//! `[pool/process]`. The same run flags go to every process. Each process has a process group of
//! its own, so a terminal's Ctrl-C reaches launch alone; launch passes SIGINT, SIGTERM and
//! SIGHUP on to every process once, waits for them to drain (their grace period and 10 s), then
//! kills what is left. A process killed by a signal is reported so ("killed by signal 9").

use crate::graph::{Graph, PoolConfig, PoolRole, TransferBackend};
use crate::signals::{Interrupts, OnSecondSignal};
use anyhow::{anyhow, bail, Context, Result};
use std::io::{BufRead, BufReader};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Writes one line to stderr in one write, so that it stays whole among the lines of the
/// processes sharing launch's stderr (`eprintln!` writes a line in pieces).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = std::io::stderr().write_all(format!("{}\n", format_args!($($arg)*)).as_bytes());
    }};
}

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

/// How a process ended, as launch says it: "exit code 3", "killed by signal 9 (SIGKILL)".
pub fn describe_end(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal} ({})", crate::signals::name(signal)),
        (None, None) => format!("{status}"),
    }
}

/// The exit code that stands for `status`: its own, or 128 + the signal that killed it (as a
/// shell says it).
pub fn exit_code_of(status: ExitStatus) -> i32 {
    status.code().or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(1)
}

/// How long launch waits, after forwarding a signal, for its processes to drain and exit before
/// it kills them: their grace period (`--grace-period` among the run flags, else its default of
/// 10 s) and [`DRAIN_MARGIN`] for cancelling the rest and writing the report.
pub fn drain_deadline(run_flags: &[String]) -> Duration {
    let mut grace = DEFAULT_GRACE;
    for (i, flag) in run_flags.iter().enumerate() {
        let value = match flag.strip_prefix("--grace-period") {
            Some("") => run_flags.get(i + 1).map(String::as_str),
            Some(rest) => rest.strip_prefix('='),
            None => None,
        };
        if let Some(g) = value.and_then(|v| crate::flags::seconds(v).ok()) {
            grace = g;
        }
    }
    grace + DRAIN_MARGIN
}

/// The run flags' default `--grace-period`.
const DEFAULT_GRACE: Duration = Duration::from_secs(10);
/// What launch allows beyond the grace period for its processes to end after a signal.
const DRAIN_MARGIN: Duration = Duration::from_secs(10);

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
            say!("[{label}] {line}");
        }
    });
}

/// The processes launch started, and the signals it has passed on to them.
struct Processes {
    started: Vec<Running>,
    interrupts: Interrupts,
    /// Signals forwarded so far (every one taken is forwarded once).
    forwarded: usize,
    /// Once a signal came: when the processes still running are killed.
    kill_at: Option<Instant>,
    drain: Duration,
}

impl Processes {
    /// Starts `command` as process `label` in a process group of its own (a terminal's Ctrl-C
    /// reaches launch alone, which forwards it once). `piped`: its output comes through
    /// prefixed with its label.
    fn start(
        &mut self,
        mut command: Command,
        label: &str,
        piped: Option<&mpsc::Sender<(String, String)>>,
    ) -> Result<()> {
        command.stdin(Stdio::null()).process_group(0);
        if piped.is_some() {
            command.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = command.spawn().with_context(|| format!("launch: cannot start the process of {label}"))?;
        if let Some(tx) = piped {
            forward(child.stdout.take().expect("piped"), label.to_string(), None);
            forward(child.stderr.take().expect("piped"), label.to_string(), Some(tx.clone()));
        }
        say!("launch: started {label} (pid {})", child.id());
        self.started.push(Running { label: label.to_string(), child });
        Ok(())
    }

    /// Passes every signal taken since the last call to the processes still running; past the
    /// drain deadline, kills them. Whether a signal has come.
    fn pass_signals_on(&mut self) -> bool {
        let taken = self.interrupts.count();
        if taken > self.forwarded {
            let signal = self.interrupts.signal().unwrap_or(libc::SIGTERM);
            for r in &mut self.started {
                if matches!(r.child.try_wait(), Ok(None)) {
                    // SAFETY: kill(2) on the pid of a child of ours that has not been reaped.
                    unsafe { libc::kill(r.child.id() as i32, signal) };
                }
            }
            if self.forwarded == 0 {
                say!(
                    "launch: {} passed on to {} process(es); waiting up to {} s for them to drain",
                    crate::signals::name(signal),
                    self.started.len(),
                    self.drain.as_secs()
                );
                self.kill_at = Some(Instant::now() + self.drain);
            }
            self.forwarded = taken;
        }
        if self.kill_at.is_some_and(|at| Instant::now() >= at) {
            for r in &mut self.started {
                if matches!(r.child.try_wait(), Ok(None)) {
                    say!(
                        "launch: the process of {} had not drained within {} s; killing it",
                        r.label,
                        self.drain.as_secs()
                    );
                    let _ = r.child.kill();
                }
            }
        }
        taken > 0
    }

    /// Waits for process `index` to end, passing signals on meanwhile; after `timeout` (when no
    /// signal came) it is killed. Its exit status.
    fn wait(&mut self, index: usize, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            if let Ok(Some(status)) = self.started[index].child.try_wait() {
                return status;
            }
            let signalled = self.pass_signals_on();
            if !signalled && deadline.is_some_and(|d| Instant::now() > d) {
                let r = &mut self.started[index];
                say!(
                    "launch: the process of {} had not ended {} s after the driving process; stopped it",
                    r.label,
                    timeout.as_secs()
                );
                let _ = r.child.kill();
                if let Ok(status) = r.child.wait() {
                    return status;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills and reaps every process still running (launch is failing).
    fn kill_all(&mut self) {
        for r in &mut self.started {
            let _ = r.child.kill();
            let _ = r.child.wait();
        }
    }
}

/// Starts the graph's processes with `run_flags` each, waits for the driving one and then the
/// others; returns the exit code of the run. SIGINT, SIGTERM and SIGHUP are passed on to every
/// process, which drain and write the report; those still running after [`drain_deadline`] are
/// killed.
pub fn launch(graph: &Graph, graph_path: &Path, run_flags: &[String]) -> Result<i32> {
    // Before any other thread starts: every thread inherits the blocked signals.
    let interrupts = crate::signals::watch_with(OnSecondSignal::Record)
        .context("launch: cannot set up SIGINT/SIGTERM/SIGHUP handling")?;
    let processes = plan(graph)?;
    let exe = std::env::current_exe().context("launch: cannot find this kvflow executable")?;
    let (tx, rx) = mpsc::channel();
    let mut running =
        Processes { started: Vec::new(), interrupts, forwarded: 0, kill_at: None, drain: drain_deadline(run_flags) };
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
            running.start(command, &p.label, Some(&tx))?;
            if let Some(pool) = &p.listens_for {
                let addr = wait_for_address(&rx, pool, &mut running)?;
                endpoints.push(format!("{pool}={addr}"));
            }
        }
        let mut driver = Command::new(&exe);
        driver.arg("run").arg(graph_path).args(&last.args).args(run_flags);
        for e in &endpoints {
            driver.args(["--endpoint", e]);
        }
        running.start(driver, &last.label, None)?;
        let driving = running.started.len() - 1;
        let status = running.wait(driving, Duration::MAX);
        if status.code().is_none() {
            say!("launch: the driving process ({}) was {}", last.label, describe_end(status));
        }
        let mut worst = exit_code_of(status);
        for index in 0..driving {
            let status = running.wait(index, END_TIMEOUT);
            if !status.success() {
                say!("launch: the process of {} ended: {}", running.started[index].label, describe_end(status));
                if worst == 0 {
                    worst = exit_code_of(status);
                }
            }
        }
        Ok(worst)
    })();
    if result.is_err() {
        running.kill_all();
    }
    result
}

/// The address decode pool `pool` prints once it listens (its process is the last started).
fn wait_for_address(rx: &mpsc::Receiver<(String, String)>, pool: &str, running: &mut Processes) -> Result<String> {
    let deadline = Instant::now() + LISTEN_TIMEOUT;
    loop {
        if running.pass_signals_on() {
            bail!("launch: interrupted while decode pool `{pool}` was starting; its processes were stopped");
        }
        let process = running.started.last_mut().expect("the decode pool's process was started");
        if let Ok(Some(status)) = process.child.try_wait() {
            bail!("launch: the process of decode pool `{pool}` ended ({}) before it listened", describe_end(status));
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

    #[test]
    fn a_process_killed_by_a_signal_is_reported_so_and_counts_as_128_plus_it() {
        let killed = ExitStatus::from_raw(libc::SIGKILL);
        assert_eq!(describe_end(killed), "killed by signal 9 (SIGKILL)");
        assert_eq!(exit_code_of(killed), 137);
        let exited = ExitStatus::from_raw(3 << 8);
        assert_eq!((describe_end(exited), exit_code_of(exited)), ("exit code 3".to_string(), 3));
    }

    #[test]
    fn the_drain_deadline_follows_the_grace_period_given_to_the_processes() {
        let flags = |f: &[&str]| f.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(drain_deadline(&[]), Duration::from_secs(20));
        assert_eq!(drain_deadline(&flags(&["--verify", "--grace-period", "2"])), Duration::from_secs(12));
        assert_eq!(drain_deadline(&flags(&["--grace-period=0.5"])), Duration::from_secs_f64(10.5));
    }

    fn plan_args(g: &Graph) -> Vec<Vec<String>> {
        plan(g).unwrap().into_iter().map(|p| p.args).collect()
    }
}
