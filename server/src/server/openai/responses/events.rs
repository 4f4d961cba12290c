//! A response as the Responses API shows it: the `response` object, and the
//! event sequence a streamed one produces (`response.created`,
//! `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta`...,
//! `response.output_text.done`, `response.content_part.done`,
//! `response.output_item.done`, then `response.completed`,
//! `response.incomplete` or `response.failed`), each with its
//! `sequence_number` (and the socket lane's `stream_id`).
//!
//! [`ResponseWriter`] is this edge's relay writer: the same relay as every
//! other edge, only the wire differs ([`Sink`]).
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use hyper::body::Bytes;
use protocol::{ErrorCode, FinishReason, Usage};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::super::super::relay::{Ending, Piece, Writer};
use super::super::respond::ApiError;
use super::wire::Create;

/// Where a response's events go.
pub enum Sink {
    /// Server-sent events of `POST /v1/responses` with `stream: true`.
    Sse(mpsc::Sender<Bytes>),
    /// The WebSocket mode: JSON text frames to the socket's writer.
    Socket(mpsc::Sender<String>),
    /// Nowhere: the whole response is answered at the end.
    Collect,
}

impl Sink {
    async fn send(&self, event: &Value) -> bool {
        match self {
            Sink::Sse(tx) => {
                let kind = event["type"].as_str().unwrap_or("message");
                tx.send(Bytes::from(format!("event: {kind}\ndata: {event}\n\n"))).await.is_ok()
            }
            Sink::Socket(tx) => tx.send(event.to_string()).await.is_ok(),
            Sink::Collect => true,
        }
    }
}

/// What every `response` object of one request repeats.
pub struct Header {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    pub create: Create,
}

/// How a response ended.
pub enum Outcome {
    /// It ran to an end: `completed`, or `incomplete` at its token limit.
    Done {
        text: String,
        usage: Usage,
        incomplete: bool,
    },
    /// The client cancelled it.
    Cancelled,
    Failed(ApiError),
}

pub struct ResponseWriter {
    header: Header,
    sink: Sink,
    sequence: u64,
    /// The output message's id, once its item was opened.
    item: Option<String>,
    text: String,
    outcome: Option<Outcome>,
    /// Set by the edge when its client cancelled the response.
    cancelled: Arc<AtomicBool>,
}

fn usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

impl ResponseWriter {
    pub fn new(header: Header, sink: Sink, cancelled: Arc<AtomicBool>) -> ResponseWriter {
        ResponseWriter { header, sink, sequence: 0, item: None, text: String::new(), outcome: None, cancelled }
    }

    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    /// The `response` object in `status`.
    pub fn response(&self, status: &str, usage: Option<&Usage>, error: Option<&ApiError>) -> Value {
        let c = &self.header.create;
        let output: Vec<Value> = self.item.iter().map(|id| self.message(id, status == "in_progress")).collect();
        json!({
            "id": self.header.id,
            "object": "response",
            "created_at": self.header.created_at,
            "status": status,
            "background": false,
            "error": error.map(|e| json!({"code": e.code.unwrap_or("server_error"), "message": e.message})),
            "incomplete_details": (status == "incomplete").then(|| json!({"reason": "max_output_tokens"})),
            "instructions": c.instructions,
            "max_output_tokens": c.max_output_tokens,
            "metadata": if c.metadata.is_null() { json!({}) } else { c.metadata.clone() },
            "model": self.header.model,
            "output": output,
            "parallel_tool_calls": false,
            "previous_response_id": c.previous_response_id,
            "prompt_cache_key": c.prompt_cache_key,
            "store": c.store,
            "temperature": c.temperature,
            "text": {"format": c.text_format},
            "tool_choice": "none",
            "tools": [],
            "top_p": c.top_p.unwrap_or(1.0),
            "truncation": "disabled",
            "usage": usage.map(self::usage),
        })
    }

    /// The output message item.
    fn message(&self, id: &str, open: bool) -> Value {
        let content: Vec<Value> = if open { Vec::new() } else { vec![self.part()] };
        json!({"id": id, "type": "message", "status": if open { "in_progress" } else { "completed" }, "role": "assistant", "content": content})
    }

