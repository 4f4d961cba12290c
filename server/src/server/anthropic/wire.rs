//! The body of `POST /v1/messages` (and of `count_tokens`), parsed strictly
//! and turned into the protocol's [`GenerateRequest`]: an unknown field is
//! an error (Anthropic's own API answers "Extra inputs are not permitted"),
//! and a feature this server does not have (images, documents, extended
//! thinking, server tools) is refused by name rather than ignored. A final
//! assistant message is a prefill, which the answer continues.
//!
//! Errors name their place the way Anthropic's do: `messages.2.content.0`.
use protocol::{ChatMessage, GenerateInput, GenerateRequest, NamedTool, ResponseFormat, Role, Tool, ToolCall, ToolChoice, ToolChoiceMode};
use serde_json::{Map, Value};

/// Fields both endpoints take.
const SHARED_FIELDS: &[&str] = &["model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "cache_control"];
/// Fields only `POST /v1/messages` takes.
const CREATE_FIELDS: &[&str] = &["max_tokens", "stop_sequences", "stream", "metadata", "temperature", "top_p", "top_k", "service_tier"];
/// Fields of Anthropic's API that name features this server does not have.
const UNSUPPORTED_FIELDS: &[&str] =
    &["container", "mcp_servers", "context_management", "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id"];

/// A request error, as the client will read it.
pub type Invalid = String;

/// Which endpoint a body came to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Create,
    CountTokens,
}

/// A parsed request: the engine request and what the edge does beside it.
pub struct Parsed {
    pub model: String,
    pub generate: GenerateRequest,
    /// `max_tokens` as asked (a ceiling: the context may leave less room).
    pub max_tokens: u32,
    pub stream: bool,
}

fn obj<'a>(v: &'a Value, at: &str) -> Result<&'a Map<String, Value>, Invalid> {
    v.as_object().ok_or_else(|| format!("{at}: Input should be an object"))
}

fn string(v: &Value, at: &str) -> Result<String, Invalid> {
    v.as_str().map(str::to_string).ok_or_else(|| format!("{at}: Input should be a valid string"))
}

fn number(v: &Value, at: &str) -> Result<f64, Invalid> {
    v.as_f64().ok_or_else(|| format!("{at}: Input should be a valid number"))
}

fn required<'a>(o: &'a Map<String, Value>, key: &str, at: &str) -> Result<&'a Value, Invalid> {
    o.get(key).ok_or_else(|| if at.is_empty() { format!("{key}: Field required") } else { format!("{at}.{key}: Field required") })
}

/// The first key of `o` outside `allowed`, as Anthropic's error.
fn refuse_extra(o: &Map<String, Value>, allowed: &[&str], at: &str) -> Result<(), Invalid> {
    match o.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) if at.is_empty() => Err(format!("{k}: Extra inputs are not permitted")),
        Some(k) => Err(format!("{at}.{k}: Extra inputs are not permitted")),
        None => Ok(()),
    }
}

/// `cache_control` on a block or the request: accepted, since every prompt
/// here is cached by prefix whether or not it asks (the hint only has to
/// be well formed).
fn cache_control(o: &Map<String, Value>, at: &str) -> Result<(), Invalid> {
    match o.get("cache_control") {
        None | Some(Value::Null) => Ok(()),
        Some(v) => {
            let c = obj(v, &format!("{at}cache_control"))?;
            refuse_extra(c, &["type", "ttl"], &format!("{at}cache_control"))?;
            match c.get("type").and_then(Value::as_str) {
                Some("ephemeral") => Ok(()),
                _ => Err(format!("{at}cache_control.type: Input should be 'ephemeral'")),
            }
        }
    }
}

/// A `text` block's text (its `cache_control` checked, `citations` refused).
fn text_block(b: &Map<String, Value>, at: &str) -> Result<String, Invalid> {
    refuse_extra(b, &["type", "text", "cache_control", "citations"], at)?;
    if b.get("citations").is_some_and(|c| !c.is_null() && c.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(format!("{at}.citations: citations are not supported by this server"));
    }
    cache_control(b, &format!("{at}."))?;
    string(required(b, "text", at)?, &format!("{at}.text"))
}

