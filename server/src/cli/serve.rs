//! `tether serve`: the WebSocket server (and its HTTP edges) in front of one
//! or more engine workers.
//!
//! The tokenizer is loaded once, here, and shared by every session; each
//! worker loads only the weights, since the engine speaks token ids.
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tether::engine::{EngineConfig, EnginePool};
use tether::server::ServerConfig;

use super::engine_args::EngineArgs;
use super::model::ModelArgs;

#[derive(Args)]
pub(super) struct ServeArgs {
    /// Engine workers, each with its own copy of the model (one per device,
    /// or replicas on one device); a session is pinned to one by its id.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// Default draft source for requests that do not choose one: `echo`
    /// (prompt lookup), `draft_model` (needs --draft-model), `off`, or
    /// `auto`: echo on the CPU, off on a GPU, where requests opt in: in
    /// bfloat16 a verification forward rounds differently from one-token
    /// decoding, so outputs can differ from speculation off, and prompt
    /// lookup gains little outside edits (see the README's Performance).
    #[arg(long, default_value = "auto")]
    speculation: String,
    /// A small model sharing --model's tokenizer that drafts for it, for
    /// requests with `speculation.source: "draft_model"` (e.g.
    /// qwen2.5-coder-0.5b for qwen2.5-coder-1.5b).
    #[arg(long)]
    draft_model: Option<String>,
    /// Default most draft tokens per verification (a request may ask for 1..=32).
    #[arg(long, default_value_t = tether::engine::speculate::DEFAULT_MAX_DRAFT)]
    max_draft: usize,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind; 0 picks a free one. The bound address is printed as
    /// `listening on http://HOST:PORT`.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Bearer token clients must present (header, `?token=` or the
    /// `tether.bearer.<token>` subprotocol). Default: $TETHER_AUTH_TOKEN; none = no auth.
    #[arg(long)]
    auth_token: Option<String>,
    /// An allowed `Origin` (repeatable); none allows every origin.
    #[arg(long = "allow-origin")]
    allow_origin: Vec<String>,
    /// Largest client frame in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_frame_bytes: usize,
    /// Most prompt tokens (default: the context length minus one).
    #[arg(long)]
    max_prompt_tokens: Option<usize>,
    /// Largest `max_tokens` a request may ask for.
    #[arg(long, default_value_t = 4096)]
    max_tokens: usize,
    /// Most tokens for an OpenAI or llama.cpp request that gives no length
    /// cap (theirs would run until the context is full).
    #[arg(long, default_value_t = 2048)]
    default_max_tokens: usize,
    /// Concurrent requests per session.
    #[arg(long, default_value_t = 8)]
    max_in_flight: usize,
    /// Sessions per server.
    #[arg(long, default_value_t = 256)]
    max_sessions: usize,
    /// Open connections per server.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Seconds a session outlives its socket.
    #[arg(long, default_value_t = 60.0)]
    session_ttl_secs: f64,
    /// Seconds a socket may stay silent with nothing in flight.
    #[arg(long, default_value_t = 300.0)]
    idle_timeout_secs: f64,
    /// Frames kept per session for replay on resume.
    #[arg(long, default_value_t = 1024)]
    replay_frames: usize,
    /// Connection-level frames queued per socket.
    #[arg(long, default_value_t = 256)]
    outgoing_queue: usize,
    /// Seconds a client may stop reading before its socket is closed.
    #[arg(long, default_value_t = 30.0)]
    stall_timeout_secs: f64,
    /// Client frames per second per WebSocket, and HTTP requests per second
    /// per bearer token (burst: twice that).
    #[arg(long, default_value_t = 100.0)]
    rate_limit: f64,
    /// Seconds graceful shutdown waits for in-flight requests.
    #[arg(long, default_value_t = 30.0)]
    drain_timeout_secs: f64,
    /// Seconds a Responses API WebSocket may stay open, as OpenAI's 60
    /// minutes; then it closes with `websocket_connection_limit_reached`
    /// (its conversations wait --session-ttl-secs for a new socket).
    #[arg(long, default_value_t = 3600.0)]
    responses_socket_secs: f64,
    /// Serve the static files of this folder on other GET paths, e.g. the
    /// browser playground built into `client-ts/dist/playground`.
    #[arg(long)]
    ui_dir: Option<std::path::PathBuf>,
}

