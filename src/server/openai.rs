//! The OpenAI request bodies `kvflow serve` takes, checked field by field (a bad one is a 400
//! naming it), and the JSON it answers with: completions and chat completions, whole or as
//! server-sent chunks, and OpenAI error objects. Each choice also carries `token_ids` (as vLLM's
//! `return_token_ids` does), so a client can compare ids exactly.

use crate::text::{ChatMessage, TextModel};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvflow_kernels::cpu::sampling::{check_temperature, check_top_p, RequestSampling};
use serde_json::{json, Map, Value};

/// An OpenAI error object with its HTTP status.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<String>,
}

impl ApiError {
    /// A 400 for field `param` (the body's, by its JSON name).
    pub fn field(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("{param}: {}", message.into()),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }

    pub fn new(status: StatusCode, kind: &'static str, code: &str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: Some(code.to_string()) }
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// A request, checked: what enters the pool and how to answer.
#[derive(Clone, Debug)]
pub struct Ask {
    pub endpoint: Endpoint,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: RequestSampling,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk carries `usage`.
    pub include_usage: bool,
    /// Strings that end the output (it is cut before them).
    pub stop: Vec<String>,
}

/// What a request is checked against.
pub struct Limits<'a> {
    pub text: Option<&'a TextModel>,
    pub model_name: &'a str,
    pub vocab_size: usize,
    /// The longest prompt plus outputs served.
    pub max_context: usize,
    /// `[serve] max_tokens`: a chat's outputs when it names none.
    pub max_tokens: usize,
    /// `[sampling]`: a request's sampling when it names none.
    pub sampling: RequestSampling,
    /// The longest prompt text tokenized ([`TextModel::max_prompt_bytes`]): a longer one has
    /// more tokens than the context, so it is refused before the work of tokenizing it.
    pub max_prompt_bytes: Option<usize>,
}

/// At most this many stop strings (as OpenAI).
const MAX_STOP_STRINGS: usize = 4;

/// Checks `body` for `endpoint`, field by field in a fixed order (the first bad one is named).
pub fn parse(endpoint: Endpoint, body: &[u8], limits: &Limits) -> Result<Ask, ApiError> {
    let obj = json_object(body)?;
    check_model(&obj, limits)?;
    check_unsupported(&obj)?;
    let prompt = match endpoint {
        Endpoint::Completions => completion_prompt(obj.get("prompt"), limits)?,
        Endpoint::Chat => chat_prompt(obj.get("messages"), limits)?,
    };
    let prompt_field = if endpoint == Endpoint::Chat { "messages" } else { "prompt" };
    if prompt.len() >= limits.max_context {
        return Err(ApiError::field(
            prompt_field,
            format!(
                "{} prompt tokens; this server serves at most {} tokens of prompt and output together",
                prompt.len(),
                limits.max_context
            ),
        ));
    }
    let max_tokens = max_tokens(&obj, endpoint, prompt.len(), limits)?;
    let sampling = sampling(&obj, limits)?;
    let (stream, include_usage) = streaming(&obj)?;
    let stop = stop_strings(&obj, limits)?;
    Ok(Ask { endpoint, prompt, max_tokens, sampling, stream, include_usage, stop })
}

/// The body as a JSON object.
fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| ApiError {
        status: StatusCode::BAD_REQUEST,
        message: format!("the body is not JSON: {e}"),
        kind: "invalid_request_error",
        param: None,
        code: None,
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_body",
            "the body must be a JSON object",
        ));
    };
    Ok(obj)
}

/// `model`, when given, names the model this server serves (else 404 `model_not_found`).
fn check_model(obj: &Map<String, Value>, limits: &Limits) -> Result<(), ApiError> {
    if let Some(model) = obj.get("model") {
        let name = model.as_str().ok_or_else(|| ApiError::field("model", "expected a string"))?;
        if name != limits.model_name {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("The model `{name}` does not exist; this server serves `{}`", limits.model_name),
                kind: "invalid_request_error",
                param: Some("model".into()),
                code: Some("model_not_found".into()),
            });
        }
    }
    Ok(())
}

