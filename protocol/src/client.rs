//! Client → server messages and their validation.

use std::collections::BTreeMap;
use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{ErrorCode, ProtocolError};
use crate::server::Limits;

/// Default `max_tokens` when a `generate` omits it.
pub const DEFAULT_MAX_TOKENS: u32 = 256;
/// Longest allowed `request_id`, in characters.
pub const MAX_REQUEST_ID_LEN: usize = 64;
/// Longest allowed `session_id` / `resume_token`, in bytes.
pub const MAX_SESSION_TOKEN_LEN: usize = 128;
/// Most `stop` sequences per request.
pub const MAX_STOP_SEQUENCES: usize = 8;
/// Longest `stop` sequence, in UTF-8 bytes.
pub const MAX_STOP_BYTES: usize = 64;
/// Largest `top_k` (0 disables top-k).
pub const MAX_TOP_K: u32 = 1000;
/// Largest `top_logprobs`.
pub const MAX_TOP_LOGPROBS: u8 = 20;
/// Largest `temperature`.
pub const MAX_TEMPERATURE: f32 = 2.0;
/// Largest `speculation.max_draft`.
pub const MAX_DRAFT_TOKENS: u8 = 32;

/// Every client message `type`, in the order the protocol documents them.
pub const CLIENT_MESSAGE_TYPES: [&str; 5] = [
    "session.open",
    "generate",
    "cancel",
    "session.close",
    "ping",
];

/// A frame sent by the client to the server.
///
/// In Rust, parse untrusted text with `parse_client`, which also validates and
/// classifies failures into error codes; the derived `Deserialize` is the plain
/// serde view of the same format.
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

    /// Semantic validation (value ranges and formats) of a well-typed message.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        match self {
            ClientMessage::SessionOpen(m) => m.validate(),
            ClientMessage::Generate(m) => m.validate(),
            ClientMessage::Cancel(m) => m.validate(),
            ClientMessage::SessionClose(_) | ClientMessage::Ping(_) => Ok(()),
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

    /// Checks field pairing (`invalid_field`) and id formats (`invalid_parameter`).
    pub fn validate(&self) -> Result<(), ProtocolError> {
        match (&self.session_id, &self.resume_token) {
            (Some(_), None) => {
                return Err(ProtocolError::invalid_field(
                    "missing field `resume_token`: resuming needs both `session_id` and `resume_token`",
                ))
            }
            (None, Some(_)) => {
                return Err(ProtocolError::invalid_field(
                    "missing field `session_id`: `resume_token` is only valid together with `session_id`",
                ))
            }
            _ => {}
        }
        if self.last_seq.is_some() && self.session_id.is_none() {
            return Err(ProtocolError::invalid_field(
                "`last_seq` is only valid when resuming (with `session_id` and `resume_token`)",
            ));
        }
        if let Some(id) = &self.session_id {
            check_session_token("session_id", id)?;
        }
        if let Some(tok) = &self.resume_token {
            check_session_token("resume_token", tok)?;
        }
        if let Some(map) = &self.last_seq {
            for key in map.keys() {
                if let Err(why) = request_id_problem(key) {
                    return Err(ProtocolError::invalid_parameter(format!(
                        "last_seq keys must be request ids (1 to {MAX_REQUEST_ID_LEN} characters from [A-Za-z0-9._:-]), {why}"
                    )));
                }
            }
        }
        Ok(())
    }
}

fn check_session_token(field: &str, v: &str) -> Result<(), ProtocolError> {
    let why = if v.is_empty() {
        "got an empty string".to_string()
    } else if v.len() > MAX_SESSION_TOKEN_LEN {
        format!("got {} bytes", v.len())
    } else if let Some(c) = v.chars().find(|c| !matches!(*c as u32, 0x21..=0x7e)) {
        format!("got invalid character {c:?}")
    } else {
        return Ok(());
    };
    Err(ProtocolError::invalid_parameter(format!(
        "{field} must be 1 to {MAX_SESSION_TOKEN_LEN} printable ASCII characters without spaces, {why}"
    )))
}

