//! Drift checks between the Rust types, the committed JSON Schema and the README.
//!
//! Regenerate the schema with
//! `UPDATE_SCHEMA=1 cargo test -p tether-protocol --test schema`.

use std::path::PathBuf;

use protocol::{parse_client, ErrorCode, ServerMessage};
use serde_json::{json, Value};

fn crate_file(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
}

#[test]
fn schema_file_is_up_to_date() {
    let path = crate_file("schema/protocol.schema.json");
    let generated = serde_json::to_string_pretty(&protocol::json_schema()).unwrap() + "\n";
    if std::env::var_os("UPDATE_SCHEMA").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}; run with UPDATE_SCHEMA=1", path.display()));
    assert!(
        committed == generated,
        "{} is out of date with the protocol types; regenerate it with \
         `UPDATE_SCHEMA=1 cargo test -p tether-protocol --test schema` and review the diff",
        path.display()
    );
}

// ---------------------------------------------------------------------------
// A minimal JSON Schema validator for the keywords the generated schema uses
// (`pattern` and `format` are not checked), so the tests can confirm that
// frames the Rust side accepts or emits are valid per the schema, and that
// shape errors are schema errors too.

fn validate(root: &Value, schema: &Value, v: &Value, path: &str, errs: &mut Vec<String>) {
    let Some(s) = schema.as_object() else {
        if schema == &Value::Bool(false) {
            errs.push(format!("{path}: not allowed"));
        }
        return;
    };
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        let name = r.strip_prefix("#/$defs/").expect("local $ref");
        validate(root, &root["$defs"][name], v, path, errs);
    }
    if let Some(t) = s.get("type") {
        let types: Vec<&str> = match t {
            Value::String(t) => vec![t.as_str()],
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
            _ => panic!("bad type keyword"),
        };
        let ok = types.iter().any(|t| match *t {
            "object" => v.is_object(),
            "array" => v.is_array(),
            "string" => v.is_string(),
            "boolean" => v.is_boolean(),
            "null" => v.is_null(),
            "number" => v.is_number(),
            "integer" => v.is_i64() || v.is_u64(),
            other => panic!("unknown type {other}"),
        });
        if !ok {
            errs.push(format!("{path}: {v} is not of type {t}"));
            return;
        }
    }
    if let Some(c) = s.get("const") {
        if c != v {
            errs.push(format!("{path}: {v} != const {c}"));
        }
    }
    if let Some(Value::Array(e)) = s.get("enum") {
        if !e.contains(v) {
            errs.push(format!("{path}: {v} not in enum"));
        }
    }
    if let Some(n) = v.as_f64() {
        let num = |k: &str| s.get(k).and_then(Value::as_f64);
        if num("minimum").is_some_and(|m| n < m) || num("maximum").is_some_and(|m| n > m) || num("exclusiveMinimum").is_some_and(|m| n <= m) {
            errs.push(format!("{path}: {n} out of range"));
        }
    }
    if let Some(st) = v.as_str() {
        let len = st.chars().count() as u64;
        if s.get("minLength").and_then(Value::as_u64).is_some_and(|m| len < m) || s.get("maxLength").and_then(Value::as_u64).is_some_and(|m| len > m) {
            errs.push(format!("{path}: string length {len} out of range"));
        }
    }
    if let Some(items) = v.as_array() {
        let len = items.len() as u64;
        if s.get("minItems").and_then(Value::as_u64).is_some_and(|m| len < m) || s.get("maxItems").and_then(Value::as_u64).is_some_and(|m| len > m) {
            errs.push(format!("{path}: {len} items out of range"));
        }
        if let Some(item_schema) = s.get("items") {
            for (i, item) in items.iter().enumerate() {
                validate(root, item_schema, item, &format!("{path}[{i}]"), errs);
            }
        }
    }
    if let Some(obj) = v.as_object() {
        let props = s.get("properties").and_then(Value::as_object);
        if let Some(Value::Array(req)) = s.get("required") {
            for r in req {
                if !obj.contains_key(r.as_str().unwrap()) {
                    errs.push(format!("{path}: missing required {r}"));
                }
            }
        }
        if let Some(Value::Object(dep)) = s.get("dependentRequired") {
            for (k, needs) in dep {
                if obj.contains_key(k) {
                    for n in needs.as_array().unwrap() {
                        if !obj.contains_key(n.as_str().unwrap()) {
                            errs.push(format!("{path}: {k} requires {n}"));
                        }
                    }
                }
            }
        }
        for (k, val) in obj {
            match props.and_then(|p| p.get(k)) {
                Some(ps) => validate(root, ps, val, &format!("{path}.{k}"), errs),
                None => match s.get("additionalProperties") {
                    Some(Value::Bool(false)) => errs.push(format!("{path}: unknown property {k}")),
                    Some(ap @ Value::Object(_)) => validate(root, ap, val, &format!("{path}.{k}"), errs),
                    _ => {}
                },
            }
        }
    }
    let passes = |sub: &Value| {
        let mut e = Vec::new();
        validate(root, sub, v, path, &mut e);
        e.is_empty()
    };
    if let Some(Value::Array(alts)) = s.get("oneOf") {
        let n = alts.iter().filter(|a| passes(a)).count();
        if n != 1 {
            errs.push(format!("{path}: matches {n} of oneOf"));
        }
    }
    if let Some(Value::Array(alts)) = s.get("anyOf") {
        if !alts.iter().any(passes) {
            errs.push(format!("{path}: matches none of anyOf"));
        }
    }
}