/// Fields kvflow does not serve are refused when set (and `n`, `best_of` unless 1).
fn check_unsupported(obj: &Map<String, Value>) -> Result<(), ApiError> {
    for unsupported in ["logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias"] {
        if obj.get(unsupported).is_some_and(|v| !v.is_null() && *v != Value::Bool(false)) {
            return Err(ApiError::field(unsupported, "not supported by kvflow serve"));
        }
    }
    for one in ["n", "best_of"] {
        if let Some(n) = obj.get(one).filter(|v| !v.is_null()) {
            if n.as_u64() != Some(1) {
                return Err(ApiError::field(one, format!("only 1 is supported, got {n}")));
            }
        }
    }
    Ok(())
}

/// The outputs asked for (`max_completion_tokens` for a chat, else `max_tokens`), within the
/// room the context leaves after `prompt_len` tokens; when none is asked, 16 for a completion
/// and `[serve] max_tokens` for a chat (each cut to the room).
fn max_tokens(
    obj: &Map<String, Value>,
    endpoint: Endpoint,
    prompt_len: usize,
    limits: &Limits,
) -> Result<usize, ApiError> {
    let (max_key, asked) = match (obj.get("max_completion_tokens").filter(|v| !v.is_null()), endpoint) {
        (Some(v), Endpoint::Chat) => ("max_completion_tokens", Some(v)),
        _ => ("max_tokens", obj.get("max_tokens").filter(|v| !v.is_null())),
    };
    let room = limits.max_context - prompt_len;
    Ok(match asked {
        Some(v) => {
            let n =
                v.as_u64().filter(|&n| n >= 1).ok_or_else(|| ApiError::field(max_key, "expected an integer ≥ 1"))?;
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            if n > room {
                return Err(ApiError::field(
                    max_key,
                    format!(
                        "{n} output tokens after {prompt_len} prompt tokens exceed this server's context of {} tokens",
                        limits.max_context
                    ),
                ));
            }
            n
        }
        None if endpoint == Endpoint::Completions => 16.min(room),
        None => limits.max_tokens.min(room),
    })
}

/// The server's `[sampling]` with the request's `temperature`, `top_p`, `top_k` and `seed` over it.
fn sampling(obj: &Map<String, Value>, limits: &Limits) -> Result<RequestSampling, ApiError> {
    let mut sampling = limits.sampling;
    if let Some(v) = obj.get("temperature").filter(|v| !v.is_null()) {
        let t = v.as_f64().filter(|t| (0.0..=2.0).contains(t)).ok_or_else(|| {
            ApiError::field("temperature", format!("expected a number from 0 to 2 (as OpenAI), got {v}"))
        })?;
        sampling.params.temperature = check_temperature(t).map_err(|e| ApiError::field("temperature", e))?;
    }
    if let Some(v) = obj.get("top_p").filter(|v| !v.is_null()) {
        let p = v.as_f64().ok_or_else(|| ApiError::field("top_p", "expected a number"))?;
        sampling.params.top_p = check_top_p(p).map_err(|e| ApiError::field("top_p", e))?;
    }
    if let Some(v) = obj.get("top_k").filter(|v| !v.is_null()) {
        let k = v.as_i64().filter(|&k| k >= -1).ok_or_else(|| ApiError::field("top_k", "expected an integer ≥ -1"))?;
        sampling.params.top_k = usize::try_from(k.max(0)).unwrap_or(0);
    }
    if let Some(v) = obj.get("seed").filter(|v| !v.is_null()) {
        // Any integer OpenAI takes: 0 to 2^64 − 1, and negative ones (taken as their two's
        // complement, as before).
        sampling.seed = v
            .as_u64()
            .or_else(|| v.as_i64().map(|s| s as u64))
            .ok_or_else(|| ApiError::field("seed", format!("expected an integer from -2^63 to 2^64 - 1, got {v}")))?;
    }
    Ok(sampling)
}

