//! The plumbing every HTTP edge shares (OpenAI's, the Responses API's,
//! llama.cpp's, Anthropic's): reading the body, refusing unknown fields,
//! the per-tenant rate limit with `Retry-After`, stream-or-collect, the
//! server-sent events' headers, and the answers to an unknown path or a
//! wrong method.
//!
//! It knows no wire shape: an edge is its request and response shapes and
//! its error vocabulary ([`EdgeError`]), nothing else. The key decision: a
//! streamed response's headers go out with its first event (through
//! [`Events`]), so a request refused before any output (a prompt too long,
//! an overloaded engine) is still an HTTP error status, not a 200 whose
//! stream holds an error event.
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use protocol::{ErrorCode, ProtocolError};
use serde_json::{Map, Value};
use tokio::sync::{mpsc, oneshot};

use super::request_body::{close_if_body_unread, read_json_object, BodyError};
use super::stream_body::ChannelBody;
use super::{full, Body};
use crate::server::relay::Writer;
use crate::server::request::Launched;
use crate::server::ServerState;

/// Server-sent events waiting to be written to a slow client before the
/// writer waits (and, through the engine's own bound, the row pauses).
pub const SSE_BUFFER: usize = 64;

/// An edge's error vocabulary: how it words and shapes each refusal the kit
/// makes, and what its error looks like on the wire.
pub trait EdgeError: From<ProtocolError> + Send + 'static {
    /// The `Content-Type` of its JSON answers.
    const CONTENT_TYPE: &'static str = "application/json";
    /// How its clients present the server's token, as a 401 tells them.
    const CREDENTIALS: &'static str = "`Authorization: Bearer <token>`";
    /// A refusal the kit makes, worded by the kit: no token or a wrong one
    /// (401), a body too large (413), too slow (408) or not a JSON object
    /// (400), a path nothing serves (404), a wrong method (405); the edge
    /// gives it its type and code.
    fn refusal(status: StatusCode, message: String) -> Self;
    /// A field whose value does not parse.
    fn bad_value(message: String) -> Self {
        Self::refusal(StatusCode::BAD_REQUEST, message)
    }
    /// A field the endpoint does not know.
    fn unknown_field(name: &str) -> Self {
        Self::refusal(StatusCode::BAD_REQUEST, format!("unknown field {name:?}"))
    }
    fn status(&self) -> StatusCode;
    /// The protocol's code, for /metrics.
    fn metric(&self) -> ErrorCode;
    /// The error as the edge's wire shows it (the HTTP body, or an event's data).
    fn body(&self) -> Value;

    /// The error as a whole HTTP answer.
    fn response(&self) -> Response<Body> {
        let mut r = json_as(self.status(), &self.body(), Self::CONTENT_TYPE);
        close_if_body_unread(&mut r);
        r
    }
}