/// Why a block type other than text, tool_use and tool_result is refused.
fn unsupported_block(kind: &str, at: &str) -> Invalid {
    match kind {
        "image" | "document" | "search_result" | "container_upload" => {
            format!("{at}: {kind} content blocks are not supported: this server's model reads text only")
        }
        "thinking" | "redacted_thinking" => format!("{at}: {kind} blocks are not supported: this server has no extended thinking"),
        "server_tool_use" | "web_search_tool_result" | "web_fetch_tool_result" | "code_execution_tool_result" | "mcp_tool_use" | "mcp_tool_result" => {
            format!("{at}: {kind} blocks are not supported: this server runs no server tools")
        }
        other => format!("{at}.type: unknown content block type {other:?} (expected text, tool_use or tool_result)"),
    }
}

/// `system`: a string, or a list of text blocks (joined by blank lines).
fn system(v: &Value) -> Result<String, Invalid> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::new();
            for (i, b) in blocks.iter().enumerate() {
                let at = format!("system.{i}");
                let b = obj(b, &at)?;
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => parts.push(text_block(b, &at)?),
                    Some(other) => return Err(format!("{at}.type: system blocks must be text, not {other:?}")),
                    None => return Err(format!("{at}.type: Field required")),
                }
            }
            Ok(parts.join("\n\n"))
        }
        _ => Err("system: Input should be a valid string or a list of text blocks".into()),
    }
}

/// A `tool_result` block's content: a string, or text blocks.
fn tool_result_text(b: &Map<String, Value>, at: &str) -> Result<String, Invalid> {
    let text = match b.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => {
            let mut parts = Vec::new();
            for (j, inner) in blocks.iter().enumerate() {
                let at = format!("{at}.content.{j}");
                let inner = obj(inner, &at)?;
                match inner.get("type").and_then(Value::as_str) {
                    Some("text") => parts.push(text_block(inner, &at)?),
                    Some(other) => return Err(unsupported_block(other, &at)),
                    None => return Err(format!("{at}.type: Field required")),
                }
            }
            parts.join("\n\n")
        }
        Some(_) => return Err(format!("{at}.content: Input should be a valid string or a list of blocks")),
    };
    // Chat templates have no error flag on a tool's answer; the text says it.
    Ok(if b.get("is_error").and_then(Value::as_bool) == Some(true) { format!("Error: {text}") } else { text })
}

