//! Steering on the WebSocket mode: `{"type": "response.steer",
//! "previous_response_id", "input"}` adds user input to a response while it
//! runs. The response stops where it is and ends `incomplete` with reason
//! `steered`, its output kept; a successor with the same settings then
//! continues it with the steering input, from the prefix cache like any
//! `previous_response_id` turn, on the same lane before anything queued
//! there.
//!
//! Events, as OpenAI's WebSocket mode sends them: `response.steer.accepted`
//! (the server holds the input; the successor's `response.created` commits
//! it), `response.steer.failed` (the input back, with a code), and
//! `response.steer.pending` when the response ended in function calls: the
//! input then waits for the client's `response.create` with the call outputs
//! (same `previous_response_id`) and goes before that request's input.
//!
//! Not here: steering over HTTP (a request there has no socket to steer it
//! on), and steers held across a reconnect (they go with their socket).
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use protocol::{ChatMessage, ToolCall};
use serde_json::{json, Value};

use super::wire::Create;

/// One accepted `response.steer`.
pub struct Steer {
    pub id: String,
    /// The response it steers.
    pub target: String,
    /// The input as the client sent it, returned if it cannot be committed.
    pub input: Value,
    pub messages: Vec<ChatMessage>,
    pub items: Vec<Value>,
}

/// A socket's steers: those waiting for their target to end, and those
/// waiting for the outputs of the calls their target ended with. Keyed by
/// the target response id.
#[derive(Default)]
pub struct Steers {
    queued: Mutex<HashMap<String, Vec<Steer>>>,
    awaiting_outputs: Mutex<HashMap<String, Vec<Steer>>>,
    /// `sequence_number` of the steer events, counted per socket (they
    /// belong to no one response's sequence).
    sequence: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Steers {
    pub fn queue(&self, steer: Steer) {
        lock(&self.queued).entry(steer.target.clone()).or_default().push(steer);
    }

    /// The steers of `target`, which just ended, in the order they came.
    pub fn take(&self, target: &str) -> Vec<Steer> {
        lock(&self.queued).remove(target).unwrap_or_default()
    }

    /// Keeps `steers` until the client answers `target`'s calls.
    pub fn await_outputs(&self, target: &str, steers: Vec<Steer>) {
        lock(&self.awaiting_outputs).entry(target.to_string()).or_default().extend(steers);
    }

    /// Puts the steers waiting on `create.previous_response_id` before its input.
    pub fn prepend_to(&self, create: &mut Create) {
        let Some(target) = &create.previous_response_id else { return };
        let Some(steers) = lock(&self.awaiting_outputs).remove(target) else { return };
        let (mut messages, mut items): (Vec<ChatMessage>, Vec<Value>) = (Vec::new(), Vec::new());
        for s in steers {
            messages.extend(s.messages);
            items.extend(s.items);
        }
        messages.append(&mut create.input);
        items.append(&mut create.input_items);
        (create.input, create.input_items) = (messages, items);
    }

    /// A steer event of `kind` with its sequence number and lane.
    fn event(&self, kind: &str, lane: Option<&str>, fields: Value) -> String {
        let mut e = json!({"type": kind, "sequence_number": self.sequence.fetch_add(1, Ordering::Relaxed)});
        if let (Value::Object(e), Value::Object(f)) = (&mut e, fields) {
            e.extend(f);
        }
        if let Some(lane) = lane.filter(|l| !l.is_empty()) {
            e["stream_id"] = json!(lane);
        }
        e.to_string()
    }

    pub fn accepted(&self, steer: &Steer, lane: &str) -> String {
        self.event("response.steer.accepted", Some(lane), json!({"steer": {"id": steer.id, "previous_response_id": steer.target}}))
    }

    /// The input back, not committed: `code` is one of OpenAI's steer
    /// error codes (`invalid_input`, `response_not_found`, ...).
    pub fn failed(&self, code: &str, message: &str, id: Option<&str>, target: &str, input: &Value, lane: Option<&str>) -> String {
        let mut steer = json!({"previous_response_id": target, "input": input});
        if let Some(id) = id {
            steer["id"] = json!(id);
        }
        let error = json!({"type": "invalid_request_error", "code": code, "message": message});
        self.event("response.steer.failed", lane, json!({"error": error, "steer": steer}))
    }

    /// The steer waits for the outputs of `calls` (stubs the client fills).
    pub fn pending(&self, steer: &Steer, calls: &[ToolCall], lane: &str) -> String {
        let required: Vec<Value> = calls.iter().map(|c| json!({"type": "function_call_output", "call_id": c.id, "name": c.name})).collect();
        self.event(
            "response.steer.pending",
            Some(lane),
            json!({"reason": "waiting_for_required_input", "required_input": required,
                "steer": {"id": steer.id, "previous_response_id": steer.target}}),
        )
    }
}

/// The response that continues `target` with `steers`' input, with the
/// settings of `template` (the request that made `target`).
pub fn successor(template: &Create, target: &str, steers: &[Steer]) -> Create {
    let mut next = template.clone();
    next.previous_response_id = Some(target.to_string());
    next.generate = true;
    next.input = steers.iter().flat_map(|s| s.messages.iter().cloned()).collect();
    next.input_items = steers.iter().flat_map(|s| s.items.iter().cloned()).collect();
    next
}

#[cfg(test)]
mod tests {
    use super::super::wire::{CreateBody, Edge};
    use super::*;

