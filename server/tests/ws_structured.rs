//! Structured outputs over a real socket with the real model: a JSON Schema,
//! a regular expression and a Lark grammar constrain what `generate` writes
//! (greedy and sampled); grammar-forced drafts change no token; bad formats
//! get `invalid_parameter` with the parser's words and the session goes on;
//! constrained and plain requests share a batch without touching each other.
mod ws_harness;

use protocol::{ErrorCode, FinishReason};
use serde_json::{json, Value};
use tether::server::ServerConfig;
use tokio::sync::OnceCell;
use ws_harness::*;

const CAPITAL: &str = "The capital of France is";

fn harness() -> &'static Harness {
    harness_for(MODEL, &[(CAPITAL, 8)])
}

async fn server() -> &'static TestServer {
    static S: OnceCell<TestServer> = OnceCell::const_new();
    S.get_or_init(|| harness().start(ServerConfig::default())).await
}

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "city": {"enum": ["Paris", "London", "Tokyo"]},
            "languages": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3}
        },
        "required": ["name", "age", "city", "languages"],
        "additionalProperties": false
    })
}

fn person_request(extra: Value) -> Value {
    let mut v = json!({
        "messages": [{"role": "user", "content": "Describe a person who lives in a big city, as JSON."}],
        "max_tokens": 120,
        "response_format": {"type": "json_schema", "schema": person_schema()}
    });
    v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    v
}

