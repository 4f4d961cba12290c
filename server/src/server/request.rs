//! One `generate`: input → token ids → engine request, and the forwarding
//! task that turns engine events into `delta` / `done` frames.
use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::{
    CacheScopeName, Delta, Done, DraftSourceName, ErrorCode, FimInput, FinishReason, GenerateInput, GenerateRequest, ProtocolError, ServerMessage,
    SpeculationOptions, SpeculativeStats, Timing, TokenLogprob as WireLogprob, TopLogprob, Usage,
};
use tokio::sync::mpsc;

use super::session::{Frame, Registration, Session};
use super::ServerState;
use crate::engine::speculate::{DraftKind, SpecStats, Speculation};
use crate::engine::{EngineError, EngineEvent, Finish, Scope, StopHandle, StopReason, SubmitRequest, Submitted, TokenLogprob};
use crate::sample::SamplingParams;
use crate::stop::{StopMatcher, StopScan};
use crate::tokenizer::{ChatMessage, PieceEncoding, TextTokenizer, TokenizerError};

/// Qwen2.5-Coder-style fill-in-the-middle tokens.
#[derive(Clone, Copy, Debug)]
pub struct FimTokens {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
    /// `<|file_sep|>`, for extra context files.
    pub file_sep: Option<u32>,
}

impl FimTokens {
    /// The model's FIM tokens, if it has all three.
    pub fn detect(tok: &TextTokenizer) -> Option<FimTokens> {
        let id = |t: &str| tok.token_id(t).filter(|&id| tok.token_kind(id).is_some());
        Some(FimTokens { prefix: id("<|fim_prefix|>")?, suffix: id("<|fim_suffix|>")?, middle: id("<|fim_middle|>")?, file_sep: id("<|file_sep|>") })
    }
}

fn tokenizer_error(e: TokenizerError) -> ProtocolError {
    match e {
        TokenizerError::NoChatTemplate => ProtocolError::invalid_parameter("this model has no chat template: send `prompt` instead of `messages`"),
        TokenizerError::TemplateRaised(m) | TokenizerError::TemplateRender(m) => {
            ProtocolError::invalid_parameter(format!("the model's chat template rejected these messages: {m}"))
        }
        other => ProtocolError::new(ErrorCode::Internal, format!("tokenizing the input failed: {other}")),
    }
}

/// Token ids of a request's input.
///
/// * `prompt`: BOS when the model wants it, then the text with special-token
///   text parsed (as `tether generate` does).
/// * `messages`: the model's chat template with the generation prompt.
/// * `fim`: `[<|file_sep|>{path}\n{content}\n]* <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>`
///   (Qwen2.5-Coder's repo-level format), where the user's text never turns
///   into control tokens.
///
/// A prompt or chat text re-uses `earlier` (the session's last prompt, see
/// [`TextTokenizer::encode_extending`]) for the part the two share; its
/// encoding is returned with the ids, for the session to keep.
pub fn tokenize(
    tok: &TextTokenizer,
    fim: Option<&FimTokens>,
    input: &GenerateInput,
    earlier: Option<&PieceEncoding>,
) -> Result<(Vec<u32>, Option<PieceEncoding>), ProtocolError> {
    let mut ids = Vec::new();
    let text = match input {
        GenerateInput::Prompt(text) => {
            if tok.add_bos() {
                ids.extend(tok.bos_id());
            }
            Some(Cow::Borrowed(text.as_str()))
        }
        GenerateInput::Messages(messages) => {
            let messages: Vec<ChatMessage> = messages.iter().map(|m| ChatMessage::new(m.role.as_str(), m.content.clone())).collect();
            Some(Cow::Owned(tok.apply_chat_template(&messages, true).map_err(tokenizer_error)?))
        }
        GenerateInput::Fim(f) => {
            let fim = fim.ok_or_else(fim_unsupported)?;
            fim_ids(tok, fim, f, &mut ids)?;
            None
        }
    };
    let encoding = text.map(|t| tok.encode_extending(&t, earlier)).transpose().map_err(tokenizer_error)?;
    if let Some(e) = &encoding {
        ids.extend_from_slice(e.ids());
    }
    if ids.is_empty() {
        return Err(ProtocolError::invalid_parameter("the input is empty: it tokenizes to no tokens"));
    }
    Ok((ids, encoding))
}

