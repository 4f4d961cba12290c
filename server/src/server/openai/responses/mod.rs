//! OpenAI's Responses API: `POST /v1/responses` (one JSON body, or
//! server-sent events with `stream: true`) and its WebSocket mode on
//! `GET /v1/responses` (`socket.rs`): a persistent socket of
//! `response.create` events, continued with `previous_response_id` from
//! state the server holds, warmed with `generate: false`, multiplexed by
//! `stream_id` lanes.
//!
//! The same request path as every edge ([`super::launch`]); this module
//! adds the conversation a response continues ([`store`]) and the event
//! sequence it streams ([`events`]).
mod compact;
mod events;
mod input;
mod socket;
mod steer;
mod store;
mod stored;
mod wire;

use std::sync::Arc;
use std::time::Instant;

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use protocol::{ChatMessage, GenerateInput, GenerateRequest, Role};
use serde_json::{Map, Value};

use super::super::http::edge::{self, SSE_BUFFER};
use super::super::http::stream_body::ChannelBody;
use super::super::http::Body;
use super::super::request::{launch, Launch, Launched, Length};
use super::super::ServerState;
use super::respond::ApiError;
use super::{check_model, owner, unix_now};
use crate::engine::{StopHandle, StopReason};
pub use compact::compact;
use events::{Header, Interrupt, Outcome, ResponseWriter, Sink};
pub use socket::run as run_socket;
pub use store::ResponseStore;
use store::{Conversation, Record, SocketResponses};
pub use stored::handle as handle_stored;
use wire::{Create, CreateBody, Edge};

/// Parses a create request from `edge`.
fn parse_create(body: Map<String, Value>, edge: Edge) -> Result<Create, ApiError> {
    edge::refuse_unknown::<ApiError>(wire::unknown_field(&body, edge))?;
    edge::deserialize::<ApiError, CreateBody>(body)?.check(edge).map_err(|e| ApiError::invalid(Some(e.param), e.message))
}

/// A response submitted to the engine, not yet relayed.
pub struct Started {
    id: String,
    create: Create,
    launched: Launched,
    tenant: String,
    owner: String,
    earlier: Option<Arc<Conversation>>,
}

/// Resolves what `create` continues, renders its conversation and submits
/// it. An error here means the response never began (nothing was emitted).
/// `own_owner`: whose prefix-cache entries a new conversation uses (the
/// socket's own, or the HTTP tenant's).
async fn start(
    state: &Arc<ServerState>,
    tenant: &str,
    own_owner: &str,
    socket: Option<&SocketResponses>,
    create: Create,
    received: Instant,
) -> Result<Started, ApiError> {
    if let Some(model) = &create.model {
        check_model(state, model)?;
    }
    let earlier = match &create.previous_response_id {
        None => None,
        Some(id) => Some(state.responses.find(tenant, id, socket).ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("previous response {id:?} was not found (it expired, or belongs to another key)"),
            )
            .with_param("previous_response_id")
            .with_code("previous_response_not_found")
        })?),
    };
    let owner = match (&earlier, &create.prompt_cache_key) {
        // A continuation's KV state is where its conversation left it.
        (Some(c), _) => c.owner.clone(),
        (None, Some(key)) => owner(tenant, Some(key)),
        (None, None) => own_owner.to_string(),
    };
    let mut messages = Vec::new();
    if let Some(i) = &create.instructions {
        messages.push(ChatMessage::new(Role::System, i.clone()));
    }
    if let Some(c) = &earlier {
        messages.extend(c.all_messages());
    }
    messages.extend(create.input.iter().cloned());
    check_call_outputs(&messages)?;
    let id = super::super::new_secret("resp_");
    let mut generate = GenerateRequest::new(id.clone(), GenerateInput::Messages(messages));
    generate.temperature = create.temperature;
    generate.top_p = create.top_p;
    generate.response_format = create.response_format.clone();
    generate.tools = create.tools.clone();
    generate.tool_choice = create.tool_choice.clone();
    generate.parallel_tool_calls = create.parallel_tool_calls;
    generate.logprobs = create.logprobs;
    generate.top_logprobs = Some(create.top_logprobs).filter(|&n| n > 0);
    let length = match (create.generate, create.max_output_tokens) {
        (false, _) => Length::WarmOnly,
        (true, Some(n)) => {
            generate.max_tokens = n;
            Length::AsAsked
        }
        (true, None) => Length::FillContext,
    };
    let earlier_encoding = earlier.as_ref().and_then(|c| c.encoding.clone());
    let launched =
        launch(state, &owner, &mut generate, Launch { length, earlier: earlier_encoding, ignore_eos: false }, received).await.map_err(ApiError::from)?;
    Ok(Started { id, create, launched, tenant: tenant.to_string(), owner, earlier })
}

