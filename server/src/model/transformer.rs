//! The decoder forward pass shared by llama, qwen2, qwen3 and gemma3:
//! RMSNorm, grouped-query attention with RoPE (after per-head query/key
//! norms on qwen3 and gemma3) and a preallocated KV cache, a gated MLP
//! (SwiGLU; GeGLU on gemma3). Gemma 3 adds norms after attention and the
//! MLP, scaled embeddings, and sliding-window layers with a RoPE base of
//! their own, whose caches hold only their window.
use std::sync::OnceLock;

use mlx::fast::{self, AttentionRow, KeyLayout, KvCodes, Mask, RopeTable};
use mlx::{Array, Dtype};

use super::batch_step::{AloneSlot, BatchStep, BatchedRows};
use super::config::{Activation, ModelConfig};
use super::embedding::Embedding;
use super::kv_batch::KvBatch;
use super::kv_cache::{KvCache, KvQuantization};
use super::linear::{Linear, Weight};

/// The RMS-norm weights (`[head_dim]`) of each head's queries and keys (Qwen3).
pub struct QkNorm {
    pub q: Array,
    pub k: Array,
}

pub struct Layer {
    pub attn_norm: Array,
    /// Applied to the projected queries and keys, head by head, before RoPE.
    pub qk_norm: Option<QkNorm>,
    /// q, k and v stacked along the output axis: one matmul per layer.
    pub qkv: Linear,
    pub attn_out: Linear,
    pub ffn_norm: Array,
    /// Norms of the attention's and the MLP's outputs before they join the
    /// residual stream (Gemma 3).
    pub post_attn_norm: Option<Array>,
    pub post_ffn_norm: Option<Array>,
    /// gate and up stacked along the output axis.
    pub gate_up: Linear,
    pub down: Linear,
}

impl Layer {
    /// Bytes held by this layer's weights.
    pub fn nbytes(&self) -> usize {
        let qk = self.qk_norm.as_ref().map_or(0, |n| n.q.nbytes() + n.k.nbytes());
        let post = [&self.post_attn_norm, &self.post_ffn_norm].into_iter().flatten().map(Array::nbytes).sum::<usize>();
        qk + post + self.attn_norm.nbytes() + self.qkv.nbytes() + self.attn_out.nbytes() + self.ffn_norm.nbytes() + self.gate_up.nbytes() + self.down.nbytes()
    }
}

pub struct Transformer {
    pub config: ModelConfig,
    /// Activations and KV cache dtype (float32 on CPU, bfloat16 on GPU).
    pub dtype: Dtype,
    /// The token embedding table (see [`Embedding`]).
    pub embedding: Embedding,
    pub layers: Vec<Layer>,
    pub final_norm: Array,
    /// The LM head; for tied embeddings it shares the embedding's buffer.
    pub lm_head: Linear,
    /// Each RoPE pair's period (`[head_dim / 2]`) when the model scales its
    /// RoPE (Llama 3.x); `None`: plain RoPE from `config.rope_theta`.
    pub rope_periods: Option<Array>,
    /// When and into what codes rows' caches turn (set through
    /// [`set_kv_quantization`](Self::set_kv_quantization), which checks it).
    pub(crate) kv_quantization: Option<KvQuantization>,
}

impl Transformer {
    pub fn new_cache(&self) -> KvCache {
        let c = &self.config;
        // The fused CPU attention reads keys stored in blocks in place.
        let cache = match self.use_fused_cpu_kernels() {
            true => KvCache::with_keys_in_blocks(c.n_layers, c.n_kv_heads, c.head_dim, self.dtype),
            false => KvCache::new(c.n_layers, c.n_kv_heads, c.head_dim, self.dtype),
        };
        cache.with_windows(c.layer_windows()).with_quantization(self.kv_quantization).expect("checked by set_kv_quantization")
    }

    /// Rows' caches turn to codes as `q` says: only where the CPU's
    /// fused attention reads them (float32 on the CPU).
    pub fn set_kv_quantization(&mut self, q: Option<KvQuantization>) -> mlx::Result<()> {
        let c = &self.config;
        let probe = KvCache::with_keys_in_blocks(c.n_layers, c.n_kv_heads, c.head_dim, self.dtype);
        if q.is_some() && !self.use_fused_cpu_kernels() {
            return Err(mlx::Error {
                op: "kv_quantization",
                message: "quantized KV is read by the CPU's fused attention only; this model runs elsewhere".into(),
            });
        }
        probe.with_quantization(q)?;
        self.kv_quantization = q;
        Ok(())
    }

