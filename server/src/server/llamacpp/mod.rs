//! llama.cpp's server endpoints that editors use, on the same port:
//! `POST /infill` (llama.vim, llama.vscode), `POST /completion`,
//! `GET /health`, `POST /tokenize`, `POST /detokenize`, with llama.cpp's
//! field names, result objects and error shape
//! (`{"error": {"code", "message", "type"}}`).
//!
//! A new edge on the one request path ([`launch`]): `/infill` is the
//! protocol's fill-in-the-middle input (`input_extra` files placed with the
//! model's repo-level FIM tokens), owned like the OpenAI edge's requests by
//! the bearer token's tenant, so consecutive keystrokes of one file share
//! their prefix in the cache: the editor's warm-up (`n_predict: 0`) leaves
//! the extra context evaluated, and each completion after evaluates only
//! what changed near the cursor.
mod reply;
mod wire;

use std::sync::Arc;
use std::time::Instant;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use protocol::{ErrorCode, ProtocolError};
use serde_json::{json, Map, Value};

use super::http::request_body::{close_if_body_unread, read_json_object, BodyError};
use super::http::stream_body::ChannelBody;
use super::http::{full, Body};
use super::request::{fim_unsupported, launch, Launch, Launched, Length};
use super::ServerState;
use reply::{EditorWriter, Settings};
use wire::{Endpoint, Predict};

/// Server-sent events waiting for a slow client.
const SSE_BUFFER: usize = 64;

/// An error in llama.cpp's shape; `code` is the HTTP status.
#[derive(Debug)]
pub struct LlamaError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    metric: ErrorCode,
}

impl LlamaError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> LlamaError {
        LlamaError { status, kind, message: message.into(), metric: ErrorCode::InvalidParameter }
    }

    fn invalid(message: impl Into<String>) -> LlamaError {
        LlamaError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    fn server(message: impl Into<String>) -> LlamaError {
        LlamaError { metric: ErrorCode::Internal, ..LlamaError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message) }
    }

    fn body(&self) -> Value {
        json!({"error": {"code": self.status.as_u16(), "message": self.message, "type": self.kind}})
    }

    fn response(&self) -> Response<Body> {
        let mut r = json_response(self.status, &self.body());
        close_if_body_unread(&mut r);
        r
    }
}

impl From<ProtocolError> for LlamaError {
    fn from(e: ProtocolError) -> LlamaError {
        let (status, kind) = match e.code {
            ErrorCode::PromptTooLong | ErrorCode::ContextOverflow => (StatusCode::BAD_REQUEST, "exceed_context_size_error"),
            ErrorCode::FimUnsupported => (StatusCode::NOT_IMPLEMENTED, "not_supported_error"),
            ErrorCode::Overloaded | ErrorCode::Cancelled | ErrorCode::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "unavailable_error"),
            ErrorCode::RateLimited => (StatusCode::TOO_MANY_REQUESTS, "unavailable_error"),
            ErrorCode::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
            _ => (StatusCode::BAD_REQUEST, "invalid_request_error"),
        };
        LlamaError { status, kind, message: e.message, metric: e.code }
    }
}

impl From<(ErrorCode, String)> for LlamaError {
    fn from((code, message): (ErrorCode, String)) -> LlamaError {
        LlamaError::from(ProtocolError::new(code, message))
    }
}

