//! OpenAI's response shapes: whole completions, server-sent event chunks,
//! usage, logprobs and errors; and the two writers that put a request's
//! output into them.
use std::sync::Arc;

use hyper::{Response, StatusCode};
use protocol::{ErrorCode, FinishReason, ProtocolError, TokenLogprob, ToolCall, Usage};
use serde_json::{json, Value};

use super::super::http::edge::{self, EdgeError, Events};
use super::super::http::Body;
use super::super::relay::{Ending, Piece, Writer};
use crate::tokenizer::TextTokenizer;

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
    /// The protocol's code, for /metrics.
    metric: ErrorCode,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, kind, message: message.into(), param: None, code: None, metric: ErrorCode::InvalidParameter }
    }

    /// A 400 `invalid_request_error`.
    pub fn invalid(param: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError { param, ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message) }
    }

    pub fn with_param(mut self, param: &'static str) -> ApiError {
        self.param = Some(param);
        self
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }
}

impl EdgeError for ApiError {
    fn refusal(status: StatusCode, message: String) -> ApiError {
        let e = ApiError::new(status, "invalid_request_error", message);
        match status {
            StatusCode::PAYLOAD_TOO_LARGE => e.with_code("request_too_large"),
            StatusCode::REQUEST_TIMEOUT => e.with_code("request_timeout"),
            StatusCode::UNAUTHORIZED => e.with_code("invalid_api_key"),
            _ => e,
        }
    }

    fn bad_value(message: String) -> ApiError {
        ApiError::invalid(None, message).with_code("invalid_value")
    }

    /// As OpenAI words it.
    fn unknown_field(name: &str) -> ApiError {
        ApiError::invalid(None, format!("unrecognized request argument supplied: {name}")).with_code("unknown_parameter")
    }

    fn status(&self) -> StatusCode {
        self.status
    }

    fn metric(&self) -> ErrorCode {
        self.metric
    }

    fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl From<ProtocolError> for ApiError {
    fn from(e: ProtocolError) -> ApiError {
        let (status, kind, code) = match e.code {
            ErrorCode::PromptTooLong | ErrorCode::ContextOverflow => (StatusCode::BAD_REQUEST, "invalid_request_error", "context_length_exceeded"),
            ErrorCode::Overloaded => (StatusCode::SERVICE_UNAVAILABLE, "server_error", "overloaded"),
            ErrorCode::Cancelled | ErrorCode::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "server_error", "unavailable"),
            ErrorCode::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error"),
            ErrorCode::RateLimited => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "rate_limit_exceeded"),
            _ => (StatusCode::BAD_REQUEST, "invalid_request_error", e.code.as_str()),
        };
        ApiError { status, kind, message: e.message, param: None, code: Some(code), metric: e.code }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// What every response of one request carries.
pub struct Reply {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub tokenizer: Arc<TextTokenizer>,
}

fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length | FinishReason::TimeLimit => "length",
        FinishReason::ToolCalls => "tool_calls",
        _ => "stop",
    }
}

/// Calls in Chat Completions' shape; `first` numbers them in a stream.
fn tool_calls(calls: &[ToolCall], first: Option<usize>) -> Value {
    let call = |(i, c): (usize, &ToolCall)| {
        let mut v = json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}});
        if let Some(first) = first {
            v["index"] = json!(first + i);
        }
        v
    };
    Value::Array(calls.iter().enumerate().map(call).collect())
}