    /// An empty batch of KV slots for this model's running rows.
    pub fn new_kv_batch(&self) -> KvBatch {
        KvBatch::new(self.config.n_layers, self.config.n_kv_heads, self.config.head_dim, self.dtype).with_windows(self.config.layer_windows())
    }

    /// Bytes held by the weights.
    pub fn nbytes(&self) -> usize {
        let layers: usize = self.layers.iter().map(Layer::nbytes).sum();
        // A tied head held dense or quantized like the table is the
        // embedding's own arrays; laid out in panels it is a copy of its own.
        let head_is_embedding = self.config.tied_embeddings
            && matches!((&self.lm_head.weight, &self.embedding), (Weight::Dense(_), Embedding::Dense(_)) | (Weight::Quantized(_), Embedding::Quantized(_)));
        let head = if head_is_embedding { 0 } else { self.lm_head.nbytes() };
        self.embedding.nbytes() + layers + self.final_norm.nbytes() + head
    }

    /// On a CPU that runs the panel kernel, lays every dense float32
    /// projection out in its panels (see `Weight::Panels`), layer by layer so
    /// only one layer's weights are held twice at a time. The tied head gets
    /// a copy of its own; the embedding stays dense for the row gathers.
    pub fn lay_out_for_cpu(&mut self) -> mlx::Result<()> {
        for layer in &mut self.layers {
            for linear in [&mut layer.qkv, &mut layer.attn_out, &mut layer.gate_up, &mut layer.down] {
                linear.lay_out_for_cpu()?;
            }
        }
        self.lm_head.lay_out_for_cpu()
    }

