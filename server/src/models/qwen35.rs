//! Qwen3.5 (dense; GGUF `qwen35`): a hybrid of Gated DeltaNet layers
//! (linear attention with a recurrent state per row) and, every few layers,
//! a full-attention layer. Its blocks are Qwen3's otherwise: pre-norms, a
//! SwiGLU MLP, per-head query/key norms.
//!
//! What is its own, read from the layout llama.cpp's converter writes:
//! - **Full attention**: the query projection yields each head's queries
//!   and then as many gate values; the heads' outputs are multiplied by
//!   `sigmoid(gate)` before the output projection. RoPE turns only the
//!   first `rope.dimension_count` features of a head (split halves); its
//!   multi-section form turns every section by the same position for text.
//! - **Gated DeltaNet**: one projection gives the convolution's channels
//!   (queries, keys, values), the output gate `z`, and per value head the
//!   write strength `beta` and the decay's input `a`. A causal depthwise
//!   convolution of width `kernel` (its last inputs carried per row) and
//!   silu; queries and keys L2-normed per head, queries scaled by
//!   `1/sqrt(key_dim)`; then per value head `h` (reading key head
//!   `h mod key_heads`), token by token, with `S` its `[key_dim, value_dim]` state:
//!   `S = exp(g) S; d = beta (v - S^T k); S += k d^T; o = S^T q`, where
//!   `g = softplus(a + dt_bias) * ssm_a` (negative: a decay). The output is
//!   RMS-normed per head, times `silu(z)`, and projected back.
//!
//! The state lives in the row's KV cache (`state_rows.rs`). What this file
//! deliberately does not do yet: the chunked (parallel) form of the delta
//! rule for long prompts (a prompt runs token by token here: correct,
//! not fast), quantized query/gate projections of the attention layers
//! (they load dense, to split the interleaved gate), the GPU's batched slots.
use gguf::GgufFile;
use mlx::{fast, Array, Dtype};

use super::config::ModelConfig;
use super::gguf_loader::Loader;
use super::linear::Linear;
use super::qwen3::QkNorm;
use super::state_rows::LayerState;
use super::transformer::{LayerWeights, LoadedLayer, MlpWeights};
use super::LoadError;

// ---- Args ----

/// The recurrent layers of a hybrid model and their sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hybrid {
    /// Bit `l` set: layer `l` is recurrent, else it attends (a model of up
    /// to 128 layers; the largest Qwen3.5 has 64).
    pub recurrent: u128,
    /// Taps of the causal convolution.
    pub conv_kernel: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    /// Features of a key (and query) head.
    pub key_dim: usize,
    /// Features of a value head.
    pub value_dim: usize,
}

/// The most layers a [`Hybrid`] pattern holds.
pub const MAX_HYBRID_LAYERS: usize = 128;

impl Hybrid {
    /// The pattern of `n_layers` where every `interval`-th layer (the last
    /// of each group) attends and the others recur.
    pub fn every(n_layers: usize, interval: usize) -> u128 {
        (0..n_layers.min(MAX_HYBRID_LAYERS)).filter(|l| !(l + 1).is_multiple_of(interval.max(1))).fold(0, |m, l| m | 1 << l)
    }

    pub fn is_recurrent(&self, layer: usize) -> bool {
        layer < MAX_HYBRID_LAYERS && self.recurrent >> layer & 1 == 1
    }

    /// The convolution's channels: queries, keys, then values.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_width()
    }

    /// Values of all heads: `value_heads * value_dim`.
    pub fn value_width(&self) -> usize {
        self.value_heads * self.value_dim
    }

    /// Values one row's state holds per recurrent layer: the convolution's
    /// last inputs and the delta rule's matrices.
    pub fn state_values(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_channels() + self.value_heads * self.key_dim * self.value_dim
    }

    pub(super) fn validate(&self) -> bool {
        self.conv_kernel > 1
            && self.key_heads > 0
            && self.value_heads > 0
            && self.value_heads.is_multiple_of(self.key_heads)
            && self.key_dim > 0
            && self.value_dim > 0
    }
}

