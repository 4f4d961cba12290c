//! From engine events to a client, whatever the edge: token ids become text
//! (held back while a multi-byte character or a possible stop string is
//! incomplete), a stop string ends the turn, and the request ends with its
//! usage and timing or an error. Each edge supplies a [`Writer`] that puts
//! these on its own wire (protocol v1 frames, server-sent events, one JSON
//! body); the relay is the same for all of them.
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::{ErrorCode, FinishReason, SpeculativeStats, Timing, TokenLogprob as WireLogprob, ToolCall, TopLogprob, Usage};
use tokio::sync::mpsc;

use super::ServerState;
use crate::engine::speculate::SpecStats;
use crate::engine::{EngineError, EngineEvent, Finish, StopHandle, StopReason, TokenLogprob};
use crate::stop::{StopMatcher, StopScan};
use crate::tools::{CallSplitter, Split};

/// A piece of the output.
pub struct Piece {
    /// Text to show (may be empty while a character or stop string is incomplete).
    pub text: String,
    /// The token ids this step produced (none for a final flush of held-back text).
    pub token_ids: Vec<u32>,
    /// One per token id, when the request asked for logprobs.
    pub logprobs: Option<Vec<WireLogprob>>,
    /// Tool calls completed in this piece (their text is not in `text`).
    pub tool_calls: Vec<ToolCall>,
}

/// How a request ended, when it ran to an end.
pub struct Finished {
    pub reason: FinishReason,
    /// The stop string that ended it (not an end-of-sequence token).
    pub stop_string: Option<String>,
    pub usage: Usage,
    pub timing: Timing,
    pub speculative: Option<SpeculativeStats>,
}

/// A request's end as the client hears it.
pub type Ending = Result<Finished, (ErrorCode, String)>;

/// An edge's way of putting a request's output on its wire.
pub trait Writer: Send {
    /// Sends a piece; false when the client is gone (the request is then
    /// cancelled and nothing more is sent).
    fn piece(&mut self, piece: Piece) -> impl Future<Output = bool> + Send;
    /// Sends the end (only while the client is still there).
    fn end(&mut self, ending: Ending) -> impl Future<Output = ()> + Send;
    /// Who cancelled a request the engine reports as cancelled: `Some(true)`
    /// the client (it ends as `cancelled`), `Some(false)` the server (an
    /// error), `None` nobody this edge knows of.
    fn cancel_origin(&self) -> Option<bool> {
        None
    }
}

/// One submitted request's relay.
pub struct Relay {
    pub state: Arc<ServerState>,
    pub stop: StopHandle,
    /// Stop strings; the text before the first one is emitted, the turn ends there.
    pub stops: Vec<String>,
    /// `Some(top)`: report each token's logprob with `top` alternatives.
    pub logprobs: Option<u8>,
    /// When the request arrived, was submitted to the engine, and how long
    /// tokenizing took of that.
    pub received: Instant,
    pub submitted: Instant,
    pub tokenizing: Duration,
    pub prompt_tokens: usize,
    /// Splits tool calls from the text, when the request offered tools.
    pub tool_calls: Option<CallSplitter>,
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// Logprobs on the wire are finite and at most 0.
fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp.min(0.0)
    } else {
        f32::MIN
    }
}

/// The wire form of a finished request's speculation counters.
fn wire_speculative(s: &SpecStats) -> SpeculativeStats {
    SpeculativeStats {
        drafted: s.drafted,
        accepted: s.accepted,
        acceptance_by_position: s.acceptance_by_position(),
        tokens_per_forward: s.tokens_per_forward(),
    }
}

/// The error a client gets for an engine's refusal or failure.
pub fn engine_error(e: &EngineError) -> (ErrorCode, String) {
    let code = match e {
        EngineError::Overloaded { .. } => ErrorCode::Overloaded,
        EngineError::ShuttingDown => ErrorCode::ShuttingDown,
        EngineError::ContextOverflow { .. } | EngineError::OverKvBudget { .. } => ErrorCode::ContextOverflow,
        EngineError::Internal(_) | EngineError::Constraint(_) => ErrorCode::Internal,
    };
    let message = match code {
        ErrorCode::Overloaded => format!("{e}; retry later"),
        ErrorCode::Internal => format!("generation failed: {e}"),
        _ => e.to_string(),
    };
    (code, message)
}

/// Text and calls of a piece, through the request's call splitter if any.
fn split(calls: &mut Option<CallSplitter>, text: String, end: bool) -> (String, Vec<ToolCall>) {
    let Some(splitter) = calls else { return (text, Vec::new()) };
    let Split { text: mut out, mut calls } = splitter.push(&text);
    if end {
        let rest = splitter.finish();
        out.push_str(&rest.text);
        calls.extend(rest.calls);
    }
    let calls = calls.into_iter().map(|c| ToolCall { id: super::session::new_secret("call_"), name: c.name, arguments: c.arguments }).collect();
    (out, calls)
}

impl Relay {
    fn wire_logprobs(&self, lps: &[TokenLogprob]) -> Option<Vec<WireLogprob>> {
        let top = self.logprobs?;
        Some(
            lps.iter()
                .map(|l| WireLogprob {
                    token_id: l.token_id,
                    logprob: finite(l.logprob),
                    top: (top > 0).then(|| l.top.iter().map(|&(token_id, lp)| TopLogprob { token_id, logprob: finite(lp) }).collect()),
                })
                .collect(),
        )
    }

