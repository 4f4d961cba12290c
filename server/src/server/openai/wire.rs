//! OpenAI's request bodies for `/v1/chat/completions` and `/v1/completions`,
//! parsed strictly (an unknown field is an error, as OpenAI's own API
//! answers) and turned into the protocol's [`GenerateRequest`], so every
//! edge shares one validation and one request path.
use protocol::{ChatMessage, FimInput, GenerateInput, GenerateRequest, NamedTool, ResponseFormat, Role, Tool, ToolCall, ToolChoice, ToolChoiceMode};
use serde::Deserialize;
use serde_json::Value;

/// `stop`: one string or a list of them.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    /// Accepted for compatibility and ignored: nothing is padded.
    #[serde(default, rename = "include_obfuscation")]
    _include_obfuscation: Option<serde::de::IgnoredAny>,
}

/// A chat message's `content`: a string, or a list of parts of which only
/// text parts are supported.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Value>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// A participant's name; no chat template here uses it, so ignored.
    #[serde(default, rename = "name")]
    _name: Option<serde::de::IgnoredAny>,
    /// An assistant message's calls: `[{id, type: "function", function: {name, arguments}}]`.
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    /// Which call a `tool` message answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// The fields of an assistant message as a response returned it, which
    /// clients append to the conversation as is: accepted when empty.
    #[serde(default)]
    pub function_call: Option<Value>,
    #[serde(default)]
    pub refusal: Option<String>,
    #[serde(default, rename = "annotations")]
    _annotations: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    pub audio: Option<Value>,
}

/// The fields [`Sampling`] reads (serde cannot deny unknown fields through
/// `flatten`, so [`unknown_field`] checks names against these lists).
const SAMPLING_FIELDS: &[&str] = &[
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "prompt_cache_key",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    // Accepted and ignored: an end-user id for the caller's records.
    "user",
];
pub const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "logprobs",
    "top_logprobs",
    "store",
    "metadata",
    "service_tier",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "continue_final_message",
];
pub const COMPLETION_FIELDS: &[&str] = &["model", "prompt", "suffix", "logprobs", "echo", "best_of"];

/// The first field of `body` that neither `fields` nor the shared sampling
/// fields name.
pub fn unknown_field<'a>(body: &'a serde_json::Map<String, Value>, fields: &[&str]) -> Option<&'a str> {
    body.keys().map(String::as_str).find(|k| !fields.contains(k) && !SAMPLING_FIELDS.contains(k))
}

/// The parameters both endpoints share.
#[derive(Deserialize, Default)]
pub struct Sampling {
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Whose prefix-cache entries this request shares (within its bearer token).
    pub prompt_cache_key: Option<String>,
    /// Supported only at 0 (their default): no penalties are applied.
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Supported only when empty.
    pub logit_bias: Option<serde_json::Map<String, Value>>,
}

#[derive(Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    #[serde(flatten)]
    pub sampling: Sampling,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u8>,
    /// `text`, `json_object` or `json_schema` (see [`response_format`]).
    pub response_format: Option<Value>,
    /// `[{type: "function", function: {name, description, parameters, strict}}]`.
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's extension: continue the final assistant message (a prefill)
    /// rather than answer it.
    #[serde(default)]
    pub continue_final_message: bool,
}

/// `prompt`: one string (or a list holding exactly one).
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    /// Text after the insertion point: fill-in-the-middle on models with FIM tokens.
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub sampling: Sampling,
    /// The number of top alternatives to return with each token's logprob.
    pub logprobs: Option<u8>,
    /// Whether to return the prompt before the completion; only `false`.
    #[serde(default)]
    pub echo: bool,
    /// Only 1.
    pub best_of: Option<u32>,
}

/// What the edge does beside the engine request.
pub struct Options {
    pub stream: bool,
    pub include_usage: bool,
    /// `max_tokens` was not given: generate until the context is full.
    pub fill_context: bool,
    pub prompt_cache_key: Option<String>,
}

/// A parameter error naming the parameter (`param` in OpenAI's error).
pub struct ParamError {
    pub param: &'static str,
    pub message: String,
}

pub fn bad(param: &'static str, message: impl Into<String>) -> ParamError {
    ParamError { param, message: message.into() }
}

