//! Anthropic's Messages API on the same port: `POST /v1/messages` (one
//! `message`, or server-sent events with `stream: true`) and
//! `POST /v1/messages/count_tokens`, for the coding agents and frameworks
//! that speak it (pointed here with `ANTHROPIC_BASE_URL`).
//!
//! A new edge, not a new engine: the body becomes the protocol's
//! `GenerateRequest` (`wire.rs`) and takes the one request path
//! ([`launch`]); only the writer differs (`reply.rs`). Errors come in
//! Anthropic's shape and statuses. The key (`x-api-key`, or a bearer token)
//! names the tenant, as on the OpenAI edge: an agent's next turn reads its
//! history from the prefix cache, within its key and never across keys.
mod reply;
mod wire;

use std::sync::Arc;
use std::time::Instant;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{self, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use protocol::{ErrorCode, ProtocolError};
use serde_json::{json, Value};

use super::http::request_body::{close_if_body_unread, read_json_object, BodyError};
use super::http::stream_body::ChannelBody;
use super::http::{full, Body};
use super::request::{count_prompt_tokens, launch, Launch, Launched, Length};
use super::session::new_secret;
use super::ServerState;
use reply::{Collected, EventStream, Reply};
use wire::{Endpoint, Parsed};

/// Server-sent events waiting for a slow client before the writer waits.
const SSE_BUFFER: usize = 64;

/// Whether `path` is this edge's.
pub fn serves(path: &str) -> bool {
    matches!(path, "/v1/messages" | "/v1/messages/count_tokens")
}

/// An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Clone, Debug)]
pub struct AnthropicError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    /// The protocol's code, for /metrics.
    metric: ErrorCode,
}

impl AnthropicError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> AnthropicError {
        AnthropicError { status, kind, message: message.into(), metric: ErrorCode::InvalidParameter }
    }

    fn invalid(message: impl Into<String>) -> AnthropicError {
        AnthropicError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn body(&self) -> Value {
        json!({"type": "error", "error": {"type": self.kind, "message": self.message}})
    }

    fn response(&self) -> Response<Body> {
        let mut r = json_response(self.status, &self.body());
        close_if_body_unread(&mut r);
        r
    }
}

impl From<ProtocolError> for AnthropicError {
    fn from(e: ProtocolError) -> AnthropicError {
        // 529 is Anthropic's "overloaded", which its clients retry.
        let overloaded = StatusCode::from_u16(529).expect("529 is a valid status");
        let (status, kind) = match e.code {
            ErrorCode::Overloaded | ErrorCode::ShuttingDown => (overloaded, "overloaded_error"),
            ErrorCode::RateLimited | ErrorCode::TooManyRequests => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            ErrorCode::Internal | ErrorCode::Cancelled => (StatusCode::INTERNAL_SERVER_ERROR, "api_error"),
            ErrorCode::Unauthorized => (StatusCode::UNAUTHORIZED, "authentication_error"),
            _ => (StatusCode::BAD_REQUEST, "invalid_request_error"),
        };
        AnthropicError { status, kind, message: e.message, metric: e.code }
    }
}

impl From<(ErrorCode, String)> for AnthropicError {
    fn from((code, message): (ErrorCode, String)) -> AnthropicError {
        AnthropicError::from(ProtocolError::new(code, message))
    }
}

