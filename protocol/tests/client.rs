//! `parse_client`: classification of bad frames, acceptance of good ones,
//! and the limit checks.

use protocol::{
    parse_client, ChatMessage, ClientMessage, ErrorCode, FimExtra, FimInput, GenerateInput, GenerateRequest, Limits, PingId, ProtocolError, Role, SessionOpen,
};
use serde_json::json;

use ErrorCode::*;

/// (name, frame, expected code, substrings the message must contain,
/// expected request_id on the error)
type Case = (&'static str, String, ErrorCode, &'static [&'static str], Option<&'static str>);

/// A valid `generate` with request_id "r1", with `extra` merged in (a `null`
/// in `extra` removes the key instead).
fn gen(extra: serde_json::Value) -> String {
    let mut base = json!({"type": "generate", "request_id": "r1", "prompt": "Hello"});
    let obj = base.as_object_mut().unwrap();
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            obj.remove(k);
        } else {
            obj.insert(k.clone(), v.clone());
        }
    }
    base.to_string()
}

fn s(x: &str) -> String {
    x.to_string()
}

#[rustfmt::skip]
fn bad_cases() -> Vec<Case> {
    let long_id = "a".repeat(65);
    let huge_id = "x".repeat(10_000);
    vec![
        // --- not JSON -------------------------------------------------------
        ("empty frame", s(""), BadJson, &["invalid JSON", "EOF"], None),
        ("whitespace only", s("   \n"), BadJson, &["invalid JSON"], None),
        ("plain text", s("hello"), BadJson, &["invalid JSON"], None),
        ("truncated object", s(r#"{"type":"generate","request_id":"r1","prompt":"hi""#), BadJson, &["EOF"], None),
        ("truncated string", s(r#"{"type":"ping","id":"ab"#), BadJson, &["EOF"], None),
        ("single quotes", s("{'type':'ping'}"), BadJson, &["invalid JSON"], None),
        ("trailing comma", s(r#"{"type":"ping",}"#), BadJson, &["invalid JSON"], None),
        ("trailing garbage", s(r#"{"type":"ping"} {"type":"ping"}"#), BadJson, &["trailing characters"], None),
        ("number out of range", s(r#"{"type":"ping","id":1e999}"#), BadJson, &["number out of range"], None),
        ("NaN literal", gen(json!({})).replace("\"Hello\"", "NaN"), BadJson, &["invalid JSON"], None),
        ("too deeply nested", format!("{}{}", "[".repeat(200), "]".repeat(200)), BadJson, &["recursion limit"], None),
        // --- not a message object -------------------------------------------
        ("array instead of object", s(r#"[{"type":"ping"}]"#), UnknownType, &["an array", "session.open, generate, cancel, session.close, ping"], None),
        ("string instead of object", s(r#""ping""#), UnknownType, &["a string", "expected one of"], None),
        ("number instead of object", s("42"), UnknownType, &["a number"], None),
        ("null instead of object", s("null"), UnknownType, &["null"], None),
        ("missing type", s(r#"{"request_id":"r1","prompt":"x"}"#), UnknownType, &["missing field `type`", "generate"], None),
        ("unknown type", s(r#"{"type":"generat","request_id":"r1"}"#), UnknownType, &["unknown message type \"generat\"", "expected one of: session.open, generate"], None),
        ("server type sent by client", s(r#"{"type":"delta"}"#), UnknownType, &["\"delta\""], None),
        ("type in wrong case", s(r#"{"type":"Generate"}"#), UnknownType, &["\"Generate\""], None),
        ("type is a number", s(r#"{"type":1}"#), UnknownType, &["`type` must be a string, got a number"], None),
        ("type is null", s(r#"{"type":null}"#), UnknownType, &["`type` must be a string, got null"], None),
        ("huge unknown type is truncated", format!(r#"{{"type":"{huge_id}"}}"#), UnknownType, &["unknown message type", "…"], None),
        // --- shape errors: generate ----------------------------------------
        ("duplicate key", s(r#"{"type":"ping","id":1,"id":2}"#), InvalidField, &["duplicate field `id`"], None),
        ("unknown field", gen(json!({"foo": 1})), InvalidField, &["unknown field `foo`", "expected one of `request_id`"], Some("r1")),
        ("OpenAI-style field name", gen(json!({"max_completion_tokens": 5})), InvalidField, &["unknown field `max_completion_tokens`"], Some("r1")),
        ("missing request_id", gen(json!({"request_id": null})), InvalidField, &["missing field `request_id`"], None),
        ("request_id is a number", gen(json!({"request_id": 7})), InvalidField, &["`request_id`", "expected a string"], None),
        ("prompt is a number", gen(json!({"prompt": 5})), InvalidField, &["`prompt`", "expected a string"], Some("r1")),
        ("prompt is null", gen(json!({})).replace("\"Hello\"", "null"), InvalidField, &["`prompt`", "null is not allowed"], Some("r1")),
        ("prompt and messages both present", gen(json!({"messages": [{"role": "user", "content": "hi"}]})), InvalidField, &["exactly one of `prompt`, `messages` or `fim`", "got `prompt` and `messages`"], Some("r1")),
        ("prompt and fim both present", gen(json!({"fim": {"prefix": "a", "suffix": "b"}})), InvalidField, &["exactly one of", "got `prompt` and `fim`"], Some("r1")),
        ("no input at all", gen(json!({"prompt": null})), InvalidField, &["exactly one of `prompt`, `messages` or `fim` is required, got none"], Some("r1")),
        ("messages is a string", gen(json!({"prompt": null, "messages": "hi"})), InvalidField, &["`messages`", "expected a sequence"], Some("r1")),
        ("bad role", gen(json!({"prompt": null, "messages": [{"role": "robot", "content": "x"}]})), InvalidField, &["`messages[0].role`", "unknown variant `robot`", "`system`, `user`, `assistant`, `tool`"], Some("r1")),
        ("message missing content", gen(json!({"prompt": null, "messages": [{"role": "user"}]})), InvalidField, &["`messages[0]`", "missing field `content`"], Some("r1")),
        ("message unknown field", gen(json!({"prompt": null, "messages": [{"role": "user", "content": "x", "name": "bob"}]})), InvalidField, &["`messages[0]`", "unknown field `name`"], Some("r1")),
        ("message content null", gen(json!({"prompt": null})).replace("}", r#","messages":[{"role":"user","content":null}]}"#), InvalidField, &["`messages[0].content`", "null is not allowed"], Some("r1")),
        ("fim missing suffix", gen(json!({"prompt": null, "fim": {"prefix": "a"}})), InvalidField, &["`fim`", "missing field `suffix`"], Some("r1")),
        ("fim is a string", gen(json!({"prompt": null, "fim": "a<FILL>b"})), InvalidField, &["`fim`", "invalid type"], Some("r1")),
        ("fim extra missing content", gen(json!({"prompt": null, "fim": {"prefix": "a", "suffix": "b", "extra": [{"path": "x.rs"}]}})), InvalidField, &["`fim.extra[0]`", "missing field `content`"], Some("r1")),
        ("fim extra unknown field", gen(json!({"prompt": null, "fim": {"prefix": "a", "suffix": "b", "extra": [{"lang": "rs", "content": "c"}]}})), InvalidField, &["`fim.extra[0]`", "unknown field `lang`"], Some("r1")),
        ("max_tokens negative", gen(json!({"max_tokens": -5})), InvalidField, &["`max_tokens`", "expected u32"], Some("r1")),
        ("max_tokens as string", gen(json!({"max_tokens": "256"})), InvalidField, &["`max_tokens`", "invalid type: string"], Some("r1")),
        ("max_tokens fractional", gen(json!({"max_tokens": 1.5})), InvalidField, &["`max_tokens`", "invalid type: floating point"], Some("r1")),
        ("max_tokens above u32", gen(json!({"max_tokens": 4_294_967_296u64})), InvalidField, &["`max_tokens`", "expected u32"], Some("r1")),
        ("temperature NaN via string", gen(json!({"temperature": "NaN"})), InvalidField, &["`temperature`", "invalid type: string \"NaN\""], Some("r1")),
        ("temperature bool", gen(json!({"temperature": true})), InvalidField, &["`temperature`"], Some("r1")),
        ("top_k negative", gen(json!({"top_k": -1})), InvalidField, &["`top_k`"], Some("r1")),
        ("seed negative", gen(json!({"seed": -1})), InvalidField, &["`seed`", "expected u64"], Some("r1")),
        ("seed as string", gen(json!({"seed": "42"})), InvalidField, &["`seed`"], Some("r1")),
        ("stop is a string", gen(json!({"stop": "\n"})), InvalidField, &["`stop`", "expected a sequence"], Some("r1")),
        ("stop entry is a number", gen(json!({"stop": ["a", 3]})), InvalidField, &["`stop[1]`", "expected a string"], Some("r1")),
        ("logprobs as string", gen(json!({"logprobs": "yes"})), InvalidField, &["`logprobs`", "expected a boolean"], Some("r1")),
        ("top_logprobs above u8", gen(json!({"logprobs": true, "top_logprobs": 300})), InvalidField, &["`top_logprobs`", "300"], Some("r1")),
        ("max_time_ms negative", gen(json!({"max_time_ms": -1})), InvalidField, &["`max_time_ms`"], Some("r1")),
        ("chunk_size as string", gen(json!({"chunk_size": "big"})), InvalidField, &["`chunk_size`"], Some("r1")),
        // --- range / format errors: generate --------------------------------
        ("request_id empty", gen(json!({"request_id": ""})), InvalidParameter, &["request_id must be 1 to 64 characters", "empty"], None),
        ("request_id too long", gen(json!({"request_id": long_id})), InvalidParameter, &["request_id must be 1 to 64 characters", "got 65 characters"], None),
        ("request_id with space", gen(json!({"request_id": "a b"})), InvalidParameter, &["request_id", "[A-Za-z0-9._:-]", "invalid character ' '"], None),
        ("request_id with slash", gen(json!({"request_id": "a/b"})), InvalidParameter, &["invalid character '/'"], None),
        ("request_id non-ASCII", gen(json!({"request_id": "réq"})), InvalidParameter, &["invalid character 'é'"], None),
        ("empty messages", gen(json!({"prompt": null, "messages": []})), InvalidParameter, &["messages must contain at least 1 message"], Some("r1")),
        ("speculation max_draft 0", gen(json!({"speculation": {"max_draft": 0}})), InvalidParameter, &["speculation.max_draft must be in [1, 32], got 0"], Some("r1")),
        ("speculation max_draft 33", gen(json!({"speculation": {"max_draft": 33}})), InvalidParameter, &["speculation.max_draft must be in [1, 32], got 33"], Some("r1")),
        ("speculation unknown source", gen(json!({"speculation": {"source": "medusa"}})), InvalidField, &["`speculation.source`", "unknown variant `medusa`", "expected one of `off`, `echo`, `draft_model`"], Some("r1")),
        ("cache unknown scope", gen(json!({"cache": "global"})), InvalidField, &["`cache`", "unknown variant `global`", "expected `session` or `shared`"], Some("r1")),
        ("speculation unknown field", gen(json!({"speculation": {"depth": 3}})), InvalidField, &["`speculation`", "unknown field `depth`"], Some("r1")),
        ("temperature -1", gen(json!({"temperature": -1})), InvalidParameter, &["temperature must be in [0, 2], got -1"], Some("r1")),
        ("temperature 3", gen(json!({"temperature": 3})), InvalidParameter, &["temperature must be in [0, 2], got 3"], Some("r1")),
        ("temperature overflowing f32", gen(json!({"temperature": 1e300})), InvalidParameter, &["temperature must be in [0, 2], got inf"], Some("r1")),
        ("top_p 0", gen(json!({"top_p": 0})), InvalidParameter, &["top_p must be in (0, 1], got 0"], Some("r1")),
        ("top_p 1.5", gen(json!({"top_p": 1.5})), InvalidParameter, &["top_p must be in (0, 1], got 1.5"], Some("r1")),
        ("top_p negative", gen(json!({"top_p": -0.5})), InvalidParameter, &["top_p must be in (0, 1]"], Some("r1")),
        ("top_k 5000", gen(json!({"top_k": 5000})), InvalidParameter, &["top_k must be in [0, 1000]", "got 5000"], Some("r1")),
        ("min_p 1.5", gen(json!({"min_p": 1.5})), InvalidParameter, &["min_p must be in [0, 1], got 1.5"], Some("r1")),
        ("min_p negative", gen(json!({"min_p": -0.1})), InvalidParameter, &["min_p must be in [0, 1], got -0.1"], Some("r1")),
        ("stop with 9 entries", gen(json!({"stop": ["a","b","c","d","e","f","g","h","i"]})), InvalidParameter, &["stop must have at most 8 entries, got 9"], Some("r1")),
        ("empty stop string", gen(json!({"stop": ["a", ""]})), InvalidParameter, &["stop[1] must be 1 to 64 bytes long, got 0 bytes"], Some("r1")),
        ("stop string of 65 bytes", gen(json!({"stop": ["x".repeat(65)]})), InvalidParameter, &["stop[0] must be 1 to 64 bytes long, got 65 bytes"], Some("r1")),
        ("stop string of 66 bytes in 22 chars", gen(json!({"stop": ["€".repeat(22)]})), InvalidParameter, &["stop[0]", "got 66 bytes"], Some("r1")),
        ("top_logprobs without logprobs", gen(json!({"top_logprobs": 5})), InvalidParameter, &["top_logprobs requires logprobs: true"], Some("r1")),
        ("top_logprobs with logprobs false", gen(json!({"logprobs": false, "top_logprobs": 5})), InvalidParameter, &["top_logprobs requires logprobs: true"], Some("r1")),
        ("top_logprobs 0 without logprobs", gen(json!({"top_logprobs": 0})), InvalidParameter, &["top_logprobs requires logprobs: true"], Some("r1")),
        ("top_logprobs 21", gen(json!({"logprobs": true, "top_logprobs": 21})), InvalidParameter, &["top_logprobs must be in [0, 20], got 21"], Some("r1")),
        ("max_time_ms 0", gen(json!({"max_time_ms": 0})), InvalidParameter, &["max_time_ms must be at least 1, got 0"], Some("r1")),
        ("chunk_size 0", gen(json!({"chunk_size": 0})), InvalidParameter, &["chunk_size must be at least 1, got 0"], Some("r1")),
        // --- session.open ----------------------------------------------------
        ("session.open token but no id", s(r#"{"type":"session.open","resume_token":"tok"}"#), InvalidField, &["missing field `session_id`", "resume_token"], None),
        ("session.open id but no token", s(r#"{"type":"session.open","session_id":"s1"}"#), InvalidField, &["missing field `resume_token`"], None),
        ("session.open last_seq without session", s(r#"{"type":"session.open","last_seq":{"r1":3}}"#), InvalidField, &["`last_seq` is only valid when resuming"], None),
        ("session.open session_id number", s(r#"{"type":"session.open","session_id":1,"resume_token":"t"}"#), InvalidField, &["`session_id`", "expected a string"], None),
        ("session.open last_seq as array", s(r#"{"type":"session.open","session_id":"s","resume_token":"t","last_seq":[1]}"#), InvalidField, &["`last_seq`", "expected a map"], None),
        ("session.open negative last_seq", s(r#"{"type":"session.open","session_id":"s","resume_token":"t","last_seq":{"r1":-1}}"#), InvalidField, &["`last_seq.r1`", "expected u64"], None),
        ("session.open unknown field", s(r#"{"type":"session.open","token":"t"}"#), InvalidField, &["unknown field `token`", "`session_id`, `resume_token`, `last_seq`"], None),
        ("session.open empty session_id", s(r#"{"type":"session.open","session_id":"","resume_token":"t"}"#), InvalidParameter, &["session_id must be 1 to 128", "got an empty string"], None),
        ("session.open resume_token with spaces", s(r#"{"type":"session.open","session_id":"s","resume_token":"a b"}"#), InvalidParameter, &["resume_token must be 1 to 128 printable ASCII", "invalid character ' '"], None),
        ("session.open bad last_seq key", s(r#"{"type":"session.open","session_id":"s","resume_token":"t","last_seq":{"bad id":1}}"#), InvalidParameter, &["last_seq keys must be request ids", "invalid character ' '"], None),
        // --- cancel, session.close, ping -------------------------------------
        ("cancel without request_id", s(r#"{"type":"cancel"}"#), InvalidField, &["missing field `request_id`"], None),
        ("cancel request_id number", s(r#"{"type":"cancel","request_id":5}"#), InvalidField, &["`request_id`", "expected a string"], None),
        ("cancel unknown field keeps request_id", s(r#"{"type":"cancel","request_id":"r9","reason":"x"}"#), InvalidField, &["unknown field `reason`"], Some("r9")),
        ("cancel bad request_id", s(r#"{"type":"cancel","request_id":"r 9"}"#), InvalidParameter, &["request_id must be 1 to 64 characters", "' '"], None),
        ("session.close with a field", s(r#"{"type":"session.close","force":true}"#), InvalidField, &["unknown field `force`"], None),
        ("ping id object", s(r#"{"type":"ping","id":{}}"#), InvalidField, &["`id`", "expected a string or number"], None),
        ("ping id bool", s(r#"{"type":"ping","id":true}"#), InvalidField, &["`id`", "expected a string or number"], None),
        ("ping id array", s(r#"{"type":"ping","id":[1]}"#), InvalidField, &["`id`", "expected a string or number"], None),
        ("ping id null", s(r#"{"type":"ping","id":null}"#), InvalidField, &["`id`", "null is not allowed"], None),
        ("ping unknown field", s(r#"{"type":"ping","nonce":1}"#), InvalidField, &["unknown field `nonce`", "expected `id`"], None),
        // --- request_id is echoed only when well-formed ---------------------
        ("huge request_id is not echoed", gen(json!({"request_id": huge_id, "top_p": 0})), InvalidParameter, &["request_id must be 1 to 64 characters"], None),
        ("valid request_id echoed with type error", s(r#"{"type":"generate","request_id":"a.b_c:d-E9","prompt":["x"]}"#), InvalidField, &["`prompt`"], Some("a.b_c:d-E9")),
    ]
}

#[test]
fn bad_inputs_are_classified() {
    let cases = bad_cases();
    assert!(cases.len() >= 40, "only {} cases", cases.len());
    let mut failures = Vec::new();
    for (name, frame, code, needles, request_id) in &cases {
        match parse_client(frame) {
            Ok(msg) => failures.push(format!("{name}: accepted as {msg:?}")),
            Err(e) => {
                if e.code != *code {
                    failures.push(format!("{name}: code {:?}, expected {code:?} (message: {})", e.code, e.message));
                }
                for needle in needles.iter() {
                    if !e.message.contains(needle) {
                        failures.push(format!("{name}: message {:?} lacks {needle:?}", e.message));
                    }
                }
                if e.request_id.as_deref() != *request_id {
                    failures.push(format!("{name}: request_id {:?}, expected {request_id:?}", e.request_id));
                }
                // Only transport-level failures close the socket.
                assert!(!e.is_fatal(), "{name}: parse errors are never fatal");
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), cases.len(), failures.join("\n"));
    println!("{} bad-input cases", cases.len());
}

#[test]
fn bad_input_names_are_unique() {
    let cases = bad_cases();
    let mut names: Vec<_> = cases.iter().map(|c| c.0).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), cases.len());
}

#[test]
fn error_frame_for_a_bad_generate_carries_request_id() {
    let err = parse_client(&gen(json!({"top_p": 0}))).unwrap_err();
    let frame = err.to_message().to_json();
    assert_eq!(frame, r#"{"type":"error","request_id":"r1","code":"invalid_parameter","message":"top_p must be in (0, 1], got 0"}"#);
    let err = parse_client("nope").unwrap_err();
    let v: serde_json::Value = serde_json::from_str(&protocol::ServerMessage::from(err).to_json()).unwrap();
    assert_eq!(v["code"], "bad_json");
    assert!(v.get("request_id").is_none(), "absent request_id is omitted, not null");
}

// ---------------------------------------------------------------------------
// valid frames

fn ok(frame: &str) -> ClientMessage {
    parse_client(frame).unwrap_or_else(|e| panic!("{frame} rejected: {e}"))
}

fn ok_gen(extra: serde_json::Value) -> GenerateRequest {
    match ok(&gen(extra)) {
        ClientMessage::Generate(g) => g,
        other => panic!("not a generate: {other:?}"),
    }
}

#[test]
fn minimal_generate_gets_defaults() {
    let g = ok_gen(json!({}));
    assert_eq!(g, GenerateRequest::new("r1", GenerateInput::Prompt("Hello".into())));
    assert_eq!(g.max_tokens, 256);
    assert_eq!(g.temperature, 0.0);
    assert!(g.is_greedy());
    assert!(!g.logprobs);
    assert!(g.stop.is_empty());
    assert_eq!((g.top_p, g.top_k, g.min_p, g.seed, g.top_logprobs), (None, None, None, None, None));
}

#[test]
fn full_generate_is_accepted() {
    let g = ok_gen(json!({
        "request_id": "a.b_c:d-E9",
        "max_tokens": 1, "temperature": 2, "top_p": 1, "top_k": 1000, "min_p": 0,
        "seed": u64::MAX, "stop": ["a","b","c","d","e","f","g", "x".repeat(64)],
        "logprobs": true, "top_logprobs": 20, "max_time_ms": 1, "chunk_size": 512,
    }));
    assert_eq!(g.request_id, "a.b_c:d-E9");
    assert_eq!(g.max_tokens, 1);
    assert_eq!(g.temperature, 2.0);
    assert_eq!(g.top_p, Some(1.0));
    assert_eq!(g.top_k, Some(1000));
    assert_eq!(g.min_p, Some(0.0));
    assert_eq!(g.seed, Some(u64::MAX));
    assert_eq!(g.stop.len(), 8);
    assert!(g.logprobs);
    assert_eq!(g.top_logprobs, Some(20));
    assert_eq!(g.max_time_ms, Some(1));
    assert_eq!(g.chunk_size, Some(512));
}

#[test]
fn edge_values_are_accepted() {
    ok_gen(json!({"request_id": "x".repeat(64)}));
    ok_gen(json!({"top_k": 0}));
    ok_gen(json!({"temperature": 0.0, "top_p": 1e-9}));
    ok_gen(json!({"stop": ["€".repeat(21)]})); // 63 bytes
    ok_gen(json!({"logprobs": true, "top_logprobs": 0}));
    ok_gen(json!({"logprobs": true}));
    ok_gen(json!({"prompt": ""}));
}

#[test]
fn messages_and_fim_inputs() {
    let g = ok_gen(json!({"prompt": null, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "tool", "content": "{}"},
    ]}));
    let GenerateInput::Messages(m) = &g.input else { panic!() };
    assert_eq!(m.iter().map(|m| m.role).collect::<Vec<_>>(), [Role::System, Role::User, Role::Assistant, Role::Tool]);
    assert_eq!(m[1], ChatMessage::new(Role::User, "Hi"));

    let g = ok_gen(json!({"prompt": null, "fim": {"prefix": "fn main() {", "suffix": "}"}}));
    assert_eq!(g.input, GenerateInput::Fim(FimInput { prefix: "fn main() {".into(), suffix: "}".into(), extra: vec![] }));

    let g = ok_gen(json!({"prompt": null, "fim": {"prefix": "a", "suffix": "b",
        "extra": [{"path": "src/lib.rs", "content": "pub fn f() {}"}, {"content": "notes"}]}}));
    let GenerateInput::Fim(f) = g.input else { panic!() };
    assert_eq!(f.extra, vec![FimExtra { path: Some("src/lib.rs".into()), content: "pub fn f() {}".into() }, FimExtra { path: None, content: "notes".into() },]);
}

#[test]
fn other_client_messages() {
    assert_eq!(ok(r#"{"type":"session.open"}"#), ClientMessage::SessionOpen(SessionOpen::default()));
    let ClientMessage::SessionOpen(open) = ok(r#"{"type":"session.open","session_id":"s-1","resume_token":"tok_abc","last_seq":{"r1":4,"r2":0}}"#) else {
        panic!()
    };
    assert!(open.is_resume());
    assert_eq!(open.session_id.as_deref(), Some("s-1"));
    assert_eq!(open.resume_token.as_deref(), Some("tok_abc"));
    let last = open.last_seq.unwrap();
    assert_eq!((last["r1"], last["r2"]), (4, 0));
    // Resuming without last_seq is allowed.
    ok(r#"{"type":"session.open","session_id":"s-1","resume_token":"tok"}"#);

    let cancel = ok(r#"{"type":"cancel","request_id":"r1"}"#);
    assert_eq!(cancel.request_id(), Some("r1"));
    assert_eq!(cancel.type_name(), "cancel");
    assert_eq!(ok(r#"{"type":"session.close"}"#).type_name(), "session.close");

    let ClientMessage::Ping(p) = ok(r#"{"type":"ping"}"#) else { panic!() };
    assert_eq!(p.id, None);
    let ClientMessage::Ping(p) = ok(r#"{"type":"ping","id":42}"#) else { panic!() };
    assert_eq!(p.id, Some(PingId::from(42)));
    let ClientMessage::Ping(p) = ok(r#"{"type":"ping","id":-1.5}"#) else { panic!() };
    assert_eq!(serde_json::to_string(&p.id).unwrap(), "-1.5");
    let ClientMessage::Ping(p) = ok(r#"{"type":"ping","id":"hb-7"}"#) else { panic!() };
    assert_eq!(p.id, Some(PingId::from("hb-7")));
}

#[test]
fn key_order_and_whitespace_do_not_matter() {
    let a = ok(r#"{"type":"generate","request_id":"r1","prompt":"Hello"}"#);
    let b = ok("  {\n \"prompt\" : \"Hello\",\n \"request_id\":\"r1\", \"type\":\"generate\" }\n");
    assert_eq!(a, b);
}

#[test]
fn client_messages_round_trip_through_to_json() {
    let frames = [
        r#"{"type":"session.open"}"#,
        r#"{"type":"session.open","session_id":"s","resume_token":"t","last_seq":{"a":1,"b":2}}"#,
        r#"{"type":"generate","request_id":"r1","prompt":"Hello","max_tokens":256,"temperature":0.0}"#,
        r#"{"type":"generate","request_id":"r2","messages":[{"role":"user","content":"Hi"}],"max_tokens":16,"temperature":0.7,"top_p":0.9,"top_k":40,"min_p":0.05,"seed":7,"stop":["\n\n"],"logprobs":true,"top_logprobs":3,"max_time_ms":5000,"chunk_size":256}"#,
        r#"{"type":"generate","request_id":"r3","fim":{"prefix":"a","suffix":"b","extra":[{"path":"p","content":"c"}]},"max_tokens":64,"temperature":0.0}"#,
        r#"{"type":"cancel","request_id":"r1"}"#,
        r#"{"type":"session.close"}"#,
        r#"{"type":"ping"}"#,
        r#"{"type":"ping","id":"x"}"#,
        r#"{"type":"ping","id":3}"#,
    ];
    for frame in frames {
        let msg = ok(frame);
        assert_eq!(msg.to_json(), frame, "canonical form");
        // The derived serde impl agrees with parse_client on valid frames.
        let plain: ClientMessage = serde_json::from_str(frame).unwrap();
        assert_eq!(plain, msg);
    }
}

// ---------------------------------------------------------------------------
// limits

fn limits() -> Limits {
    Limits {
        max_frame_bytes: 1 << 20,
        max_prompt_tokens: 3000,
        max_tokens: 1024,
        max_in_flight: 4,
        session_ttl_ms: 60_000,
        idle_timeout_ms: 30_000,
        context_length: 4096,
    }
}

#[test]
fn check_frame_len() {
    let l = limits();
    assert_eq!(l.check_frame_len(1 << 20), Ok(()));
    let e = l.check_frame_len((1 << 20) + 1).unwrap_err();
    assert_eq!(e.code, FrameTooLarge);
    assert!(e.is_fatal());
    assert_eq!(e.message, "frame is 1048577 bytes, the limit is 1048576");
}

#[test]
fn validate_is_callable_on_built_requests() {
    let mut g = GenerateRequest::new("ok", GenerateInput::Messages(vec![]));
    let e = g.validate().unwrap_err();
    assert_eq!(e, ProtocolError::invalid_parameter("messages must contain at least 1 message, got 0").with_request_id("ok"));
    g.input = GenerateInput::Prompt("p".into());
    assert_eq!(ClientMessage::Generate(g).validate(), Ok(()));
}