fn usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// A token's text and bytes (a token may hold part of a character).
fn token_text(tokenizer: &TextTokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.decode_bytes(&[id], false);
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Logprobs as Chat Completions' `content` list and the Responses API's
/// `logprobs` share them: `{token, logprob, bytes, top_logprobs: [{token,
/// logprob, bytes}]}` per token.
pub fn logprob_entries(tokenizer: &TextTokenizer, lps: &[TokenLogprob]) -> Vec<Value> {
    let entry = |id: u32, lp: f32| {
        let (token, bytes) = token_text(tokenizer, id);
        json!({"token": token, "logprob": lp, "bytes": bytes})
    };
    lps.iter()
        .map(|l| {
            let mut e = entry(l.token_id, l.logprob);
            e["top_logprobs"] = l.top.iter().flatten().map(|t| entry(t.token_id, t.logprob)).collect();
            e
        })
        .collect()
}

impl Reply {
    fn token_text(&self, id: u32) -> (String, Vec<u8>) {
        token_text(&self.tokenizer, id)
    }

    /// Logprobs of `lps` in the endpoint's shape: chat's `content` list, or
    /// the legacy completions' parallel lists (`text_offset` counted from `offset`).
    fn logprobs(&self, lps: &[TokenLogprob], offset: usize) -> Value {
        match self.endpoint {
            Endpoint::Chat => json!({"content": logprob_entries(&self.tokenizer, lps)}),
            Endpoint::Completion => {
                let (mut tokens, mut offsets, mut at) = (Vec::new(), Vec::new(), offset);
                for l in lps {
                    let (t, _) = self.token_text(l.token_id);
                    offsets.push(at);
                    at += t.len();
                    tokens.push(t);
                }
                let top: Vec<Value> = lps
                    .iter()
                    .map(|l| l.top.iter().flatten().map(|t| (self.token_text(t.token_id).0, json!(t.logprob))).collect::<serde_json::Map<_, _>>().into())
                    .collect();
                json!({
                    "tokens": tokens,
                    "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": offsets,
                })
            }
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    /// One choice: chat's `message` (whole) or `delta` (chunk), or the
    /// completion's `text`.
    fn choice(&self, text: &str, first_chunk: Option<bool>, logprobs: Option<Value>, finish: Option<&str>) -> Value {
        let mut c = json!({"index": 0, "logprobs": logprobs, "finish_reason": finish});
        match (self.endpoint, first_chunk) {
            (Endpoint::Chat, None) => c["message"] = json!({"role": "assistant", "content": text, "refusal": null}),
            (Endpoint::Chat, Some(true)) => c["delta"] = json!({"role": "assistant", "content": text}),
            (Endpoint::Chat, Some(false)) if finish.is_some() && text.is_empty() => c["delta"] = json!({}),
            (Endpoint::Chat, Some(false)) => c["delta"] = json!({"content": text}),
            (Endpoint::Completion, _) => c["text"] = json!(text),
        }
        c
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>, usage: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        } else if chunk {
            v["usage"] = Value::Null;
        }
        v
    }
}

/// The non-streaming writer: collects the text, calls and logprobs, then
/// answers with one JSON body.
pub struct Collected {
    reply: Reply,
    text: String,
    tool_calls: Vec<ToolCall>,
    logprobs: Option<Vec<TokenLogprob>>,
    ending: Option<Ending>,
}

impl Collected {
    pub fn new(reply: Reply) -> Collected {
        Collected { reply, text: String::new(), tool_calls: Vec::new(), logprobs: None, ending: None }
    }

    pub fn into_response(self) -> Result<Response<Body>, ApiError> {
        let ending = self.ending.unwrap_or_else(|| Err((ErrorCode::Internal, "the request ended without an answer".into())));
        let finished = ending.map_err(edge::failed::<ApiError>)?;
        let logprobs = self.logprobs.map(|l| self.reply.logprobs(&l, 0));
        let mut choice = self.reply.choice(&self.text, None, logprobs, Some(finish_reason(finished.reason)));
        if !self.tool_calls.is_empty() {
            let message = &mut choice["message"];
            if self.text.is_empty() {
                message["content"] = Value::Null;
            }
            message["tool_calls"] = tool_calls(&self.tool_calls, None);
        }
        Ok(edge::json(StatusCode::OK, &self.reply.envelope(false, vec![choice], Some(usage(&finished.usage)))))
    }
}

impl Writer for Collected {
    async fn piece(&mut self, piece: Piece) -> bool {
        self.text.push_str(&piece.text);
        self.tool_calls.extend(piece.tool_calls);
        if let Some(l) = piece.logprobs {
            self.logprobs.get_or_insert_with(Vec::new).extend(l);
        }
        true
    }

    async fn end(&mut self, ending: Ending) {
        self.ending = Some(ending);
    }
}

/// The streaming writer: one server-sent event per piece, a last chunk with
/// the finish reason, the usage chunk when asked for, then `[DONE]`. An
/// error after the first event is sent as an `error` event.
pub struct EventStream {
    reply: Reply,
    events: Events<ApiError>,
    include_usage: bool,
    /// Bytes of text sent, for the completions' `text_offset`.
    sent: usize,
    /// Tool calls sent (the next one's `index`).
    calls: usize,
}

impl EventStream {
    pub fn new(reply: Reply, events: Events<ApiError>, include_usage: bool) -> EventStream {
        EventStream { reply, events, include_usage, sent: 0, calls: 0 }
    }
}

impl Writer for EventStream {
    async fn piece(&mut self, piece: Piece) -> bool {
        let first = self.events.open();
        let logprobs = piece.logprobs.map(|l| self.reply.logprobs(&l, self.sent));
        self.sent += piece.text.len();
        // A piece with no text (held back: a character or a call's tag not
        // complete yet) is sent only to open the stream or carry logprobs.
        if !piece.text.is_empty() || first || logprobs.is_some() {
            let choice = self.reply.choice(&piece.text, Some(first), logprobs, None);
            if !self.events.send(None, self.reply.envelope(true, vec![choice], None)).await {
                return false;
            }
        }
        if piece.tool_calls.is_empty() {
            return true;
        }
        // Each call whole, in one chunk (clients join a call's pieces by
        // `index`, so one piece is a complete call).
        let choice = json!({"index": 0, "logprobs": null, "finish_reason": null, "delta": {"tool_calls": tool_calls(&piece.tool_calls, Some(self.calls))}});
        self.calls += piece.tool_calls.len();
        self.events.send(None, self.reply.envelope(true, vec![choice], None)).await
    }

    async fn end(&mut self, ending: Ending) {
        match ending {
            Err(e) => self.events.fail(edge::failed(e), None).await,
            Ok(f) => {
                let first = self.events.open();
                let choice = self.reply.choice("", Some(first), None, Some(finish_reason(f.reason)));
                if !self.events.send(None, self.reply.envelope(true, vec![choice], None)).await {
                    return;
                }
                if self.include_usage && !self.events.send(None, self.reply.envelope(true, Vec::new(), Some(usage(&f.usage)))).await {
                    return;
                }
                self.events.send(None, "[DONE]").await;
            }
        }
    }
}