/// Qwen3.5's settings in a GGUF file (under `arch_name.`).
pub(super) fn gguf_args(file: &GgufFile, arch_name: &str, c: &mut ModelConfig) -> Result<(), LoadError> {
    let int = |suffix: &str| -> Result<usize, LoadError> {
        let key = format!("{arch_name}.{suffix}");
        file.get_u64(&key).map(|v| v as usize).ok_or_else(|| LoadError::Invalid(format!("missing {key}")))
    };
    let (value_heads, inner) = (int("ssm.time_step_rank")?, int("ssm.inner_size")?);
    // The last blocks may be multi-token-prediction heads (they draft; the
    // forward does not run them).
    c.n_layers = c.n_layers.saturating_sub(file.get_u64(&format!("{arch_name}.nextn_predict_layers")).unwrap_or(0) as usize);
    if c.n_layers > MAX_HYBRID_LAYERS {
        return Err(LoadError::Invalid(format!("{arch_name}: {} layers, at most {MAX_HYBRID_LAYERS} are supported", c.n_layers)));
    }
    // Which layers recur: named one by one, or every layer but each
    // `full_attention_interval`-th (llama.cpp's default interval: 4).
    let recurrent = match file.get_array(&format!("{arch_name}.attention.recurrent_layers")) {
        Some(flags) => {
            let flags: Option<Vec<bool>> = flags.iter().take(c.n_layers).map(|v| v.as_bool()).collect();
            match flags {
                Some(f) if f.len() == c.n_layers => f.iter().enumerate().fold(0u128, |m, (l, &r)| m | (r as u128) << l),
                _ => return Err(LoadError::Invalid(format!("{arch_name}.attention.recurrent_layers must hold a boolean per layer"))),
            }
        }
        None => Hybrid::every(c.n_layers, file.get_u64(&format!("{arch_name}.full_attention_interval")).map_or(4, |v| v as usize)),
    };
    c.hybrid = Some(Hybrid {
        recurrent,
        conv_kernel: int("ssm.conv_kernel")?,
        key_heads: int("ssm.group_count")?,
        value_heads,
        key_dim: int("ssm.state_size")?,
        value_dim: inner / value_heads.max(1),
    });
    c.rope_dims = Some(int("rope.dimension_count")?);
    // Only the attention layers have them (layer 0 is recurrent).
    c.qk_norm = true;
    Ok(())
}

// ---- Attention ----

/// An attention layer's weights: the query rows of the file's projection
/// come interleaved per head (its queries, then its gate values); they are
/// split into the fused q/k/v projection and the gate's own.
fn attention_layer(loader: &Loader<'_>, c: &ModelConfig, p: &str) -> Result<(Linear, Linear), LoadError> {
    let (d, hd, hq, hkv) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads);
    let both = loader.dense(&format!("{p}.attn_q.weight"), &[2 * hq * hd, d])?.reshape(&[hq as i32, 2, hd as i32, d as i32])?;
    let half = |i: i32| both.slice(&[0, i, 0, 0], &[hq as i32, i + 1, hd as i32, d as i32])?.reshape(&[(hq * hd) as i32, d as i32]);
    let (q, gate) = (half(0)?, half(1)?);
    let k = loader.dense(&format!("{p}.attn_k.weight"), &[hkv * hd, d])?;
    let v = loader.dense(&format!("{p}.attn_v.weight"), &[hkv * hd, d])?;
    let qkv = mlx::concatenate(&[&q, &k, &v], 0)?;
    let dense = |w: Array| Linear { weight: super::linear::Weight::Dense(w), bias: None };
    Ok((dense(qkv), dense(gate.contiguous()?)))
}

// ---- DeltaNet ----

