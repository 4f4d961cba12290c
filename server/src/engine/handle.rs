//! [`EngineHandle`]: how the async edge reaches the engine thread.
//!
//! Commands travel over one bounded channel. A submit that finds it full is
//! refused at once as [`EngineError::Overloaded`] (a flood never grows the
//! queue past its bound); the few control commands (a session attached,
//! detached or ended; stats; shutdown) wait for room instead, which is at
//! most one engine step: the engine drains the channel before every step
//! and never waits on the edge itself. Ending a request early needs no
//! command at all (see [`StopHandle`]).
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::api::{EngineError, EngineEvent, EngineModelInfo, EngineStats, RequestId, StopHandle, SubmitRequest, Submitted};
use super::config::EngineConfig;
use super::prefix::Scope;
use super::worker;

pub(crate) enum Command {
    Submit(Box<Submission>),
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

/// A submitted request on its way to the engine's queue.
pub(crate) struct Submission {
    pub id: RequestId,
    pub request: SubmitRequest,
    pub events: tokio::sync::mpsc::Sender<EngineEvent>,
    pub stop: StopHandle,
    pub queued_at: Instant,
}

/// Cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: SyncSender<Command>,
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
        // Room for a full queue's worth of submits in flight to the engine,
        // plus control commands.
        let (tx, rx) = mpsc::sync_channel(config.max_waiting.max(1) + 64);
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

    /// Queues a request. Refusals that need no engine state come back here;
    /// those that do (the queue's length, the KV budget) arrive as the
    /// request's only event, [`EngineEvent::Failed`].
    pub fn submit(&self, request: SubmitRequest) -> Result<Submitted, EngineError> {
        let context = self.info.context_length;
        if request.prompt.len() + request.max_tokens > context {
            return Err(EngineError::ContextOverflow { prompt: request.prompt.len(), max_tokens: request.max_tokens, context });
        }
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (events, rx) = tokio::sync::mpsc::channel(self.config.event_buffer);
        let stop = StopHandle::default();
        let submission = Submission { id, request, events, stop: stop.clone(), queued_at: Instant::now() };
        match self.tx.try_send(Command::Submit(Box::new(submission))) {
            Ok(()) => Ok(Submitted { id, events: rx, stop }),
            Err(TrySendError::Full(_)) => Err(EngineError::Overloaded { waiting: self.config.max_waiting }),
            Err(TrySendError::Disconnected(_)) => Err(EngineError::ShuttingDown),
        }
    }

    /// Sends a control command, waiting for room (at most one engine step).
    fn control(&self, command: Command) {
        let _ = self.tx.send(command);
    }

    /// Frees the prefix-cache entries of `scope` (call when a session ends).
    pub fn drop_scope(&self, scope: Scope) {
        self.control(Command::DropScope { scope });
    }

    /// Tells the prefix cache whether `scope`'s session has a socket attached
    /// (`live`) or is detached, awaiting a resume: entries of detached
    /// sessions are evicted before those of live ones. Scopes start live.
    pub fn set_scope_live(&self, scope: Scope, live: bool) {
        self.control(Command::SetScopeLive { scope, live });
    }

    /// Whether the engine thread is still running (it ends on shutdown, or
    /// on a failure it could not recover from). Answers at once, unlike
    /// [`stats`](Self::stats), which waits for the engine's next pause.
    pub fn is_alive(&self) -> bool {
        self.thread.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|t| !t.is_finished())
    }

    pub async fn stats(&self) -> Option<EngineStats> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.control(Command::Stats { reply });
        rx.await.ok()
    }

    /// Asks the engine to finish running requests and exit.
    pub fn shutdown(&self) {
        self.control(Command::Shutdown);
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

#[cfg(test)]
impl EngineHandle {
    /// A handle with no engine thread behind it, for unit tests of the edge:
    /// the test reads the commands the edge sends from the receiver, and
    /// plays the engine by sending events through each submission's `events`.
    pub(crate) fn for_tests(info: EngineModelInfo, config: EngineConfig) -> (EngineHandle, mpsc::Receiver<Command>) {
        let (tx, rx) = mpsc::sync_channel(config.max_waiting.max(1) + 64);
        let handle =
            EngineHandle { tx, next_id: Arc::new(AtomicU64::new(1)), info: Arc::new(info), config: Arc::new(config), thread: Arc::new(Mutex::new(None)) };
        (handle, rx)
    }
}
