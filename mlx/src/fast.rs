//! MLX's fused kernels (`mlx::core::fast`).
use crate::array::wrap;
use crate::ffi::bridge;
use crate::{Array, Result};

/// RMS normalisation over the last axis, scaled by `weight`.
pub fn rms_norm(x: &Array, weight: &Array, eps: f32) -> Result<Array> {
    wrap("rms_norm", bridge::rms_norm(x.raw(), weight.raw(), eps))
}

/// Rotary position embedding of the last axis' first `dims` features, for
/// positions `offset..offset + seq_len` (the second-to-last axis).
/// `traditional` rotates adjacent pairs (2i, 2i+1); otherwise the two halves.
pub fn rope(x: &Array, dims: i32, traditional: bool, base: f32, scale: f32, offset: i32) -> Result<Array> {
    wrap("rope", bridge::rope(x.raw(), dims, traditional, base, scale, offset))
}

/// Like [`rope`] with one starting offset per batch row (an int32 array of
/// shape `[batch]`), for batches whose rows sit at different positions.
pub fn rope_offsets(x: &Array, dims: i32, traditional: bool, base: f32, scale: f32, offsets: &Array) -> Result<Array> {
    wrap("rope", bridge::rope_offsets(x.raw(), dims, traditional, base, scale, offsets.raw()))
}

/// Attention mask for [`sdpa`].
#[derive(Clone, Copy)]
pub enum Mask<'a> {
    None,
    /// Causal, aligned so the last query attends to the last key.
    Causal,
    /// Boolean (true = attend) or additive float mask, broadcastable to
    /// `[batch, heads, q_len, k_len]`.
    Array(&'a Array),
}

/// `softmax(q k^T * scale + mask) v` with grouped-query support: `k`/`v` may
/// have fewer heads than `q` (a divisor of it).
pub fn sdpa(q: &Array, k: &Array, v: &Array, scale: f32, mask: Mask<'_>) -> Result<Array> {
    let r = match mask {
        Mask::None => bridge::sdpa(q.raw(), k.raw(), v.raw(), scale, ""),
        Mask::Causal => bridge::sdpa(q.raw(), k.raw(), v.raw(), scale, "causal"),
        Mask::Array(m) => bridge::sdpa_masked(q.raw(), k.raw(), v.raw(), scale, m.raw()),
    };
    wrap("scaled_dot_product_attention", r)
}
