//! The engine: ONE thread owns MLX and runs every forward pass.
//!
//! The async edge (WebSocket sessions) talks to it only through
//! [`EngineHandle`]: `submit` sends token ids and parameters in, and each
//! request gets its own bounded channel of [`EngineEvent`]s back. The engine
//! never waits on a consumer: a request whose channel is full is paused (not
//! scheduled) until it drains. Tokenization and detokenization stay at the
//! edge, so this thread does nothing but numerics and scheduling.
mod config;
mod draft_cost;
mod pool;
mod prefix;
mod row;
pub mod speculate;
mod step_cost;
mod warmup;
mod worker;

/// Whether `TETHER_TRACE_STEPS=1` asks for traces on stderr: every engine
/// step (rows, tokens, time) and, at the server's edge, where each
/// request's time to first token went before the engine. Read once.
pub fn tracing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TETHER_TRACE_STEPS").is_ok_and(|v| v == "1"))
}

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::sample::SamplingParams;

pub use config::{EngineConfig, KvLayout};
pub use pool::EnginePool;
pub use prefix::{PrefixStats, Scope};

/// An engine-assigned request id (unique per engine).
pub type RequestId = u64;

/// Why a request stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token (or the edge's stop string: it cancels with `Stop`).
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled by the client or the session.
    Cancelled,
    /// `deadline` passed.
    TimeLimit,
}

/// One generation request, in token ids.
#[derive(Clone, Debug)]
pub struct SubmitRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end generation; they are not emitted.
    pub stop_ids: Vec<u32>,
    /// Return the sampled token's log-probability, with this many top alternatives.
    pub logprobs: Option<u8>,
    /// Prompt tokens per forward for this request (clamped to the engine's limits).
    pub prefill_chunk: Option<usize>,
    /// Finish with `TimeLimit` once this instant passes.
    pub deadline: Option<Instant>,
    /// Whose prefix-cache entries this request may reuse and leaves behind
    /// (a session's id); `None` neither reads nor writes the cache.
    pub cache_scope: Option<Scope>,
    /// The session that sent it: sessions take turns for free rows (see
    /// the engine's admission). `None` counts as a session of its own.
    pub session: Option<String>,
    /// Draft tokens verified alongside this request's decode steps.
    pub speculation: speculate::Speculation,
}

impl SubmitRequest {
    /// Greedy, no stop ids, no cache, no speculation: fill in the rest.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> SubmitRequest {
        SubmitRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_ids: Vec::new(),
            logprobs: None,
            prefill_chunk: None,
            deadline: None,
            cache_scope: None,
            session: None,
            speculation: speculate::Speculation::default(),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
    /// The most likely alternatives, best first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// The request left the queue and its prefill began.
    Started { queue_ms: f64 },
    /// Newly generated tokens (usually one per step), in order.
    Tokens { ids: Vec<u32>, logprobs: Vec<TokenLogprob> },
    /// The last event of a request that ran.
    Finished(FinishInfo),
    /// The last event of a request that failed.
    Failed { message: String },
}

#[derive(Clone, Debug, PartialEq)]
pub struct FinishInfo {
    pub reason: Finish,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Speculation counters, when the request speculated.
    pub speculative: Option<speculate::SpecStats>,
}

/// A snapshot of the engine's state, for /metrics and tests.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub steps: u64,
    pub generated_tokens: u64,
    pub prompt_tokens: u64,
    /// Bytes of KV cache held by live requests.
    pub kv_bytes: usize,
    /// MLX allocator: bytes held by live arrays, the peak, and its free-buffer cache.
    pub active_memory: usize,
    pub peak_memory: usize,
    pub cache_memory: usize,
    pub prefix: PrefixStats,
    /// Draft tokens verified and accepted, over all requests.
    pub drafted_tokens: u64,
    pub accepted_draft_tokens: u64,
    /// Decode row-forwards of speculating rows, and the tokens they produced.
    pub spec_decode_forwards: u64,
    pub spec_decode_tokens: u64,
    /// Where the engine thread's step time went, summed over all steps.
    pub step_time: StepTimes,
}

/// Engine-thread time per phase of a step, in microseconds, summed over
/// steps: `build` schedules the step and records its lazy graph (host
/// work), `eval` runs it on the device and reads the sampled tokens back,
/// `publish` accepts drafts and emits tokens. A step whose `build` rivals
/// its `eval` is bound by the host, not the device.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTimes {
    pub build_us: u64,
    pub eval_us: u64,
    pub publish_us: u64,
}

impl StepTimes {
    pub fn add(&mut self, other: &StepTimes) {
        self.build_us += other.build_us;
        self.eval_us += other.eval_us;
        self.publish_us += other.publish_us;
    }
}

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum EngineError {
    #[error("the engine's queue is full ({0} requests waiting)")]
    Overloaded(usize),
    #[error("the engine is shutting down")]
    ShuttingDown,
    #[error("the request can never fit: {0}")]
    TooLarge(String),
}

