//! One request, whatever the edge: input → [`ValidGenerate`] (every check,
//! the prompt tokenized: [`prepare`], `valid.rs`) → engine request
//! ([`submit_request`]), then a [`Relay`] to the edge's writer. Protocol
//! v1's `generate` ([`start`]) is one such edge: its writer puts `delta` /
//! `done` frames into the session's replay ring.
mod valid;
use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::{
    CacheScopeName, Delta, Done, DraftSourceName, ErrorCode, FimInput, GenerateInput, GenerateRequest, ProtocolError, ResponseFormat, ServerMessage,
    SpeculationOptions, Tool, ToolCall, ToolMode,
};
pub use valid::{GenerateLimits, Length, ModelChecks, Refused, ValidGenerate};

use super::relay::{engine_error, Ending, Piece, Relay, Writer};
use super::session::{Frame, Registration, Session};
use super::ServerState;
use crate::engine::constraint::Constraint;
use crate::engine::speculate::{DraftKind, Speculation};
use crate::engine::{EngineHandle, Scope, SubmitRequest, Submitted};
use crate::sample::SamplingParams;
use crate::tokenizer::{PieceEncoding, RenderOptions, TextTokenizer, TokenizerError};
use crate::tools::{self, CallSplitter, ToolPrompting};

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
/// * `messages`: the model's chat template with the generation prompt, and
///   `tools` shown as `prompting` says; or, with `continue_final`, the final
///   message left open for the model to continue (a prefill).
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
    continue_final: bool,
    (tools, prompting): (&[Tool], ToolPrompting),
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
            let (messages, tools) = tools::template_input(messages, tools, prompting);
            let opts =
                RenderOptions { add_generation_prompt: !continue_final, continue_final_message: continue_final, tools: tools.as_deref(), ..Default::default() };
            Some(Cow::Owned(tok.chat_template().and_then(|t| t.render_with(&messages, &opts)).map_err(tokenizer_error)?))
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

fn fim_unsupported() -> ProtocolError {
    ProtocolError::new(ErrorCode::FimUnsupported, Refused::FimUnsupported.to_string())
}

/// The engine request for a valid `generate`, and the request (its length
/// settled) for the relay. `owner` (a session's id, or an HTTP tenant's
/// key) scopes its prefix-cache entries: its next turn resumes from this
/// one's KV state, and no other owner ever sees it (unless the request
/// asked for `cache: "shared"`, which stores it for every owner). Owners
/// also take turns for free rows.
pub fn submit_request(state: &ServerState, owner: &str, valid: ValidGenerate, received: Instant) -> (SubmitRequest, GenerateRequest) {
    let (req, prompt, constraint) = valid.into_parts();
    let submit = SubmitRequest {
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
            Some(CacheScopeName::Session) | None => Scope::Session(owner.to_string()),
        }),
        session: Some(owner.to_string()),
        deadline: req.max_time_ms.map(|ms| received + Duration::from_millis(ms as u64)),
        speculation: speculation_for(&state.config.speculation, req.speculation),
        constraint,
    };
    (submit, req)
}

/// The constraint of `req`: its tool calls' grammar, or its compiled
/// `response_format`. A schema, pattern or grammar llguidance rejects is the
/// client's `invalid_parameter`, in its words.
fn compile_constraint(state: &ServerState, req: &GenerateRequest) -> Result<Option<Constraint>, ProtocolError> {
    let invalid = |what: &str, e: String| ProtocolError::invalid_parameter(format!("{what}: {e}"));
    let format = req.response_format.as_ref().filter(|f| **f != ResponseFormat::Text);
    if let (Some(ToolMode::Auto), Some(format)) = (req.tool_mode(), format) {
        let parallel = req.parallel_tool_calls.unwrap_or(true);
        let calls = tools::calls_or_answer_grammar(&state.tokenizer, &req.tools, parallel, crate::grammar::with_json_style);
        return state.grammars.compile_calls_or_answer(&calls, format).map(Some).map_err(|e| invalid("tools or response_format", e));
    }
    if let Some(mode) = req.tool_mode() {
        let parallel = req.parallel_tool_calls.unwrap_or(true);
        let Some(calls) = tools::call_grammar(&state.tokenizer, &req.tools, mode, parallel, crate::grammar::with_json_style) else { return Ok(None) };
        return state.grammars.compile_calls(&calls).map(Some).map_err(|e| invalid("tools", e));
    }
    let Some(format) = &req.response_format else { return Ok(None) };
    state.grammars.compile(format).map_err(|e| invalid("response_format", e))
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
    // Grammar-forced drafts are certain, so only an explicit "off" stops them.
    let grammar_drafts = asked.source != Some(DraftSourceName::Off);
    Speculation { kind, max_draft: asked.max_draft.map_or(default.max_draft, usize::from), grammar_drafts }
}

/// Refuses every new request while the server drains.
pub fn check_accepting(state: &ServerState, request_id: &str) -> Result<(), ProtocolError> {
    if state.is_draining() {
        return Err(ProtocolError::new(ErrorCode::ShuttingDown, "the server is shutting down and accepts no new requests; send it to another server")
            .with_request_id(request_id));
    }
    Ok(())
}

