//! Tether's scheduler, as a crate of its own so that the compiler keeps it
//! pure: no MLX, no tokio, no clocks but the ones it is handed. An engine
//! step is three calls:
//!
//! 1. [`Scheduler::plan`] turns views of the running rows into a
//!    [`StepPlan`]: which rows decode (with how many drafts) and which read
//!    how much of their prompt, under one token budget;
//! 2. the engine's runner (the only part that touches MLX) fills in the
//!    drafts ([`Work`]), runs the forward and draws, and hands back a plain
//!    [`StepOutput`];
//! 3. [`apply`] moves each row's [`RequestProgress`] and decides acceptance,
//!    stops, token limits and deadlines, as [`RowUpdate`]s the engine
//!    carries out (KV rollback, events, finishing rows).
//!
//! Admission ([`Scheduler::admit`]) and the cost models that steer the
//! prefill allowance and draft depth live here too. What it deliberately
//! does not do: own channels, caches or arrays. The engine keeps those beside
//! each row's progress and reports what they say (whether a consumer has
//! room, which drafts are ready).
mod apply;
pub mod constraint;
mod draft_cost;
mod drafting;
mod progress;
mod request;
mod scheduler;
mod step_cost;

pub use apply::{apply, logprobs_of, Applied, End, RowUpdate, Sampled, StepCounts, StepOutput, Verified};
pub use drafting::{accept_matching, Drafting, SpecStats, START_DEPTH};
pub use progress::{Limits, RequestProgress, Work};
pub use request::{EngineError, EngineEvent, Finish, FinishInfo, RequestId, StopHandle, StopReason, TokenId, TokenLogprob};
pub use scheduler::{DraftView, RowView, RowWork, Scheduler, SchedulerConfig, StepPlan, StepTiming, WaitingView, SHORT_PROMPT_TOKENS};