    /// `quantized` when any projection is held quantized, else `dense`.
    pub fn weight_form(&self) -> &'static str {
        let quantized = |l: &Linear| matches!(l.weight, Weight::Quantized(_));
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
        Ok(self.forward_step(None, rows)?.rows)
    }

    /// [`forward_batch`](Self::forward_batch) with, in front of the rows,
    /// the rows whose caches live in a [`KvBatch`] (decoding, verifying or
    /// reading their prompt): their tokens come first in the flattened
    /// batch (see [`BatchStep`]), and each layer attends for all of them at
    /// once (see [`attention_batched`](Self::attention_batched)).
    pub fn forward_step(&self, mut batched: Option<BatchedRows<'_>>, rows: &mut [RowInput<'_>]) -> mlx::Result<StepLogits> {
        let c = &self.config;
        let lens: Vec<usize> = rows.iter().map(|r| r.ids.dim(-1)).collect();
        if (rows.is_empty() && batched.is_none()) || rows.iter().zip(&lens).any(|(r, &n)| n == 0 || r.n_logits == 0 || r.n_logits > n) {
            return Err(mlx::Error { op: "forward", message: format!("bad batch: token counts {lens:?}") });
        }
        let batch_step = match &mut batched {
            Some(b) => Some(BatchStep::prepare(b, c.n_heads)?),
            None => None,
        };
        let batch_tokens = batch_step.as_ref().map_or(0, |b| b.tokens) as i32;
        let offsets: Vec<i32> = rows.iter().map(|r| r.cache.len() as i32).collect();
        for (r, &n) in rows.iter_mut().zip(&lens) {
            r.cache.reserve(n)?;
        }
        // Start of each row's tokens in the flattened batch, after the batched rows' tokens.
        let starts: Vec<i32> = lens
            .iter()
            .scan(batch_tokens, |acc, &n| {
                let s = *acc;
                *acc += n as i32;
                Some(s)
            })
            .collect();
        let total: i32 = batch_tokens + lens.iter().sum::<usize>() as i32;
        let mut all_ids: Vec<Array> = Vec::with_capacity(rows.len() + 1);
        if let Some(step) = &batch_step {
            all_ids.push(step.ids.clone());
        }
        all_ids.extend(rows.iter().map(|r| r.ids.clone()));
        let ids = if all_ids.len() == 1 { all_ids.pop().expect("one") } else { mlx::concatenate(&all_ids.iter().collect::<Vec<_>>(), 1)? };
        let mut h = self.embedding.rows(&ids, self.dtype)?; // [1, T, d]
        if c.embedding_scale != 1.0 {
            h = h.multiply(&Array::scalar(c.embedding_scale, self.dtype)?)?;
        }
        // A row's window layers all attend over the same positions: on MLX's
        // attention path its window mask is built once per step (per row
        // attending on its own, batched slots alone included).
        let mut alone_masks: Vec<Option<Array>> = vec![None; batch_step.as_ref().map_or(0, |s| s.alone.len())];
        let mut row_masks: Vec<Option<Array>> = vec![None; rows.len()];

        let (hq, hkv, hd) = (c.n_heads as i32, c.n_kv_heads as i32, c.head_dim as i32);
        // The fused CPU path turns every row token of the step by one table per RoPE, each at its own position.
        let mut rope_tables = if self.use_fused_cpu_kernels() && !rows.is_empty() {
            let p: Vec<i32> = offsets.iter().zip(&lens).flat_map(|(&o, &n)| o..o + n as i32).collect();
            Some(RopeTables::new(Array::from_i32(&p, &[p.len()])?))
        } else {
            None
        };

        for (li, layer) in self.layers.iter().enumerate() {
            let qkv = layer.qkv.forward_fused(&h, Some((&layer.attn_norm, c.rms_eps)), None)?; // [1, T, (hq + 2 hkv) hd]
            let qkv = match &layer.qk_norm {
                Some(norm) => self.norm_queries_and_keys(&qkv, norm, total)?,
                None => qkv,
            };
            let mut parts: Vec<Array> = Vec::with_capacity(rows.len() + 1);
            if let (Some(b), Some(step)) = (&mut batched, &batch_step) {
                let mine = qkv.slice(&[0, 0, 0], &[1, batch_tokens, (hq + 2 * hkv) * hd])?;
                let mut outputs = Vec::with_capacity(1 + step.alone.len());
                if step.shared {
                    outputs.push(self.attention_batched(li, &step.to_shared(&mine)?, b.kv, step)?);
                }
                for (alone, window_mask) in step.alone.iter().zip(&mut alone_masks) {
                    let (at, n) = (alone.start as i32, alone.queries as i32);
                    let rows = mine.slice(&[0, at, 0], &[1, at + n, (hq + 2 * hkv) * hd])?;
                    outputs.push(match &alone.mask {
                        Some(mask) => self.attention_alone(li, &rows, b.kv, alone, mask)?,
                        // A batch with window layers: each attends over its own keys.
                        None => {
                            let first = b.kv.first(li, alone.slot);
                            self.attention_own(li, &rows, (alone.offset, first), window_mask, |k, v| b.kv.write_slot(li, alone.slot, alone.offset, k, v))?
                        }
                    });
                }
                parts.push(step.to_flat(&outputs)?);
            }
            match &mut rope_tables {
                Some(rope_tables) => {
                    let mine = if batch_tokens == 0 { qkv.clone() } else { qkv.slice(&[0, batch_tokens, 0], &[1, total, (hq + 2 * hkv) * hd])? };
                    parts.push(self.attention_fused_cpu(li, c.layer_window(li), &mine, rows, &lens, rope_tables)?);
                }
                None => {
                    for (r, (row, mask)) in rows.iter_mut().zip(&mut row_masks).enumerate() {
                        let (s, n) = (starts[r], lens[r] as i32);
                        let mine = qkv.slice(&[0, s, 0], &[1, s + n, (hq + 2 * hkv) * hd])?;
                        let first = row.cache.first(li);
                        parts.push(self.attention_own(li, &mine, (offsets[r] as usize, first), mask, |k, v| row.cache.append(li, k, v))?);
                    }
                }
            }
            let attn = if parts.len() == 1 { parts.pop().expect("one part") } else { mlx::concatenate(&parts.iter().collect::<Vec<_>>(), 1)? };
            h = self.residual(&h, &layer.attn_out, &attn, &layer.post_attn_norm)?;
            let gu = layer.gate_up.forward_fused(&h, Some((&layer.ffn_norm, c.rms_eps)), None)?;
            h = self.residual(&h, &layer.down, &self.gated(&gu, total)?, &layer.post_ffn_norm)?;
        }
        for (r, row) in rows.iter_mut().enumerate() {
            row.cache.advance(lens[r]);
        }
        if let (Some(b), Some(step)) = (&mut batched, &batch_step) {
            b.kv.advance(&step.real);
        }

        // Only the positions whose logits are wanted go through the head:
        // a batched slot's last `logits` real tokens, a row's last n_logits.
        let d = c.d_model as i32;
        let mut spans: Vec<(i32, i32)> = Vec::new();
        if let (Some(b), Some(step)) = (&batched, &batch_step) {
            spans.extend(step.logit_spans(&b.logits).map(|(at, k)| (at as i32, k as i32)));
        }
        spans.extend(rows.iter().enumerate().map(|(r, row)| (starts[r] + lens[r] as i32 - row.n_logits as i32, row.n_logits as i32)));
        let picks: Vec<Array> = spans.iter().filter(|(_, k)| *k > 0).map(|&(at, k)| h.slice(&[0, at, 0], &[1, at + k, d])).collect::<mlx::Result<_>>()?;
        if picks.is_empty() {
            // Only prompt chunks that do not end their prompts: no head at all.
            return Ok(StepLogits { batched: spans.iter().map(|_| None).collect(), rows: Vec::new() });
        }
        let last = if picks.len() == 1 { picks[0].clone() } else { mlx::concatenate(&picks.iter().collect::<Vec<_>>(), 1)? };
        let logits = self.lm_head.forward_fused(&last, Some((&self.final_norm, c.rms_eps)), None)?.astype(Dtype::F32)?; // [1, sum of wanted, vocab]
        let vocab = logits.dim(-1) as i32;
        let mut at = 0i32;
        let mut split = spans.iter().map(|&(_, k)| {
            if k == 0 {
                return Ok(None);
            }
            let part = logits.slice(&[0, at, 0], &[1, at + k, vocab])?.reshape(&[k, vocab])?;
            at += k;
            Ok(Some(part))
        });
        let batched_logits = match &batch_step {
            Some(step) => (&mut split).take(step.slots).collect::<mlx::Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        let rows_logits = split.map(|l| l.map(|l| l.expect("rows always want logits"))).collect::<mlx::Result<Vec<_>>>()?;
        Ok(StepLogits { batched: batched_logits, rows: rows_logits })
    }
}