// ---------------------------------------------------------------------------
// request ids

/// Whether `id` is a valid `request_id`: 1 to 64 characters from `[A-Za-z0-9._:-]`.
pub fn is_valid_request_id(id: &str) -> bool {
    request_id_problem(id).is_ok()
}

fn request_id_problem(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("got an empty string".into());
    }
    let n = id.chars().count();
    if n > MAX_REQUEST_ID_LEN {
        return Err(format!("got {n} characters"));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
    {
        return Err(format!("got invalid character {c:?}"));
    }
    Ok(())
}

fn check_request_id(id: &str) -> Result<(), ProtocolError> {
    request_id_problem(id).map_err(|why| {
        ProtocolError::invalid_parameter(format!(
            "request_id must be 1 to {MAX_REQUEST_ID_LEN} characters from [A-Za-z0-9._:-], {why}"
        ))
    })
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
    pub content: String,
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "GenerateWire", into = "GenerateWire")]
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
        }
    }

    /// Whether sampling is greedy (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Range and format checks that need no server configuration. Errors are
    /// `invalid_parameter` and carry `request_id` when it is itself valid.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        check_request_id(&self.request_id)?;
        self.validate_params()
            .map_err(|e| e.with_request_id(self.request_id.clone()))
    }

    fn validate_params(&self) -> Result<(), ProtocolError> {
        fn bad(m: impl Into<String>) -> ProtocolError {
            ProtocolError::invalid_parameter(m)
        }
        if let GenerateInput::Messages(m) = &self.input {
            if m.is_empty() {
                return Err(bad("messages must contain at least 1 message, got 0"));
            }
        }
        if !(self.temperature >= 0.0 && self.temperature <= MAX_TEMPERATURE) {
            return Err(bad(format!(
                "temperature must be in [0, 2], got {}",
                self.temperature
            )));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(bad(format!("top_p must be in (0, 1], got {p}")));
            }
        }
        if let Some(k) = self.top_k {
            if k > MAX_TOP_K {
                return Err(bad(format!(
                    "top_k must be in [0, {MAX_TOP_K}] (0 = off), got {k}"
                )));
            }
        }
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(bad(format!("min_p must be in [0, 1], got {p}")));
            }
        }
        if self.stop.len() > MAX_STOP_SEQUENCES {
            return Err(bad(format!(
                "stop must have at most {MAX_STOP_SEQUENCES} entries, got {}",
                self.stop.len()
            )));
        }
        for (i, s) in self.stop.iter().enumerate() {
            if s.is_empty() || s.len() > MAX_STOP_BYTES {
                return Err(bad(format!(
                    "stop[{i}] must be 1 to {MAX_STOP_BYTES} bytes long, got {} bytes",
                    s.len()
                )));
            }
        }
        if let Some(n) = self.top_logprobs {
            if n > MAX_TOP_LOGPROBS {
                return Err(bad(format!(
                    "top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {n}"
                )));
            }
            if !self.logprobs {
                return Err(bad("top_logprobs requires logprobs: true"));
            }
        }
        if self.max_time_ms == Some(0) {
            return Err(bad("max_time_ms must be at least 1, got 0"));
        }
        if self.chunk_size == Some(0) {
            return Err(bad("chunk_size must be at least 1, got 0"));
        }
        if let Some(n) = self.speculation.and_then(|s| s.max_draft) {
            if n == 0 || n > MAX_DRAFT_TOKENS {
                return Err(bad(format!(
                    "speculation.max_draft must be in [1, {MAX_DRAFT_TOKENS}], got {n}"
                )));
            }
        }
        Ok(())
    }

    /// Checks that depend on the server's configuration but need no
    /// tokenization: `max_tokens <= limits.max_tokens` (`invalid_parameter`)
    /// and `max_tokens < limits.context_length` (`context_overflow`: even a
    /// one-token prompt would not fit). Errors carry `request_id`.
    pub fn check_limits(&self, limits: &Limits) -> Result<(), ProtocolError> {
        let err = |code, msg: String| {
            Err(ProtocolError::new(code, msg).with_request_id(self.request_id.clone()))
        };
        if self.max_tokens > limits.max_tokens {
            return err(
                ErrorCode::InvalidParameter,
                format!(
                    "max_tokens must be in [0, {}], got {}",
                    limits.max_tokens, self.max_tokens
                ),
            );
        }
        if self.max_tokens >= limits.context_length {
            return err(
                ErrorCode::ContextOverflow,
                format!(
                    "max_tokens {} leaves no room for the prompt in the {}-token context",
                    self.max_tokens, limits.context_length
                ),
            );
        }
        Ok(())
    }

    /// Checks after tokenization: `prompt_tokens <= limits.max_prompt_tokens`
    /// (`prompt_too_long`) and `prompt_tokens + max_tokens <= limits.context_length`
    /// (`context_overflow`). Errors carry `request_id`.
    pub fn check_prompt_tokens(
        &self,
        prompt_tokens: usize,
        limits: &Limits,
    ) -> Result<(), ProtocolError> {
        let err = |code, msg: String| {
            Err(ProtocolError::new(code, msg).with_request_id(self.request_id.clone()))
        };
        if prompt_tokens > limits.max_prompt_tokens as usize {
            return err(
                ErrorCode::PromptTooLong,
                format!(
                    "prompt is {prompt_tokens} tokens, the limit is {}",
                    limits.max_prompt_tokens
                ),
            );
        }
        let total = prompt_tokens as u64 + self.max_tokens as u64;
        if total > limits.context_length as u64 {
            return err(
                ErrorCode::ContextOverflow,
                format!(
                    "prompt ({prompt_tokens} tokens) + max_tokens ({}) = {total} exceeds the context length {}",
                    self.max_tokens, limits.context_length
                ),
            );
        }
        Ok(())
    }
}

