//! The client → server message types, and their constructors and accessors.
//! Checks live in `validate`, the flat wire form of `generate` in `wire`.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ping_id::PingId;

/// Default `max_tokens` when a `generate` omits it.
pub const DEFAULT_MAX_TOKENS: u32 = 256;

/// Every client message `type`, in the order the protocol documents them.
pub const CLIENT_MESSAGE_TYPES: [&str; 5] = ["session.open", "generate", "cancel", "session.close", "ping"];

/// A frame sent by the client to the server.
///
/// In Rust, parse untrusted text with `parse_client`, which also validates and
/// classifies failures into error codes; the derived `Deserialize` is the plain
/// serde view of the same format.
// `generate` is most of the traffic and each frame is parsed once and moved
// into its request, so it is not boxed to shrink the rarer variants.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type")]
pub enum ClientMessage {
    /// Open a new session, or resume an existing one.
    #[serde(rename = "session.open")]
    SessionOpen(SessionOpen),
    /// Start a generation request.
    #[serde(rename = "generate")]
    Generate(GenerateRequest),
    /// Cancel an in-flight request.
    #[serde(rename = "cancel")]
    Cancel(Cancel),
    /// Close the session for good (it cannot be resumed afterwards).
    #[serde(rename = "session.close")]
    SessionClose(SessionClose),
    /// Liveness check; answered by `pong` echoing `id`.
    #[serde(rename = "ping")]
    Ping(Ping),
}

impl ClientMessage {
    /// The wire `type` of this message.
    pub fn type_name(&self) -> &'static str {
        match self {
            ClientMessage::SessionOpen(_) => "session.open",
            ClientMessage::Generate(_) => "generate",
            ClientMessage::Cancel(_) => "cancel",
            ClientMessage::SessionClose(_) => "session.close",
            ClientMessage::Ping(_) => "ping",
        }
    }

    /// The `request_id` of a `generate` or `cancel`.
    pub fn request_id(&self) -> Option<&str> {
        match self {
            ClientMessage::Generate(g) => Some(&g.request_id),
            ClientMessage::Cancel(c) => Some(&c.request_id),
            _ => None,
        }
    }

    /// Serializes to a JSON text frame (what a client sends).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("client messages always serialize")
    }
}

// ---------------------------------------------------------------------------
// session.open

/// `session.open`: with no fields, opens a new session. With `session_id` and
/// `resume_token` (both required together), resumes that session; `last_seq`
/// then maps each unfinished `request_id` to the highest `seq` received for it
/// (0 if none), and frames after it are replayed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(extend("dependentRequired" = {
    "session_id": ["resume_token"],
    "resume_token": ["session_id"],
    "last_seq": ["session_id", "resume_token"],
}))]
pub struct SessionOpen {
    /// Session to resume (from a previous `session.ready`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128), regex(pattern = r"^[!-~]+$"))]
    pub session_id: Option<String>,
    /// Secret from the same `session.ready`; required with `session_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128), regex(pattern = r"^[!-~]+$"))]
    pub resume_token: Option<String>,
    /// Per-request highest `seq` already received; only when resuming.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seq: Option<BTreeMap<String, u64>>,
}

impl SessionOpen {
    /// Whether this asks to resume an existing session.
    pub fn is_resume(&self) -> bool {
        self.session_id.is_some()
    }
}

// ---------------------------------------------------------------------------
// generate

/// Role of a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One chat message; the server renders `messages` with the model's chat template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: Role,
    /// The text (`""` on an assistant message that only called tools).
    pub content: String,
    /// The calls an assistant message made (as an earlier `done.tool_calls`
    /// returned them); assistant messages only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Which call a `tool` message answers (its `ToolCall.id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of plain text.
    pub fn new(role: Role, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role, content: content.into(), tool_calls: Vec::new(), tool_call_id: None }
    }
}

/// A function the model may call: its name, what it does, and its
/// arguments as a JSON Schema (an object schema).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    /// Only `function` (the default).
    #[serde(rename = "type", default)]
    pub kind: ToolKind,
    /// 1..=64 characters of `[A-Za-z0-9_.-]`, unique within the request.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9_.-]+$"))]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of the arguments object; omitted = any object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
}