    /// Relays `events` to `writer` until the request ends.
    pub async fn run(mut self, mut events: mpsc::Receiver<EngineEvent>, writer: &mut impl Writer) {
        let tok = self.state.tokenizer.clone();
        let tags = if self.tool_calls.is_some() { crate::tools::tag_tokens(&tok) } else { Vec::new() };
        let mut decoder = tok.stream_decoder(true).keeping(tags);
        // Once a stop sequence matched (`stops.matched()`), the engine was
        // told to stop and later tokens are dropped.
        let mut stops = StopMatcher::new(self.stops.clone());
        // The client still listens (false once the writer lost it).
        let mut alive = true;
        let mut completion = 0usize;
        let mut queue_ms = None;
        let mut first_token = None;
        let outcome = loop {
            let Some(event) = events.recv().await else {
                break Err((ErrorCode::Internal, "the engine stopped before finishing the request".to_string()));
            };
            match event {
                EngineEvent::Started { queue_ms: q } => {
                    queue_ms = Some(ms(self.submitted - self.received) + q.max(0.0) as u64);
                }
                EngineEvent::Tokens { ids, logprobs } => {
                    if stops.matched().is_some() || !alive {
                        continue;
                    }
                    first_token.get_or_insert_with(Instant::now);
                    completion += ids.len();
                    self.state.metrics.generated_tokens.inc_by(ids.len() as u64);
                    let mut text = String::new();
                    for &id in &ids {
                        if let Some(t) = decoder.push(&tok, id) {
                            text.push_str(&t);
                        }
                    }
                    let text = match stops.push(&text) {
                        StopScan::Continue(t) => t,
                        StopScan::Stopped(t) => {
                            // The turn ended here: the engine keeps its
                            // state for the session's next turn.
                            self.stop.stop(StopReason::StopString);
                            t
                        }
                    };
                    let (text, tool_calls) = split(&mut self.tool_calls, text, stops.matched().is_some());
                    let piece = Piece { text, token_ids: ids, logprobs: self.wire_logprobs(&logprobs), tool_calls };
                    if !writer.piece(piece).await {
                        alive = false;
                        self.stop.stop(StopReason::Cancel);
                    }
                }
                EngineEvent::Finished(info) => {
                    if alive && stops.matched().is_none() {
                        // Text held back by the decoder or the stop matcher.
                        let tail = decoder.flush(&tok).unwrap_or_default();
                        let text = match stops.push(&tail) {
                            StopScan::Continue(t) => t + &stops.finish(),
                            StopScan::Stopped(t) => t,
                        };
                        let (text, tool_calls) = split(&mut self.tool_calls, text, true);
                        if !text.is_empty() || !tool_calls.is_empty() {
                            let piece = Piece { text, token_ids: Vec::new(), logprobs: self.logprobs.map(|_| Vec::new()), tool_calls };
                            alive = writer.piece(piece).await;
                        }
                    }
                    let called = self.tool_calls.as_ref().is_some_and(CallSplitter::made_calls);
                    let stopped = stops.matched().is_some();
                    // Calls end a turn the model (or a stop string) ended.
                    let reason = if called && (stopped || matches!(info.reason, Finish::Stop)) {
                        FinishReason::ToolCalls
                    } else if stopped {
                        FinishReason::Stop
                    } else {
                        match info.reason {
                            Finish::Stop => FinishReason::Stop,
                            Finish::Length => FinishReason::Length,
                            Finish::TimeLimit => FinishReason::TimeLimit,
                            Finish::Cancelled => match writer.cancel_origin() {
                                Some(true) => FinishReason::Cancelled,
                                Some(false) => break Err((ErrorCode::Cancelled, "the server cancelled the request (shutting down)".into())),
                                None if !alive => FinishReason::Cancelled,
                                None => break Err((ErrorCode::Cancelled, "the engine cancelled the request".into())),
                            },
                        }
                    };
                    break Ok((reason, info));
                }
                EngineEvent::Failed(e) => {
                    // Refusals (the queue, the KV budget) come before the
                    // request started; anything after is a failure.
                    let e = if queue_ms.is_some() { EngineError::Internal(e.to_string()) } else { e };
                    break Err(engine_error(&e));
                }
            }
        };
        let total = self.received.elapsed();
        let ending = match outcome {
            Ok((reason, info)) => {
                if crate::engine::tracing() {
                    let ms = |d: Duration| d.as_secs_f64() * 1e3;
                    eprintln!(
                        "[request] prompt_tokens={} cached_tokens={} tokenize_ms={:.2} submit_ms={:.2} queue_ms={} first_token_ms={:.2}",
                        info.prompt_tokens,
                        info.cached_tokens,
                        ms(self.tokenizing),
                        ms(self.submitted - self.received),
                        queue_ms.map_or(-1, |q| q as i64),
                        first_token.map_or(f64::NAN, |t| ms(t - self.received)),
                    );
                }
                self.state.metrics.request_finished(reason);
                Ok(Finished {
                    reason,
                    stop_string: stops.matched().map(str::to_string),
                    usage: Usage {
                        prompt_tokens: if info.prompt_tokens > 0 { info.prompt_tokens } else { self.prompt_tokens } as u32,
                        cached_tokens: info.cached_tokens as u32,
                        completion_tokens: completion as u32,
                    },
                    timing: Timing {
                        queue_ms: queue_ms.unwrap_or(ms(total)),
                        ttft_ms: first_token.map_or(ms(total), |t| ms(t - self.received)),
                        total_ms: ms(total),
                    },
                    speculative: info.speculative.as_ref().map(wire_speculative),
                })
            }
            Err((code, message)) => {
                self.state.metrics.request_failed(code);
                if alive {
                    self.state.metrics.error(code);
                }
                Err((code, message))
            }
        };
        if alive {
            writer.end(ending).await;
        }
    }
}

#[cfg(test)]
mod tests;
