//! Server → client messages.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::ErrorCode;
use crate::limits::Limits;
use crate::ping_id::PingId;

/// Every server message `type`.
pub const SERVER_MESSAGE_TYPES: [&str; 5] = ["session.ready", "delta", "done", "error", "pong"];

/// A frame sent by the server to the client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type")]
pub enum ServerMessage {
    /// Reply to a successful `session.open`.
    #[serde(rename = "session.ready")]
    SessionReady(SessionReady),
    /// A chunk of generated text for one request.
    #[serde(rename = "delta")]
    Delta(Delta),
    /// The end of one request.
    #[serde(rename = "done")]
    Done(Done),
    /// A rejected frame or a failed request.
    #[serde(rename = "error")]
    Error(ErrorFrame),
    /// Reply to `ping`.
    #[serde(rename = "pong")]
    Pong(Pong),
}

impl ServerMessage {
    /// The JSON text frame for this message.
    pub fn to_json(&self) -> String {
        // Every field is a string, integer, bool, finite-or-null float, or a
        // map with string keys: serialization cannot fail.
        serde_json::to_string(self).expect("server messages always serialize")
    }

    /// Parses a server frame (for Rust clients and tests). Unknown fields are
    /// rejected, like on the server side.
    pub fn from_json(text: &str) -> Result<ServerMessage, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The wire `type` of this message.
    pub fn type_name(&self) -> &'static str {
        match self {
            ServerMessage::SessionReady(_) => "session.ready",
            ServerMessage::Delta(_) => "delta",
            ServerMessage::Done(_) => "done",
            ServerMessage::Error(_) => "error",
            ServerMessage::Pong(_) => "pong",
        }
    }

    /// The request this frame belongs to, if any.
    pub fn request_id(&self) -> Option<&str> {
        match self {
            ServerMessage::Delta(d) => Some(&d.request_id),
            ServerMessage::Done(d) => Some(&d.request_id),
            ServerMessage::Error(e) => e.request_id.as_deref(),
            _ => None,
        }
    }

    /// The replay sequence number of a `delta` or `done`.
    pub fn seq(&self) -> Option<u64> {
        match self {
            ServerMessage::Delta(d) => Some(d.seq),
            ServerMessage::Done(d) => Some(d.seq),
            _ => None,
        }
    }

    /// An `error` frame.
    pub fn error(code: ErrorCode, message: impl Into<String>, request_id: Option<String>) -> Self {
        ServerMessage::Error(ErrorFrame { request_id, code, message: message.into() })
    }
}

/// The loaded model, announced in `session.ready`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelInfo {
    pub name: String,
    /// Architecture family, e.g. `llama`, `qwen2`.
    pub architecture: String,
    pub context_length: u32,
    pub vocab_size: u32,
    /// Whether `generate` accepts `fim`.
    pub fim: bool,
}

/// `session.ready`: the session is open (or resumed). On resume, replayed
/// frames follow this one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionReady {
    /// Protocol version spoken by the server (1).
    pub protocol_version: u32,
    pub session_id: String,
    /// Secret needed to resume this session; keep it private.
    pub resume_token: String,
    /// True when an existing session was resumed.
    pub resumed: bool,
    pub model: ModelInfo,
    pub limits: Limits,
}

/// `delta`: newly generated text for a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Delta {
    pub request_id: String,
    /// 1-based, contiguous per request.
    #[schemars(range(min = 1))]
    pub seq: u64,
    /// Text decoded from `token_ids` (may be empty while a multi-byte
    /// character is incomplete; may lag tokens held back by stop matching).
    pub text: String,
    pub token_ids: Vec<u32>,
    /// Per-token log-probabilities, parallel to `token_ids`, when requested.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprob>>,
}

/// Log-probability of a generated token, with optional alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens, most likely first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top: Option<Vec<TopLogprob>>,
}

/// One alternative token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TopLogprob {
    pub token_id: u32,
    pub logprob: f32,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-sequence token or a stop sequence.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled by `cancel` (or by `session.close`).
    Cancelled,
    /// `max_time_ms` reached.
    TimeLimit,
    /// The model called tools (`done.tool_calls`) and waits for their results.
    ToolCalls,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::TimeLimit => "time_limit",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache (included in `prompt_tokens`).
    pub cached_tokens: u32,
    pub completion_tokens: u32,
}

/// Timings of a finished request, in ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Timing {
    /// From receipt to the start of prefill.
    pub queue_ms: u64,
    /// From receipt to the first generated token.
    pub ttft_ms: u64,
    /// From receipt to `done`.
    pub total_ms: u64,
}

/// `done`: the request is over. Its `seq` is one past the last delta's (1
/// if there were none), so replay covers it too.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Done {
    pub request_id: String,
    #[schemars(range(min = 1))]
    pub seq: u64,
    pub finish_reason: FinishReason,
    pub usage: Usage,
    pub timing: Timing,
    /// Present when the request speculated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeStats>,
    /// The tools the model called, in order (with `finish_reason:
    /// "tool_calls"`); the text deltas carry only the rest of the answer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<crate::ToolCall>,
}

/// How speculation went for one request.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeStats {
    /// Draft tokens verified.
    pub drafted: u64,
    /// Draft tokens accepted (each saved one forward).
    pub accepted: u64,
    /// Acceptance rate at each draft position (first draft first).
    pub acceptance_by_position: Vec<f32>,
    /// Generated tokens per forward of this request's decode (1.0 without speculation).
    pub tokens_per_forward: f32,
}

/// `error`: see [`ErrorCode`] for each code's meaning and whether the
/// socket is closed afterwards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorFrame {
    /// The request concerned, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    pub code: ErrorCode,
    /// Human-readable detail, naming the offending field and allowed range.
    pub message: String,
}

/// `pong`: echoes the `ping`'s `id` (absent if the ping had none).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Pong {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<PingId>,
}
