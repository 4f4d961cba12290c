//! The relay driven through a channel of engine events, as the engine sends
//! them, into a writer that records what a client would get.
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::{ErrorCode, FinishReason};
use tokio::sync::mpsc;

use super::{Ending, Piece, Relay, Writer};
use crate::engine::{EngineError, EngineEvent, Finish, FinishInfo, StopHandle, StopReason, TokenLogprob};
use crate::server::testing::{self, ids};
use crate::server::{ServerConfig, ServerState};

/// What a client got: the pieces, then the end (if it was still there).
#[derive(Default)]
struct Recorder {
    pieces: Vec<Piece>,
    ending: Option<Ending>,
    /// The client hangs up when handed this many pieces.
    gone_after: Option<usize>,
    /// Who cancelled, as the edge knows it.
    origin: Option<bool>,
}

impl Recorder {
    fn text(&self) -> String {
        self.pieces.iter().map(|p| p.text.as_str()).collect()
    }

    fn finished(&self) -> &super::Finished {
        match &self.ending {
            Some(Ok(f)) => f,
            Some(Err((code, message))) => panic!("ended with {code:?}: {message}"),
            None => panic!("no end was sent"),
        }
    }

    fn error(&self) -> &(ErrorCode, String) {
        match &self.ending {
            Some(Err(e)) => e,
            Some(Ok(f)) => panic!("finished ({:?}) instead of failing", f.reason),
            None => panic!("no end was sent"),
        }
    }
}

impl Writer for Recorder {
    async fn piece(&mut self, piece: Piece) -> bool {
        self.pieces.push(piece);
        self.gone_after.is_none_or(|n| self.pieces.len() < n)
    }

    async fn end(&mut self, ending: Ending) {
        assert!(self.ending.is_none(), "a request ends once");
        self.ending = Some(ending);
    }

    fn cancel_origin(&self) -> Option<bool> {
        self.origin
    }
}

fn state() -> Arc<ServerState> {
    testing::state(ServerConfig::default()).0
}

fn relay(state: &Arc<ServerState>, stops: &[&str], logprobs: Option<u8>) -> (Relay, StopHandle) {
    let stop = StopHandle::default();
    let now = Instant::now();
    let relay = Relay {
        state: state.clone(),
        stop: stop.clone(),
        stops: stops.iter().map(|s| s.to_string()).collect(),
        logprobs,
        received: now,
        submitted: now,
        tokenizing: Duration::ZERO,
        prompt_tokens: 3,
        tool_calls: None,
    };
    (relay, stop)
}

/// One `Tokens` event per token id, as a decode step sends them.
fn one_by_one(ids: &[u32]) -> Vec<EngineEvent> {
    ids.iter().map(|&id| EngineEvent::Tokens { ids: vec![id], logprobs: Vec::new() }).collect()
}

fn finished(reason: Finish) -> EngineEvent {
    EngineEvent::Finished(FinishInfo { reason, prompt_tokens: 4, cached_tokens: 2, completion_tokens: 0, speculative: None })
}

/// Runs the relay over `events` (all sent before it starts, then the
/// channel closes) into `writer`.
async fn run(relay: Relay, events: Vec<EngineEvent>, writer: &mut Recorder) {
    let (tx, rx) = mpsc::channel(events.len().max(1));
    for e in events {
        tx.try_send(e).unwrap();
    }
    drop(tx);
    relay.run(rx, writer).await;
}

fn started() -> EngineEvent {
    EngineEvent::Started { queue_ms: 0.0 }
}

/// How many requests `state` counted as ended with `finish_reason` (/metrics).
fn ended_as(state: &ServerState, finish_reason: &str) -> u64 {
    let line = format!("tether_requests_total{{finish_reason=\"{finish_reason}\"}} ");
    state.metrics.render(None).lines().find_map(|l| l.strip_prefix(line.as_str())).map_or(0, |n| n.parse().unwrap())
}