/// The messages of one Anthropic turn, in the protocol's shape: a user
/// turn's `tool_result` blocks become `tool` messages (in order, beside its
/// text), an assistant turn's `tool_use` blocks its calls. `called`: the
/// ids of the calls made so far, which a `tool_result` must name.
fn turn(v: &Value, i: usize, called: &mut Vec<String>, out: &mut Vec<ChatMessage>) -> Result<(), Invalid> {
    let at = format!("messages.{i}");
    let m = obj(v, &at)?;
    refuse_extra(m, &["role", "content"], &at)?;
    let role = match required(m, "role", &at)?.as_str() {
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        _ => return Err(format!("{at}.role: Input should be 'user' or 'assistant'")),
    };
    let blocks = match required(m, "content", &at)? {
        Value::String(s) => vec![serde_json::json!({"type": "text", "text": s})],
        Value::Array(blocks) => blocks.clone(),
        _ => return Err(format!("{at}.content: Input should be a valid string or a list of content blocks")),
    };
    let mut text: Vec<String> = Vec::new();
    let mut calls = Vec::new();
    let flush = |text: &mut Vec<String>, out: &mut Vec<ChatMessage>| {
        if !text.is_empty() {
            out.push(ChatMessage::new(role, text.join("\n\n")));
            text.clear();
        }
    };
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content.{j}");
        let b = obj(b, &at)?;
        match b.get("type").and_then(Value::as_str) {
            Some("text") => text.push(text_block(b, &at)?),
            Some("tool_use") if role == Role::Assistant => {
                refuse_extra(b, &["type", "id", "name", "input", "cache_control", "caller"], &at)?;
                cache_control(b, &format!("{at}."))?;
                let id = string(required(b, "id", &at)?, &format!("{at}.id"))?;
                let name = string(required(b, "name", &at)?, &format!("{at}.name"))?;
                let input = obj(required(b, "input", &at)?, &format!("{at}.input"))?;
                called.push(id.clone());
                calls.push(ToolCall { id, name, arguments: Value::Object(input.clone()).to_string() });
            }
            Some("tool_result") if role == Role::User => {
                refuse_extra(b, &["type", "tool_use_id", "content", "is_error", "cache_control"], &at)?;
                cache_control(b, &format!("{at}."))?;
                let id = string(required(b, "tool_use_id", &at)?, &format!("{at}.tool_use_id"))?;
                if !called.contains(&id) {
                    return Err(format!(
                        "{at}: unexpected `tool_use_id` found in `tool_result` blocks: {id}. Each `tool_result` block must have a corresponding `tool_use` block in an earlier assistant message"
                    ));
                }
                flush(&mut text, out);
                let mut answer = ChatMessage::new(Role::Tool, tool_result_text(b, &at)?);
                answer.tool_call_id = Some(id);
                out.push(answer);
            }
            Some(kind @ ("tool_use" | "tool_result")) => {
                let whose = if kind == "tool_use" { "assistant" } else { "user" };
                return Err(format!("{at}: {kind} blocks belong in {whose} messages"));
            }
            Some(other) => return Err(unsupported_block(other, &at)),
            None => return Err(format!("{at}.type: Field required")),
        }
    }
    if role == Role::Assistant {
        let mut answer = ChatMessage::new(role, text.join("\n\n"));
        answer.tool_calls = calls;
        out.push(answer);
    } else {
        flush(&mut text, out);
    }
    Ok(())
}

/// A final assistant message is a prefill: the answer continues its text
/// (and does not repeat it). Anthropic refuses one that ends in whitespace:
/// tokenizers join a space to the word after it, so the model would go on
/// from a boundary it never saw. One with `tool_use` blocks has no text to
/// continue: its calls wait for their results, in a user message.
fn prefill(last: &ChatMessage, i: usize) -> Result<(), Invalid> {
    if !last.tool_calls.is_empty() {
        return Err(format!(
            "messages.{i}: tool_use blocks in a final assistant message are not supported: a prefill continues text; answer the calls with tool_result blocks in a user message"
        ));
    }
    if last.content.ends_with(char::is_whitespace) {
        return Err("messages: final assistant content cannot end with trailing whitespace".into());
    }
    Ok(())
}

/// A custom tool (`{name, description, input_schema}`) in the protocol's
/// shape. Anthropic's own server tools (typed `bash_20250124` and the like)
/// need the tool run by the API, which this server does not do.
fn tool(v: &Value, i: usize) -> Result<Tool, Invalid> {
    let at = format!("tools.{i}");
    let t = obj(v, &at)?;
    match t.get("type") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "custom" => {}
        Some(Value::String(s)) => {
            return Err(format!("{at}.type: the server tool {s:?} is not supported here; declare the tool with a name and an input_schema instead"))
        }
        Some(_) => return Err(format!("{at}.type: Input should be a valid string")),
    }
    refuse_extra(
        t,
        &[
            "type",
            "name",
            "description",
            "input_schema",
            "cache_control",
            "strict",
            "input_examples",
            "defer_loading",
            "eager_input_streaming",
            "allowed_callers",
        ],
        &at,
    )?;
    cache_control(t, &format!("{at}."))?;
    let name = string(required(t, "name", &at)?, &format!("{at}.name"))?;
    let description = t.get("description").filter(|d| !d.is_null()).map(|d| string(d, &format!("{at}.description"))).transpose()?;
    let schema = required(t, "input_schema", &at)?;
    if obj(schema, &format!("{at}.input_schema"))?.get("type").and_then(Value::as_str) != Some("object") {
        return Err(format!("{at}.input_schema.type: Input should be 'object'"));
    }
    Ok(Tool { kind: Default::default(), name, description, parameters: Some(schema.clone()) })
}

