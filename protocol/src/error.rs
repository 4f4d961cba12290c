//! Error codes carried by `error` frames, and the [`ProtocolError`] type that
//! parsing and validation return.

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Machine-readable error code of an `error` frame (serialized in snake_case).
///
/// Fatal codes (`frame_too_large`, `unauthorized`, `origin_not_allowed`,
/// `server_busy`, `shutting_down`, `idle_timeout`; see `ErrorCode::is_fatal`)
/// are followed by the server closing the WebSocket; after any other code the
/// connection stays usable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// A text frame was not valid JSON (syntax error, truncated, trailing data,
    /// number out of range, nesting too deep).
    BadJson,
    /// A binary WebSocket frame was received; the protocol uses text frames only.
    BinaryFrame,
    /// The frame was JSON but not an object, had no string `type` field, or its
    /// `type` is not a client message type.
    UnknownType,
    /// A field has the wrong JSON type, is unknown, is missing, is duplicated, or
    /// fields that are mutually exclusive / must appear together are mixed up.
    InvalidField,
    /// A field is well-typed but its value is out of the allowed range or format
    /// (e.g. `temperature` 3, `top_p` 0, a bad `request_id`).
    InvalidParameter,
    /// A frame exceeded `limits.max_frame_bytes`.
    FrameTooLarge,
    /// The tokenized prompt exceeds `limits.max_prompt_tokens`.
    PromptTooLong,
    /// Prompt tokens plus `max_tokens` exceed the model's context length.
    ContextOverflow,
    /// `cancel` named a request that is not in flight in this session (never
    /// started, or already finished: a race with `done` is normal).
    UnknownRequest,
    /// `generate` reused a `request_id` that this session still holds (in flight
    /// or kept for replay). Use a fresh id per request.
    DuplicateRequest,
    /// `generate` was rejected because the session already has
    /// `limits.max_in_flight` requests in flight.
    TooManyRequests,
    /// The client is sending frames or requests faster than allowed; the frame
    /// was dropped. Slow down and retry.
    RateLimited,
    /// `session.open` tried to resume a session id the server doesn't know.
    SessionNotFound,
    /// `session.open` gave a `resume_token` that doesn't match the session.
    InvalidResumeToken,
    /// `session.open` tried to resume a session whose TTL has run out.
    SessionExpired,
    /// A `generate` or `cancel` arrived before a successful `session.open`.
    NoSession,
    /// `session.open` was sent on a connection that already has a session.
    SessionAlreadyOpen,
    /// Authentication failed or is missing.
    Unauthorized,
    /// The WebSocket handshake's `Origin` is not allowed.
    OriginNotAllowed,
    /// The server is at its session limit and cannot open another session.
    ServerBusy,
    /// A `generate` with `fim` was sent but the model has no fill-in-the-middle
    /// support (`model.fim` is false in `session.ready`).
    FimUnsupported,
    /// The server's generation queue is full; the request was not started.
    /// Retry later.
    Overloaded,
    /// The server aborted the request on its own (e.g. drained from the queue
    /// at shutdown); this error is that request's terminal frame. A client's
    /// `cancel` ends the request with `done` (`finish_reason` `cancelled`)
    /// instead.
    Cancelled,
    /// An unexpected server-side failure. If it has a `request_id`, that
    /// request is over; the session remains usable.
    Internal,
    /// The server is shutting down. Without a `request_id`: the connection
    /// closes (1001) after the running requests finished. With one: that
    /// request was refused before it started; send it again on another
    /// server (a draining replica takes no new work).
    ShuttingDown,
    /// The connection was idle longer than `limits.idle_timeout_ms`. The
    /// session survives for its TTL and can be resumed.
    IdleTimeout,
    /// On resume, frames after the client's `last_seq` for this request are no
    /// longer available (dropped from the bounded replay buffer, or the request
    /// is unknown). No further frames will be sent for that request; resubmit it
    /// under a new `request_id` if needed.
    ReplayUnavailable,
}

impl ErrorCode {
    /// Every code, in declaration order.
    pub const ALL: [ErrorCode; 27] = [
        ErrorCode::BadJson,
        ErrorCode::BinaryFrame,
        ErrorCode::UnknownType,
        ErrorCode::InvalidField,
        ErrorCode::InvalidParameter,
        ErrorCode::FrameTooLarge,
        ErrorCode::PromptTooLong,
        ErrorCode::ContextOverflow,
        ErrorCode::UnknownRequest,
        ErrorCode::DuplicateRequest,
        ErrorCode::TooManyRequests,
        ErrorCode::RateLimited,
        ErrorCode::SessionNotFound,
        ErrorCode::InvalidResumeToken,
        ErrorCode::SessionExpired,
        ErrorCode::NoSession,
        ErrorCode::SessionAlreadyOpen,
        ErrorCode::Unauthorized,
        ErrorCode::OriginNotAllowed,
        ErrorCode::ServerBusy,
        ErrorCode::FimUnsupported,
        ErrorCode::Overloaded,
        ErrorCode::Cancelled,
        ErrorCode::Internal,
        ErrorCode::ShuttingDown,
        ErrorCode::IdleTimeout,
        ErrorCode::ReplayUnavailable,
    ];

