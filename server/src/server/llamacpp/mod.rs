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

use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use protocol::{ErrorCode, ProtocolError};
use serde_json::{json, Map, Value};

use super::http::edge::{self, EdgeError};
use super::http::Body;
use super::request::{launch, Launch, Length};
use super::ServerState;
use reply::{EditorWriter, Settings};
use wire::{Endpoint, Predict};

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
}

impl EdgeError for LlamaError {
    /// Compact JSON on one line: llama.vim finds `"content":"` in the raw text.
    const CONTENT_TYPE: &'static str = "application/json; charset=utf-8";
    const CREDENTIALS: &'static str = "`Authorization: Bearer <token>` or `X-Api-Key: <token>`";

    fn refusal(status: StatusCode, message: String) -> LlamaError {
        let kind = match status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            _ => "invalid_request_error",
        };
        LlamaError::new(status, kind, message)
    }

    fn status(&self) -> StatusCode {
        self.status
    }

    fn metric(&self) -> ErrorCode {
        self.metric
    }

    fn body(&self) -> Value {
        json!({"error": {"code": self.status.as_u16(), "message": self.message, "type": self.kind}})
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

fn json_response(status: StatusCode, body: &Value) -> Response<Body> {
    edge::json_as(status, body, LlamaError::CONTENT_TYPE)
}

/// This edge's paths; each one's subpaths are this edge's too (answered 404
/// in its shape).
const PATHS: &[&str] = &["/health", "/v1/health", "/completion", "/completions", "/infill", "/tokenize", "/detokenize"];

/// Whether `path` is this edge's (see [`PATHS`]).
pub fn serves(path: &str) -> bool {
    PATHS.iter().any(|p| path.strip_prefix(p).is_some_and(|rest| rest.is_empty() || rest.starts_with('/')))
}

/// Whether `path` needs no bearer token (llama.cpp's `/health` is public).
pub fn is_public(path: &str) -> bool {
    matches!(path, "/health" | "/v1/health")
}

/// Serves one of this edge's paths (see [`serves`]) for `tenant`.
pub async fn handle(state: &Arc<ServerState>, req: Request<Incoming>, tenant: &str) -> Response<Body> {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    if !PATHS.contains(&path.as_str()) {
        return edge::unknown_path::<LlamaError>(&method, &path);
    }
    let wanted = if is_public(&path) { Method::GET } else { Method::POST };
    if method != wanted {
        return edge::wrong_method::<LlamaError>(&method, &path, if wanted == Method::GET { "GET" } else { "POST" });
    }
    let result = match path.as_str() {
        "/health" | "/v1/health" => Ok(health(state)),
        "/tokenize" => tokenize(state, req).await,
        "/detokenize" => detokenize(state, req).await,
        "/infill" => complete(state, req, Endpoint::Infill, tenant).await,
        _ => complete(state, req, Endpoint::Completion, tenant).await,
    };
    edge::answer(state, result)
}

fn health(state: &ServerState) -> Response<Body> {
    if state.is_draining() {
        return LlamaError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable_error", "the server is shutting down").response();
    }
    json_response(StatusCode::OK, &json!({"status": "ok"}))
}

fn parse<T: serde::de::DeserializeOwned>(body: Map<String, Value>, known: &[&str]) -> Result<T, LlamaError> {
    edge::refuse_unknown::<LlamaError>(body.keys().map(String::as_str).find(|k| !known.contains(k)))?;
    edge::deserialize(body)
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
    let body: TokenizeBody = parse(edge::read_json::<LlamaError>(state, req).await?, &["content", "add_special", "parse_special", "with_pieces"])?;
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
    let body: DetokenizeBody = parse(edge::read_json::<LlamaError>(state, req).await?, &["tokens"])?;
    let vocab = state.tokenizer.vocab_size();
    if let Some(bad) = body.tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(LlamaError::invalid(format!("token id {bad} is out of the vocabulary (size {vocab})")));
    }
    Ok(json_response(StatusCode::OK, &json!({"content": state.tokenizer.decode(&body.tokens, false)})))
}

/// `POST /completion` and `POST /infill`.
async fn complete(state: &Arc<ServerState>, req: Request<Incoming>, endpoint: Endpoint, tenant: &str) -> Result<Response<Body>, LlamaError> {
    let received = Instant::now();
    edge::take_turn::<LlamaError>(state, tenant)?;
    let body = edge::read_json::<LlamaError>(state, req).await?;
    edge::refuse_unknown::<LlamaError>(wire::unknown_field(&body))?;
    let body: wire::Body = edge::deserialize::<LlamaError, _>(body)?;
    let (mut generate, options) =
        body.into_generate(endpoint, super::new_secret("cmpl-"), &state.model.name).map_err(|wire::Invalid(m)| LlamaError::invalid(m))?;
    let length = match options.predict {
        Predict::WarmOnly => Length::WarmOnly,
        Predict::Unlimited => Length::FillContext,
        Predict::Tokens(_) => Length::AsAsked,
    };
    let owner = super::openai::owner(tenant, None);
    let launch_with = Launch { length, earlier: None, ignore_eos: options.ignore_eos };
    let launched = launch(state, &owner, &mut generate, launch_with, received).await?;
    let settings = Settings {
        model: state.model.name.clone(),
        n_ctx: state.limits.context_length,
        prompt_tokens: launched.relay.prompt_tokens,
        max_tokens: generate.max_tokens,
        temperature: generate.temperature,
        top_k: generate.top_k,
        top_p: generate.top_p,
        min_p: generate.min_p,
        seed: generate.seed,
        stop: generate.stop.clone(),
    };
    let stop = launched.submitted.stop.clone();
    if options.stream {
        edge::stream(launched, |events| EditorWriter::new(options, settings, stop, Some(events))).await
    } else {
        let writer = edge::collect(launched, EditorWriter::new(options, settings, stop, None)).await;
        Ok(json_response(StatusCode::OK, &writer.into_result()?))
    }
}
