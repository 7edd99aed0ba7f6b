//! Who may call `kvflow serve`, and what a hostile client can hold: `--api-key` (401 without
//! or with a wrong key, /health and /metrics open, the key never printed), the bound address
//! (127.0.0.1 unless `--host` says otherwise), TLS with a certificate made here and verified by
//! the `openai` client, clear errors for bad TLS files; slow clients (headers a byte at a time,
//! a body that never comes, idle keep-alives) closed by their timeouts, connections over
//! `--max-connections` answered 503, a half-closing client answered in full, and a body over
//! the limit answered 413 with an OpenAI error object. Where a mechanism can be switched off
//! (`--test-switch`), the same client is run against a server without it and shown to hold on.

use crate::common::{repo, report_in, serve_command, Served};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

/// A `kvflow serve` process on the Llama fixture, with the folder it writes its output to.
struct Serving {
    served: Served,
    out: tempfile::TempDir,
}

impl Serving {
    /// `kvflow serve graphs/aggregated-2.toml --port 0 ARGS…` with `env`, once it listens.
    fn start(args: &[&str], env: &[(&str, &str)]) -> Serving {
        let out = tempfile::tempdir().unwrap();
        let mut command = serve_command(&repo().join("graphs/aggregated-2.toml"), out.path(), args);
        command.envs(env.iter().copied());
        Serving { served: Served::spawn(command), out }
    }

    /// The address it listens on (`host:port`).
    fn address(&self) -> &str {
        &self.served.address
    }

    fn connect(&self) -> TcpStream {
        self.served.connect()
    }

    /// One request on a fresh connection that closes after it.
    fn request(&self, method: &str, path: &str, headers: &str, body: &str) -> Answer {
        let mut stream = self.connect();
        let head = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}");
        write!(stream, "{head}Content-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        read_answer(&mut stream).expect("an answer")
    }

    /// SIGTERM; waits for the exit: (status code, stderr, report).
    fn stop(self) -> (i32, String, Value) {
        let (code, stderr) = self.served.stop();
        (code, stderr, report_in(self.out.path()))
    }
}

/// An HTTP answer: its status, head (lower case) and body (de-chunked), and whether the body
/// came whole (not cut by the connection's end).
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: String,
    complete: bool,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {} {}", self.head, self.body))
    }
}

/// Reads one answer off `stream` (by its Content-Length, its chunks, or to the end); None when
/// the connection ends (or the read times out) before a whole head.
fn read_answer(stream: &mut impl Read) -> Option<Answer> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return None,
        }
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let header = |name: &str| {
        head.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(':'))).map(|v| v.trim().to_string())
    };
    let mut body = Vec::new();
    let complete = if let Some(n) = header("content-length") {
        body.resize(n.parse().unwrap(), 0);
        stream.read_exact(&mut body).is_ok()
    } else if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        read_chunks(&mut BufReader::new(stream), &mut body).is_some()
    } else {
        stream.read_to_end(&mut body).is_ok()
    };
    Some(Answer { status, head, body: String::from_utf8_lossy(&body).to_string(), complete })
}

/// Appends a chunked body's data to `body`; None if the connection ends before its last chunk.
fn read_chunks(reader: &mut impl BufRead, body: &mut Vec<u8>) -> Option<()> {
    loop {
        let mut size = String::new();
        reader.read_line(&mut size).ok()?;
        let n = usize::from_str_radix(size.trim(), 16).ok()?;
        let mut chunk = vec![0; n + 2];
        reader.read_exact(&mut chunk).ok()?;
        body.extend_from_slice(&chunk[..n]);
        if n == 0 {
            return Some(());
        }
    }
}

