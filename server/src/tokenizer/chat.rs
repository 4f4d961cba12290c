//! Chat templates: Hugging Face-style Jinja rendered with minijinja.
//!
//! The environment mirrors `transformers`' `apply_chat_template`: `trim_blocks`
//! and `lstrip_blocks` on, loop controls (`{% break %}`), Python string/dict
//! methods (`.strip()`, `.startswith()`, `.items()`… via minijinja-contrib's
//! pycompat), `raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson` that
//! formats like Python's `json.dumps(ensure_ascii=False)` (`", "` / `": "`).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use super::error::{Result, TokenizerError};

const TEMPLATE_NAME: &str = "chat";

/// Gemma's turn format, for Gemma files that carry no template of their own
/// (llama.cpp likewise falls back to a built-in one): `<start_of_turn>` and
/// the role (`model` for the assistant) on a line, the content, then
/// `<end_of_turn>`; a system message opens the first user turn, followed by
/// a blank line.
const GEMMA_TEMPLATE: &str = r#"{{ bos_token }}{% set has_system = messages and messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' if has_system else '' %}{% set turns = messages[1:] if has_system else messages %}{% for message in turns %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"#;

/// The template of a model family whose files may come without one, by
/// GGUF architecture name.
pub fn family_template(architecture: &str) -> Option<&'static str> {
    match architecture {
        "gemma3" => Some(GEMMA_TEMPLATE),
        _ => None,
    }
}
const RAISE_MARKER: &str = "raise_exception: ";

/// One chat message.  Unknown fields (e.g. `reasoning_content`) are kept in
/// `extra` and passed to the template as-is.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// Usually a string; may be a list of content parts.  `None` (e.g. an
    /// assistant turn with only tool calls) is *undefined* in the template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: Some(serde_json::Value::String(content.into())), ..Default::default() }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
    pub fn tool(content: impl Into<String>) -> Self {
        Self::new("tool", content)
    }
}

/// Extra inputs to a render.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions<'a> {
    /// Append the assistant header so the model continues as the assistant.
    pub add_generation_prompt: bool,
    /// Leave the final message open for the model to continue its text (an
    /// assistant prefill): nothing the template writes after it (end of
    /// turn, generation prompt) is kept. Transformers' `continue_final_message`.
    pub continue_final_message: bool,
    /// Tool (function) schemas, exposed as `tools`; left undefined when `None`.
    pub tools: Option<&'a [serde_json::Value]>,
    /// RAG documents, exposed as `documents` when given.
    pub documents: Option<&'a [serde_json::Value]>,
    /// Additional template variables (e.g. `enable_thinking`).
    pub extra: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bos_token", &self.bos_token).field("eos_token", &self.eos_token).finish()
    }
}

impl ChatTemplate {
    /// Compile `source`.  `bos_token`/`eos_token` are the texts exposed to the template.
    pub fn new(source: impl Into<String>, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.into()).map_err(|e| TokenizerError::TemplateSyntax(describe(&e)))?;
        Ok(ChatTemplate { env, bos_token: bos_token.unwrap_or_default().to_string(), eos_token: eos_token.unwrap_or_default().to_string() })
    }

    /// Render messages (no tools, no extra variables).
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, &RenderOptions { add_generation_prompt, ..Default::default() })
    }

    pub fn render_with(&self, messages: &[ChatMessage], opts: &RenderOptions<'_>) -> Result<String> {
        self.render_value(Value::from_serialize(messages), opts)
    }

    /// Render messages given as a JSON array (OpenAI-style objects).
    pub fn render_json(&self, messages: &serde_json::Value, opts: &RenderOptions<'_>) -> Result<String> {
        self.render_value(Value::from_serialize(messages), opts)
    }

    fn render_value(&self, messages: Value, opts: &RenderOptions<'_>) -> Result<String> {
        if opts.continue_final_message {
            return self.render_continuing(messages, opts);
        }
        self.render_whole(messages, opts)
    }

    /// Renders the conversation whole and cuts it where the final message's
    /// text ends, as transformers does: templates have no open-turn mode of
    /// their own, and their end-of-turn markers differ, but each writes the
    /// text. Where a template trims the text (Gemma's `| trim`), the cut is
    /// at its trimmed end. An empty final message has nothing to continue:
    /// the model starts that turn, as after the generation prompt.
    fn render_continuing(&self, messages: Value, opts: &RenderOptions<'_>) -> Result<String> {
        let num_messages = messages.len().unwrap_or(0);
        let last = num_messages.checked_sub(1).and_then(|i| messages.get_item_by_index(i).ok());
        let text = last
            .as_ref()
            .and_then(final_text)
            .ok_or_else(|| TokenizerError::TemplateRender("continue_final_message: the final message has no text to continue".into()))?;
        let whole = RenderOptions { add_generation_prompt: false, continue_final_message: false, ..opts.clone() };
        let trimmed = text.trim();
        if trimmed.is_empty() {
            let earlier: Vec<Value> = (0..num_messages - 1).filter_map(|i| messages.get_item_by_index(i).ok()).collect();
            return self.render_whole(Value::from(earlier), &RenderOptions { add_generation_prompt: true, ..whole });
        }
        let mut rendered = self.render_whole(messages, &whole)?;
        let at = rendered
            .rfind(trimmed)
            .ok_or_else(|| TokenizerError::TemplateRender("continue_final_message: the final message's text does not appear in the rendered chat".into()))?;
        let unindented = text.trim_start();
        let end = if rendered[at..].starts_with(unindented) { at + unindented.len() } else { at + trimmed.len() };
        rendered.truncate(end);
        Ok(rendered)
    }

    fn render_whole(&self, messages: Value, opts: &RenderOptions<'_>) -> Result<String> {
        let mut ctx: Vec<(String, Value)> = Vec::new();
        if let Some(extra) = opts.extra {
            for (k, v) in extra {
                ctx.push((k.clone(), Value::from_serialize(v)));
            }
        }
        ctx.push(("messages".into(), messages));
        ctx.push(("add_generation_prompt".into(), Value::from(opts.add_generation_prompt)));
        ctx.push(("bos_token".into(), Value::from(self.bos_token.clone())));
        ctx.push(("eos_token".into(), Value::from(self.eos_token.clone())));
        if let Some(tools) = opts.tools {
            ctx.push(("tools".into(), Value::from_serialize(tools)));
        }
        if let Some(docs) = opts.documents {
            ctx.push(("documents".into(), Value::from_serialize(docs)));
        }
        let ctx: Value = ctx.into_iter().collect();
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| TokenizerError::TemplateRender(describe(&e)))?;
        tmpl.render(ctx).map_err(classify)
    }
}

