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

use hyper::body::Incoming;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use protocol::{ErrorCode, ProtocolError};
use serde_json::{json, Value};

use super::http::edge::{self, EdgeError};
use super::http::Body;
use super::request::{count_prompt_tokens, launch, Launch, Length};
use super::session::new_secret;
use super::ServerState;
use reply::{Collected, EventStream, Reply};
use wire::{Endpoint, Parsed};

/// Whether `path` is this edge's: `/v1/messages` and every path under it
/// (those nothing serves answer 404 in this edge's shape).
pub fn serves(path: &str) -> bool {
    path.strip_prefix("/v1/messages").is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
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
}

impl EdgeError for AnthropicError {
    const CREDENTIALS: &'static str = "`x-api-key: <key>`";

    fn refusal(status: StatusCode, message: String) -> AnthropicError {
        let kind = match status {
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::REQUEST_TIMEOUT => "timeout_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            _ => "invalid_request_error",
        };
        AnthropicError::new(status, kind, message)
    }

    fn status(&self) -> StatusCode {
        self.status
    }

    fn metric(&self) -> ErrorCode {
        self.metric
    }

    fn body(&self) -> Value {
        json!({"type": "error", "error": {"type": self.kind, "message": self.message}})
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

/// `YYYY-MM-DD`.
fn is_version_date(v: &str) -> bool {
    let b = v.as_bytes();
    b.len() == 10 && b.iter().enumerate().all(|(i, c)| if i == 4 || i == 7 { *c == b'-' } else { c.is_ascii_digit() })
}

/// Serves one request to this edge for `tenant` (see [`super::openai::tenant`]).
pub async fn handle(state: &Arc<ServerState>, req: Request<Incoming>, tenant: &str) -> Response<Body> {
    let request_id = new_secret("req_");
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let endpoint = match path.as_str() {
        "/v1/messages" => Some(Endpoint::Create),
        "/v1/messages/count_tokens" => Some(Endpoint::CountTokens),
        _ => None,
    };
    let mut r = match (endpoint, &method) {
        (None, _) => edge::unknown_path::<AnthropicError>(&method, &path),
        (Some(endpoint), &Method::POST) => edge::answer(state, serve(state, req, endpoint, tenant).await),
        (Some(_), _) => edge::wrong_method::<AnthropicError>(&method, &path, "POST"),
    };
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        r.headers_mut().insert(HeaderName::from_static("request-id"), v);
    }
    r
}

async fn serve(state: &Arc<ServerState>, req: Request<Incoming>, endpoint: Endpoint, tenant: &str) -> Result<Response<Body>, AnthropicError> {
    let received = Instant::now();
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
    edge::take_turn::<AnthropicError>(state, tenant)?;
    let body = edge::read_json::<AnthropicError>(state, req).await?;
    let id = new_secret("msg_");
    let Parsed { model, mut generate, max_tokens, stream } = wire::parse(&body, endpoint, id.clone()).map_err(AnthropicError::invalid)?;
    if model != state.model.name {
        let message = format!("model: {model:?} does not exist here; this server serves {:?}", state.model.name);
        return Err(AnthropicError::new(StatusCode::NOT_FOUND, "not_found_error", message));
    }
    if endpoint == Endpoint::CountTokens {
        generate.validate()?;
        let tokens = count_prompt_tokens(state, &generate).await?;
        return Ok(edge::json(StatusCode::OK, &json!({"input_tokens": tokens})));
    }
    let owner = super::openai::owner(tenant, None);
    let length = Launch { length: Length::UpTo(max_tokens), ..Launch::default() };
    let launched = launch(state, &owner, &mut generate, length, received).await?;
    let reply = Reply { id, model: state.model.name.clone(), max_tokens, prompt_tokens: launched.relay.prompt_tokens as u32 };
    if stream {
        edge::stream(launched, |events| EventStream::new(reply, events)).await
    } else {
        Ok(edge::json(StatusCode::OK, &edge::collect(launched, Collected::new(reply)).await.into_message()?))
    }
}