/// The checks of `person_schema`, written out independently of the grammar engine.
fn assert_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {text}"));
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["age", "city", "languages", "name"], "{text}");
    assert!(o["name"].as_str().is_some_and(|s| s.chars().count() <= 24), "{text}");
    assert!(o["age"].as_u64().is_some_and(|a| a <= 130), "{text}");
    assert!(["Paris", "London", "Tokyo"].contains(&o["city"].as_str().unwrap_or("")), "{text}");
    let langs = o["languages"].as_array().unwrap_or_else(|| panic!("{text}"));
    assert!((1..=3).contains(&langs.len()) && langs.iter().all(|l| l.as_str().is_some_and(|s| s.chars().count() <= 16)), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_schema_constrains_greedy_and_sampled_outputs() {
    let mut c = server().await.client().await;
    c.open().await;
    c.generate("greedy", person_request(json!({}))).await;
    let greedy = c.collect("greedy").await;
    greedy.assert_contiguous();
    assert_person(&greedy.text());
    assert_eq!(greedy.done().finish_reason, FinishReason::Stop, "the grammar ends the answer: {}", greedy.text());
    // The layout is fixed (", " and ": " between items): nothing to pad with.
    assert!(!greedy.text().contains('\n'), "{}", greedy.text());
    for seed in 1..=4 {
        let id = format!("sampled-{seed}");
        c.generate(&id, person_request(json!({"temperature": 1.0, "seed": seed}))).await;
        let out = c.collect(&id).await;
        assert_person(&out.text());
    }
    c.generate("object", json!({"prompt": "A JSON object:", "max_tokens": 60, "response_format": {"type": "json_object"}})).await;
    let object = c.collect("object").await;
    if object.done().finish_reason == FinishReason::Stop {
        assert!(serde_json::from_str::<Value>(&object.text()).unwrap().is_object(), "{}", object.text());
    } else {
        assert!(object.text().starts_with('{'), "{}", object.text());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_forced_drafts_change_no_token() {
    let mut c = server().await.client().await;
    c.open().await;
    let mut outputs = Vec::new();
    for (id, speculation) in [("off", json!({"source": "off"})), ("forced", json!({})), ("forced-echo", json!({"source": "echo", "max_draft": 4}))] {
        c.generate(id, person_request(json!({"speculation": speculation}))).await;
        let out = c.collect(id).await;
        assert_person(&out.text());
        outputs.push((id, out.token_ids(), out.done().speculative.clone()));
    }
    assert_eq!(outputs[0].1, outputs[1].1, "forced drafts changed the greedy tokens");
    assert_eq!(outputs[0].1, outputs[2].1, "forced and echo drafts changed the greedy tokens");
    assert!(outputs[0].2.is_none(), "speculation off verifies no drafts");
    let forced = outputs[1].2.as_ref().expect("a constrained request verifies its grammar's forced tokens");
    // The keys, quotes and separators of the schema are forced; nearly all hold.
    assert!(forced.drafted >= 8 && forced.accepted * 10 >= forced.drafted * 8, "{forced:?}");
    assert!(forced.tokens_per_forward > 1.3, "{forced:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regex_and_a_lark_grammar_constrain_the_text() {
    let mut c = server().await.client().await;
    c.open().await;
    let pattern = r"(yes|no), [0-9]{2} (apples|pears)\.";
    c.generate("regex", json!({"prompt": "Answer:", "max_tokens": 30, "response_format": {"type": "regex", "pattern": pattern}})).await;
    let out = c.collect("regex").await;
    let text = out.text();
    let (answer, rest) = text.split_once(", ").unwrap_or_else(|| panic!("{text:?}"));
    let (count, fruit) = rest.split_once(' ').unwrap_or_else(|| panic!("{text:?}"));
    assert!(["yes", "no"].contains(&answer) && count.len() == 2 && count.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
    assert!(["apples.", "pears."].contains(&fruit), "{text:?}");
    assert_eq!(out.done().finish_reason, FinishReason::Stop);

    let lark = r#"start: "The sky is " COLOR "." 
COLOR: "blue" | "grey" | "red""#;
    c.generate("lark", json!({"prompt": "Weather report:", "max_tokens": 30, "response_format": {"type": "grammar", "lark": lark}})).await;
    let out = c.collect("lark").await;
    assert!(["The sky is blue.", "The sky is grey.", "The sky is red."].contains(&out.text().as_str()), "{:?}", out.text());
    assert_eq!(out.done().finish_reason, FinishReason::Stop);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_formats_are_invalid_parameters_and_the_session_goes_on() {
    let h = harness();
    let mut c = server().await.client().await;
    c.open().await;
    let cases = [
        (json!({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}), "nonsense"),
        (json!({"type": "json_schema", "schema": {"$ref": "#/$defs/missing"}}), "missing"),
        (json!({"type": "json_schema", "schema": false}), "false"),
        (json!({"type": "regex", "pattern": "(unclosed"}), "regex"),
        (json!({"type": "grammar", "lark": "start: undefined_rule"}), "undefined_rule"),
        (json!({"type": "json_schema", "schema": 7}), "schema"),
        (json!({"type": "json_schema", "schema": {}, "strict": true}), "strict"),
        (json!({"type": "yaml"}), "yaml"),
    ];
    for (i, (format, quoted)) in cases.into_iter().enumerate() {
        let id = format!("bad-{i}");
        c.generate(&id, json!({"prompt": "hi", "max_tokens": 4, "response_format": format})).await;
        let out = c.collect(&id).await;
        let e = out.error();
        assert_eq!(e.request_id.as_deref(), Some(id.as_str()));
        assert!(matches!(e.code, ErrorCode::InvalidParameter | ErrorCode::InvalidField), "{format}: {e:?}");
        assert!(e.message.to_lowercase().contains(&quoted.to_lowercase()), "{format}: the message should say what is wrong: {}", e.message);
    }
    c.generate("after", json!({"prompt": CAPITAL, "max_tokens": 8, "speculation": {"source": "off"}})).await;
    assert_eq!(c.collect("after").await.token_ids(), h.greedy(CAPITAL, 8).0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_and_plain_requests_share_a_batch_untouched() {
    let h = harness();
    let mut c = server().await.client().await;
    c.open().await;
    c.generate("json", person_request(json!({}))).await;
    c.generate("plain", json!({"prompt": CAPITAL, "max_tokens": 8, "speculation": {"source": "off"}})).await;
    c.generate("json-2", person_request(json!({"temperature": 0.8, "seed": 11}))).await;
    let plain = c.collect("plain").await;
    assert_eq!(plain.token_ids(), h.greedy(CAPITAL, 8).0, "a constrained neighbour changed a plain row");
    assert_person(&c.collect("json").await.text());
    assert_person(&c.collect("json-2").await.text());
}
