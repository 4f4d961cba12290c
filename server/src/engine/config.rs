//! The engine's knobs: batch and budget sizes, caches, speculation, KV layout.
use super::speculate;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Rows decoding or prefilling at once.
    pub max_running: usize,
    /// Requests waiting for a row; more are refused as overloaded.
    pub max_waiting: usize,
    /// Tokens (decode + prefill) per engine step.
    pub step_token_budget: usize,
    /// Default prompt tokens per prefill chunk, and the range a request may
    /// ask for. While streams decode, a long prompt's chunks are smaller
    /// still (see the engine); the default matters for prompts read while
    /// nothing decodes, such as a chat's next turn: one step for a turn of
    /// up to the whole step budget, where each step costs a GPU a fixed
    /// ~7-11 ms (bench/results/archive/gpu-h200-agent-warm-shapes.jsonl).
    pub prefill_chunk: usize,
    pub min_prefill_chunk: usize,
    pub max_prefill_chunk: usize,
    /// Capacity of each request's event channel.
    pub event_buffer: usize,
    /// KV cache bytes all running rows may reserve together.
    pub kv_budget_bytes: usize,
    /// Run the prefix cache's maintenance and return MLX's cached buffers
    /// to the system every this many steps.
    pub reclaim_every_steps: u64,
    /// KV bytes the prefix cache may hold.
    pub prefix_cache_bytes: usize,
    /// Bytes of prefix-cache entries evicted from RAM kept in memory, in
    /// their compact file form (without the shared prefix), before they go
    /// to disk; 0: none.
    pub kv_host_bytes: usize,
    /// Where prefix-cache entries evicted from RAM are written (idle
    /// sessions' first), to be read back on their next turn; `None`: they
    /// are dropped.
    pub kv_disk: Option<super::DiskTierConfig>,
    /// Tokens per prefix-cache block (the granularity of matches).
    pub prefix_block_tokens: usize,
    /// Draft tokens (all rows together) one step may verify, within the
    /// step's token budget: drafts are speculative work and must not crowd
    /// out prefill of waiting requests.
    pub step_draft_budget: usize,
    /// A small model sharing the tokenizer, for requests that draft with one.
    pub draft_model: Option<speculate::DraftModelSpec>,
    /// Where running rows keep their KV caches.
    pub kv_layout: KvLayout,
    /// When rows' KV caches turn to codes (`None`: never; the CPU only).
    pub kv_quantization: Option<crate::models::KvQuantization>,
    /// Batched layout: most attention scores (slots x heads x queries x
    /// capacity) the rows attending together may hold; a prompt chunk that
    /// would take more attends alone (see [`crate::models::BatchedRows`]).
    pub shared_attention_scores: usize,
    /// While rows are decoding, a step carries only as many prompt tokens
    /// as keep it within this multiple of a decode-only step (measured as
    /// the engine runs, see [`super::step_cost`]), so a long prompt joining
    /// does not stall the streams; at most 1 turns the limit off.
    pub max_itl_inflation: f64,
    /// Queue a plain decode step's successor before reading its tokens, so
    /// building it overlaps the device's work (batched slots only, see
    /// `lookahead.rs`).
    pub lookahead: bool,
}

/// Where running rows keep their KV caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvLayout {
    /// Batched on a GPU, per row on the CPU.
    Auto,
    /// Each row its own cache, attention row by row: on the CPU the fused
    /// attention kernel already covers every row in one op.
    Rows,
    /// Slots of one shared buffer, from a row's first prompt chunk to its
    /// last token; attention for all rows in one op per layer
    /// ([`crate::models::KvBatch`]): a GPU step is bound by kernel launches,
    /// and this keeps their count independent of the batch.
    Batched,
}

impl KvLayout {
    pub fn batched_on(self, device: mlx::Device) -> bool {
        match self {
            KvLayout::Auto => device == mlx::Device::Gpu,
            KvLayout::Rows => false,
            KvLayout::Batched => true,
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_running: 32,
            max_waiting: 256,
            step_token_budget: 512,
            prefill_chunk: 512,
            min_prefill_chunk: 16,
            max_prefill_chunk: 2048,
            event_buffer: 64,
            kv_budget_bytes: 4 << 30,
            reclaim_every_steps: 256,
            prefix_cache_bytes: 1 << 30,
            kv_host_bytes: 0,
            kv_disk: None,
            prefix_block_tokens: 16,
            step_draft_budget: 64,
            draft_model: None,
            kv_layout: KvLayout::Auto,
            kv_quantization: None,
            shared_attention_scores: crate::models::SHARED_ATTENTION_SCORES,
            max_itl_inflation: 1.5,
            lookahead: true,
        }
    }
}