/// How long the server took to close `stream` (a read gives its end), while `feed` is called
/// between reads; None if it is still open after `patience`.
fn closed_after(stream: &mut TcpStream, patience: Duration, mut feed: impl FnMut(&mut TcpStream)) -> Option<Duration> {
    let start = Instant::now();
    stream.set_read_timeout(Some(Duration::from_millis(250))).unwrap();
    let mut sink = [0u8; 4096];
    while start.elapsed() < patience {
        feed(stream);
        match stream.read(&mut sink) {
            Ok(0) => return Some(start.elapsed()),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return Some(start.elapsed()), // reset: closed too
        }
    }
    None
}

const KEY: &str = "kv-test-key-5f1c2a9e";

#[test]
fn without_the_api_key_every_v1_route_answers_401_and_health_and_metrics_stay_open() {
    let served = Serving::start(&["--keep-alive-timeout", "30"], &[("KVFLOW_API_KEY", KEY), ("RUST_LOG", "debug")]);
    let bearer = |key: &str| format!("Authorization: Bearer {key}\r\n");
    for (path, headers) in [
        ("/v1/models", String::new()),
        ("/v1/models", bearer("kv-test-key-5f1c2a9f")),
        ("/v1/models", format!("Authorization: Basic {KEY}\r\n")),
        ("/v1/no-such-route", String::new()),
    ] {
        let answer = served.request("GET", path, &headers, "");
        assert_eq!(answer.status, 401, "{path} {headers}: {answer:?}");
        let error = &answer.json()["error"];
        assert_eq!(
            (error["type"].as_str(), error["code"].as_str()),
            (Some("invalid_request_error"), Some("invalid_api_key"))
        );
        assert!(answer.head.contains("www-authenticate: bearer"), "{}", answer.head);
    }
    let answer = served.request("GET", "/v1/models", &bearer(KEY), "");
    assert_eq!(answer.status, 200, "{answer:?}");
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 3}).to_string();
    let answer = served.request("POST", "/v1/completions", &bearer(KEY), &body);
    assert_eq!((answer.status, answer.json()["usage"]["completion_tokens"].as_u64()), (200, Some(3)), "{answer:?}");
    let answer = served.request("POST", "/v1/completions", "", &body);
    assert_eq!(answer.status, 401, "{answer:?}");
    assert_eq!(served.request("GET", "/health", "", "").status, 200);
    let metrics = served.request("GET", "/metrics", "", "");
    assert_eq!(metrics.status, 200);
    assert!(metrics.body.contains("kvflow:http_requests_refused_total{status=\"401\"} 5"), "{}", metrics.body);
    let (code, stderr, report) = served.stop();
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(report["completed"], 1, "only the request with the key entered a pool: {report}");
    assert!(!stderr.contains(KEY), "the key is never printed, not even at debug level: {stderr}");
    // Nor by --help, which says what stays open.
    let help = Command::new(env!("CARGO_BIN_EXE_kvflow")).args(["serve", "--help"]).env("KVFLOW_API_KEY", KEY).output();
    let help = String::from_utf8_lossy(&help.unwrap().stdout).to_string();
    assert!(help.contains("KVFLOW_API_KEY") && !help.contains(KEY), "{help}");
    assert!(help.contains("/health and /metrics stay open"), "{help}");
}

#[test]
fn the_server_listens_on_127_0_0_1_only_unless_host_says_otherwise() {
    let served = Serving::start(&[], &[]);
    let port = served.address().strip_prefix("127.0.0.1:").unwrap_or_else(|| panic!("bound to {}", served.address()));
    assert_eq!(served.request("GET", "/health", "", "").status, 200);
    // Another address of this machine (all of 127/8 is loopback) finds nothing listening.
    let elsewhere = TcpStream::connect(format!("127.0.0.2:{port}"));
    assert_eq!(elsewhere.map_err(|e| e.kind()).err(), Some(std::io::ErrorKind::ConnectionRefused));
    let (code, stderr, _) = served.stop();
    assert_eq!(code, 0, "{stderr}");
}

