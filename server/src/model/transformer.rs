//! The decoder forward pass shared by llama and qwen2: RMSNorm, grouped-query
//! attention with RoPE and a preallocated KV cache, SwiGLU feed-forward.
use mlx::fast::{self, Mask};
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
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.attn_norm.nbytes() + l.qkv.nbytes() + l.attn_out.nbytes() + l.ffn_norm.nbytes() + l.gate_up.nbytes() + l.down.nbytes())
            .sum();
        let head = if self.config.tied_embeddings { 0 } else { self.lm_head.nbytes() };
        self.embedding.nbytes() + layers + self.final_norm.nbytes() + head
    }

    /// Bytes of weights one decode step reads: every layer, the final norm and
    /// the LM head (the embedding table itself is only gathered a row at a time).
    pub fn decode_read_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.attn_norm.nbytes() + l.qkv.nbytes() + l.attn_out.nbytes() + l.ffn_norm.nbytes() + l.gate_up.nbytes() + l.down.nbytes())
            .sum();
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
        let c = &self.config;
        let n = ids.dim(-1);
        if n == 0 || n_logits == 0 || n_logits > n {
            return Err(mlx::Error { op: "forward", message: format!("bad token count {n} / logits {n_logits}") });
        }
        let offset = cache.len() as i32;
        cache.reserve(n)?;
        let mut h = self.embedding.take(ids, 0)?; // [1, n, d]

        let (hq, hkv, hd) = (c.n_heads as i32, c.n_kv_heads as i32, c.head_dim as i32);
        let q_width = hq * hd;
        let kv_width = hkv * hd;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let mask = if n > 1 { Mask::Causal } else { Mask::None };

        for (li, layer) in self.layers.iter().enumerate() {
            let x = fast::rms_norm(&h, &layer.attn_norm, c.rms_eps)?;
            let qkv = layer.qkv.forward(&x)?; // [1, n, (hq + 2 hkv) hd]
            let heads = |start: i32, width: i32, count: i32| -> mlx::Result<Array> {
                qkv.slice(&[0, 0, start], &[1, n as i32, start + width])?.reshape(&[1, n as i32, count, hd])?.transpose(&[0, 2, 1, 3])
            };
            let q = heads(0, q_width, hq)?;
            let k = heads(q_width, kv_width, hkv)?;
            let v = heads(q_width + kv_width, kv_width, hkv)?;
            let q = fast::rope(&q, hd, c.rope_traditional, c.rope_theta, 1.0, offset)?;
            let k = fast::rope(&k, hd, c.rope_traditional, c.rope_theta, 1.0, offset)?;
            let (keys, values) = cache.append(li, &k, &v)?;
            let attn = fast::sdpa(&q, &keys, &values, scale, mask)?;
            let attn = attn.transpose(&[0, 2, 1, 3])?.reshape(&[1, n as i32, q_width])?;
            h = h.add(&layer.attn_out.forward(&attn)?)?;

            let x = fast::rms_norm(&h, &layer.ffn_norm, c.rms_eps)?;
            let gu = layer.gate_up.forward(&x)?;
            let ff = c.d_ff as i32;
            let gate = gu.slice(&[0, 0, 0], &[1, n as i32, ff])?;
            let up = gu.slice(&[0, 0, ff], &[1, n as i32, 2 * ff])?;
            h = h.add(&layer.down.forward(&gate.silu()?.multiply(&up)?)?)?;
        }
        cache.advance(n);

        let last = h.slice(&[0, (n - n_logits) as i32, 0], &[1, n as i32, c.d_model as i32])?;
        let last = fast::rms_norm(&last, &self.final_norm, c.rms_eps)?;
        let logits = self.lm_head.forward(&last)?.reshape(&[n_logits as i32, -1])?;
        logits.astype(Dtype::F32)
    }
}