/// Compact JSON on one line: llama.vim finds `"content":"` in the raw text.
fn json_response(status: StatusCode, body: &Value) -> Response<Body> {
    let mut r = Response::new(full(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
    r
}

/// A refusal for a missing or wrong bearer token.
pub fn unauthorized(why: &str) -> Response<Body> {
    let message = format!("{why}: send `Authorization: Bearer <token>` or `X-Api-Key: <token>`");
    let mut r = LlamaError::new(StatusCode::UNAUTHORIZED, "authentication_error", message).response();
    r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

/// Whether `path` is one of this edge's.
pub fn serves(path: &str) -> bool {
    matches!(path, "/health" | "/v1/health" | "/completion" | "/completions" | "/infill" | "/tokenize" | "/detokenize")
}

/// Whether `path` needs no bearer token (llama.cpp's `/health` is public).
pub fn is_public(path: &str) -> bool {
    matches!(path, "/health" | "/v1/health")
}

/// Serves one of this edge's paths (see [`serves`]) for `tenant`.
pub async fn handle(state: &Arc<ServerState>, req: Request<Incoming>, tenant: &str) -> Response<Body> {
    let path = req.uri().path().to_string();
    let wanted = if is_public(&path) { Method::GET } else { Method::POST };
    if req.method() != wanted {
        let mut r = LlamaError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", format!("{path} requires {wanted}")).response();
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(if wanted == Method::GET { "GET" } else { "POST" }));
        return r;
    }
    let result = match path.as_str() {
        "/health" | "/v1/health" => Ok(health(state)),
        "/tokenize" => tokenize(state, req).await,
        "/detokenize" => detokenize(state, req).await,
        _ if !state.http_buckets.take(tenant) => {
            let e = LlamaError::from((
                ErrorCode::RateLimited,
                format!("more than {} requests per second with this key; retry later", state.config.rate_limit_per_sec),
            ));
            let mut r = e.response();
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(state.http_buckets.retry_after_secs()));
            state.metrics.error(ErrorCode::RateLimited);
            return r;
        }
        "/infill" => complete(state, req, Endpoint::Infill, tenant).await,
        _ => complete(state, req, Endpoint::Completion, tenant).await,
    };
    result.unwrap_or_else(|e| {
        state.metrics.error(e.metric);
        e.response()
    })
}

fn health(state: &ServerState) -> Response<Body> {
    if state.is_draining() {
        return LlamaError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", "the server is shutting down").response();
    }
    json_response(StatusCode::OK, &json!({"status": "ok"}))
}

/// The request body as a JSON object (see `http::request_body`), or the
/// failure in llama.cpp's shape.
async fn read_json(state: &ServerState, req: Request<Incoming>) -> Result<Map<String, Value>, LlamaError> {
    read_json_object(req, state.config.max_frame_bytes, state.config.stall_timeout).await.map_err(|e| match e {
        BodyError::TooLarge { .. } => LlamaError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", e.message()),
        BodyError::TooSlow { .. } => LlamaError::new(StatusCode::REQUEST_TIMEOUT, "invalid_request_error", e.message()),
        _ => LlamaError::invalid(e.message()),
    })
}

fn parse<T: serde::de::DeserializeOwned>(body: Map<String, Value>, known: &[&str]) -> Result<T, LlamaError> {
    if let Some(k) = body.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(LlamaError::invalid(format!("unknown field {k:?}")));
    }
    serde_path_to_error::deserialize(Value::Object(body)).map_err(|e| LlamaError::invalid(format!("invalid value for {}: {}", e.path(), e.inner())))
}

#[derive(serde::Deserialize)]
struct TokenizeBody {
    content: String,
    #[serde(default)]
    add_special: bool,
    #[serde(default = "yes")]
    parse_special: bool,
    #[serde(default)]
    with_pieces: bool,
}

fn yes() -> bool {
    true
}

