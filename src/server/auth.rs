//! `kvflow serve --api-key KEY` (or `KVFLOW_API_KEY`, an [`ApiKey`]), as vLLM's `--api-key`: every `/v1/*`
//! route then needs `Authorization: Bearer KEY`, and answers 401 with an OpenAI error object
//! otherwise; `/health` and `/metrics` stay open. The server keeps only the key's SHA-256 and
//! compares digests in constant time (equal lengths, every byte looked at), so neither the
//! comparison's time nor any print of the options tells anything about the key.

use super::access::{ApiKey, RefusedEarly};
use super::openai::ApiError;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// The token of an `Authorization: Bearer TOKEN` header (the scheme in any case), if there is one.
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| token.trim_ascii())
}

/// The router layer: a `/v1/*` request goes on only with the key; anything else goes on.
pub async fn require_key(State(key): State<Arc<ApiKey>>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    if path != "/v1" && !path.starts_with("/v1/") {
        return next.run(request).await;
    }
    let message = match bearer(request.headers()) {
        Some(token) if key.matches(token) => return next.run(request).await,
        Some(_) => "Incorrect API key provided (the key given to the server's --api-key or KVFLOW_API_KEY).",
        None => {
            "You didn't provide an API key: send it as `Authorization: Bearer KEY` (the key given to the \
                 server's --api-key or KVFLOW_API_KEY)."
        }
    };
    let refusal = ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", "invalid_api_key", message);
    let mut response = refusal.into_response();
    response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response.extensions_mut().insert(RefusedEarly);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_key_itself_matches_and_debug_shows_none_of_it() {
        let key = ApiKey::parse("sk-test-123").unwrap();
        assert!(key.matches(b"sk-test-123"));
        for other in [&b""[..], b"sk-test-12", b"sk-test-1234", b"SK-TEST-123", b"sk-test-124"] {
            assert!(!key.matches(other), "{other:?}");
        }
        assert_eq!(format!("{key:?}"), "ApiKey(<hidden>)");
        assert!(ApiKey::parse("").is_err());
        assert!(ApiKey::parse("two words").is_err());
    }

    #[test]
    fn the_bearer_token_is_read_in_any_case_of_the_scheme() {
        let mut headers = HeaderMap::new();
        assert_eq!(bearer(&headers), None);
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("bearer  k1 "));
        assert_eq!(bearer(&headers), Some(&b"k1"[..]));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic k1"));
        assert_eq!(bearer(&headers), None);
    }
}
