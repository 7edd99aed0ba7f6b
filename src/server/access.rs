//! What `kvflow serve` asks of a client before its request reaches a handler: the API key, TLS,
//! how long a connection may take over its headers, its body and its idle keep-alive, how many
//! connections may be open at once and how large a body may be. And the test switches that
//! remove one of those mechanisms each, so a test can show that its check fails without it.

use ring::digest::{digest, SHA256};
use std::sync::Arc;
use std::time::Duration;
use subtle::ConstantTimeEq;

/// The largest request body taken (axum's own default limit, kept): a bigger one gets 413.
pub const MAX_BODY_BYTES: usize = 2 << 20;

/// The most connections `--max-connections` may allow (the accept loop counts them in `u32`s).
pub const MAX_CONNECTIONS: usize = 1 << 20;

/// The connection limits and credentials of one server. A zero duration means "no limit".
#[derive(Clone)]
pub struct Access {
    /// `--api-key`: every `/v1/*` route needs it.
    pub api_key: Option<ApiKey>,
    /// `--ssl-certfile` and `--ssl-keyfile`, loaded: the server speaks HTTPS.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// From a connection's start, or the end of its last answer, to the end of the next
    /// request's headers (also the TLS handshake's limit).
    pub header_read_timeout: Duration,
    /// From the end of a request's headers to the end of its body.
    pub body_read_timeout: Duration,
    /// How long a connection may sit with no request in flight and no byte moving.
    pub keep_alive_timeout: Duration,
    pub max_connections: usize,
    pub max_body_bytes: usize,
    pub switches: ServeSwitches,
}

impl Default for Access {
    fn default() -> Self {
        Access {
            api_key: None,
            tls: None,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            keep_alive_timeout: Duration::from_secs(5),
            max_connections: 512,
            max_body_bytes: MAX_BODY_BYTES,
            switches: ServeSwitches::default(),
        }
    }
}

impl std::fmt::Debug for Access {
    // The key's own Debug prints no part of it; the TLS config only whether there is one.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Access")
            .field("api_key", &self.api_key)
            .field("tls", &self.tls.is_some())
            .field("header_read_timeout", &self.header_read_timeout)
            .field("body_read_timeout", &self.body_read_timeout)
            .field("keep_alive_timeout", &self.keep_alive_timeout)
            .field("max_connections", &self.max_connections)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("switches", &self.switches)
            .finish()
    }
}

/// A limit of `duration`, or none for zero (the flags' "0: no limit").
pub fn limit(duration: Duration) -> Option<Duration> {
    (!duration.is_zero()).then_some(duration)
}

impl Access {
    pub fn header_read_limit(&self) -> Option<Duration> {
        limit(self.header_read_timeout).filter(|_| !self.switches.no_header_read_timeout)
    }

    pub fn body_read_limit(&self) -> Option<Duration> {
        limit(self.body_read_timeout).filter(|_| !self.switches.no_body_read_timeout)
    }

    pub fn keep_alive_limit(&self) -> Option<Duration> {
        limit(self.keep_alive_timeout).filter(|_| !self.switches.no_keep_alive_timeout)
    }

    /// The cap the accept loop holds to (without the cap: [`MAX_CONNECTIONS`]).
    pub fn connection_cap(&self) -> usize {
        if self.switches.no_connection_cap {
            MAX_CONNECTIONS
        } else {
            self.max_connections.min(MAX_CONNECTIONS)
        }
    }
}

/// An API key, held as its digest (the key itself is not kept).
#[derive(Clone)]
pub struct ApiKey {
    digest: [u8; 32],
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<hidden>)")
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0; 32];
    out.copy_from_slice(digest(&SHA256, bytes).as_ref());
    out
}

impl ApiKey {
    /// `--api-key`'s parser: any non-empty text of visible characters (what fits in a header).
    pub fn parse(text: &str) -> Result<ApiKey, String> {
        if text.is_empty() {
            return Err(
                "an empty key would let anyone in: give a key, or leave --api-key and KVFLOW_API_KEY out".into()
            );
        }
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("a key is visible ASCII characters without spaces (it travels in an HTTP header)".into());
        }
        Ok(ApiKey { digest: sha256(text.as_bytes()) })
    }

    /// Whether `presented` is the key, in time independent of where they differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        bool::from(sha256(presented).ct_eq(&self.digest))
    }
}

/// Marks a response that refused a request before a handler saw it (401, 408, 413): the
/// router's outer layer counts these in `/metrics`' refusals.
#[derive(Clone, Copy, Debug)]
pub struct RefusedEarly;

/// Test only (`kvflow serve --test-switch NAME`): each removes one mechanism of this module.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServeSwitches {
    /// Connections may take for ever over their headers.
    pub no_header_read_timeout: bool,
    /// A declared body may take for ever to arrive.
    pub no_body_read_timeout: bool,
    /// Idle keep-alive connections stay open.
    pub no_keep_alive_timeout: bool,
    /// Any number of connections may be open.
    pub no_connection_cap: bool,
    /// A client's end of input (its half-close) ends the connection and cancels its request.
    pub no_half_close: bool,
}

impl ServeSwitches {
    /// Sets the switch NAME (the field's name with dashes).
    pub fn set_from(&mut self, name: &str) -> Result<(), String> {
        let switch = match name {
            "no-header-read-timeout" => &mut self.no_header_read_timeout,
            "no-body-read-timeout" => &mut self.no_body_read_timeout,
            "no-keep-alive-timeout" => &mut self.no_keep_alive_timeout,
            "no-connection-cap" => &mut self.no_connection_cap,
            "no-half-close" => &mut self.no_half_close,
            _ => {
                return Err(format!(
                    "unknown serve test switch {name:?} (expected no-header-read-timeout, no-body-read-timeout, \
                     no-keep-alive-timeout, no-connection-cap or no-half-close)"
                ))
            }
        };
        *switch = true;
        Ok(())
    }
}