/// Every `function_call_output` answers a call made before it in the
/// conversation (the `previous_response_id` chain and this input), as
/// OpenAI's API holds them: an output for no call is refused.
fn check_call_outputs(messages: &[ChatMessage]) -> Result<(), ApiError> {
    let mut made = std::collections::HashSet::new();
    for m in messages {
        made.extend(m.tool_calls.iter().map(|c| c.id.as_str()));
        if let Some(id) = m.tool_call_id.as_deref().filter(|id| m.role == Role::Tool && !made.contains(id)) {
            return Err(ApiError::invalid(Some("input"), format!("No tool call found for function call output with call_id {id}.")));
        }
    }
    Ok(())
}

impl Started {
    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn stop_handle(&self) -> StopHandle {
        self.launched.submitted.stop.clone()
    }

    /// Streams the response to `sink` until it ends, then keeps its
    /// conversation for the next `previous_response_id`.
    async fn run(self, state: &ServerState, sink: Sink, interrupt: Arc<Interrupt>, socket: Option<&SocketResponses>) -> ResponseWriter {
        let Started { id, create, launched, tenant, owner, earlier } = self;
        let Launched { submitted, in_flight, relay, encoding } = launched;
        let header =
            Header { id: id.clone(), created_at: unix_now(), model: state.model.name.clone(), create: create.clone(), tokenizer: state.tokenizer.clone() };
        let mut writer = ResponseWriter::new(header, sink, interrupt);
        if writer.begin().await {
            relay.run(submitted.events, &mut writer).await;
        } else {
            submitted.stop.stop(StopReason::Cancel);
        }
        drop(in_flight);
        if let Some(Outcome::Done { text, tool_calls, .. }) = writer.outcome() {
            let record = match (create.store, writer.whole()) {
                (true, Ok(response)) => Some(Record { response, input_items: create.input_items }),
                _ => None,
            };
            let mut messages = create.input;
            if create.generate {
                let mut answer = ChatMessage::new(Role::Assistant, text.clone());
                answer.tool_calls = tool_calls.clone();
                messages.push(answer);
            }
            let conversation = Conversation { tenant, owner, earlier, messages, encoding: encoding.map(Arc::new), record };
            state.responses.keep(&id, Arc::new(conversation), create.store, socket);
        }
        writer
    }
}

/// `POST /v1/responses`.
pub async fn create(state: &Arc<ServerState>, req: Request<Incoming>, tenant: &str) -> Result<Response<Body>, ApiError> {
    let received = Instant::now();
    let body = edge::read_json::<ApiError>(state, req).await?;
    let create = parse_create(body, Edge::Http)?;
    let stream = create.stream;
    let own_owner = owner(tenant, None);
    let started = start(state, tenant, &own_owner, None, create, received).await?;
    let interrupt = Arc::new(Interrupt::default());
    if !stream {
        let writer = started.run(state, Sink::Collect, interrupt, None).await;
        return Ok(edge::json(StatusCode::OK, &writer.whole()?));
    }
    let (tx, body) = ChannelBody::new(SSE_BUFFER);
    let state = state.clone();
    tokio::spawn(async move {
        started.run(&state, Sink::Sse(tx), interrupt, None).await;
    });
    Ok(edge::sse(body))
}
