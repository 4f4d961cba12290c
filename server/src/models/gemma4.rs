//! Gemma 4 (GGUF `gemma4`; the dense models: E2B, E4B, 31B): Gemma 3's
//! blocks (pre- and post-norms, GeGLU, window layers beside whole-history
//! ones, embeddings scaled by `sqrt(d_model)`) whose layers differ from
//! each other.
//!
//! What is its own, read from the layout llama.cpp's converter writes:
//! - **Layers of two shapes**: a window layer's heads are
//!   `key_length_swa` wide, a whole-history layer's `key_length`; KV head
//!   counts and MLP widths may be given per layer. Which layers attend
//!   within the window is a per-layer array. So a row's cache holds
//!   buffers of each layer's own shape (`KvCache::with_layer_shapes`).
//! - **KV-shared layers**: the last `shared_kv_layers` layers project only
//!   queries and attend over the keys and values of the last earlier layer
//!   of their kind (window or not). They hold no KV: a row's cache has no
//!   buffers for them, and within a step they read what their source layer
//!   wrote for it (`StepAttention::attend_shared`).
//! - **Attention**: queries and keys RMS-normed per head with weights,
//!   values RMS-normed without; scores unscaled (1, folded into the query
//!   norm here); window layers turn their RoPE at a base of their own, the
//!   others by per-pair factors (`rope_freqs`: "proportional" RoPE, whose
//!   slow pairs do not turn). A file without `attn_v` uses the keys'
//!   projection for the values too.
//! - **Per-layer inputs** (E2B, E4B): a second embedding table gives each
//!   token a small vector per layer, mixed with a projection of the scaled
//!   embeddings; after its MLP each layer adds `post_norm(proj(gelu(gate(h))
//!   * input))`. A layer may scale its output (`layer_output_scale`).
//! - **Final logit softcapping**: `cap * tanh(logits / cap)`.
//!
//! What it deliberately does not do: the mixture-of-experts model
//! (26B-A4B) is refused at load; it runs through MLX's ops on rows with
//! caches of their own (not the CPU's fused attention, whose tables turn
//! whole heads of one size, nor batched KV slots, which hold one shape).
use std::rc::Rc;

use gguf::GgufFile;
use mlx::{fast, Array, Dtype};

use super::config::{Activation, ModelConfig};
use super::embedding::Embedding;
use super::gemma3::{self, SlidingWindow};
use super::gguf_loader::Loader;
use super::layers::{Attention, Block, Gate, Heads, Mixer, Mlp, Rope, RopeFreqs};
use super::linear::Linear;
use super::qwen3::QkNorm;
use super::LoadError;

// ---- Args ----

/// How Gemma 4's layers differ from each other.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerPlan {
    pub layers: Vec<LayerShape>,
    /// Features of each layer's per-layer input (0: the model has none).
    pub per_layer_input: usize,
    /// Logits become `cap * tanh(logits / cap)`.
    pub final_softcap: Option<f32>,
}

/// One layer's sizes and where its KV comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Features of each head RoPE turns, from the first.
    pub rope_dims: usize,
    pub d_ff: usize,
    /// The earlier layer whose keys and values it attends over (a
    /// KV-shared layer); `None`: its own.
    pub kv_from: Option<usize>,
}

impl LayerPlan {
    pub(super) fn validate(&self, n_layers: usize, window: impl Fn(usize) -> bool) -> bool {
        self.layers.len() == n_layers
            && self.layers.iter().enumerate().all(|(l, s)| {
                s.heads > 0
                    && s.kv_heads > 0
                    && s.heads.is_multiple_of(s.kv_heads)
                    && s.head_dim.is_multiple_of(2)
                    && s.rope_dims > 0
                    && s.rope_dims <= s.head_dim
                    && s.rope_dims.is_multiple_of(2)
                    && s.kv_from
                        .is_none_or(|src| src < l && self.layers[src].kv_from.is_none() && window(src) == window(l) && self.layers[src].head_dim == s.head_dim)
            })
    }
}

/// A metadata value given once for all layers or as an array of one per layer.
fn per_layer(file: &GgufFile, key: &str, n_layers: usize) -> Result<Option<Vec<usize>>, LoadError> {
    if let Some(v) = file.get_u64(key) {
        return Ok(Some(vec![v as usize; n_layers]));
    }
    let Some(values) = file.get_array(key) else { return Ok(None) };
    let values: Option<Vec<usize>> = values.iter().map(|v| v.as_u64().map(|v| v as usize)).collect();
    match values {
        Some(v) if v.len() == n_layers => Ok(Some(v)),
        _ => Err(LoadError::Invalid(format!("{key} must hold an integer per layer ({n_layers})"))),
    }
}

