//! Every malformed or invalid message gets a typed `error` frame and the
//! session goes on serving (a table of bad inputs through one real socket);
//! limits with their exact codes; session errors; authentication and Origin.
mod ws_harness;

use std::time::Duration;

use protocol::{ErrorCode, FinishReason, ServerMessage};
use serde_json::json;
use tether::server::ServerConfig;
use tokio::sync::OnceCell;
use tokio_tungstenite::tungstenite::Message;
use ws_harness::*;

const CAPITAL: &str = "The capital of France is";
const COUNT: &str = "1, 2, 3, 4,";

fn harness() -> &'static Harness {
    harness_for(MODEL, &[(CAPITAL, 8)])
}

async fn server() -> &'static TestServer {
    static S: OnceCell<TestServer> = OnceCell::const_new();
    S.get_or_init(|| harness().start(ServerConfig::default())).await
}

enum F {
    Text(String),
    Binary(Vec<u8>),
}

fn t(s: &str) -> F {
    F::Text(s.to_string())
}

fn gen(extra: serde_json::Value) -> F {
    let mut v = json!({"type": "generate", "request_id": "bad-1", "prompt": "hi", "max_tokens": 4});
    v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    F::Text(v.to_string())
}

/// A prompt of `n` tokens, built with the real tokenizer.
fn prompt_of(h: &Harness, n: usize) -> String {
    let text = " hello".repeat(n);
    assert_eq!(h.tokenizer.encode(&text, true).unwrap().len(), n, "\" hello\" is one token");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_typed_errors_and_the_session_keeps_serving() {
    use ErrorCode::*;
    let h = harness();
    let srv = server().await;
    let mut c = srv.client().await;

    // Before session.open.
    for (frame, rid) in
        [(json!({"type": "generate", "request_id": "early", "prompt": "hi"}), "early"), (json!({"type": "cancel", "request_id": "early"}), "early")]
    {
        c.send(&frame).await;
        let e = c.expect_error().await;
        assert_eq!((e.code, e.request_id.as_deref()), (NoSession, Some(rid)));
    }
    let ready = c.open().await;
    let limits = ready.limits.clone();
    let ctx = limits.context_length as usize;

    let long_prompt = prompt_of(h, limits.max_prompt_tokens as usize + 1);
    let overflow_prompt = prompt_of(h, ctx - limits.max_tokens as usize / 2);
    let nine_stops: Vec<String> = (0..9).map(|i| format!("s{i}")).collect();
    let rid65 = "r".repeat(65);
    let rid = Some("bad-1");

    // (what, frame, code, request_id in the error)
    let table: Vec<(&str, F, ErrorCode, Option<&str>)> = vec![
        ("not JSON", t("hello"), BadJson, None),
        ("truncated JSON", t(r#"{"type": "generate""#), BadJson, None),
        ("trailing data", t(r#"{"type": "ping"} {"type": "ping"}"#), BadJson, None),
        ("empty frame", t(""), BadJson, None),
        ("number out of range", t(r#"{"type": "ping", "id": 1e999}"#), BadJson, None),
        ("array", t("[1, 2]"), UnknownType, None),
        ("string", t(r#""generate""#), UnknownType, None),
        ("no type", t("{}"), UnknownType, None),
        ("type not a string", t(r#"{"type": 5}"#), UnknownType, None),
        ("unknown type", t(r#"{"type": "generat", "request_id": "bad-1", "prompt": "x"}"#), UnknownType, None),
        ("server type", t(r#"{"type": "delta"}"#), UnknownType, None),
        ("no input", t(r#"{"type": "generate", "request_id": "bad-1"}"#), InvalidField, rid),
        ("two inputs", gen(json!({"messages": [{"role": "user", "content": "x"}]})), InvalidField, rid),
        ("prompt not a string", gen(json!({"prompt": 5})), InvalidField, rid),
        ("max_tokens a string", gen(json!({"max_tokens": "8"})), InvalidField, rid),
        ("max_tokens negative", gen(json!({"max_tokens": -1})), InvalidField, rid),
        ("unknown field", gen(json!({"bogus": 1})), InvalidField, rid),
        ("null field", gen(json!({"temperature": null})), InvalidField, rid),
        // Duplicate keys are caught while parsing the JSON, before the request_id is known.
        ("duplicate key", t(r#"{"type": "generate", "request_id": "bad-1", "prompt": "x", "prompt": "y"}"#), InvalidField, None),
        ("request_id a number", t(r#"{"type": "generate", "request_id": 7, "prompt": "x"}"#), InvalidField, None),
        ("unknown role", t(r#"{"type": "generate", "request_id": "bad-1", "messages": [{"role": "robot", "content": "x"}]}"#), InvalidField, rid),
        ("fim without suffix", t(r#"{"type": "generate", "request_id": "bad-1", "fim": {"prefix": "a"}}"#), InvalidField, rid),
        ("cancel without id", t(r#"{"type": "cancel"}"#), InvalidField, None),
        ("half a resume", t(r#"{"type": "session.open", "session_id": "s_1"}"#), InvalidField, None),
        ("last_seq without resume", t(r#"{"type": "session.open", "last_seq": {"a": 1}}"#), InvalidField, None),
        ("ping id an array", t(r#"{"type": "ping", "id": [1]}"#), InvalidField, None),
        ("session.close with a field", t(r#"{"type": "session.close", "now": true}"#), InvalidField, None),
        ("temperature 3", gen(json!({"temperature": 3})), InvalidParameter, rid),
        ("top_p 0", gen(json!({"top_p": 0})), InvalidParameter, rid),
        ("top_k 5000", gen(json!({"top_k": 5000})), InvalidParameter, rid),
        ("min_p 1.5", gen(json!({"min_p": 1.5})), InvalidParameter, rid),
        ("max_draft 0", gen(json!({"speculation": {"max_draft": 0}})), InvalidParameter, rid),
        ("draft model on a server without one", gen(json!({"speculation": {"source": "draft_model"}})), InvalidParameter, rid),
        ("max_tokens over the cap", gen(json!({"max_tokens": limits.max_tokens + 1})), InvalidParameter, rid),
        ("9 stop sequences", gen(json!({"stop": nine_stops})), InvalidParameter, rid),
        ("empty stop sequence", gen(json!({"stop": [""]})), InvalidParameter, rid),
        ("top_logprobs without logprobs", gen(json!({"top_logprobs": 2})), InvalidParameter, rid),
        ("top_logprobs 21", gen(json!({"logprobs": true, "top_logprobs": 21})), InvalidParameter, rid),
        ("bad request_id", t(r#"{"type": "generate", "request_id": "bad id!", "prompt": "x"}"#), InvalidParameter, None),
        ("request_id too long", F::Text(json!({"type": "generate", "request_id": rid65, "prompt": "x"}).to_string()), InvalidParameter, None),
        ("no messages", t(r#"{"type": "generate", "request_id": "bad-1", "messages": []}"#), InvalidParameter, rid),
        ("max_time_ms 0", gen(json!({"max_time_ms": 0})), InvalidParameter, rid),
        ("chunk_size 0", gen(json!({"chunk_size": 0})), InvalidParameter, rid),
        ("bad session_id", t(r#"{"type": "session.open", "session_id": "has space", "resume_token": "x"}"#), InvalidParameter, None),
        (
            "prompt too long",
            F::Text(json!({"type": "generate", "request_id": "bad-1", "prompt": long_prompt, "max_tokens": 1}).to_string()),
            PromptTooLong,
            rid,
        ),
        (
            "prompt + max_tokens over the context",
            F::Text(json!({"type": "generate", "request_id": "bad-1", "prompt": overflow_prompt, "max_tokens": limits.max_tokens}).to_string()),
            ContextOverflow,
            rid,
        ),
        ("fim on a model without FIM", t(r#"{"type": "generate", "request_id": "bad-1", "fim": {"prefix": "a", "suffix": "b"}}"#), FimUnsupported, rid),
        ("cancel of an unknown request", t(r#"{"type": "cancel", "request_id": "nope"}"#), UnknownRequest, Some("nope")),
        ("second session.open", t(r#"{"type": "session.open"}"#), SessionAlreadyOpen, None),
        ("binary frame", F::Binary(b"{\"type\": \"ping\"}".to_vec()), BinaryFrame, None),
        ("empty binary frame", F::Binary(Vec::new()), BinaryFrame, None),
    ];
    assert!(table.len() >= 30);
    let mut failures = Vec::new();
    for (what, frame, code, want_rid) in table {
        match frame {
            F::Text(s) => c.send_text(&s).await,
            F::Binary(b) => c.send_raw(Message::binary(b)).await,
        }
        let e = c.expect_error().await;
        if e.code != code || e.request_id.as_deref() != want_rid {
            failures.push(format!("{what}: got {:?} / {:?} ({}), want {code:?} / {want_rid:?}", e.code, e.request_id, e.message));
        }
        assert!(!e.message.is_empty());
    }
    assert!(failures.is_empty(), "wrong errors:\n{}", failures.join("\n"));

    // duplicate_request: the new generate is rejected, the running one goes on.
    c.generate("dup", json!({"prompt": CAPITAL, "max_tokens": 8})).await;
    c.generate("dup", json!({"prompt": "other", "max_tokens": 8})).await;
    let e = c.recv_matching(|m| matches!(m, ServerMessage::Error(_))).await;
    let ServerMessage::Error(e) = e else { unreachable!() };
    assert_eq!((e.code, e.request_id.as_deref()), (DuplicateRequest, Some("dup")));
    let dup = c.collect("dup").await;
    assert_eq!(dup.text(), h.greedy(CAPITAL, 8).1);
    // Finished but kept for replay: still a duplicate; cancel says unknown.
    c.generate("dup", json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(c.expect_error().await.code, DuplicateRequest);
    c.send(&json!({"type": "cancel", "request_id": "dup"})).await;
    assert_eq!(c.expect_error().await.code, UnknownRequest);

    // After all that, the same socket still serves.
    c.generate("good", json!({"prompt": CAPITAL, "max_tokens": 8})).await;
    let out = c.collect("good").await;
    out.assert_contiguous();
    assert_eq!(out.text(), h.greedy(CAPITAL, 8).1);
    assert_eq!(out.done().finish_reason, FinishReason::Length);
    c.send(&json!({"type": "ping", "id": 1})).await;
    assert!(matches!(c.recv().await, ServerMessage::Pong(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_open_errors_leave_the_connection_usable() {
    let srv = server().await;
    let mut a = srv.client().await;
    let ra = a.open().await;

    let mut c = srv.client().await;
    c.send(&json!({"type": "session.open", "session_id": "s_00000000000000000000000000000000", "resume_token": "rt_x"})).await;
    assert_eq!(c.expect_error().await.code, ErrorCode::SessionNotFound);
    c.send(&json!({"type": "session.open", "session_id": ra.session_id, "resume_token": "rt_wrong"})).await;
    assert_eq!(c.expect_error().await.code, ErrorCode::InvalidResumeToken);
    // A closed session cannot be resumed.
    a.send(&json!({"type": "session.close"})).await;
    assert_eq!(a.expect_close().await.map(|f| u16::from(f.code)), Some(1000));
    c.send(&json!({"type": "session.open", "session_id": ra.session_id, "resume_token": ra.resume_token})).await;
    assert_eq!(c.expect_error().await.code, ErrorCode::SessionExpired);
    // The connection still opens a fresh session.
    let rc = c.open().await;
    assert!(!rc.resumed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_and_token_limits() {
    let h = harness();
    let srv = h.start(ServerConfig { max_in_flight: 2, max_tokens: 32, max_prompt_tokens: Some(16), ..ServerConfig::default() }).await;
    let mut c = srv.client().await;
    let ready = c.open().await;
    assert_eq!(ready.limits.max_in_flight, 2);
    assert_eq!(ready.limits.max_tokens, 32);
    assert_eq!(ready.limits.max_prompt_tokens, 16);

    c.generate("r1", json!({"prompt": COUNT, "max_tokens": 32})).await;
    c.generate("r2", json!({"prompt": COUNT, "max_tokens": 32})).await;
    c.generate("r3", json!({"prompt": COUNT, "max_tokens": 32})).await;
    let e = c.recv_matching(|m| matches!(m, ServerMessage::Error(_))).await;
    let ServerMessage::Error(e) = e else { unreachable!() };
    assert_eq!((e.code, e.request_id.as_deref()), (ErrorCode::TooManyRequests, Some("r3")));
    c.generate("big", json!({"prompt": COUNT, "max_tokens": 33})).await;
    let e = c.recv_matching(|m| matches!(m, ServerMessage::Error(_))).await;
    let ServerMessage::Error(e) = e else { unreachable!() };
    assert_eq!((e.code, e.request_id.as_deref()), (ErrorCode::InvalidParameter, Some("big")));
    for r in ["r1", "r2"] {
        c.send(&json!({"type": "cancel", "request_id": r})).await;
    }
    for r in ["r1", "r2"] {
        assert_eq!(c.collect(r).await.done().finish_reason, FinishReason::Cancelled);
    }
    // Room again.
    c.generate("long", json!({"prompt": prompt_of(h, 17), "max_tokens": 1})).await;
    let e = c.recv_matching(|m| matches!(m, ServerMessage::Error(_))).await;
    let ServerMessage::Error(e) = e else { unreachable!() };
    assert_eq!((e.code, e.request_id.as_deref()), (ErrorCode::PromptTooLong, Some("long")));
    c.generate("r4", json!({"prompt": prompt_of(h, 16), "max_tokens": 1})).await;
    assert_eq!(c.collect("r4").await.done().usage.completion_tokens, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frames_are_fatal() {
    let h = harness();
    let srv = h.start(ServerConfig { max_frame_bytes: 4096, ..ServerConfig::default() }).await;
    // Just over the limit: an error frame, then close 1009.
    let mut c = srv.client().await;
    c.open().await;
    let text = json!({"type": "generate", "request_id": "x", "prompt": "a".repeat(4096)}).to_string();
    c.send_text(&text).await;
    let e = c.expect_error().await;
    assert_eq!(e.code, ErrorCode::FrameTooLarge);
    assert_eq!(c.expect_close().await.map(|f| u16::from(f.code)), Some(1009));
    // Far over (refused by the WebSocket layer from the frame header).
    let mut c = srv.client().await;
    c.open().await;
    c.send_raw(Message::text("b".repeat(1 << 20))).await;
    match c.next_raw().await {
        Some(Message::Text(t)) => {
            let e = match ServerMessage::from_json(t.as_str()).unwrap() {
                ServerMessage::Error(e) => e,
                other => panic!("{other:?}"),
            };
            assert_eq!(e.code, ErrorCode::FrameTooLarge);
        }
        other => panic!("expected the frame_too_large error, got {other:?}"),
    }
    // A binary frame over the limit is fatal as well.
    let mut c = srv.client().await;
    c.send_raw(Message::binary(vec![0u8; 5000])).await;
    assert_eq!(c.expect_error().await.code, ErrorCode::FrameTooLarge);
    assert_eq!(c.expect_close().await.map(|f| u16::from(f.code)), Some(1009));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flooding_is_rate_limited_then_recovers() {
    let h = harness();
    let srv = h.start(ServerConfig { rate_limit_per_sec: 10.0, rate_limit_burst: 5.0, ..ServerConfig::default() }).await;
    let mut c = srv.client().await;
    for i in 0..20 {
        c.send(&json!({"type": "ping", "id": i})).await;
    }
    let (mut pongs, mut limited) = (0, 0);
    for _ in 0..20 {
        match c.recv().await {
            ServerMessage::Pong(_) => pongs += 1,
            ServerMessage::Error(e) if e.code == ErrorCode::RateLimited => limited += 1,
            other => panic!("{other:?}"),
        }
    }
    assert!(pongs >= 5 && limited >= 10, "pongs {pongs}, rate_limited {limited}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.send(&json!({"type": "ping", "id": "after"})).await;
    assert!(matches!(c.recv().await, ServerMessage::Pong(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_limit_gives_server_busy() {
    let h = harness();
    let srv = h.start(ServerConfig { max_sessions: 1, ..ServerConfig::default() }).await;
    let mut a = srv.client().await;
    a.open().await;
    let mut b = srv.client().await;
    b.send(&json!({"type": "session.open"})).await;
    assert_eq!(b.expect_error().await.code, ErrorCode::ServerBusy);
    assert_eq!(b.expect_close().await.map(|f| u16::from(f.code)), Some(1013));
    a.send(&json!({"type": "session.close"})).await;
    a.expect_close().await;
    let mut c = srv.client().await;
    c.open().await;
}

/// Clients that close their socket without `session.close` (a closed
/// browser tab) leave detached sessions awaiting a resume; at the limit a
/// new client wins over them: the session detached longest is ended (its
/// resume gets `session_expired`) and counted in /metrics. Attached
/// sessions alone still make the server busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detached_sessions_make_room_for_new_clients_at_the_limit() {
    let h = harness();
    let srv = h.start(ServerConfig { max_sessions: 3, session_ttl: Duration::from_secs(600), ..ServerConfig::default() }).await;
    let mut gone = Vec::new();
    for i in 0..3 {
        let mut c = srv.client().await;
        let ready = c.open().await;
        c.generate(&format!("tab-{i}"), json!({"prompt": "Hello", "max_tokens": 2})).await;
        c.collect(&format!("tab-{i}")).await;
        c.drop_connection();
        gone.push(ready);
        // Detached in this order, so the first is the oldest.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The server notices the last drop on its own time.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut fresh = Vec::new();
    for _ in 0..3 {
        let mut c = srv.client().await;
        c.open().await;
        fresh.push(c);
    }
    let mut busy = srv.client().await;
    busy.send(&json!({"type": "session.open"})).await;
    assert_eq!(busy.expect_error().await.code, ErrorCode::ServerBusy, "attached sessions alone fill the server");
    let mut late = srv.client().await;
    late.send(&json!({"type": "session.open", "session_id": gone[0].session_id, "resume_token": gone[0].resume_token})).await;
    assert_eq!(late.expect_error().await.code, ErrorCode::SessionExpired);
    let (_, metrics) = srv.http_get("/metrics").await;
    let evicted = metrics.lines().find_map(|l| l.strip_prefix("tether_sessions_evicted_total ")).expect("evictions in /metrics");
    assert_eq!(evicted.trim(), "3", "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_time_out_and_the_session_survives() {
    let h = harness();
    let srv = h.start(ServerConfig { idle_timeout: Duration::from_millis(300), ..ServerConfig::default() }).await;
    let mut c = srv.client().await;
    let ready = c.open().await;
    assert_eq!(ready.limits.idle_timeout_ms, 300);
    let e = c.expect_error().await;
    assert_eq!(e.code, ErrorCode::IdleTimeout);
    assert_eq!(c.expect_close().await.map(|f| u16::from(f.code)), Some(1001));
    let mut c = srv.client().await;
    let r = c.resume(&ready.session_id, &ready.resume_token, json!({})).await;
    assert!(r.resumed);
    assert_eq!(r.session_id, ready.session_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_and_origin() {
    let h = harness();
    let srv =
        h.start(ServerConfig { auth_token: Some("s3cret-token".into()), allowed_origins: vec!["https://app.example".into()], ..ServerConfig::default() }).await;
    let url = srv.url("/v1/ws");
    // Missing or wrong token: 401 with the protocol's error body.
    for headers in [vec![], vec![("authorization", "Bearer nope")], vec![("sec-websocket-protocol", "tether.bearer.nope")]] {
        let Err((status, body)) = Client::connect_with(&url, &headers).await else { panic!("accepted without a valid token: {headers:?}") };
        assert_eq!(status, 401);
        assert!(body.contains("\"code\":\"unauthorized\""), "{body}");
    }
    let Err((status, _)) = Client::connect_with(&format!("{url}?token=nope"), &[]).await else { panic!() };
    assert_eq!(status, 401);
    // A disallowed Origin: 403, even with the token.
    let Err((status, body)) = Client::connect_with(&url, &[("authorization", "Bearer s3cret-token"), ("origin", "https://evil.example")]).await else {
        panic!("accepted a disallowed origin")
    };
    assert_eq!(status, 403);
    assert!(body.contains("origin_not_allowed"), "{body}");

    // Header, query and subprotocol tokens all work.
    let (mut c, _) = Client::connect_with(&url, &[("authorization", "Bearer s3cret-token"), ("origin", "https://app.example")]).await.unwrap();
    c.open().await;
    let (mut c, _) = Client::connect_with(&format!("{url}?token=s3cret-token"), &[]).await.unwrap();
    c.open().await;
    let (mut c, proto) = Client::connect_with(&url, &[("sec-websocket-protocol", "tether.v1, tether.bearer.s3cret-token")]).await.unwrap();
    assert_eq!(proto.as_deref(), Some("tether.v1"));
    c.open().await;
    let (mut c, proto) = Client::connect_with(&url, &[("sec-websocket-protocol", "tether.bearer.s3cret-token")]).await.unwrap();
    assert_eq!(proto.as_deref(), Some("tether.bearer.s3cret-token"));
    c.open().await;
    // /healthz needs no token; /metrics does.
    assert_eq!(srv.http_get("/healthz").await.0, 200);
    assert_eq!(srv.http_get("/metrics").await.0, 401);
    assert_eq!(srv.http_get("/metrics?token=s3cret-token").await.0, 200);
}
