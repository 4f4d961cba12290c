//! A request from `generate` to the engine and back, with the engine played
//! by the test: tokenizing each kind of input, the engine request built from
//! the client's choices, this server's limits and model in the checks
//! (`valid/tests.rs` has each check), and the whole path through a
//! session's ring.
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::{
    CacheScopeName, ChatMessage, DraftSourceName, ErrorCode, FimExtra, FimInput, GenerateInput, GenerateRequest, ProtocolError, ServerMessage,
    SpeculationOptions,
};

use super::{
    check_accepting, generate_limits, prepare, speculation_for, start, submit_request, tokenize, FimTokens, InFlight, Length, ServedModel, ValidGenerate,
};
use crate::engine::speculate::{DraftKind, Speculation};
use crate::engine::{Command, EngineEvent, Finish, FinishInfo, Scope, StopReason};
use crate::server::conn::ConnCtl;
use crate::server::testing::{self, ids, END};
use crate::server::{ServerConfig, ServerState};

fn state() -> Arc<ServerState> {
    testing::state(ServerConfig::default()).0
}

fn generate(input: GenerateInput) -> GenerateRequest {
    GenerateRequest { max_tokens: 8, ..GenerateRequest::new("r1", input) }
}

fn prompt(text: &str) -> GenerateInput {
    GenerateInput::Prompt(text.into())
}

/// The token ids `tokenize` gives `input` on `state`'s tokenizer (no tools).
fn tokens(state: &ServerState, fim: Option<&FimTokens>, input: &GenerateInput) -> Result<Vec<u32>, ProtocolError> {
    tokenize(&state.tokenizer, fim, input, false, (&[], state.tool_prompting), None).map(|(ids, _)| ids)
}

#[test]
fn a_prompt_is_its_text_with_special_tokens_and_messages_go_through_the_template() {
    let state = state();
    assert_eq!(tokens(&state, None, &prompt("abc")).unwrap(), ids("abc"));
    assert_eq!(tokens(&state, None, &prompt("a<|end|>")).unwrap(), [u32::from(b'a'), END], "as `tether generate` reads a prompt");
    let messages: Vec<ChatMessage> = serde_json::from_value(serde_json::json!([{"role": "user", "content": "hi"}])).unwrap();
    let rendered = "<user>hi\n<assistant>";
    assert_eq!(tokens(&state, None, &GenerateInput::Messages(messages)).unwrap(), ids(rendered));
    let empty = tokens(&state, None, &prompt("")).unwrap_err();
    assert_eq!(empty.code, ErrorCode::InvalidParameter);
    assert!(empty.message.contains("the input is empty"), "{}", empty.message);
}

#[test]
fn fill_in_the_middle_lays_out_its_parts_and_never_reads_control_tokens_from_user_text() {
    let state = state();
    let fim_tokens = |file_sep| FimTokens { prefix: 9001, suffix: 9002, middle: 9003, file_sep };
    let input = GenerateInput::Fim(FimInput {
        prefix: "a<|end|>".into(),
        suffix: "b".into(),
        extra: vec![FimExtra { path: Some("x.py".into()), content: "c".into() }],
    });
    let with_sep = tokens(&state, Some(&fim_tokens(Some(9004))), &input).unwrap();
    let want: Vec<u32> = [vec![9004], ids("x.py\nc\n"), vec![9001], ids("a<|end|>"), vec![9002], ids("b"), vec![9003]].concat();
    assert_eq!(with_sep, want);
    assert!(!with_sep.contains(&END), "`<|end|>` typed by the user stays text");
    // Without a file separator token, a newline separates the files.
    let without = tokens(&state, Some(&fim_tokens(None)), &input).unwrap();
    assert_eq!(without[..ids("\nx.py\nc\n").len()], ids("\nx.py\nc\n"));
    assert_eq!(tokens(&state, None, &input).unwrap_err().code, ErrorCode::FimUnsupported);
}

/// `req` checked on `state` as asked, its prompt tokenized.
fn valid(state: &ServerState, req: GenerateRequest) -> ValidGenerate {
    let mut model = ServedModel { state, earlier: None, encoding: None, tokenizing: Duration::ZERO };
    ValidGenerate::new(req, Length::AsAsked, &generate_limits(state), &mut model).unwrap()
}

