//! Qwen2 (and Qwen2.5): Llama's decoder with biases on the q, k and v
//! projections, split-half RoPE and usually tied embeddings.
//!
//! Nothing in its forward is its own: the biases are loaded into the fused
//! q/k/v projection ([`Linear::bias`](super::linear::Linear)) and added in
//! its node, so Qwen2 runs the shared layers as they are. A GGUF file tells
//! the biases by its `attn_q.bias` tensors.
use super::config::ModelConfig;

// ---- Args ----

/// Qwen2's settings in a Hugging Face `config.json` (which does not name
/// the biases: the family has them).
pub(super) fn hf_args(c: &mut ModelConfig) {
    c.qkv_bias = true;
}