    fn part(&self) -> Value {
        json!({"type": "output_text", "text": self.text, "annotations": [], "logprobs": []})
    }

    /// The body of a whole (not streamed) response.
    pub fn whole(&self) -> Result<Value, ApiError> {
        match &self.outcome {
            Some(Outcome::Done { usage, incomplete, .. }) => Ok(self.response(if *incomplete { "incomplete" } else { "completed" }, Some(usage), None)),
            Some(Outcome::Cancelled) => Ok(self.response("cancelled", None, None)),
            Some(Outcome::Failed(e)) => Err(e.clone()),
            None => Err(ApiError::from((ErrorCode::Internal, "the response ended without an answer".to_string()))),
        }
    }

    async fn emit(&mut self, mut event: Value) -> bool {
        event["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        if let Some(lane) = &self.header.create.stream_id {
            event["stream_id"] = json!(lane);
        }
        self.sink.send(&event).await
    }

    /// `response.created` and `response.in_progress`: the response exists.
    pub async fn begin(&mut self) -> bool {
        let r = self.response("in_progress", None, None);
        self.emit(json!({"type": "response.created", "response": r})).await
            && self.emit(json!({"type": "response.in_progress", "response": self.response("in_progress", None, None)})).await
    }

    /// Opens the output message and its text part (once).
    async fn open_item(&mut self) -> bool {
        if self.item.is_some() {
            return true;
        }
        let id = super::super::super::new_secret("msg_");
        self.item = Some(id.clone());
        let item = self.message(&id, true);
        self.emit(json!({"type": "response.output_item.added", "output_index": 0, "item": item})).await
            && self
                .emit(json!({"type": "response.content_part.added", "item_id": id, "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
                .await
    }

    /// The text, part and item `done` events.
    async fn close_item(&mut self) -> bool {
        let Some(id) = self.item.clone() else { return true };
        let (text, part, item) = (self.text.clone(), self.part(), self.message(&id, false));
        self.emit(json!({"type": "response.output_text.done", "item_id": id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []})).await
            && self.emit(json!({"type": "response.content_part.done", "item_id": id, "output_index": 0, "content_index": 0, "part": part})).await
            && self.emit(json!({"type": "response.output_item.done", "output_index": 0, "item": item})).await
    }

    async fn fail(&mut self, e: ApiError) {
        let r = self.response("failed", None, Some(&e));
        self.outcome = Some(Outcome::Failed(e));
        self.emit(json!({"type": "response.failed", "response": r})).await;
    }
}

impl Writer for ResponseWriter {
    async fn piece(&mut self, piece: Piece) -> bool {
        if !self.open_item().await {
            return false;
        }
        if piece.text.is_empty() {
            return true;
        }
        self.text.push_str(&piece.text);
        let id = self.item.clone().unwrap_or_default();
        self.emit(json!({"type": "response.output_text.delta", "item_id": id, "output_index": 0, "content_index": 0, "delta": piece.text, "logprobs": []}))
            .await
    }

    async fn end(&mut self, ending: Ending) {
        let finished = match ending {
            Ok(f) => f,
            Err(e) => return self.fail(ApiError::from(e)).await,
        };
        if finished.reason == FinishReason::Cancelled {
            self.outcome = Some(Outcome::Cancelled);
            let r = self.response("cancelled", None, None);
            // The Responses API has no `response.cancelled` event: a
            // cancelled response ends as incomplete with status `cancelled`.
            self.emit(json!({"type": "response.incomplete", "response": r})).await;
            return;
        }
        if self.header.create.generate && !self.open_item().await {
            return;
        }
        if !self.close_item().await {
            return;
        }
        let incomplete = matches!(finished.reason, FinishReason::Length | FinishReason::TimeLimit) && self.header.create.generate;
        let status = if incomplete { "incomplete" } else { "completed" };
        let r = self.response(status, Some(&finished.usage), None);
        self.outcome = Some(Outcome::Done { text: self.text.clone(), usage: finished.usage, incomplete });
        let kind = if incomplete { "response.incomplete" } else { "response.completed" };
        self.emit(json!({"type": kind, "response": r})).await;
    }

    fn cancel_origin(&self) -> Option<bool> {
        self.cancelled.load(Ordering::Acquire).then_some(true)
    }
}
