//! The body of `POST /v1/responses` and of the WebSocket mode's
//! `response.create` event (the same fields, plus `generate` and
//! `stream_id` on the socket), parsed strictly: an unknown field, or a
//! feature this server does not have (tools, images, reasoning), is an
//! error naming the parameter rather than something silently ignored.
use protocol::{ChatMessage, ResponseFormat, Tool, ToolChoice};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::super::wire::{bad, check_shared, response_format as response_format_of, tool_choice as tool_choice_of, tools as tools_of, FormatShape, ParamError};
use super::input::{self, Input};

/// Fields both `POST /v1/responses` and `response.create` take.
const SHARED_FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "previous_response_id",
    "store",
    "metadata",
    "prompt_cache_key",
    "truncation",
    "text",
    "tools",
    "tool_choice",
    "reasoning",
    "include",
    "top_logprobs",
    "parallel_tool_calls",
    // Accepted only at 0, their default: no penalties are applied.
    "presence_penalty",
    "frequency_penalty",
    // Accepted and echoed: it bounds calls to built-in tools, and this
    // server runs none (function calls are the client's to run).
    "max_tool_calls",
    // Accepted and echoed: ids for the caller's records, one service tier.
    "user",
    "safety_identifier",
    "service_tier",
];
/// Fields only the HTTP endpoint takes.
const HTTP_FIELDS: &[&str] = &["stream", "stream_options", "background"];
/// Fields only the socket's `response.create` takes (`stream` is implicit
/// there and accepted when true).
const SOCKET_FIELDS: &[&str] = &["type", "generate", "stream_id", "stream"];

/// Most `metadata` entries, and the longest key and value (OpenAI's bounds).
const MAX_METADATA: usize = 16;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;
/// Longest `stream_id`.
const MAX_STREAM_ID: usize = 64;
/// The one `include` value this server fills: sampled logprobs on output text.
const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";

/// Where a create request came from: the edges differ in a few fields.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Edge {
    Http,
    Socket,
}

/// The first field of `body` that `edge` does not take.
pub fn unknown_field(body: &Map<String, Value>, edge: Edge) -> Option<&str> {
    let own = match edge {
        Edge::Http => HTTP_FIELDS,
        Edge::Socket => SOCKET_FIELDS,
    };
    body.keys().map(String::as_str).find(|k| !SHARED_FIELDS.contains(k) && !own.contains(k))
}

#[derive(Deserialize)]
pub struct CreateBody {
    pub model: Option<String>,
    pub input: Option<Input>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub previous_response_id: Option<String>,
    pub store: Option<bool>,
    pub metadata: Option<Map<String, Value>>,
    pub prompt_cache_key: Option<String>,
    pub truncation: Option<String>,
    pub text: Option<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub reasoning: Option<Value>,
    pub include: Option<Vec<Value>>,
    pub top_logprobs: Option<u8>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub max_tool_calls: Option<u32>,
    pub user: Option<String>,
    pub safety_identifier: Option<String>,
    pub service_tier: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<Value>,
    pub background: Option<bool>,
    pub generate: Option<bool>,
    pub stream_id: Option<String>,
}

/// A create request, checked.
#[derive(Clone, Debug)]
pub struct Create {
    pub model: Option<String>,
    /// This turn's new messages (`instructions` apart).
    pub input: Vec<ChatMessage>,
    /// The system message of this turn only: not carried to the next.
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub temperature: f32,
    pub top_p: Option<f32>,
    /// Keep the response for later `previous_response_id`s beyond this socket.
    pub store: bool,
    /// HTTP: answer with server-sent events.
    pub stream: bool,
    /// False: only warm the prefix cache with the input (socket's `generate: false`).
    pub generate: bool,
    /// The socket lane; its responses run one after another.
    pub stream_id: Option<String>,
    pub prompt_cache_key: Option<String>,
    pub metadata: Value,
    /// `text.format` as protocol v1 enforces it (`None`: plain text).
    pub response_format: Option<ResponseFormat>,
    /// `text.format` as the client sent it, echoed in the response object.
    pub text_format: Value,
    pub tools: Vec<Tool>,
    pub tool_choice: Option<ToolChoice>,
    pub parallel_tool_calls: Option<bool>,
    /// `tools` as the response object shows them (each with `strict`), and
    /// `tool_choice` as the client sent it.
    pub tools_echo: Value,
    pub tool_choice_echo: Value,
    /// Report each output token's logprob (`include` names
    /// `message.output_text.logprobs`, or `top_logprobs` is set).
    pub logprobs: bool,
    /// Alternatives to report at each position (0: none).
    pub top_logprobs: u8,
    /// `reasoning` as the response object shows it: `{effort, summary}`.
    pub reasoning_echo: Value,
    /// Echoed only (see `SHARED_FIELDS`).
    pub max_tool_calls: Option<u32>,
    pub user: Option<String>,
    pub safety_identifier: Option<String>,
    /// This turn's input as items with ids, as `input_items` lists them.
    pub input_items: Vec<Value>,
}

