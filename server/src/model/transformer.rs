//! The decoder forward pass shared by llama and qwen2: RMSNorm, grouped-query
//! attention with RoPE and a preallocated KV cache, SwiGLU feed-forward.
use std::sync::OnceLock;

use mlx::fast::{self, AttentionRow, Mask};
use mlx::{Array, Dtype};

use super::config::ModelConfig;
use super::kv_cache::KvCache;
use super::linear::Linear;

pub struct Layer {
    pub attn_norm: Array,
    /// q, k and v stacked along the output axis: one matmul per layer.
    pub qkv: Linear,
    pub attn_out: Linear,
    pub ffn_norm: Array,
    /// gate and up stacked along the output axis.
    pub gate_up: Linear,
    pub down: Linear,
}

impl Layer {
    /// Bytes held by this layer's weights.
    pub fn nbytes(&self) -> usize {
        self.attn_norm.nbytes() + self.qkv.nbytes() + self.attn_out.nbytes() + self.ffn_norm.nbytes() + self.gate_up.nbytes() + self.down.nbytes()
    }
}

pub struct Transformer {
    pub config: ModelConfig,
    /// Activations and KV cache dtype (float32 on CPU, bfloat16 on GPU).
    pub dtype: Dtype,
    /// `[vocab, d_model]`, dense for row gathers.
    pub embedding: Array,
    pub layers: Vec<Layer>,
    pub final_norm: Array,
    /// The LM head; for tied embeddings it shares the embedding's buffer.
    pub lm_head: Linear,
}

