//! JSON Schema (draft 2020-12) of the whole protocol.

use serde_json::{json, Value};

use crate::{ClientMessage, ServerMessage, PROTOCOL_VERSION};

/// The JSON Schema of protocol v1, as committed in `schema/protocol.schema.json`.
///
/// `$defs/ClientMessage` describes every frame a client may send and
/// `$defs/ServerMessage` every frame the server sends; the root accepts either.
/// The schema captures types, required/unknown fields and ranges; the few
/// rules it cannot express (e.g. `top_logprobs` requires `logprobs: true`,
/// `stop` entries are limited in UTF-8 bytes, not characters) are enforced by
/// the server and documented in the README.
pub fn json_schema() -> Value {
    let mut generator = schemars::generate::SchemaSettings::draft2020_12().into_generator();
    let client = generator.subschema_for::<ClientMessage>();
    let server = generator.subschema_for::<ServerMessage>();
    let mut defs = Value::Object(generator.take_definitions(true));
    let (mut client, mut server) = (client.to_value(), server.to_value());
    for v in [&mut defs, &mut client, &mut server] {
        strip_null(v);
    }
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": format!("Tether protocol v{PROTOCOL_VERSION}"),
        "description": "WebSocket JSON text frames of the Tether inference server. Each frame is one object with a `type` field.",
        "x-protocol-version": PROTOCOL_VERSION,
        "anyOf": [client, server],
        "$defs": defs,
    })
}

/// No protocol field accepts or carries `null` (optional fields are omitted,
/// and `parse_client` rejects null), so remove the `null` alternatives that
/// schemars adds for `Option<T>`.
fn strip_null(v: &mut Value) {
    match v {
        Value::Object(map) => {
            if let Some(Value::Array(types)) = map.get_mut("type") {
                types.retain(|t| t != "null");
                if types.len() == 1 {
                    let only = types.pop().unwrap();
                    map.insert("type".into(), only);
                }
            }
            if let Some(Value::Array(alts)) = map.get_mut("anyOf") {
                alts.retain(|a| a != &json!({"type": "null"}));
                if alts.len() == 1 {
                    let Some(Value::Object(only)) = alts.pop() else { unreachable!("schema alternatives are objects") };
                    map.remove("anyOf");
                    for (k, val) in only {
                        map.entry(k).or_insert(val);
                    }
                }
            }
            map.values_mut().for_each(strip_null);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_null),
        _ => {}
    }
}