/// `tool_choice`: `{type: auto|any|tool|none, name?, disable_parallel_tool_use?}`;
/// the choice and whether one answer may hold several calls.
fn tool_choice(v: &Value) -> Result<(ToolChoice, Option<bool>), Invalid> {
    let c = obj(v, "tool_choice")?;
    refuse_extra(c, &["type", "name", "disable_parallel_tool_use"], "tool_choice")?;
    let choice = match c.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Mode(ToolChoiceMode::Auto),
        Some("any") => ToolChoice::Mode(ToolChoiceMode::Required),
        Some("none") => ToolChoice::Mode(ToolChoiceMode::None),
        Some("tool") => {
            let name = string(required(c, "name", "tool_choice")?, "tool_choice.name")?;
            ToolChoice::Function(NamedTool { kind: Default::default(), name })
        }
        _ => return Err("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'".into()),
    };
    let parallel = match c.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(off)) => Some(!off),
        Some(_) => return Err("tool_choice.disable_parallel_tool_use: Input should be a valid boolean".into()),
    };
    Ok((choice, parallel))
}

/// `thinking`: only `{type: "disabled"}`.
fn thinking(v: &Value) -> Result<(), Invalid> {
    match v.get("type").and_then(Value::as_str) {
        Some("disabled") => Ok(()),
        Some("enabled" | "adaptive") => Err("thinking: extended thinking is not supported by this server; leave `thinking` out".into()),
        _ => Err("thinking.type: Input should be 'enabled', 'adaptive' or 'disabled'".into()),
    }
}

/// `output_config`: `format` (a JSON schema the answer is held to, token by
/// token) and `effort` (a hint for Anthropic's own models: accepted, unused).
fn output_config(v: &Value) -> Result<Option<ResponseFormat>, Invalid> {
    let c = obj(v, "output_config")?;
    refuse_extra(c, &["format", "effort"], "output_config")?;
    let Some(format) = c.get("format").filter(|f| !f.is_null()) else { return Ok(None) };
    let f = obj(format, "output_config.format")?;
    refuse_extra(f, &["type", "schema"], "output_config.format")?;
    if f.get("type").and_then(Value::as_str) != Some("json_schema") {
        return Err("output_config.format.type: Input should be 'json_schema'".into());
    }
    let schema = required(f, "schema", "output_config.format")?;
    obj(schema, "output_config.format.schema")?;
    Ok(Some(ResponseFormat::JsonSchema { schema: schema.clone() }))
}

/// `metadata`: only `user_id` (a string or null), kept for nobody.
fn metadata(v: &Value) -> Result<(), Invalid> {
    let m = obj(v, "metadata")?;
    refuse_extra(m, &["user_id"], "metadata")?;
    match m.get("user_id") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if s.len() <= 256 => Ok(()),
        Some(_) => Err("metadata.user_id: Input should be a string of at most 256 characters".into()),
    }
}