/// A JSON answer with the given `Content-Type`.
pub fn json_as(status: StatusCode, body: &Value, content_type: &'static str) -> Response<Body> {
    let mut r = Response::new(full(body.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// A JSON answer.
pub fn json(status: StatusCode, body: &Value) -> Response<Body> {
    json_as(status, body, "application/json")
}

/// An edge's answer: the response, or its error (counted in /metrics, with
/// `Retry-After` on a rate limit).
pub fn answer<E: EdgeError>(state: &ServerState, result: Result<Response<Body>, E>) -> Response<Body> {
    result.unwrap_or_else(|e| {
        state.metrics.error(e.metric());
        let mut r = e.response();
        if e.metric() == ErrorCode::RateLimited {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(state.http_buckets.retry_after_secs()));
        }
        r
    })
}

/// The 401 of a request without the server's token (`why`: none was
/// presented, or a wrong one), telling how the edge's clients send it. Every
/// edge takes a bearer token, so every 401 challenges for one (RFC 9110
/// requires a challenge on a 401).
pub fn unauthorized<E: EdgeError>(why: &str) -> Response<Body> {
    let mut r = E::refusal(StatusCode::UNAUTHORIZED, format!("{why}: send {}", E::CREDENTIALS)).response();
    r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

/// The 404 of a path under an edge that nothing serves (worded as OpenAI's API words it).
pub fn unknown_path<E: EdgeError>(method: &Method, path: &str) -> Response<Body> {
    E::refusal(StatusCode::NOT_FOUND, format!("Invalid URL ({method} {path})")).response()
}

/// The 405 of a served path asked for with a method not in `allow`.
pub fn wrong_method<E: EdgeError>(method: &Method, path: &str, allow: &'static str) -> Response<Body> {
    let mut r = E::refusal(StatusCode::METHOD_NOT_ALLOWED, format!("{path} requires {allow}, not {method}")).response();
    r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

/// Takes one of `tenant`'s requests per second (`--rate-limit-per-sec`).
pub fn take_turn<E: EdgeError>(state: &ServerState, tenant: &str) -> Result<(), E> {
    if state.http_buckets.take(tenant) {
        return Ok(());
    }
    let message = format!("more than {} requests per second with this key; retry later", state.config.rate_limit_per_sec);
    Err(E::from(ProtocolError::new(ErrorCode::RateLimited, message)))
}

/// The request body as a JSON object (see `request_body`: held to
/// `--max-frame-bytes` and `--stall-timeout-secs`).
pub async fn read_json<E: EdgeError>(state: &ServerState, req: Request<Incoming>) -> Result<Map<String, Value>, E> {
    read_json_object(req, state.config.max_frame_bytes, state.config.stall_timeout).await.map_err(|e| {
        let status = match e {
            BodyError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BodyError::TooSlow { .. } => StatusCode::REQUEST_TIMEOUT,
            _ => StatusCode::BAD_REQUEST,
        };
        E::refusal(status, e.message())
    })
}

/// `unknown`, the first field of a body the endpoint does not know, refused.
pub fn refuse_unknown<E: EdgeError>(unknown: Option<&str>) -> Result<(), E> {
    unknown.map_or(Ok(()), |name| Err(E::unknown_field(name)))
}

/// A body's fields as `T`; a bad value names its path.
pub fn deserialize<E: EdgeError, T: serde::de::DeserializeOwned>(body: Map<String, Value>) -> Result<T, E> {
    serde_path_to_error::deserialize(Value::Object(body)).map_err(|e| E::bad_value(format!("invalid value for {}: {}", e.path(), e.inner())))
}

/// A request's end in error (the relay's `(code, message)`), in the edge's shape.
pub fn failed<E: EdgeError>((code, message): (ErrorCode, String)) -> E {
    E::from(ProtocolError::new(code, message))
}

/// Relays `launched` into `writer` to its end.
pub async fn collect<W: Writer>(launched: Launched, mut writer: W) -> W {
    let Launched { submitted, in_flight, relay, .. } = launched;
    relay.run(submitted.events, &mut writer).await;
    drop(in_flight);
    writer
}

/// Streams `launched` through the writer `make` builds on the stream's
/// [`Events`], relayed in a task of its own. Answers once the first event
/// is out, or with the error that ended the request before any.
pub async fn stream<E: EdgeError, W: Writer + 'static>(launched: Launched, make: impl FnOnce(Events<E>) -> W) -> Result<Response<Body>, E> {
    let (tx, body) = ChannelBody::new(SSE_BUFFER);
    let (ready_tx, ready) = oneshot::channel();
    let writer = make(Events { tx, ready: Some(ready_tx) });
    tokio::spawn(collect(launched, writer));
    if let Ok(Err(e)) = ready.await {
        return Err(e);
    }
    Ok(sse(body))
}

/// The answer that carries a stream of server-sent events.
pub fn sse(body: ChannelBody) -> Response<Body> {
    let mut r = Response::new(http_body_util::BodyExt::boxed(body));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// A streamed response's events, as its writer sends them. The response
/// (its status and headers) starts with the first event, or fails with the
/// error that came before any.
pub struct Events<E> {
    tx: mpsc::Sender<Bytes>,
    ready: Option<oneshot::Sender<Result<(), E>>>,
}

impl<E: EdgeError> Events<E> {
    /// Starts the response unless it has started; true when this started it.
    pub fn open(&mut self) -> bool {
        let Some(ready) = self.ready.take() else { return false };
        let _ = ready.send(Ok(()));
        true
    }

    /// Sends one event (`event: name` first, when named), starting the
    /// response; false when the client is gone.
    pub async fn send(&mut self, name: Option<&str>, data: impl std::fmt::Display) -> bool {
        self.open();
        let text = match name {
            Some(name) => format!("event: {name}\ndata: {data}\n\n"),
            None => format!("data: {data}\n\n"),
        };
        self.tx.send(Bytes::from(text)).await.is_ok()
    }

    /// Ends the stream with `e`: the response's status when nothing was
    /// sent yet, else an event (named `name`) holding its body.
    pub async fn fail(&mut self, e: E, name: Option<&str>) {
        match self.ready.take() {
            Some(ready) => {
                let _ = ready.send(Err(e));
            }
            None => {
                self.send(name, e.body()).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use serde_json::json;

    use super::*;
    use crate::server::anthropic::AnthropicError;
    use crate::server::llamacpp::LlamaError;
    use crate::server::openai::ApiError;

    /// `E`'s 401: its status, its challenge and its body.
    async fn refused<E: EdgeError>() -> (StatusCode, Option<HeaderValue>, Value) {
        let r = unauthorized::<E>("no token");
        let (status, challenge) = (r.status(), r.headers().get(header::WWW_AUTHENTICATE).cloned());
        let body = r.into_body().collect().await.expect("a whole body").to_bytes();
        (status, challenge, serde_json::from_slice(&body).expect("a JSON body"))
    }

    #[tokio::test]
    async fn every_edge_answers_a_missing_token_with_a_challenge_in_its_own_shape() {
        let bearer = Some(HeaderValue::from_static("Bearer"));
        let (status, challenge, openai) = refused::<ApiError>().await;
        assert_eq!((status, challenge), (StatusCode::UNAUTHORIZED, bearer.clone()));
        assert_eq!((&openai["error"]["type"], &openai["error"]["code"]), (&json!("invalid_request_error"), &json!("invalid_api_key")));
        assert_eq!(openai["error"]["message"], "no token: send `Authorization: Bearer <token>`");
        let (status, challenge, anthropic) = refused::<AnthropicError>().await;
        assert_eq!((status, challenge), (StatusCode::UNAUTHORIZED, bearer.clone()));
        assert_eq!(anthropic, json!({"type": "error", "error": {"type": "authentication_error", "message": "no token: send `x-api-key: <key>`"}}));
        let (status, challenge, llama) = refused::<LlamaError>().await;
        assert_eq!((status, challenge), (StatusCode::UNAUTHORIZED, bearer));
        let message = "no token: send `Authorization: Bearer <token>` or `X-Api-Key: <token>`";
        assert_eq!(llama, json!({"error": {"code": 401, "message": message, "type": "authentication_error"}}));
    }
}
