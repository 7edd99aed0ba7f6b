//! The `kvflow serve` command: loads the graph and the model's text side, binds the address,
//! loads the TLS certificate, and runs the graph with the HTTP server in place of the trace
//! driver until SIGTERM or Ctrl-C.

use super::access::ApiKey;
use super::access::{Access, ServeSwitches, MAX_CONNECTIONS};
use super::Serving;
use crate::graph::{Graph, Overrides};
use crate::runtime::{self, RunOptions};
use crate::text::TextModel;
use anyhow::{anyhow, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args, Clone, Debug)]
#[command(allow_negative_numbers = true)]
pub struct ServeArgs {
    /// The graph file (TOML): its pools serve the requests.
    pub graph: PathBuf,
    /// Address to listen on (the default takes connections from this machine only; 0.0.0.0:
    /// from every network it is on).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: the kernel picks; the bound address is printed once listening).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Checkpoint folder, GGUF file or model spec (overrides model.path).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Ranks of every pool.
    #[arg(long, value_parser = crate::flags::count)]
    pub ranks: Option<usize>,
    /// Where report.json and requests.jsonl go when the server stops.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// After SIGTERM or Ctrl-C, seconds in-flight requests may finish before they are cancelled.
    #[arg(long, default_value = "10", value_parser = crate::flags::seconds)]
    pub grace_period: Duration,
    /// Seconds without progress, with requests pending, before a pool is declared stalled (0: off).
    #[arg(long, default_value = "60", value_parser = crate::flags::seconds)]
    pub stall_timeout: Duration,
    /// Every /v1/* route needs `Authorization: Bearer KEY` (else 401 with an OpenAI error
    /// object); /health and /metrics stay open without it. The key is compared in constant time
    /// and never printed.
    #[arg(long, env = "KVFLOW_API_KEY", hide_env_values = true, value_name = "KEY", value_parser = ApiKey::parse)]
    pub api_key: Option<ApiKey>,
    /// Serve HTTPS (rustls) with this PEM certificate chain, the server's certificate first;
    /// needs --ssl-keyfile.
    #[arg(long, value_name = "PEM", requires = "ssl_keyfile")]
    pub ssl_certfile: Option<PathBuf>,
    /// The PEM private key (PKCS#8, PKCS#1 or SEC1) of --ssl-certfile.
    #[arg(long, value_name = "PEM", requires = "ssl_certfile")]
    pub ssl_keyfile: Option<PathBuf>,
    /// Seconds a connection has, from its start or the end of its last answer, to send its
    /// next request's headers (and its TLS handshake); past them it is closed (0: no limit).
    #[arg(long, default_value = "10", value_parser = crate::flags::seconds)]
    pub header_read_timeout: Duration,
    /// Seconds a request's body has to arrive once its headers have; past them the request gets
    /// 408 and its connection is closed (0: no limit).
    #[arg(long, default_value = "30", value_parser = crate::flags::seconds)]
    pub body_read_timeout: Duration,
    /// Seconds a connection may stay open with no request in flight and nothing sent either way;
    /// then it is closed (0: no limit).
    #[arg(long, default_value = "5", value_parser = crate::flags::seconds)]
    pub keep_alive_timeout: Duration,
    /// Connections open at once, at most: one more gets 503 with Retry-After and is closed (the
    /// refusals are logged at most once per 10 s, with their count).
    #[arg(long, default_value_t = 512, value_parser = max_connections)]
    pub max_connections: usize,
    /// Test only: `NAME[=ARG]` removes one mechanism so a test can show its check fails without
    /// it: one of the server's connection handling (src/server/access.rs, `ServeSwitches`) or one
    /// of the ranks', as `kvflow run --test-switch` takes. Repeatable.
    #[arg(long = "test-switch", hide = true, value_name = "NAME[=ARG]", value_parser = check_test_switch)]
    pub test_switches: Vec<String>,
    /// A file holding the chat template (Jinja, as Hugging Face's `chat_template`) to use in
    /// place of the model's own. Either is checked at startup on a small chat.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
}

/// `--max-connections`: a count in `1..=MAX_CONNECTIONS`.
fn max_connections(text: &str) -> Result<usize, String> {
    let value = crate::flags::count(text)?;
    if value > MAX_CONNECTIONS {
        return Err(format!("expected a whole number between 1 and {MAX_CONNECTIONS}, got {value}"));
    }
    Ok(value)
}