/// The fields Chat Completions and the Responses API share that hold no
/// generation parameter (those are the protocol's, checked with the
/// request), checked once for both: penalties only at 0 (none are
/// applied), `stream_options` only when streaming, a `prompt_cache_key` of
/// 1 to 256 characters.
pub fn check_shared(
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    stream_options: bool,
    stream: bool,
    prompt_cache_key: Option<&str>,
) -> Result<(), ParamError> {
    for (param, v) in [("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)] {
        if v.is_some_and(|v| v != 0.0) {
            return Err(bad(param, format!("{param} is not supported (only 0)")));
        }
    }
    if stream_options && !stream {
        return Err(bad("stream_options", "stream_options is only allowed with stream: true"));
    }
    if prompt_cache_key.is_some_and(|k| k.is_empty() || k.len() > 256) {
        return Err(bad("prompt_cache_key", "prompt_cache_key must be 1 to 256 characters"));
    }
    Ok(())
}

/// Where a format's schema sits: Chat Completions nests it as
/// `{type: "json_schema", json_schema: {name, schema, strict}}`, the
/// Responses API's `text.format` flattens it to `{type: "json_schema",
/// name, schema, strict}`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum FormatShape {
    Chat,
    Responses,
}

/// OpenAI's structured-output `format` as protocol v1's `response_format`.
/// Every schema is enforced whether or not `strict` is set: constrained
/// decoding costs the same either way, and an answer that does not parse
/// helps nobody. `name` and `description` are accepted and unused.
pub fn response_format(format: &Value, param: &'static str, shape: FormatShape) -> Result<ResponseFormat, ParamError> {
    let obj = format.as_object().ok_or_else(|| bad(param, "must be an object with a `type`"))?;
    let kind = obj.get("type").and_then(Value::as_str).ok_or_else(|| bad(param, "`type` is required: text, json_object or json_schema"))?;
    let allowed: &[&str] = match (kind, shape) {
        ("text" | "json_object", _) => &["type"],
        ("json_schema", FormatShape::Chat) => &["type", "json_schema"],
        ("json_schema", FormatShape::Responses) => &["type", "name", "schema", "strict", "description"],
        (other, _) => return Err(bad(param, format!("unknown type {other:?}: expected text, json_object or json_schema"))),
    };
    if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(bad(param, format!("unknown field {k:?} for type {kind:?}")));
    }
    let spec = match (kind, shape) {
        ("text", _) => return Ok(ResponseFormat::Text),
        ("json_object", _) => return Ok(ResponseFormat::JsonObject),
        (_, FormatShape::Chat) => {
            obj.get("json_schema").and_then(Value::as_object).ok_or_else(|| bad(param, "json_schema: an object with `name` and `schema` is required"))?
        }
        (_, FormatShape::Responses) => obj,
    };
    // (The Responses shape's `type` sits beside the schema's fields.)
    let known = |k: &str| ["name", "schema", "strict", "description"].contains(&k) || (shape == FormatShape::Responses && k == "type");
    if let Some(k) = spec.keys().find(|k| !known(k)) {
        return Err(bad(param, format!("unknown json_schema field {k:?}")));
    }
    if !spec.get("name").is_some_and(Value::is_string) {
        return Err(bad(param, "json_schema.name (a string) is required"));
    }
    match spec.get("schema") {
        Some(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(ResponseFormat::JsonSchema { schema: schema.clone() }),
        // OpenAI's own default when `schema` is left out: any JSON object.
        None => Ok(ResponseFormat::JsonObject),
        Some(_) => Err(bad(param, "json_schema.schema must be a JSON Schema object")),
    }
}

/// One function tool's fields (`obj` holds `name`, `description`,
/// `parameters`, `strict`, and `type` in the Responses shape). Every
/// call's arguments are held to `parameters` whether or not `strict` is set.
fn function_tool(obj: &serde_json::Map<String, Value>, at: &str, param: &'static str, shape: FormatShape) -> Result<Tool, ParamError> {
    let known = |k: &str| ["name", "description", "parameters", "strict"].contains(&k) || (shape == FormatShape::Responses && k == "type");
    if let Some(k) = obj.keys().find(|k| !known(k)) {
        return Err(bad(param, format!("{at}: unknown field {k:?}")));
    }
    let name = obj.get("name").and_then(Value::as_str).ok_or_else(|| bad(param, format!("{at}.name (a string) is required")))?;
    let description = match obj.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(_) => return Err(bad(param, format!("{at}.description must be a string"))),
    };
    let parameters = match obj.get("parameters") {
        None | Some(Value::Null) => None,
        Some(p @ Value::Object(_)) => Some(p.clone()),
        Some(_) => return Err(bad(param, format!("{at}.parameters must be a JSON Schema object"))),
    };
    Ok(Tool { kind: Default::default(), name: name.to_string(), description, parameters })
}