/// Gemma 4's settings in a GGUF file (under `arch_name.`).
pub(super) fn gguf_args(file: &GgufFile, arch_name: &str, c: &mut ModelConfig) -> Result<(), LoadError> {
    let key = |suffix: &str| format!("{arch_name}.{suffix}");
    let int = |suffix: &str| -> Result<usize, LoadError> {
        file.get_u64(&key(suffix)).map(|v| v as usize).ok_or_else(|| LoadError::Invalid(format!("missing {}", key(suffix))))
    };
    let n = c.n_layers;
    if file.get_u64(&key("expert_count")).is_some_and(|e| e > 0) || file.tensor("blk.0.ffn_gate_inp.weight").is_some() {
        return Err(LoadError::Unsupported(format!("{arch_name}: mixture-of-experts layers (the 26B-A4B's ffn_gate_inp and expert tensors)")));
    }
    if n > 128 {
        return Err(LoadError::Invalid(format!("{arch_name}: {n} layers, at most 128 are supported")));
    }
    let pattern: Vec<bool> = match file.get_array(&key("attention.sliding_window_pattern")) {
        Some(flags) => flags.iter().map(|v| v.as_bool()).collect::<Option<Vec<bool>>>().filter(|f| f.len() == n),
        None => None,
    }
    .ok_or_else(|| LoadError::Invalid(format!("{} must hold a boolean per layer", key("attention.sliding_window_pattern"))))?;
    let (full_dim, swa_dim) = (int("attention.key_length")?, int("attention.key_length_swa")?);
    let value_lengths = (file.get_u64(&key("attention.value_length")), file.get_u64(&key("attention.value_length_swa")));
    if value_lengths.0.is_some_and(|v| v as usize != full_dim) || value_lengths.1.is_some_and(|v| v as usize != swa_dim) {
        return Err(LoadError::Unsupported(format!("{arch_name}: values of another width than keys")));
    }
    let need = |k: &str| -> Result<Vec<usize>, LoadError> { per_layer(file, &key(k), n)?.ok_or_else(|| LoadError::Invalid(format!("missing {}", key(k)))) };
    let heads = need("attention.head_count")?;
    let kv_heads = per_layer(file, &key("attention.head_count_kv"), n)?.unwrap_or_else(|| heads.clone());
    let d_ff = need("feed_forward_length")?;
    let rope_full = file.get_u64(&key("rope.dimension_count")).map_or(full_dim, |v| v as usize);
    let rope_swa = file.get_u64(&key("rope.dimension_count_swa")).map_or(swa_dim, |v| v as usize);
    // The last `shared` layers read the KV of the last earlier layer of their kind.
    let shared = file.get_u64(&key("attention.shared_kv_layers")).unwrap_or(0) as usize;
    let first_shared = n.checked_sub(shared).ok_or_else(|| LoadError::Invalid(format!("{arch_name}: {shared} KV-shared layers of {n}")))?;
    let kv_from = |l: usize| (l >= first_shared).then(|| (0..first_shared).rev().find(|&j| pattern[j] == pattern[l])).flatten();
    let layers = (0..n)
        .map(|l| {
            let (head_dim, rope_dims) = if pattern[l] { (swa_dim, rope_swa) } else { (full_dim, rope_full) };
            Ok(LayerShape { heads: heads[l], kv_heads: kv_heads[l], head_dim, rope_dims, d_ff: d_ff[l], kv_from: kv_from(l) })
        })
        .collect::<Result<Vec<_>, LoadError>>()?;
    if layers.iter().enumerate().any(|(l, s)| l >= first_shared && s.kv_from.is_none()) {
        return Err(LoadError::Invalid(format!("{arch_name}: a KV-shared layer has no earlier layer of its kind to read")));
    }
    c.sliding_window = Some(SlidingWindow {
        size: int("attention.sliding_window")?,
        global_every: 1,
        local_rope_theta: file.get_f32(&key("rope.freq_base_swa")).unwrap_or(10_000.0),
        pattern: Some(pattern.iter().enumerate().fold(0u128, |m, (l, &w)| m | (w as u128) << l)),
    });
    // The model-wide sizes are the whole-history layers' (what `rope_freqs` turns).
    let first_full = pattern.iter().position(|w| !w).unwrap_or(0);
    (c.head_dim, c.n_heads, c.n_kv_heads, c.d_ff) = (full_dim, heads[first_full], kv_heads[first_full], d_ff[first_full]);
    c.layer_plan = Some(LayerPlan {
        layers,
        per_layer_input: file.get_u64(&key("embedding_length_per_layer_input")).unwrap_or(0) as usize,
        final_softcap: file.get_f32(&key("final_logit_softcapping")).filter(|&cap| cap > 0.0),
    });
    // Gemma 4's norms are stored as they multiply (no `1 + w`).
    c.embedding_scale = (c.d_model as f32).sqrt();
    c.activation = Activation::GeluTanh;
    c.post_norms = true;
    c.qk_norm = true;
    Ok(())
}