/// The limits this server holds a `generate` to.
pub fn generate_limits(state: &ServerState) -> GenerateLimits {
    GenerateLimits {
        limits: state.limits.clone(),
        default_max_tokens: u32::try_from(state.config.default_max_tokens).unwrap_or(u32::MAX),
        has_draft_model: state.config.has_draft_model,
        has_fim: state.fim.is_some(),
    }
}

/// This server's model, as checking a request asks of it: its tokenizer
/// (extending `earlier`, the owner's last prompt, where it can; the new
/// prompt's encoding is kept for the owner's next) and its grammar engine.
struct ServedModel<'a> {
    state: &'a ServerState,
    earlier: Option<&'a PieceEncoding>,
    encoding: Option<PieceEncoding>,
    tokenizing: Duration,
}

impl ModelChecks for ServedModel<'_> {
    fn prompt_ids(&mut self, req: &GenerateRequest) -> Result<Vec<u32>, ProtocolError> {
        let started = Instant::now();
        let (ids, encoding) = prompt_ids(self.state, req, self.earlier)?;
        (self.encoding, self.tokenizing) = (encoding, started.elapsed());
        Ok(ids)
    }

    fn constraint(&mut self, req: &GenerateRequest) -> Result<Option<Constraint>, ProtocolError> {
        compile_constraint(self.state, req)
    }
}

/// A request tokenized and checked, ready for the engine.
pub struct Prepared {
    pub submit: SubmitRequest,
    /// The request, its length settled.
    pub request: GenerateRequest,
    /// The prompt's encoding in pieces, for the owner's next prompt to extend.
    pub encoding: Option<PieceEncoding>,
    pub tokenizing: Duration,
}

/// The token ids of `req`'s input on this server (its tokenizer, FIM
/// tokens and tool prompting), extending `earlier` where it can.
fn prompt_ids(state: &ServerState, req: &GenerateRequest, earlier: Option<&PieceEncoding>) -> Result<(Vec<u32>, Option<PieceEncoding>), ProtocolError> {
    // Tools are shown even with `tool_choice: "none"`, so a conversation's
    // turns share one prompt prefix (and its cache) whatever each allows.
    tokenize(&state.tokenizer, state.fim.as_ref(), &req.input, req.continue_final_message, (req.tools.as_slice(), state.tool_prompting), earlier)
}

/// Checks `req` into a [`ValidGenerate`] (tokenizing it off the async
/// threads, re-using `earlier`, the owner's last prompt, where the new one
/// extends it; its length settled as `length` says) and builds its engine
/// request. Errors carry the request id.
pub async fn prepare(
    state: &Arc<ServerState>,
    owner: &str,
    req: GenerateRequest,
    length: Length,
    earlier: Option<Arc<PieceEncoding>>,
    received: Instant,
) -> Result<Prepared, ProtocolError> {
    let (state, owner, request_id) = (state.clone(), owner.to_string(), req.request_id.clone());
    let rid = request_id.clone();
    tokio::task::spawn_blocking(move || {
        let mut model = ServedModel { state: &state, earlier: earlier.as_deref(), encoding: None, tokenizing: Duration::ZERO };
        let valid = ValidGenerate::new(req, length, &generate_limits(&state), &mut model).map_err(|e| e.for_request(&rid))?;
        let (submit, request) = submit_request(&state, &owner, valid, received);
        Ok(Prepared { submit, request, encoding: model.encoding, tokenizing: model.tokenizing })
    })
    .await
    .unwrap_or_else(|e| Err(ProtocolError::new(ErrorCode::Internal, format!("tokenizer task failed: {e}")).with_request_id(request_id)))
}

/// How many tokens `req`'s input comes to, its tools shown as for a
/// generation, without submitting it (Anthropic's `count_tokens`).
pub async fn count_prompt_tokens(state: &Arc<ServerState>, req: &GenerateRequest) -> Result<usize, ProtocolError> {
    let (state, req) = (state.clone(), req.clone());
    tokio::task::spawn_blocking(move || prompt_ids(&state, &req, None).map(|(ids, _)| ids.len()))
        .await
        .unwrap_or_else(|e| Err(ProtocolError::new(ErrorCode::Internal, format!("tokenizer task failed: {e}"))))
}

/// Submits a prepared request to `engine`; returns its handles and the
/// guard that counts it in flight, and the relay that takes it to a writer.
pub fn submit(state: &Arc<ServerState>, engine: &EngineHandle, prepared: Prepared, received: Instant) -> Result<(Submitted, InFlight, Relay), ProtocolError> {
    let req = &prepared.request;
    let prompt_tokens = prepared.submit.prompt.len();
    let submitted_at = Instant::now();
    let submitted = engine.submit(prepared.submit).map_err(|e| {
        let (code, message) = engine_error(&e);
        ProtocolError::new(code, message).with_request_id(req.request_id.clone())
    })?;
    let in_flight = InFlight::new(state.clone(), prompt_tokens);
    let relay = Relay {
        state: state.clone(),
        stop: submitted.stop.clone(),
        stops: req.stop.clone(),
        logprobs: req.logprobs.then(|| req.top_logprobs.unwrap_or(0)),
        received,
        submitted: submitted_at,
        tokenizing: prepared.tokenizing,
        prompt_tokens,
        tool_calls: req.tool_mode().map(|_| CallSplitter::new(tools::tool_names(&req.tools))),
    };
    Ok((submitted, in_flight, relay))
}

