//! The network server: protocol v1 over WebSocket (`GET /v1/ws`), plus
//! `/healthz` and Prometheus `/metrics`, in front of the engine.
//!
//! * `config` — limits, TTLs, auth ([`ServerConfig`]).
//! * `http` — routing, Origin / bearer checks, the WebSocket upgrade.
//! * `ws` — one connection: reader and writer tasks.
//! * `conn` — a connection's handle as sessions see it; close reasons.
//! * `session` — one session: its requests, their frames, resume.
//! * `replay` — a session's ring of frames, at absolute positions.
//! * `sessions` — the registry: create (room at the limit), find, expire.
//! * `request` — `generate` → token ids → engine; engine events → frames.
//! * `relay` — engine events → text pieces and endings, for every edge.
//! * `openai` — OpenAI's HTTP API and the Responses API's WebSocket mode.
//! * `anthropic` — Anthropic's Messages API (`/v1/messages`, `count_tokens`).
//! * `llamacpp` — llama.cpp's editor endpoints (`/infill`, `/completion`, ...).
//! * `rate` — flood limits per socket and per HTTP tenant.
//! * `metrics` — the Prometheus registry.
//!
//! [`serve`] binds and starts serving; [`ServerHandle::shutdown`] drains.
mod anthropic;
mod config;
mod conn;
mod http;
mod llamacpp;
mod metrics;
mod openai;
mod rate;
mod relay;
mod replay;
mod request;
mod session;
mod sessions;
#[cfg(test)]
mod testing;
mod ws;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use protocol::{Limits, ModelInfo};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use config::ServerConfig;
pub use http::{ws_size_cap, BEARER_SUBPROTOCOL_PREFIX, SUBPROTOCOL};
pub use metrics::Metrics;
pub use request::{tokenize, FimTokens};
pub use session::new_secret;

use crate::engine::{EnginePool, Scope};
use crate::tokenizer::TextTokenizer;
use session::SessionLimits;
use sessions::SessionRegistry;

/// Everything the connections share.
pub struct ServerState {
    pub config: ServerConfig,
    /// The engine workers; each session is pinned to one.
    pub engines: EnginePool,
    pub tokenizer: Arc<TextTokenizer>,
    /// Compiles requests' `response_format`s for this model.
    pub grammars: crate::grammar::Grammars,
    pub fim: Option<FimTokens>,
    /// How this model is shown tools.
    pub tool_prompting: crate::tools::ToolPrompting,
    pub model: ModelInfo,
    pub limits: Limits,
    sessions: SessionRegistry,
    /// What the Responses API's `previous_response_id` continues from.
    responses: openai::ResponseStore,
    /// HTTP requests per tenant (429 above).
    http_buckets: rate::TenantBuckets,
    pub metrics: Metrics,
    draining: AtomicBool,
    /// Stop accepting connections (listener and idle HTTP connections).
    stop_accepting: watch::Sender<bool>,
    /// Close every WebSocket (after the drain).
    stop: watch::Sender<bool>,
    in_flight: AtomicUsize,
    connections: AtomicUsize,
    next_conn: AtomicU64,
}

impl ServerState {
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Requests submitted to the engine and not finished yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    pub fn connection_count(&self) -> usize {
        self.connections.load(Ordering::Acquire)
    }

    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    fn next_conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    fn try_open_connection(&self) -> bool {
        if self.connections.fetch_add(1, Ordering::AcqRel) >= self.config.max_connections {
            self.connections.fetch_sub(1, Ordering::AcqRel);
            false
        } else {
            true
        }
    }

    /// A counted connection that became a WebSocket: the socket holds a
    /// count of its own from here, as the HTTP connection's ends with the
    /// upgrade (so no check: the connection was admitted at accept).
    fn connection_upgraded(&self) {
        self.connections.fetch_add(1, Ordering::AcqRel);
    }

    fn connection_closed(&self) {
        self.connections.fetch_sub(1, Ordering::AcqRel);
    }

    fn request_started(&self, prompt_tokens: usize) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.metrics.requests_in_flight.inc();
        self.metrics.prompt_tokens.inc_by(prompt_tokens as u64);
    }

    fn request_ended(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.metrics.requests_in_flight.dec();
    }

    fn stop_signal(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }
}

/// A running server.
pub struct ServerHandle {
    addr: SocketAddr,
    state: Arc<ServerState>,
    accept: JoinHandle<()>,
    reaper: JoinHandle<()>,
}

/// Binds `config.host:config.port` and serves until [`ServerHandle::shutdown`].
/// Must be called inside a Tokio runtime. The engine is shared, not owned:
/// stopping the server leaves it running.
pub async fn serve(config: ServerConfig, engines: impl Into<EnginePool>, tokenizer: Arc<TextTokenizer>) -> anyhow::Result<ServerHandle> {
    config.validate().map_err(anyhow::Error::msg)?;
    let listener = TcpListener::bind((config.host.as_str(), config.port)).await?;
    let addr = listener.local_addr()?;
    let state = ServerState::new(config, engines.into(), tokenizer);
    let grammars = state.clone();
    tokio::task::spawn_blocking(move || grammars.grammars.prepare());
    let accept = tokio::spawn(accept_loop(state.clone(), listener));
    let reaper = tokio::spawn(reaper_loop(state.clone()));
    Ok(ServerHandle { addr, state, accept, reaper })
}

