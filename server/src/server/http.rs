//! The HTTP side: routing, the WebSocket upgrade of `GET /v1/ws` (with the
//! Origin and bearer-token checks done BEFORE upgrading), `/healthz`,
//! `/metrics`, and with `--ui-dir` static files (the playground) elsewhere.
pub mod edge;
pub mod request_body;
mod static_files;
pub mod stream_body;
pub mod ws_frames;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use protocol::{ErrorCode, ServerMessage};
use subtle::ConstantTimeEq;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::WebSocketStream;

use super::openai::ApiError;
use super::{ws, ServerState};

/// A response body: whole (JSON, files) or streamed (server-sent events).
pub type Body = BoxBody<Bytes, Infallible>;

/// A body of `bytes`, sent whole.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed()
}

/// An empty body.
pub fn empty() -> Body {
    full(Bytes::new())
}

/// The subprotocol a browser client may offer to name the protocol.
pub const SUBPROTOCOL: &str = "tether.v1";
/// Prefix of the subprotocol entry that carries a bearer token (browsers
/// cannot set `Authorization` on a WebSocket).
pub const BEARER_SUBPROTOCOL_PREFIX: &str = "tether.bearer.";

/// Which protocol an upgraded socket speaks.
enum Socket {
    /// Tether's protocol v1 (`GET /v1/ws`).
    TetherV1,
    /// OpenAI's Responses API in WebSocket mode (`GET /v1/responses`), for
    /// the tenant of the bearer token it presented.
    Responses { tenant: String },
}

/// The HTTP edge a path belongs to: its unknown paths answer in its error shape.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Edge {
    LlamaCpp,
    Anthropic,
    /// Every other path under `/v1/` but the protocol's socket.
    OpenAi,
}

impl Edge {
    fn of(path: &str) -> Option<Edge> {
        match path {
            _ if super::llamacpp::serves(path) => Some(Edge::LlamaCpp),
            _ if super::anthropic::serves(path) => Some(Edge::Anthropic),
            "/v1/ws" => None,
            _ if path.starts_with("/v1/") => Some(Edge::OpenAi),
            _ => None,
        }
    }
}

fn is_upgrade(h: &HeaderMap) -> bool {
    has_token(h, header::CONNECTION, "upgrade") && has_token(h, header::UPGRADE, "websocket")
}

pub async fn handle(state: Arc<ServerState>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    if req.method() == Method::GET && req.uri().path() == "/v1/responses" && is_upgrade(req.headers()) {
        let offered = offered_protocols(req.headers());
        let tenant = super::openai::tenant(presented_tokens(&req, &offered).first().map(String::as_str));
        return Ok(upgrade(state, req, Socket::Responses { tenant }));
    }
    if let Some(edge) = Edge::of(req.uri().path()) {
        let tenant = super::openai::tenant(presented_tokens(&req, &[]).first().map(String::as_str));
        let public = edge == Edge::LlamaCpp && super::llamacpp::is_public(req.uri().path());
        if let Some(why) = auth_problem(&state, &req, &[]).filter(|_| !public) {
            state.metrics.error(ErrorCode::Unauthorized);
            return Ok(match edge {
                Edge::LlamaCpp => edge::unauthorized::<super::llamacpp::LlamaError>(why),
                Edge::Anthropic => edge::unauthorized::<super::anthropic::AnthropicError>(why),
                Edge::OpenAi => edge::unauthorized::<ApiError>(why),
            });
        }
        return Ok(match edge {
            Edge::LlamaCpp => super::llamacpp::handle(&state, req, &tenant).await,
            Edge::Anthropic => super::anthropic::handle(&state, req, &tenant).await,
            Edge::OpenAi => super::openai::handle(&state, req, &tenant).await,
        });
    }
    let path = req.uri().path();
    Ok(match (req.method(), path) {
        (&Method::GET, "/v1/ws") => upgrade(state, req, Socket::TetherV1),
        (&Method::GET, "/healthz") => healthz(&state).await,
        // Error counts and sessions are the operator's: with a token set, a
        // scraper presents it (Prometheus' `authorization`). /healthz stays
        // open for load balancers: it tells status and counts only.
        (&Method::GET, "/metrics") => match auth_problem(&state, &req, &[]) {
            Some(why) => {
                state.metrics.error(ErrorCode::Unauthorized);
                edge::unauthorized::<ApiError>(why)
            }
            None => metrics(&state).await,
        },
        (method, "/v1/ws" | "/healthz" | "/metrics") => edge::wrong_method::<ApiError>(method, path, "GET"),
        (method, _) => match &state.config.ui_dir {
            Some(dir) if method == Method::GET || method == Method::HEAD => static_files::serve(dir, path).await,
            // Answered in OpenAI's error shape, the one most clients here parse.
            _ => edge::unknown_path::<ApiError>(req.method(), path),
        },
    })
}

