//! Validation of client messages: value ranges and formats (`validate`).
//! A `generate`'s checks against a server's limits (its `max_tokens`, its
//! prompt against the context) are the server's, made where it tokenizes.

use crate::error::ProtocolError;

use super::messages::{Cancel, ChatMessage, ClientMessage, GenerateInput, GenerateRequest, ResponseFormat, Role, SessionOpen, ToolMode};

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
/// Longest `response_format` regular expression or grammar, in bytes.
pub const MAX_GRAMMAR_BYTES: usize = 64 * 1024;
/// Most `tools` per request.
pub const MAX_TOOLS: usize = 128;
/// Longest tool name, and longest tool call id.
const MAX_TOOL_NAME: usize = 64;
const MAX_TOOL_CALL_ID: usize = 128;

impl ClientMessage {
    /// Semantic validation (value ranges and formats) of a well-typed message.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        match self {
            ClientMessage::SessionOpen(m) => m.validate(),
            ClientMessage::Generate(m) => m.validate(),
            ClientMessage::Cancel(m) => m.validate(),
            ClientMessage::SessionClose(_) | ClientMessage::Ping(_) => Ok(()),
        }
    }
}

// ---------------------------------------------------------------------------
// session.open

impl SessionOpen {
    /// Checks field pairing (`invalid_field`) and id formats (`invalid_parameter`).
    pub fn validate(&self) -> Result<(), ProtocolError> {
        match (&self.session_id, &self.resume_token) {
            (Some(_), None) => return Err(ProtocolError::invalid_field("missing field `resume_token`: resuming needs both `session_id` and `resume_token`")),
            (None, Some(_)) => return Err(ProtocolError::invalid_field("missing field `session_id`: `resume_token` is only valid together with `session_id`")),
            _ => {}
        }
        if self.last_seq.is_some() && self.session_id.is_none() {
            return Err(ProtocolError::invalid_field("`last_seq` is only valid when resuming (with `session_id` and `resume_token`)"));
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
    Err(ProtocolError::invalid_parameter(format!("{field} must be 1 to {MAX_SESSION_TOKEN_LEN} printable ASCII characters without spaces, {why}")))
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
    if let Some(c) = id.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'))) {
        return Err(format!("got invalid character {c:?}"));
    }
    Ok(())
}

fn check_request_id(id: &str) -> Result<(), ProtocolError> {
    request_id_problem(id)
        .map_err(|why| ProtocolError::invalid_parameter(format!("request_id must be 1 to {MAX_REQUEST_ID_LEN} characters from [A-Za-z0-9._:-], {why}")))
}

// ---------------------------------------------------------------------------
// generate

impl GenerateRequest {
    /// Range and format checks that need no server configuration. Errors are
    /// `invalid_parameter` and carry `request_id` when it is itself valid.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        check_request_id(&self.request_id)?;
        self.validate_params().map_err(|e| e.with_request_id(self.request_id.clone()))
    }