fn fim_ids(tok: &TextTokenizer, fim: &FimTokens, f: &FimInput, ids: &mut Vec<u32>) -> Result<(), ProtocolError> {
    let enc = |s: &str| tok.encode(s, false).map_err(tokenizer_error);
    if tok.add_bos() {
        ids.extend(tok.bos_id());
    }
    for extra in &f.extra {
        let mut text = String::new();
        if let Some(path) = &extra.path {
            text.push_str(path);
            text.push('\n');
        }
        text.push_str(&extra.content);
        if !text.ends_with('\n') {
            text.push('\n');
        }
        match fim.file_sep {
            Some(sep) => ids.push(sep),
            None => text.insert(0, '\n'),
        }
        ids.extend(enc(&text)?);
    }
    ids.push(fim.prefix);
    ids.extend(enc(&f.prefix)?);
    ids.push(fim.suffix);
    ids.extend(enc(&f.suffix)?);
    ids.push(fim.middle);
    Ok(())
}

pub fn fim_unsupported() -> ProtocolError {
    ProtocolError::new(ErrorCode::FimUnsupported, "this model has no fill-in-the-middle tokens (model.fim is false); send `prompt` or `messages`")
}

/// The engine request for a validated, tokenized `generate`.
/// The session's id scopes its prefix-cache entries: its next turn resumes
/// from this one's KV state, and no other session ever sees it (unless the
/// request asked for `cache: "shared"`, which stores it for every session).
pub fn submit_request(state: &ServerState, session_id: &str, req: &GenerateRequest, prompt: Vec<u32>, received: Instant) -> SubmitRequest {
    SubmitRequest {
        prompt,
        max_tokens: req.max_tokens as usize,
        sampling: SamplingParams {
            temperature: req.temperature,
            top_k: req.top_k.unwrap_or(0),
            top_p: req.top_p.unwrap_or(1.0),
            min_p: req.min_p.unwrap_or(0.0),
            seed: req.seed,
        },
        stop_ids: state.tokenizer.eos_ids().to_vec(),
        logprobs: req.logprobs.then(|| req.top_logprobs.unwrap_or(0)),
        prefill_chunk: req.chunk_size.map(|c| (c as usize).min(state.config.max_prefill_chunk)),
        cache_scope: Some(match req.cache {
            Some(CacheScopeName::Shared) => Scope::Shared,
            Some(CacheScopeName::Session) | None => Scope::Session(session_id.to_string()),
        }),
        session: Some(session_id.to_string()),
        deadline: req.max_time_ms.map(|ms| received + Duration::from_millis(ms as u64)),
        speculation: speculation_for(&state.config.speculation, req.speculation),
    }
}

/// A request's speculation: its own choices over the server's defaults.
fn speculation_for(default: &Speculation, asked: Option<SpeculationOptions>) -> Speculation {
    let asked = asked.unwrap_or_default();
    let kind = match asked.source {
        None => default.kind.clone(),
        Some(DraftSourceName::Off) => DraftKind::Off,
        Some(DraftSourceName::Echo) => DraftKind::Echo,
        Some(DraftSourceName::DraftModel) => DraftKind::Model,
    };
    Speculation { kind, max_draft: asked.max_draft.map_or(default.max_draft, usize::from) }
}