impl ServerState {
    /// The state of a server for `config` (already validated) in front of
    /// `engines`; nothing is started.
    fn new(config: ServerConfig, engines: EnginePool, tokenizer: Arc<TextTokenizer>) -> Arc<ServerState> {
        let info = engines.info().clone();
        let fim = FimTokens::detect(&tokenizer);
        let model = ModelInfo {
            name: config.model_name.clone().unwrap_or_else(|| info.name.clone()),
            architecture: info.architecture.clone(),
            context_length: info.context_length.min(u32::MAX as usize) as u32,
            vocab_size: info.vocab_size.min(u32::MAX as usize) as u32,
            fim: fim.is_some(),
        };
        let limits = config.limits(info.context_length);
        let session_limits = SessionLimits {
            max_in_flight: config.max_in_flight,
            replay_frames: config.replay_frames,
            replay_bytes: config.replay_bytes,
            stall_timeout: config.stall_timeout,
        };
        let forget = engines.clone();
        Arc::new(ServerState {
            sessions: SessionRegistry::new(config.max_sessions, config.session_ttl, session_limits)
                .with_on_forget(move |id| forget.for_session(id).drop_scope(Scope::Session(id.to_string()))),
            responses: openai::ResponseStore::new(config.session_ttl),
            http_buckets: rate::TenantBuckets::new(config.rate_limit_per_sec, config.rate_limit_burst),
            config,
            grammars: crate::grammar::Grammars::new(tokenizer.clone(), info.vocab_size),
            engines,
            tool_prompting: crate::tools::ToolPrompting::detect(&tokenizer),
            tokenizer,
            fim,
            model,
            limits,
            metrics: Metrics::new(),
            draining: AtomicBool::new(false),
            stop_accepting: watch::Sender::new(false),
            stop: watch::Sender::new(false),
            in_flight: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            next_conn: AtomicU64::new(1),
        })
    }
}

/// Bytes of a connection's kernel send buffer (Linux doubles it): ample for
/// token streams (a 64 KiB window a round trip: 1.3 MB/s at 50 ms, where a
/// stream of 100 tokens a second is ~20 KB/s of events), small enough that
/// a client that stops reading is noticed after tens of KiB.
const SEND_BUFFER_BYTES: usize = 32 << 10;

async fn accept_loop(state: Arc<ServerState>, listener: TcpListener) {
    let mut stop = state.stop_accepting.subscribe();
    loop {
        let (stream, _) = tokio::select! {
            _ = until_true(&mut stop) => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(_) => {
                    // Out of file descriptors or similar: back off a little.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        // A bounded send buffer, where the kernel would grow it to several
        // MiB: a client that stops reading then blocks the server's writes
        // soon, so the stall timeout can see it, and stalled connections
        // cannot pile up kernel memory.
        let _ = socket2::SockRef::from(&stream).set_send_buffer_size(SEND_BUFFER_BYTES);
        // Every connection counts toward --max-connections, HTTP or
        // WebSocket; one over it gets a 503 for its request and is closed.
        let admitted = state.try_open_connection();
        if !admitted {
            state.metrics.error(protocol::ErrorCode::ServerBusy);
        }
        let state = state.clone();
        tokio::spawn(async move {
            let mut stop = state.stop_accepting.subscribe();
            let svc = {
                let state = state.clone();
                service_fn(move |req| {
                    let state = state.clone();
                    async move {
                        if admitted {
                            http::handle(state, req).await
                        } else {
                            Ok(openai::too_many_connections())
                        }
                    }
                })
            };
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(30))
                .serve_connection(TokioIo::new(stream), svc)
                .with_upgrades();
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = until_true(&mut stop) => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(5), conn.as_mut()).await;
                }
            }
            if admitted {
                state.connection_closed();
            }
        });
    }
}

/// Resolves once the watched flag is true (or its sender is gone).
async fn until_true(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

async fn reaper_loop(state: Arc<ServerState>) {
    let period = (state.config.session_ttl / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let n = state.sessions.reap();
        if n > 0 {
            state.metrics.sessions_expired.inc_by(n as u64);
            state.metrics.sessions.set(state.sessions.len() as i64);
        }
    }
}

impl ServerHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn state(&self) -> &Arc<ServerState> {
        &self.state
    }

    pub fn engines(&self) -> &EnginePool {
        &self.state.engines
    }

    /// Graceful shutdown: stop accepting connections, sessions and requests
    /// (new `generate`s get error `cancelled`); wait up to
    /// `config.drain_timeout` for in-flight requests (still streaming to
    /// their sockets); cancel what is left; then send `shutting_down` to
    /// every socket and close them. The engine is left running.
    pub async fn shutdown(self) {
        let st = &self.state;
        st.draining.store(true, Ordering::Release);
        st.stop_accepting.send_replace(true);
        let deadline = tokio::time::Instant::now() + st.config.drain_timeout;
        while st.in_flight() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if st.in_flight() > 0 {
            for s in st.sessions.all() {
                s.server_cancel_all();
            }
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while st.in_flight() > 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        st.stop.send_replace(true);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while st.connection_count() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        st.sessions.close_all();
        self.reaper.abort();
        let _ = self.accept.await;
    }
}
