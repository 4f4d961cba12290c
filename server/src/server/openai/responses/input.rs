//! A response's `input` items: messages (text parts, `phase` on assistant
//! ones), the `function_call`s an earlier response made, their
//! `function_call_output`s, and `compaction`s (`compact.rs`); and the
//! `input` of the socket's `response.steer`. Each becomes the prompt's chat
//! messages and, with an id, the item `input_items` lists.
//!
//! Strict, as the rest of the body: an unknown field or item type is an
//! error naming the item, not something silently dropped.
use protocol::{ChatMessage, Role, ToolCall};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::super::wire::{bad, ParamError};

#[derive(Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

/// `input` as the prompt's messages and the listed items (one per item).
pub fn parse(input: Option<Input>) -> Result<(Vec<ChatMessage>, Vec<Value>), ParamError> {
    let (mut messages, mut items) = (Vec::new(), Vec::new());
    match input {
        None => {}
        Some(Input::Text(t)) if t.is_empty() => return Err(bad("input", "input must not be empty")),
        Some(Input::Text(t)) => push_item(&mut messages, &mut items, &json!({"type": "message", "role": "user", "content": t}), 0)?,
        Some(Input::Items(list)) => {
            for (i, v) in list.iter().enumerate() {
                push_item(&mut messages, &mut items, v, i)?;
            }
        }
    }
    Ok((messages, items))
}

fn role(name: &str, i: usize) -> Result<Role, ParamError> {
    Ok(match name {
        "system" | "developer" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        other => return Err(bad("input", format!("input[{i}]: unknown role {other:?}: expected user, assistant, system or developer"))),
    })
}

/// A text part as the response object shows it.
fn text_part(kind: &str, text: &str) -> Value {
    match kind {
        "output_text" => json!({"type": "output_text", "text": text, "annotations": []}),
        _ => json!({"type": "input_text", "text": text}),
    }
}

/// A message's `content`: a string, or text parts (`input_text`, or
/// `output_text` when an earlier response's output is sent back). Returns
/// the text and the parts as `input_items` lists them (`own` is the part
/// type a plain string becomes).
fn content(v: &Value, i: usize, own: &str) -> Result<(String, Vec<Value>), ParamError> {
    match v {
        Value::String(s) => Ok((s.clone(), vec![text_part(own, s)])),
        Value::Array(parts) => {
            let mut text = String::new();
            let mut listed = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.get("text").and_then(Value::as_str)) {
                    (Some(k @ ("input_text" | "output_text")), Some(t)) => {
                        text.push_str(t);
                        listed.push(text_part(k, t));
                    }
                    (Some("input_text" | "output_text"), None) => return Err(bad("input", format!("input[{i}].content[{j}]: `text` must be a string"))),
                    (kind, _) => {
                        return Err(bad(
                            "input",
                            format!("input[{i}].content[{j}]: parts of type {:?} are not supported (input_text only)", kind.unwrap_or("?")),
                        ))
                    }
                }
            }
            Ok((text, listed))
        }
        _ => Err(bad("input", format!("input[{i}].content must be a string or a list of input_text parts"))),
    }
}

/// Only these fields, else an error naming the first other.
fn only_fields(obj: &Map<String, Value>, fields: &[&str], i: usize) -> Result<(), ParamError> {
    match obj.keys().find(|k| !fields.contains(&k.as_str())) {
        Some(k) => Err(bad("input", format!("input[{i}]: unknown field {k:?}"))),
        None => Ok(()),
    }
}

fn string_field<'a>(obj: &'a Map<String, Value>, key: &str, i: usize) -> Result<&'a str, ParamError> {
    obj.get(key).and_then(Value::as_str).ok_or_else(|| bad("input", format!("input[{i}]: `{key}` (a string) is required")))
}

/// An item's own `id`, or a new one with `prefix`.
fn item_id(obj: &Map<String, Value>, prefix: &str) -> String {
    obj.get("id").and_then(Value::as_str).map_or_else(|| super::super::super::new_secret(prefix), str::to_string)
}

/// `phase`, which labels an assistant message (or call) as `commentary` or
/// the `final_answer`: checked and kept for `input_items`; it does not
/// change the prompt.
fn phase(obj: &Map<String, Value>, i: usize) -> Result<Option<&'static str>, ParamError> {
    match obj.get("phase") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(p)) if p == "commentary" => Ok(Some("commentary")),
        Some(Value::String(p)) if p == "final_answer" => Ok(Some("final_answer")),
        Some(other) => Err(bad("input", format!("input[{i}].phase must be \"commentary\" or \"final_answer\", got {other}"))),
    }
}

