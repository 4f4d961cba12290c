//! [`Limits`]: the server's limits, announced in `session.ready`. The server
//! holds each `generate` to them (its `ValidGenerate`); a client may check
//! its own requests against them before sending.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::{ErrorCode, ProtocolError};

/// Server limits, announced in `session.ready`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Largest accepted text frame, in bytes (`frame_too_large` above it).
    pub max_frame_bytes: u32,
    /// Most prompt tokens after templating (`prompt_too_long` above it).
    pub max_prompt_tokens: u32,
    /// Largest accepted `max_tokens`.
    pub max_tokens: u32,
    /// Most concurrent requests per session (`too_many_requests` above it).
    pub max_in_flight: u32,
    /// How long a session outlives its socket, in ms.
    pub session_ttl_ms: u64,
    /// How long a socket may stay silent before `idle_timeout`, in ms.
    pub idle_timeout_ms: u64,
    /// Model context length in tokens: prompt + `max_tokens` must fit.
    pub context_length: u32,
}

impl Limits {
    /// `frame_too_large` if a frame of `len` bytes exceeds `max_frame_bytes`.
    pub fn check_frame_len(&self, len: usize) -> Result<(), ProtocolError> {
        if len > self.max_frame_bytes as usize {
            Err(ProtocolError::new(ErrorCode::FrameTooLarge, format!("frame is {len} bytes, the limit is {}", self.max_frame_bytes)))
        } else {
            Ok(())
        }
    }
}