/// The text a message ends with: its `content` string, or the last text
/// part of a list of parts.
fn final_text(message: &Value) -> Option<String> {
    let content = message.get_attr("content").ok()?;
    if let Some(s) = content.as_str() {
        return Some(s.to_string());
    }
    let parts: Vec<Value> = content.try_iter().ok()?.collect();
    parts.iter().rev().find_map(|p| p.get_attr("text").ok()?.as_str().map(str::to_string))
}

fn classify(e: Error) -> TokenizerError {
    if e.kind() == ErrorKind::InvalidOperation {
        if let Some(msg) = e.detail().and_then(|d| d.strip_prefix(RAISE_MARKER)) {
            return TokenizerError::TemplateRaised(msg.to_string());
        }
    }
    TokenizerError::TemplateRender(describe(&e))
}

/// "kind: detail (in chat:LINE)" plus the chain of causes.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        let _ = write!(s, ": {inner}");
        src = inner.source();
    }
    s
}

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("{RAISE_MARKER}{msg}")))
}

// ---------------------------------------------------------------- tojson --

/// Python-compatible `tojson(value, indent=None, sort_keys=False, separators=None)`.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")?.or(indent) {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = i64::try_from(v)?;
                Some(" ".repeat(n.max(0) as usize))
            }
        },
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let _ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair")),
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let fmt = JsonFmt { indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    fmt.write(value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// `v` as the templates' `tojson` writes it (Python's `json.dumps`, `", "`
/// and `": "`), for text that must match what a template renders.
pub fn python_json(v: &serde_json::Value) -> String {
    let fmt = JsonFmt { indent: None, item_sep: ", ".into(), key_sep: ": ".into(), sort_keys: false };
    let mut out = String::new();
    match fmt.write(&Value::from_serialize(v), 0, &mut out) {
        Ok(()) => out,
        Err(_) => v.to_string(),
    }
}

struct JsonFmt {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl JsonFmt {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, v: &Value, level: usize, out: &mut String) -> std::result::Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    let _ = write!(out, "{v}");
                } else {
                    out.push_str(&py_float(f64::try_from(v.clone())?));
                }
            }
            ValueKind::String => json_string(v.as_str().unwrap_or_default(), out),
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    match k.as_str() {
                        Some(s) => json_string(s, out),
                        None => json_string(&k.to_string(), out),
                    }
                    out.push_str(&self.key_sep);
                    self.write(&v.get_item(k)?, level + 1, out)?;
                }
                self.newline(level, out);
                out.push('}');
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push(']');
            }
            _ => json_string(&v.to_string(), out),
        }
        Ok(())
    }
}

/// Python `json.dumps` string escaping with `ensure_ascii=False`.
fn json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `repr(float)`: shortest round-trip digits, exponent form outside [1e-4, 1e16).
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let s = format!("{f:e}"); // e.g. "1e16", "1.5e-7"
        let (mant, exp) = s.split_once('e').unwrap();
        let exp: i32 = exp.parse().unwrap();
        return format!("{mant}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

// ---------------------------------------------------------- strftime_now --

fn strftime_now(fmt: String) -> std::result::Result<Value, Error> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    Ok(Value::from(strftime(&fmt, secs)))
}