// ---- Attention ----

/// The two RoPEs of a Gemma 4 model: the window layers' (at their own
/// base) and the whole-history layers' (by per-pair periods when the file
/// gives factors).
pub(super) struct Ropes {
    window: Rc<Rope>,
    full: Rc<Rope>,
}

impl Ropes {
    pub(super) fn new(c: &ModelConfig, full_periods: Option<Array>) -> Ropes {
        let plan = c.layer_plan.as_ref().expect("invariant: a gemma4 config has a layer plan");
        let dims = |window: bool| (0..c.n_layers).find(|&l| c.layer_window(l).is_some() == window).map_or(c.head_dim, |l| plan.layers[l].rope_dims) as i32;
        let theta = c.sliding_window.map_or(c.rope_theta, |w| w.local_rope_theta);
        let full = match full_periods {
            Some(p) => RopeFreqs::Periods(p),
            None => RopeFreqs::Base(c.rope_theta),
        };
        Ropes {
            window: Rc::new(Rope { freqs: RopeFreqs::Base(theta), dims: dims(true), traditional: false }),
            full: Rc::new(Rope { freqs: full, dims: dims(false), traditional: false }),
        }
    }
}

/// The projection `[1, total, (hq + 2 hkv) hd]` with queries and keys
/// RMS-normed by their weights and values by `unit` (ones); a KV-shared
/// layer's (`hkv` 0) holds only queries.
pub(super) fn norm_heads(qkv: &Array, norm: &QkNorm, unit: &Array, heads: Heads, total: i32, eps: f32) -> mlx::Result<Array> {
    let Heads { q: hq, kv: hkv, dim: hd } = heads;
    let all = qkv.reshape(&[1, total, hq + 2 * hkv, hd])?;
    let part = |from: i32, to: i32| all.slice(&[0, 0, from, 0], &[1, total, to, hd]);
    let q = fast::rms_norm(&part(0, hq)?, &norm.q, eps)?;
    if hkv == 0 {
        return q.reshape(&[1, total, hq * hd]);
    }
    let k = fast::rms_norm(&part(hq, hq + hkv)?, &norm.k, eps)?;
    let v = fast::rms_norm(&part(hq + hkv, hq + 2 * hkv)?, unit, eps)?;
    mlx::concatenate(&[&q, &k, &v], 2)?.reshape(&[1, total, (hq + 2 * hkv) * hd])
}

// ---- Per-layer inputs ----

/// The model's per-layer input table and the projection mixed into it.
pub struct PerLayerInput {
    /// `[vocab, layers * width]`: each token's vector per layer.
    table: Embedding,
    /// `[layers * width, d_model]`, of the scaled embeddings.
    proj: Linear,
    /// `[width]`: the RMS norm of the projection, per layer.
    norm: Array,
    layers: i32,
    width: i32,
    d_model: usize,
    eps: f32,
}

impl PerLayerInput {
    /// Every layer's input for the step's tokens `ids` (`[1, T]`) whose
    /// scaled embeddings are `h`: `[1, T, layers, width]`,
    /// `(norm(proj(h) / sqrt(d)) + table[ids] sqrt(width)) / sqrt(2)`.
    pub(super) fn inputs(&self, ids: &Array, h: &Array, dtype: Dtype) -> mlx::Result<Array> {
        let (total, l, w) = (h.dim(1) as i32, self.layers, self.width);
        let scalar = |v: f64| Array::scalar(v as f32, dtype);
        let tokens = self.table.rows(ids, dtype)?.reshape(&[1, total, l, w])?.multiply(&scalar((w as f64).sqrt())?)?;
        let projected = self.proj.forward(h)?.multiply(&scalar(1.0 / (self.d_model as f64).sqrt())?)?.reshape(&[1, total, l, w])?;
        fast::rms_norm(&projected, &self.norm, self.eps)?.add(&tokens)?.multiply(&scalar(std::f64::consts::FRAC_1_SQRT_2)?)
    }