/// The kind of a tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolKind {
    #[default]
    Function,
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    /// Server-chosen id; a `tool` message answering this call names it in `tool_call_id`.
    #[schemars(length(min = 1, max = 128))]
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments, as JSON text (an object).
    pub arguments: String,
}

/// `generate.tool_choice`: whether the model may, must or must not call tools.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum ToolChoice {
    /// `"auto"` (the default with tools: the model decides, and its calls are
    /// held to the tools' schemas once it starts one), `"none"` (no calls), or
    /// `"required"` (at least one call, nothing else).
    Mode(ToolChoiceMode),
    /// `{"type": "function", "name": ...}`: exactly this tool is called.
    Function(NamedTool),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoiceMode {
    None,
    Auto,
    Required,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NamedTool {
    #[serde(rename = "type", default)]
    pub kind: ToolKind,
    pub name: String,
}

/// Fill-in-the-middle input: generate the text between `prefix` and `suffix`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FimInput {
    /// Text before the cursor.
    pub prefix: String,
    /// Text after the cursor.
    pub suffix: String,
    /// Extra context (e.g. other open files), placed before the prefix.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extra: Vec<FimExtra>,
}

/// A piece of extra FIM context, optionally labelled with a file path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FimExtra {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    pub content: String,
}

/// The input of a `generate`: exactly one of `prompt`, `messages`, `fim` on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GenerateInput {
    /// Raw prompt text, tokenized as is (no chat template).
    Prompt(String),
    /// Chat messages, rendered with the model's chat template.
    Messages(Vec<ChatMessage>),
    /// Fill-in-the-middle.
    Fim(FimInput),
}

/// `generate`: start a request. Deserialized from the flat wire object (see
/// README); `input` holds whichever of `prompt` / `messages` / `fim` was given,
/// and omitted fields hold their defaults.
// Serialize, Deserialize and JsonSchema go through the flat wire form, in `wire`.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// Client-chosen id, unique within the session: 1..=64 chars of `[A-Za-z0-9._:-]`.
    pub request_id: String,
    pub input: GenerateInput,
    /// Most tokens to generate; default 256, at most `limits.max_tokens`.
    /// 0 pre-warms: the prompt is read into the session's cache and nothing
    /// is generated, so the next request with this prefix starts at once.
    pub max_tokens: u32,
    /// Sampling temperature in [0, 2]; 0 (the default) is greedy.
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1]; `None` = off.
    pub top_p: Option<f32>,
    /// Top-k in [0, 1000]; 0 or `None` = off.
    pub top_k: Option<u32>,
    /// Min-p in [0, 1]; `None` = off.
    pub min_p: Option<f32>,
    /// RNG seed for reproducible sampling.
    pub seed: Option<u64>,
    /// Stop sequences (at most 8, each 1..=64 bytes); the stop text is not emitted.
    pub stop: Vec<String>,
    /// Return the log-probability of each generated token.
    pub logprobs: bool,
    /// Also return this many (0..=20) most likely alternatives per token;
    /// requires `logprobs: true`.
    pub top_logprobs: Option<u8>,
    /// Cap on generation wall time in ms (at least 1); finishes with `time_limit`.
    pub max_time_ms: Option<u32>,
    /// Prefill chunk size in tokens (at least 1), checked against server limits.
    pub chunk_size: Option<u32>,
    /// Speculative decoding for this request; `None` = the server's default.
    pub speculation: Option<SpeculationOptions>,
    /// Where this request's finished state is cached; `None` = the session.
    pub cache: Option<CacheScopeName>,
    /// What the output must look like; `None` = any text.
    pub response_format: Option<ResponseFormat>,
    /// Functions the model may call (shown to it through its chat template);
    /// `messages` input only.
    pub tools: Vec<Tool>,
    /// `None` = `auto` when there are tools.
    pub tool_choice: Option<ToolChoice>,
    /// Whether one answer may hold several calls; `None` = yes.
    pub parallel_tool_calls: Option<bool>,
    /// Continue the text of the final message (an assistant prefill: the
    /// output picks up where it stops) rather than start a new assistant
    /// turn; `messages` input only. Set by edges whose API has it
    /// (Anthropic's); protocol v1's `generate` does not carry it.
    pub continue_final_message: bool,
}

