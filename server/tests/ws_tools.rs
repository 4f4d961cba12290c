//! Tool calls over a real socket with the real models. Qwen2.5-Coder-0.5B
//! (whose chat template has a tool section) runs an agent turn: it calls a
//! tool, the result comes back as a `tool` message in the same session, and
//! the answer uses it, continuing from the session's cache. SmolLM2 (whose
//! template has none: the server writes the tools into the system message)
//! is held to valid calls by `tool_choice`. Bad tools get typed errors and
//! the session goes on.
mod ws_harness;

use protocol::{ErrorCode, FinishReason, ToolCall};
use serde_json::{json, Value};
use tether::server::ServerConfig;
use tokio::sync::OnceCell;
use ws_harness::*;

const QWEN: &str = "qwen2.5-coder-0.5b";

async fn qwen() -> &'static TestServer {
    static S: OnceCell<TestServer> = OnceCell::const_new();
    S.get_or_init(|| harness_for(QWEN, &[]).start(ServerConfig::default())).await
}

async fn smollm() -> &'static TestServer {
    static S: OnceCell<TestServer> = OnceCell::const_new();
    S.get_or_init(|| harness_for(MODEL, &[]).start(ServerConfig::default())).await
}

fn weather_tool() -> Value {
    json!({
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": false
        }
    })
}

fn time_tool() -> Value {
    json!({"name": "get_time", "description": "The local time in a time zone", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}})
}

/// A weather call's arguments, checked against `weather_tool`'s schema by hand.
fn assert_weather_call(call: &ToolCall) -> Value {
    assert_eq!(call.name, "get_weather");
    assert!(call.id.starts_with("call_"), "{call:?}");
    let args: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {call:?}"));
    let o = args.as_object().unwrap();
    assert!(o.len() == 2 && o["city"].is_string() && ["celsius", "fahrenheit"].contains(&o["unit"].as_str().unwrap_or("")), "{args}");
    args
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_turn_calls_a_tool_and_answers_from_its_result() {
    let mut c = qwen().await.client().await;
    c.open().await;
    let question = json!({"role": "user", "content": "What is the weather in Paris right now?"});
    c.generate(
        "call",
        json!({"messages": [question], "tools": [weather_tool()], "tool_choice": {"type": "function", "name": "get_weather"}, "max_tokens": 64}),
    )
    .await;
    let call = c.collect("call").await;
    call.assert_contiguous();
    let done = call.done();
    assert_eq!(done.finish_reason, FinishReason::ToolCalls);
    assert_eq!(done.tool_calls.len(), 1, "{done:?}");
    let args = assert_weather_call(&done.tool_calls[0]);
    assert_eq!(args["city"], "Paris");
    // The call is in `done`, not in the text.
    assert_eq!(call.text(), "");
    let first_prompt = done.usage.prompt_tokens;

    // The result comes back; the answer (a JSON object here, so the test
    // can read it) uses it.
    let calls: Vec<Value> = done.tool_calls.iter().map(|t| serde_json::to_value(t).unwrap()).collect();
    let messages = json!([
        question,
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": done.tool_calls[0].id, "content": "{\"temperature_c\": 18, \"sky\": \"cloudy\"}"}
    ]);
    let answer_format = json!({"type": "json_schema", "schema": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}});
    c.generate("answer", json!({"messages": messages, "tools": [weather_tool()], "tool_choice": "none", "response_format": answer_format, "max_tokens": 64}))
        .await;
    let answer = c.collect("answer").await;
    let done = answer.done();
    assert_eq!(done.finish_reason, FinishReason::Stop);
    assert!(done.tool_calls.is_empty());
    let text: Value = serde_json::from_str(&answer.text()).unwrap();
    assert!(text["answer"].as_str().unwrap().contains("18"), "the answer should use the tool's result: {text}");
    // The turn continued from the session's cache: the first turn's prompt
    // and call were not read again.
    assert!(
        done.usage.cached_tokens >= first_prompt,
        "cached {} of {} tokens; the first prompt was {first_prompt}",
        done.usage.cached_tokens,
        done.usage.prompt_tokens
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_a_tool_template_is_held_to_valid_calls() {
    let mut c = smollm().await.client().await;
    c.open().await;
    let ask = |choice: Value, parallel: bool| {
        json!({
            "messages": [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}],
            "tools": [weather_tool(), time_tool()],
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
            "max_tokens": 96
        })
    };
    c.generate("one", ask(json!("required"), false)).await;
    let out = c.collect("one").await;
    let done = out.done();
    assert_eq!((done.finish_reason, done.tool_calls.len()), (FinishReason::ToolCalls, 1), "{done:?} {:?}", out.text());
    assert!(["get_weather", "get_time"].contains(&done.tool_calls[0].name.as_str()));
    // A named tool is called once, parallel calls allowed or not.
    c.generate("named", ask(json!({"type": "function", "name": "get_weather"}), true)).await;
    let done = c.collect("named").await;
    let done = done.done();
    assert_eq!((done.finish_reason, done.tool_calls.len()), (FinishReason::ToolCalls, 1), "{done:?}");
    assert_weather_call(&done.tool_calls[0]);
    // Sampled: still valid calls.
    for seed in 1..=3 {
        let id = format!("sampled-{seed}");
        let mut req = ask(json!({"type": "function", "name": "get_weather"}), false);
        req["temperature"] = json!(1.0);
        req["seed"] = json!(seed);
        c.generate(&id, req).await;
        let out = c.collect(&id).await;
        assert_eq!(out.done().tool_calls.len(), 1, "{:?}", out.done());
        assert_weather_call(&out.done().tool_calls[0]);
    }
    // `auto`: the model decides; whatever it wrote ends cleanly.
    c.generate("auto", ask(json!("auto"), true)).await;
    let out = c.collect("auto").await;
    assert!(matches!(out.done().finish_reason, FinishReason::Stop | FinishReason::ToolCalls | FinishReason::Length));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tools_are_invalid_parameters_and_the_session_goes_on() {
    let mut c = smollm().await.client().await;
    c.open().await;
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!({"messages": user, "tools": [weather_tool()], "tool_choice": {"type": "function", "name": "nope"}}), "nope"),
        (json!({"messages": user, "tool_choice": "required"}), "tools"),
        (json!({"prompt": "hi", "tools": [weather_tool()]}), "messages"),
        (json!({"messages": user, "tools": [weather_tool(), weather_tool()]}), "twice"),
        (json!({"messages": user, "tools": [{"name": "bad name!"}]}), "name"),
        (
            json!({"messages": user, "tools": [{"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}], "tool_choice": "required"}),
            "nonsense",
        ),
        (json!({"messages": user, "tools": [{"name": "f", "parameters": []}]}), "parameters"),
        (json!({"messages": user, "tools": [weather_tool()], "tool_choice": "sometimes"}), "tool_choice"),
        (json!({"messages": user, "tools": [weather_tool()], "tool_choice": "required", "response_format": {"type": "json_object"}}), "response_format"),
        (json!({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "c", "name": "f", "arguments": "{}"}]}]}), "assistant"),
        (json!({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}), "tool"),
        (json!({"messages": user, "tools": [{"name": "f", "kind": "x"}]}), "kind"),
    ];
    for (i, (mut req, quoted)) in cases.into_iter().enumerate() {
        let id = format!("bad-{i}");
        req["max_tokens"] = json!(4);
        c.generate(&id, req.clone()).await;
        let out = c.collect(&id).await;
        let e = out.error();
        assert_eq!(e.request_id.as_deref(), Some(id.as_str()), "{req}");
        assert!(matches!(e.code, ErrorCode::InvalidParameter | ErrorCode::InvalidField), "{req}: {e:?}");
        assert!(e.message.contains(quoted), "{req}: the message should say what is wrong: {}", e.message);
    }
    c.generate("after", json!({"messages": user, "tools": [time_tool()], "tool_choice": "required", "parallel_tool_calls": false, "max_tokens": 96})).await;
    let after = c.collect("after").await;
    assert_eq!(after.done().tool_calls.len(), 1, "{:?} {:?}", after.done(), after.text());
    assert_eq!(after.done().tool_calls[0].name, "get_time");
}

