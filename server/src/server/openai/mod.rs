//! OpenAI-compatible HTTP on the same port: `GET /v1/models`,
//! `POST /v1/chat/completions`, `POST /v1/completions` (with `suffix` for
//! fill-in-the-middle), whole or streamed as server-sent events.
//!
//! A new edge, not a new engine: the body becomes the protocol's
//! `GenerateRequest` (`wire.rs`) and takes the same path as `/v1/ws`'s
//! `generate` (validation, tokenizing, submission, relay); only the writer
//! differs (`respond.rs`). Errors come in OpenAI's shape.
//!
//! Prefix caching across requests: HTTP has no session, so requests are
//! owned by their tenant (a hash of the bearer token they presented, plus
//! `prompt_cache_key` when given). A conversation's next turn reuses the
//! previous turn's KV state within its tenant, never across tenants.
mod respond;
mod wire;

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use http_body_util::{BodyExt, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};
use protocol::{ErrorCode, GenerateRequest, ProtocolError};
use sha2::{Digest, Sha256};

use super::http::stream_body::ChannelBody;
use super::http::Body;
use super::request::{check_request, prepare, submit};
use super::session::new_secret;
use super::ServerState;
use respond::{ApiError, Collected, Endpoint, EventStream, Reply};
use wire::{ChatRequest, CompletionRequest, Options, ParamError};

/// Server-sent events waiting to be written to a slow client before the
/// writer waits (and, through the engine's own bound, the row pauses).
const SSE_BUFFER: usize = 64;

/// Routes an `/v1/...` OpenAI request; `None` for paths this edge does not serve.
pub async fn handle(state: &Arc<ServerState>, req: Request<Incoming>, bearer: Option<String>) -> Option<Response<Body>> {
    let endpoint = match req.uri().path() {
        "/v1/models" => return Some(models(state, &req)),
        "/v1/chat/completions" => Endpoint::Chat,
        "/v1/completions" => Endpoint::Completion,
        _ => return None,
    };
    if req.method() != hyper::Method::POST {
        let e = ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", format!("{} requires POST", req.uri().path()));
        let mut r = e.response();
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static("POST"));
        return Some(r);
    }
    Some(match complete(state, req, endpoint, bearer).await {
        Ok(r) => r,
        Err(e) => {
            state.metrics.error(e.metric_code());
            e.response()
        }
    })
}

/// `GET /v1/models`: the one model this server serves.
fn models(state: &ServerState, req: &Request<Incoming>) -> Response<Body> {
    if req.method() != hyper::Method::GET {
        let mut r = ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "/v1/models requires GET").response();
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET"));
        return r;
    }
    let body = serde_json::json!({
        "object": "list",
        "data": [{"id": state.model.name, "object": "model", "created": 0, "owned_by": "tether"}],
    });
    respond::json(StatusCode::OK, body)
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Whose prefix-cache entries a request reads and leaves: its bearer
/// token's tenant (hashed: the token itself is never kept), narrowed by
/// `prompt_cache_key`.
fn owner(bearer: Option<&str>, prompt_cache_key: Option<&str>) -> String {
    let mut h = Sha256::new();
    h.update(bearer.unwrap_or("").as_bytes());
    let tenant: String = h.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect();
    match prompt_cache_key {
        Some(key) => format!("http:{tenant}:{key}"),
        None => format!("http:{tenant}"),
    }
}

async fn read_json(state: &ServerState, req: Request<Incoming>) -> Result<serde_json::Map<String, serde_json::Value>, ApiError> {
    let limit = state.config.max_frame_bytes;
    let bytes: Bytes = match Limited::new(req.into_body(), limit).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            return Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", format!("the request body is over {limit} bytes"))
                .with_code("request_too_large"))
        }
        Err(e) => return Err(ApiError::invalid(None, format!("reading the request body failed: {e}"))),
    };
    match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::invalid(None, "the request body must be a JSON object")),
        Err(e) => Err(ApiError::invalid(None, format!("the request body is not valid JSON: {e}"))),
    }
}