    pub fn nbytes(&self) -> usize {
        self.table.nbytes() + self.proj.nbytes() + self.norm.nbytes()
    }
}

/// What a Gemma 4 layer does after its MLP: adds its per-layer input's
/// gated projection, and scales its output.
pub struct LayerTail {
    layer: i32,
    /// gate `[width, d]`, proj `[d, width]` and the norm of proj's output `[d]`.
    input: Option<(Linear, Linear, Array)>,
    /// `[1]`.
    out_scale: Option<Array>,
    eps: f32,
    dtype: Dtype,
}

impl LayerTail {
    /// `h` after the tail; `inputs` is [`PerLayerInput::inputs`]'s.
    pub(super) fn forward(&self, h: Array, inputs: Option<&Array>) -> mlx::Result<Array> {
        let h = match (&self.input, inputs) {
            (Some((gate, proj, norm)), Some(all)) => {
                let (total, w) = (h.dim(1) as i32, all.dim(3) as i32);
                let mine = all.slice(&[0, 0, self.layer, 0], &[1, total, self.layer + 1, w])?.reshape(&[1, total, w])?;
                let gated = gemma3::gelu_tanh(&gate.forward(&h)?, self.dtype)?.multiply(&mine)?;
                h.add(&fast::rms_norm(&proj.forward(&gated)?, norm, self.eps)?)?
            }
            _ => h,
        };
        match &self.out_scale {
            Some(s) => h.multiply(s),
            None => Ok(h),
        }
    }

    pub(super) fn linears(&self) -> Vec<&Linear> {
        self.input.iter().flat_map(|(g, p, _)| [g, p]).collect()
    }

    pub(super) fn linears_mut(&mut self) -> Vec<&mut Linear> {
        self.input.iter_mut().flat_map(|(g, p, _)| [g, p]).collect()
    }

    pub fn nbytes(&self) -> usize {
        let small = self.input.as_ref().map_or(0, |(_, _, n)| n.nbytes()) + self.out_scale.as_ref().map_or(0, Array::nbytes);
        small + self.linears().iter().map(|l| l.nbytes()).sum::<usize>()
    }
}

// ---- Model ----

/// Layer `i` of a Gemma 4 GGUF file, built whole.
pub(super) fn gguf_layer(loader: &Loader<'_>, c: &ModelConfig, i: usize, ropes: &Ropes, kv_index: &[Option<usize>]) -> Result<Block, LoadError> {
    let plan = c.layer_plan.as_ref().expect("invariant: a gemma4 config has a layer plan");
    let s = plan.layers[i];
    let (d, hd, dtype) = (c.d_model, s.head_dim, loader.dtype());
    let p = format!("blk.{i}");
    let name = |n: &str| format!("{p}.{n}");
    let kv_heads = if s.kv_from.is_some() { 0 } else { s.kv_heads };
    let heads = Heads { q: s.heads as i32, kv: kv_heads as i32, dim: hd as i32 };
    let qkv = if loader.has(&name("attn_qkv.weight")) {
        let rows = (s.heads + 2 * s.kv_heads) * hd;
        match kv_heads {
            0 => Linear {
                weight: super::linear::Weight::Dense(
                    loader.dense(&name("attn_qkv.weight"), &[rows, d])?.slice(&[0, 0], &[(s.heads * hd) as i32, d as i32])?.contiguous()?,
                ),
                bias: None,
            },
            _ => loader.linear(&name("attn_qkv"), rows, d)?,
        }
    } else if kv_heads == 0 {
        loader.linear(&name("attn_q"), s.heads * hd, d)?
    } else {
        // Without `attn_v`, the values are the keys' projection (normed apart).
        let v = if loader.has(&name("attn_v.weight")) { name("attn_v") } else { name("attn_k") };
        let parts = [loader.linear(&name("attn_q"), s.heads * hd, d)?, loader.linear(&name("attn_k"), kv_heads * hd, d)?, loader.linear(&v, kv_heads * hd, d)?];
        loader.fuse(&parts, &[&name("attn_q"), &name("attn_k"), &v])?
    };
    // Scores are unscaled: the attention's 1/sqrt(hd) is undone in the query norm.
    let q_norm = loader.dense(&name("attn_q_norm.weight"), &[hd])?.multiply(&Array::scalar((hd as f32).sqrt(), dtype)?)?;
    let unit = Array::full(&[hd], 1.0, dtype)?;
    // A KV-shared layer has no keys: its key norm is never read.
    let k_norm = if kv_heads == 0 { unit.clone() } else { loader.dense(&name("attn_k_norm.weight"), &[hd])? };
    let window = c.layer_window(i);
    let attention = Attention {
        norm: loader.dense(&name("attn_norm.weight"), &[d])?,
        qkv,
        qk_norm: Some(QkNorm { q: q_norm, k: k_norm }),
        value_norm: Some(unit),
        kv_from: s.kv_from.map(|src| kv_index[src].expect("invariant: a KV-shared layer's source holds KV")),
        out: loader.linear(&name("attn_output"), d, s.heads * hd)?,
        gate: None,
        post_norm: Some(loader.dense(&name("post_attention_norm.weight"), &[d])?),
        rope: if window.is_some() { ropes.window.clone() } else { ropes.full.clone() },
        window,
        heads,
        eps: c.rms_eps,
    };
    let gate_up = [loader.linear(&name("ffn_gate"), s.d_ff, d)?, loader.linear(&name("ffn_up"), s.d_ff, d)?];
    let mlp = Mlp {
        norm: loader.dense(&name("ffn_norm.weight"), &[d])?,
        gate_up: loader.fuse(&gate_up, &[&name("ffn_gate"), &name("ffn_up")])?,
        down: loader.linear(&name("ffn_down"), d, s.d_ff)?,
        post_norm: Some(loader.dense(&name("post_ffw_norm.weight"), &[d])?),
        gate: Gate::GeGlu,
        d_ff: s.d_ff as i32,
        eps: c.rms_eps,
        dtype,
    };
    let w = plan.per_layer_input;
    let input = match w {
        0 => None,
        _ => Some((loader.linear(&name("inp_gate"), w, d)?, loader.linear(&name("proj"), d, w)?, loader.dense(&name("post_norm.weight"), &[d])?)),
    };
    let out_scale = match loader.has(&name("layer_output_scale.weight")) {
        true => Some(loader.dense(&name("layer_output_scale.weight"), &[1])?),
        false => None,
    };
    let tail = (input.is_some() || out_scale.is_some()).then_some(LayerTail { layer: i as i32, input, out_scale, eps: c.rms_eps, dtype });
    Ok(Block { mixer: Mixer::Attention(attention), mlp, tail })
}

