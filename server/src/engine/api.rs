//! What the engine's users exchange with it: requests in token ids, the
//! events that come back, why a request ended or failed, and statistics.
//! Plain data: no MLX, no threads.
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::constraint::Constraint;
use super::prefix::{PrefixStats, Scope};
use super::speculate;
use crate::sample::SamplingParams;

/// An engine-assigned request id (unique per engine). Distinct from the
/// client's own `request_id` string and from a session's registration key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "r{}", self.0)
    }
}

/// Why a request stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token, or the edge's stop string
    /// ([`StopReason::StopString`]).
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Abandoned by the client or the server ([`StopReason::Cancel`]), or
    /// its consumer went away: its KV state is freed, not cached.
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
    /// Which tokens it may generate (a grammar); `None`: any.
    pub constraint: Option<Constraint>,
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
            constraint: None,
        }
    }
}

/// Why the edge ends a request before the engine does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The generated text reached one of the request's stop strings: the
    /// turn ended normally, so its KV state up to the last emitted token
    /// is kept for the session's next turn, exactly as after an
    /// end-of-generation token. Finishes with [`Finish::Stop`].
    StopString,
    /// The client or the server abandoned the request: its state is freed.
    /// Finishes with [`Finish::Cancelled`].
    Cancel,
}

const NOT_STOPPED: u8 = 0;

impl StopReason {
    fn code(self) -> u8 {
        match self {
            StopReason::StopString => 1,
            StopReason::Cancel => 2,
        }
    }

    fn from_code(code: u8) -> Option<StopReason> {
        match code {
            1 => Some(StopReason::StopString),
            2 => Some(StopReason::Cancel),
            _ => None,
        }
    }
}

/// Ends one request early, from any thread, without a message to the
/// engine: the engine reads it before every step. The first reason given
/// wins (a stop string matched, then the client cancels: the turn still
/// ended on its stop string).
#[derive(Clone, Debug, Default)]
pub struct StopHandle(Arc<AtomicU8>);

impl StopHandle {
    pub fn stop(&self, reason: StopReason) {
        let _ = self.0.compare_exchange(NOT_STOPPED, reason.code(), Ordering::AcqRel, Ordering::Acquire);
    }

    /// The reason given, if any.
    pub fn requested(&self) -> Option<StopReason> {
        StopReason::from_code(self.0.load(Ordering::Acquire))
    }
}

/// A request the engine accepted: its id, its events (ending with
/// `Finished` or `Failed`; dropping the receiver cancels the request) and
/// the handle that ends it early.
pub struct Submitted {
    pub id: RequestId,
    pub events: tokio::sync::mpsc::Receiver<EngineEvent>,
    pub stop: StopHandle,
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
    /// The last event of a request that failed or was refused.
    Failed(EngineError),
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

/// Why the engine refused or failed a request. The edges map each variant
/// to their own error codes; nothing matches on message text.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum EngineError {
    /// Too many requests are queued (or being handed over) already.
    #[error("the engine's queue is full ({waiting} requests waiting)")]
    Overloaded { waiting: usize },
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// Prompt and `max_tokens` together exceed the model's context.
    #[error("prompt ({prompt} tokens) + max_tokens ({max_tokens}) exceeds the context of {context} tokens")]
    ContextOverflow { prompt: usize, max_tokens: usize, context: usize },
    /// The request alone needs more KV cache than all rows may reserve.
    #[error("the request needs {needed} bytes of KV cache, more than the engine's budget of {budget} bytes")]
    OverKvBudget { needed: usize, budget: usize },
    /// The request's constraint failed while it generated (its matcher
    /// reported an error, or allowed no token at all).
    #[error("the request's output constraint failed: {0}")]
    Constraint(String),
    /// A forward pass or a request's setup failed inside the engine
    /// (a bug or the device: not the request's fault).
    #[error("{0}")]
    Internal(String),
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
