//! Client → server messages and their validation: the types in `messages`,
//! their value checks in `validate`, and the flat wire form of `generate` in
//! `wire`.

mod messages;
mod validate;
mod wire;

pub use messages::{
    CacheScopeName, Cancel, ChatMessage, ClientMessage, DraftSourceName, FimExtra, FimInput, GenerateInput, GenerateRequest, NamedTool, Ping, ResponseFormat,
    Role, SessionClose, SessionOpen, SpeculationOptions, Tool, ToolCall, ToolChoice, ToolChoiceMode, ToolKind, ToolMode, CLIENT_MESSAGE_TYPES,
    DEFAULT_MAX_TOKENS,
};
pub use validate::{
    is_valid_request_id, MAX_DRAFT_TOKENS, MAX_GRAMMAR_BYTES, MAX_REQUEST_ID_LEN, MAX_SESSION_TOKEN_LEN, MAX_STOP_BYTES, MAX_STOP_SEQUENCES, MAX_TEMPERATURE,
    MAX_TOOLS, MAX_TOP_K, MAX_TOP_LOGPROBS,
};