/// `stream`, and `stream_options.include_usage` (only with `stream`).
fn streaming(obj: &Map<String, Value>) -> Result<(bool, bool), ApiError> {
    let stream = match obj.get("stream").filter(|v| !v.is_null()) {
        Some(v) => v.as_bool().ok_or_else(|| ApiError::field("stream", "expected true or false"))?,
        None => false,
    };
    let include_usage = match obj.get("stream_options").filter(|v| !v.is_null()) {
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(v) => v.as_bool().ok_or_else(|| ApiError::field("stream_options.include_usage", "expected a bool"))?,
        },
        Some(_) => return Err(ApiError::field("stream_options", "expected an object")),
        None => false,
    };
    if include_usage && !stream {
        return Err(ApiError::field("stream_options", "only allowed with stream = true"));
    }
    Ok((stream, include_usage))
}

/// `stop`: a string or up to `MAX_STOP_STRINGS` non-empty ones, for a model with a tokenizer.
fn stop_strings(obj: &Map<String, Value>, limits: &Limits) -> Result<Vec<String>, ApiError> {
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(String::from).ok_or_else(|| ApiError::field("stop", "expected strings")))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(ApiError::field("stop", "expected a string or a list of strings")),
    };
    if stop.len() > MAX_STOP_STRINGS || stop.iter().any(String::is_empty) {
        return Err(ApiError::field("stop", format!("at most {MAX_STOP_STRINGS} non-empty strings")));
    }
    if !stop.is_empty() && limits.text.is_none() {
        return Err(ApiError::field("stop", "this model has no tokenizer, so its output has no text to stop on"));
    }
    Ok(stop)
}

fn completion_prompt(value: Option<&Value>, limits: &Limits) -> Result<Vec<u32>, ApiError> {
    let ids = match value {
        None | Some(Value::Null) => return Err(ApiError::field("prompt", "missing")),
        Some(Value::String(text)) => encode("prompt", text, limits)?,
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(text)] => encode("prompt", text, limits)?,
            [Value::Array(ids)] => token_ids(ids, limits)?,
            ids if ids.iter().all(Value::is_number) => token_ids(ids, limits)?,
            _ => {
                return Err(ApiError::field(
                    "prompt",
                    "expected a string, or one list of token ids (batches of prompts are not supported)",
                ))
            }
        },
        Some(_) => return Err(ApiError::field("prompt", "expected a string or a list of token ids")),
    };
    if ids.is_empty() {
        return Err(ApiError::field("prompt", "empty"));
    }
    Ok(ids)
}

fn token_ids(values: &[Value], limits: &Limits) -> Result<Vec<u32>, ApiError> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64().filter(|&t| (t as usize) < limits.vocab_size).map(|t| t as u32).ok_or_else(|| {
                ApiError::field(
                    "prompt",
                    format!("token {i} ({v}) is not an id below the vocabulary of {}", limits.vocab_size),
                )
            })
        })
        .collect()
}

fn encode(field: &str, text: &str, limits: &Limits) -> Result<Vec<u32>, ApiError> {
    let model = limits.text.ok_or_else(|| {
        ApiError::field(field, "this model has no tokenizer (no tokenizer.json or GGUF vocabulary): send token ids")
    })?;
    check_prompt_bytes(field, text, model, limits)?;
    model.encode(text).map_err(|e| ApiError::field(field, e.to_string()))
}

/// A prompt text longer than `limits.max_prompt_bytes` is refused untokenized (400).
fn check_prompt_bytes(field: &str, text: &str, model: &TextModel, limits: &Limits) -> Result<(), ApiError> {
    match limits.max_prompt_bytes {
        Some(max) if text.len() > max => Err(ApiError::field(
            field,
            format!(
                "{} bytes of prompt text; this server takes at most {max} bytes (its context of {} tokens × {} \
                 bytes, the longest token of its vocabulary)",
                text.len(),
                limits.max_context,
                model.max_token_bytes().unwrap_or(0)
            ),
        )),
        _ => Ok(()),
    }
}