/// `generate.response_format`: the output is constrained, token by token,
/// to a JSON Schema, a regular expression or a grammar. The request ends
/// (`finish_reason: "stop"`) when the output is complete, or with `length`
/// when `max_tokens` comes first. Bad schemas, patterns and grammars are
/// `invalid_parameter` errors that quote the parser's message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    /// Any text (the same as omitting `response_format`).
    Text,
    /// One JSON object, of any shape.
    JsonObject,
    /// JSON valid against `schema` (JSON Schema: objects, arrays, enums,
    /// `required`, string patterns and formats, `$ref`/`$defs`, ...).
    JsonSchema { schema: serde_json::Value },
    /// Text matching `pattern` in full (Rust `regex` syntax, no look-around).
    Regex { pattern: String },
    /// Text in the language of a Lark grammar (llguidance's Lark dialect;
    /// the start rule is `start`).
    Grammar { lark: String },
}

/// `generate.cache`: which prefix-cache scope a request's prompt and output
/// are stored in. Every request reuses its session's entries and the shared
/// ones, whichever match longer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CacheScopeName {
    /// Private to the session (the default): no other session ever sees it.
    Session,
    /// Reusable by every session on the server (e.g. pre-warm a common system
    /// prompt with `max_tokens: 0`). Never send private text this way.
    Shared,
}

/// Where draft tokens come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DraftSourceName {
    /// No speculation.
    Off,
    /// Prompt lookup: continuations copied from the prompt (FIM suffix and
    /// context files included) and the text generated so far.
    Echo,
    /// The server's draft model (a small model sharing the tokenizer);
    /// `invalid_parameter` when the server has none.
    DraftModel,
}

/// `generate.speculation`. Speculation never changes greedy output, and keeps
/// the sampling distribution; it only changes how many tokens each forward yields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SpeculationOptions {
    /// Draft source; omitted = the server's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<DraftSourceName>,
    /// Most draft tokens per verification, 1..=32; omitted = the server's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 32))]
    pub max_draft: Option<u8>,
}

impl GenerateRequest {
    /// A request with default parameters.
    pub fn new(request_id: impl Into<String>, input: GenerateInput) -> Self {
        GenerateRequest {
            request_id: request_id.into(),
            input,
            max_tokens: DEFAULT_MAX_TOKENS,
            temperature: 0.0,
            top_p: None,
            top_k: None,
            min_p: None,
            seed: None,
            stop: Vec::new(),
            logprobs: false,
            top_logprobs: None,
            max_time_ms: None,
            chunk_size: None,
            speculation: None,
            cache: None,
            response_format: None,
            tools: Vec::new(),
            tool_choice: None,
            parallel_tool_calls: None,
            continue_final_message: false,
        }
    }

    /// How this request uses its tools: `None` when it offers none or
    /// says `tool_choice: "none"`.
    pub fn tool_mode(&self) -> Option<ToolMode<'_>> {
        if self.tools.is_empty() {
            return None;
        }
        match &self.tool_choice {
            None | Some(ToolChoice::Mode(ToolChoiceMode::Auto)) => Some(ToolMode::Auto),
            Some(ToolChoice::Mode(ToolChoiceMode::None)) => None,
            Some(ToolChoice::Mode(ToolChoiceMode::Required)) => Some(ToolMode::Required),
            Some(ToolChoice::Function(f)) => Some(ToolMode::Named(&f.name)),
        }
    }

    /// Whether sampling is greedy (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// What a request with tools lets the model do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolMode<'a> {
    /// Answer in text or call tools.
    Auto,
    /// Call at least one tool, and write nothing else.
    Required,
    /// Call this tool, and write nothing else.
    Named(&'a str),
}

// ---------------------------------------------------------------------------
// cancel, session.close, ping

/// `cancel`: stop a request, queued or running. It ends with `done`
/// (`finish_reason` `cancelled`); unknown or finished ids get `unknown_request`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Cancel {
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9._:-]+$"))]
    pub request_id: String,
}

/// `session.close`: end the session; in-flight requests are cancelled, and the
/// server closes the socket.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionClose {}

/// `ping`: the server answers `pong` with the same `id`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Ping {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<PingId>,
}
