//! A response as the Responses API shows it: the `response` object, and the
//! event sequence a streamed one produces (`response.created`,
//! `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta`...,
//! `response.output_text.done`, `response.content_part.done`,
//! `response.output_item.done`; for each tool call a `function_call` item
//! with `response.function_call_arguments.delta` and `.done`; then `response.completed`,
//! `response.incomplete` or `response.failed`), each with its
//! `sequence_number` (and the socket lane's `stream_id`).
//!
//! [`ResponseWriter`] is this edge's relay writer: the same relay as every
//! other edge, only the wire differs ([`Sink`]).
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use hyper::body::Bytes;
use protocol::{ErrorCode, FinishReason, ProtocolError, ToolCall, Usage};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::super::super::http::edge;
use super::super::super::relay::{Ending, Piece, Writer};
use super::super::respond::{logprob_entries, ApiError};
use super::super::unix_now;
use super::wire::Create;
use crate::tokenizer::TextTokenizer;

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

/// Why the client stopped a running response, set by the edge before it
/// stops the row: a cancel ends it `cancelled`; a steer ends it
/// `incomplete` (reason `steered`), its output kept for the successor.
#[derive(Default)]
pub struct Interrupt(AtomicU8);

const CANCELLED: u8 = 1;
const STEERED: u8 = 2;

impl Interrupt {
    /// Marks the response cancelled unless it was steered (the steer
    /// already stopped it, its output kept).
    pub fn cancel(&self) {
        let _ = self.0.compare_exchange(0, CANCELLED, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Marks the response steered unless it was cancelled; false if it was.
    pub fn steer(&self) -> bool {
        self.0.compare_exchange(0, STEERED, Ordering::AcqRel, Ordering::Acquire).is_ok() || self.steered()
    }

    pub fn steered(&self) -> bool {
        self.0.load(Ordering::Acquire) == STEERED
    }

    fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire) != 0
    }
}

/// What every `response` object of one request repeats.
pub struct Header {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    pub create: Create,
    /// Names the tokens of logprobs.
    pub tokenizer: Arc<TextTokenizer>,
}

/// How a response ended.
pub enum Outcome {
    /// It ran to an end: `completed`, or `incomplete` at its token limit.
    Done {
        text: String,
        tool_calls: Vec<ToolCall>,
        usage: Usage,
        incomplete: bool,
    },
    /// The client cancelled it.
    Cancelled,
    Failed(ApiError),
}

/// One item of a response's `output`.
enum Item {
    /// Assistant text; `open` while it may still grow. `logprobs`: one
    /// entry per token when the request asked for them.
    Message { id: String, text: String, open: bool, logprobs: Option<Vec<Value>> },
    /// A function call (`call.id` is its `call_id`).
    Call { id: String, call: ToolCall },
}

impl Item {
    fn json(&self) -> Value {
        match self {
            Item::Message { id, text, open, logprobs } => {
                let content: Vec<Value> = if *open { Vec::new() } else { vec![text_part(text, logprobs.as_deref())] };
                json!({"id": id, "type": "message", "status": if *open { "in_progress" } else { "completed" }, "role": "assistant", "content": content})
            }
            Item::Call { id, call } => function_call(id, call, "completed", &call.arguments),
        }
    }
}

/// An `output_text` part; its `logprobs` are `[]` unless they were asked for.
fn text_part(text: &str, logprobs: Option<&[Value]>) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs.unwrap_or_default()})
}

fn function_call(id: &str, call: &ToolCall, status: &str, arguments: &str) -> Value {
    json!({"id": id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name, "arguments": arguments})
}

