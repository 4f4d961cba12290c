//! `POST /v1/responses/compact`: a long conversation (`previous_response_id`
//! and/or `input`) becomes its user messages followed by one `compaction`
//! item whose summary the model writes, greedily, as one more turn of that
//! conversation (so it reads the conversation from the prefix cache). The
//! client sends that output back as the input of its next response, which
//! then reads the summary instead of the whole history.
//!
//! The `encrypted_content` is sealed, not encrypted: it is the summary, marked
//! as this server's. A client could write the same text as a message; what
//! the seal gives is that a compaction from elsewhere (OpenAI's, which only
//! OpenAI can read) is refused by name rather than read as text.
use std::sync::Arc;
use std::time::Instant;

use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use protocol::Role;
use serde_json::{json, Value};

use super::super::super::http::{edge, Body};
use super::super::super::ServerState;
use super::super::respond::ApiError;
use super::super::{owner, unix_now};
use super::events::{Interrupt, Outcome, Sink};
use super::wire::Edge;
use super::{parse_create, start};

/// The fields compact takes (OpenAI's, less the image options).
const FIELDS: &[&str] = &["model", "input", "instructions", "previous_response_id", "prompt_cache_key"];
/// Longest summary, in tokens.
const MAX_SUMMARY_TOKENS: u32 = 256;
/// The turn that asks the model for the summary.
const ASK: &str = "Summarize our conversation so far, for you to continue it later: the goals, facts, names, numbers, \
                   decisions and open questions. Write only the summary.";
/// Marks a compaction's content as this server's.
const SEAL: &str = "tether-compaction-v1:";

/// The content of a compaction item holding `summary`.
fn seal(summary: &str) -> String {
    let mut out = String::with_capacity(SEAL.len() + 2 * summary.len());
    out.push_str(SEAL);
    for b in summary.bytes() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// The summary a compaction item holds; `None` if this server did not seal it.
pub fn open(content: &str) -> Option<String> {
    let hex = content.strip_prefix(SEAL)?;
    let bytes: Option<Vec<u8>> = (0..hex.len()).step_by(2).map(|i| hex.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect();
    String::from_utf8(bytes?).ok()
}

/// The message a summary becomes in a later prompt.
pub fn recall(summary: &str) -> String {
    format!("A summary of our conversation so far:\n{summary}")
}

/// A user message as an output item.
fn user_item(text: &str) -> Value {
    json!({"id": super::super::super::new_secret("msg_"), "type": "message", "role": "user", "status": "completed",
        "content": [{"type": "input_text", "text": text}]})
}

pub async fn compact(state: &Arc<ServerState>, req: Request<Incoming>, tenant: &str) -> Result<Response<Body>, ApiError> {
    let received = Instant::now();
    let mut body = edge::read_json::<ApiError>(state, req).await?;
    edge::refuse_unknown::<ApiError>(body.keys().map(String::as_str).find(|k| !FIELDS.contains(k)))?;
    if !body.get("model").is_some_and(Value::is_string) {
        return Err(ApiError::invalid(Some("model"), "model (a string) is required"));
    }
    let mut input = match body.remove("input") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![json!({"role": "user", "content": s})],
        Some(Value::Array(items)) => items,
        Some(_) => return Err(ApiError::invalid(Some("input"), "input must be a string or a list of items")),
    };
    if input.is_empty() && body.get("previous_response_id").is_none_or(Value::is_null) {
        return Err(ApiError::invalid(Some("input"), "give input, previous_response_id or both: the conversation to compact"));
    }
    let own = input.len();
    input.push(json!({"role": "user", "content": ASK}));
    body.insert("input".into(), Value::Array(input));
    body.insert("temperature".into(), json!(0));
    body.insert("max_output_tokens".into(), json!(MAX_SUMMARY_TOKENS));
    body.insert("store".into(), json!(false));
    let create = parse_create(body, Edge::Http)?;
    // The output: every user message of the conversation, oldest first.
    let earlier = create.previous_response_id.as_deref().and_then(|id| state.responses.find(tenant, id, None));
    let mut output: Vec<Value> =
        earlier.map(|c| c.all_messages()).unwrap_or_default().iter().filter(|m| m.role == Role::User).map(|m| user_item(&m.content)).collect();
    output.extend(create.input_items[..own].iter().filter(|i| i["type"] == "message" && i["role"] == "user").cloned());
    let started = start(state, tenant, &owner(tenant, None), None, create, received).await?;
    let writer = started.run(state, Sink::Collect, Arc::new(Interrupt::default()), None).await;
    let response = writer.whole()?;
    let Some(Outcome::Done { text, .. }) = writer.outcome() else {
        return Err(ApiError::invalid(None, "the summary was not written (the request was cancelled)"));
    };
    output.push(json!({"id": super::super::super::new_secret("cmp_"), "type": "compaction", "encrypted_content": seal(text.trim())}));
    let compacted = json!({"id": super::super::super::new_secret("resp_"), "object": "response.compaction", "created_at": unix_now(),
        "output": output, "usage": response["usage"]});
    Ok(edge::json(StatusCode::OK, &compacted))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_summary_opens_to_itself_and_others_do_not_open() {
        let summary = "Ada lives in Lisbon. ünïcode, \"quotes\"\nand lines";
        assert_eq!(open(&seal(summary)).as_deref(), Some(summary));
        assert_eq!(open("gAAAAABpM0Yj-opaque"), None);
        assert_eq!(open(&format!("{SEAL}zz")), None);
        assert_eq!(open(&format!("{SEAL}4")), None);
    }
}