/// Appends input item `i` to `messages` (and, with an id, to `items`): a
/// message; a `function_call` an earlier response made (joining the
/// assistant message before it); a `function_call_output`, the call's
/// result, as a tool message; or a `compaction`, its summary as an
/// assistant message.
fn push_item(messages: &mut Vec<ChatMessage>, items: &mut Vec<Value>, v: &Value, i: usize) -> Result<(), ParamError> {
    let Some(obj) = v.as_object() else {
        return Err(bad("input", format!("input[{i}] must be an object (a message or a function call item)")));
    };
    let kind = obj.get("type").map(|t| t.as_str().unwrap_or("?")).unwrap_or("message");
    match kind {
        "message" => {
            only_fields(obj, &["type", "role", "content", "id", "status", "phase"], i)?;
            let role_name = string_field(obj, "role", i)?;
            let role = role(role_name, i)?;
            let own = if role == Role::Assistant { "output_text" } else { "input_text" };
            let (text, parts) = content(obj.get("content").ok_or_else(|| bad("input", format!("input[{i}]: `content` is required")))?, i, own)?;
            let mut item = json!({"id": item_id(obj, "msg_"), "type": "message", "role": role_name, "status": "completed", "content": parts});
            if let Some(p) = phase(obj, i)? {
                item["phase"] = json!(p);
            }
            items.push(item);
            messages.push(ChatMessage::new(role, text));
        }
        "function_call" => {
            only_fields(obj, &["type", "call_id", "name", "arguments", "id", "status", "phase"], i)?;
            phase(obj, i)?;
            let call = ToolCall {
                id: string_field(obj, "call_id", i)?.into(),
                name: string_field(obj, "name", i)?.into(),
                arguments: string_field(obj, "arguments", i)?.into(),
            };
            items.push(json!({"id": item_id(obj, "fc_"), "type": "function_call", "status": "completed",
                "call_id": call.id, "name": call.name, "arguments": call.arguments}));
            match messages.last_mut() {
                Some(m) if m.role == Role::Assistant => m.tool_calls.push(call),
                _ => {
                    let mut m = ChatMessage::new(Role::Assistant, "");
                    m.tool_calls.push(call);
                    messages.push(m);
                }
            }
        }
        "function_call_output" => {
            only_fields(obj, &["type", "call_id", "output", "id", "status"], i)?;
            let (output, _) = content(obj.get("output").ok_or_else(|| bad("input", format!("input[{i}]: `output` is required")))?, i, "input_text")?;
            let call_id = string_field(obj, "call_id", i)?;
            items.push(json!({"id": item_id(obj, "fco_"), "type": "function_call_output", "status": "completed",
                "call_id": call_id, "output": obj["output"]}));
            let mut m = ChatMessage::new(Role::Tool, output);
            m.tool_call_id = Some(call_id.into());
            messages.push(m);
        }
        "compaction" => {
            only_fields(obj, &["type", "encrypted_content", "id", "created_by"], i)?;
            let summary = super::compact::open(string_field(obj, "encrypted_content", i)?)
                .ok_or_else(|| bad("input", format!("input[{i}]: `encrypted_content` is not a compaction this server made")))?;
            items.push(json!({"id": item_id(obj, "cmp_"), "type": "compaction", "encrypted_content": obj["encrypted_content"]}));
            messages.push(ChatMessage::new(Role::Assistant, super::compact::recall(&summary)));
        }
        other => {
            return Err(bad(
                "input",
                format!("input[{i}]: items of type {other:?} are not supported (message, function_call, function_call_output and compaction)"),
            ))
        }
    }
    Ok(())
}

/// The `input` of a socket's `response.steer`: a string, or user messages
/// of `type`, `role` and `content` only (OpenAI's rule for steering). Its
/// messages and its items (with ids), as `response.create`'s input gives them.
pub fn steer_input(v: Option<&Value>) -> Result<(Vec<ChatMessage>, Vec<Value>), ParamError> {
    let (mut messages, mut items) = (Vec::new(), Vec::new());
    match v {
        Some(Value::String(t)) if !t.is_empty() => push_item(&mut messages, &mut items, &json!({"role": "user", "content": t}), 0)?,
        Some(Value::Array(list)) if !list.is_empty() => {
            for (i, item) in list.iter().enumerate() {
                let obj = item.as_object().ok_or_else(|| bad("input", format!("input[{i}] must be a user message")))?;
                let user = obj.get("role").and_then(Value::as_str) == Some("user") && obj.get("type").is_none_or(|t| t == "message");
                if !user {
                    return Err(bad("input", format!("input[{i}]: steering takes only messages with the user role")));
                }
                only_fields(obj, &["type", "role", "content"], i)?;
                push_item(&mut messages, &mut items, item, i)?;
            }
        }
        _ => return Err(bad("input", "input is required: a non-empty string or a non-empty list of user messages")),
    }
    Ok((messages, items))
}