    fn create(body: Value) -> Create {
        serde_json::from_value::<CreateBody>(body).expect("a create body").check(Edge::Socket).map_err(|e| e.message).expect("a valid create")
    }

    fn steer(id: &str, target: &str, text: &str) -> Steer {
        let (messages, items) = super::super::input::steer_input(Some(&json!(text))).map_err(|e| e.message).expect("valid steer input");
        Steer { id: id.into(), target: target.into(), input: json!(text), messages, items }
    }

    #[test]
    fn a_successor_keeps_the_settings_and_takes_the_steers_in_order() {
        let template = create(json!({"input": "count", "max_output_tokens": 50, "temperature": 0, "stream_id": "a", "instructions": "be brief"}));
        let next = successor(&template, "resp_1", &[steer("s1", "resp_1", "stop"), steer("s2", "resp_1", "say hi")]);
        assert_eq!(next.previous_response_id.as_deref(), Some("resp_1"));
        assert_eq!((next.max_output_tokens, next.temperature, next.stream_id.as_deref()), (Some(50), 0.0, Some("a")));
        assert_eq!(next.instructions.as_deref(), Some("be brief"));
        assert_eq!(next.input.iter().map(|m| m.content.as_str()).collect::<Vec<_>>(), ["stop", "say hi"]);
        assert_eq!(next.input_items.len(), 2);
    }

    #[test]
    fn steers_waiting_for_call_outputs_go_before_the_next_requests_input_once() {
        let steers = Steers::default();
        steers.queue(steer("s1", "resp_1", "also check Oslo"));
        let queued = steers.take("resp_1");
        assert!(steers.take("resp_1").is_empty(), "taken once");
        steers.await_outputs("resp_1", queued);
        let outputs = json!([{"type": "function_call_output", "call_id": "c1", "output": "12:00"}]);
        let mut next = create(json!({"input": outputs, "previous_response_id": "resp_1"}));
        steers.prepend_to(&mut next);
        assert_eq!(next.input.iter().map(|m| m.content.as_str()).collect::<Vec<_>>(), ["also check Oslo", "12:00"]);
        assert_eq!(next.input_items.len(), 2);
        let mut again = create(json!({"input": "x", "previous_response_id": "resp_1"}));
        steers.prepend_to(&mut again);
        assert_eq!(again.input.len(), 1, "the steer went with the first request");
    }

    #[test]
    fn steer_events_are_numbered_per_socket_and_carry_their_lane() {
        let steers = Steers::default();
        let s = steer("steer_1", "resp_1", "x");
        let accepted: Value = serde_json::from_str(&steers.accepted(&s, "a")).expect("json");
        assert_eq!(
            accepted,
            json!({"type": "response.steer.accepted", "sequence_number": 0, "stream_id": "a", "steer": {"id": "steer_1", "previous_response_id": "resp_1"}})
        );
        let calls = [ToolCall { id: "c1".into(), name: "get_time".into(), arguments: "{}".into() }];
        let pending: Value = serde_json::from_str(&steers.pending(&s, &calls, "")).expect("json");
        assert_eq!(pending["sequence_number"], 1);
        assert!(pending.get("stream_id").is_none(), "the default lane has no stream_id");
        assert_eq!(pending["required_input"], json!([{"type": "function_call_output", "call_id": "c1", "name": "get_time"}]));
        let failed: Value = serde_json::from_str(&steers.failed("response_not_found", "no", None, "resp_2", &json!("x"), None)).expect("json");
        assert_eq!(failed["steer"], json!({"previous_response_id": "resp_2", "input": "x"}));
        assert_eq!(failed["error"], json!({"type": "invalid_request_error", "code": "response_not_found", "message": "no"}));
    }
}