/// A certificate authority, and a server certificate for 127.0.0.1 and localhost it signed:
/// (CA PEM, certificate PEM, key PEM).
fn test_certificates() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let mut authority = CertificateParams::new(Vec::<String>::new()).unwrap();
    authority.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    authority.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    authority.distinguished_name.push(DnType::CommonName, "kvflow test authority");
    let authority = CertifiedIssuer::self_signed(authority, KeyPair::generate().unwrap()).unwrap();
    let mut server = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    server.distinguished_name.push(DnType::CommonName, "kvflow test server");
    server.use_authority_key_identifier_extension = true;
    server.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    server.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate().unwrap();
    let certificate = server.signed_by(&key, &authority).unwrap();
    (authority.pem(), certificate.pem(), key.serialize_pem())
}

/// Whether python3 has the `openai` client (else the test says it skipped, unless required).
fn python_has_openai() -> bool {
    let probe = Command::new("python3").args(["-c", "import openai"]).output();
    if probe.is_ok_and(|o| o.status.success()) {
        return true;
    }
    assert!(
        std::env::var_os("KVFLOW_REQUIRE_PY_CLIENTS").is_none(),
        "KVFLOW_REQUIRE_PY_CLIENTS is set, but python3 lacks openai"
    );
    println!("skipped: python3 lacks openai (pip install openai)");
    false
}

#[test]
fn tls_with_a_certificate_made_here_is_verified_by_the_openai_client_which_needs_the_key() {
    if !python_has_openai() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (authority, certificate, key) = test_certificates();
    let file = |name: &str, text: &str| {
        std::fs::write(dir.path().join(name), text).unwrap();
        dir.path().join(name).to_str().unwrap().to_string()
    };
    let (authority, certificate, key) =
        (file("ca.pem", &authority), file("cert.pem", &certificate), file("key.pem", &key));
    let served = Serving::start(&["--ssl-certfile", &certificate, "--ssl-keyfile", &key, "--api-key", KEY], &[]);
    let out = Command::new("python3")
        .arg(repo().join("tools/serve_access_check.py"))
        .args([format!("https://{}", served.address()), authority, KEY.to_string()])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("ok"), "{text}");
    // Plain HTTP on the TLS port gets no HTTP answer.
    let mut plain = served.connect();
    write!(plain, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut reply = Vec::new();
    let _ = plain.read_to_end(&mut reply);
    assert!(!String::from_utf8_lossy(&reply).contains("200 OK"), "{reply:?}");
    let (code, stderr, report) = served.stop();
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(report["completed"], 1, "{report}");
}

#[test]
fn bad_tls_files_are_refused_before_serving_naming_the_flag_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (_, certificate, key) = test_certificates();
    let (_, _, other_key) = test_certificates();
    let path = |name: &str, text: Option<&str>| {
        let path = dir.path().join(name);
        if let Some(text) = text {
            std::fs::write(&path, text).unwrap();
        }
        path.to_str().unwrap().to_string()
    };
    let (cert, key, other_key) =
        (path("cert.pem", Some(&certificate)), path("key.pem", Some(&key)), path("other.pem", Some(&other_key)));
    let (missing, garbage) = (path("missing.pem", None), path("garbage.pem", Some("not a PEM file\n")));
    let cases: [(Vec<&str>, String); 6] = [
        (vec!["--ssl-certfile", &cert], "--ssl-keyfile".to_string()),
        (vec!["--ssl-keyfile", &key], "--ssl-certfile".to_string()),
        (vec!["--ssl-certfile", &missing, "--ssl-keyfile", &key], format!("--ssl-certfile {missing}: cannot read it")),
        (
            vec!["--ssl-certfile", &garbage, "--ssl-keyfile", &key],
            format!("--ssl-certfile {garbage}: no certificate in it"),
        ),
        (
            vec!["--ssl-certfile", &cert, "--ssl-keyfile", &garbage],
            format!("--ssl-keyfile {garbage}: no private key in it"),
        ),
        (
            vec!["--ssl-certfile", &cert, "--ssl-keyfile", &other_key],
            format!("--ssl-certfile {cert} with --ssl-keyfile {other_key}"),
        ),
    ];
    for (flags, expected) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_kvflow"))
            .args(["serve", repo().join("graphs/aggregated-2.toml").to_str().unwrap(), "--port", "0"])
            .args(&flags)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} was accepted");
        assert!(
            stderr.contains(&expected) && !stderr.contains("panicked"),
            "{flags:?}: expected {expected:?} in {stderr}"
        );
    }
}