pub(super) fn run(args: ServeArgs) -> anyhow::Result<()> {
    let tokenizer = args.model.load_tokenizer()?;
    let config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        model_name: Some(args.model.model.clone()),
        speculation: speculation_arg(&args.speculation, args.max_draft, args.draft_model.is_some(), args.model.device()?)?,
        has_draft_model: args.draft_model.is_some(),
        max_frame_bytes: args.max_frame_bytes,
        max_prompt_tokens: args.max_prompt_tokens,
        max_tokens: args.max_tokens,
        default_max_tokens: args.default_max_tokens,
        max_in_flight: args.max_in_flight,
        max_sessions: args.max_sessions,
        max_connections: args.max_connections,
        session_ttl: secs("session-ttl-secs", args.session_ttl_secs)?,
        idle_timeout: secs("idle-timeout-secs", args.idle_timeout_secs)?,
        replay_frames: args.replay_frames,
        outgoing_queue: args.outgoing_queue,
        stall_timeout: secs("stall-timeout-secs", args.stall_timeout_secs)?,
        rate_limit_per_sec: args.rate_limit,
        rate_limit_burst: (args.rate_limit * 2.0).max(1.0),
        auth_token: args.auth_token.clone().or_else(|| std::env::var("TETHER_AUTH_TOKEN").ok().filter(|t| !t.is_empty())),
        allowed_origins: args.allow_origin.clone(),
        drain_timeout: secs("drain-timeout-secs", args.drain_timeout_secs)?,
        responses_socket_lifetime: secs("responses-socket-secs", args.responses_socket_secs)?,
        ui_dir: match &args.ui_dir {
            Some(d) => Some(d.canonicalize().ok().filter(|p| p.is_dir()).ok_or_else(|| anyhow::anyhow!("--ui-dir {}: not a folder", d.display()))?),
            None => None,
        },
        ..ServerConfig::default()
    };
    config.validate().map_err(anyhow::Error::msg)?;
    anyhow::ensure!(args.workers >= 1, "--workers must be at least 1");
    let engine_config = EngineConfig { draft_model: args.model.draft_model_spec(args.draft_model.as_deref())?, ..args.engine.config()? };
    let workers = (0..args.workers).map(|_| args.model.start_worker(engine_config.clone(), &tokenizer)).collect::<anyhow::Result<Vec<_>>>()?;
    let engine = EnginePool::new(workers);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(async {
        let server = tether::server::serve(config, engine.clone(), Arc::new(tokenizer)).await?;
        println!("listening on http://{}", server.addr());
        std::io::stdout().flush()?;
        shutdown_signal().await;
        eprintln!("[serve] shutting down: draining in-flight requests");
        server.shutdown().await;
        anyhow::Ok(())
    });
    // The engine finishes what is left, drops the model and exits.
    engine.shutdown_and_join();
    result
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn speculation_arg(source: &str, max_draft: usize, has_draft_model: bool, device: mlx::Device) -> anyhow::Result<tether::engine::speculate::Speculation> {
    use tether::engine::speculate::{DraftKind, Speculation};
    let kind = match source {
        "auto" if device == mlx::Device::Cpu => DraftKind::Echo,
        "auto" => DraftKind::Off,
        "echo" => DraftKind::Echo,
        "off" => DraftKind::Off,
        "draft_model" if has_draft_model => DraftKind::Model,
        "draft_model" => anyhow::bail!("--speculation draft_model needs --draft-model"),
        other => anyhow::bail!("--speculation must be `auto`, `echo`, `draft_model` or `off`, got {other:?}"),
    };
    anyhow::ensure!((1..=protocol::MAX_DRAFT_TOKENS as usize).contains(&max_draft), "--max-draft must be in [1, {}]", protocol::MAX_DRAFT_TOKENS);
    Ok(Speculation { kind, max_draft, ..Default::default() })
}

fn secs(name: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v).map_err(|_| anyhow::anyhow!("--{name} must be a non-negative number of seconds, got {v}"))
}