#[tokio::test]
async fn tokens_become_text_and_the_request_ends_with_its_usage() {
    let state = state();
    let (relay, stop) = relay(&state, &[], None);
    let text = "abc, de";
    let mut events = vec![started()];
    events.extend(one_by_one(&ids(text)));
    events.push(finished(Finish::Length));
    let mut client = Recorder::default();
    run(relay, events, &mut client).await;

    assert_eq!(client.text(), text);
    let sent: Vec<u32> = client.pieces.iter().flat_map(|p| p.token_ids.clone()).collect();
    assert_eq!(sent, ids(text), "every token id, in order, once");
    assert!(client.pieces.iter().all(|p| p.logprobs.is_none() && p.tool_calls.is_empty()));
    let done = client.finished();
    assert_eq!(done.reason, FinishReason::Length);
    assert_eq!(done.stop_string, None);
    // The relay counts the tokens it relayed; the engine's numbers give the prompt.
    assert_eq!((done.usage.prompt_tokens, done.usage.cached_tokens, done.usage.completion_tokens), (4, 2, ids(text).len() as u32));
    assert!(done.timing.queue_ms <= done.timing.ttft_ms && done.timing.ttft_ms <= done.timing.total_ms, "{:?}", done.timing);
    assert_eq!(stop.requested(), None, "nothing asked the engine to stop");
    assert_eq!(ended_as(&state, "length"), 1);
    assert_eq!(state.metrics.generated_tokens.get(), ids(text).len() as u64);
}

#[tokio::test]
async fn a_character_split_across_tokens_is_held_back_until_whole() {
    let state = state();
    let (relay, _) = relay(&state, &[], None);
    // "é" is two bytes, so two tokens here.
    let split = ids("é");
    assert_eq!(split.len(), 2);
    let mut events = one_by_one(&split);
    events.push(finished(Finish::Stop));
    let mut client = Recorder::default();
    run(relay, events, &mut client).await;
    let texts: Vec<&str> = client.pieces.iter().map(|p| p.text.as_str()).collect();
    assert_eq!(texts, ["", "é"], "no half character on the wire");
    assert_eq!(client.pieces[0].token_ids, split[..1], "the ids go out with their step even while the text waits");
    assert_eq!(client.finished().reason, FinishReason::Stop);
}

#[tokio::test]
async fn text_held_back_at_the_end_is_flushed_in_a_last_piece() {
    let state = state();
    // "x" could start the stop string, and the last byte starts a character
    // that never completes: both are held until the engine finishes.
    let (relay, _) = relay(&state, &["xyz"], Some(0));
    let mut token_ids = ids("abx");
    token_ids.push(0xC3);
    let mut events = one_by_one(&token_ids);
    events.push(finished(Finish::Length));
    let mut client = Recorder::default();
    run(relay, events, &mut client).await;
    assert_eq!(client.text(), "abx\u{FFFD}");
    let last = client.pieces.last().unwrap();
    assert_eq!(last.text, "x\u{FFFD}");
    assert!(last.token_ids.is_empty(), "the flush carries no tokens");
    assert_eq!(last.logprobs.as_deref(), Some(&[][..]), "nor logprobs, though they were asked for");
    assert_eq!(client.finished().usage.completion_tokens, token_ids.len() as u32);
}

#[tokio::test]
async fn a_stop_string_ends_the_turn_and_stops_the_engine() {
    let state = state();
    let (relay, stop) = relay(&state, &["lo w"], None);
    let text = ids("Hello world");
    // The engine, told to stop, may still send a token or two of its step.
    let mut events = one_by_one(&text);
    events.push(finished(Finish::Stop));
    let mut client = Recorder::default();
    run(relay, events, &mut client).await;
    assert_eq!(client.text(), "Hel");
    assert_eq!(stop.requested(), Some(StopReason::StopString));
    let done = client.finished();
    assert_eq!(done.reason, FinishReason::Stop);
    assert_eq!(done.stop_string.as_deref(), Some("lo w"));
    // Up to the token that completed "lo w"; those after it were dropped.
    assert_eq!(done.usage.completion_tokens, ids("Hello w").len() as u32);
    assert_eq!(client.pieces.len(), ids("Hello w").len());
}

#[tokio::test]
async fn a_client_that_is_gone_cancels_the_request_and_hears_no_end() {
    let state = state();
    let (relay, stop) = relay(&state, &[], None);
    let mut events = vec![started()];
    events.extend(one_by_one(&ids("abcdef")));
    events.push(finished(Finish::Cancelled));
    let mut client = Recorder { gone_after: Some(2), ..Recorder::default() };
    run(relay, events, &mut client).await;
    assert_eq!(client.pieces.len(), 2, "nothing more is sent to a client that is gone");
    assert!(client.ending.is_none());
    assert_eq!(stop.requested(), Some(StopReason::Cancel));
    assert_eq!(ended_as(&state, "cancelled"), 1);
}

