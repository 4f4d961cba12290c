//! [`parse_client`]: text frame → [`ClientMessage`], with precise error codes.

use std::fmt;

use serde::de::{DeserializeOwned, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::client::{Cancel, ClientMessage, GenerateRequest, Ping, SessionClose, SessionOpen, CLIENT_MESSAGE_TYPES};
use crate::error::{ErrorCode, ProtocolError};

/// Parses and validates one client text frame.
///
/// Failures are classified in this order:
/// 1. not JSON (syntax error, truncated, trailing data) → `bad_json`;
///    a duplicated object key → `invalid_field`;
/// 2. not an object, no `type`, non-string or unknown `type` → `unknown_type`
///    (the message lists the valid types);
/// 3. wrong field types (including `null`: omit optional fields instead),
///    unknown / missing fields, `prompt`/`messages`/`fim`
///    not exactly one, `resume_token` without `session_id` → `invalid_field`,
///    with serde's message prefixed by the field's path;
/// 4. values out of range or badly formatted → `invalid_parameter`, naming
///    the field and the allowed range.
///
/// For `generate` and `cancel`, the error carries the frame's `request_id`
/// whenever that field is present and well-formed, whatever else is wrong.
pub fn parse_client(text: &str) -> Result<ClientMessage, ProtocolError> {
    let value = parse_json_strict(text)?;
    let mut obj = match value {
        Value::Object(obj) => obj,
        other => return Err(unknown_type(format!("a message must be a JSON object with a `type` field, got {}", json_kind(&other)))),
    };
    let ty = match obj.shift_remove("type") {
        None => return Err(unknown_type("missing field `type`".to_string())),
        Some(Value::String(s)) => s,
        Some(other) => return Err(unknown_type(format!("`type` must be a string, got {}", json_kind(&other)))),
    };
    let request_id = match ty.as_str() {
        "generate" | "cancel" => obj.get("request_id").and_then(Value::as_str).filter(|id| crate::client::is_valid_request_id(id)).map(str::to_owned),
        _ => None,
    };
    if let Some(path) = find_null(&obj) {
        return Err(ProtocolError::invalid_field(format!("`{path}`: null is not allowed; omit optional fields instead")).or_request_id(request_id.as_deref()));
    }
    let msg = match ty.as_str() {
        "session.open" => fields::<SessionOpen>(obj).map(ClientMessage::SessionOpen),
        "generate" => fields::<GenerateRequest>(obj).map(ClientMessage::Generate),
        "cancel" => fields::<Cancel>(obj).map(ClientMessage::Cancel),
        "session.close" => fields::<SessionClose>(obj).map(ClientMessage::SessionClose),
        "ping" => fields::<Ping>(obj).map(ClientMessage::Ping),
        _ => {
            let shown: String = if ty.chars().count() > 64 { ty.chars().take(64).chain("…".chars()).collect() } else { ty.clone() };
            return Err(unknown_type(format!("unknown message type {shown:?}")));
        }
    };
    let msg = msg.map_err(|e| e.or_request_id(request_id.as_deref()))?;
    msg.validate().map_err(|e| e.or_request_id(request_id.as_deref()))?;
    Ok(msg)
}

fn unknown_type(what: String) -> ProtocolError {
    ProtocolError::new(ErrorCode::UnknownType, format!("{what}; expected one of: {}", CLIENT_MESSAGE_TYPES.join(", ")))
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Path of the first `null` anywhere in the message body. No protocol field
/// accepts null: optional fields are omitted instead.
fn find_null(obj: &Map<String, Value>) -> Option<String> {
    fn walk(v: &Value, path: &mut String) -> bool {
        match v {
            Value::Null => true,
            Value::Array(items) => items.iter().enumerate().any(|(i, item)| {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                let found = walk(item, path);
                if !found {
                    path.truncate(len);
                }
                found
            }),
            Value::Object(map) => map.iter().any(|(k, item)| {
                let len = path.len();
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(k);
                let found = walk(item, path);
                if !found {
                    path.truncate(len);
                }
                found
            }),
            _ => false,
        }
    }
    let mut path = String::new();
    obj.iter()
        .any(|(k, v)| {
            path.clear();
            path.push_str(k);
            walk(v, &mut path)
        })
        .then_some(path)
}

/// Deserializes a message body (the object minus `type`), mapping serde's
/// errors to `invalid_field` with the path of the offending field.
fn fields<T: DeserializeOwned>(obj: Map<String, Value>) -> Result<T, ProtocolError> {
    serde_path_to_error::deserialize(Value::Object(obj)).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        // serde names the field itself in "missing field `x`" / "unknown
        // field `x`"; for type and value errors the path is the field name.
        let path = if inner.starts_with("unknown field") {
            // The path ends with the unknown key itself, which serde's
            // message already names: keep only the enclosing object's path.
            match path.rfind('.') {
                Some(dot) => path[..dot].to_string(),
                None => String::new(),
            }
        } else {
            path
        };
        if path == "." || path.is_empty() {
            ProtocolError::invalid_field(inner)
        } else {
            ProtocolError::invalid_field(format!("`{path}`: {inner}"))
        }
    })
}

/// Parses JSON into a `Value`, rejecting duplicate object keys (which would
/// otherwise silently keep the last value): `invalid_field` for a duplicate,
/// `bad_json` for text that is not JSON. Every edge's bodies go through it.
pub fn parse_json_strict(text: &str) -> Result<Value, ProtocolError> {
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = StrictValue::deserialize(&mut de).and_then(|v| de.end().map(|()| v.0));
    parsed.map_err(|e| match e.classify() {
        serde_json::error::Category::Data => ProtocolError::invalid_field(e.to_string()),
        _ => ProtocolError::new(ErrorCode::BadJson, format!("invalid JSON: {e}")),
    })
}

struct StrictValue(Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        serde_json::Number::from_f64(v).map(Value::Number).ok_or_else(|| E::custom("non-finite number"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(A::Error::custom(format_args!("duplicate field `{key}`")));
            }
            let StrictValue(v) = map.next_value()?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}