/// The flat wire form of `generate` (what the JSON looks like).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(
    title = "GenerateRequest",
    description = "`generate`: start a request. Exactly one of `prompt`, `messages`, `fim` is required.",
    extend("oneOf" = [
        {"required": ["prompt"]},
        {"required": ["messages"]},
        {"required": ["fim"]},
    ])
)]
struct GenerateWire {
    /// Client-chosen id, unique within the session.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9._:-]+$"))]
    request_id: String,
    /// Raw prompt text (no chat template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    prompt: Option<String>,
    /// Chat messages, rendered with the model's chat template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    messages: Option<Vec<ChatMessage>>,
    /// Fill-in-the-middle input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fim: Option<FimInput>,
    /// Most tokens to generate (at most `limits.max_tokens`); 0 pre-warms the session's cache.
    #[serde(default = "default_max_tokens")]
    #[schemars(range(min = 0))]
    max_tokens: u32,
    /// Sampling temperature; 0 = greedy.
    #[serde(default)]
    #[schemars(range(min = 0.0, max = 2.0))]
    temperature: f32,
    /// Nucleus sampling mass, in (0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 1.0), extend("exclusiveMinimum" = 0))]
    top_p: Option<f32>,
    /// Top-k; 0 = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    top_k: Option<u32>,
    /// Min-p, in [0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    min_p: Option<f32>,
    /// RNG seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    /// Stop sequences, each 1..=64 UTF-8 bytes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), inner(length(min = 1)))]
    stop: Vec<String>,
    /// Return per-token log-probabilities.
    #[serde(default, skip_serializing_if = "is_false")]
    logprobs: bool,
    /// Alternatives per token (0..=20); requires `logprobs: true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 20))]
    top_logprobs: Option<u8>,
    /// Cap on generation wall time, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    max_time_ms: Option<u32>,
    /// Prefill chunk size, tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    chunk_size: Option<u32>,
    /// Speculative decoding; omitted = the server's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    speculation: Option<SpeculationOptions>,
    /// Prefix-cache scope this request's state is stored in: `session` (default) or `shared`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cache: Option<CacheScopeName>,
}

