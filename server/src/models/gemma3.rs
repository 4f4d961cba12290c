//! Gemma 3 (text): Qwen3's per-head query/key norms, embeddings scaled by
//! `sqrt(d_model)`, norms after attention and after the MLP as well as
//! before, GeGLU, and sliding-window layers interleaved with global ones,
//! turning their RoPE at a base of their own.
//!
//! What is Gemma's lives here: its settings, the window's layer pattern and
//! mask, the 27B's score scale and GELU. The window caches (rows' and
//! batched slots') hold only the last `size` positions of a local layer;
//! that bookkeeping is the caches' own (`kv_cache.rs`, `kv_batch.rs`).
use gguf::GgufFile;
use mlx::{Array, Dtype};

use super::config::{Activation, Architecture, ModelConfig};
use super::LoadError;

// ---- Args ----

/// Sliding-window attention on some layers: a local layer's query sees only
/// the last `size` positions (itself included) and its RoPE turns at its
/// own base; every `global_every`-th layer (the last of each group) attends
/// to everything at the model's main RoPE base.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlidingWindow {
    pub size: usize,
    pub global_every: usize,
    pub local_rope_theta: f32,
    /// Bit `l` set: layer `l` is local, named layer by layer (Gemma 4's
    /// pattern); `None`: `global_every` decides.
    pub pattern: Option<u128>,
}

impl SlidingWindow {
    /// Whether layer `layer` (from 0) attends within the window.
    pub fn is_local(&self, layer: usize) -> bool {
        match self.pattern {
            Some(bits) => layer < 128 && bits >> layer & 1 == 1,
            None => !(layer + 1).is_multiple_of(self.global_every),
        }
    }
}

/// Gemma 3's settings in a GGUF file (under `arch_name.`).
pub(super) fn gguf_args(file: &GgufFile, arch_name: &str, c: &mut ModelConfig) -> Result<(), LoadError> {
    let key = |suffix: &str| format!("{arch_name}.{suffix}");
    // The local layers: the window is in the file; the layer pattern (five
    // local, one global) and the local RoPE base are the family's own
    // (llama.cpp hard-codes them too; a file may name them).
    c.sliding_window = file.get_u64(&key("attention.sliding_window")).map(|size| SlidingWindow {
        size: size as usize,
        global_every: file.get_u64(&key("attention.sliding_window_pattern")).map_or(6, |v| v as usize),
        local_rope_theta: file.get_f32(&key("rope.freq_base_swa")).unwrap_or(10_000.0),
        pattern: None,
    });
    if file.get_str(&key("rope.scaling.type")).is_some_and(|t| t != "none") {
        return Err(LoadError::Invalid(format!("{arch_name}: RoPE scaling is not supported for this architecture yet")));
    }
    // Gemma's GGUF norms already hold 1 + w (its converter adds the one).
    c.embedding_scale = (c.d_model as f32).sqrt();
    c.activation = Activation::GeluTanh;
    c.post_norms = true;
    Ok(())
}

/// Gemma's Hugging Face checkpoints store norm weights as offsets from 1
/// and its layer pattern in fields of their own; only its GGUF form is read.
pub(super) fn hf_args() -> Result<(), LoadError> {
    Err(LoadError::Invalid("Gemma 3 loads from its GGUF file; Hugging Face folders of it are not supported".into()))
}

// ---- Attention ----

/// What the query norm's weights are multiplied by at load. Attention
/// scales scores by 1/sqrt(head_dim); Gemma 3 27B (62 layers) was trained
/// with 1/sqrt(d_model / heads) instead (llama.cpp tells it by its layer
/// count too). RoPE is linear, so folding the ratio into the query norm
/// scales the scores the same at no cost per step.
pub(super) fn query_norm_scale(c: &ModelConfig) -> f32 {
    match c.arch == Architecture::Gemma3 && c.n_layers == 62 {
        true => ((c.head_dim as f64) / (c.d_model as f64 / c.n_heads as f64)).sqrt() as f32,
        false => 1.0,
    }
}

/// The additive mask of `n` queries at positions `offset ..` over the
/// keys of positions `first .. offset + n` on a layer of `window`: each
/// sees itself and the `window - 1` positions before it.
pub(super) fn window_mask(offset: usize, n: usize, first: usize, window: usize, dtype: Dtype) -> mlx::Result<Array> {
    let keys = offset + n - first;
    let mask: Vec<f32> = (0..n * keys)
        .map(|x| (offset + x / keys, first + x % keys))
        .map(|(query, key)| if key <= query && key + window > query { 0.0 } else { f32::NEG_INFINITY })
        .collect();
    Array::from_f32(&mask, &[1, 1, n, keys])?.astype(dtype)
}

// ---- Mlp ----

/// GELU's tanh approximation, `x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`
/// (GeGLU's activation).
pub(super) fn gelu_tanh(x: &Array, dtype: Dtype) -> mlx::Result<Array> {
    let k = |v: f64| Array::scalar(v as f32, dtype);
    let cubic = x.multiply(&x.square()?)?.multiply(&k(0.044715)?)?;
    let inner = x.add(&cubic)?.multiply(&k((2.0 / std::f64::consts::PI).sqrt())?)?;
    x.multiply(&k(0.5)?)?.multiply(&inner.tanh()?.add(&k(1.0)?)?)
}

// ---- Model ----

/// The token embeddings scaled as Gemma scales them (by
/// `config.embedding_scale`, 1 for the other families).
pub(super) fn scale_embeddings(h: Array, c: &ModelConfig, dtype: Dtype) -> mlx::Result<Array> {
    match c.embedding_scale != 1.0 {
        true => h.multiply(&Array::scalar(c.embedding_scale, dtype)?),
        false => Ok(h),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_layer_of_each_group_is_global() {
        let window = SlidingWindow { size: 512, global_every: 6, local_rope_theta: 10_000.0, pattern: None };
        let global: Vec<usize> = (0..18).filter(|&l| !window.is_local(l)).collect();
        assert_eq!(global, [5, 11, 17]);
    }

    #[test]
    fn a_window_query_sees_itself_and_the_window_before_it() {
        mlx::set_default_device(mlx::Device::Cpu).unwrap();
        // Queries at positions 4 and 5 over the keys held from position 2
        // (2..=5), on a layer of window 3.
        let mask = window_mask(4, 2, 2, 3, Dtype::F32).unwrap();
        assert_eq!(mask.shape(), [1, 1, 2, 4]);
        let seen: Vec<bool> = mask.to_vec_f32().unwrap().into_iter().map(|m| m == 0.0).collect();
        #[rustfmt::skip]
        assert_eq!(seen, [
            true, true, true, false, // query 4: keys 2, 3, 4
            false, true, true, true, // query 5: keys 3, 4, 5
        ]);
    }
}