/// Function tools as the response object shows them: every field, with
/// `strict` true unless the client said otherwise (as OpenAI's Responses
/// API defaults it). The tools were checked by `tools_of` before.
fn tools_echo(tools: &[Value]) -> Result<Value, ParamError> {
    let echo = |(i, t): (usize, &Value)| {
        let strict = match t.get("strict") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(bad("tools", format!("tools[{i}].strict must be a boolean"))),
        };
        Ok(json!({"type": "function", "name": t["name"], "description": t.get("description").unwrap_or(&Value::Null),
            "parameters": t.get("parameters").unwrap_or(&Value::Null), "strict": strict}))
    };
    tools.iter().enumerate().map(echo).collect::<Result<Vec<_>, _>>().map(Value::Array)
}

/// `reasoning` as the response object shows it. This model does not
/// reason: only an empty configuration, or effort `none`, is taken.
fn reasoning(r: Option<&Value>) -> Result<Value, ParamError> {
    let refuse = || bad("reasoning", "reasoning options are not supported: this model does not reason (only effort \"none\")");
    let Some(obj) = r.and_then(Value::as_object) else {
        return if r.is_none_or(Value::is_null) { Ok(json!({"effort": null, "summary": null})) } else { Err(refuse()) };
    };
    if obj.keys().any(|k| k != "effort" && k != "summary") || obj.get("summary").is_some_and(|s| !s.is_null()) {
        return Err(refuse());
    }
    match obj.get("effort") {
        None | Some(Value::Null) => Ok(json!({"effort": null, "summary": null})),
        Some(Value::String(e)) if e == "none" => Ok(json!({"effort": "none", "summary": null})),
        Some(_) => Err(refuse()),
    }
}