/// A `--test-switch` the server's connection handling or the ranks know.
fn check_test_switch(spec: &str) -> Result<String, String> {
    if ServeSwitches::default().set_from(spec).is_ok() {
        return Ok(spec.to_string());
    }
    kvflow_operators::rank::TestSwitches::default().set_from(spec).map_err(|e| e.to_string())?;
    Ok(spec.to_string())
}

impl ServeArgs {
    /// The server's access settings; loads the TLS certificate and key (an error names the flag
    /// and the file).
    pub fn access(&self) -> Result<Access> {
        let tls = match (&self.ssl_certfile, &self.ssl_keyfile) {
            (Some(cert), Some(key)) => Some(super::tls::server_config(cert, key)?),
            (None, None) => None,
            _ => return Err(anyhow!("--ssl-certfile and --ssl-keyfile go together")),
        };
        let mut switches = ServeSwitches::default();
        // The others are the ranks' (`serve`).
        for name in &self.test_switches {
            let _ = switches.set_from(name);
        }
        Ok(Access {
            api_key: self.api_key.clone(),
            tls,
            header_read_timeout: self.header_read_timeout,
            body_read_timeout: self.body_read_timeout,
            keep_alive_timeout: self.keep_alive_timeout,
            max_connections: self.max_connections,
            switches,
            ..Access::default()
        })
    }
}

/// The text side of the model at `path`, if it has one: a GGUF file, or a folder with
/// `tokenizer.json` (a model spec, or a folder without one, serves token ids only).
pub fn text_of(path: &Path) -> Result<Option<TextModel>> {
    let is_gguf = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if !is_gguf && !path.join("tokenizer.json").is_file() {
        return Ok(None);
    }
    Ok(Some(TextModel::load(path)?))
}

/// Runs `kvflow serve`; returns the exit status.
pub fn serve(args: ServeArgs, interrupts: &crate::signals::Interrupts) -> Result<i32> {
    let access = Arc::new(args.access()?);
    let registry = crate::registry::Registry::default();
    let overrides =
        Overrides { model: args.model.clone(), ranks: args.ranks, out: args.out.clone(), ..Default::default() };
    let graph = Graph::load_overridden(&args.graph, &registry.names(), &overrides)?;
    let mut text =
        text_of(&graph.model).with_context(|| format!("cannot load the tokenizer of {}", graph.model.display()))?;
    if let Some(path) = &args.chat_template {
        let source = std::fs::read_to_string(path)
            .with_context(|| format!("--chat-template: cannot read {}", path.display()))?;
        let Some(text) = text.as_mut() else {
            return Err(anyhow!("--chat-template: {} has no tokenizer, so it serves no chat", graph.model.display()));
        };
        text.set_chat_template(source, format!("--chat-template {}", path.display()));
    }
    if let Some(text) = &text {
        text.check_chat_template().context("the chat template does not work")?;
    }
    if text.is_none() {
        eprintln!("note: {} has no tokenizer: /v1/completions takes token ids; chat is refused", graph.model.display());
    }
    let address = format!("{}:{}", args.host, args.port);
    let listener =
        std::net::TcpListener::bind(&address).map_err(|e| anyhow!("--host/--port: cannot listen on {address}: {e}"))?;
    let mut switches = kvflow_operators::rank::TestSwitches::default();
    for spec in args.test_switches.iter().filter(|spec| ServeSwitches::default().set_from(spec).is_err()) {
        switches.set_from(spec).map_err(|e| anyhow!("--test-switch: {e}"))?;
    }
    let opts = RunOptions {
        switches,
        interrupt: Some(interrupts.flag.clone()),
        grace: Some(args.grace_period),
        stall_timeout: Some(args.stall_timeout),
        show_progress: false,
        front_end: Some(Arc::new(Serving { listener, text: text.map(Arc::new), access })),
        ..Default::default()
    };
    let outcome = runtime::run(&graph, &opts, &registry)?;
    if let Some(report) = &outcome.report {
        eprintln!(
            "served {} requests: {} completed, {} failed, {} cancelled; report in {}",
            report["requests"],
            report["completed"],
            report["failed"],
            report["cancelled"],
            outcome.out_dir.display()
        );
    }
    // A drained server did its job: its status is the run's, not the signal's.
    Ok(outcome.exit_code)
}