fn json(status: StatusCode, body: String) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An HTTP error response whose body is the protocol's `error` frame.
fn refuse(status: StatusCode, code: ErrorCode, message: &str) -> Response<Body> {
    json(status, ServerMessage::error(code, message, None).to_json())
}

fn header_str(h: &HeaderMap, name: header::HeaderName) -> impl Iterator<Item = &str> {
    h.get_all(name).into_iter().filter_map(|v| v.to_str().ok())
}

fn has_token(h: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    header_str(h, name).flat_map(|v| v.split(',')).any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Subprotocols the client offered, in order.
fn offered_protocols(h: &HeaderMap) -> Vec<String> {
    header_str(h, header::SEC_WEBSOCKET_PROTOCOL).flat_map(|v| v.split(',')).map(|p| p.trim().to_string()).filter(|p| !p.is_empty()).collect()
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = s.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// Bearer tokens the request presents: `Authorization: Bearer`,
/// `X-Api-Key` (llama.cpp's clients), `?token=`, and
/// `tether.bearer.<token>` subprotocol entries.
fn presented_tokens(req: &Request<Incoming>, offered: &[String]) -> Vec<String> {
    let mut tokens = Vec::new();
    for v in header_str(req.headers(), header::AUTHORIZATION) {
        if let Some((scheme, rest)) = v.trim().split_once(' ') {
            if scheme.eq_ignore_ascii_case("bearer") {
                tokens.push(rest.trim().to_string());
            }
        }
    }
    tokens.extend(header_str(req.headers(), header::HeaderName::from_static("x-api-key")).map(|v| v.trim().to_string()));
    if let Some(q) = req.uri().query() {
        for pair in q.split('&') {
            if let Some(v) = pair.strip_prefix("token=") {
                tokens.extend(percent_decode(v));
            }
        }
    }
    tokens.extend(offered.iter().filter_map(|p| p.strip_prefix(BEARER_SUBPROTOCOL_PREFIX)).map(str::to_string));
    tokens
}

fn token_matches(expected: &str, presented: &str) -> bool {
    bool::from(expected.as_bytes().ct_eq(presented.as_bytes()))
}

/// Why the request may not pass, when the server wants a bearer token and
/// none of those presented (`offered` subprotocols included) matches.
fn auth_problem(state: &ServerState, req: &Request<Incoming>, offered: &[String]) -> Option<&'static str> {
    let expected = state.config.auth_token.as_ref()?;
    let presented = presented_tokens(req, offered);
    // Check every presented token, so the timing does not say which matched.
    let ok = presented.iter().fold(false, |acc, t| token_matches(expected, t) | acc);
    match (ok, presented.is_empty()) {
        (true, _) => None,
        (false, true) => Some("a bearer token is required"),
        (false, false) => Some("the bearer token is wrong"),
    }
}

fn upgrade(state: Arc<ServerState>, mut req: Request<Incoming>, socket: Socket) -> Response<Body> {
    let h = req.headers();
    let Some(key) = h.get(header::SEC_WEBSOCKET_KEY).filter(|_| is_upgrade(h)) else {
        let mut r =
            json(StatusCode::UPGRADE_REQUIRED, serde_json::json!({"error": "this endpoint speaks WebSocket only (GET with Upgrade: websocket)"}).to_string());
        r.headers_mut().insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        return r;
    };
    if !matches!(h.get(header::SEC_WEBSOCKET_VERSION), Some(v) if v == "13") {
        let mut r = json(StatusCode::UPGRADE_REQUIRED, serde_json::json!({"error": "WebSocket version 13 is required"}).to_string());
        r.headers_mut().insert(header::SEC_WEBSOCKET_VERSION, HeaderValue::from_static("13"));
        return r;
    }
    let cfg = &state.config;
    if !cfg.allowed_origins.is_empty() {
        if let Some(origin) = h.get(header::ORIGIN) {
            let allowed = origin.to_str().is_ok_and(|o| cfg.allowed_origins.iter().any(|a| a.eq_ignore_ascii_case(o.trim_end_matches('/'))));
            if !allowed {
                state.metrics.error(ErrorCode::OriginNotAllowed);
                let shown = String::from_utf8_lossy(origin.as_bytes()).chars().take(100).collect::<String>();
                return refuse(StatusCode::FORBIDDEN, ErrorCode::OriginNotAllowed, &format!("origin {shown:?} is not allowed"));
            }
        }
    }
    let offered = offered_protocols(h);
    if let Some(why) = auth_problem(&state, &req, &offered) {
        state.metrics.error(ErrorCode::Unauthorized);
        let mut r = refuse(
            StatusCode::UNAUTHORIZED,
            ErrorCode::Unauthorized,
            &format!("{why}: send `Authorization: Bearer <token>`, `?token=<token>` or the subprotocol `tether.bearer.<token>`"),
        );
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return r;
    }
    state.connection_upgraded();
    let chosen = offered
        .iter()
        .find(|p| p.as_str() == SUBPROTOCOL)
        .or_else(|| offered.iter().find(|p| p.starts_with(BEARER_SUBPROTOCOL_PREFIX)))
        .and_then(|p| HeaderValue::from_str(p).ok());
    let accept = derive_accept_key(key.as_bytes());
    let version = req.version();
    let ws_config = WebSocketConfig::default().max_message_size(Some(ws_size_cap(cfg.max_frame_bytes))).max_frame_size(Some(ws_size_cap(cfg.max_frame_bytes)));
    tokio::spawn(async move {
        match hyper::upgrade::on(&mut req).await {
            Ok(upgraded) => {
                let ws = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, Some(ws_config)).await;
                match socket {
                    Socket::TetherV1 => ws::run(state, ws).await,
                    Socket::Responses { tenant } => super::openai::run_responses_socket(state, ws, tenant).await,
                }
            }
            Err(_) => state.connection_closed(),
        }
    });
    let mut r = Response::new(empty());
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    *r.version_mut() = version;
    let rh = r.headers_mut();
    rh.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    rh.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    rh.insert(header::SEC_WEBSOCKET_ACCEPT, HeaderValue::from_str(&accept).expect("base64 is a valid header"));
    if let Some(p) = chosen {
        rh.insert(header::SEC_WEBSOCKET_PROTOCOL, p);
    }
    r
}