/// Starts `kvflow serve ARGS…` twice, the second with `--test-switch SWITCH` (the mechanism
/// under test removed), and runs `client` on both at once: what it found with the mechanism and
/// without, and the first server's stderr; each server stops cleanly.
fn with_and_without<T: Send>(args: &[&str], switch: &str, client: impl Fn(&Serving) -> T + Sync) -> (T, T, String) {
    let (with, without, [(stderr, _), _]) = with_and_without_reports(args, switch, client);
    (with, without, stderr)
}

/// [`with_and_without`], with each server's stderr and report.
fn with_and_without_reports<T: Send>(
    args: &[&str],
    switch: &str,
    client: impl Fn(&Serving) -> T + Sync,
) -> (T, T, [(String, Value); 2]) {
    let with = Serving::start(args, &[]);
    let without = Serving::start(&[args, &["--test-switch", switch]].concat(), &[]);
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| client(&with));
        let b = s.spawn(|| client(&without));
        (a.join().unwrap(), b.join().unwrap())
    });
    let (code, stderr, report) = with.stop();
    assert_eq!(code, 0, "{stderr}");
    let (code, other, other_report) = without.stop();
    assert_eq!(code, 0, "{other}");
    (a, b, [(stderr, report), (other, other_report)])
}

#[test]
fn connections_sending_their_headers_a_byte_a_second_are_closed_at_the_header_read_timeout() {
    let request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n";
    let args = ["--header-read-timeout", "2", "--keep-alive-timeout", "30"];
    let (with, without, _) = with_and_without(&args, "no-header-read-timeout", |served| {
        let slow: Vec<_> = (0..10)
            .map(|_| {
                let mut stream = served.connect();
                std::thread::spawn(move || {
                    let (mut sent, mut last) = (0, Instant::now() - Duration::from_secs(1));
                    closed_after(&mut stream, Duration::from_secs(7), |s| {
                        if last.elapsed() >= Duration::from_secs(1) {
                            let _ = s.write_all(&request[sent % request.len()..][..1]);
                            (sent, last) = (sent + 1, Instant::now());
                        }
                    })
                })
            })
            .collect();
        slow.into_iter().map(|t| t.join().unwrap()).collect::<Vec<_>>()
    });
    for closed in with {
        let closed = closed.expect("a slow connection was never closed");
        assert!(closed >= Duration::from_millis(1500) && closed < Duration::from_secs(5), "{closed:?}");
    }
    assert!(without.iter().all(Option::is_none), "without the timeout they are held: {without:?}");
}