impl CreateBody {
    pub fn check(self, edge: Edge) -> Result<Create, ParamError> {
        let tools = self.tools.as_deref().map(|t| tools_of(t, FormatShape::Responses)).transpose()?.unwrap_or_default();
        let tool_choice = self.tool_choice.as_ref().map(|c| tool_choice_of(c, FormatShape::Responses)).transpose()?;
        let reasoning_echo = reasoning(self.reasoning.as_ref())?;
        let mut logprobs = false;
        for v in self.include.iter().flatten() {
            match v.as_str() {
                Some(INCLUDE_LOGPROBS) => logprobs = true,
                _ => return Err(bad("include", format!("include {v} is not supported (only {INCLUDE_LOGPROBS:?})"))),
            }
        }
        // Alternatives come with the sampled token's own logprob; 0 (the
        // default some clients send) asks for nothing. Their bound is the
        // protocol's, checked with the request.
        logprobs |= self.top_logprobs.is_some_and(|n| n > 0);
        if self.max_tool_calls == Some(0) {
            return Err(bad("max_tool_calls", "max_tool_calls must be at least 1"));
        }
        if self.service_tier.as_deref().is_some_and(|t| !["auto", "default", "flex", "priority"].contains(&t)) {
            return Err(bad("service_tier", "service_tier must be auto, default, flex or priority"));
        }
        for (param, v) in [("user", &self.user), ("safety_identifier", &self.safety_identifier)] {
            if v.as_ref().is_some_and(|v| v.len() > 64) {
                return Err(bad(param, format!("{param} must be at most 64 characters")));
            }
        }
        if self.truncation.as_deref().is_some_and(|t| t != "disabled") {
            return Err(bad("truncation", "only truncation \"disabled\" is supported: an input over the context is an error"));
        }
        let mut text_format = json!({"type": "text"});
        let mut response_format = None;
        if let Some(text) = &self.text {
            let obj = text.as_object().ok_or_else(|| bad("text", "text must be an object: {format, verbosity}"))?;
            if let Some(k) = obj.keys().find(|k| *k != "format" && *k != "verbosity") {
                return Err(bad("text", format!("unknown field {k:?} (expected format or verbosity)")));
            }
            if let Some(f) = obj.get("format") {
                response_format = Some(response_format_of(f, "text.format", FormatShape::Responses)?);
                text_format = f.clone();
                // The response object shows a schema format whole.
                if text_format["type"] == "json_schema" {
                    for (k, default) in [("description", Value::Null), ("strict", json!(false))] {
                        if text_format.get(k).is_none_or(Value::is_null) {
                            text_format[k] = default;
                        }
                    }
                }
            }
        }
        if self.background == Some(true) {
            return Err(bad("background", "background responses are not supported"));
        }
        let stream = self.stream.unwrap_or(false);
        if edge == Edge::Socket && self.stream == Some(false) {
            return Err(bad("stream", "responses on a WebSocket always stream; leave `stream` out"));
        }
        // (The socket takes no `stream_options`: its events always stream.)
        check_shared(
            self.presence_penalty,
            self.frequency_penalty,
            self.stream_options.is_some(),
            edge == Edge::Socket || stream,
            self.prompt_cache_key.as_deref(),
        )?;
        if self.max_output_tokens == Some(0) {
            return Err(bad("max_output_tokens", "max_output_tokens must be at least 1 (a warm-up is `generate: false`)"));
        }
        if let Some(id) = &self.stream_id {
            if id.is_empty() || id.len() > MAX_STREAM_ID {
                return Err(bad("stream_id", format!("stream_id must be 1 to {MAX_STREAM_ID} characters")));
            }
        }
        if let Some(id) = &self.previous_response_id {
            if id.is_empty() || id.len() > 128 {
                return Err(bad("previous_response_id", "previous_response_id must be 1 to 128 characters"));
            }
        }
        let metadata = match self.metadata {
            None => Value::Null,
            Some(m) => {
                if m.len() > MAX_METADATA {
                    return Err(bad("metadata", format!("metadata has at most {MAX_METADATA} entries")));
                }
                for (k, v) in &m {
                    let ok = k.len() <= MAX_METADATA_KEY && v.as_str().is_some_and(|s| s.len() <= MAX_METADATA_VALUE);
                    if !ok {
                        return Err(bad(
                            "metadata",
                            format!("metadata values must be strings of at most {MAX_METADATA_VALUE} characters, keys at most {MAX_METADATA_KEY}"),
                        ));
                    }
                }
                Value::Object(m)
            }
        };
        let (input, input_items) = input::parse(self.input)?;
        if input.is_empty() {
            return Err(bad("input", "input is required: a string or a list of messages"));
        }
        Ok(Create {
            model: self.model,
            input,
            instructions: self.instructions,
            previous_response_id: self.previous_response_id,
            max_output_tokens: self.max_output_tokens,
            // OpenAI's default temperature is 1 (sampling).
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.filter(|&p| p != 1.0),
            store: self.store.unwrap_or(true),
            stream: edge == Edge::Socket || stream,
            generate: self.generate.unwrap_or(true),
            stream_id: self.stream_id,
            prompt_cache_key: self.prompt_cache_key,
            metadata,
            response_format,
            text_format,
            tools,
            tool_choice_echo: self.tool_choice.unwrap_or_else(|| json!(if self.tools.as_ref().is_some_and(|t| !t.is_empty()) { "auto" } else { "none" })),
            tools_echo: tools_echo(self.tools.as_deref().unwrap_or_default())?,
            tool_choice,
            parallel_tool_calls: self.parallel_tool_calls,
            logprobs,
            top_logprobs: self.top_logprobs.unwrap_or(0),
            reasoning_echo,
            max_tool_calls: self.max_tool_calls,
            user: self.user,
            safety_identifier: self.safety_identifier,
            input_items,
        })
    }
}