/// One Gated DeltaNet layer (see the module notes).
pub struct DeltaNet {
    /// The RMS norm of the block's input.
    pub norm: Array,
    /// The convolution's channels, `z`, `beta` and `a` stacked along the
    /// output axis: one matmul per layer.
    pub in_proj: Linear,
    /// `[kernel, channels]`: tap `j` meets the input `kernel - 1 - j` tokens back.
    pub conv: Array,
    /// `[value_heads]`, added to `a` before the softplus.
    pub dt_bias: Array,
    /// `[value_heads]`, negative: the decay's rate (`-exp(A_log)`).
    pub decay_rate: Array,
    /// `[value_dim]`: the per-head RMS norm of the output.
    pub out_norm: Array,
    pub out: Linear,
    pub(super) dims: Hybrid,
    pub(super) eps: f32,
    pub(super) dtype: Dtype,
}

impl DeltaNet {
    /// `h + out(..)` of this layer; `recur` runs each row's share of the
    /// projected `[1, T, width]` input from its state (see [`run`](Self::run)).
    pub(super) fn forward(&self, h: &Array, recur: impl FnOnce(&Array) -> mlx::Result<Array>) -> mlx::Result<Array> {
        let x = self.in_proj.forward_fused(h, Some((&self.norm, self.eps)), None)?;
        let mixed = recur(&x)?;
        self.out.forward_fused(&mixed, None, Some(h))
    }

    /// One row's `[1, n, width]` projected input after `state` (`None`:
    /// the row's first tokens): the gated, normed outputs `[1, n, value
    /// width]`, the state after its last token, and the states after each
    /// count of its tokens in `capture` (ascending, within `1..=n`: a
    /// prompt's block boundaries, for the prefix cache's checkpoints).
    pub(super) fn run(&self, x: &Array, state: Option<&LayerState>, capture: &[usize]) -> mlx::Result<(Array, LayerState, Vec<LayerState>)> {
        let Hybrid { conv_kernel, key_heads, value_heads, key_dim, value_dim, .. } = self.dims;
        let (n, ch, vw) = (x.dim(1) as i32, self.dims.conv_channels() as i32, self.dims.value_width() as i32);
        let (hk, hv, dk, dv, kernel) = (key_heads as i32, value_heads as i32, key_dim as i32, value_dim as i32, conv_kernel as i32);
        let x = x.reshape(&[n, ch + vw + 2 * hv])?;
        let cols = |from: i32, to: i32| x.slice(&[0, from], &[n, to]);
        let (mixed, z, b, a) = (cols(0, ch)?, cols(ch, ch + vw)?, cols(ch + vw, ch + vw + hv)?, cols(ch + vw + hv, ch + vw + 2 * hv)?);
        let beta = b.sigmoid()?; // [n, hv]
        let decay = softplus(&a.add(&self.dt_bias)?)?.multiply(&self.decay_rate)?.exp()?; // [n, hv], in (0, 1]

        // The causal convolution over the carried inputs and these.
        let past = match state {
            Some(s) => s.conv.clone(),
            None => Array::zeros(&[conv_kernel - 1, ch as usize], self.dtype)?,
        };
        let inputs = mlx::concatenate(&[&past, &mixed], 0)?; // [kernel - 1 + n, ch]
                                                             // The convolution's last inputs after `t` tokens, as a buffer of its
                                                             // own (times one): a slice is a view that would keep every input of
                                                             // the step alive as long as the state is kept.
        let one = Array::scalar(1.0, self.dtype)?;
        let conv_after = |t: i32| inputs.slice(&[t, 0], &[t + kernel - 1, ch])?.multiply(&one);
        let mut conv = inputs.slice(&[0, 0], &[n, ch])?.multiply(&self.conv.slice(&[0, 0], &[1, ch])?)?;
        for j in 1..kernel {
            conv = conv.add(&inputs.slice(&[j, 0], &[j + n, ch])?.multiply(&self.conv.slice(&[j, 0], &[j + 1, ch])?)?)?;
        }
        let conv = conv.silu()?;

        let eps = Array::scalar(self.eps, self.dtype)?;
        let l2 = |t: Array| -> mlx::Result<Array> { t.multiply(&t.square()?.sum(&[-1], true)?.add(&eps)?.rsqrt()?) };
        // Value head h reads key head h mod key_heads: the key heads repeat whole.
        let tiled = |t: Array| -> mlx::Result<Array> {
            match hv / hk {
                1 => Ok(t),
                r => mlx::concatenate(&vec![&t; r as usize], 1),
            }
        };
        let q = tiled(l2(conv.slice(&[0, 0], &[n, hk * dk])?.reshape(&[n, hk, dk])?)?.multiply(&Array::scalar(1.0 / (dk as f32).sqrt(), self.dtype)?)?)?;
        let k = tiled(l2(conv.slice(&[0, hk * dk], &[n, 2 * hk * dk])?.reshape(&[n, hk, dk])?)?)?;
        let v = conv.slice(&[0, 2 * hk * dk], &[n, ch])?.reshape(&[n, hv, dv])?;

        // The delta rule, token by token.
        let mut s = match state {
            Some(st) => st.delta.clone(),
            None => Array::zeros(&[value_heads, key_dim, value_dim], self.dtype)?,
        };
        let mut outs = Vec::with_capacity(n as usize);
        let mut captured = Vec::with_capacity(capture.len());
        for t in 0..n {
            let at = |a: &Array, w: i32| a.slice(&[t, 0, 0], &[t + 1, hv, w])?.reshape(&[hv, 1, w]); // [hv, 1, w]
            let per_head = |a: &Array| a.slice(&[t, 0], &[t + 1, hv])?.reshape(&[hv, 1, 1]);
            let (qt, kt, vt) = (at(&q, dk)?, at(&k, dk)?, at(&v, dv)?);
            s = s.multiply(&per_head(&decay)?)?;
            let recalled = kt.matmul(&s)?; // S^T k: [hv, 1, dv]
            let delta = vt.subtract(&recalled)?.multiply(&per_head(&beta)?)?;
            s = s.add(&kt.transpose(&[0, 2, 1])?.matmul(&delta)?)?; // += k d^T
            outs.push(qt.matmul(&s)?); // S^T q: [hv, 1, dv]
            if capture.contains(&(t as usize + 1)) {
                captured.push(LayerState { conv: conv_after(t + 1)?, delta: s.clone() });
            }
        }
        let o = match outs.len() {
            1 => outs.pop().expect("one token"),
            _ => mlx::concatenate(&outs.iter().collect::<Vec<_>>(), 1)?,
        }
        .transpose(&[1, 0, 2])?; // [n, hv, dv]
        let gate = z.reshape(&[n, hv, dv])?.silu()?;
        let o = fast::rms_norm(&o, &self.out_norm, self.eps)?.multiply(&gate)?;
        Ok((o.reshape(&[1, n, vw])?, LayerState { conv: conv_after(n)?, delta: s }, captured))
    }

