//! Reading a request body as a JSON object, for every HTTP edge: the edges
//! differ only in how they word the failures ([`BodyError`]).
//!
//! A body is held to a size (refused before reading when its declared
//! length is over) and to a time in all, so a client that never finishes
//! its body does not hold a connection open: at 30 s, a slow sender of
//! 1 MiB must keep up ~35 KB/s.
use std::time::Duration;

use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Request, Response, StatusCode};
use serde_json::{Map, Value};

/// Why a body could not be read as a JSON object.
#[derive(Debug)]
pub enum BodyError {
    /// Over `limit` bytes (declared or sent): 413.
    TooLarge { limit: usize },
    /// Not all there within `within`: 408.
    TooSlow { within: Duration },
    /// The connection failed while reading.
    Read(String),
    /// Valid JSON, but not an object.
    NotAnObject,
    /// Not valid JSON.
    Json(String),
}

impl BodyError {
    /// What went wrong, in words an edge may send as is.
    pub fn message(&self) -> String {
        match self {
            BodyError::TooLarge { limit } => format!("the request body is over {limit} bytes"),
            BodyError::TooSlow { within } => format!("the request body did not arrive within {:.0} s", within.as_secs_f64()),
            BodyError::Read(e) => format!("reading the request body failed: {e}"),
            BodyError::NotAnObject => "the request body must be a JSON object".into(),
            BodyError::Json(e) => format!("the request body is not valid JSON: {e}"),
        }
    }
}

/// Marks an error answer to end its connection where the request's body
/// may have been left unread (413, 408): its rest would otherwise be read as
/// the next request.
pub fn close_if_body_unread(response: &mut Response<crate::server::http::Body>) {
    if matches!(response.status(), StatusCode::PAYLOAD_TOO_LARGE | StatusCode::REQUEST_TIMEOUT) {
        response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
}

/// The body of `req` as a JSON object, at most `limit` bytes, all of it
/// within `within`.
pub async fn read_json_object(req: Request<Incoming>, limit: usize, within: Duration) -> Result<Map<String, Value>, BodyError> {
    if declared_length(req.headers()).is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge { limit });
    }
    let bytes = match tokio::time::timeout(within, Limited::new(req.into_body(), limit).collect()).await {
        Err(_) => return Err(BodyError::TooSlow { within }),
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => return Err(BodyError::TooLarge { limit }),
        Ok(Err(e)) => return Err(BodyError::Read(e.to_string())),
    };
    // Duplicate keys are refused, as on the WebSockets (serde would keep the last).
    let text = std::str::from_utf8(&bytes).map_err(|e| BodyError::Json(format!("the body is not UTF-8: {e}")))?;
    match protocol::parse_json_strict(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(BodyError::NotAnObject),
        Err(e) => Err(BodyError::Json(e.message.trim_start_matches("invalid JSON: ").to_string())),
    }
}

/// The body length a request declares (`Content-Length`), if it does.
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}
