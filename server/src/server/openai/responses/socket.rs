//! The Responses API's WebSocket mode: `GET /v1/responses` upgraded, the
//! socket the official SDKs open with `client.responses.connect()`.
//!
//! Client events: `response.create` (the body of `POST /v1/responses`, plus
//! `generate: false` to only warm the prefix cache and `stream_id` to pick
//! a lane), `response.cancel` (`response_id` or `stream_id`) and
//! `response.steer` (`steer.rs`). Server events: each response's event
//! sequence (`events.rs`), tagged with its lane's `stream_id`, the steer
//! events, and `error` events for refused client events.
//!
//! Lanes: the responses of one `stream_id` run one after another (FIFO), so
//! a `response.create` may continue the lane's previous response before it
//! finished; different lanes run concurrently, at most `max_in_flight` per
//! socket. Responses continue from the socket's own state: a conversation's
//! prompt encoding here, its KV state in the prefix cache under the
//! socket's owner, marked live while the socket is open. When the socket
//! goes, its running responses are cancelled and its responses are parked
//! for the session TTL: a client that reconnects continues them with
//! `previous_response_id`.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures_util::{SinkExt, StreamExt};
use hyper::StatusCode;
use protocol::{ErrorCode, ProtocolError};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::Message;

use super::super::super::http::edge::EdgeError;
use super::super::super::http::ws_frames::{Frame, FrameReader, Ws, WsStream};
use super::super::super::ServerState;
use super::super::respond::ApiError;
use super::events::{Interrupt, Outcome, Sink};
use super::input;
use super::steer::{self, Steer, Steers};
use super::store::SocketResponses;
use super::wire::{Create, Edge};
use super::{parse_create, start};
use crate::engine::{Scope, StopHandle, StopReason};

/// Events waiting for the socket's writer.
const OUTGOING: usize = 256;

/// A response running on this socket.
struct Running {
    lane: String,
    stop: StopHandle,
    /// Set when the client cancelled or steered it.
    interrupt: Arc<Interrupt>,
}

/// What the socket's lanes share.
struct Shared {
    state: Arc<ServerState>,
    tenant: String,
    /// This socket's prefix-cache owner, for conversations it starts.
    owner: String,
    out: mpsc::Sender<String>,
    responses: SocketResponses,
    running: Mutex<HashMap<String, Running>>,
    steers: Steers,
    /// The socket is gone: queued responses are not started.
    closed: AtomicBool,
}

impl Shared {
    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<String, Running>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An `error` event, as the SDK parses it. The OpenResponses
    /// specification's socket error always has a `code` (an HTTP error's may
    /// be null): one without gets its status's generic code.
    async fn error(&self, e: &ApiError, lane: Option<&str>) {
        self.state.metrics.error(e.metric());
        let mut event = json!({"type": "error", "status": e.status.as_u16(), "error": e.body()["error"].clone()});
        event["error"]["code"] = json!(e.code.unwrap_or(if e.status.is_server_error() { "server_error" } else { "invalid_request" }));
        if let Some(lane) = lane {
            event["stream_id"] = json!(lane);
        }
        let _ = self.out.send(event.to_string()).await;
    }
}

/// One lane: its responses, in order.
struct Lane {
    queue: mpsc::Sender<(Create, Instant)>,
    task: JoinHandle<()>,
}