impl Transformer {
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.config.n_layers, self.config.n_kv_heads, self.config.head_dim, self.dtype)
    }

    /// Bytes held by the weights.
    pub fn nbytes(&self) -> usize {
        let layers: usize = self.layers.iter().map(Layer::nbytes).sum();
        let head = if self.config.tied_embeddings { 0 } else { self.lm_head.nbytes() };
        self.embedding.nbytes() + layers + self.final_norm.nbytes() + head
    }

    /// `quantized` when any projection is held quantized, else `dense`.
    pub fn weight_form(&self) -> &'static str {
        let quantized = |l: &Linear| matches!(l.weight, super::linear::Weight::Quantized(_));
        if quantized(&self.lm_head) || self.layers.iter().any(|l| [&l.qkv, &l.attn_out, &l.gate_up, &l.down].into_iter().any(quantized)) {
            "quantized"
        } else {
            "dense"
        }
    }

    /// Bytes of weights one decode step reads: every layer, the final norm and
    /// the LM head (the embedding table itself is only gathered a row at a time).
    pub fn decode_read_bytes(&self) -> usize {
        let layers: usize = self.layers.iter().map(Layer::nbytes).sum();
        layers + self.final_norm.nbytes() + self.lm_head.nbytes()
    }

    /// Runs `tokens` (one sequence) through the model after the cached
    /// positions, appends their keys/values to `cache`, and returns logits
    /// `[n, vocab]` in float32 for the last `n_logits` positions.
    /// The result is lazy; evaluating it also evaluates the cache writes.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, n_logits: usize) -> mlx::Result<Array> {
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        self.forward_ids(&Array::from_i32(&ids, &[1, tokens.len()])?, cache, n_logits)
    }

    /// [`forward`](Self::forward) over token ids already on the device
    /// (`[1, n]` int32), such as the lazily sampled token of the previous step:
    /// the next step's graph can then be built before that token is known.
    pub fn forward_ids(&self, ids: &Array, cache: &mut KvCache, n_logits: usize) -> mlx::Result<Array> {
        let mut rows = [RowInput { ids: ids.clone(), cache, n_logits }];
        Ok(self.forward_batch(&mut rows)?.pop().expect("one row in, one out"))
    }

    /// One forward over several sequences at once: the mixed iteration.
    /// Each row brings its own tokens (a decode token, draft tokens or a
    /// prefill chunk) and KV cache. Their tokens are concatenated for the
    /// per-token work (embedding, projections, MLP), so weights are read once
    /// per step for all rows; attention runs row by row against each row's
    /// own cache at its own position. Returns each row's float32 logits
    /// `[n_logits, vocab]` for its last `n_logits` positions (lazy).
    pub fn forward_batch(&self, rows: &mut [RowInput<'_>]) -> mlx::Result<Vec<Array>> {
        let c = &self.config;
        let lens: Vec<usize> = rows.iter().map(|r| r.ids.dim(-1)).collect();
        if rows.is_empty() || rows.iter().zip(&lens).any(|(r, &n)| n == 0 || r.n_logits == 0 || r.n_logits > n) {
            return Err(mlx::Error { op: "forward", message: format!("bad batch: token counts {lens:?}") });
        }
        let offsets: Vec<i32> = rows.iter().map(|r| r.cache.len() as i32).collect();
        for (r, &n) in rows.iter_mut().zip(&lens) {
            r.cache.reserve(n)?;
        }
        // Start of each row's tokens in the flattened batch.
        let starts: Vec<i32> = lens.iter().scan(0i32, |acc, &n| {
            let s = *acc;
            *acc += n as i32;
            Some(s)
        }).collect();
        let total: i32 = lens.iter().sum::<usize>() as i32;
        let ids = if rows.len() == 1 { rows[0].ids.clone() } else { mlx::concatenate(&rows.iter().map(|r| &r.ids).collect::<Vec<_>>(), 1)? };
        let mut h = self.embedding.take(&ids, 0)?; // [1, T, d]

        let (hq, hkv, hd) = (c.n_heads as i32, c.n_kv_heads as i32, c.head_dim as i32);
        let q_width = hq * hd;
        let kv_width = hkv * hd;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        // The fused CPU path ropes every token of the step at once, each at its own position.
        let positions = if self.use_fused_cpu_attention() {
            let p: Vec<i32> = offsets.iter().zip(&lens).flat_map(|(&o, &n)| o..o + n as i32).collect();
            Some(Array::from_i32(&p, &[p.len()])?)
        } else {
            None
        };

        for (li, layer) in self.layers.iter().enumerate() {
            let x = fast::rms_norm(&h, &layer.attn_norm, c.rms_eps)?;
            let qkv = layer.qkv.forward(&x)?; // [1, T, (hq + 2 hkv) hd]
            let attn = match &positions {
                Some(positions) => self.attention_fused_cpu(li, &qkv, rows, &lens, positions)?,
                None => {
                    let mut outs = Vec::with_capacity(rows.len());
                    for (r, row) in rows.iter_mut().enumerate() {
                        let (s, n) = (starts[r], lens[r] as i32);
                        let heads = |start: i32, width: i32, count: i32| -> mlx::Result<Array> {
                            qkv.slice(&[0, s, start], &[1, s + n, start + width])?.reshape(&[1, n, count, hd])?.transpose(&[0, 2, 1, 3])
                        };
                        let q = fast::rope(&heads(0, q_width, hq)?, hd, c.rope_traditional, c.rope_theta, 1.0, offsets[r])?;
                        let k = fast::rope(&heads(q_width, kv_width, hkv)?, hd, c.rope_traditional, c.rope_theta, 1.0, offsets[r])?;
                        let v = heads(q_width + kv_width, kv_width, hkv)?;
                        let (keys, values) = row.cache.append(li, &k, &v)?;
                        let mask = if n > 1 { Mask::Causal } else { Mask::None };
                        let attn = fast::sdpa(&q, &keys, &values, scale, mask)?;
                        outs.push(attn.transpose(&[0, 2, 1, 3])?.reshape(&[1, n, q_width])?);
                    }
                    if outs.len() == 1 { outs.pop().expect("one row") } else { mlx::concatenate(&outs.iter().collect::<Vec<_>>(), 1)? }
                }
            };
            h = h.add(&layer.attn_out.forward(&attn)?)?;

            let x = fast::rms_norm(&h, &layer.ffn_norm, c.rms_eps)?;
            let gu = layer.gate_up.forward(&x)?;
            let ff = c.d_ff as i32;
            let gate = gu.slice(&[0, 0, 0], &[1, total, ff])?;
            let up = gu.slice(&[0, 0, ff], &[1, total, 2 * ff])?;
            h = h.add(&layer.down.forward(&gate.silu()?.multiply(&up)?)?)?;
        }
        for (r, row) in rows.iter_mut().enumerate() {
            row.cache.advance(lens[r]);
        }

        // Only the positions whose logits are wanted go through the head.
        let d = c.d_model as i32;
        let picks: Vec<Array> = rows
            .iter()
            .enumerate()
            .map(|(r, row)| {
                let end = starts[r] + lens[r] as i32;
                h.slice(&[0, end - row.n_logits as i32, 0], &[1, end, d])
            })
            .collect::<mlx::Result<_>>()?;
        let last = if picks.len() == 1 { picks[0].clone() } else { mlx::concatenate(&picks.iter().collect::<Vec<_>>(), 1)? };
        let last = fast::rms_norm(&last, &self.final_norm, c.rms_eps)?;
        let logits = self.lm_head.forward(&last)?.astype(Dtype::F32)?; // [1, sum n_logits, vocab]
        let vocab = logits.dim(-1) as i32;
        let mut out = Vec::with_capacity(rows.len());
        let mut at = 0i32;
        for row in rows.iter() {
            let k = row.n_logits as i32;
            out.push(logits.slice(&[0, at, 0], &[1, at + k, vocab])?.reshape(&[k, vocab])?);
            at += k;
        }
        Ok(out)
    }
}