/// tungstenite's own message cap: above the protocol limit, so frames a bit
/// too large are read whole and answered with `frame_too_large`; far larger
/// ones are refused from their header without being buffered.
pub fn ws_size_cap(max_frame_bytes: usize) -> usize {
    max_frame_bytes.saturating_add((max_frame_bytes / 4).max(64 << 10))
}

async fn engine_stats(state: &ServerState, wait: Duration) -> Option<crate::engine::EngineStats> {
    tokio::time::timeout(wait, state.engines.stats()).await.ok().flatten()
}

/// How long `/healthz` waits for the engine's numbers: the engine answers
/// between steps, and a busy engine is healthy, so a proxy's health check
/// must not wait for a long step (it would take the replica out under load).
const HEALTH_STATS_WAIT: Duration = Duration::from_millis(200);

async fn healthz(state: &ServerState) -> Response<Body> {
    let stats = engine_stats(state, HEALTH_STATS_WAIT).await;
    let status = if state.is_draining() {
        "draining"
    } else if !state.engines.is_alive() {
        "engine_unavailable"
    } else {
        "ok"
    };
    let engine = stats.map(|s| {
        serde_json::json!({
            "running": s.running,
            "waiting": s.waiting,
            "steps": s.steps,
            "generated_tokens": s.generated_tokens,
            "prompt_tokens": s.prompt_tokens,
            "kv_bytes": s.kv_bytes,
            "active_memory": s.active_memory,
            "peak_memory": s.peak_memory,
            "cache_memory": s.cache_memory,
        })
    });
    let body = serde_json::json!({
        "status": status,
        "model": state.model.name,
        "architecture": state.model.architecture,
        "context_length": state.model.context_length,
        "sessions": state.sessions.len(),
        "connections": state.connection_count(),
        "requests_in_flight": state.in_flight(),
        "engine": engine,
    });
    let code = if status == "ok" { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    json(code, body.to_string())
}

async fn metrics(state: &ServerState) -> Response<Body> {
    let stats = engine_stats(state, Duration::from_secs(2)).await;
    state.metrics.sessions.set(state.sessions.len() as i64);
    let body = state.metrics.render(stats.as_ref());
    let mut r = Response::new(full(body));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"));
    r
}