fn schema_errors(def: &str, frame: &Value) -> Vec<String> {
    let root = protocol::json_schema();
    let mut errs = Vec::new();
    validate(&root, &json!({"$ref": format!("#/$defs/{def}")}), frame, "$", &mut errs);
    errs
}

/// A client frame must be accepted by `parse_client` and by the schema.
fn check_client_frame(text: &str) {
    parse_client(text).unwrap_or_else(|e| panic!("rejected by parse_client: {text}\n{e}"));
    let errs = schema_errors("ClientMessage", &serde_json::from_str(text).unwrap());
    assert!(errs.is_empty(), "rejected by the schema: {text}\n{errs:?}");
}

/// A server frame must parse as a `ServerMessage`, re-serialize to the same
/// JSON, and be valid per the schema.
fn check_server_frame(text: &str) {
    let msg = ServerMessage::from_json(text).unwrap_or_else(|e| panic!("not a server message: {text}\n{e}"));
    let value: Value = serde_json::from_str(text).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&msg.to_json()).unwrap(), value, "re-serialized differently: {text}");
    let errs = schema_errors("ServerMessage", &value);
    assert!(errs.is_empty(), "rejected by the schema: {text}\n{errs:?}");
}

#[test]
fn schema_accepts_valid_client_frames() {
    for frame in [
        r#"{"type":"session.open"}"#,
        r#"{"type":"session.open","session_id":"s","resume_token":"t","last_seq":{"a":1}}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x"}"#,
        r#"{"type":"generate","request_id":"r1","messages":[{"role":"tool","content":"x"}],"top_k":0,"top_p":1,"min_p":0,"temperature":2}"#,
        r#"{"type":"generate","request_id":"r1","fim":{"prefix":"a","suffix":"b","extra":[{"content":"c"}]},"logprobs":true,"top_logprobs":20,"stop":["a","b","c","d","e","f","g","h"]}"#,
        r#"{"type":"cancel","request_id":"r1"}"#,
        r#"{"type":"session.close"}"#,
        r#"{"type":"ping","id":1.5}"#,
        r#"{"type":"ping","id":"x"}"#,
    ] {
        check_client_frame(frame);
    }
}

#[test]
fn schema_rejects_shape_and_range_errors() {
    // Each is rejected by parse_client, and must be rejected by the schema.
    for frame in [
        r#"{"type":"generate","request_id":"r1","prompt":"x","foo":1}"#,
        r#"{"type":"generate","request_id":"r1"}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x","messages":[{"role":"user","content":"y"}]}"#,
        r#"{"type":"generate","request_id":"r1","prompt":null}"#,
        r#"{"type":"generate","prompt":"x"}"#,
        r#"{"type":"generate","request_id":"","prompt":"x"}"#,
        r#"{"type":"generate","request_id":"r1","messages":[]}"#,
        r#"{"type":"generate","request_id":"r1","messages":[{"role":"robot","content":"x"}]}"#,
        r#"{"type":"generate","request_id":"r1","fim":{"prefix":"a"}}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x","max_tokens":-1}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x","speculation":{"max_draft":0}}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x","max_tokens":"5"}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x","temperature":3}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x","top_p":0}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x","top_k":5000}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x","min_p":-1}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x","stop":["a","b","c","d","e","f","g","h","i"]}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x","stop":[""]}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x","top_logprobs":21,"logprobs":true}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"x","max_time_ms":0}"#,
        r#"{"type":"session.open","resume_token":"t"}"#,
        r#"{"type":"session.open","session_id":"s"}"#,
        r#"{"type":"session.open","last_seq":{"a":1}}"#,
        r#"{"type":"cancel"}"#,
        r#"{"type":"session.close","x":1}"#,
        r#"{"type":"ping","id":{}}"#,
        r#"{"type":"ping","id":null}"#,
        r#"{"type":"nope"}"#,
        r#"{"request_id":"r1"}"#,
    ] {
        assert!(parse_client(frame).is_err(), "parse_client accepted {frame}");
        let errs = schema_errors("ClientMessage", &serde_json::from_str(frame).unwrap());
        assert!(!errs.is_empty(), "schema accepted {frame}");
    }
}