/// `POST /tokenize`: `{"tokens": [ids]}`, or with pieces `[{"id", "piece"}]`
/// (`piece` a byte list when it is not valid UTF-8 on its own).
async fn tokenize(state: &ServerState, req: Request<Incoming>) -> Result<Response<Body>, LlamaError> {
    let body: TokenizeBody = parse(read_json(state, req).await?, &["content", "add_special", "parse_special", "with_pieces"])?;
    let tok = &state.tokenizer;
    let mut ids = Vec::new();
    if body.add_special && tok.add_bos() {
        ids.extend(tok.bos_id());
    }
    ids.extend(tok.encode(&body.content, body.parse_special).map_err(|e| LlamaError::server(format!("tokenizing failed: {e}")))?);
    let tokens: Vec<Value> = if body.with_pieces {
        ids.iter()
            .map(|&id| {
                let bytes = tok.token_bytes(id).unwrap_or_default();
                let piece = std::str::from_utf8(bytes).map_or_else(|_| json!(bytes), |s| json!(s));
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(json_response(StatusCode::OK, &json!({"tokens": tokens})))
}

/// `POST /detokenize`: `{"content": text}`.
async fn detokenize(state: &ServerState, req: Request<Incoming>) -> Result<Response<Body>, LlamaError> {
    #[derive(serde::Deserialize)]
    struct DetokenizeBody {
        tokens: Vec<u32>,
    }
    let body: DetokenizeBody = parse(read_json(state, req).await?, &["tokens"])?;
    let vocab = state.tokenizer.vocab_size();
    if let Some(bad) = body.tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(LlamaError::invalid(format!("token id {bad} is out of the vocabulary (size {vocab})")));
    }
    Ok(json_response(StatusCode::OK, &json!({"content": state.tokenizer.decode(&body.tokens, false)})))
}

/// `POST /completion` and `POST /infill`.
async fn complete(state: &Arc<ServerState>, req: Request<Incoming>, endpoint: Endpoint, tenant: &str) -> Result<Response<Body>, LlamaError> {
    let received = Instant::now();
    let body = read_json(state, req).await?;
    if let Some(k) = wire::unknown_field(&body) {
        return Err(LlamaError::invalid(format!("unknown field {k:?}")));
    }
    if endpoint == Endpoint::Infill && state.fim.is_none() {
        return Err(LlamaError::from(fim_unsupported()));
    }
    let body: wire::Body =
        serde_path_to_error::deserialize(Value::Object(body)).map_err(|e| LlamaError::invalid(format!("invalid value for {}: {}", e.path(), e.inner())))?;
    let (mut generate, options) =
        body.into_generate(endpoint, super::new_secret("cmpl-"), &state.model.name).map_err(|wire::Invalid(m)| LlamaError::invalid(m))?;
    let length = match options.predict {
        Predict::WarmOnly => Length::WarmOnly,
        Predict::Unlimited => Length::FillContext,
        Predict::Tokens(_) => Length::AsAsked,
    };
    let owner = super::openai::owner(tenant, None);
    let launch_with = Launch { length, earlier: None, ignore_eos: options.ignore_eos };
    let Launched { submitted, in_flight, relay, .. } = launch(state, &owner, &mut generate, launch_with, received).await?;
    let settings = Settings {
        model: state.model.name.clone(),
        n_ctx: state.limits.context_length,
        prompt_tokens: relay.prompt_tokens,
        max_tokens: generate.max_tokens,
        temperature: generate.temperature,
        top_k: generate.top_k,
        top_p: generate.top_p,
        min_p: generate.min_p,
        seed: generate.seed,
        stop: generate.stop.clone(),
    };
    let stop = submitted.stop.clone();
    if !options.stream {
        let mut writer = EditorWriter::new(options, settings, stop, None);
        relay.run(submitted.events, &mut writer).await;
        drop(in_flight);
        return Ok(json_response(StatusCode::OK, &writer.into_result()?));
    }
    let (tx, body) = ChannelBody::new(SSE_BUFFER);
    let (ready_tx, ready) = tokio::sync::oneshot::channel();
    let mut writer = EditorWriter::new(options, settings, stop, Some((tx, ready_tx)));
    tokio::spawn(async move {
        relay.run(submitted.events, &mut writer).await;
        drop(in_flight);
    });
    // Headers go out with the first event, so a refusal before any output
    // is still an HTTP error status.
    if let Ok(Err(e)) = ready.await {
        return Err(e);
    }
    let mut r = Response::new(BodyExt::boxed(body));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    r.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(r)
}