#[test]
fn the_engine_request_carries_the_clients_choices() {
    let state = state();
    let received = Instant::now();
    let submit = |req| submit_request(&state, "owner", valid(&state, req), received).0;
    let plain = submit(generate(prompt("abc")));
    assert_eq!((plain.prompt, plain.max_tokens), (ids("abc"), 8));
    let s = &plain.sampling;
    assert_eq!((s.temperature, s.top_k, s.top_p, s.min_p, s.seed), (0.0, 0, 1.0, 0.0, None), "greedy, no filters");
    assert_eq!(plain.stop_ids, [END], "the model's end-of-sequence tokens");
    assert_eq!((plain.logprobs, plain.prefill_chunk, plain.deadline), (None, None, None));
    assert_eq!(plain.cache_scope, Some(Scope::Session("owner".into())), "private to its owner unless asked");
    assert_eq!(plain.session.as_deref(), Some("owner"));

    let asked = GenerateRequest {
        temperature: 0.7,
        top_k: Some(5),
        top_p: Some(0.9),
        min_p: Some(0.1),
        seed: Some(3),
        logprobs: true,
        top_logprobs: Some(2),
        chunk_size: Some(1 << 20),
        cache: Some(CacheScopeName::Shared),
        max_time_ms: Some(1500),
        ..generate(prompt("abc"))
    };
    let r = submit(asked);
    let s = &r.sampling;
    assert_eq!((s.temperature, s.top_k, s.top_p, s.min_p, s.seed), (0.7, 5, 0.9, 0.1, Some(3)));
    assert_eq!(r.logprobs, Some(2));
    assert_eq!(r.prefill_chunk, Some(state.config.max_prefill_chunk), "a chunk is held to the server's limit");
    assert_eq!(r.cache_scope, Some(Scope::Shared));
    assert_eq!(r.deadline, Some(received + Duration::from_millis(1500)));
    let logprobs_only = GenerateRequest { logprobs: true, ..generate(prompt("abc")) };
    assert_eq!(submit(logprobs_only).logprobs, Some(0));
}

#[test]
fn a_requests_speculation_overrides_the_servers_default() {
    let default = Speculation { kind: DraftKind::Echo, max_draft: 6, grammar_drafts: true };
    let asked = |source, max_draft| speculation_for(&default, Some(SpeculationOptions { source, max_draft }));
    assert_eq!(speculation_for(&default, None), default);
    assert_eq!(asked(None, Some(3)), Speculation { max_draft: 3, ..default.clone() });
    assert_eq!(asked(Some(DraftSourceName::DraftModel), None), Speculation { kind: DraftKind::Model, ..default.clone() });
    // Only an explicit "off" also stops a grammar's forced drafts.
    assert_eq!(asked(Some(DraftSourceName::Off), None), Speculation { kind: DraftKind::Off, max_draft: 6, grammar_drafts: false });
    let off_server = Speculation { kind: DraftKind::Off, ..default.clone() };
    assert_eq!(speculation_for(&off_server, Some(SpeculationOptions { source: Some(DraftSourceName::Echo), max_draft: None })).kind, DraftKind::Echo);
}

#[tokio::test]
async fn the_servers_limits_and_model_are_what_a_request_is_checked_against() {
    let state = state();
    let refused = |req: GenerateRequest| {
        let state = state.clone();
        async move { prepare(&state, "owner", req, Length::AsAsked, None, Instant::now()).await.err().unwrap() }
    };
    let fim = generate(GenerateInput::Fim(FimInput { prefix: "a".into(), suffix: "b".into(), extra: Vec::new() }));
    let e = refused(fim).await;
    assert_eq!((e.code, e.request_id.as_deref()), (ErrorCode::FimUnsupported, Some("r1")), "this model has no FIM tokens");
    let draft =
        GenerateRequest { speculation: Some(SpeculationOptions { source: Some(DraftSourceName::DraftModel), max_draft: None }), ..generate(prompt("abc")) };
    let e = refused(draft).await;
    assert_eq!(e.code, ErrorCode::InvalidParameter);
    assert!(e.message.contains("--draft-model"), "{}", e.message);
    let limit = state.limits.max_tokens;
    let e = refused(GenerateRequest { max_tokens: limit + 1, ..generate(prompt("abc")) }).await;
    assert_eq!(e.message, format!("max_tokens must be in [0, {limit}], got {}", limit + 1));
    let long = "x".repeat(state.limits.max_prompt_tokens as usize + 1);
    let e = refused(GenerateRequest { max_tokens: 0, ..generate(prompt(&long)) }).await;
    assert_eq!((e.code, e.request_id.as_deref()), (ErrorCode::PromptTooLong, Some("r1")), "the tiny vocabulary's tokens are bytes");
    let e = refused(generate(prompt(""))).await;
    assert!(e.message.contains("the input is empty"), "the tokenizer's verdict: {}", e.message);
    let prepared = prepare(&state, "owner", generate(prompt("abc")), Length::FillContext, None, Instant::now()).await.unwrap();
    let room = state.limits.context_length as usize - ids("abc").len();
    assert_eq!(prepared.request.max_tokens as usize, room.min(state.config.default_max_tokens).min(state.limits.max_tokens as usize));
    assert_eq!(prepared.submit.max_tokens, prepared.request.max_tokens as usize);
}