impl Transformer {
    /// Attention of one layer for one sequence over its own keys: `qkv` is
    /// its `[1, n, ..]` rows at positions `offset ..`; `write` stores the new
    /// keys and values and returns all those held, positions `first ..`
    /// (`first` > 0 only on a sliding-window layer). `window_mask` keeps the
    /// row's window mask for its other window layers this step. Returns
    /// `[1, n, n_heads * head_dim]`.
    fn attention_own<W>(&self, layer: usize, qkv: &Array, (offset, first): (usize, usize), window_mask: &mut Option<Array>, write: W) -> mlx::Result<Array>
    where
        W: FnOnce(&Array, &Array) -> mlx::Result<(Array, Array)>,
    {
        let c = &self.config;
        let (hq, hd) = (c.n_heads as i32, c.head_dim as i32);
        let n = qkv.dim(1) as i32;
        let (q, k, v) = self.rotated_heads(layer, qkv, offset)?;
        let (keys, values) = write(&k, &v)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let out = match c.layer_window(layer) {
            // Causal: query i sits at offset + i and sees keys up to there.
            None => fast::sdpa(&q, &keys, &values, scale, if n > 1 { Mask::Causal } else { Mask::None })?,
            Some(window) => {
                if window_mask.is_none() {
                    *window_mask = Some(self.window_mask(offset, n as usize, first, window)?);
                }
                fast::sdpa(&q, &keys, &values, scale, Mask::Array(window_mask.as_ref().expect("built above")))?
            }
        };
        out.transpose(&[0, 2, 1, 3])?.reshape(&[1, n, hq * hd])
    }

    /// One sequence's `[1, n, ..]` rows at positions `offset ..` split into
    /// queries, keys and values, `[1, heads, n, head_dim]`, the first two rotated.
    fn rotated_heads(&self, layer: usize, qkv: &Array, offset: usize) -> mlx::Result<(Array, Array, Array)> {
        let c = &self.config;
        let (hq, hkv, hd) = (c.n_heads as i32, c.n_kv_heads as i32, c.head_dim as i32);
        let n = qkv.dim(1) as i32;
        let heads = |start: i32, count: i32| -> mlx::Result<Array> {
            qkv.slice(&[0, 0, start * hd], &[1, n, (start + count) * hd])?.reshape(&[1, n, count, hd])?.transpose(&[0, 2, 1, 3])
        };
        let rope = |a: &Array| self.rope(layer, a, offset as i32);
        Ok((rope(&heads(0, hq)?)?, rope(&heads(hq, hkv)?)?, heads(hq + hkv, hkv)?))
    }