/// `tool_choice: "auto"` beside a `response_format`: every output is either
/// valid calls or an answer in the format (never free text, never a broken
/// call), greedy and sampled, on a model whose template speaks the call
/// format (Qwen, one opener token) and on one whose tools are written into
/// the system message (SmolLM2, whose opener is several tokens). Both
/// branches are taken: the weather question gets calls, SmolLM2 answers the
/// yes-or-no question in the regex's words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_beside_a_response_format_is_calls_or_the_answer() {
    let answer_schema = json!({"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"], "additionalProperties": false});
    let formats = [json!({"type": "json_schema", "schema": answer_schema}), json!({"type": "regex", "pattern": "(yes|no)"})];
    let answer_is_valid = |format: usize, text: &str| match format {
        0 => serde_json::from_str::<Value>(text).is_ok_and(|v| v.as_object().is_some_and(|o| o.len() == 1 && o["answer"].is_string())),
        _ => text == "yes" || text == "no",
    };
    let questions = ["What is the weather in Paris right now?", "Is Paris in France? Answer yes or no."];
    let (mut answers, mut calls) = (0, 0);
    for server in [qwen().await, smollm().await] {
        let mut c = server.client().await;
        c.open().await;
        for (f, format) in formats.iter().enumerate() {
            for (q, question) in questions.iter().enumerate() {
                for seed in [0, 5] {
                    let id = format!("f{f}-q{q}-seed{seed}");
                    let mut req = json!({"messages": [{"role": "user", "content": question}], "tools": [weather_tool(), time_tool()], "response_format": format, "max_tokens": 64});
                    if seed > 0 {
                        req["temperature"] = json!(1.0);
                        req["seed"] = json!(seed);
                    }
                    c.generate(&id, req).await;
                    let out = c.collect(&id).await;
                    let (done, text) = (out.done(), out.text());
                    if done.tool_calls.is_empty() {
                        assert_eq!(done.finish_reason, FinishReason::Stop, "{id}: {text:?}");
                        assert!(answer_is_valid(f, &text), "{id}: not an answer in the format: {text:?}");
                        answers += 1;
                        continue;
                    }
                    calls += 1;
                    for call in &done.tool_calls {
                        match call.name.as_str() {
                            "get_weather" => drop(assert_weather_call(call)),
                            name => {
                                assert_eq!(name, "get_time", "{id}");
                                let args: Value = serde_json::from_str(&call.arguments).unwrap();
                                assert!(args["zone"].is_string(), "{id}: {args}");
                            }
                        }
                    }
                    // Nothing but calls; at the token limit, the start of one more.
                    match done.finish_reason {
                        FinishReason::ToolCalls => assert_eq!(text, "", "{id}"),
                        FinishReason::Length => assert!(text.starts_with("<tool_call>"), "{id}: {text:?}"),
                        other => panic!("{id}: calls ended by {other:?}"),
                    }
                }
            }
        }
    }
    assert!(answers > 0 && calls > 0, "both branches should be taken: {answers} answers, {calls} calls");
}