// ---------------------------------------------------------------------------
// README

fn readme() -> String {
    std::fs::read_to_string(crate_file("README.md")).unwrap()
}

/// Contents of the fenced code blocks with the given info string.
fn code_blocks(md: &str, lang: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in md.lines() {
        match &mut current {
            None if line.trim_start() == format!("```{lang}") => current = Some(String::new()),
            Some(block) if line.trim_start() == "```" => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            Some(block) => {
                block.push_str(line);
                block.push('\n');
            }
            None => {}
        }
    }
    blocks
}

#[test]
fn readme_json_examples_are_valid_frames() {
    let blocks = code_blocks(&readme(), "json");
    assert!(blocks.len() >= 10, "found only {} json examples", blocks.len());
    let (mut client, mut server) = (0, 0);
    for block in &blocks {
        let v: Value = serde_json::from_str(block).unwrap_or_else(|e| panic!("README example is not JSON: {e}\n{block}"));
        let ty = v["type"].as_str().expect("example has a type");
        if protocol::CLIENT_MESSAGE_TYPES.contains(&ty) {
            check_client_frame(block);
            client += 1;
        } else {
            check_server_frame(block);
            server += 1;
        }
    }
    // Every message type has at least one example.
    let mut seen: Vec<String> = blocks.iter().map(|b| serde_json::from_str::<Value>(b).unwrap()["type"].to_string()).collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 10, "types with examples: {seen:?}");
    assert!(client >= 5 && server >= 5);
}

#[test]
fn readme_example_exchange_is_valid() {
    let blocks = code_blocks(&readme(), "text");
    let exchange = blocks.iter().find(|b| b.contains("→ {")).expect("example exchange");
    let frames: Vec<(bool, &str)> = exchange
        .lines()
        .filter_map(|l| match (l.strip_prefix("→ "), l.strip_prefix("← ")) {
            (Some(f), _) => Some((true, f)),
            (_, Some(f)) => Some((false, f)),
            _ => None,
        })
        .collect();
    let n = frames.len();
    for (i, (from_client, frame)) in frames.iter().enumerate() {
        if !from_client {
            check_server_frame(frame);
            continue;
        }
        // A client frame answered by a parse-level error must be rejected by
        // parse_client with exactly that error frame; otherwise it is valid.
        let reply = frames.get(i + 1).filter(|(c, _)| !c).map(|(_, f)| ServerMessage::from_json(f).unwrap());
        match reply {
            Some(ServerMessage::Error(e))
                if matches!(e.code, ErrorCode::BadJson | ErrorCode::UnknownType | ErrorCode::InvalidField | ErrorCode::InvalidParameter) =>
            {
                let got = parse_client(frame).expect_err(frame).to_message();
                assert_eq!(got, ServerMessage::Error(e), "README shows a different error for {frame}");
            }
            _ => check_client_frame(frame),
        }
    }
    assert!(n >= 10, "only {n} frames in the exchange");
}

#[test]
fn readme_documents_every_error_code() {
    let md = readme();
    for code in ErrorCode::ALL {
        let row = md.lines().find(|l| l.starts_with(&format!("| `{}` |", code.as_str()))).unwrap_or_else(|| panic!("README error table lacks {code}"));
        let fatal_cell = row.trim_end_matches('|').rsplit('|').next().unwrap().trim();
        let expected = match code.close_code() {
            Some(c) => format!("yes ({c})"),
            None => "no".to_string(),
        };
        assert_eq!(fatal_cell, expected, "fatal column for {code}");
    }
}