    /// Attention of one layer for a batched slot's chunk on its own (see
    /// [`BatchStep`]): `qkv` is its `[1, queries, ..]` rows, its real tokens
    /// first, at positions `alone.offset ..`. Only the real tokens' keys and
    /// values are written; every query attends over the slot's whole
    /// capacity under `mask`, so the shape is (queries, capacity class)
    /// whatever the chunk's end (a padding query's output is dropped).
    /// Returns `[1, queries, n_heads * head_dim]`.
    fn attention_alone(&self, layer: usize, qkv: &Array, kv: &mut KvBatch, alone: &AloneSlot, mask: &Array) -> mlx::Result<Array> {
        let c = &self.config;
        let (hq, hkv, hd) = (c.n_heads as i32, c.n_kv_heads as i32, c.head_dim as i32);
        let n = qkv.dim(1) as i32;
        let (q, k, v) = self.rotated_heads(layer, qkv, alone.offset)?;
        let real = alone.tokens as i32;
        let (k, v) = if real < n { (k.slice(&[0, 0, 0, 0], &[1, hkv, real, hd])?, v.slice(&[0, 0, 0, 0], &[1, hkv, real, hd])?) } else { (k, v) };
        let (keys, values) = kv.write_slot_whole(layer, alone.slot, alone.offset, &k, &v)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let out = fast::sdpa(&q, &keys, &values, scale, Mask::Array(mask))?;
        out.transpose(&[0, 2, 1, 3])?.reshape(&[1, n, hq * hd])
    }

    /// Runs one layer's [`attention_alone`](Self::attention_alone) once, on
    /// zeros, for `queries` queries over a slot of `capacity` keys (a
    /// [`capacity_class`](super::kv_batch::capacity_class)), so that what MLX
    /// sets up for the shape at first use is done before serving.
    pub fn warm_alone_attention(&self, queries: usize, capacity: usize) -> mlx::Result<()> {
        let c = &self.config;
        let mut kv = KvBatch::new(1, c.n_kv_heads, c.head_dim, self.dtype);
        kv.admit(&KvCache::new(1, c.n_kv_heads, c.head_dim, self.dtype), capacity)?;
        let mask = kv.alone_mask(0, queries)?;
        let alone = AloneSlot { slot: 0, start: 0, tokens: queries, queries, offset: 0, mask: None };
        let width = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim;
        let qkv = Array::full(&[1, queries, width], 0.0, self.dtype)?;
        let out = self.attention_alone(0, &qkv, &mut kv, &alone, &mask)?;
        mlx::eval(&[&out])
    }

    /// Runs the shared attention ([`attention_batched`](Self::attention_batched))
    /// of one layer once, on zeros, for `slots` slots (a power of two) of
    /// `n` queries each over `capacity` keys (a [`capacity_class`](super::kv_batch::capacity_class)): the
    /// same ops on the same shapes and layouts as a step, so that whatever
    /// MLX sets up for a shape at first use is done before serving.
    pub fn warm_shared_attention(&self, slots: usize, n: usize, capacity: usize) -> mlx::Result<()> {
        let c = &self.config;
        let mut kv = KvBatch::new(1, c.n_kv_heads, c.head_dim, self.dtype);
        let empty = KvCache::new(1, c.n_kv_heads, c.head_dim, self.dtype);
        for _ in 0..slots {
            kv.admit(&empty, capacity)?;
        }
        let mut rows = BatchedRows { kv: &mut kv, tokens: vec![vec![0; n]; slots], logits: vec![0; slots], shared_scores: usize::MAX };
        let step = BatchStep::prepare(&mut rows, c.n_heads)?;
        let width = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim;
        // `full` materialises its value, so the rows are laid out as a projection's output.
        let qkv = Array::full(&[1, slots * n, width], 0.0, self.dtype)?;
        let out = self.attention_batched(0, &qkv, rows.kv, &step)?;
        mlx::eval(&[&out])
    }