#[tokio::test]
async fn who_cancelled_decides_between_done_and_an_error() {
    for (origin, want) in [
        (Some(true), Ok(FinishReason::Cancelled)),
        (Some(false), Err("the server cancelled the request (shutting down)")),
        (None, Err("the engine cancelled the request")),
    ] {
        let state = state();
        let (relay, _) = relay(&state, &[], None);
        let mut client = Recorder { origin, ..Recorder::default() };
        run(relay, vec![started(), finished(Finish::Cancelled)], &mut client).await;
        match want {
            Ok(reason) => assert_eq!(client.finished().reason, reason),
            Err(message) => assert_eq!(client.error(), &(ErrorCode::Cancelled, message.to_string()), "origin {origin:?}"),
        }
    }
}

#[tokio::test]
async fn refusals_keep_their_code_until_the_request_started_then_failures_are_internal() {
    let overflow = EngineError::ContextOverflow { prompt: 200, max_tokens: 100, context: 256 };
    let cases = [
        (vec![EngineEvent::Failed(EngineError::Overloaded { waiting: 8 })], ErrorCode::Overloaded),
        (vec![EngineEvent::Failed(overflow.clone())], ErrorCode::ContextOverflow),
        (vec![started(), EngineEvent::Failed(overflow)], ErrorCode::Internal),
        (vec![EngineEvent::Failed(EngineError::Constraint("no token allowed".into()))], ErrorCode::Internal),
    ];
    for (events, code) in cases {
        let state = state();
        let (relay, _) = relay(&state, &[], None);
        let mut client = Recorder::default();
        run(relay, events, &mut client).await;
        assert_eq!(client.error().0, code, "{}", client.error().1);
        assert_eq!(ended_as(&state, code.as_str()), 1);
    }
    let state = state();
    let (relay, _) = relay(&state, &[], None);
    let mut client = Recorder::default();
    run(relay, vec![EngineEvent::Failed(EngineError::Overloaded { waiting: 8 })], &mut client).await;
    assert!(client.error().1.ends_with("retry later"), "{}", client.error().1);
}

#[tokio::test]
async fn an_engine_that_drops_the_request_without_an_end_fails_it() {
    let state = state();
    let (relay, _) = relay(&state, &[], None);
    let mut client = Recorder::default();
    run(relay, vec![started(), one_by_one(&ids("a")).remove(0)], &mut client).await;
    assert_eq!(client.text(), "a");
    assert_eq!(client.error(), &(ErrorCode::Internal, "the engine stopped before finishing the request".to_string()));
}

#[tokio::test]
async fn logprobs_on_the_wire_are_finite_and_at_most_zero() {
    let lp = |logprob: f32, top: Vec<(u32, f32)>| TokenLogprob { token_id: 0, logprob, top };
    let step = |ids: Vec<u32>, logprobs| EngineEvent::Tokens { ids, logprobs };
    for top in [0u8, 2] {
        let state = state();
        let (relay, _) = relay(&state, &[], Some(top));
        let events = vec![
            step(ids("a"), vec![lp(-0.5, vec![(97, -0.5), (98, f32::NEG_INFINITY)])]),
            // Rounding can give a logprob a hair above 0; a NaN must not reach JSON.
            step(ids("b"), vec![lp(1e-7, vec![(98, f32::NAN), (97, -3.0)])]),
            finished(Finish::Length),
        ];
        let mut client = Recorder::default();
        run(relay, events, &mut client).await;
        let wire: Vec<_> = client.pieces.iter().flat_map(|p| p.logprobs.clone().expect("logprobs were asked for")).collect();
        assert_eq!(wire.iter().map(|l| l.logprob).collect::<Vec<_>>(), [-0.5, 0.0]);
        let tops: Vec<Option<Vec<f32>>> = wire.iter().map(|l| l.top.as_ref().map(|t| t.iter().map(|t| t.logprob).collect())).collect();
        if top == 0 {
            assert_eq!(tops, [None, None], "no alternatives unless asked for");
        } else {
            assert_eq!(tops, [Some(vec![-0.5, f32::MIN]), Some(vec![f32::MIN, -3.0])]);
        }
    }
}
