//! Streaming over a real socket through the real engine: deltas concatenate
//! to the plain greedy text, chat, stop sequences with logprobs, several
//! requests per session, two isolated sessions, ping, /healthz, /metrics.
mod ws_harness;

use std::time::Instant;

use protocol::{ErrorCode, FinishReason, ServerMessage};
use serde_json::json;
use tether::server::ServerConfig;
use tether::tokenizer::ChatMessage;
use tokio::sync::OnceCell;
use ws_harness::*;

const COUNT: &str = "1, 2, 3, 4,";
const CAPITAL: &str = "The capital of France is";
const CHAT: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n";

fn harness() -> &'static Harness {
    harness_for(MODEL, &[(COUNT, 24), (CAPITAL, 8), (CHAT, 16)])
}

async fn server() -> &'static TestServer {
    static S: OnceCell<TestServer> = OnceCell::const_new();
    S.get_or_init(|| harness().start(ServerConfig::default())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_deltas_concatenate_to_the_greedy_text() {
    let h = harness();
    let mut c = server().await.client().await;
    let ready = c.open().await;
    assert_eq!(ready.protocol_version, 1);
    assert!(!ready.resumed);
    assert_eq!(ready.model.name, MODEL);
    assert!(!ready.model.fim, "SmolLM2 has no FIM tokens");
    assert!(ready.session_id.len() >= 32 && ready.resume_token.len() >= 32);

    let sent = Instant::now();
    c.generate("count-1", json!({"prompt": COUNT, "speculation": {"source": "off"}, "max_tokens": 24})).await;
    let out = c.collect("count-1").await;
    let done_at = sent.elapsed();
    out.assert_contiguous();

    let (ids, text) = h.greedy(COUNT, 24);
    assert_eq!(out.token_ids(), ids, "streamed tokens differ from greedy_tokens");
    assert_eq!(out.text(), text);
    // Real streaming: one frame per generated token (speculation is off here:
    // accepted drafts arrive together), in order.
    assert_eq!(out.deltas.len(), 24);
    let done = out.done();
    assert_eq!(done.finish_reason, FinishReason::Length);
    assert_eq!(done.usage.completion_tokens, 24);
    assert_eq!(done.usage.prompt_tokens as usize, h.tokenizer.encode(COUNT, true).unwrap().len());
    // No clock decides here: on two busy cores a stalled relay can take all 24
    // tokens in one millisecond. That deltas reach a client before the end is
    // shown by cancelling mid-stream (ws_lifecycle's cancel test).
    assert!(done.timing.queue_ms <= done.timing.ttft_ms && done.timing.ttft_ms <= done.timing.total_ms, "{:?}", done.timing);
    assert!(done.timing.total_ms as u128 <= done_at.as_millis() + 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_request_uses_the_chat_template_and_stops_at_end_of_turn() {
    let h = harness();
    // The template renders to the reference prompt (SmolLM2 adds its default system message).
    let rendered = h.tokenizer.apply_chat_template(&[ChatMessage::user("What is 2+2?")], true).unwrap();
    assert_eq!(rendered, CHAT);
    let mut c = server().await.client().await;
    c.open().await;
    c.generate("chat:1", json!({"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 16})).await;
    let out = c.collect("chat:1").await;
    out.assert_contiguous();
    let (ids, text) = h.greedy(CHAT, 16);
    assert!(ids.len() < 16, "the reference ends with an end-of-turn token");
    assert_eq!(out.text(), text);
    assert_eq!(out.token_ids(), ids);
    assert_eq!(out.done().finish_reason, FinishReason::Stop);
    assert_eq!(out.done().usage.completion_tokens as usize, ids.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_sequence_cuts_the_text_and_logprobs_follow_tokens() {
    let h = harness();
    let mut c = server().await.client().await;
    c.open().await;
    c.generate("stop.1", json!({"prompt": COUNT, "speculation": {"source": "off"}, "max_tokens": 24, "stop": [" 8,"], "logprobs": true, "top_logprobs": 2}))
        .await;
    let out = c.collect("stop.1").await;
    out.assert_contiguous();
    let (_, full) = h.greedy(COUNT, 24);
    let cut = full.find(" 8,").expect("the greedy text contains the stop");
    assert_eq!(out.text(), &full[..cut]);
    assert_eq!(out.done().finish_reason, FinishReason::Stop);
    for d in &out.deltas {
        let lps = d.logprobs.as_ref().expect("logprobs requested");
        assert_eq!(lps.len(), d.token_ids.len());
        for (lp, &id) in lps.iter().zip(&d.token_ids) {
            assert_eq!(lp.token_id, id);
            assert!(lp.logprob <= 0.0 && lp.logprob.is_finite());
            let top = lp.top.as_ref().expect("top_logprobs requested");
            assert_eq!(top.len(), 2);
            assert_eq!(top[0].token_id, id, "greedy picks the most likely token");
            assert!(top[0].logprob >= top[1].logprob);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_time_ms_ends_with_time_limit() {
    let mut c = server().await.client().await;
    c.open().await;
    c.generate("t", json!({"prompt": COUNT, "speculation": {"source": "off"}, "max_tokens": 1000, "max_time_ms": 300})).await;
    let out = c.collect("t").await;
    out.assert_contiguous();
    let done = out.done();
    assert_eq!(done.finish_reason, FinishReason::TimeLimit);
    assert!(done.usage.completion_tokens < 1000);
    assert!(done.timing.total_ms >= 300 && done.timing.total_ms < 5000, "{:?}", done.timing);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_requests_in_one_session_interleave() {
    let h = harness();
    let mut c = server().await.client().await;
    c.open().await;
    c.generate("a", json!({"prompt": COUNT, "speculation": {"source": "off"}, "max_tokens": 24})).await;
    c.generate("b", json!({"prompt": CAPITAL, "max_tokens": 8})).await;
    let b = c.collect("b").await;
    let a = c.collect("a").await;
    a.assert_contiguous();
    b.assert_contiguous();
    assert_eq!(a.text(), h.greedy(COUNT, 24).1);
    assert_eq!(b.text(), h.greedy(CAPITAL, 8).1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sessions_are_isolated() {
    let h = harness();
    let srv = server().await;
    let mut a = srv.client().await;
    let mut b = srv.client().await;
    let ra = a.open().await;
    let rb = b.open().await;
    assert_ne!(ra.session_id, rb.session_id);
    assert_ne!(ra.resume_token, rb.resume_token);

    a.generate("shared-id", json!({"prompt": COUNT, "speculation": {"source": "off"}, "max_tokens": 24})).await;
    let first = a.deltas("shared-id", 1).await.remove(0);
    // B cannot see or cancel A's request...
    b.send(&json!({"type": "cancel", "request_id": "shared-id"})).await;
    let e = b.expect_error().await;
    assert_eq!(e.code, ErrorCode::UnknownRequest);
    assert_eq!(e.request_id.as_deref(), Some("shared-id"));
    // ...has its own namespace of ids...
    b.generate("shared-id", json!({"prompt": CAPITAL, "max_tokens": 8})).await;
    let ob = b.collect("shared-id").await;
    assert_eq!(ob.text(), h.greedy(CAPITAL, 8).1);
    // ...and cannot take A's session with its own token.
    let mut thief = srv.client().await;
    thief.send(&json!({"type": "session.open", "session_id": ra.session_id, "resume_token": rb.resume_token})).await;
    assert_eq!(thief.expect_error().await.code, ErrorCode::InvalidResumeToken);

    let oa = a.collect("shared-id").await;
    assert_eq!(oa.deltas.len(), 23, "the first delta was read above");
    assert_eq!(oa.done().finish_reason, FinishReason::Length);
    assert_eq!(first.text + &oa.text(), h.greedy(COUNT, 24).1, "A's stream is untouched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_works_before_and_after_session_open() {
    let mut c = server().await.client().await;
    for (ping, id) in
        [(json!({"type": "ping", "id": 17}), Some(json!(17))), (json!({"type": "ping", "id": "hb-1"}), Some(json!("hb-1"))), (json!({"type": "ping"}), None)]
    {
        c.send(&ping).await;
        match c.recv().await {
            ServerMessage::Pong(p) => assert_eq!(p.id.map(|i| serde_json::to_value(i).unwrap()), id),
            other => panic!("expected pong, got {other:?}"),
        }
    }
    c.open().await;
    c.send(&json!({"type": "ping", "id": 2.5})).await;
    assert!(matches!(c.recv().await, ServerMessage::Pong(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_metrics_and_other_routes() {
    let srv = server().await;
    let (status, body) = srv.http_get("/healthz").await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["status"], "ok");
    assert_eq!(v["model"], MODEL);
    assert!(v["engine"]["active_memory"].as_u64().unwrap() > 0);
    assert!(v["engine"]["kv_bytes"].is_u64());

    // Something to count.
    let mut c = srv.client().await;
    c.open().await;
    c.send_text("nope").await;
    assert_eq!(c.expect_error().await.code, ErrorCode::BadJson);
    let (status, body) = srv.http_get("/metrics").await;
    assert_eq!(status, 200);
    for name in [
        "tether_sessions ",
        "tether_connections ",
        "tether_requests_in_flight ",
        "tether_engine_kv_bytes ",
        "tether_engine_active_memory_bytes ",
        "tether_generated_tokens_total ",
        "tether_errors_total{code=\"bad_json\"} ",
    ] {
        assert!(body.contains(name), "/metrics lacks {name:?}:\n{body}");
    }
    assert!(body.trim_end().ends_with("# EOF"));

    assert_eq!(srv.http_get("/nope").await.0, 404);
    assert_eq!(srv.http_get("/v1/ws").await.0, 426, "a plain GET is not an upgrade");
}

/// Turn 2 of a chat starts from turn 1's KV state (usage.cached_tokens),
/// with the same text as without the cache; another session with the same
/// history gets nothing from the first session's cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_second_turn_reuses_its_first_turn() {
    let mut c = server().await.client().await;
    c.open().await;
    let user1 = json!({"role": "user", "content": "What is 2+2?"});
    c.generate("turn-1", json!({"messages": [user1], "max_tokens": 16})).await;
    let turn1 = c.collect("turn-1").await;
    assert_eq!(turn1.done().usage.cached_tokens, 0);
    let history = json!([user1, {"role": "assistant", "content": turn1.text()}, {"role": "user", "content": "And 3+3?"}]);
    c.generate("turn-2", json!({"messages": history, "max_tokens": 8})).await;
    let turn2 = c.collect("turn-2").await;
    let cached = turn2.done().usage.cached_tokens;
    assert!(cached >= 32 && cached < turn2.done().usage.prompt_tokens, "cached {cached} of {}", turn2.done().usage.prompt_tokens);

    let mut other = server().await.client().await;
    other.open().await;
    other.generate("turn-2", json!({"messages": history, "max_tokens": 8})).await;
    let uncached = other.collect("turn-2").await;
    assert_eq!(uncached.done().usage.cached_tokens, 0, "sessions never share private entries");
    assert_eq!(uncached.text(), turn2.text(), "a cache hit must not change the output");

    let (status, metrics) = server().await.http_get("/metrics").await;
    assert_eq!(status, 200);
    let hits = metrics.lines().find_map(|l| l.strip_prefix("tether_prefix_cache_hits_total ")).expect("prefix cache hits in /metrics");
    assert!(hits.trim().parse::<u64>().unwrap() >= 1, "{hits}");
    assert!(metrics.contains("tether_prefix_cache_bytes "), "{metrics}");
}

/// A turn that ends on a stop string leaves its KV state for the next turn
/// as a turn ended by an end token does: editors send a stop string with
/// nearly every completion, and their next keystroke must not pay the
/// whole prefill again. The stop string is taken from the middle of the
/// turn's greedy text (read first on another session), so the edge, not
/// the model, ends the turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_ended_by_a_stop_string_is_cached_for_the_next_turn() {
    let user1 = json!({"role": "user", "content": "Write a short poem about the sea."});
    let turn = json!({"messages": [user1], "max_tokens": 32, "speculation": {"source": "off"}});
    let mut reference = server().await.client().await;
    reference.open().await;
    reference.generate("whole", turn.clone()).await;
    let whole = reference.collect("whole").await.text();
    let chars: Vec<char> = whole.chars().collect();
    assert!(chars.len() >= 24, "the greedy turn is long enough to cut: {whole:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let cut = whole.find(&stop).expect("the stop string is in the text");

    let mut c = server().await.client().await;
    c.open().await;
    let mut stopped = turn.clone();
    stopped["stop"] = json!([stop]);
    c.generate("stop-turn-1", stopped).await;
    let turn1 = c.collect("stop-turn-1").await;
    assert_eq!(turn1.done().finish_reason, FinishReason::Stop);
    assert_eq!(turn1.text(), whole[..cut], "the text ends before the stop string {stop:?}");
    let history = json!([user1, {"role": "assistant", "content": turn1.text()}, {"role": "user", "content": "Now one about the moon."}]);
    c.generate("stop-turn-2", json!({"messages": history, "max_tokens": 4})).await;
    let turn2 = c.collect("stop-turn-2").await;
    let usage = &turn2.done().usage;
    assert!(usage.cached_tokens >= 32, "cached {} of {} prompt tokens after a turn ended by a stop string", usage.cached_tokens, usage.prompt_tokens);
}

/// A long raw prompt whose next turn extends it: the session re-encodes
/// only the new part (tokenizer/extend.rs), and the second turn reads the
/// same tokens, so the same output, as a fresh session given the whole text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extended_prompt_reads_the_same_tokens_as_the_whole_text() {
    let h = harness();
    let lines: Vec<String> = (0..40).map(|i| format!("Step {i}: the parser read 1{i}7 lines; don't stop.\n")).collect();
    let first = lines[..30].concat();
    let second = format!("{first}{}Summary:", lines[30..].concat());
    let mut c = server().await.client().await;
    c.open().await;
    c.generate("turn-1", json!({"prompt": first, "max_tokens": 1})).await;
    c.collect("turn-1").await;
    c.generate("turn-2", json!({"prompt": second, "max_tokens": 8, "speculation": {"source": "off"}})).await;
    let turn2 = c.collect("turn-2").await;

    let mut other = server().await.client().await;
    other.open().await;
    other.generate("turn-2", json!({"prompt": second, "max_tokens": 8, "speculation": {"source": "off"}})).await;
    let fresh = other.collect("turn-2").await;
    let whole = h.tokenizer.encode(&second, true).unwrap().len() + usize::from(h.tokenizer.add_bos());
    assert_eq!(turn2.done().usage.prompt_tokens as usize, whole);
    assert_eq!(fresh.done().usage.prompt_tokens as usize, whole);
    assert_eq!(turn2.token_ids(), fresh.token_ids());
}