    /// The shared attention of one layer for every slot of a [`KvBatch`]:
    /// `qkv` is `[1, slots * n, ..]`, slot-major. One rope each for queries
    /// and keys (each slot at its own offset), one scatter each into the key
    /// and value buffers, one masked attention. Returns `[1, slots * n, n_heads * head_dim]`.
    fn attention_batched(&self, layer: usize, qkv: &Array, kv: &mut KvBatch, step: &BatchStep) -> mlx::Result<Array> {
        let c = &self.config;
        let (hq, hkv, hd) = (c.n_heads as i32, c.n_kv_heads as i32, c.head_dim as i32);
        let (slots, n) = (step.slots as i32, step.n as i32);
        let x = qkv.reshape(&[slots, n, hq + 2 * hkv, hd])?;
        let heads = |from: i32, to: i32| x.slice(&[0, 0, from, 0], &[slots, n, to, hd])?.transpose(&[0, 2, 1, 3]);
        let rope = |a: &Array| self.rope_at(layer, a, &step.offsets);
        let q = rope(&heads(0, hq)?)?;
        let k = rope(&heads(hq, hq + hkv)?)?;
        let v = heads(hq + hkv, hq + 2 * hkv)?;
        // Window layers index each slot's keys from its first position.
        let (positions, mask) = match (&step.window, kv.window(layer)) {
            (Some((positions, mask)), Some(_)) => (positions, mask),
            _ => (&step.positions, &step.mask),
        };
        let (keys, values) = kv.write(layer, &k, &v, positions)?;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let out = fast::sdpa(&q, &keys, &values, scale, Mask::Array(mask))?; // [slots, hq, n, hd]
        out.transpose(&[0, 2, 1, 3])?.reshape(&[1, slots * n, hq * hd])
    }
}

impl Transformer {
    /// The additive mask of `n` queries at positions `offset ..` over the
    /// keys of positions `first .. offset + n` on a layer of `window`:
    /// each sees itself and the `window - 1` positions before it.
    fn window_mask(&self, offset: usize, n: usize, first: usize, window: usize) -> mlx::Result<Array> {
        let keys = offset + n - first;
        let mask: Vec<f32> = (0..n * keys)
            .map(|x| (offset + x / keys, first + x % keys))
            .map(|(query, key)| if key <= query && key + window > query { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        Array::from_f32(&mask, &[1, 1, n, keys])?.astype(self.dtype)
    }

    /// How layer `layer` turns its heads: a sliding-window layer at its own
    /// base when the model gives its local layers one (Gemma 3), else by
    /// per-pair periods when the model scales its RoPE (Llama 3.x), else at
    /// the model's base.
    fn layer_rope(&self, layer: usize) -> Rope<'_> {
        match (self.config.sliding_window.filter(|w| w.is_local(layer)), &self.rope_periods) {
            (Some(window), _) => Rope::Base(window.local_rope_theta),
            (None, Some(periods)) => Rope::Periods(periods),
            (None, None) => Rope::Base(self.config.rope_theta),
        }
    }

    /// RoPE over whole heads from position `offset` on, as layer `layer` turns it.
    fn rope(&self, layer: usize, a: &Array, offset: i32) -> mlx::Result<Array> {
        let (dims, traditional) = (self.config.head_dim as i32, self.config.rope_traditional);
        match self.layer_rope(layer) {
            Rope::Base(theta) => fast::rope(a, dims, traditional, theta, 1.0, offset),
            Rope::Periods(periods) => fast::rope_freqs(a, dims, traditional, 1.0, offset, periods),
        }
    }

    /// RoPE with one starting position per row of `a` (`offsets`: int32).
    fn rope_at(&self, layer: usize, a: &Array, offsets: &Array) -> mlx::Result<Array> {
        let (dims, traditional) = (self.config.head_dim as i32, self.config.rope_traditional);
        match self.layer_rope(layer) {
            Rope::Base(theta) => fast::rope_offsets(a, dims, traditional, theta, 1.0, offsets),
            Rope::Periods(periods) => fast::rope_offsets_freqs(a, dims, traditional, 1.0, offsets, periods),
        }
    }

    /// Qwen3's per-head RMS norms on the fused projection's output
    /// `[1, total, (hq + 2 hkv) hd]`: queries with `norm.q`, keys with
    /// `norm.k`, values untouched. Done once here, before the rows split into
    /// the attention paths, so every path sees normed queries and keys.
    fn norm_queries_and_keys(&self, qkv: &Array, norm: &QkNorm, total: i32) -> mlx::Result<Array> {
        let c = &self.config;
        let (hq, hkv, hd) = (c.n_heads as i32, c.n_kv_heads as i32, c.head_dim as i32);
        let heads = qkv.reshape(&[1, total, hq + 2 * hkv, hd])?;
        let q = fast::rms_norm(&heads.slice(&[0, 0, 0, 0], &[1, total, hq, hd])?, &norm.q, c.rms_eps)?;
        let k = fast::rms_norm(&heads.slice(&[0, 0, hq, 0], &[1, total, hq + hkv, hd])?, &norm.k, c.rms_eps)?;
        let v = heads.slice(&[0, 0, hq + hkv, 0], &[1, total, hq + 2 * hkv, hd])?;
        mlx::concatenate(&[&q, &k, &v], 2)?.reshape(&[1, total, (hq + 2 * hkv) * hd])
    }

    /// `act(gate) * up` of the fused gate/up projection's output
    /// `[1, total, 2 d_ff]`. SwiGLU runs in one vectorised pass on the CPU
    /// in float32 (the same switch as the fused attention), MLX's ops
    /// elsewhere; GeGLU (tanh GELU) on MLX's ops.
    fn gated(&self, gate_up: &Array, total: i32) -> mlx::Result<Array> {
        let activation = self.config.activation;
        if activation == Activation::Silu && self.use_fused_cpu_kernels() {
            return fast::cpu_swiglu(gate_up);
        }
        let ff = self.config.d_ff as i32;
        let gate = gate_up.slice(&[0, 0, 0], &[1, total, ff])?;
        let up = gate_up.slice(&[0, 0, ff], &[1, total, 2 * ff])?;
        match activation {
            Activation::Silu => gate.silu()?.multiply(&up),
            Activation::GeluTanh => self.gelu_tanh(&gate)?.multiply(&up),
        }
    }

    /// GELU's tanh approximation, `x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    fn gelu_tanh(&self, x: &Array) -> mlx::Result<Array> {
        let k = |v: f64| Array::scalar(v as f32, self.dtype);
        let cubic = x.multiply(&x.square()?)?.multiply(&k(0.044715)?)?;
        let inner = x.add(&cubic)?.multiply(&k((2.0 / std::f64::consts::PI).sqrt())?)?;
        x.multiply(&k(0.5)?)?.multiply(&inner.tanh()?.add(&k(1.0)?)?)
    }