#[test]
fn a_draining_server_accepts_no_request() {
    let state = state();
    check_accepting(&state, "r1").unwrap();
    state.draining.store(true, std::sync::atomic::Ordering::Release);
    let e = check_accepting(&state, "r1").unwrap_err();
    assert_eq!((e.code, e.request_id.as_deref()), (ErrorCode::ShuttingDown, Some("r1")));
}

#[test]
fn a_request_counts_in_flight_while_its_guard_lives() {
    let state = state();
    let guard = InFlight::new(state.clone(), 5);
    assert_eq!((state.in_flight(), state.metrics.requests_in_flight.get(), state.metrics.prompt_tokens.get()), (1, 1, 5));
    drop(guard);
    assert_eq!((state.in_flight(), state.metrics.requests_in_flight.get()), (0, 0));
}

/// The session's frames until (and with) the request's last one.
async fn frames_until_the_end(session: &crate::server::session::Session, conn_id: u64) -> Vec<ServerMessage> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        for f in session.pull(conn_id, 16).expect("the connection holds the session") {
            got.push(serde_json::from_str::<ServerMessage>(&f).unwrap());
        }
        if matches!(got.last(), Some(ServerMessage::Done(_) | ServerMessage::Error(_))) {
            return got;
        }
        assert!(Instant::now() < deadline, "no end after {got:?}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test]
async fn a_generate_reaches_the_engine_and_its_events_come_back_as_numbered_frames() {
    let (state, commands) = testing::state(ServerConfig::default());
    let conn = ConnCtl::new(1);
    let session = state.sessions.create(conn.clone(), &state.engines).unwrap().session;
    start(&state, &session, conn.id, generate(prompt("abc")), Instant::now()).await.unwrap();
    let Command::Submit(submission) = testing::next_command(&commands) else { panic!("the engine's first command is not the submit") };
    assert_eq!(submission.request.prompt, ids("abc"));
    assert_eq!(submission.request.cache_scope, Some(Scope::Session(session.id.clone())));
    assert_eq!((state.in_flight(), session.running()), (1, 1));
    let again = start(&state, &session, conn.id, generate(prompt("abc")), Instant::now()).await.unwrap_err();
    assert_eq!(again.code, ErrorCode::DuplicateRequest);

    for event in [
        EngineEvent::Started { queue_ms: 0.0 },
        EngineEvent::Tokens { ids: vec![u32::from(b'd')], logprobs: Vec::new() },
        EngineEvent::Tokens { ids: vec![u32::from(b'e')], logprobs: Vec::new() },
        EngineEvent::Finished(FinishInfo { reason: Finish::Length, prompt_tokens: 3, cached_tokens: 0, completion_tokens: 2, speculative: None }),
    ] {
        submission.events.send(event).await.unwrap();
    }
    let frames = frames_until_the_end(&session, conn.id).await;
    let [ServerMessage::Delta(d), ServerMessage::Delta(e), ServerMessage::Done(done)] = &frames[..] else { panic!("{frames:?}") };
    assert_eq!([(d.seq, d.text.as_str()), (e.seq, e.text.as_str())], [(1, "d"), (2, "e")]);
    assert!(d.request_id == "r1" && done.request_id == "r1");
    assert_eq!((done.seq, done.finish_reason, done.usage.completion_tokens, done.usage.prompt_tokens), (3, protocol::FinishReason::Length, 2, 3));
    // The request lets go of the session, then of the server's count.
    let deadline = Instant::now() + Duration::from_secs(10);
    while state.in_flight() > 0 {
        assert!(Instant::now() < deadline, "the request never ended");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(session.running(), 0);
    assert_eq!(submission.stop.requested(), None);
}

#[tokio::test]
async fn a_cancel_reaches_the_engine_and_the_request_ends_as_cancelled() {
    let (state, commands) = testing::state(ServerConfig::default());
    let conn = ConnCtl::new(1);
    let session = state.sessions.create(conn.clone(), &state.engines).unwrap().session;
    start(&state, &session, conn.id, generate(prompt("abc")), Instant::now()).await.unwrap();
    let Command::Submit(submission) = testing::next_command(&commands) else { panic!("the engine's first command is not the submit") };
    session.cancel("r1").unwrap();
    assert_eq!(submission.stop.requested(), Some(StopReason::Cancel), "no command needed: the engine reads the stop handle");
    submission
        .events
        .send(EngineEvent::Finished(FinishInfo { reason: Finish::Cancelled, prompt_tokens: 3, cached_tokens: 0, completion_tokens: 0, speculative: None }))
        .await
        .unwrap();
    let frames = frames_until_the_end(&session, conn.id).await;
    let [ServerMessage::Done(done)] = &frames[..] else { panic!("{frames:?}") };
    assert_eq!(done.finish_reason, protocol::FinishReason::Cancelled);
}