/// Serves one upgraded socket until it closes.
pub async fn run(state: Arc<ServerState>, ws: Ws, tenant: String) {
    state.metrics.connections.inc();
    let (mut sink, stream) = ws.split();
    let (out, mut outgoing) = mpsc::channel::<String>(OUTGOING);
    // A client that takes no event for the stall timeout stopped reading:
    // the socket closes (as `/v1/ws` does), its responses are cancelled.
    let stalled = Arc::new(tokio::sync::Notify::new());
    let writer = {
        let (stalled, stall) = (stalled.clone(), state.config.stall_timeout);
        tokio::spawn(async move {
            while let Some(text) = outgoing.recv().await {
                match tokio::time::timeout(stall, sink.send(Message::text(text))).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return sink,
                    Err(_) => {
                        stalled.notify_one();
                        return sink;
                    }
                }
            }
            let _ = sink.close().await;
            sink
        })
    };
    let owner = format!("responses:{tenant}:{}", crate::server::new_secret(""));
    let engine = state.engines.for_session(&owner).clone();
    engine.set_scope_live(Scope::Session(owner.clone()), true);
    let shared = Arc::new(Shared {
        state: state.clone(),
        tenant,
        owner: owner.clone(),
        out,
        responses: Mutex::new(HashMap::new()),
        running: Mutex::new(HashMap::new()),
        steers: Steers::default(),
        closed: AtomicBool::new(false),
    });
    let mut reader = Reader { shared: shared.clone(), lanes: HashMap::new() };
    let mut frames = FrameReader::new(stream, &state.config, state.stop_signal(), |stop| *stop);
    tokio::select! {
        _ = reader.run(&mut frames) => {}
        _ = stalled.notified() => {}
        _ = tokio::time::sleep(state.config.responses_socket_lifetime) => {
            let e = ApiError::invalid(None, format!(
                "this socket reached its {} s limit; open a new one and continue with previous_response_id",
                state.config.responses_socket_lifetime.as_secs()
            ))
            .with_code("websocket_connection_limit_reached");
            shared.error(&e, None).await;
        }
    }
    // Gone: nothing queued starts, what runs is cancelled (freeing its KV
    // rows), and the conversations wait a session TTL for a reconnect.
    shared.closed.store(true, Ordering::Release);
    for r in shared.running().values() {
        r.stop.stop(StopReason::Cancel);
    }
    for (_, lane) in reader.lanes.drain() {
        drop(lane.queue);
        let _ = lane.task.await;
    }
    state.responses.park(&shared.responses);
    engine.set_scope_live(Scope::Session(owner), false);
    drop(reader);
    drop(shared);
    if let Ok(sink) = writer.await {
        frames.drain_unread(sink).await;
    }
    state.metrics.connections.dec();
    state.connection_closed();
}

struct Reader {
    shared: Arc<Shared>,
    lanes: HashMap<String, Lane>,
}

