//! Tool calls: the request's tools shown to the model, the grammar that
//! holds its calls to the tools' schemas, and its output split into text
//! and calls ([`CallSplitter`]).
//!
//! One call format is spoken, the one Qwen2.5 (and Hermes-style models) were
//! trained on: each call is a JSON object `{"name": ..., "arguments": {...}}`
//! between `<tool_call>` and `</tool_call>` lines. A chat template with a tool
//! section of that kind renders the tools itself ([`ToolPrompting::Template`]);
//! for any other template (SmolLM2's and Gemma 3's have none) the server writes
//! the tools and the format into the system message, shows earlier calls as
//! the assistant's text and tool results as `<tool_response>` user turns
//! ([`ToolPrompting::Written`]), so every model can be asked, and with
//! `tool_choice` `required` or a named function the grammar makes even a
//! model never trained on tools answer with a valid call.
mod parse;

use protocol::{ChatMessage as WireMessage, Role, Tool, ToolCall, ToolMode};
use serde_json::{json, Value};

use crate::tokenizer::{python_json, ChatMessage, RenderOptions, TextTokenizer, TokenKind};
pub use parse::{CallSplitter, Split};

/// Opens a call in the model's output.
pub const CALL_OPEN: &str = "<tool_call>";
/// Closes a call.
pub const CALL_CLOSE: &str = "</tool_call>";

/// How the model is told about tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolPrompting {
    /// The chat template renders `tools`, calls and results in the call format.
    Template,
    /// The server writes them into the messages (the template has no tool section).
    Written,
}

impl ToolPrompting {
    /// Whether `tok`'s chat template speaks the call format: it renders a
    /// probe tool and tells the model to answer in `<tool_call>` tags.
    pub fn detect(tok: &TextTokenizer) -> ToolPrompting {
        let Ok(template) = tok.chat_template() else { return ToolPrompting::Written };
        let probe = [json!({"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}}})];
        let opts = RenderOptions { add_generation_prompt: true, tools: Some(&probe), ..Default::default() };
        match template.render_with(&[ChatMessage::user("?")], &opts) {
            Ok(text) if text.contains(CALL_OPEN) && text.contains("probe") => ToolPrompting::Template,
            _ => ToolPrompting::Written,
        }
    }
}

/// A tool as chat templates expect it (OpenAI's Chat Completions shape).
fn template_tool(tool: &Tool) -> Value {
    let mut function = json!({"name": tool.name});
    if let Some(d) = &tool.description {
        function["description"] = json!(d);
    }
    function["parameters"] = tool.parameters.clone().unwrap_or_else(|| json!({"type": "object", "properties": {}}));
    json!({"type": "function", "function": function})
}

/// A call's arguments as the model wrote them: the JSON value (so the
/// template writes it back in its own layout, which the grammar also uses,
/// and the next turn's tokens match the cached ones), or the text as is
/// when it is not JSON.
fn arguments_value(call: &ToolCall) -> Value {
    serde_json::from_str(&call.arguments).unwrap_or_else(|_| Value::String(call.arguments.clone()))
}

/// A call as the model writes it.
fn call_text(call: &ToolCall) -> String {
    let body = json!({"name": call.name, "arguments": arguments_value(call)});
    format!("{CALL_OPEN}\n{}\n{CALL_CLOSE}", python_json(&body))
}

/// The system text that shows tools to a model whose template cannot.
fn written_preamble(tools: &[Tool]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou can call functions to help with the user's request. Each function's signature is a JSON object \
         in <tools></tools>:\n<tools>",
    );
    for tool in tools {
        s.push('\n');
        s.push_str(&python_json(&template_tool(tool)));
    }
    s.push_str(
        "\n</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments, between \
         <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n</tool_call>",
    );
    s
}

/// The template's messages and tools for a conversation of wire messages
/// and the request's `tools` (empty: none offered now, though earlier turns
/// may still hold calls and results).
pub fn template_input(messages: &[WireMessage], tools: &[Tool], prompting: ToolPrompting) -> (Vec<ChatMessage>, Option<Vec<Value>>) {
    match prompting {
        ToolPrompting::Template => {
            let out = messages
                .iter()
                .map(|m| {
                    let mut c = ChatMessage::new(m.role.as_str(), m.content.clone());
                    if !m.tool_calls.is_empty() {
                        if m.content.is_empty() {
                            c.content = None;
                        }
                        let calls = m
                            .tool_calls
                            .iter()
                            .map(|call| json!({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments_value(call)}}))
                            .collect();
                        c.tool_calls = Some(calls);
                    }
                    c.tool_call_id = m.tool_call_id.clone();
                    c
                })
                .collect();
            let tools = (!tools.is_empty()).then(|| tools.iter().map(template_tool).collect());
            (out, tools)
        }
        ToolPrompting::Written => (written_messages(messages, tools), None),
    }
}

fn written_messages(messages: &[WireMessage], tools: &[Tool]) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    // The tools follow the client's own system message, or make one.
    let client_system = messages.first().is_some_and(|m| m.role == Role::System);
    if !tools.is_empty() && !client_system {
        out.push(ChatMessage::system(written_preamble(tools)));
    }
    for (i, m) in messages.iter().enumerate() {
        match m.role {
            Role::System if i == 0 && !tools.is_empty() => {
                out.push(ChatMessage::system(format!("{}\n\n{}", m.content, written_preamble(tools))));
            }
            Role::Assistant if !m.tool_calls.is_empty() => {
                let mut parts: Vec<String> = Vec::new();
                if !m.content.is_empty() {
                    parts.push(m.content.clone());
                }
                parts.extend(m.tool_calls.iter().map(call_text));
                out.push(ChatMessage::assistant(parts.join("\n")));
            }
            Role::Tool => {
                let response = format!("<tool_response>\n{}\n</tool_response>", m.content);
                // Results of one turn's calls go back as one user turn.
                match out.last_mut() {
                    Some(last) if i > 0 && messages[i - 1].role == Role::Tool => {
                        if let Some(Value::String(text)) = &mut last.content {
                            text.push('\n');
                            text.push_str(&response);
                        }
                    }
                    _ => out.push(ChatMessage::user(response)),
                }
            }
            _ => out.push(ChatMessage::new(m.role.as_str(), m.content.clone())),
        }
    }
    out
}