/// Parses a body sent to `endpoint`.
pub fn parse(body: &Map<String, Value>, endpoint: Endpoint, request_id: String) -> Result<Parsed, Invalid> {
    if let Some(k) = body.keys().find(|k| UNSUPPORTED_FIELDS.contains(&k.as_str())) {
        return Err(format!("{k}: this server does not support `{k}`"));
    }
    let own: &[&str] = if endpoint == Endpoint::Create { CREATE_FIELDS } else { &[] };
    if let Some(k) = body.keys().find(|k| !SHARED_FIELDS.contains(&k.as_str()) && !own.contains(&k.as_str())) {
        return Err(format!("{k}: Extra inputs are not permitted"));
    }
    let model = string(required(body, "model", "")?, "model")?;
    let turns = required(body, "messages", "")?.as_array().ok_or("messages: Input should be a valid list")?;
    if turns.is_empty() {
        return Err("messages: at least one message is required".into());
    }
    let mut messages = Vec::new();
    if let Some(s) = body.get("system") {
        let s = system(s)?;
        if !s.is_empty() {
            messages.push(ChatMessage::new(Role::System, s));
        }
    }
    let mut called = Vec::new();
    for (i, m) in turns.iter().enumerate() {
        turn(m, i, &mut called, &mut messages)?;
    }
    let prefilled = turns.last().and_then(|m| m.get("role")).and_then(Value::as_str) == Some("assistant");
    if let (true, Some(last)) = (prefilled, messages.last()) {
        prefill(last, turns.len() - 1)?;
    }
    cache_control(body, "")?;
    let mut generate = GenerateRequest::new(request_id, GenerateInput::Messages(messages));
    generate.continue_final_message = prefilled;
    if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
        let tools = tools.as_array().ok_or("tools: Input should be a valid list")?;
        generate.tools = tools.iter().enumerate().map(|(i, t)| tool(t, i)).collect::<Result<_, _>>()?;
    }
    if let Some(choice) = body.get("tool_choice").filter(|c| !c.is_null()) {
        let (choice, parallel) = tool_choice(choice)?;
        let optional = choice == ToolChoice::Mode(ToolChoiceMode::None) || choice == ToolChoice::Mode(ToolChoiceMode::Auto);
        if generate.tools.is_empty() && !optional {
            return Err("tool_choice: a tool must be called, but `tools` is empty".into());
        }
        // Anthropic's API takes `auto` or `none` without tools (agents send
        // their default choice whatever their tool list); it means nothing then.
        if !generate.tools.is_empty() {
            generate.tool_choice = Some(choice);
            generate.parallel_tool_calls = parallel;
        }
    }
    if let Some(t) = body.get("thinking").filter(|t| !t.is_null()) {
        thinking(t)?;
    }
    if let Some(c) = body.get("output_config").filter(|c| !c.is_null()) {
        generate.response_format = output_config(c)?;
    }
    let mut parsed = Parsed { model, generate, max_tokens: 0, stream: false };
    if endpoint == Endpoint::Create {
        create_fields(body, &mut parsed)?;
    }
    Ok(parsed)
}

