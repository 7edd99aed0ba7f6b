//! The router layer that reads a request's whole body before its handler runs, against two
//! limits: its size (`MAX_BODY_BYTES`: over it, 413 stating the limit) and its time
//! (`--body-read-timeout` from the end of the headers: a declared body that does not arrive gets
//! 408). Both answer with an OpenAI error object and close the connection, whose unread rest
//! cannot be told from a next request. An oversized body is still read, and dropped, up to as
//! much again as the limit, so the client (which is still sending) reads the answer rather than
//! a reset.

use super::access::RefusedEarly;
use super::openai::ApiError;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use std::time::Duration;

/// The body limits of one server.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimits {
    pub max_bytes: usize,
    /// None: a body may take for ever (`--body-read-timeout 0`, or the test switch).
    pub read_timeout: Option<Duration>,
}

/// How reading a body ended.
enum BodyEnd {
    Whole,
    OverLimit,
    /// The client's stream broke (it left, or its chunked encoding is bad).
    Broken(String),
}

/// Reads `body` into `kept`, counting every byte in `seen`; past `max` bytes it keeps
/// nothing more and reads on (dropping) until the end or twice the limit.
async fn read_body(body: Body, max: usize, kept: &mut Vec<u8>, seen: &mut u64) -> BodyEnd {
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(e) => return BodyEnd::Broken(e.to_string()),
        };
        *seen += chunk.len() as u64;
        if *seen > 2 * max as u64 {
            return BodyEnd::OverLimit;
        }
        if *seen <= max as u64 {
            kept.extend_from_slice(&chunk);
        }
    }
    if *seen > max as u64 {
        BodyEnd::OverLimit
    } else {
        BodyEnd::Whole
    }
}

fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// A refusal that closes the connection.
fn refuse(status: StatusCode, code: &str, message: String) -> Response {
    let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
    let mut response = ApiError::new(status, kind, code, message).into_response();
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    response.extensions_mut().insert(RefusedEarly);
    response
}

fn too_large(max: usize, size: String) -> Response {
    let message = format!(
        "the request body ({size}) is over the {max} bytes ({:.1} MiB) this server takes",
        max as f64 / (1 << 20) as f64
    );
    refuse(StatusCode::PAYLOAD_TOO_LARGE, "request_too_large", message)
}

/// The layer: the handler gets the whole body, or the client a 408, 413 or 400.
pub async fn read_whole_body(State(limits): State<BodyLimits>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let declared = declared_length(&parts.headers);
    let expects_continue =
        parts.headers.get(header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if let Some(n) = declared.filter(|&n| n > limits.max_bytes as u64) {
        // Nothing of it has been sent yet (the client waits for a 100), or draining it would
        // cost more than the limit: answer at once.
        if expects_continue || n > 2 * limits.max_bytes as u64 {
            return too_large(limits.max_bytes, format!("{n} bytes declared"));
        }
    }
    let (mut kept, mut seen) = (Vec::new(), 0u64);
    let reading = read_body(body, limits.max_bytes, &mut kept, &mut seen);
    let end = match limits.read_timeout {
        None => reading.await,
        Some(limit) => match tokio::time::timeout(limit, reading).await {
            Ok(end) => end,
            Err(_) => {
                let of = declared.map(|n| format!(" of the {n} declared")).unwrap_or_default();
                let message = format!(
                    "the request body did not arrive within {:.1} s of its headers (the server's \
                     --body-read-timeout): {seen} bytes{of} came",
                    limit.as_secs_f64()
                );
                return refuse(StatusCode::REQUEST_TIMEOUT, "request_timeout", message);
            }
        },
    };
    match end {
        BodyEnd::Whole => next.run(Request::from_parts(parts, Body::from(kept))).await,
        BodyEnd::OverLimit => too_large(limits.max_bytes, format!("at least {seen} bytes")),
        BodyEnd::Broken(why) => {
            refuse(StatusCode::BAD_REQUEST, "bad_body", format!("the request body could not be read: {why}"))
        }
    }
}
