//! A Redis server of this machine's own, on a free loopback port, without persistence: what
//! `kvflow bench offload --store redis` measures against (beside `redis-benchmark` on the same
//! server) and what the tests run their stores on — a real server, never a mock. It can be
//! stopped, paused (SIGSTOP: a store slower than any timeout) and restarted on the same port. A
//! launcher (`ip netns exec HOST`) runs it on another host that a test made.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct LocalRedis {
    pub port: u16,
    /// The address it listens on.
    host: String,
    /// What runs `redis-server` and `redis-cli` (nothing: this machine, this namespace).
    launcher: Vec<String>,
    /// Extra `redis-server` arguments (`--maxmemory 1mb`…), kept for restarts.
    args: Vec<String>,
    dir: PathBuf,
    child: Option<Child>,
}

/// Why no local server could be started.
#[derive(Debug, thiserror::Error)]
pub enum LocalRedisError {
    #[error("redis-server is not installed (Debian: apt-get install redis-server)")]
    NotInstalled,
    #[error("{0}")]
    Start(String),
}

impl LocalRedis {
    /// Starts `redis-server` on a free port of 127.0.0.1 with `args` added.
    pub fn start(args: &[&str]) -> Result<Self, LocalRedisError> {
        LocalRedis::start_on(&[], "127.0.0.1", args)
    }

    /// Starts `redis-server` through `launcher` (such as `ip netns exec HOST`), listening on
    /// `host` at a port free here (a namespace a test made has every port free).
    pub fn start_on(launcher: &[&str], host: &str, args: &[&str]) -> Result<Self, LocalRedisError> {
        if Command::new("redis-server").arg("--version").stdout(Stdio::null()).status().is_err() {
            return Err(LocalRedisError::NotInstalled);
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| LocalRedisError::Start(format!("no free loopback port: {e}")))?
            .port();
        let dir = std::env::temp_dir().join(format!("kvflow-redis-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| LocalRedisError::Start(format!("{}: {e}", dir.display())))?;
        let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        let mut server =
            LocalRedis { port, host: host.to_string(), launcher: owned(launcher), args: owned(args), dir, child: None };
        server.restart()?;
        Ok(server)
    }

    /// For tests: [`Self::start`], or `None` after saying the test skipped when redis-server is
    /// not installed — unless `KVFLOW_REQUIRE_REDIS` is set (tools/test.sh sets it where it could
    /// install one), which makes that a failure. Any other failure to start panics.
    #[doc(hidden)]
    pub fn start_or_skip(args: &[&str]) -> Option<Self> {
        LocalRedis::start_on_or_skip(&[], "127.0.0.1", args)
    }

    /// [`Self::start_on`], skipping as [`Self::start_or_skip`] does.
    #[doc(hidden)]
    pub fn start_on_or_skip(launcher: &[&str], host: &str, args: &[&str]) -> Option<Self> {
        match LocalRedis::start_on(launcher, host, args) {
            Ok(server) => Some(server),
            Err(LocalRedisError::NotInstalled) if std::env::var_os("KVFLOW_REQUIRE_REDIS").is_none() => {
                eprintln!(
                    "skipped: redis-server is not installed (tools/test.sh installs it; with KVFLOW_REQUIRE_REDIS set \
                     this fails instead)"
                );
                None
            }
            Err(e) => panic!("cannot start a local redis-server: {e}"),
        }
    }

    pub fn url(&self) -> String {
        format!("redis://{}:{}/0", self.host, self.port)
    }

    /// Starts the server again (after [`Self::kill`]), on the same port, empty.
    pub fn restart(&mut self) -> Result<(), LocalRedisError> {
        self.kill();
        let port = self.port.to_string();
        let child = self
            .launched("redis-server")
            .args(["--port", &port, "--bind", &self.host, "--save", "", "--appendonly", "no"])
            .args(["--dir", &self.dir.to_string_lossy()])
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| LocalRedisError::Start(format!("cannot start redis-server: {e}")))?;
        self.child = Some(child);
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            if self.ping() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        Err(LocalRedisError::Start(format!("redis-server on port {port} did not answer within 10 s")))
    }

    /// Whether the server answers PING (with PONG, or with an error when it wants a password);
    /// through `redis-cli` run by the launcher when there is one.
    pub fn ping(&self) -> bool {
        use std::io::{Read, Write};
        if !self.launcher.is_empty() {
            let out =
                self.launched("redis-cli").args(["-h", &self.host, "-p", &self.port.to_string(), "ping"]).output();
            return out.is_ok_and(|o| {
                let text = String::from_utf8_lossy(&o.stdout);
                text.contains("PONG") || text.contains("NOAUTH")
            });
        }
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
        let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut first = [0u8; 1];
        s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut first).is_ok() && matches!(first[0], b'+' | b'-')
    }

    /// `program`, run through the launcher.
    fn launched(&self, program: &str) -> Command {
        let argv: Vec<&str> = self.launcher.iter().map(String::as_str).chain([program]).collect();
        let mut c = Command::new(argv[0]);
        c.args(&argv[1..]);
        c
    }

    /// Keys the server holds (0 when it does not answer).
    pub fn keys(&self) -> u64 {
        self.command(redis::cmd("DBSIZE")).unwrap_or(0)
    }

    /// Empties the server.
    pub fn flush(&self) {
        self.command::<()>(redis::cmd("FLUSHALL")).expect("the local redis-server flushes");
    }

    fn command<T: redis::FromRedisValue>(&self, cmd: redis::Cmd) -> Option<T> {
        let client = redis::Client::open(self.url()).ok()?;
        let mut con = client.get_connection_with_timeout(Duration::from_millis(500)).ok()?;
        cmd.query(&mut con).ok()
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops (`true`: SIGSTOP) or resumes (`false`: SIGCONT) the server: while stopped, it
    /// accepts connections and answers nothing.
    pub fn pause(&self, paused: bool) {
        if let Some(child) = &self.child {
            let signal = if paused { "-STOP" } else { "-CONT" };
            let _ = Command::new("kill").args([signal, &child.id().to_string()]).status();
        }
    }
}

impl Drop for LocalRedis {
    fn drop(&mut self) {
        self.pause(false);
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