/// What a request's tools ask of the constraint.
pub struct CallGrammar {
    /// The Lark grammar of the constrained part of the output.
    pub lark: String,
    /// `Some(token)`: the output is free until the model writes this token
    /// (the call opener), then the grammar holds the call, and the output is
    /// free again after it. `None`: the whole output is the grammar's.
    pub trigger: Option<u32>,
}

/// A string or special token in Lark: `<[id]>` for a control token (a
/// grammar's quoted text never produces one), else the quoted text.
fn lark_literal(tok: &TextTokenizer, text: &str) -> String {
    match tok.token_id(text) {
        Some(id) if tok.token_kind(id) == Some(TokenKind::Control) => format!("<[{id}]>"),
        _ => Value::String(text.to_string()).to_string(),
    }
}

/// The JSON Schema of one call's object: `{"name": <one of the tools>,
/// "arguments": <that tool's parameters>}`.
fn call_schema(tools: &[&Tool]) -> Value {
    let one = |t: &Tool| {
        json!({
            "type": "object",
            "properties": {
                "name": {"const": t.name},
                "arguments": t.parameters.clone().unwrap_or_else(|| json!({"type": "object"})),
            },
            "required": ["name", "arguments"],
            "additionalProperties": false,
        })
    };
    match tools {
        [t] => one(t),
        many => json!({"anyOf": many.iter().map(|t| one(t)).collect::<Vec<_>>()}),
    }
}

/// The grammar of a request's calls; `None` when nothing constrains them
/// (`auto` on a model whose call opener is several tokens: its calls are
/// parsed, not held).
///
/// * `required`: the output is one call, or several with `parallel`, and
///   nothing else; a named tool: one call of it.
/// * `auto`: free text until the model writes the opener token; from there
///   to the closing tag the call must match one of the tools.
///
/// `style` lays out the call's JSON schema (the grammar module's fixed
/// layout).
pub fn call_grammar(tok: &TextTokenizer, tools: &[Tool], mode: ToolMode<'_>, parallel: bool, style: impl Fn(Value) -> Value) -> Option<CallGrammar> {
    let chosen: Vec<&Tool> = match mode {
        ToolMode::Named(name) => tools.iter().filter(|t| t.name == name).collect(),
        ToolMode::Auto | ToolMode::Required => tools.iter().collect(),
    };
    let rules = CallRules::new(tok, &chosen, style);
    match mode {
        ToolMode::Auto => {
            let opener = tok.encode(CALL_OPEN, false).ok().filter(|ids| ids.len() == 1)?;
            Some(CallGrammar { lark: format!("start: \"\\n\" body \"\\n\" {}\n{}\n", rules.close, rules.body), trigger: Some(opener[0]) })
        }
        ToolMode::Required | ToolMode::Named(_) => {
            // A named tool is called once (OpenAI's meaning of naming it).
            let several = parallel && mode == ToolMode::Required;
            Some(CallGrammar { lark: format!("start: {}\n{}", repeated("call", several), rules.tagged()), trigger: None })
        }
    }
}

