//! The engine: ONE thread owns MLX and runs every forward pass.
//!
//! The async edge (WebSocket sessions) talks to it only through
//! [`EngineHandle`]: `submit` sends token ids and parameters in, and each
//! request gets its own bounded channel of [`EngineEvent`]s back. The types
//! they exchange are in `api`; the channel and thread in `handle`. The engine
//! never waits on a consumer: a request whose channel is full is paused (not
//! scheduled) until it drains. Tokenization and detokenization stay at the
//! edge, so this thread does nothing but numerics and scheduling.
mod api;
mod config;
mod handle;
mod lookahead;
mod pool;
mod prefix;
mod row;
mod runner;
pub mod speculate;
mod step;
mod step_masks;
mod warmup;
mod worker;

/// Constrained decoding's matcher traits, as the scheduler defines them.
pub use tether_sched::constraint;

/// Whether `TETHER_TRACE_STEPS=1` asks for traces on stderr: every engine
/// step (rows, tokens, time, primitives), the path a model's step took
/// where it has two, and, at the server's edge, where each request's time
/// to first token went before the engine. Read once.
pub use crate::models::tracing;

pub use api::{
    EngineError, EngineEvent, EngineModelInfo, EngineStats, Finish, FinishInfo, RequestId, StepTimes, StopHandle, StopReason, SubmitRequest, Submitted,
    TokenLogprob,
};
pub use config::{EngineConfig, KvLayout};
#[cfg(test)]
pub(crate) use handle::Command;
pub use handle::EngineHandle;
pub use pool::EnginePool;
pub use prefix::{DiskStats, DiskTierConfig, HostStats, PrefixStats, Scope};
