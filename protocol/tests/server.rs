//! Server messages: exact JSON for each, and parse-back round trips.
//! Also the error-code catalogue.

use std::collections::HashSet;

use protocol::{
    Delta, Done, ErrorCode, ErrorFrame, FinishReason, Limits, ModelInfo, PingId, Pong, ServerMessage, SessionReady, SpeculativeStats, Timing, TokenLogprob,
    ToolCall, TopLogprob, Usage, PROTOCOL_VERSION, SERVER_MESSAGE_TYPES,
};
use serde_json::{json, Value};

/// `msg` serializes to exactly `expected` (as JSON values, and with `type`
/// as the first key), and parses back to an equal message.
fn round_trip(msg: ServerMessage, expected: Value) {
    let text = msg.to_json();
    assert!(text.starts_with(&format!(r#"{{"type":"{}""#, msg.type_name())), "type first: {text}");
    assert!(!text.contains('\n'), "one line per frame");
    let got: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(got, expected, "serialized form of {msg:?}");
    assert!(!text.contains("null"), "optional fields are omitted, never null: {text}");
    let back = ServerMessage::from_json(&text).unwrap_or_else(|e| panic!("{text} does not parse back: {e}"));
    assert_eq!(back, msg);
    assert!(SERVER_MESSAGE_TYPES.contains(&msg.type_name()));
}

fn limits() -> Limits {
    Limits {
        max_frame_bytes: 1_048_576,
        max_prompt_tokens: 30_000,
        max_tokens: 4096,
        max_in_flight: 4,
        session_ttl_ms: 300_000,
        idle_timeout_ms: 60_000,
        context_length: 32_768,
    }
}

#[test]
fn session_ready() {
    let msg = ServerMessage::SessionReady(SessionReady {
        protocol_version: PROTOCOL_VERSION,
        session_id: "s_7f3a".into(),
        resume_token: "rt_9b1c".into(),
        resumed: false,
        model: ModelInfo { name: "qwen2.5-coder-1.5b".into(), architecture: "qwen2".into(), context_length: 32_768, vocab_size: 151_936, fim: true },
        limits: limits(),
    });
    round_trip(
        msg,
        json!({
            "type": "session.ready", "protocol_version": 1,
            "session_id": "s_7f3a", "resume_token": "rt_9b1c", "resumed": false,
            "model": {"name": "qwen2.5-coder-1.5b", "architecture": "qwen2", "context_length": 32768, "vocab_size": 151936, "fim": true},
            "limits": {"max_frame_bytes": 1048576, "max_prompt_tokens": 30000, "max_tokens": 4096, "max_in_flight": 4,
                       "session_ttl_ms": 300000, "idle_timeout_ms": 60000, "context_length": 32768},
        }),
    );
}

#[test]
fn delta_plain() {
    let msg = ServerMessage::Delta(Delta { request_id: "r1".into(), seq: 1, text: "Hello".into(), token_ids: vec![9707], logprobs: None });
    assert_eq!(msg.to_json(), r#"{"type":"delta","request_id":"r1","seq":1,"text":"Hello","token_ids":[9707]}"#);
    assert_eq!((msg.request_id(), msg.seq()), (Some("r1"), Some(1)));
    round_trip(msg, json!({"type": "delta", "request_id": "r1", "seq": 1, "text": "Hello", "token_ids": [9707]}));
}

#[test]
fn delta_with_logprobs_and_unicode() {
    let msg = ServerMessage::Delta(Delta {
        request_id: "r1".into(),
        seq: 2,
        text: " wörld \"✓\"\n".into(),
        token_ids: vec![1917, 11],
        logprobs: Some(vec![
            TokenLogprob {
                token_id: 1917,
                logprob: -0.25,
                top: Some(vec![TopLogprob { token_id: 1917, logprob: -0.25 }, TopLogprob { token_id: 4337, logprob: -1.5 }]),
            },
            TokenLogprob { token_id: 11, logprob: -0.125, top: None },
        ]),
    });
    round_trip(
        msg,
        json!({"type": "delta", "request_id": "r1", "seq": 2, "text": " wörld \"✓\"\n", "token_ids": [1917, 11],
        "logprobs": [
            {"token_id": 1917, "logprob": -0.25, "top": [{"token_id": 1917, "logprob": -0.25}, {"token_id": 4337, "logprob": -1.5}]},
            {"token_id": 11, "logprob": -0.125},
        ]}),
    );
}

#[test]
fn delta_with_empty_text() {
    // A token that is only part of a multi-byte character.
    round_trip(
        ServerMessage::Delta(Delta { request_id: "r1".into(), seq: 3, text: String::new(), token_ids: vec![158], logprobs: None }),
        json!({"type": "delta", "request_id": "r1", "seq": 3, "text": "", "token_ids": [158]}),
    );
}

#[test]
fn done_for_each_finish_reason() {
    for (reason, wire) in
        [(FinishReason::Stop, "stop"), (FinishReason::Length, "length"), (FinishReason::Cancelled, "cancelled"), (FinishReason::TimeLimit, "time_limit")]
    {
        assert_eq!(reason.as_str(), wire);
        let msg = ServerMessage::Done(Done {
            request_id: "r1".into(),
            seq: 4,
            finish_reason: reason,
            usage: Usage { prompt_tokens: 12, cached_tokens: 8, completion_tokens: 3 },
            timing: Timing { queue_ms: 1, ttft_ms: 35, total_ms: 80 },
            speculative: None,
            tool_calls: Vec::new(),
        });
        assert_eq!(msg.seq(), Some(4));
        round_trip(
            msg,
            json!({"type": "done", "request_id": "r1", "seq": 4, "finish_reason": wire,
                   "usage": {"prompt_tokens": 12, "cached_tokens": 8, "completion_tokens": 3},
                   "timing": {"queue_ms": 1, "ttft_ms": 35, "total_ms": 80}}),
        );
    }
}

#[test]
fn done_with_speculation_stats() {
    let msg = ServerMessage::Done(Done {
        request_id: "r1".into(),
        seq: 2,
        finish_reason: FinishReason::Length,
        usage: Usage { prompt_tokens: 40, cached_tokens: 0, completion_tokens: 9 },
        timing: Timing { queue_ms: 0, ttft_ms: 20, total_ms: 50 },
        speculative: Some(SpeculativeStats { drafted: 8, accepted: 6, acceptance_by_position: vec![1.0, 0.5], tokens_per_forward: 2.25 }),
        tool_calls: Vec::new(),
    });
    round_trip(
        msg,
        json!({"type": "done", "request_id": "r1", "seq": 2, "finish_reason": "length",
               "usage": {"prompt_tokens": 40, "cached_tokens": 0, "completion_tokens": 9},
               "timing": {"queue_ms": 0, "ttft_ms": 20, "total_ms": 50},
               "speculative": {"drafted": 8, "accepted": 6, "acceptance_by_position": [1.0, 0.5], "tokens_per_forward": 2.25}}),
    );
}

#[test]
fn done_with_tool_calls() {
    let msg = ServerMessage::Done(Done {
        request_id: "r1".into(),
        seq: 1,
        finish_reason: FinishReason::ToolCalls,
        usage: Usage { prompt_tokens: 40, cached_tokens: 0, completion_tokens: 20 },
        timing: Timing { queue_ms: 0, ttft_ms: 20, total_ms: 50 },
        speculative: None,
        tool_calls: vec![ToolCall { id: "call_1".into(), name: "get_weather".into(), arguments: "{\"city\":\"Paris\"}".into() }],
    });
    round_trip(
        msg,
        json!({"type": "done", "request_id": "r1", "seq": 1, "finish_reason": "tool_calls",
               "usage": {"prompt_tokens": 40, "cached_tokens": 0, "completion_tokens": 20},
               "timing": {"queue_ms": 0, "ttft_ms": 20, "total_ms": 50},
               "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}]}),
    );
}

#[test]
fn error_with_and_without_request_id() {
    let msg = ServerMessage::error(ErrorCode::TooManyRequests, "4 requests already in flight", Some("r5".into()));
    assert_eq!(msg.request_id(), Some("r5"));
    round_trip(msg, json!({"type": "error", "request_id": "r5", "code": "too_many_requests", "message": "4 requests already in flight"}));
    let msg = ServerMessage::Error(ErrorFrame { request_id: None, code: ErrorCode::BadJson, message: "invalid JSON".into() });
    assert_eq!(msg.to_json(), r#"{"type":"error","code":"bad_json","message":"invalid JSON"}"#);
    round_trip(msg, json!({"type": "error", "code": "bad_json", "message": "invalid JSON"}));
}

#[test]
fn error_frames_for_every_code() {
    for code in ErrorCode::ALL {
        round_trip(
            ServerMessage::error(code, format!("about {code}"), None),
            json!({"type": "error", "code": code.as_str(), "message": format!("about {}", code.as_str())}),
        );
    }
}

#[test]
fn pong_variants() {
    round_trip(ServerMessage::Pong(Pong::default()), json!({"type": "pong"}));
    round_trip(ServerMessage::Pong(Pong { id: Some(PingId::from(7)) }), json!({"type": "pong", "id": 7}));
    round_trip(ServerMessage::Pong(Pong { id: Some(PingId::from("hb")) }), json!({"type": "pong", "id": "hb"}));
    let float: PingId = serde_json::from_str("2.5").unwrap();
    round_trip(ServerMessage::Pong(Pong { id: Some(float) }), json!({"type": "pong", "id": 2.5}));
}

#[test]
fn from_json_rejects_unknown_fields_and_types() {
    assert!(ServerMessage::from_json(r#"{"type":"pong","extra":1}"#).is_err());
    assert!(ServerMessage::from_json(r#"{"type":"ping"}"#).is_err());
    assert!(ServerMessage::from_json(r#"{"type":"error","code":"no_such_code","message":""}"#).is_err());
}

#[test]
fn error_code_catalogue() {
    let required = [
        "bad_json",
        "binary_frame",
        "unknown_type",
        "invalid_field",
        "invalid_parameter",
        "frame_too_large",
        "prompt_too_long",
        "context_overflow",
        "unknown_request",
        "duplicate_request",
        "too_many_requests",
        "rate_limited",
        "session_not_found",
        "invalid_resume_token",
        "session_expired",
        "no_session",
        "session_already_open",
        "unauthorized",
        "origin_not_allowed",
        "server_busy",
        "fim_unsupported",
        "overloaded",
        "cancelled",
        "internal",
        "shutting_down",
        "idle_timeout",
        "replay_unavailable",
    ];
    let wire: HashSet<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    assert_eq!(wire.len(), ErrorCode::ALL.len(), "distinct wire names");
    for name in required {
        assert!(wire.contains(name), "missing code {name}");
    }
    for code in ErrorCode::ALL {
        // serde and as_str agree; from_wire inverts them.
        assert_eq!(serde_json::to_value(code).unwrap(), json!(code.as_str()));
        assert_eq!(serde_json::from_value::<ErrorCode>(json!(code.as_str())).unwrap(), code);
        assert_eq!(ErrorCode::from_wire(code.as_str()), Some(code));
        assert_eq!(code.to_string(), code.as_str());
        // Fatal codes, and only those, come with a WebSocket close code.
        assert_eq!(code.is_fatal(), code.close_code().is_some(), "{code}");
    }
    let fatal: Vec<&str> = ErrorCode::ALL.iter().filter(|c| c.is_fatal()).map(|c| c.as_str()).collect();
    assert_eq!(fatal, ["frame_too_large", "unauthorized", "origin_not_allowed", "server_busy", "shutting_down", "idle_timeout"]);
    assert_eq!(ErrorCode::from_wire("nope"), None);
}