    fn validate_params(&self) -> Result<(), ProtocolError> {
        fn bad(m: impl Into<String>) -> ProtocolError {
            ProtocolError::invalid_parameter(m)
        }
        if let GenerateInput::Messages(m) = &self.input {
            if m.is_empty() {
                return Err(bad("messages must contain at least 1 message, got 0"));
            }
            for (i, message) in m.iter().enumerate() {
                check_message(i, message)?;
            }
        }
        self.check_tools()?;
        if !(self.temperature >= 0.0 && self.temperature <= MAX_TEMPERATURE) {
            return Err(bad(format!("temperature must be in [0, 2], got {}", self.temperature)));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(bad(format!("top_p must be in (0, 1], got {p}")));
            }
        }
        if let Some(k) = self.top_k {
            if k > MAX_TOP_K {
                return Err(bad(format!("top_k must be in [0, {MAX_TOP_K}] (0 = off), got {k}")));
            }
        }
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(bad(format!("min_p must be in [0, 1], got {p}")));
            }
        }
        if self.stop.len() > MAX_STOP_SEQUENCES {
            return Err(bad(format!("stop must have at most {MAX_STOP_SEQUENCES} entries, got {}", self.stop.len())));
        }
        for (i, s) in self.stop.iter().enumerate() {
            if s.is_empty() || s.len() > MAX_STOP_BYTES {
                return Err(bad(format!("stop[{i}] must be 1 to {MAX_STOP_BYTES} bytes long, got {} bytes", s.len())));
            }
        }
        if let Some(n) = self.top_logprobs {
            if n > MAX_TOP_LOGPROBS {
                return Err(bad(format!("top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {n}")));
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
                return Err(bad(format!("speculation.max_draft must be in [1, {MAX_DRAFT_TOKENS}], got {n}")));
            }
        }
        match &self.response_format {
            Some(ResponseFormat::JsonSchema { schema }) if !schema.is_object() && !schema.is_boolean() => {
                return Err(bad("response_format.schema must be a JSON Schema: an object or a boolean"));
            }
            Some(ResponseFormat::Regex { pattern: text } | ResponseFormat::Grammar { lark: text }) if text.is_empty() || text.len() > MAX_GRAMMAR_BYTES => {
                return Err(bad(format!("response_format's pattern or grammar must be 1 to {MAX_GRAMMAR_BYTES} bytes long, got {}", text.len())));
            }
            _ => {}
        }
        Ok(())
    }

    /// Tool names unique and well formed, schemas objects, a named choice
    /// among the tools; tools only with `messages`, and not beside a
    /// `response_format` when the answer must be a call.
    fn check_tools(&self) -> Result<(), ProtocolError> {
        fn bad(m: impl Into<String>) -> ProtocolError {
            ProtocolError::invalid_parameter(m)
        }
        if self.tools.len() > MAX_TOOLS {
            return Err(bad(format!("tools must have at most {MAX_TOOLS} entries, got {}", self.tools.len())));
        }
        for (i, tool) in self.tools.iter().enumerate() {
            let name = &tool.name;
            let well_formed =
                !name.is_empty() && name.chars().count() <= MAX_TOOL_NAME && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
            if !well_formed {
                return Err(bad(format!("tools[{i}].name must be 1 to {MAX_TOOL_NAME} characters from [A-Za-z0-9_.-], got {name:?}")));
            }
            if self.tools[..i].iter().any(|t| &t.name == name) {
                return Err(bad(format!("tools[{i}].name {name:?} is given twice")));
            }
            if tool.parameters.as_ref().is_some_and(|p| !p.is_object()) {
                return Err(bad(format!("tools[{i}].parameters must be a JSON Schema object")));
            }
        }
        if self.tool_choice.is_some() && self.tools.is_empty() {
            return Err(bad("tool_choice needs tools"));
        }
        if let Some(ToolMode::Named(name)) = self.tool_mode() {
            if !self.tools.iter().any(|t| t.name == name) {
                return Err(bad(format!("tool_choice names {name:?}, which is not among the tools")));
            }
        }
        if !self.tools.is_empty() && !matches!(self.input, GenerateInput::Messages(_)) {
            return Err(bad("tools need `messages` input: they are shown to the model through its chat template"));
        }
        let must_call = matches!(self.tool_mode(), Some(ToolMode::Required | ToolMode::Named(_)));
        if must_call && self.response_format.as_ref().is_some_and(|f| *f != ResponseFormat::Text) {
            return Err(bad("response_format cannot be combined with a tool_choice that requires a call: the answer is the call"));
        }
        Ok(())
    }
}

/// Tool calls only on assistant messages, call ids only on tool messages.
fn check_message(i: usize, m: &ChatMessage) -> Result<(), ProtocolError> {
    fn bad(m: String) -> ProtocolError {
        ProtocolError::invalid_parameter(m)
    }
    if !m.tool_calls.is_empty() && m.role != Role::Assistant {
        return Err(bad(format!("messages[{i}]: only assistant messages carry tool_calls")));
    }
    if m.tool_call_id.is_some() && m.role != Role::Tool {
        return Err(bad(format!("messages[{i}]: only tool messages carry tool_call_id")));
    }
    for (j, call) in m.tool_calls.iter().enumerate() {
        if call.id.is_empty() || call.id.len() > MAX_TOOL_CALL_ID {
            return Err(bad(format!("messages[{i}].tool_calls[{j}].id must be 1 to {MAX_TOOL_CALL_ID} bytes")));
        }
        if call.name.is_empty() {
            return Err(bad(format!("messages[{i}].tool_calls[{j}].name must not be empty")));
        }
    }
    if m.tool_call_id.as_ref().is_some_and(|id| id.is_empty() || id.len() > MAX_TOOL_CALL_ID) {
        return Err(bad(format!("messages[{i}].tool_call_id must be 1 to {MAX_TOOL_CALL_ID} bytes")));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// cancel

impl Cancel {
    pub fn validate(&self) -> Result<(), ProtocolError> {
        check_request_id(&self.request_id)
    }
}
