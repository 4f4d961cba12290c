//! What identifies a request and what comes back from it: ids, why it
//! ended, the events its consumer receives and the errors it can fail with.
//! Plain data shared by the engine and its edges; no MLX, no channels.
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use crate::drafting::SpecStats;

/// A token id of the model's vocabulary.
pub type TokenId = u32;

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
    /// An end-of-generation token, the end of its grammar, or the edge's
    /// stop string ([`StopReason::StopString`]).
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Abandoned by the client or the server ([`StopReason::Cancel`]), or
    /// its consumer went away: its KV state is freed, not cached.
    Cancelled,
    /// `deadline` passed.
    TimeLimit,
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

impl StopReason {
    /// How a request the edge stopped for this reason finishes.
    pub fn finish(self) -> Finish {
        match self {
            StopReason::StopString => Finish::Stop,
            StopReason::Cancel => Finish::Cancelled,
        }
    }

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

const NOT_STOPPED: u8 = 0;

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

#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token_id: TokenId,
    pub logprob: f32,
    /// The most likely alternatives, best first.
    pub top: Vec<(TokenId, f32)>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// The request left the queue and its prefill began.
    Started { queue_ms: f64 },
    /// Newly generated tokens (usually one per step), in order.
    Tokens { ids: Vec<TokenId>, logprobs: Vec<TokenLogprob> },
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
    pub speculative: Option<SpecStats>,
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
