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
mod responses;
mod wire;

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};
use protocol::{ErrorCode, GenerateRequest, ProtocolError};
use sha2::{Digest, Sha256};

use super::http::request_body::{read_json_object, BodyError};
use super::http::stream_body::ChannelBody;
use super::http::Body;
use super::request::{launch, Launch, Launched, Length};
use super::session::new_secret;
use super::ServerState;
use respond::{ApiError, Collected, Endpoint, EventStream, Reply};
pub use responses::{run_socket as run_responses_socket, ResponseStore};
use wire::{ChatRequest, CompletionRequest, Options, ParamError};

/// Server-sent events waiting to be written to a slow client before the
/// writer waits (and, through the engine's own bound, the row pauses).
const SSE_BUFFER: usize = 64;

/// What a route serves.
enum Route {
    Complete(Endpoint),
    Responses,
    /// `POST /v1/responses/compact`.
    Compact,
    /// `/v1/responses/{id}[/action]`: a stored response (`rest` is what follows `/v1/responses/`).
    Stored(String),
}

/// Routes an `/v1/...` OpenAI request; `None` for paths this edge does not serve.
pub async fn handle(state: &Arc<ServerState>, req: Request<Incoming>, bearer: Option<String>) -> Option<Response<Body>> {
    let route = match req.uri().path() {
        "/v1/models" => return Some(models(state, &req)),
        "/v1/chat/completions" => Route::Complete(Endpoint::Chat),
        "/v1/completions" => Route::Complete(Endpoint::Completion),
        "/v1/responses" => Route::Responses,
        "/v1/responses/compact" => Route::Compact,
        path => Route::Stored(path.strip_prefix("/v1/responses/")?.to_string()),
    };
    if req.method() != hyper::Method::POST && !matches!(route, Route::Stored(_)) {
        // GET /v1/responses upgrades to the WebSocket mode (`http.rs`).
        let (allow, what) = match route {
            Route::Responses => ("POST, GET", "POST (or GET with Upgrade: websocket)"),
            Route::Complete(_) | Route::Compact | Route::Stored(_) => ("POST", "POST"),
        };
        let e = ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", format!("{} requires {what}", req.uri().path()));
        let mut r = e.response();
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
        return Some(r);
    }
    let tenant = tenant(bearer.as_deref());
    if !state.http_buckets.take(&tenant) {
        let e = ApiError::from(ProtocolError::new(
            ErrorCode::RateLimited,
            format!("more than {} requests per second with this key; retry later", state.config.rate_limit_per_sec),
        ));
        state.metrics.error(ErrorCode::RateLimited);
        let mut r = e.response();
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(state.http_buckets.retry_after_secs()));
        return Some(r);
    }
    let result = match route {
        Route::Complete(endpoint) => complete(state, req, endpoint, &tenant).await,
        Route::Responses => responses::create(state, req, &tenant).await,
        Route::Compact => responses::compact(state, req, &tenant).await,
        Route::Stored(rest) => match responses::handle_stored(state, &req, &tenant, &rest) {
            Some(r) => r,
            None => return Some(unknown_path(req.method(), req.uri().path())),
        },
    };
    Some(match result {
        Ok(r) => r,
        Err(e) => {
            state.metrics.error(e.metric_code());
            e.response()
        }
    })
}

/// A path nothing here serves: 404 in OpenAI's shape, worded as OpenAI's
/// API words it.
pub fn unknown_path(method: &hyper::Method, path: &str) -> Response<Body> {
    ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("Invalid URL ({method} {path})")).response()
}

/// The answer to a connection over `--max-connections`: 503 in OpenAI's
/// shape, and the connection closes.
pub fn too_many_connections() -> Response<Body> {
    let mut r = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "too many connections; retry later").with_code("server_busy").response();
    r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// A served path asked for with the wrong method: 405 in OpenAI's shape,
/// with `Allow`.
pub fn method_not_allowed(method: &hyper::Method, path: &str, allow: &'static str) -> Response<Body> {
    let mut r = ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", format!("{path} requires {allow}, not {method}")).response();
    r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
    r
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

/// A bearer token's tenant: a hash, so the token itself is never kept.
pub fn tenant(bearer: Option<&str>) -> String {
    let mut h = Sha256::new();
    h.update(bearer.unwrap_or("").as_bytes());
    h.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// Whose prefix-cache entries a request reads and leaves: its tenant,
/// narrowed by `prompt_cache_key`.
pub fn owner(tenant: &str, prompt_cache_key: Option<&str>) -> String {
    match prompt_cache_key {
        Some(key) => format!("http:{tenant}:{key}"),
        None => format!("http:{tenant}"),
    }
}

/// The request body as a JSON object (see `http::request_body`), or the
/// failure in OpenAI's shape.
async fn read_json(state: &ServerState, req: Request<Incoming>) -> Result<serde_json::Map<String, serde_json::Value>, ApiError> {
    read_json_object(req, state.config.max_frame_bytes, state.config.stall_timeout).await.map_err(|e| match e {
        BodyError::TooLarge { .. } => ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", e.message()).with_code("request_too_large"),
        BodyError::TooSlow { .. } => ApiError::new(StatusCode::REQUEST_TIMEOUT, "invalid_request_error", e.message()).with_code("request_timeout"),
        _ => ApiError::invalid(None, e.message()),
    })
}

/// An unknown field's error, as OpenAI words it.
fn refuse_unknown(name: Option<&str>) -> Result<(), ApiError> {
    match name {
        Some(name) => Err(ApiError::invalid(None, format!("unrecognized request argument supplied: {name}")).with_code("unknown_parameter")),
        None => Ok(()),
    }
}

/// The request's fields as `T`; a bad value names its path.
fn deserialize<T: serde::de::DeserializeOwned>(body: serde_json::Map<String, serde_json::Value>) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(serde_json::Value::Object(body)).map_err(|e| {
        let path = e.path().to_string();
        ApiError::invalid(None, format!("invalid value for {path}: {}", e.inner())).with_code("invalid_value")
    })
}

/// The request's fields, parsed as `T` after checking that every name is known.
fn parse<T: serde::de::DeserializeOwned>(body: serde_json::Map<String, serde_json::Value>, fields: &[&str]) -> Result<T, ApiError> {
    refuse_unknown(wire::unknown_field(&body, fields))?;
    deserialize(body)
}

/// A request for a model other than the one served is a 404, as OpenAI answers.
fn check_model(state: &ServerState, model: &str) -> Result<(), ApiError> {
    if model == state.model.name {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("the model {model:?} does not exist here; this server serves {:?}", state.model.name),
    )
    .with_param("model")
    .with_code("model_not_found"))
}

async fn complete(state: &Arc<ServerState>, req: Request<Incoming>, endpoint: Endpoint, tenant: &str) -> Result<Response<Body>, ApiError> {
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
    check_model(state, &model)?;
    let owner = owner(tenant, options.prompt_cache_key.as_deref());
    let length = if options.fill_context { Length::FillContext } else { Length::AsAsked };
    let Launched { submitted, in_flight, relay, .. } =
        launch(state, &owner, &mut generate, Launch { length, ..Launch::default() }, received).await.map_err(ApiError::from)?;
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