/// The fields only a generation has: its length, stops and sampling.
fn create_fields(body: &Map<String, Value>, parsed: &mut Parsed) -> Result<(), Invalid> {
    let max_tokens = required(body, "max_tokens", "")?;
    parsed.max_tokens = max_tokens
        .as_u64()
        .filter(|&n| n >= 1)
        .and_then(|n| u32::try_from(n).ok())
        .ok_or("max_tokens: Input should be an integer greater than or equal to 1")?;
    parsed.stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("stream: Input should be a valid boolean".into()),
    };
    let g = &mut parsed.generate;
    if let Some(stops) = body.get("stop_sequences").filter(|s| !s.is_null()) {
        let stops = stops.as_array().ok_or("stop_sequences: Input should be a valid list")?;
        g.stop = stops.iter().enumerate().map(|(i, s)| string(s, &format!("stop_sequences.{i}"))).collect::<Result<_, _>>()?;
    }
    // Anthropic's default temperature is 1 (sampling), in [0, 1].
    g.temperature = 1.0;
    if let Some(t) = body.get("temperature").filter(|t| !t.is_null()) {
        let t = number(t, "temperature")?;
        if !(0.0..=1.0).contains(&t) {
            return Err("temperature: Input should be between 0 and 1".into());
        }
        g.temperature = t as f32;
    }
    if let Some(p) = body.get("top_p").filter(|p| !p.is_null()) {
        // Its range, (0, 1], is the protocol's, checked with the request.
        g.top_p = Some(number(p, "top_p")? as f32).filter(|&p| p != 1.0);
    }
    if let Some(k) = body.get("top_k").filter(|k| !k.is_null()) {
        let k = k.as_u64().and_then(|k| u32::try_from(k).ok()).ok_or("top_k: Input should be a non-negative integer")?;
        g.top_k = (k > 0).then_some(k);
    }
    if let Some(m) = body.get("metadata").filter(|m| !m.is_null()) {
        metadata(m)?;
    }
    match body.get("service_tier").map(Value::as_str) {
        None | Some(Some("auto" | "standard_only")) => Ok(()),
        Some(_) => Err("service_tier: Input should be 'auto' or 'standard_only'".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_create(v: Value) -> Result<Parsed, Invalid> {
        parse(v.as_object().unwrap(), Endpoint::Create, "msg_test".into())
    }

    fn messages(p: &Parsed) -> &[ChatMessage] {
        match &p.generate.input {
            GenerateInput::Messages(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_tool_loop_becomes_calls_and_tool_messages() {
        let p = parse_create(json!({
            "model": "m", "max_tokens": 64,
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                    {"type": "text", "text": "And tomorrow?"}]},
            ],
            "tools": [{"name": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        }))
        .unwrap();
        let m = messages(&p);
        let roles: Vec<Role> = m.iter().map(|m| m.role).collect();
        assert_eq!(roles, [Role::System, Role::User, Role::Assistant, Role::Tool, Role::User]);
        assert_eq!(m[2].tool_calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(m[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(m[3].content, "18C");
        assert_eq!(p.generate.tool_choice, Some(ToolChoice::Mode(ToolChoiceMode::Required)));
        assert_eq!(p.generate.parallel_tool_calls, Some(false));
        assert_eq!(p.generate.temperature, 1.0);
        assert_eq!(p.max_tokens, 64);
    }

    #[test]
    fn an_optional_tool_choice_without_tools_is_taken_and_a_forced_one_refused() {
        let with_choice =
            |choice: Value| parse_create(json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tool_choice": choice}));
        for optional in ["auto", "none"] {
            let p = with_choice(json!({"type": optional})).unwrap();
            assert_eq!(p.generate.tool_choice, None, "{optional}");
            p.generate.validate().unwrap();
        }
        assert!(with_choice(json!({"type": "any"})).err().unwrap().contains("`tools` is empty"));
    }

    #[test]
    fn what_this_server_lacks_is_refused_by_name() {
        let base = |extra: Value| {
            let mut v = json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            parse_create(v).err().unwrap()
        };
        assert_eq!(base(json!({"frobnicate": 1})), "frobnicate: Extra inputs are not permitted");
        assert!(base(json!({"thinking": {"type": "enabled", "budget_tokens": 1024}})).contains("extended thinking"));
        assert!(base(json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]})).contains("server tool"));
        assert!(base(json!({"temperature": 1.5})).starts_with("temperature"));
        assert!(base(json!({"container": "c"})).contains("does not support"));
        let image = json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]});
        assert!(parse_create(image).err().unwrap().starts_with("messages.0.content.0: image content blocks"));
        let orphan = json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]});
        assert!(parse_create(orphan).err().unwrap().contains("unexpected `tool_use_id`"));
        let no_max = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(parse_create(no_max).err().unwrap(), "max_tokens: Field required");
    }

    #[test]
    fn a_final_assistant_message_is_a_prefill_to_continue() {
        let ask = |last: Value| json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": last}]});
        let p = parse_create(ask(json!([{"type": "text", "text": "The"}, {"type": "text", "text": "capital is"}]))).unwrap();
        assert!(p.generate.continue_final_message);
        assert_eq!(messages(&p).last().unwrap().content, "The\n\ncapital is");
        assert!(
            !parse_create(json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})).unwrap().generate.continue_final_message
        );
        assert_eq!(parse_create(ask(json!("The "))).err().unwrap(), "messages: final assistant content cannot end with trailing whitespace");
        assert_eq!(parse_create(ask(json!("The\n"))).err().unwrap(), "messages: final assistant content cannot end with trailing whitespace");
        let call = json!([{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]);
        assert!(parse_create(ask(call)).err().unwrap().starts_with("messages.1: tool_use blocks in a final assistant message are not supported"));
        // count_tokens counts the same continued prompt.
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]});
        assert!(parse(body.as_object().unwrap(), Endpoint::CountTokens, "c".into()).unwrap().generate.continue_final_message);
    }

    #[test]
    fn count_tokens_takes_no_generation_fields() {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        assert!(parse(body.as_object().unwrap(), Endpoint::CountTokens, "c".into()).is_ok());
        let body = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
        assert_eq!(parse(body.as_object().unwrap(), Endpoint::CountTokens, "c".into()).err().unwrap(), "max_tokens: Extra inputs are not permitted");
    }
}