/// Model facts the edge needs without touching MLX.
#[derive(Clone, Debug)]
pub struct EngineModelInfo {
    pub name: String,
    pub architecture: String,
    pub context_length: usize,
    pub vocab_size: usize,
    pub kv_bytes_per_token: usize,
    pub weight_bytes: usize,
    /// The draft model's path, when the engine has one.
    pub draft_model: Option<String>,
}

pub(crate) enum Command {
    Submit {
        id: RequestId,
        request: SubmitRequest,
        events: tokio::sync::mpsc::Sender<EngineEvent>,
        queued_at: Instant,
    },
    Cancel {
        id: RequestId,
    },
    Stats {
        reply: tokio::sync::oneshot::Sender<EngineStats>,
    },
    /// Drop a scope's prefix-cache entries (its session ended).
    DropScope {
        scope: Scope,
    },
    /// A scope's session attached (`live`) or detached: idle scopes' prefix
    /// entries are evicted first.
    SetScopeLive {
        scope: Scope,
        live: bool,
    },
    /// Stop admitting; finish running requests; then exit.
    Shutdown,
}

/// Cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    info: Arc<EngineModelInfo>,
    config: Arc<EngineConfig>,
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

/// Engines still running, joined when the process exits (see `start`).
static LIVE_ENGINES: Mutex<Vec<EngineHandle>> = Mutex::new(Vec::new());

fn join_live_engines() {
    let engines = std::mem::take(&mut *LIVE_ENGINES.lock().unwrap_or_else(|e| e.into_inner()));
    for e in engines {
        e.shutdown_and_join();
    }
}

impl EngineHandle {
    /// Starts the engine thread; `load` runs ON that thread (MLX arrays are
    /// bound to it) and returns the model. Returns once the model is loaded.
    pub fn start<F>(config: EngineConfig, load: F) -> anyhow::Result<EngineHandle>
    where
        F: FnOnce() -> anyhow::Result<crate::loaded::LoadedModel> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let (info_tx, info_rx) = mpsc::channel();
        let cfg = config.clone();
        let thread = std::thread::Builder::new().name("tether-engine".into()).spawn(move || worker::run(cfg, load, rx, info_tx))?;
        let info = info_rx.recv().map_err(|_| anyhow::anyhow!("engine thread exited while loading the model"))??;
        let handle = EngineHandle {
            tx,
            next_id: Arc::new(AtomicU64::new(1)),
            info: Arc::new(info),
            config: Arc::new(config),
            thread: Arc::new(Mutex::new(Some(thread))),
        };
        // The engine thread must be gone before MLX's globals are torn down
        // at process exit, wherever the process exits from.
        let mut live = LIVE_ENGINES.lock().unwrap_or_else(|e| e.into_inner());
        if live.is_empty() {
            mlx::call_at_exit(join_live_engines);
        }
        live.push(handle.clone());
        Ok(handle)
    }

    pub fn info(&self) -> &EngineModelInfo {
        &self.info
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Queues a request. Events arrive on the returned channel, ending with
    /// `Finished` or `Failed`. Dropping the receiver cancels the request.
    pub fn submit(&self, request: SubmitRequest) -> Result<(RequestId, tokio::sync::mpsc::Receiver<EngineEvent>), EngineError> {
        let needed = request.prompt.len() + request.max_tokens;
        if needed > self.info.context_length {
            return Err(EngineError::TooLarge(format!(
                "prompt ({}) + max_tokens ({}) exceeds the context of {} tokens",
                request.prompt.len(),
                request.max_tokens,
                self.info.context_length
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = tokio::sync::mpsc::channel(self.config.event_buffer);
        self.tx.send(Command::Submit { id, request, events, queued_at: Instant::now() }).map_err(|_| EngineError::ShuttingDown)?;
        Ok((id, rx))
    }

    /// Stops a request within one engine step and frees its KV state. Its
    /// channel then gets `Finished` with `Cancelled` (unless already done).
    pub fn cancel(&self, id: RequestId) {
        let _ = self.tx.send(Command::Cancel { id });
    }

    /// Frees the prefix-cache entries of `scope` (call when a session ends).
    pub fn drop_scope(&self, scope: Scope) {
        let _ = self.tx.send(Command::DropScope { scope });
    }

    /// Tells the prefix cache whether `scope`'s session has a socket attached
    /// (`live`) or is detached, awaiting a resume: entries of detached
    /// sessions are evicted before those of live ones. Scopes start live.
    pub fn set_scope_live(&self, scope: Scope, live: bool) {
        let _ = self.tx.send(Command::SetScopeLive { scope, live });
    }

    pub async fn stats(&self) -> Option<EngineStats> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.tx.send(Command::Stats { reply }).ok()?;
        rx.await.ok()
    }

    /// Asks the engine to finish running requests and exit.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }

    /// [`shutdown`](Self::shutdown), then waits for the engine thread to
    /// finish its requests, drop the model and exit.
    pub fn shutdown_and_join(&self) {
        self.shutdown();
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}