    /// `h + post_norm(proj(x))`: the residual add rides in the projection's
    /// node where no norm comes between (see [`Linear::forward_fused`]).
    fn residual(&self, h: &Array, proj: &Linear, x: &Array, post_norm: &Option<Array>) -> mlx::Result<Array> {
        match post_norm {
            None => proj.forward_fused(x, None, Some(h)),
            Some(_) => h.add(&self.post_norm(proj.forward(x)?, post_norm)?),
        }
    }

    /// `x` RMS-normed by `norm` when the layer has that norm, else `x`.
    fn post_norm(&self, x: Array, norm: &Option<Array>) -> mlx::Result<Array> {
        match norm {
            Some(w) => fast::rms_norm(&x, w, self.config.rms_eps),
            None => Ok(x),
        }
    }

    /// Whether attention (and SwiGLU) run through the fused CPU kernels: on
    /// the CPU, in float32, unless `TETHER_CPU_ATTENTION=0` asks for MLX's
    /// ops (kept for comparison and as a fallback).
    fn use_fused_cpu_kernels(&self) -> bool {
        static ENABLED: OnceLock<bool> = OnceLock::new();
        let enabled = *ENABLED.get_or_init(|| std::env::var("TETHER_CPU_ATTENTION").map_or(true, |v| v != "0"));
        enabled && self.dtype == Dtype::F32 && mlx::default_device() == mlx::Device::Cpu
    }