/// A draft-model request on a server without one is refused up front.
fn check_speculation(state: &ServerState, req: &GenerateRequest) -> Result<(), ProtocolError> {
    let wants_model = req.speculation.and_then(|s| s.source) == Some(DraftSourceName::DraftModel);
    if wants_model && !state.config.has_draft_model {
        return Err(ProtocolError::invalid_parameter("speculation.source \"draft_model\": this server has no draft model (start it with --draft-model)")
            .with_request_id(req.request_id.clone()));
    }
    Ok(())
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

/// Validates, tokenizes and submits a `generate`, then spawns its forwarder.
/// Errors carry the request id; the request is not registered after one.
pub async fn start(state: &Arc<ServerState>, session: &Arc<Session>, conn_id: u64, req: GenerateRequest, received: Instant) -> Result<(), ProtocolError> {
    let rid = req.request_id.clone();
    let with_id = |e: ProtocolError| e.with_request_id(rid.clone());
    if state.is_draining() {
        return Err(with_id(ProtocolError::new(ErrorCode::Cancelled, "the server is shutting down and accepts no new requests")));
    }
    req.check_limits(&state.limits)?;
    check_speculation(state, &req)?;
    if matches!(req.input, GenerateInput::Fim(_)) && state.fim.is_none() {
        return Err(with_id(fim_unsupported()));
    }
    let registration = session.register(conn_id, &rid)?;
    let prepared = {
        let state = state.clone();
        let req = req.clone();
        let session = session.clone();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let (prompt, encoding) = tokenize(&state.tokenizer, state.fim.as_ref(), &req.input, session.last_prompt().as_deref())
                .map_err(|e| e.with_request_id(req.request_id.clone()))?;
            let tokenizing = started.elapsed();
            if let Some(e) = encoding {
                session.set_last_prompt(e);
            }
            req.check_prompt_tokens(prompt.len(), &state.limits)?;
            Ok::<_, ProtocolError>((submit_request(&state, &session.id, &req, prompt, received), tokenizing))
        })
        .await
        .unwrap_or_else(|e| Err(ProtocolError::new(ErrorCode::Internal, format!("tokenizer task failed: {e}")).with_request_id(rid.clone())))
    };
    let (submit, tokenizing) = prepared?;
    let prompt_tokens = submit.prompt.len();
    let submitted = Instant::now();
    let Submitted { events, stop, .. } = session.engine().submit(submit).map_err(|e| with_id(engine_refusal(e)))?;
    let in_flight = InFlight::new(state.clone(), prompt_tokens);
    registration.set_stop(stop.clone());
    let fwd = Forwarder {
        state: state.clone(),
        registration,
        _in_flight: in_flight,
        request_id: rid,
        stop,
        stops: req.stop,
        logprobs: req.logprobs.then(|| req.top_logprobs.unwrap_or(0)),
        received,
        submitted,
        tokenizing,
        prompt_tokens,
    };
    tokio::spawn(fwd.run(events));
    Ok(())
}

/// The error a client gets for an engine's refusal or failure. Before the
/// request started, the engine's own limits are the client's to retry;
/// after, a failure is the server's.
fn engine_refusal(e: EngineError) -> ProtocolError {
    let code = match &e {
        EngineError::Overloaded { .. } => ErrorCode::Overloaded,
        EngineError::ShuttingDown => ErrorCode::Cancelled,
        EngineError::ContextOverflow { .. } => ErrorCode::ContextOverflow,
        EngineError::OverKvBudget { .. } => ErrorCode::ContextOverflow,
        EngineError::Internal(_) => ErrorCode::Internal,
    };
    let message = match code {
        ErrorCode::Overloaded => format!("{e}; retry later"),
        ErrorCode::Internal => format!("generation failed: {e}"),
        _ => e.to_string(),
    };
    ProtocolError::new(code, message)
}

/// Counts a request in flight (for drain and /metrics) while it lives.
struct InFlight(Arc<ServerState>);

impl InFlight {
    fn new(state: Arc<ServerState>, prompt_tokens: usize) -> InFlight {
        state.request_started(prompt_tokens);
        InFlight(state)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_ended();
    }
}

struct Forwarder {
    state: Arc<ServerState>,
    /// Dropped when the forwarder ends, before `_in_flight` (fields drop in
    /// order): the session forgets the request, then the server's count
    /// drops, so a drain that sees zero finds every session settled.
    registration: Registration,
    _in_flight: InFlight,
    request_id: String,
    stop: StopHandle,
    stops: Vec<String>,
    logprobs: Option<u8>,
    received: Instant,
    submitted: Instant,
    /// Time spent tokenizing the input (part of received..submitted).
    tokenizing: Duration,
    prompt_tokens: usize,
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp.min(0.0)
    } else {
        f32::MIN
    }
}