pub struct ResponseWriter {
    header: Header,
    sink: Sink,
    sequence: u64,
    /// The output so far, in order.
    items: Vec<Item>,
    outcome: Option<Outcome>,
    /// Set by the edge when its client cancelled or steered the response.
    interrupt: Arc<Interrupt>,
    /// Unix seconds when the response completed.
    completed_at: Option<u64>,
    /// Why an `incomplete` response stopped: `max_output_tokens`, or `steered`.
    incomplete_reason: &'static str,
    /// Logprobs of tokens whose text is still held back (a partial
    /// character or stop string): they go out with the next text delta.
    pending_logprobs: Vec<Value>,
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
    pub fn new(header: Header, sink: Sink, interrupt: Arc<Interrupt>) -> ResponseWriter {
        ResponseWriter {
            header,
            sink,
            sequence: 0,
            items: Vec::new(),
            outcome: None,
            interrupt,
            completed_at: None,
            incomplete_reason: "max_output_tokens",
            pending_logprobs: Vec::new(),
        }
    }

    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    /// The `response` object in `status`.
    pub fn response(&self, status: &str, usage: Option<&Usage>, error: Option<&ApiError>) -> Value {
        let c = &self.header.create;
        let output: Vec<Value> = self.items.iter().map(Item::json).collect();
        json!({
            "id": self.header.id,
            "object": "response",
            "created_at": self.header.created_at,
            "completed_at": if status == "completed" { self.completed_at } else { None },
            "status": status,
            "background": false,
            "error": error.map(|e| json!({"code": e.code.unwrap_or("server_error"), "message": e.message})),
            "incomplete_details": (status == "incomplete").then(|| json!({"reason": self.incomplete_reason})),
            "instructions": c.instructions,
            "max_output_tokens": c.max_output_tokens,
            "max_tool_calls": c.max_tool_calls,
            "metadata": if c.metadata.is_null() { json!({}) } else { c.metadata.clone() },
            "model": self.header.model,
            "output": output,
            "parallel_tool_calls": c.parallel_tool_calls.unwrap_or(true),
            "previous_response_id": c.previous_response_id,
            "prompt_cache_key": c.prompt_cache_key,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "reasoning": c.reasoning_echo,
            "safety_identifier": c.safety_identifier,
            "service_tier": "default",
            "store": c.store,
            "temperature": c.temperature,
            "text": {"format": c.text_format},
            "tool_choice": c.tool_choice_echo,
            "tools": c.tools_echo,
            "top_logprobs": c.top_logprobs,
            "top_p": c.top_p.unwrap_or(1.0),
            "truncation": "disabled",
            "usage": usage.map(self::usage),
            "user": c.user,
        })
    }