fn default_max_tokens() -> u32 {
    DEFAULT_MAX_TOKENS
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Why a wire `generate` couldn't become a [`GenerateRequest`] (a field error).
#[derive(Debug)]
struct InputChoiceError(String);

impl fmt::Display for InputChoiceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<GenerateWire> for GenerateRequest {
    type Error = InputChoiceError;

    fn try_from(w: GenerateWire) -> Result<Self, Self::Error> {
        let input = match (w.prompt, w.messages, w.fim) {
            (Some(p), None, None) => GenerateInput::Prompt(p),
            (None, Some(m), None) => GenerateInput::Messages(m),
            (None, None, Some(f)) => GenerateInput::Fim(f),
            (p, m, f) => {
                let given: Vec<&str> = [
                    ("`prompt`", p.is_some()),
                    ("`messages`", m.is_some()),
                    ("`fim`", f.is_some()),
                ]
                .into_iter()
                .filter_map(|(n, on)| on.then_some(n))
                .collect();
                let got = if given.is_empty() {
                    "none".to_string()
                } else {
                    given.join(" and ")
                };
                return Err(InputChoiceError(format!(
                    "exactly one of `prompt`, `messages` or `fim` is required, got {got}"
                )));
            }
        };
        Ok(GenerateRequest {
            request_id: w.request_id,
            input,
            max_tokens: w.max_tokens,
            temperature: w.temperature,
            top_p: w.top_p,
            top_k: w.top_k,
            min_p: w.min_p,
            seed: w.seed,
            stop: w.stop,
            logprobs: w.logprobs,
            top_logprobs: w.top_logprobs,
            max_time_ms: w.max_time_ms,
            chunk_size: w.chunk_size,
            speculation: w.speculation,
            cache: w.cache,
        })
    }
}

impl From<GenerateRequest> for GenerateWire {
    fn from(r: GenerateRequest) -> Self {
        let (prompt, messages, fim) = match r.input {
            GenerateInput::Prompt(p) => (Some(p), None, None),
            GenerateInput::Messages(m) => (None, Some(m), None),
            GenerateInput::Fim(f) => (None, None, Some(f)),
        };
        GenerateWire {
            request_id: r.request_id,
            prompt,
            messages,
            fim,
            max_tokens: r.max_tokens,
            temperature: r.temperature,
            top_p: r.top_p,
            top_k: r.top_k,
            min_p: r.min_p,
            seed: r.seed,
            stop: r.stop,
            logprobs: r.logprobs,
            top_logprobs: r.top_logprobs,
            max_time_ms: r.max_time_ms,
            chunk_size: r.chunk_size,
            speculation: r.speculation,
            cache: r.cache,
        }
    }
}

impl JsonSchema for GenerateRequest {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "GenerateRequest".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        GenerateWire::json_schema(generator)
    }
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

impl Cancel {
    pub fn validate(&self) -> Result<(), ProtocolError> {
        check_request_id(&self.request_id)
    }
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

/// A `ping` / `pong` id: any JSON string or number, echoed verbatim.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum PingId {
    Number(serde_json::Number),
    String(String),
}

impl From<u64> for PingId {
    fn from(n: u64) -> Self {
        PingId::Number(n.into())
    }
}

impl From<&str> for PingId {
    fn from(s: &str) -> Self {
        PingId::String(s.to_owned())
    }
}

impl<'de> Deserialize<'de> for PingId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = PingId;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or number")
            }
            fn visit_u64<E>(self, v: u64) -> Result<PingId, E> {
                Ok(PingId::Number(v.into()))
            }
            fn visit_i64<E>(self, v: i64) -> Result<PingId, E> {
                Ok(PingId::Number(v.into()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<PingId, E> {
                serde_json::Number::from_f64(v)
                    .map(PingId::Number)
                    .ok_or_else(|| E::custom("ping id must be a finite number"))
            }
            fn visit_str<E>(self, v: &str) -> Result<PingId, E> {
                Ok(PingId::String(v.to_owned()))
            }
            fn visit_string<E>(self, v: String) -> Result<PingId, E> {
                Ok(PingId::String(v))
            }
        }
        d.deserialize_any(V)
    }
}