    /// Attention of one layer for the whole step on the CPU, as one graph
    /// node however many rows there are ([`fast::cpu_layer_attention`]):
    /// RoPE on all tokens' queries and keys (each token at its own position,
    /// by the step's table), each row's cache writes, and the attention over
    /// every row's cache. Returns `[1, T, n_heads * head_dim]`.
    fn attention_fused_cpu(
        &self,
        layer: usize,
        window: Option<usize>,
        qkv: &Array,
        rows: &mut [RowInput<'_>],
        lens: &[usize],
        rope_tables: &mut RopeTables,
    ) -> mlx::Result<Array> {
        let c = &self.config;
        let mut taken = Vec::with_capacity(rows.len());
        for (row, &n) in rows.iter_mut().zip(lens) {
            match row.cache.take_for_write(layer, n) {
                Ok(buffers) => taken.push(buffers),
                Err(e) => {
                    put_back_all(rows, layer, taken);
                    return Err(e);
                }
            }
        }
        let keys = rows.first().map_or(KeyLayout::Positions, |r| r.cache.key_layout());
        let attention_rows: Vec<AttentionRow<'_>> = rows
            .iter()
            .zip(&taken)
            .zip(lens)
            .map(|((row, (keys, values)), &n)| AttentionRow { keys, values, n, kv_len: row.cache.len() + n, first: row.cache.first(layer) })
            .collect();
        let built = if rows.iter().any(|r| r.cache.key_layout() != keys) {
            Err(mlx::Error { op: "forward", message: "rows of one step store their keys differently".into() })
        } else {
            // Rows in codes (past their quantization's start) beside rows in float32.
            let codes = self.kv_quantization.map_or(KvCodes::Float, |q| q.codes());
            rope_tables.table(self, layer).and_then(|table| {
                let rope = RopeTable { table, traditional: c.rope_traditional };
                fast::cpu_layer_attention(qkv, rope, c.n_heads, &attention_rows, keys, window, codes)
            })
        };
        drop(attention_rows);
        match built {
            Ok((attention, updated)) => {
                drop(taken); // the node now holds the only references: its writes can be in place
                put_back_all(rows, layer, updated);
                Ok(attention)
            }
            Err(e) => {
                put_back_all(rows, layer, taken);
                Err(e)
            }
        }
    }
}

/// Hands each row its layer `layer` buffers back (see [`KvCache::take_for_write`]).
fn put_back_all(rows: &mut [RowInput<'_>], layer: usize, buffers: Vec<(Array, Array)>) {
    for (row, (keys, values)) in rows.iter_mut().zip(buffers) {
        row.cache.put_back(layer, keys, values);
    }
}

/// The RoPE tables ([`RopeTable`]) of one step's row tokens, one per way
/// its layers turn (a model has one, or two when its window layers turn at
/// a base of their own), each built at its first layer: a few graph nodes a
/// step instead of MLX's RoPE in every layer.
struct RopeTables {
    /// `[T]` int32: each row token's position.
    positions: Array,
    built: Vec<(RopeKey, Array)>,
}

/// Which RoPE a table is for: a base's bits, or the periods' address.
#[derive(PartialEq)]
enum RopeKey {
    Base(u32),
    Periods(*const Array),
}

impl RopeTables {
    fn new(positions: Array) -> RopeTables {
        RopeTables { positions, built: Vec::new() }
    }

    /// Layer `layer`'s table, `[T, head_dim]`: MLX's RoPE of a unit head
    /// (see [`RopeTable`]) at every token's position.
    fn table(&mut self, model: &Transformer, layer: usize) -> mlx::Result<&Array> {
        let key = match model.layer_rope(layer) {
            Rope::Base(theta) => RopeKey::Base(theta.to_bits()),
            Rope::Periods(periods) => RopeKey::Periods(periods),
        };
        let at = match self.built.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                let (dim, tokens) = (model.config.head_dim, self.positions.dim(0));
                let traditional = model.config.rope_traditional;
                // 1 at the first feature of each rotated pair, 0 at the second.
                let unit: Vec<f32> = (0..dim).map(|d| if traditional { ((d + 1) % 2) as f32 } else { (d < dim / 2) as u8 as f32 }).collect();
                let heads = Array::from_f32(&unit, &[1, 1, 1, dim])?.broadcast_to(&[tokens as i32, 1, 1, dim as i32])?;
                let table = model.rope_at(layer, &heads, &self.positions)?.reshape(&[tokens as i32, dim as i32])?;
                self.built.push((key, table));
                self.built.len() - 1
            }
        };
        Ok(&self.built[at].1)
    }
}

/// How a layer's RoPE turns: at a base (`base^(2i / head_dim)` periods) or
/// by given per-pair periods.
enum Rope<'a> {
    Base(f32),
    Periods(&'a Array),
}

/// A step's float32 logits (lazy): per batched slot (`None` where it wanted
/// none) `[logits, vocab]`, and per row `[n_logits, vocab]`.
pub struct StepLogits {
    pub batched: Vec<Option<Array>>,
    pub rows: Vec<Array>,
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
