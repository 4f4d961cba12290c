//! Server configuration: bind address, protocol limits, session lifetimes,
//! authentication. Every limit here is announced to clients (see
//! [`ServerConfig::limits`]) or enforced at the edge.
use std::path::PathBuf;
use std::time::Duration;

use protocol::Limits;

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to bind (`127.0.0.1`, `0.0.0.0`, ...).
    pub host: String,
    /// TCP port; 0 picks an ephemeral one.
    pub port: u16,
    /// Model name announced in `session.ready` and `/healthz` (defaults to the engine's).
    pub model_name: Option<String>,
    /// Largest client text frame, bytes (`frame_too_large` above, then close).
    pub max_frame_bytes: usize,
    /// Most prompt tokens after templating; `None`: the context length minus one.
    pub max_prompt_tokens: Option<usize>,
    /// Largest `max_tokens` a request may ask for (clamped below the context length).
    pub max_tokens: usize,
    /// The length cap of a request that gives none (OpenAI's and llama.cpp's
    /// run until the context is full, which a small model sampling at
    /// temperature 1 fills with minutes of text).
    pub default_max_tokens: usize,
    /// Concurrent requests per session.
    pub max_in_flight: usize,
    /// Sessions per server (attached or waiting for a resume).
    pub max_sessions: usize,
    /// Open connections, HTTP and WebSocket; one more is answered 503 and closed.
    pub max_connections: usize,
    /// How long a session outlives its socket.
    pub session_ttl: Duration,
    /// A socket with no client frame and no request in flight for this long is closed.
    pub idle_timeout: Duration,
    /// Frames kept per session for replay on resume (deltas, done, request errors).
    pub replay_frames: usize,
    /// Bytes of JSON kept per session for replay.
    pub replay_bytes: usize,
    /// Connection-level frames (pong, errors, session.ready) queued for the writer.
    pub outgoing_queue: usize,
    /// A request whose frames cannot be delivered for this long (the client
    /// stopped reading) gets its socket closed; the session is then detached
    /// and its replay bound applies.
    pub stall_timeout: Duration,
    /// Client frames per second, sustained, per WebSocket (`rate_limited`
    /// above), and HTTP requests per second per bearer token (429 above).
    pub rate_limit_per_sec: f64,
    /// Burst of client frames allowed above the sustained rate.
    pub rate_limit_burst: f64,
    /// Largest `chunk_size` (prefill tokens per forward) a request may ask for.
    pub max_prefill_chunk: usize,
    /// Speculation for requests that do not choose their own.
    pub speculation: crate::engine::speculate::Speculation,
    /// Whether the engines have a draft model (`speculation.source: "draft_model"`).
    pub has_draft_model: bool,
    /// Bearer token required on `/v1/ws` when set.
    pub auth_token: Option<String>,
    /// Allowed `Origin` values on `/v1/ws`; empty allows every origin.
    pub allowed_origins: Vec<String>,
    /// How long graceful shutdown waits for in-flight requests.
    pub drain_timeout: Duration,
    /// How long a Responses API WebSocket may stay open (OpenAI's 60
    /// minutes); then it is closed with `websocket_connection_limit_reached`.
    pub responses_socket_lifetime: Duration,
    /// A folder of static files served on `GET` paths outside the API (the
    /// browser playground); an absolute, canonical path. `None` serves none.
    pub ui_dir: Option<PathBuf>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            model_name: None,
            max_frame_bytes: 1 << 20,
            max_prompt_tokens: None,
            max_tokens: 4096,
            default_max_tokens: 2048,
            max_in_flight: 8,
            max_sessions: 256,
            max_connections: 1024,
            session_ttl: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(300),
            replay_frames: 1024,
            replay_bytes: 4 << 20,
            outgoing_queue: 256,
            stall_timeout: Duration::from_secs(30),
            rate_limit_per_sec: 100.0,
            rate_limit_burst: 200.0,
            max_prefill_chunk: 2048,
            speculation: crate::engine::speculate::Speculation { kind: crate::engine::speculate::DraftKind::Echo, ..Default::default() },
            has_draft_model: false,
            auth_token: None,
            allowed_origins: Vec::new(),
            drain_timeout: Duration::from_secs(30),
            responses_socket_lifetime: Duration::from_secs(3600),
            ui_dir: None,
        }
    }
}

impl ServerConfig {
    /// The limits announced in `session.ready`, for a model of `context_length` tokens.
    pub fn limits(&self, context_length: usize) -> Limits {
        let ctx = context_length.max(2);
        let max_prompt = self.max_prompt_tokens.unwrap_or(ctx - 1).min(ctx - 1).max(1);
        Limits {
            max_frame_bytes: clamp_u32(self.max_frame_bytes),
            max_prompt_tokens: clamp_u32(max_prompt),
            max_tokens: clamp_u32(self.max_tokens.min(ctx - 1).max(1)),
            max_in_flight: clamp_u32(self.max_in_flight),
            session_ttl_ms: self.session_ttl.as_millis() as u64,
            idle_timeout_ms: self.idle_timeout.as_millis() as u64,
            context_length: clamp_u32(ctx),
        }
    }

    /// Checks values that would make the server unusable.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("max_frame_bytes", self.max_frame_bytes),
            ("max_tokens", self.max_tokens),
            ("default_max_tokens", self.default_max_tokens),
            ("max_in_flight", self.max_in_flight),
            ("max_sessions", self.max_sessions),
            ("max_connections", self.max_connections),
            ("replay_frames", self.replay_frames),
            ("replay_bytes", self.replay_bytes),
            ("outgoing_queue", self.outgoing_queue),
            ("max_prefill_chunk", self.max_prefill_chunk),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if self.max_prompt_tokens == Some(0) {
            return Err("max_prompt_tokens must be at least 1".into());
        }
        if !(self.rate_limit_per_sec > 0.0 && self.rate_limit_burst >= 1.0) {
            return Err("rate limit must be positive with a burst of at least 1".into());
        }
        if self.idle_timeout.is_zero() {
            return Err("idle_timeout must be positive".into());
        }
        if matches!(&self.auth_token, Some(t) if t.is_empty()) {
            return Err("the auth token must not be empty".into());
        }
        Ok(())
    }
}

fn clamp_u32(v: usize) -> u32 {
    v.min(u32::MAX as usize) as u32
}