/// OpenAI's `tools` (function tools only) in the endpoint's shape: Chat
/// Completions nests each as `{type: "function", function: {...}}`, the
/// Responses API flattens it to `{type: "function", name, ...}`.
pub fn tools(tools: &[Value], shape: FormatShape) -> Result<Vec<Tool>, ParamError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let at = format!("tools[{i}]");
            let obj = t.as_object().ok_or_else(|| bad("tools", format!("{at} must be an object")))?;
            match obj.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => return Err(bad("tools", format!("{at}: tools of type {other:?} are not supported (function only)"))),
                None => return Err(bad("tools", format!("{at}.type is required (\"function\")"))),
            }
            match shape {
                FormatShape::Chat => {
                    if let Some(k) = obj.keys().find(|k| *k != "type" && *k != "function") {
                        return Err(bad("tools", format!("{at}: unknown field {k:?}")));
                    }
                    let f = obj.get("function").and_then(Value::as_object).ok_or_else(|| bad("tools", format!("{at}.function (an object) is required")))?;
                    function_tool(f, &format!("{at}.function"), "tools", shape)
                }
                FormatShape::Responses => function_tool(obj, &at, "tools", shape),
            }
        })
        .collect()
}

/// OpenAI's `tool_choice`: `"none"`, `"auto"`, `"required"`, or one
/// function (`{type: "function", function: {name}}` in Chat Completions,
/// `{type: "function", name}` in the Responses API).
pub fn tool_choice(v: &Value, shape: FormatShape) -> Result<ToolChoice, ParamError> {
    let expected = "expected \"none\", \"auto\", \"required\" or a function";
    match v {
        Value::String(s) => match s.as_str() {
            "none" => Ok(ToolChoice::Mode(ToolChoiceMode::None)),
            "auto" => Ok(ToolChoice::Mode(ToolChoiceMode::Auto)),
            "required" => Ok(ToolChoice::Mode(ToolChoiceMode::Required)),
            other => Err(bad("tool_choice", format!("unknown tool_choice {other:?}: {expected}"))),
        },
        Value::Object(obj) => {
            if obj.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad("tool_choice", format!("only function tool choices are supported: {expected}")));
            }
            let name = match shape {
                FormatShape::Chat => obj.get("function").and_then(|f| f.get("name")),
                FormatShape::Responses => obj.get("name"),
            };
            let allowed: &[&str] = if shape == FormatShape::Chat { &["type", "function"] } else { &["type", "name"] };
            if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
                return Err(bad("tool_choice", format!("unknown field {k:?}")));
            }
            let name = name.and_then(Value::as_str).ok_or_else(|| bad("tool_choice", "the function's `name` is required"))?;
            Ok(ToolChoice::Function(NamedTool { kind: Default::default(), name: name.to_string() }))
        }
        _ => Err(bad("tool_choice", expected)),
    }
}

/// Chat Completions' `tool_calls` of an assistant message.
fn chat_tool_calls(calls: &[Value], i: usize) -> Result<Vec<ToolCall>, ParamError> {
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let at = format!("messages[{i}].tool_calls[{j}]");
            let id = c.get("id").and_then(Value::as_str).ok_or_else(|| bad("messages", format!("{at}.id (a string) is required")))?;
            let function = c.get("function").ok_or_else(|| bad("messages", format!("{at}.function is required")))?;
            let name = function.get("name").and_then(Value::as_str).ok_or_else(|| bad("messages", format!("{at}.function.name is required")))?;
            let arguments = match function.get("arguments") {
                Some(Value::String(a)) => a.clone(),
                Some(a @ Value::Object(_)) => a.to_string(),
                _ => return Err(bad("messages", format!("{at}.function.arguments (a JSON string) is required"))),
            };
            Ok(ToolCall { id: id.to_string(), name: name.to_string(), arguments })
        })
        .collect()
}