    /// The wire name, e.g. `"invalid_parameter"`.
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadJson => "bad_json",
            ErrorCode::BinaryFrame => "binary_frame",
            ErrorCode::UnknownType => "unknown_type",
            ErrorCode::InvalidField => "invalid_field",
            ErrorCode::InvalidParameter => "invalid_parameter",
            ErrorCode::FrameTooLarge => "frame_too_large",
            ErrorCode::PromptTooLong => "prompt_too_long",
            ErrorCode::ContextOverflow => "context_overflow",
            ErrorCode::UnknownRequest => "unknown_request",
            ErrorCode::DuplicateRequest => "duplicate_request",
            ErrorCode::TooManyRequests => "too_many_requests",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::SessionNotFound => "session_not_found",
            ErrorCode::InvalidResumeToken => "invalid_resume_token",
            ErrorCode::SessionExpired => "session_expired",
            ErrorCode::NoSession => "no_session",
            ErrorCode::SessionAlreadyOpen => "session_already_open",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::OriginNotAllowed => "origin_not_allowed",
            ErrorCode::ServerBusy => "server_busy",
            ErrorCode::FimUnsupported => "fim_unsupported",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::Cancelled => "cancelled",
            ErrorCode::Internal => "internal",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::IdleTimeout => "idle_timeout",
            ErrorCode::ReplayUnavailable => "replay_unavailable",
        }
    }

    /// Parses a wire name back into a code.
    pub fn from_wire(s: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// Whether the server closes the WebSocket right after sending this error.
    ///
    /// Fatal: `frame_too_large`, `unauthorized`, `origin_not_allowed`,
    /// `server_busy`, `shutting_down`, `idle_timeout`. Every other code only
    /// rejects the offending frame or request.
    pub const fn is_fatal(self) -> bool {
        matches!(
            self,
            ErrorCode::FrameTooLarge
                | ErrorCode::Unauthorized
                | ErrorCode::OriginNotAllowed
                | ErrorCode::ServerBusy
                | ErrorCode::ShuttingDown
                | ErrorCode::IdleTimeout
        )
    }

    /// The WebSocket close code the server uses when closing after a fatal
    /// error; `None` for non-fatal codes.
    ///
    /// 1009 (message too big) for `frame_too_large`, 1008 (policy violation)
    /// for `unauthorized` / `origin_not_allowed`, 1013 (try again later) for
    /// `server_busy`, 1001 (going away) for `shutting_down` / `idle_timeout`.
    pub const fn close_code(self) -> Option<u16> {
        match self {
            ErrorCode::FrameTooLarge => Some(1009),
            ErrorCode::Unauthorized | ErrorCode::OriginNotAllowed => Some(1008),
            ErrorCode::ServerBusy => Some(1013),
            ErrorCode::ShuttingDown | ErrorCode::IdleTimeout => Some(1001),
            _ => None,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A protocol-level failure: what goes into an `error` frame.
///
/// Returned by [`crate::parse_client`], the `validate` methods and
/// [`crate::GenerateRequest::check_limits`]. `request_id` is set whenever the
/// failing frame carried a well-formed `request_id`, so the error frame can be
/// correlated with the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ProtocolError {
    pub code: ErrorCode,
    pub message: String,
    pub request_id: Option<String>,
}

impl ProtocolError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ProtocolError { code, message: message.into(), request_id: None }
    }

    /// Sets `request_id` (replacing any previous one).
    pub fn with_request_id(mut self, request_id: impl Into<String>) -> Self {
        self.request_id = Some(request_id.into());
        self
    }

    /// Sets `request_id` unless one is already set.
    pub(crate) fn or_request_id(mut self, request_id: Option<&str>) -> Self {
        if self.request_id.is_none() {
            self.request_id = request_id.map(str::to_owned);
        }
        self
    }

    pub fn invalid_parameter(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidParameter, message)
    }

    pub fn invalid_field(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidField, message)
    }

    /// Shorthand for `self.code.is_fatal()`.
    pub fn is_fatal(&self) -> bool {
        self.code.is_fatal()
    }

    /// The `error` frame for this failure.
    pub fn to_message(&self) -> crate::ServerMessage {
        crate::ServerMessage::Error(crate::ErrorFrame { request_id: self.request_id.clone(), code: self.code, message: self.message.clone() })
    }
}

impl From<ProtocolError> for crate::ServerMessage {
    fn from(e: ProtocolError) -> Self {
        crate::ServerMessage::Error(crate::ErrorFrame { request_id: e.request_id, code: e.code, message: e.message })
    }
}