fn json_response(status: StatusCode, body: &Value) -> Response<Body> {
    let mut r = Response::new(full(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// The refusal of a request without the server's key, in Anthropic's shape.
pub fn unauthorized(why: &str) -> Response<Body> {
    AnthropicError::new(StatusCode::UNAUTHORIZED, "authentication_error", format!("{why}: send `x-api-key: <key>`")).response()
}

/// `YYYY-MM-DD`.
fn is_version_date(v: &str) -> bool {
    let b = v.as_bytes();
    b.len() == 10 && b.iter().enumerate().all(|(i, c)| if i == 4 || i == 7 { *c == b'-' } else { c.is_ascii_digit() })
}

/// Serves one request to this edge for `tenant` (see [`super::openai::tenant`]).
pub async fn handle(state: &Arc<ServerState>, req: Request<Incoming>, tenant: &str) -> Response<Body> {
    let request_id = new_secret("req_");
    let mut r = match serve(state, req, tenant).await {
        Ok(r) => r,
        Err(e) => {
            state.metrics.error(e.metric);
            let mut r = e.response();
            if e.status == StatusCode::TOO_MANY_REQUESTS {
                r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(state.http_buckets.retry_after_secs()));
            }
            r
        }
    };
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        r.headers_mut().insert(HeaderName::from_static("request-id"), v);
    }
    r
}

async fn serve(state: &Arc<ServerState>, req: Request<Incoming>, tenant: &str) -> Result<Response<Body>, AnthropicError> {
    let received = Instant::now();
    let endpoint = if req.uri().path() == "/v1/messages" { Endpoint::Create } else { Endpoint::CountTokens };
    if req.method() != Method::POST {
        let message = format!("{} requires POST, not {}", req.uri().path(), req.method());
        let mut r = AnthropicError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", message).response();
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static("POST"));
        return Ok(r);
    }
    // Anthropic's API requires the header; a client that leaves it out
    // (curl by hand) gets today's shapes rather than a refusal. Versions
    // (dates) only add fields, and the SDKs send their newest, so any date
    // is taken.
    if let Some(v) = req.headers().get("anthropic-version") {
        let v = String::from_utf8_lossy(v.as_bytes());
        if !is_version_date(&v) {
            return Err(AnthropicError::invalid(format!("anthropic-version: {v:?} is not a version date (such as 2023-06-01)")));
        }
    }
    if !state.http_buckets.take(tenant) {
        let message = format!("more than {} requests per second with this key; retry later", state.config.rate_limit_per_sec);
        return Err(AnthropicError::from(ProtocolError::new(ErrorCode::RateLimited, message)));
    }
    let body = read_json_object(req, state.config.max_frame_bytes, state.config.stall_timeout).await.map_err(|e| match e {
        BodyError::TooLarge { .. } => AnthropicError::new(StatusCode::PAYLOAD_TOO_LARGE, "request_too_large", e.message()),
        BodyError::TooSlow { .. } => AnthropicError::new(StatusCode::REQUEST_TIMEOUT, "timeout_error", e.message()),
        _ => AnthropicError::invalid(e.message()),
    })?;
    let id = new_secret("msg_");
    let Parsed { model, mut generate, max_tokens, stream } = wire::parse(&body, endpoint, id.clone()).map_err(AnthropicError::invalid)?;
    if model != state.model.name {
        let message = format!("model: {model:?} does not exist here; this server serves {:?}", state.model.name);
        return Err(AnthropicError::new(StatusCode::NOT_FOUND, "not_found_error", message));
    }
    if endpoint == Endpoint::CountTokens {
        generate.validate()?;
        let tokens = count_prompt_tokens(state, &generate).await?;
        return Ok(json_response(StatusCode::OK, &json!({"input_tokens": tokens})));
    }
    let owner = super::openai::owner(tenant, None);
    let length = Launch { length: Length::UpTo(max_tokens), ..Launch::default() };
    let Launched { submitted, in_flight, relay, .. } = launch(state, &owner, &mut generate, length, received).await?;
    let reply = Reply { id, model: state.model.name.clone(), max_tokens, prompt_tokens: relay.prompt_tokens as u32 };
    if !stream {
        let mut writer = Collected::new(reply);
        relay.run(submitted.events, &mut writer).await;
        drop(in_flight);
        return Ok(json_response(StatusCode::OK, &writer.into_message()?));
    }
    let (tx, body) = ChannelBody::new(SSE_BUFFER);
    let (ready_tx, ready) = tokio::sync::oneshot::channel();
    let mut writer = EventStream::new(reply, tx, ready_tx);
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
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(r)
}