/// Validates, tokenizes and submits a `generate`, then spawns its relay.
/// Errors carry the request id; the request is not registered after one.
pub async fn start(state: &Arc<ServerState>, session: &Arc<Session>, conn_id: u64, req: GenerateRequest, received: Instant) -> Result<(), ProtocolError> {
    check_accepting(state, &req.request_id)?;
    let request_id = req.request_id.clone();
    let mut prepared = prepare(state, &session.id, req, Length::AsAsked, session.last_prompt(), received).await?;
    let registration = session.register(conn_id, &request_id)?;
    if let Some(e) = prepared.encoding.take() {
        session.set_last_prompt(e);
    }
    let (submitted, in_flight, relay) = submit(state, session.engine(), prepared, received)?;
    registration.set_stop(submitted.stop.clone());
    let mut writer = FrameWriter { registration, request_id, seq: 0, tool_calls: Vec::new() };
    tokio::spawn(async move {
        relay.run(submitted.events, &mut writer).await;
        // The session forgets the request before the server's count drops,
        // so a drain that sees zero in flight finds every session settled.
        drop(writer);
        drop(in_flight);
    });
    Ok(())
}

/// How a request is launched, beyond its `GenerateRequest`.
#[derive(Default)]
pub struct Launch {
    pub length: Length,
    /// The conversation's last prompt, which this one extends.
    pub earlier: Option<Arc<PieceEncoding>>,
    /// Generate past end-of-sequence tokens (llama.cpp's `ignore_eos`).
    pub ignore_eos: bool,
}

/// A request on its way through the engine.
pub struct Launched {
    pub submitted: Submitted,
    pub in_flight: InFlight,
    pub relay: Relay,
    /// The prompt's encoding, for the owner's next prompt to extend.
    pub encoding: Option<PieceEncoding>,
}

/// The one request path of the HTTP edges: checks `generate` into a
/// [`ValidGenerate`] (tokenizing it, extending `earlier`, the
/// conversation's last prompt; its length settled, and written back to
/// `generate`), and submits it on `owner`'s engine.
pub async fn launch(
    state: &Arc<ServerState>,
    owner: &str,
    generate: &mut GenerateRequest,
    launch: Launch,
    received: Instant,
) -> Result<Launched, ProtocolError> {
    let Launch { length, earlier, ignore_eos } = launch;
    check_accepting(state, &generate.request_id)?;
    let mut prepared = prepare(state, owner, generate.clone(), length, earlier, received).await?;
    generate.max_tokens = prepared.request.max_tokens;
    if ignore_eos {
        prepared.submit.stop_ids.clear();
    }
    let encoding = prepared.encoding.take();
    let engine = state.engines.for_session(owner).clone();
    let (submitted, in_flight, relay) = submit(state, &engine, prepared, received)?;
    Ok(Launched { submitted, in_flight, relay, encoding })
}

/// Counts a request in flight (for drain and /metrics) while it lives.
pub struct InFlight(Arc<ServerState>);

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

/// Protocol v1's writer: `delta` frames numbered from 1, then `done` or a
/// request `error`, into the session's replay ring.
struct FrameWriter {
    registration: Registration,
    request_id: String,
    /// The last `seq` used.
    seq: u64,
    /// The calls the model made, for `done`.
    tool_calls: Vec<ToolCall>,
}

impl FrameWriter {
    async fn push(&self, seq: Option<u64>, msg: ServerMessage) -> bool {
        let terminal = !matches!(msg, ServerMessage::Delta(_));
        self.registration.push(Frame { seq, json: Arc::from(msg.to_json()), terminal }).await
    }
}

impl Writer for FrameWriter {
    async fn piece(&mut self, piece: Piece) -> bool {
        self.seq += 1;
        self.tool_calls.extend(piece.tool_calls);
        let delta = Delta { request_id: self.request_id.clone(), seq: self.seq, text: piece.text, token_ids: piece.token_ids, logprobs: piece.logprobs };
        self.push(Some(self.seq), ServerMessage::Delta(delta)).await
    }

    async fn end(&mut self, ending: Ending) {
        match ending {
            Ok(f) => {
                self.seq += 1;
                let done = Done {
                    request_id: self.request_id.clone(),
                    seq: self.seq,
                    finish_reason: f.reason,
                    usage: f.usage,
                    timing: f.timing,
                    speculative: f.speculative,
                    tool_calls: std::mem::take(&mut self.tool_calls),
                };
                self.push(Some(self.seq), ServerMessage::Done(done)).await;
            }
            Err((code, message)) => {
                self.push(None, ServerMessage::error(code, message, Some(self.request_id.clone()))).await;
            }
        }
    }

    fn cancel_origin(&self) -> Option<bool> {
        self.registration.cancel_origin()
    }
}

#[cfg(test)]
mod tests;