fn chat_prompt(value: Option<&Value>, limits: &Limits) -> Result<Vec<u32>, ApiError> {
    let Some(Value::Array(items)) = value else {
        return Err(ApiError::field("messages", "expected a list of {role, content} messages"));
    };
    if items.is_empty() {
        return Err(ApiError::field("messages", "empty"));
    }
    let mut messages = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = |what: &str| format!("messages[{i}].{what}");
        let Value::Object(m) = item else {
            return Err(ApiError::field(&format!("messages[{i}]"), "expected an object"));
        };
        let role =
            m.get("role").and_then(Value::as_str).ok_or_else(|| ApiError::field(&at("role"), "expected a string"))?;
        if !["system", "user", "assistant", "developer", "tool"].contains(&role) {
            return Err(ApiError::field(&at("role"), format!("unknown role {role:?}")));
        }
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(Value::Array(parts)) => parts
                .iter()
                .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(text)) => Ok(text),
                    _ => Err(ApiError::field(
                        &at("content"),
                        "only text parts ({\"type\": \"text\", \"text\": …}) are supported",
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?
                .concat(),
            Some(_) => return Err(ApiError::field(&at("content"), "expected a string or a list of text parts")),
        };
        messages.push(ChatMessage { role: if role == "developer" { "system".into() } else { role.into() }, content });
    }
    let model = limits.text.ok_or_else(|| {
        ApiError::field("messages", "this model has no tokenizer: use /v1/completions with token ids")
    })?;
    let rendered = model.render_chat(&messages, true).map_err(|e| ApiError::field("messages", e.to_string()))?;
    check_prompt_bytes("messages", &rendered, model, limits)?;
    model.encode(&rendered).map_err(|e| ApiError::field("messages", e.to_string()))
}

/// `usage`.
pub fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// The response's id, object kind and creation time, shared by its chunks.
pub struct Envelope {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

impl Envelope {
    pub fn new(endpoint: Endpoint, request: u64, model: &str) -> Self {
        let prefix = if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Envelope { id: format!("{prefix}-{request}"), created, model: model.to_string(), endpoint }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    fn with(&self, chunk: bool, choices: Value, usage: Option<Value>) -> Value {
        let mut o = Map::new();
        o.insert("id".into(), json!(self.id));
        o.insert("object".into(), json!(self.object(chunk)));
        o.insert("created".into(), json!(self.created));
        o.insert("model".into(), json!(self.model));
        o.insert("choices".into(), choices);
        if let Some(u) = usage {
            o.insert("usage".into(), u);
        }
        Value::Object(o)
    }

    /// The whole answer.
    pub fn whole(&self, text: &str, ids: &[u32], finish: &str, usage: Value) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null,
                "finish_reason": finish, "token_ids": ids,
            }),
            Endpoint::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "token_ids": ids})
            }
        };
        self.with(false, json!([choice]), Some(usage))
    }

    /// A chunk: a piece of text (the first chat chunk also names the role), or the last one
    /// with its finish reason.
    pub fn chunk(&self, text: &str, ids: &[u32], first: bool, finish: Option<&str>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if finish.is_none() || !text.is_empty() {
                    delta.insert("content".into(), json!(text));
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish, "token_ids": ids})
            }
            Endpoint::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "token_ids": ids})
            }
        };
        self.with(true, json!([choice]), None)
    }

    /// The usage chunk (`stream_options.include_usage`): no choices.
    pub fn usage_chunk(&self, usage: Value) -> Value {
        self.with(true, json!([]), Some(usage))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits<'static> {
        Limits {
            text: None,
            model_name: "m",
            vocab_size: 100,
            max_context: 64,
            max_tokens: 8,
            sampling: RequestSampling::default(),
            max_prompt_bytes: None,
        }
    }

    fn seed_of(seed: &str) -> Result<u64, ApiError> {
        let body = format!("{{\"prompt\": [1, 2, 3], \"seed\": {seed}}}");
        parse(Endpoint::Completions, body.as_bytes(), &limits()).map(|ask| ask.sampling.seed)
    }

    #[test]
    fn any_u64_seed_is_taken_and_a_negative_one_wraps() {
        assert_eq!(seed_of("18446744073709551615").unwrap(), u64::MAX, "2^64 - 1, as OpenAI allows");
        assert_eq!(seed_of("9223372036854775808").unwrap(), 1 << 63);
        assert_eq!(seed_of("7").unwrap(), 7);
        assert_eq!(seed_of("-1").unwrap(), u64::MAX);
        for bad in ["18446744073709551616", "1.5", "\"7\""] {
            let e = seed_of(bad).unwrap_err();
            assert!(e.message.starts_with("seed: expected an integer from -2^63 to 2^64 - 1"), "{bad}: {}", e.message);
        }
    }
}