#[test]
fn a_declared_body_that_never_arrives_gets_408_at_the_body_read_timeout() {
    let args = ["--body-read-timeout", "2", "--keep-alive-timeout", "1"];
    let (with, without, _) = with_and_without(&args, "no-body-read-timeout", |served| {
        let mut stream = served.connect();
        stream.set_read_timeout(Some(Duration::from_secs(6))).unwrap();
        let start = Instant::now();
        write!(stream, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{{\"prompt\": [1")
            .unwrap();
        let answer = read_answer(&mut stream);
        let closed = answer.is_some() && closed_after(&mut stream, Duration::from_secs(2), |_| {}).is_some();
        (answer, start.elapsed(), closed)
    });
    let (answer, took, closed) = with;
    let answer = answer.expect("the body's client got no answer");
    assert_eq!(answer.status, 408, "{answer:?}");
    assert!(took >= Duration::from_millis(1500) && took < Duration::from_secs(5), "{took:?}");
    let error = &answer.json()["error"];
    assert_eq!(error["code"], "request_timeout");
    let message = error["message"].as_str().unwrap();
    assert!(message.contains("--body-read-timeout") && message.contains("13 bytes of the 1000 declared"), "{message}");
    assert!(closed && answer.head.contains("connection: close"), "then the connection is closed: {answer:?}");
    assert!(without.0.is_none(), "without the timeout nothing comes in 6 s: {:?}", without.0);
}

#[test]
fn an_idle_keep_alive_connection_is_closed_at_the_keep_alive_timeout_but_not_before() {
    let args = ["--keep-alive-timeout", "1.5", "--header-read-timeout", "60"];
    let (with, without, _) = with_and_without(&args, "no-keep-alive-timeout", |served| {
        let mut used = served.connect();
        let mut asked = || {
            write!(used, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            read_answer(&mut used).map(|a| a.status)
        };
        // Kept alive across requests closer together than the timeout.
        let statuses = [asked(), asked()];
        std::thread::sleep(Duration::from_millis(700));
        let statuses = [statuses[0], statuses[1], asked()];
        let used_closed = closed_after(&mut used, Duration::from_secs(5), |_| {});
        // A connection that never sends anything.
        let mut silent = served.connect();
        let silent_closed = closed_after(&mut silent, Duration::from_secs(5), |_| {});
        (statuses, used_closed, silent_closed)
    });
    assert_eq!(with.0, [Some(200); 3]);
    assert_eq!(without.0, [Some(200); 3]);
    for closed in [with.1, with.2] {
        let closed = closed.expect("an idle connection was never closed");
        assert!(closed >= Duration::from_millis(1000) && closed < Duration::from_secs(4), "{closed:?}");
    }
    assert_eq!((without.1, without.2), (None, None), "without the timeout idle connections stay");
}

#[test]
fn connections_over_the_cap_get_503_with_retry_after_while_those_within_it_are_served() {
    let args = ["--max-connections", "3", "--keep-alive-timeout", "60", "--header-read-timeout", "60"];
    let (with, without, stderr) = with_and_without(&args, "no-connection-cap", |served| {
        let health = |stream: &mut TcpStream| {
            write!(stream, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            read_answer(stream).expect("an answer")
        };
        let mut held: Vec<TcpStream> = (0..3).map(|_| served.connect()).collect();
        let within: Vec<u16> = held.iter_mut().map(|s| health(s).status).collect();
        let over: Vec<Answer> = (0..20).map(|_| health(&mut served.connect())).collect();
        let still: Vec<u16> = held.iter_mut().map(|s| health(s).status).collect();
        // One of the held connections closes: a new one is served (once the server saw it go).
        drop(held.pop());
        let deadline = Instant::now() + Duration::from_secs(10);
        let after = loop {
            let status = health(&mut served.connect()).status;
            if status == 200 || Instant::now() > deadline {
                break status;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        (within, over, still, after)
    });
    let (within, over, still, after) = with;
    assert_eq!((within, still, after), (vec![200; 3], vec![200; 3], 200));
    for answer in &over {
        assert_eq!(answer.status, 503, "{answer:?}");
        assert!(answer.head.contains("retry-after: 1") && answer.head.contains("connection: close"), "{answer:?}");
        let error = &answer.json()["error"];
        assert_eq!(error["code"], "too_many_connections");
        assert!(error["message"].as_str().unwrap().contains("--max-connections"), "{error}");
    }
    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("over --max-connections 3")).collect();
    assert!(!lines.is_empty() && lines.len() <= 2, "logged, at most once per 10 s and at the stop: {lines:?}");
    let counted: u64 =
        lines.iter().filter_map(|l| l.split("refused ").nth(1)?.split(' ').next()?.parse::<u64>().ok()).sum();
    assert!(counted >= 20, "every refusal counted: {lines:?}");
    assert!(without.1.iter().all(|a| a.status == 200), "without the cap all are served");
}

#[test]
fn a_client_that_half_closes_after_its_body_gets_its_whole_answer_and_is_not_cancelled() {
    let (with, without, [(stderr, report), (_, switched_report)]) =
        with_and_without_reports(&[], "no-half-close", |served| {
            [false, true].map(|stream| {
                let body = json!({"prompt": [1, 2, 3], "max_tokens": 200, "stream": stream}).to_string();
                let mut s = served.connect();
                let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n";
                write!(s, "{head}Content-Length: {}\r\n\r\n{body}", body.len()).unwrap();
                s.shutdown(Shutdown::Write).unwrap(); // as `nc -N` does
                read_answer(&mut s)
            })
        });
    let [whole, streamed] = with.map(|a| a.expect("a half-closed client got an empty reply"));
    assert!(whole.complete && streamed.complete, "{whole:?} {streamed:?}");
    assert_eq!((whole.status, whole.json()["usage"]["completion_tokens"].as_u64()), (200, Some(200)), "{whole:?}");
    let data: Vec<&str> = streamed.body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!((streamed.status, data.last()), (200, Some(&"[DONE]")), "{streamed:?}");
    assert_eq!((report["completed"].as_u64(), report["cancelled"].as_u64()), (Some(2), Some(0)), "{report}\n{stderr}");
    // Without half-close support the end of the client's input ends the connection: no reply
    // (or, streamed, its head and then nothing), and its requests cancelled as if it had left.
    assert!(without.iter().all(|a| a.as_ref().is_none_or(|a| !a.complete)), "{without:?}");
    assert_eq!(switched_report["completed"].as_u64(), Some(0), "{switched_report}");
}

#[test]
fn a_body_over_the_limit_gets_413_as_an_openai_error_stating_the_limit() {
    let served = Serving::start(&[], &[]);
    let limit = 2 << 20;
    let prompt = "a".repeat(limit);
    let body = json!({"prompt": prompt, "max_tokens": 3}).to_string();
    let refusals = [
        format!("Content-Length: {}\r\n\r\n", body.len()),
        "Transfer-Encoding: chunked\r\n\r\n".to_string(),
        format!("Content-Length: {}\r\nExpect: 100-continue\r\n\r\n", body.len()),
    ];
    for (case, framing) in refusals.iter().enumerate() {
        let mut stream = served.connect();
        let mut writer = stream.try_clone().unwrap();
        let head = format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{framing}");
        let body = body.clone();
        // The client sends its whole body (but for the one that waits for a 100) as it reads.
        let sending = std::thread::spawn(move || {
            writer.write_all(head.as_bytes())?;
            match case {
                0 => writer.write_all(body.as_bytes()),
                1 => body
                    .as_bytes()
                    .chunks(64 << 10)
                    .try_for_each(|c| {
                        write!(writer, "{:x}\r\n", c.len())?;
                        writer.write_all(c)?;
                        writer.write_all(b"\r\n")
                    })
                    .and_then(|()| writer.write_all(b"0\r\n\r\n")),
                _ => Ok(()),
            }
        });
        let answer = read_answer(&mut stream).expect("an answer");
        let _ = sending.join().unwrap();
        assert_eq!(answer.status, 413, "case {case}: {answer:?}");
        let error = &answer.json()["error"];
        assert_eq!(
            (error["type"].as_str(), error["code"].as_str()),
            (Some("invalid_request_error"), Some("request_too_large"))
        );
        let message = error["message"].as_str().unwrap();
        assert!(message.contains(&format!("over the {limit} bytes (2.0 MiB) this server takes")), "{message}");
    }
    // A body at the limit is read whole (and refused by the handler only for what it says).
    let at_limit = json!({"prompt": [1, 2, 3], "max_tokens": 3, "user": "b".repeat(limit - 60)}).to_string();
    assert!(at_limit.len() <= limit);
    let answer = served.request("POST", "/v1/completions", "Content-Type: application/json\r\n", &at_limit);
    assert_ne!(answer.status, 413, "{}", answer.head);
    let (code, stderr, _) = served.stop();
    assert_eq!(code, 0, "{stderr}");
}