/// The request's fields, parsed as `T` after checking that every name is known.
fn parse<T: serde::de::DeserializeOwned>(body: serde_json::Map<String, serde_json::Value>, fields: &[&str]) -> Result<T, ApiError> {
    if let Some(name) = wire::unknown_field(&body, fields) {
        return Err(ApiError::invalid(None, format!("unrecognized request argument supplied: {name}")).with_code("unknown_parameter"));
    }
    serde_path_to_error::deserialize(serde_json::Value::Object(body)).map_err(|e| {
        let path = e.path().to_string();
        ApiError::invalid(None, format!("invalid value for {path}: {}", e.inner())).with_code("invalid_value")
    })
}

async fn complete(state: &Arc<ServerState>, req: Request<Incoming>, endpoint: Endpoint, bearer: Option<String>) -> Result<Response<Body>, ApiError> {
    let received = Instant::now();
    let body = read_json(state, req).await?;
    let request_id = match endpoint {
        Endpoint::Chat => new_secret("chatcmpl-"),
        Endpoint::Completion => new_secret("cmpl-"),
    };
    let from_param = |e: ParamError| ApiError::invalid(Some(e.param), e.message);
    let (model, mut generate, options): (String, GenerateRequest, Options) = match endpoint {
        Endpoint::Chat => parse::<ChatRequest>(body, wire::CHAT_FIELDS)?.into_generate(request_id.clone()).map_err(from_param)?,
        Endpoint::Completion => parse::<CompletionRequest>(body, wire::COMPLETION_FIELDS)?.into_generate(request_id.clone()).map_err(from_param)?,
    };
    if model != state.model.name {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model {model:?} does not exist here; this server serves {:?}", state.model.name),
        )
        .with_param("model")
        .with_code("model_not_found"));
    }
    if options.fill_context {
        // Until the context is full: the engine's length is set after
        // tokenizing, and 0 here keeps the length checks to the prompt.
        generate.max_tokens = 0;
    }
    generate.validate().map_err(ApiError::from)?;
    check_request(state, &generate).map_err(ApiError::from)?;
    let owner = owner(bearer.as_deref(), options.prompt_cache_key.as_deref());
    let mut prepared = prepare(state, &owner, &generate, None, received).await.map_err(ApiError::from)?;
    if options.fill_context {
        let room = (state.limits.context_length as usize).saturating_sub(prepared.submit.prompt.len());
        let max_tokens = room.min(state.limits.max_tokens as usize);
        if max_tokens == 0 {
            let message =
                format!("the prompt ({} tokens) leaves no room to generate in the {}-token context", prepared.submit.prompt.len(), state.limits.context_length);
            return Err(ApiError::from(ProtocolError::new(ErrorCode::ContextOverflow, message)));
        }
        prepared.submit.max_tokens = max_tokens;
        generate.max_tokens = max_tokens as u32;
    }
    let engine = state.engines.for_session(&owner).clone();
    let (submitted, in_flight, relay) = submit(state, &engine, &generate, prepared, received).map_err(ApiError::from)?;
    let reply = Reply { endpoint, id: request_id, created: unix_now(), model: state.model.name.clone(), tokenizer: state.tokenizer.clone() };
    if options.stream {
        let (tx, body) = ChannelBody::new(SSE_BUFFER);
        let (ready_tx, ready) = tokio::sync::oneshot::channel();
        let mut writer = EventStream::new(reply, tx, options.include_usage, ready_tx);
        tokio::spawn(async move {
            relay.run(submitted.events, &mut writer).await;
            drop(in_flight);
        });
        // Headers go out with the first piece, so a refusal before any
        // output is still an HTTP error status.
        match ready.await {
            Ok(Ok(())) | Err(_) => {}
            Ok(Err(e)) => return Err(e),
        }
        let mut r = Response::new(BodyExt::boxed(body));
        let h = r.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        Ok(r)
    } else {
        let mut writer = Collected::new(reply);
        relay.run(submitted.events, &mut writer).await;
        drop(in_flight);
        writer.into_response()
    }
}

/// The body of a refusal a caller of [`handle`] makes before routing (no
/// token, a wrong token), in OpenAI's shape.
pub fn unauthorized(why: &str) -> Response<Body> {
    let mut r = ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", format!("{why}: send `Authorization: Bearer <token>`"))
        .with_code("invalid_api_key")
        .response();
    r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}