fn invalid(param: Option<&'static str>, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

impl Reader {
    /// Reads until the socket ends; an idle socket ends once none of its
    /// responses runs.
    async fn run(&mut self, frames: &mut FrameReader<WsStream, bool>) {
        loop {
            match frames.next().await {
                Frame::Text { text, received } => self.on_event(text.as_str(), received).await,
                Frame::Idle if !self.shared.running().is_empty() => {}
                Frame::Idle | Frame::Closed | Frame::Stopped => return,
                Frame::TooLarge(message) => {
                    let e = ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", message).with_code("request_too_large");
                    return self.shared.error(&e, None).await;
                }
                Frame::RateLimited => {
                    let per_sec = self.shared.state.config.rate_limit_per_sec;
                    let e = ApiError::from(ProtocolError::new(ErrorCode::RateLimited, format!("more than {per_sec} events per second; the event was dropped")));
                    self.shared.error(&e, None).await;
                }
                Frame::Binary => self.shared.error(&invalid(None, "binary frames are not supported: send JSON text events"), None).await,
            }
        }
    }

    async fn on_event(&mut self, text: &str, received: Instant) {
        // Duplicate keys are refused, as on every edge.
        let body = match protocol::parse_json_strict(text) {
            Ok(Value::Object(map)) => map,
            Ok(_) => return self.shared.error(&invalid(None, "an event must be a JSON object with a `type`"), None).await,
            Err(e) => {
                let why = e.message.trim_start_matches("invalid JSON: ");
                return self.shared.error(&invalid(None, format!("the event is not valid JSON: {why}")), None).await;
            }
        };
        let kind = body.get("type").and_then(Value::as_str).unwrap_or("").to_string();
        let lane = body.get("stream_id").and_then(Value::as_str).map(str::to_string);
        match kind.as_str() {
            "response.create" => match parse_create(body, Edge::Socket) {
                Ok(create) => self.enqueue(create, received).await,
                Err(e) => self.shared.error(&e, lane.as_deref()).await,
            },
            "response.cancel" => self.cancel(&body, lane.as_deref()).await,
            "response.steer" => self.steer(&body).await,
            "" => self.shared.error(&invalid(Some("type"), "the event has no `type`"), lane.as_deref()).await,
            other => {
                let e =
                    invalid(Some("type"), format!("unsupported event type {other:?}: this server takes response.create, response.cancel and response.steer"))
                        .with_code("unknown_event_type");
                self.shared.error(&e, lane.as_deref()).await
            }
        }
    }

    /// Queues `create` on its lane, starting the lane when it is new.
    async fn enqueue(&mut self, create: Create, received: Instant) {
        let key = create.stream_id.clone().unwrap_or_default();
        let limit = self.shared.state.config.max_in_flight;
        if !self.lanes.contains_key(&key) && self.lanes.len() >= limit {
            self.forget_idle_lanes();
            if self.lanes.len() >= limit {
                let e = ApiError::from(ProtocolError::new(ErrorCode::RateLimited, format!("at most {limit} lanes (stream_id) may be busy on one socket")));
                return self.shared.error(&e, create.stream_id.as_deref()).await;
            }
        }
        let lane = self.lanes.entry(key).or_insert_with(|| {
            let (queue, rx) = mpsc::channel(limit);
            Lane { queue, task: tokio::spawn(run_lane(self.shared.clone(), rx)) }
        });
        let stream_id = create.stream_id.clone();
        if lane.queue.try_send((create, received)).is_err() {
            let e = ApiError::from(ProtocolError::new(ErrorCode::RateLimited, format!("at most {limit} responses may wait on one lane")));
            self.shared.error(&e, stream_id.as_deref()).await;
        }
    }

    /// Ends the lanes with nothing queued or running.
    fn forget_idle_lanes(&mut self) {
        let busy: Vec<String> = self.shared.running().values().map(|r| r.lane.clone()).collect();
        self.lanes.retain(|key, lane| busy.contains(key) || lane.queue.capacity() < lane.queue.max_capacity());
    }

    /// `response.steer`: queues its input for the running response it names
    /// and stops that response (see `steer.rs`).
    async fn steer(&mut self, body: &serde_json::Map<String, Value>) {
        let target = body.get("previous_response_id").and_then(Value::as_str).unwrap_or_default().to_string();
        let input = body.get("input").cloned().unwrap_or(Value::Null);
        let steers = &self.shared.steers;
        let refused = |code: &str, message: &str, lane: Option<&str>| steers.failed(code, message, None, &target, &input, lane);
        let unknown = body.keys().find(|k| !["type", "previous_response_id", "input"].contains(&k.as_str()));
        let event = if let Some(k) = unknown {
            refused(
                "invalid_input",
                &format!("unrecognized argument supplied: {k} (a steer takes previous_response_id and input; its lane is its response's)"),
                None,
            )
        } else if target.is_empty() {
            refused("invalid_input", "previous_response_id (the running response to steer) is required", None)
        } else {
            match input::steer_input(body.get("input")) {
                Err(e) => refused("invalid_input", &e.message, None),
                Ok((messages, items)) => {
                    let steer = Steer { id: crate::server::new_secret("steer_"), target: target.clone(), input: input.clone(), messages, items };
                    // Queued under the running table's lock, so a response
                    // that ends meanwhile still finds it when it is removed.
                    let running = self.shared.running();
                    match running.get(&target) {
                        Some(r) if r.interrupt.steer() => {
                            let accepted = steers.accepted(&steer, &r.lane);
                            // Ends the turn as a stop string does: what it
                            // computed stays in the prefix cache for the successor.
                            r.stop.stop(StopReason::StopString);
                            steers.queue(steer);
                            accepted
                        }
                        Some(r) => refused("response_not_active", "the response is being cancelled", create_lane(&r.lane)),
                        None if self.shared.responses.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&target) => {
                            refused("response_already_completed", "the response already ended; continue it with response.create", None)
                        }
                        None => refused("response_not_found", &format!("no response {target:?} on this socket"), None),
                    }
                }
            }
        };
        let _ = self.shared.out.send(event).await;
    }

    async fn cancel(&mut self, body: &serde_json::Map<String, Value>, lane: Option<&str>) {
        if let Some(k) = body.keys().find(|k| !["type", "response_id", "stream_id"].contains(&k.as_str())) {
            let e = invalid(None, format!("unrecognized argument supplied: {k}")).with_code("unknown_parameter");
            return self.shared.error(&e, lane).await;
        }
        let id = body.get("response_id").and_then(Value::as_str);
        if id.is_none() && lane.is_none() {
            return self.shared.error(&invalid(Some("response_id"), "response.cancel needs `response_id` or `stream_id`"), None).await;
        }
        let mut found = false;
        for (rid, r) in self.shared.running().iter() {
            if id.is_some_and(|id| id == rid) || (id.is_none() && lane == Some(r.lane.as_str())) {
                r.interrupt.cancel();
                r.stop.stop(StopReason::Cancel);
                found = true;
            }
        }
        if !found {
            let what = id.map_or_else(|| format!("on lane {:?}", lane.unwrap_or_default()), |id| format!("{id:?}"));
            let e = ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("no running response {what}")).with_code("response_not_found");
            self.shared.error(&e, lane).await;
        }
    }
}