    pub fn linears(&self) -> [&Linear; 2] {
        [&self.in_proj, &self.out]
    }

    pub(super) fn linears_mut(&mut self) -> [&mut Linear; 2] {
        [&mut self.in_proj, &mut self.out]
    }

    /// Bytes held by its weights.
    pub fn nbytes(&self) -> usize {
        let small = [&self.norm, &self.conv, &self.dt_bias, &self.decay_rate, &self.out_norm].iter().map(|a| a.nbytes()).sum::<usize>();
        small + self.linears().iter().map(|l| l.nbytes()).sum::<usize>()
    }
}

/// `log(1 + e^x)`, without overflow: `max(x, 0) + log(1 + e^-|x|)`.
fn softplus(x: &Array) -> mlx::Result<Array> {
    let zero = Array::scalar(0.0, x.dtype())?;
    let one = Array::scalar(1.0, x.dtype())?;
    x.maximum(&zero)?.add(&x.abs()?.negative()?.exp()?.add(&one)?.log()?)
}

// ---- Model ----

/// Layer `i` of a Qwen3.5 GGUF file, with its MLP (after the norm the
/// file names `post_attention_norm`).
pub(super) fn gguf_layer(loader: &Loader<'_>, c: &ModelConfig, i: usize) -> Result<LoadedLayer, LoadError> {
    let (d, ff) = (c.d_model, c.d_ff);
    let p = format!("blk.{i}");
    let gate = loader.linear(&format!("{p}.ffn_gate"), ff, d)?;
    let up = loader.linear(&format!("{p}.ffn_up"), ff, d)?;
    let mlp = MlpWeights {
        ffn_norm: loader.dense(&format!("{p}.post_attention_norm.weight"), &[d])?,
        gate_up: loader.fuse(&[gate, up], &[&format!("{p}.ffn_gate"), &format!("{p}.ffn_up")])?,
        down: loader.linear(&format!("{p}.ffn_down"), d, ff)?,
    };
    let attn_norm = loader.dense(&format!("{p}.attn_norm.weight"), &[d])?;
    let Some(hy) = c.hybrid.filter(|hy| hy.is_recurrent(i)) else {
        let (qkv, gate) = attention_layer(loader, c, &p)?;
        let hd = c.head_dim;
        let qk_norm = QkNorm { q: loader.dense(&format!("{p}.attn_q_norm.weight"), &[hd])?, k: loader.dense(&format!("{p}.attn_k_norm.weight"), &[hd])? };
        return Ok(LoadedLayer::Attention(LayerWeights {
            attn_norm,
            qk_norm: Some(qk_norm),
            qkv,
            attn_gate: Some(gate),
            attn_out: loader.linear(&format!("{p}.attn_output"), d, c.n_heads * hd)?,
            ffn_norm: mlp.ffn_norm,
            post_attn_norm: None,
            post_ffn_norm: None,
            gate_up: mlp.gate_up,
            down: mlp.down,
        }));
    };
    let (ch, vw, hv) = (hy.conv_channels(), hy.value_width(), hy.value_heads);
    let names = ["attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"].map(|n| format!("{p}.{n}"));
    let parts = [loader.linear(&names[0], ch, d)?, loader.linear(&names[1], vw, d)?, loader.linear(&names[2], hv, d)?, loader.linear(&names[3], hv, d)?];
    let conv = loader.dense(&format!("{p}.ssm_conv1d.weight"), &[ch, hy.conv_kernel])?.transpose(&[1, 0])?.contiguous()?;
    let delta_net = DeltaNet {
        norm: attn_norm,
        in_proj: loader.fuse(&parts, &names.iter().map(String::as_str).collect::<Vec<_>>())?,
        conv,
        dt_bias: loader.dense(&format!("{p}.ssm_dt.bias"), &[hv])?,
        decay_rate: loader.dense(&format!("{p}.ssm_a"), &[hv])?,
        out_norm: loader.dense(&format!("{p}.ssm_norm.weight"), &[hy.value_dim])?,
        out: loader.linear(&format!("{p}.ssm_out"), d, vw)?,
        dims: hy,
        eps: c.rms_eps,
        dtype: loader.dtype(),
    };
    Ok(LoadedLayer::Recurrent(delta_net, mlp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_last_layer_of_a_group_attends() {
        let hy = Hybrid { recurrent: Hybrid::every(12, 4), conv_kernel: 4, key_heads: 16, value_heads: 32, key_dim: 128, value_dim: 128 };
        let attending: Vec<usize> = (0..12).filter(|&l| !hy.is_recurrent(l)).collect();
        assert_eq!(attending, [3, 7, 11]);
        assert_eq!(hy.conv_channels(), 2 * 16 * 128 + 32 * 128);
        assert_eq!(hy.state_values(), 3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128, "conv inputs and a matrix per value head");
        assert!(hy.validate());
        assert!(!Hybrid { value_heads: 24, key_heads: 16, ..hy }.validate(), "value heads must repeat the key heads whole");
    }

    #[test]
    fn softplus_matches_its_definition_without_overflow() {
        mlx::set_default_device(mlx::Device::Cpu).unwrap();
        let x = Array::from_f32(&[-30.0, -1.0, 0.0, 2.0, 100.0], &[5]).unwrap();
        let got = softplus(&x).unwrap().to_vec_f32().unwrap();
        let want = [(-30f64).exp().ln_1p(), (-1f64).exp().ln_1p(), 2f64.ln(), 2f64.exp().ln_1p(), 100.0];
        for (g, w) in got.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6 * (1.0 + w.abs()), "softplus {g} vs {w}");
        }
    }
}