impl Transformer {
    /// Whether attention runs through the fused CPU kernels: on the CPU, in
    /// float32, unless `TETHER_CPU_ATTENTION=0` asks for MLX's per-row ops
    /// (kept for comparison and as a fallback).
    fn use_fused_cpu_attention(&self) -> bool {
        static ENABLED: OnceLock<bool> = OnceLock::new();
        let enabled = *ENABLED.get_or_init(|| std::env::var("TETHER_CPU_ATTENTION").map_or(true, |v| v != "0"));
        enabled && self.dtype == Dtype::F32 && mlx::default_device() == mlx::Device::Cpu
    }

    /// Attention of one layer for the whole step on the CPU, in a handful of
    /// ops however many rows there are: one rope over all tokens' queries and
    /// keys (each token at its own position), two cache writes per row, and
    /// one attention over every row's cache. Returns `[1, T, n_heads * head_dim]`.
    fn attention_fused_cpu(&self, layer: usize, qkv: &Array, rows: &mut [RowInput<'_>], lens: &[usize], positions: &Array) -> mlx::Result<Array> {
        let c = &self.config;
        let (hq, hkv, hd) = (c.n_heads as i32, c.n_kv_heads as i32, c.head_dim as i32);
        let total = positions.dim(0) as i32;
        let qk = qkv.slice(&[0, 0, 0], &[1, total, (hq + hkv) * hd])?.reshape(&[total, hq + hkv, 1, hd])?;
        let qk = fast::rope_offsets(&qk, hd, c.rope_traditional, c.rope_theta, 1.0, positions)?;
        let q = qk.slice(&[0, 0, 0, 0], &[total, hq, 1, hd])?;
        let k = qk.slice(&[0, hq, 0, 0], &[total, hq + hkv, 1, hd])?;
        let v = qkv.slice(&[0, 0, (hq + hkv) * hd], &[1, total, (hq + 2 * hkv) * hd])?;
        let mut buffers = Vec::with_capacity(rows.len());
        let mut start = 0;
        for (row, &n) in rows.iter_mut().zip(lens) {
            buffers.push(row.cache.write_step(layer, &k, &v, start, n)?);
            start += n;
        }
        let attention_rows: Vec<AttentionRow<'_>> = rows
            .iter()
            .zip(&buffers)
            .zip(lens)
            .map(|((row, (keys, values)), &n)| AttentionRow { keys, values, n, kv_len: row.cache.len() + n })
            .collect();
        fast::cpu_attention(&q, &attention_rows)
    }
}

/// One sequence's share of a batched forward.
pub struct RowInput<'a> {
    /// `[1, n]` int32 token ids.
    pub ids: Array,
    pub cache: &'a mut KvCache,
    /// How many of the last positions need logits (1 for decode and prefill,
    /// more to verify draft tokens).
    pub n_logits: usize,
}
