//! What the engine's users exchange with it: requests in token ids, the
//! events that come back (defined with the scheduler, in `tether_sched`),
//! and statistics. Plain data: no MLX, no threads.
use std::time::Instant;

pub use tether_sched::{EngineError, EngineEvent, Finish, FinishInfo, RequestId, StopHandle, StopReason, TokenLogprob};

use tether_sched::constraint::Constraint;

use super::prefix::{PrefixStats, Scope};
use super::speculate;
use crate::sample::SamplingParams;

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

/// A request the engine accepted: its id, its events (ending with
/// `Finished` or `Failed`; dropping the receiver cancels the request) and
/// the handle that ends it early.
pub struct Submitted {
    pub id: RequestId,
    pub events: tokio::sync::mpsc::Receiver<EngineEvent>,
    pub stop: StopHandle,
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
    /// Lookahead steps (see the engine's `lookahead.rs`) used as the next
    /// step, and those dropped because the next step's work differed.
    pub lookahead_served: u64,
    pub lookahead_dropped: u64,
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