impl Forwarder {
    async fn push(&self, seq: Option<u64>, msg: ServerMessage, terminal: bool) -> bool {
        let frame = Frame { seq, json: Arc::from(msg.to_json()), terminal };
        self.registration.push(frame).await
    }

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

    async fn run(self, mut events: mpsc::Receiver<EngineEvent>) {
        let tok = self.state.tokenizer.clone();
        let mut decoder = tok.stream_decoder(true);
        let mut stops = StopMatcher::new(self.stops.clone());
        let mut seq = 0u64;
        // A stop sequence matched: the engine was told to stop, later tokens are dropped.
        let mut stopped = false;
        // Frames are still wanted (false once the session dropped one).
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
                    if stopped || !alive {
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
                            stopped = true;
                            self.stop.stop(StopReason::StopString);
                            t
                        }
                    };
                    seq += 1;
                    let delta = Delta { request_id: self.request_id.clone(), seq, text, token_ids: ids, logprobs: self.wire_logprobs(&logprobs) };
                    if !self.push(Some(seq), ServerMessage::Delta(delta), false).await {
                        alive = false;
                        self.stop.stop(StopReason::Cancel);
                    }
                }
                EngineEvent::Finished(info) => {
                    if alive && !stopped {
                        // Text held back by the decoder or the stop matcher.
                        let tail = decoder.flush(&tok).unwrap_or_default();
                        let text = match stops.push(&tail) {
                            StopScan::Continue(t) => t + &stops.finish(),
                            StopScan::Stopped(t) => {
                                stopped = true;
                                t
                            }
                        };
                        if !text.is_empty() {
                            seq += 1;
                            let delta =
                                Delta { request_id: self.request_id.clone(), seq, text, token_ids: Vec::new(), logprobs: self.logprobs.map(|_| Vec::new()) };
                            alive = self.push(Some(seq), ServerMessage::Delta(delta), false).await;
                        }
                    }
                    let reason = if stopped {
                        FinishReason::Stop
                    } else {
                        match info.reason {
                            Finish::Stop => FinishReason::Stop,
                            Finish::Length => FinishReason::Length,
                            Finish::TimeLimit => FinishReason::TimeLimit,
                            Finish::Cancelled => match self.registration.cancel_origin() {
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
                    let e = engine_refusal(e);
                    break Err((e.code, e.message));
                }
            }
        };
        let total = self.received.elapsed();
        match outcome {
            Ok((reason, info)) => {
                let (prompt_tokens, cached_tokens) = (info.prompt_tokens, info.cached_tokens);
                if crate::engine::tracing() {
                    let ms = |d: Duration| d.as_secs_f64() * 1e3;
                    eprintln!(
                        "[request] prompt_tokens={prompt_tokens} cached_tokens={cached_tokens} tokenize_ms={:.2} submit_ms={:.2} queue_ms={} first_token_ms={:.2}",
                        ms(self.tokenizing),
                        ms(self.submitted - self.received),
                        queue_ms.map_or(-1, |q| q as i64),
                        first_token.map_or(f64::NAN, |t| ms(t - self.received)),
                    );
                }
                self.state.metrics.request_finished(reason);
                if alive {
                    let done = Done {
                        request_id: self.request_id.clone(),
                        seq: seq + 1,
                        finish_reason: reason,
                        usage: Usage {
                            prompt_tokens: if prompt_tokens > 0 { prompt_tokens } else { self.prompt_tokens } as u32,
                            cached_tokens: cached_tokens as u32,
                            completion_tokens: completion as u32,
                        },
                        timing: Timing {
                            queue_ms: queue_ms.unwrap_or(ms(total)),
                            ttft_ms: first_token.map_or(ms(total), |t| ms(t - self.received)),
                            total_ms: ms(total),
                        },
                        speculative: info.speculative.as_ref().map(wire_speculative),
                    };
                    self.push(Some(seq + 1), ServerMessage::Done(done), true).await;
                }
            }
            Err((code, message)) => {
                self.state.metrics.request_failed(code);
                if alive {
                    self.state.metrics.error(code);
                    let msg = ServerMessage::error(code, message, Some(self.request_id.clone()));
                    self.push(None, msg, true).await;
                }
            }
        }
    }
}
