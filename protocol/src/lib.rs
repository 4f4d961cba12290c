//! Tether wire protocol, version 1.
//!
//! Clients talk to the server over a WebSocket using JSON text frames; each
//! frame is one object whose `type` field names the message. This crate holds
//! the message types ([`ClientMessage`], [`ServerMessage`]), the parser that
//! turns an untrusted frame into a validated [`ClientMessage`] or a precise
//! [`ProtocolError`] ([`parse_client`]), the [`ErrorCode`] catalogue, and the
//! JSON Schema of the whole protocol ([`json_schema`]). See `README.md` for
//! the client-facing reference.

mod client;
mod error;
mod limits;
mod parse;
mod ping_id;
mod schema;
mod server;

pub use client::{
    is_valid_request_id, CacheScopeName, Cancel, ChatMessage, ClientMessage, DraftSourceName, FimExtra, FimInput, GenerateInput, GenerateRequest, NamedTool,
    Ping, ResponseFormat, Role, SessionClose, SessionOpen, SpeculationOptions, Tool, ToolCall, ToolChoice, ToolChoiceMode, ToolKind, ToolMode,
    CLIENT_MESSAGE_TYPES, DEFAULT_MAX_TOKENS, MAX_DRAFT_TOKENS, MAX_GRAMMAR_BYTES, MAX_REQUEST_ID_LEN, MAX_SESSION_TOKEN_LEN, MAX_STOP_BYTES,
    MAX_STOP_SEQUENCES, MAX_TEMPERATURE, MAX_TOOLS, MAX_TOP_K, MAX_TOP_LOGPROBS,
};
pub use error::{ErrorCode, ProtocolError};
pub use limits::Limits;
pub use parse::{parse_client, parse_json_strict};
pub use ping_id::PingId;
pub use schema::json_schema;
pub use server::{
    Delta, Done, ErrorFrame, FinishReason, ModelInfo, Pong, ServerMessage, SessionReady, SpeculativeStats, Timing, TokenLogprob, TopLogprob, Usage,
    SERVER_MESSAGE_TYPES,
};

/// The protocol version this crate speaks; sent in `session.ready`.
pub const PROTOCOL_VERSION: u32 = 1;
