//! Anthropic's response shapes, and the two writers that put a request's
//! output into them: one `message` object, or the server-sent events
//! `message_start`, `ping`, `content_block_start` / `_delta` / `_stop` per
//! block, `message_delta` (stop reason, final usage) and `message_stop`.
//!
//! Text and tool calls keep the order the model wrote them in: text becomes
//! `text` blocks, each call a `tool_use` block whose input is sent whole in
//! one `input_json_delta` (the call is complete when the relay hands it over).
use protocol::{FinishReason, ToolCall, Usage};
use serde_json::{json, Value};

use super::super::http::edge::{self, Events};
use super::super::relay::{Ending, Finished, Piece, Writer};
use super::AnthropicError;

/// What every response of one request carries.
pub struct Reply {
    pub id: String,
    pub model: String,
    /// `max_tokens` as asked: a shorter answer cut for length ran out of context.
    pub max_tokens: u32,
    /// The prompt's tokens, for `message_start` (before the cache's share is known).
    pub prompt_tokens: u32,
}

enum Block {
    Text(String),
    ToolUse(ToolCall),
}

fn block_json(b: &Block) -> Value {
    match b {
        Block::Text(text) => json!({"type": "text", "text": text}),
        Block::ToolUse(call) => {
            // The relay's calls hold JSON objects (the grammar sees to it).
            let input: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}));
            json!({"type": "tool_use", "id": call.id, "name": call.name, "input": input})
        }
    }
}

/// Anthropic's `usage`: `input_tokens` are those read anew, the prefix
/// cache's share is `cache_read_input_tokens`.
fn usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    })
}

impl Reply {
    /// `stop_reason` and `stop_sequence` of a finished request.
    fn stop(&self, f: &Finished) -> (&'static str, Option<String>) {
        match f.reason {
            FinishReason::ToolCalls => ("tool_use", None),
            FinishReason::Stop if f.stop_string.is_some() => ("stop_sequence", f.stop_string.clone()),
            FinishReason::Length if f.usage.completion_tokens < self.max_tokens => ("model_context_window_exceeded", None),
            FinishReason::Length | FinishReason::TimeLimit => ("max_tokens", None),
            FinishReason::Stop | FinishReason::Cancelled => ("end_turn", None),
        }
    }

    fn message(&self, content: Vec<Value>, stop: Option<(&str, Option<String>)>, usage: Value) -> Value {
        let (reason, sequence) = stop.map_or((None, None), |(r, s)| (Some(r), s));
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        })
    }
}

/// Appends a piece's text and calls to `blocks`, text joining a text block
/// still open.
fn extend(blocks: &mut Vec<Block>, piece: Piece) {
    if !piece.text.is_empty() {
        match blocks.last_mut() {
            Some(Block::Text(t)) => t.push_str(&piece.text),
            _ => blocks.push(Block::Text(piece.text)),
        }
    }
    blocks.extend(piece.tool_calls.into_iter().map(Block::ToolUse));
}

/// The non-streaming writer: one `message` object at the end.
pub struct Collected {
    reply: Reply,
    blocks: Vec<Block>,
    ending: Option<Ending>,
}

impl Collected {
    pub fn new(reply: Reply) -> Collected {
        Collected { reply, blocks: Vec::new(), ending: None }
    }

    pub fn into_message(self) -> Result<Value, AnthropicError> {
        let ending = self.ending.unwrap_or_else(|| Err((protocol::ErrorCode::Internal, "the request ended without an answer".into())));
        let finished = ending.map_err(edge::failed::<AnthropicError>)?;
        let content = self.blocks.iter().map(block_json).collect();
        Ok(self.reply.message(content, Some(self.reply.stop(&finished)), usage(&finished.usage)))
    }
}

impl Writer for Collected {
    async fn piece(&mut self, piece: Piece) -> bool {
        extend(&mut self.blocks, piece);
        true
    }

    async fn end(&mut self, ending: Ending) {
        self.ending = Some(ending);
    }
}

/// The streaming writer. An error before the first event becomes the HTTP
/// response's status (through `ready`); after it, an `error` event.
pub struct EventStream {
    reply: Reply,
    events: Events<AnthropicError>,
    /// Blocks started so far (the next one's `index`).
    blocks: usize,
    /// A text block is open (the last one started).
    text_open: bool,
}

impl EventStream {
    pub fn new(reply: Reply, events: Events<AnthropicError>) -> EventStream {
        EventStream { reply, events, blocks: 0, text_open: false }
    }

    async fn event(&mut self, name: &str, data: Value) -> bool {
        self.events.send(Some(name), data).await
    }

    /// `message_start` and a `ping`, once, before anything else.
    async fn start(&mut self) -> bool {
        if !self.events.open() {
            return true;
        }
        let usage = json!({"input_tokens": self.reply.prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0});
        let message = self.reply.message(Vec::new(), None, usage);
        self.event("message_start", json!({"type": "message_start", "message": message})).await && self.event("ping", json!({"type": "ping"})).await
    }

    async fn close_text(&mut self) -> bool {
        if !std::mem::take(&mut self.text_open) {
            return true;
        }
        self.event("content_block_stop", json!({"type": "content_block_stop", "index": self.blocks - 1})).await
    }

    async fn text(&mut self, text: String) -> bool {
        if !self.text_open {
            let start = json!({"type": "content_block_start", "index": self.blocks, "content_block": {"type": "text", "text": ""}});
            self.blocks += 1;
            self.text_open = true;
            if !self.event("content_block_start", start).await {
                return false;
            }
        }
        let delta = json!({"type": "content_block_delta", "index": self.blocks - 1, "delta": {"type": "text_delta", "text": text}});
        self.event("content_block_delta", delta).await
    }

    async fn tool_use(&mut self, call: ToolCall) -> bool {
        let index = self.blocks;
        self.blocks += 1;
        let start =
            json!({"type": "content_block_start", "index": index, "content_block": {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}});
        let delta = json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": call.arguments}});
        self.event("content_block_start", start).await
            && self.event("content_block_delta", delta).await
            && self.event("content_block_stop", json!({"type": "content_block_stop", "index": index})).await
    }
}

impl Writer for EventStream {
    async fn piece(&mut self, piece: Piece) -> bool {
        if !self.start().await {
            return false;
        }
        if !piece.text.is_empty() && !self.text(piece.text).await {
            return false;
        }
        for call in piece.tool_calls {
            if !(self.close_text().await && self.tool_use(call).await) {
                return false;
            }
        }
        true
    }

    async fn end(&mut self, ending: Ending) {
        let finished = match ending {
            Ok(f) => f,
            Err(e) => return self.events.fail(edge::failed(e), Some("error")).await,
        };
        if !(self.start().await && self.close_text().await) {
            return;
        }
        let (reason, sequence) = self.reply.stop(&finished);
        let delta = json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage(&finished.usage)});
        if self.event("message_delta", delta).await {
            self.event("message_stop", json!({"type": "message_stop"})).await;
        }
    }
}
