//! Stored responses read back: `GET /v1/responses/{id}` (the final
//! response object), `DELETE /v1/responses/{id}`,
//! `GET /v1/responses/{id}/input_items` (a cursor page, as the SDK's
//! `input_items.list` walks it) and `POST /v1/responses/{id}/cancel`.
//!
//! Only `store: true` responses are here, and only for the tenant that made
//! them: another key's id is as unknown as a made-up one (404). Nothing runs
//! in the background on this server, so cancel never finds a response it
//! could stop: it answers as OpenAI does for a response that was not created
//! with `background: true` (a cancel of a running streamed response is the
//! client closing its stream, or the socket's `response.cancel`).
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};

use super::super::super::http::{edge, Body};
use super::super::super::ServerState;
use super::super::respond::ApiError;

/// Most input items one page holds, and the default (OpenAI's).
const MAX_PAGE: usize = 100;
const DEFAULT_PAGE: usize = 20;

/// Serves `/v1/responses/{rest}`; `None` for a path no route here has.
pub fn handle(state: &ServerState, req: &Request<Incoming>, tenant: &str, rest: &str) -> Option<Result<Response<Body>, ApiError>> {
    let (id, action) = rest.split_once('/').unwrap_or((rest, ""));
    if id.is_empty() {
        return None;
    }
    let path = req.uri().path();
    let method = req.method();
    Some(match (action, method) {
        ("", &Method::GET) => retrieve(state, tenant, id, req.uri().query().unwrap_or("")),
        ("", &Method::DELETE) => delete(state, tenant, id),
        ("", _) => Ok(edge::wrong_method::<ApiError>(method, path, "GET, DELETE")),
        ("input_items", &Method::GET) => input_items(state, tenant, id, req.uri().query().unwrap_or("")),
        ("input_items", _) => Ok(edge::wrong_method::<ApiError>(method, path, "GET")),
        ("cancel", &Method::POST) => cancel(state, tenant, id),
        ("cancel", _) => Ok(edge::wrong_method::<ApiError>(method, path, "POST")),
        _ => return None,
    })
}

/// A response id nothing here holds for this tenant, in OpenAI's words.
fn not_found(id: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("Response with id '{id}' not found."))
}

fn retrieve(state: &ServerState, tenant: &str, id: &str, query: &str) -> Result<Response<Body>, ApiError> {
    // A stored response is answered whole: a client that asked for its
    // events would not parse the JSON it got.
    if query.split('&').any(|p| p == "stream=true") {
        return Err(ApiError::invalid(Some("stream"), "a stored response is read back whole: leave out stream=true"));
    }
    let c = state.responses.stored(tenant, id).ok_or_else(|| not_found(id))?;
    let record = c.record.as_ref().ok_or_else(|| not_found(id))?;
    Ok(edge::json(StatusCode::OK, &record.response))
}

fn delete(state: &ServerState, tenant: &str, id: &str) -> Result<Response<Body>, ApiError> {
    if !state.responses.delete(tenant, id) {
        return Err(not_found(id));
    }
    Ok(edge::json(StatusCode::OK, &json!({"id": id, "object": "response", "deleted": true})))
}

fn cancel(state: &ServerState, tenant: &str, id: &str) -> Result<Response<Body>, ApiError> {
    state.responses.stored(tenant, id).ok_or_else(|| not_found(id))?;
    Err(ApiError::invalid(None, "Only responses created with background=true can be cancelled; this server runs no background responses."))
}

/// The page `query` asks for: `order` (`asc`, or `desc` by default),
/// `limit` (1 to 100), `after` (an item id).
struct Page<'a> {
    ascending: bool,
    limit: usize,
    after: Option<&'a str>,
}

fn page(query: &str) -> Result<Page<'_>, ApiError> {
    let mut page = Page { ascending: false, limit: DEFAULT_PAGE, after: None };
    for (key, value) in query.split('&').filter(|p| !p.is_empty()).map(|p| p.split_once('=').unwrap_or((p, ""))) {
        match key {
            "order" => {
                page.ascending = match value {
                    "asc" => true,
                    "desc" => false,
                    _ => return Err(ApiError::invalid(Some("order"), format!("order must be asc or desc, got {value:?}"))),
                }
            }
            "limit" => {
                page.limit = value
                    .parse()
                    .ok()
                    .filter(|n| (1..=MAX_PAGE).contains(n))
                    .ok_or_else(|| ApiError::invalid(Some("limit"), format!("limit must be 1 to {MAX_PAGE}, got {value:?}")))?
            }
            "after" => page.after = Some(value),
            // `include` adds nothing to these items (they carry no logprobs).
            "include" | "include[]" | "include%5B%5D" => {}
            other => return Err(ApiError::invalid(None, format!("unrecognized query parameter supplied: {other}")).with_code("unknown_parameter")),
        }
    }
    Ok(page)
}

fn input_items(state: &ServerState, tenant: &str, id: &str, query: &str) -> Result<Response<Body>, ApiError> {
    let page = page(query)?;
    let c = state.responses.stored(tenant, id).ok_or_else(|| not_found(id))?;
    let record = c.record.as_ref().ok_or_else(|| not_found(id))?;
    let mut items: Vec<&Value> = record.input_items.iter().collect();
    if !page.ascending {
        items.reverse();
    }
    if let Some(after) = page.after {
        let at =
            items.iter().position(|v| v["id"] == after).ok_or_else(|| ApiError::invalid(Some("after"), format!("no input item {after:?} in this response")))?;
        items.drain(..=at);
    }
    let has_more = items.len() > page.limit;
    items.truncate(page.limit);
    let (first_id, last_id) = (items.first().map(|v| v["id"].clone()), items.last().map(|v| v["id"].clone()));
    Ok(edge::json(StatusCode::OK, &json!({"object": "list", "data": items, "first_id": first_id, "last_id": last_id, "has_more": has_more})))
}