/// The model's per-layer input table and projection, if it has them.
pub(super) fn gguf_per_layer_input(loader: &Loader<'_>, c: &ModelConfig) -> Result<Option<PerLayerInput>, LoadError> {
    let w = c.layer_plan.as_ref().map_or(0, |p| p.per_layer_input);
    if w == 0 {
        return Ok(None);
    }
    let (n, d) = (c.n_layers, c.d_model);
    Ok(Some(PerLayerInput {
        table: loader.embedding("per_layer_token_embd.weight", c.vocab_size, n * w)?,
        proj: loader.linear("per_layer_model_proj", n * w, d)?,
        norm: loader.dense("per_layer_proj_norm.weight", &[w])?,
        layers: n as i32,
        width: w as i32,
        d_model: d,
        eps: c.rms_eps,
    }))
}

/// Logits `cap * tanh(logits / cap)` where the model caps them.
pub(super) fn softcap(logits: Array, c: &ModelConfig) -> mlx::Result<Array> {
    match c.layer_plan.as_ref().and_then(|p| p.final_softcap) {
        Some(cap) => logits.multiply(&Array::scalar(1.0 / cap, logits.dtype())?)?.tanh()?.multiply(&Array::scalar(cap, logits.dtype())?),
        None => Ok(logits),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(head_dim: usize, kv_from: Option<usize>) -> LayerShape {
        LayerShape { heads: 4, kv_heads: 2, head_dim, rope_dims: head_dim, d_ff: 64, kv_from }
    }

    #[test]
    fn a_shared_layer_reads_an_earlier_layer_of_its_kind() {
        // Layers 0-3: window, window, full, window; 4 (window) and 5 (full) share.
        let window = |l: usize| [true, true, false, true, true, false][l];
        let good = LayerPlan {
            layers: vec![shape(32, None), shape(32, None), shape(64, None), shape(32, None), shape(32, Some(3)), shape(64, Some(2))],
            per_layer_input: 0,
            final_softcap: None,
        };
        assert!(good.validate(6, window));
        let mut wrong_kind = good.clone();
        wrong_kind.layers[5].kv_from = Some(3);
        assert!(!wrong_kind.validate(6, window), "a full layer cannot read a window layer's KV");
        let mut later = good.clone();
        later.layers[3].kv_from = Some(4);
        assert!(!later.validate(6, window), "a layer reads only an earlier one");
    }
}