    /// The body of a whole (not streamed) response.
    pub fn whole(&self) -> Result<Value, ApiError> {
        match &self.outcome {
            Some(Outcome::Done { usage, incomplete, .. }) => Ok(self.response(if *incomplete { "incomplete" } else { "completed" }, Some(usage), None)),
            Some(Outcome::Cancelled) => Ok(self.response("cancelled", None, None)),
            Some(Outcome::Failed(e)) => Err(e.clone()),
            None => Err(ApiError::from(ProtocolError::new(ErrorCode::Internal, "the response ended without an answer"))),
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

    /// The open message's id and output index, opening one (with its text
    /// part) when the last item is not an open message.
    async fn open_message(&mut self) -> Option<(String, usize)> {
        if let Some(Item::Message { id, open: true, .. }) = self.items.last() {
            return Some((id.clone(), self.items.len() - 1));
        }
        let id = super::super::super::new_secret("msg_");
        let index = self.items.len();
        let logprobs = self.header.create.logprobs.then(Vec::new);
        self.items.push(Item::Message { id: id.clone(), text: String::new(), open: true, logprobs });
        let item = self.items[index].json();
        let opened = self.emit(json!({"type": "response.output_item.added", "output_index": index, "item": item})).await
            && self
                .emit(json!({"type": "response.content_part.added", "item_id": id, "output_index": index, "content_index": 0,
                "part": text_part("", None)}))
                .await;
        opened.then_some((id, index))
    }

    /// The text, part and item `done` events of the open message, if any.
    async fn close_message(&mut self) -> bool {
        let index = self.items.len().wrapping_sub(1);
        let Some(Item::Message { id, text, open, logprobs }) = self.items.last_mut() else { return true };
        if !*open {
            return true;
        }
        *open = false;
        let (id, text, logprobs) = (id.clone(), text.clone(), logprobs.clone());
        let item = self.items[index].json();
        let part = text_part(&text, logprobs.as_deref());
        self.emit(json!({"type": "response.output_text.done", "item_id": id, "output_index": index, "content_index": 0, "text": text,
            "logprobs": part["logprobs"]}))
            .await
            && self.emit(json!({"type": "response.content_part.done", "item_id": id, "output_index": index, "content_index": 0, "part": part})).await
            && self.emit(json!({"type": "response.output_item.done", "output_index": index, "item": item})).await
    }

    /// A call, whole: its item added, its arguments, its item done.
    async fn emit_call(&mut self, call: ToolCall) -> bool {
        if !self.close_message().await {
            return false;
        }
        let id = super::super::super::new_secret("fc_");
        let index = self.items.len();
        let added = function_call(&id, &call, "in_progress", "");
        let (arguments, name) = (call.arguments.clone(), call.name.clone());
        self.items.push(Item::Call { id: id.clone(), call });
        let done = self.items[index].json();
        self.emit(json!({"type": "response.output_item.added", "output_index": index, "item": added})).await
            && self.emit(json!({"type": "response.function_call_arguments.delta", "item_id": id, "output_index": index, "delta": arguments})).await
            && self
                .emit(json!({"type": "response.function_call_arguments.done", "item_id": id, "output_index": index, "name": name, "arguments": arguments}))
                .await
            && self.emit(json!({"type": "response.output_item.done", "output_index": index, "item": done})).await
    }

    async fn fail(&mut self, e: ApiError) {
        let r = self.response("failed", None, Some(&e));
        self.outcome = Some(Outcome::Failed(e));
        self.emit(json!({"type": "response.failed", "response": r})).await;
    }

    /// The answer's text and calls, for the conversation's next turn.
    fn answer(&self) -> (String, Vec<ToolCall>) {
        let mut text = String::new();
        let mut calls = Vec::new();
        for item in &self.items {
            match item {
                Item::Message { text: t, .. } => text.push_str(t),
                Item::Call { call, .. } => calls.push(call.clone()),
            }
        }
        (text, calls)
    }
}

impl Writer for ResponseWriter {
    async fn piece(&mut self, piece: Piece) -> bool {
        // The message opens with the first output, unless the output may
        // be calls (then with the first text).
        let first = self.items.is_empty() && self.header.create.tools.is_empty();
        if let Some(l) = &piece.logprobs {
            self.pending_logprobs.extend(logprob_entries(&self.header.tokenizer, l));
        }
        if !piece.text.is_empty() || first {
            let Some((id, index)) = self.open_message().await else { return false };
            if !piece.text.is_empty() {
                let entries = std::mem::take(&mut self.pending_logprobs);
                if let Some(Item::Message { text, logprobs, .. }) = self.items.last_mut() {
                    text.push_str(&piece.text);
                    if let Some(all) = logprobs {
                        all.extend(entries.iter().cloned());
                    }
                }
                let delta = json!({"type": "response.output_text.delta", "item_id": id, "output_index": index, "content_index": 0, "delta": piece.text, "logprobs": entries});
                if !self.emit(delta).await {
                    return false;
                }
            }
        }
        if !piece.tool_calls.is_empty() {
            // Those were the calls' tokens, not text's.
            self.pending_logprobs.clear();
        }
        for call in piece.tool_calls {
            if !self.emit_call(call).await {
                return false;
            }
        }
        true
    }

    async fn end(&mut self, ending: Ending) {
        let finished = match ending {
            Ok(f) => f,
            Err(e) => return self.fail(edge::failed(e)).await,
        };
        // A steered response stops where it was, as at a stop string (its
        // output, and its KV state, kept for the successor).
        let steered = finished.reason == FinishReason::Stop && self.interrupt.steered();
        if steered {
            self.incomplete_reason = "steered";
        }
        if finished.reason == FinishReason::Cancelled {
            self.outcome = Some(Outcome::Cancelled);
            let r = self.response("cancelled", None, None);
            // The Responses API has no `response.cancelled` event: a
            // cancelled response ends as incomplete with status `cancelled`.
            self.emit(json!({"type": "response.incomplete", "response": r})).await;
            return;
        }
        // An answer always has an item, if only an empty message.
        if self.header.create.generate && self.items.is_empty() && self.open_message().await.is_none() {
            return;
        }
        if !self.close_message().await {
            return;
        }
        let incomplete = steered || (matches!(finished.reason, FinishReason::Length | FinishReason::TimeLimit) && self.header.create.generate);
        let status = if incomplete { "incomplete" } else { "completed" };
        self.completed_at = Some(unix_now());
        let r = self.response(status, Some(&finished.usage), None);
        let (text, tool_calls) = self.answer();
        self.outcome = Some(Outcome::Done { text, tool_calls, usage: finished.usage, incomplete });
        let kind = if incomplete { "response.incomplete" } else { "response.completed" };
        self.emit(json!({"type": kind, "response": r})).await;
    }

    fn cancel_origin(&self) -> Option<bool> {
        self.interrupt.is_set().then_some(true)
    }
}