impl Sampling {
    /// The generation parameters of `req`; `logprobs` (whether to report
    /// them) and `top_logprobs` (how many alternatives) are the endpoint's own.
    fn apply(self, req: &mut GenerateRequest, logprobs: bool, top_logprobs: Option<u8>) -> Result<Options, ParamError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(bad("n", "only n = 1 is supported"));
        }
        check_shared(self.presence_penalty, self.frequency_penalty, self.stream_options.is_some(), self.stream, self.prompt_cache_key.as_deref())?;
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return Err(bad("logit_bias", "logit_bias is not supported"));
        }
        let max_tokens = match (self.max_tokens, self.max_completion_tokens) {
            (Some(_), Some(_)) => return Err(bad("max_tokens", "give max_tokens or max_completion_tokens, not both")),
            (a, b) => a.or(b),
        };
        if let Some(n) = max_tokens {
            req.max_tokens = n;
        }
        // OpenAI's default temperature is 1 (sampling), unlike Tether's own protocol.
        req.temperature = self.temperature.unwrap_or(1.0);
        req.top_p = self.top_p.filter(|&p| p != 1.0);
        if let Some(seed) = self.seed {
            req.seed = Some(seed as u64);
        }
        req.stop = self.stop.map(Stop::into_vec).unwrap_or_default();
        req.logprobs = logprobs;
        req.top_logprobs = top_logprobs;
        Ok(Options {
            stream: self.stream,
            include_usage: self.stream_options.is_some_and(|o| o.include_usage),
            fill_context: max_tokens.is_none(),
            prompt_cache_key: self.prompt_cache_key,
        })
    }
}

fn role(name: &str) -> Result<Role, ParamError> {
    Ok(match name {
        // OpenAI's newer name for the system role.
        "system" | "developer" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" => Role::Tool,
        other => return Err(bad("messages", format!("unknown role {other:?}: expected system, developer, user, assistant or tool"))),
    })
}

fn content_text(content: Option<Content>, i: usize) -> Result<String, ParamError> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(bad("messages", format!("messages[{i}]: content parts of type {:?} are not supported (text only)", kind.unwrap_or("?"))))
                    }
                }
            }
            Ok(text)
        }
    }
}

impl ChatRequest {
    pub fn into_generate(self, request_id: String) -> Result<(String, GenerateRequest, Options), ParamError> {
        let tools = self.tools.as_deref().map(|t| tools(t, FormatShape::Chat)).transpose()?.unwrap_or_default();
        let tool_choice = self.tool_choice.as_ref().map(|c| tool_choice(c, FormatShape::Chat)).transpose()?;
        let format = self.response_format.as_ref().map(|f| response_format(f, "response_format", FormatShape::Chat)).transpose()?;
        let messages = self
            .messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                if m.function_call.as_ref().is_some_and(|f| !f.is_null()) {
                    return Err(bad("messages", format!("messages[{i}]: function_call (deprecated) is not supported: use tool_calls")));
                }
                if m.audio.as_ref().is_some_and(|a| !a.is_null()) {
                    return Err(bad("messages", format!("messages[{i}]: audio is not supported")));
                }
                // A refusal is the assistant's text when it had no content.
                let content = match (m.content, m.refusal) {
                    (None, Some(refusal)) => refusal,
                    (content, _) => content_text(content, i)?,
                };
                let mut message = ChatMessage::new(role(&m.role)?, content);
                message.tool_calls = chat_tool_calls(m.tool_calls.as_deref().unwrap_or_default(), i)?;
                message.tool_call_id = m.tool_call_id;
                Ok(message)
            })
            .collect::<Result<Vec<_>, ParamError>>()?;
        let prefill = messages.last().filter(|m| m.role == Role::Assistant && m.tool_calls.is_empty());
        if self.continue_final_message && prefill.is_none() {
            return Err(bad("continue_final_message", "continue_final_message needs a final assistant message (without tool_calls) to continue"));
        }
        let mut req = GenerateRequest::new(request_id, GenerateInput::Messages(messages));
        req.response_format = format;
        req.tools = tools;
        req.tool_choice = tool_choice;
        req.parallel_tool_calls = self.parallel_tool_calls;
        req.continue_final_message = self.continue_final_message;
        let options = self.sampling.apply(&mut req, self.logprobs, self.top_logprobs)?;
        Ok((self.model, req, options))
    }
}

impl CompletionRequest {
    pub fn into_generate(self, request_id: String) -> Result<(String, GenerateRequest, Options), ParamError> {
        if self.echo {
            return Err(bad("echo", "echo is not supported"));
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(bad("best_of", "only best_of = 1 is supported"));
        }
        let prompt = match self.prompt {
            Prompt::One(p) => p,
            Prompt::Many(mut v) if v.len() == 1 => v.remove(0),
            Prompt::Many(_) => return Err(bad("prompt", "only one prompt per request is supported")),
        };
        let input = match self.suffix {
            Some(suffix) => GenerateInput::Fim(FimInput { prefix: prompt, suffix, extra: Vec::new() }),
            None => GenerateInput::Prompt(prompt),
        };
        let mut req = GenerateRequest::new(request_id, input);
        // `logprobs`: how many alternatives, the sampled token's own always.
        let options = self.sampling.apply(&mut req, self.logprobs.is_some(), self.logprobs)?;
        Ok((self.model, req, options))
    }
}