/// Runs one lane's responses, one after another, each followed by the
/// successors its steers make.
async fn run_lane(shared: Arc<Shared>, mut queue: mpsc::Receiver<(Create, Instant)>) {
    while let Some((mut create, received)) = queue.recv().await {
        shared.steers.prepend_to(&mut create);
        let mut next = Some((create, received, Vec::new()));
        while let Some((create, received, steers)) = next.take() {
            if shared.closed.load(Ordering::Acquire) {
                return;
            }
            next = run_one(&shared, create, received, steers).await;
        }
    }
}

/// Runs `create` (the successor of `steers`, when there are any) and
/// returns its own successor, if it was steered.
async fn run_one(shared: &Shared, create: Create, received: Instant, steers: Vec<Steer>) -> Option<(Create, Instant, Vec<Steer>)> {
    let lane = create.stream_id.clone().unwrap_or_default();
    let template = create.clone();
    let started = match start(&shared.state, &shared.tenant, &shared.owner, Some(&shared.responses), create, received).await {
        Ok(s) => s,
        Err(e) if steers.is_empty() => {
            shared.error(&e, create_lane(&lane)).await;
            return None;
        }
        Err(e) => {
            for s in steers {
                let failed = shared.steers.failed("successor_creation_failed", &e.message, Some(&s.id), &s.target, &s.input, Some(&lane));
                let _ = shared.out.send(failed).await;
            }
            return None;
        }
    };
    let id = started.id().to_string();
    let interrupt = Arc::new(Interrupt::default());
    let running = Running { lane: lane.clone(), stop: started.stop_handle(), interrupt: interrupt.clone() };
    shared.running().insert(id.clone(), running);
    if shared.closed.load(Ordering::Acquire) {
        started.stop_handle().stop(StopReason::Cancel);
    }
    let writer = started.run(&shared.state, Sink::Socket(shared.out.clone()), interrupt, Some(&shared.responses)).await;
    shared.running().remove(&id);
    let queued = shared.steers.take(&id);
    if queued.is_empty() {
        return None;
    }
    let events: Vec<String> = match writer.outcome() {
        Some(Outcome::Done { tool_calls, .. }) if tool_calls.is_empty() => return Some((steer::successor(&template, &id, &queued), Instant::now(), queued)),
        Some(Outcome::Done { tool_calls, .. }) => {
            let events = queued.iter().map(|s| shared.steers.pending(s, tool_calls, &lane)).collect();
            shared.steers.await_outputs(&id, queued);
            events
        }
        _ => queued
            .iter()
            .map(|s| {
                shared.steers.failed(
                    "response_not_active",
                    "the response was cancelled or failed before the steer applied",
                    Some(&s.id),
                    &id,
                    &s.input,
                    Some(&lane),
                )
            })
            .collect(),
    };
    for e in events {
        let _ = shared.out.send(e).await;
    }
    None
}

/// A lane's `stream_id` for its events (none for the default lane).
fn create_lane(lane: &str) -> Option<&str> {
    Some(lane).filter(|l| !l.is_empty())
}