/// The grammar of `tool_choice: "auto"` beside a `response_format`: the
/// output is either calls (tagged, or the bare call objects small models
/// write, which the splitter also takes as calls) or the answer, which is
/// the grammar named [`ANSWER_GRAMMAR`] that the caller supplies. Free text
/// is not among the choices: the format is the answer's shape.
pub fn calls_or_answer_grammar(tok: &TextTokenizer, tools: &[Tool], parallel: bool, style: impl Fn(Value) -> Value) -> String {
    let chosen: Vec<&Tool> = tools.iter().collect();
    let rules = CallRules::new(tok, &chosen, style);
    // Untagged, one call only: nothing marks where a run of them would end.
    format!("start: tagged | bare | @{ANSWER_GRAMMAR}\ntagged: {}\nbare: body\n{}", repeated("call", parallel), rules.tagged())
}

/// The name under which [`calls_or_answer_grammar`] refers to the answer's grammar.
pub const ANSWER_GRAMMAR: &str = "answer";

/// `rule`, or several of it on their own lines.
fn repeated(rule: &str, several: bool) -> String {
    if several {
        format!("{rule} (\"\\n\" {rule})*")
    } else {
        rule.to_string()
    }
}

/// The Lark rules every call grammar shares: the call object's JSON (`body`)
/// and the tags around it.
struct CallRules {
    body: String,
    open: String,
    close: String,
}

impl CallRules {
    fn new(tok: &TextTokenizer, chosen: &[&Tool], style: impl Fn(Value) -> Value) -> CallRules {
        CallRules { body: format!("body: %json {}", style(call_schema(chosen))), open: lark_literal(tok, CALL_OPEN), close: lark_literal(tok, CALL_CLOSE) }
    }

    /// `call` (a tagged call) and `body`.
    fn tagged(&self) -> String {
        format!("call: {} \"\\n\" body \"\\n\" {}\n{}\n", self.open, self.close, self.body)
    }
}

/// The call tags where the vocabulary has them as single control tokens:
/// their text must reach the splitter although control tokens are not text.
pub fn tag_tokens(tok: &TextTokenizer) -> Vec<u32> {
    [CALL_OPEN, CALL_CLOSE].iter().filter_map(|t| tok.token_id(t)).filter(|&id| tok.is_special(id)).collect()
}

/// The names a request's calls may use.
pub fn tool_names(tools: &[Tool]) -> Vec<String> {
    tools.iter().map(|t| t.name.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> Tool {
        Tool {
            kind: Default::default(),
            name: name.into(),
            description: Some("d".into()),
            parameters: Some(json!({"type": "object", "properties": {"city": {"type": "string"}}})),
        }
    }

    #[test]
    fn written_prompting_shows_tools_calls_and_results_as_text() {
        let mut call = WireMessage::new(Role::Assistant, "");
        call.tool_calls = vec![ToolCall { id: "c1".into(), name: "weather".into(), arguments: "{\"city\":\"Paris\"}".into() }];
        let mut result = WireMessage::new(Role::Tool, "21C");
        result.tool_call_id = Some("c1".into());
        let msgs = [WireMessage::new(Role::User, "Paris?"), call, result.clone(), result];
        let (out, tools) = template_input(&msgs, &[tool("weather")], ToolPrompting::Written);
        assert!(tools.is_none());
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        let text = |m: &ChatMessage| m.content.as_ref().and_then(Value::as_str).unwrap().to_string();
        assert!(text(&out[0]).contains("\"name\": \"weather\""), "{}", text(&out[0]));
        assert_eq!(text(&out[2]), "<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
        assert_eq!(text(&out[3]), "<tool_response>\n21C\n</tool_response>\n<tool_response>\n21C\n</tool_response>");
        // A client's system message keeps its text, the tools follow it.
        let (out, _) = template_input(&[WireMessage::new(Role::System, "Be brief."), WireMessage::new(Role::User, "x")], &[tool("a")], ToolPrompting::Written);
        assert_eq!(out.len(), 2);
        assert!(text(&out[0]).starts_with("Be brief.\n\n# Tools"));
    }

    #[test]
    fn template_prompting_passes_calls_as_json() {
        let mut call = WireMessage::new(Role::Assistant, "");
        call.tool_calls = vec![ToolCall { id: "c1".into(), name: "weather".into(), arguments: "{\"city\": \"Paris\", \"a\": 1}".into() }];
        let (out, tools) = template_input(&[call], &[tool("weather")], ToolPrompting::Template);
        assert_eq!(tools.unwrap()[0]["function"]["name"], "weather");
        assert!(out[0].content.is_none());
        let args = &out[0].tool_calls.as_ref().unwrap()[0]["function"]["arguments"];
        // Key order is the model's, not sorted.
        assert_eq!(python_json(args), "{\"city\": \"Paris\", \"a\": 1}");
    }
}
