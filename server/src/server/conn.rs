//! The server's handle on one WebSocket connection, as sessions see it,
//! and why the server closes one.
use std::sync::Arc;
use std::time::Duration;

use protocol::ErrorCode;
use tokio::sync::{watch, Notify};

/// Why the server closes a connection: an optional `error` frame, then a
/// close frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloseReason {
    pub code: u16,
    pub reason: String,
    pub error: Option<(ErrorCode, String)>,
}

impl CloseReason {
    /// A fatal protocol error: the `error` frame, then its close code.
    pub fn fatal(code: ErrorCode, message: impl Into<String>) -> CloseReason {
        let message = message.into();
        CloseReason { code: code.close_code().unwrap_or(1011), reason: truncate_reason(&message), error: Some((code, message)) }
    }

    /// A normal closure without an error frame.
    pub fn normal(reason: &str) -> CloseReason {
        CloseReason { code: 1000, reason: reason.into(), error: None }
    }

    pub(super) fn taken_over() -> CloseReason {
        CloseReason::normal("session resumed on another connection")
    }

    pub(super) fn too_slow(after: Duration) -> CloseReason {
        CloseReason { code: 1008, reason: format!("client stopped reading for {} ms", after.as_millis()), error: None }
    }
}

/// Close reasons are limited to 123 bytes by the WebSocket spec.
fn truncate_reason(s: &str) -> String {
    let mut end = s.len().min(120);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// The server's handle on one WebSocket connection, as sessions see it.
pub struct ConnCtl {
    pub id: u64,
    /// Signalled when the attached session has frames for this connection.
    pub wake: Notify,
    close: watch::Sender<Option<CloseReason>>,
}

impl ConnCtl {
    pub fn new(id: u64) -> Arc<ConnCtl> {
        Arc::new(ConnCtl { id, wake: Notify::new(), close: watch::Sender::new(None) })
    }

    /// Asks the connection to close (the first reason wins).
    pub fn close(&self, reason: CloseReason) {
        self.close.send_if_modified(|cur| {
            if cur.is_none() {
                *cur = Some(reason);
                true
            } else {
                false
            }
        });
    }

    pub fn closing(&self) -> watch::Receiver<Option<CloseReason>> {
        self.close.subscribe()
    }
}
