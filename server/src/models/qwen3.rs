//! Qwen3: Llama's decoder with an RMS norm over each head's queries and keys
//! before RoPE, no q/k/v biases, and a head size of its own (not
//! `d_model / heads`, read from the checkpoint).
//!
//! The norms are the only part of the forward that is Qwen3's own; Gemma 3
//! has the same ones and takes them from here. They run on the fused q/k/v
//! projection's output, once a layer for the whole step, before any
//! attention backend sees the rows.
use mlx::fast;
use mlx::Array;

use super::config::ModelConfig;
use super::layers::Heads;

// ---- Args ----

/// Qwen3's settings in a Hugging Face `config.json`: the per-head norms
/// (`self_attn.q_norm`, `self_attn.k_norm`). A GGUF file tells them by
/// its `attn_q_norm` tensors.
pub(super) fn hf_args(c: &mut ModelConfig) {
    c.qk_norm = true;
}

// ---- Attention ----

/// The RMS-norm weights (`[head_dim]`) of each head's queries and keys.
pub struct QkNorm {
    pub q: Array,
    pub k: Array,
}

impl QkNorm {
    /// The fused projection's output `[1, total, (hq + 2 hkv) hd]` with its
    /// queries normed by `q` and its keys by `k`, values untouched.
    pub(super) fn apply(&self, qkv: &Array, heads: Heads, total: i32, eps: f32) -> mlx::Result<Array> {
        let Heads { q: hq, kv: hkv, dim: hd } = heads;
        let heads = qkv.reshape(&[1, total, hq + 2 * hkv, hd])?;
        let q = fast::rms_norm(&heads.slice(&[0, 0, 0, 0], &[1, total, hq, hd])?, &self.q, eps)?;
        let k = fast::rms_norm(&heads.slice(&[0, 0, hq, 0], &[1, total, hq + hkv, hd])?, &self.k, eps)?;
        let v = heads.slice(&[0, 0, hq + hkv, 0], &[1, total, hq + 2 * hkv, hd])?;
        mlx::concatenate(&[&q, &k, &v], 2)?.reshape(&[1, total, (hq + 2 * hkv) * hd])
    }
}