/// Minimal UTC `strftime` for the codes chat templates use.
pub(crate) fn strftime(fmt: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (h, mi, s) = (sod / 3600, (sod % 3600) / 60, sod % 60);
    // Civil-from-days (H. Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let is_leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(is_leap && m > 2);

    let mut out = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |out: &mut String, v: i64, w: usize| {
            if no_pad {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0w$}");
            }
        };
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{y}");
            }
            Some('y') => num(&mut out, y.rem_euclid(100), 2),
            Some('m') => num(&mut out, m, 2),
            Some('d') => num(&mut out, d, 2),
            Some('e') => {
                let _ = write!(out, "{d:>2}");
            }
            Some('j') => num(&mut out, yday, 3),
            Some('H') => num(&mut out, h, 2),
            Some('I') => num(&mut out, if h % 12 == 0 { 12 } else { h % 12 }, 2),
            Some('M') => num(&mut out, mi, 2),
            Some('S') => num(&mut out, s, 2),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') | Some('h') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, msgs: &[ChatMessage], gen: bool) -> Result<String> {
        ChatTemplate::new(src, Some("<s>"), Some("</s>"))?.render(msgs, gen)
    }

    #[test]
    fn python_methods_and_blocks() {
        let src = "{% for m in messages %}{% if m.content.strip().startswith('x') %}[{{ m.role.upper() }}]{% endif %}\n{% endfor %}{{ bos_token }}";
        let out = render(src, &[ChatMessage::user("  xyz "), ChatMessage::user("abc")], false).unwrap();
        assert_eq!(out, "[USER]<s>");
    }

    #[test]
    fn raise_exception_is_reported() {
        let src = "{% if messages[0].role != 'system' %}{{ raise_exception('System role required') }}{% endif %}";
        match render(src, &[ChatMessage::user("hi")], false) {
            Err(TokenizerError::TemplateRaised(m)) => assert_eq!(m, "System role required"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn syntax_error_is_reported() {
        let err = ChatTemplate::new("{% for %}", None, None).unwrap_err();
        assert!(matches!(err, TokenizerError::TemplateSyntax(_)), "{err}");
        assert!(err.to_string().contains("chat template failed to compile"), "{err}");
    }

    #[test]
    fn tojson_matches_python() {
        let src = "{{ messages[0].tool_calls[0] | tojson }}|{{ messages[0].tool_calls[0] | tojson(indent=2) }}";
        let mut m = ChatMessage::assistant("");
        m.tool_calls = Some(vec![serde_json::json!({"name": "f<x>", "arguments": {"a": 1, "b": [1.5, true, null], "c": "é\n"}})]);
        let out = render(src, &[m], false).unwrap();
        let (flat, pretty) = out.split_once('|').unwrap();
        // Key order is preserved (workspace serde_json has `preserve_order`), like Python.
        assert_eq!(flat, r#"{"name": "f<x>", "arguments": {"a": 1, "b": [1.5, true, null], "c": "é\n"}}"#);
        assert_eq!(
            pretty,
            "{\n  \"name\": \"f<x>\",\n  \"arguments\": {\n    \"a\": 1,\n    \"b\": [\n      1.5,\n      true,\n      null\n    ],\n    \"c\": \"é\\n\"\n  }\n}"
        );
    }

    #[test]
    fn py_float_repr() {
        assert_eq!(py_float(1.0), "1.0");
        assert_eq!(py_float(0.1), "0.1");
        assert_eq!(py_float(1e16), "1e+16");
        assert_eq!(py_float(1.5e-7), "1.5e-07");
    }

    #[test]
    fn strftime_known_date() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let t = 1_721_999_109;
        assert_eq!(strftime("%d %b %Y %H:%M:%S %A %j %-d", t), "26 Jul 2024 13:05:09 Friday 208 26");
    }

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn continuing(src: &str, msgs: &[ChatMessage]) -> Result<String> {
        let opts = RenderOptions { continue_final_message: true, ..Default::default() };
        ChatTemplate::new(src, Some("<s>"), Some("</s>"))?.render_with(msgs, &opts)
    }

    #[test]
    fn continuing_leaves_the_final_turn_open() {
        let msgs = [ChatMessage::user("Capital of France?"), ChatMessage::assistant("The capital of France is")];
        let out = continuing(CHATML, &msgs).unwrap();
        assert_eq!(out, "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\nThe capital of France is");
        // A template that trims the text (Gemma's) is cut at its trimmed end.
        let msgs = [ChatMessage::user("Hi"), ChatMessage::assistant("  Hello there\n")];
        let out = continuing(GEMMA_TEMPLATE, &msgs).unwrap();
        assert_eq!(out, "<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello there");
    }

    #[test]
    fn continuing_an_empty_message_starts_its_turn() {
        let out = continuing(CHATML, &[ChatMessage::user("Hi"), ChatMessage::assistant("")]).unwrap();
        assert_eq!(out, render(CHATML, &[ChatMessage::user("Hi")], true).unwrap());
    }

    #[test]
    fn continuing_text_the_template_drops_is_an_error() {
        let drops_assistants = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}";
        let err = continuing(drops_assistants, &[ChatMessage::user("Hi"), ChatMessage::assistant("Hello")]).unwrap_err();
        assert!(err.to_string().contains("does not appear"), "{err}");
    }

    #[test]
    fn loop_controls_enabled() {
        let src = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}";
        let out = render(src, &[ChatMessage::user("a"), ChatMessage::user("b")], false).unwrap();
        assert_eq!(out, "a");
    }
}
