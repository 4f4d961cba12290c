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

use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use protocol::GenerateRequest;
use sha2::{Digest, Sha256};

use super::http::edge::{self, EdgeError};
use super::http::Body;
use super::request::{launch, Launch, Length};
use super::session::new_secret;
use super::ServerState;
pub use respond::ApiError;
use respond::{Collected, Endpoint, EventStream, Reply};
pub use responses::{run_socket as run_responses_socket, ResponseStore};
use wire::{ChatRequest, CompletionRequest, Options, ParamError};

/// What a route serves.
enum Route {
    Complete(Endpoint),
    Responses,
    /// `POST /v1/responses/compact`.
    Compact,
    /// `/v1/responses/{id}[/action]`: a stored response (`rest` is what follows `/v1/responses/`).
    Stored(String),
}

/// Serves an `/v1/...` OpenAI request; a path nothing serves is a 404 in OpenAI's shape.
pub async fn handle(state: &Arc<ServerState>, req: Request<Incoming>, tenant: &str) -> Response<Body> {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let route = match path.as_str() {
        "/v1/models" if method == Method::GET => return models(state),
        "/v1/models" => return edge::wrong_method::<ApiError>(&method, &path, "GET"),
        "/v1/chat/completions" => Route::Complete(Endpoint::Chat),
        "/v1/completions" => Route::Complete(Endpoint::Completion),
        "/v1/responses" => Route::Responses,
        "/v1/responses/compact" => Route::Compact,
        _ => match path.strip_prefix("/v1/responses/") {
            Some(rest) => Route::Stored(rest.to_string()),
            None => return edge::unknown_path::<ApiError>(&method, &path),
        },
    };
    if method != Method::POST && !matches!(route, Route::Stored(_)) {
        // GET /v1/responses upgrades to the WebSocket mode (`http.rs`).
        let allow = if matches!(route, Route::Responses) { "POST, GET" } else { "POST" };
        return edge::wrong_method::<ApiError>(&method, &path, allow);
    }
    if let Err(e) = edge::take_turn::<ApiError>(state, tenant) {
        return edge::answer(state, Err(e));
    }
    let result = match route {
        Route::Complete(endpoint) => complete(state, req, endpoint, tenant).await,
        Route::Responses => responses::create(state, req, tenant).await,
        Route::Compact => responses::compact(state, req, tenant).await,
        Route::Stored(rest) => match responses::handle_stored(state, &req, tenant, &rest) {
            Some(r) => r,
            None => return edge::unknown_path::<ApiError>(&method, &path),
        },
    };
    edge::answer(state, result)
}

/// The answer to a connection over `--max-connections`: 503 in OpenAI's
/// shape, and the connection closes.
pub fn too_many_connections() -> Response<Body> {
    let mut r = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "too many connections; retry later").with_code("server_busy").response();
    r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// `GET /v1/models`: the one model this server serves.
fn models(state: &ServerState) -> Response<Body> {
    let body = serde_json::json!({
        "object": "list",
        "data": [{"id": state.model.name, "object": "model", "created": 0, "owned_by": "tether"}],
    });
    edge::json(StatusCode::OK, &body)
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

/// The request's fields, parsed as `T` after checking that every name is known.
fn parse<T: serde::de::DeserializeOwned>(body: serde_json::Map<String, serde_json::Value>, fields: &[&str]) -> Result<T, ApiError> {
    edge::refuse_unknown::<ApiError>(wire::unknown_field(&body, fields))?;
    edge::deserialize(body)
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
    let body = edge::read_json::<ApiError>(state, req).await?;
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
    let launched = launch(state, &owner, &mut generate, Launch { length, ..Launch::default() }, received).await.map_err(ApiError::from)?;
    let reply = Reply { endpoint, id: request_id, created: unix_now(), model: state.model.name.clone(), tokenizer: state.tokenizer.clone() };
    if options.stream {
        edge::stream(launched, |events| EventStream::new(reply, events, options.include_usage)).await
    } else {
        edge::collect(launched, Collected::new(reply)).await.into_response()
    }
}
