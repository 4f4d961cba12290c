//! The model every family loads into: token embedding, a stack of
//! [`Block`]s (`layers.rs`), a final norm and the LM head, and the one
//! forward that runs a step's rows through them.
//!
//! The families (`llama.rs`, `qwen2.rs`, `qwen3.rs`, `gemma3.rs`) differ
//! only in the parts their blocks are built with, set at load; the
//! attention backend (the CPU's kernel or MLX's ops) is picked at load too
//! (`attention.rs`). So [`Transformer::forward_step`] reads as mlx-lm's
//! `Model.__call__`: embed, each block, norm, head.
use std::rc::Rc;

use mlx::fast::KvCodes;
use mlx::{Array, Dtype};

use super::attention::{attention_alone, attention_batched, AttentionBackend, StepAttention};
use super::batch_step::{AloneSlot, BatchStep, BatchedRows};
use super::config::{Activation, ModelConfig};
use super::embedding::Embedding;
use super::gemma3;
use super::gemma4::{self, PerLayerInput};
use super::gpu::GpuDecode;
use super::kv_batch::KvBatch;
use super::kv_cache::{KvCache, KvQuantization};
use super::layers::{Attention, Block, Gate, Heads, Mixer, Mlp, Rope, RopeFreqs};
use super::linear::{Linear, Weight};
use super::qwen3::QkNorm;
use super::qwen35::DeltaNet;

/// One layer's weights as a loader reads them, before
/// [`Transformer::assemble`] builds its [`Block`].
pub(super) struct LayerWeights {
    pub attn_norm: Array,
    pub qk_norm: Option<QkNorm>,
    pub qkv: Linear,
    /// The attention output's gate (Qwen3.5).
    pub attn_gate: Option<Linear>,
    pub attn_out: Linear,
    pub ffn_norm: Array,
    pub post_attn_norm: Option<Array>,
    pub post_ffn_norm: Option<Array>,
    pub gate_up: Linear,
    pub down: Linear,
}

/// A layer as a loader reads it: an attention layer's weights, or a
/// recurrent layer's mixer built whole beside its MLP's weights, or a
/// layer its family builds whole (Gemma 4's, whose layers differ).
pub(super) enum LoadedLayer {
    Attention(LayerWeights),
    Recurrent(DeltaNet, MlpWeights),
    Built(Box<Block>),
}

impl LoadedLayer {
    /// Its projections, to materialise as it loads.
    pub fn linears(&self) -> Vec<&Linear> {
        match self {
            LoadedLayer::Attention(w) => [&w.qkv, &w.attn_out, &w.gate_up, &w.down].into_iter().chain(w.attn_gate.as_ref()).collect(),
            LoadedLayer::Recurrent(d, m) => d.linears().into_iter().chain([&m.gate_up, &m.down]).collect(),
            LoadedLayer::Built(b) => b.linears(),
        }
    }
}

/// A recurrent layer's MLP weights.
pub(super) struct MlpWeights {
    pub ffn_norm: Array,
    pub gate_up: Linear,
    pub down: Linear,
}

pub struct Transformer {
    pub config: ModelConfig,
    /// Activations and KV cache dtype (float32 on CPU, bfloat16 on GPU).
    pub dtype: Dtype,
    /// The token embedding table (see [`Embedding`]).
    pub embedding: Embedding,
    pub layers: Vec<Block>,
    pub final_norm: Array,
    /// The LM head; for tied embeddings it shares the embedding's buffer.
    pub lm_head: Linear,
    /// How rows with caches of their own attend (picked at load).
    pub backend: AttentionBackend,
    /// When and into what codes rows' caches turn (set through
    /// [`set_kv_quantization`](Self::set_kv_quantization), which checks it).
    pub(crate) kv_quantization: Option<KvQuantization>,
    /// The decode step in kernels of our own, on a CUDA GPU where the model
    /// fits them (set at load, see `models/gpu`).
    pub gpu_decode: Option<GpuDecode>,
    /// Gemma 4's per-layer input table, where the model has one (set at load).
    pub(super) per_layer_input: Option<PerLayerInput>,
}

impl Transformer {
    /// Builds the model from a loader's weights: each layer's RoPE (a
    /// window layer's at its own base when the model gives its local layers
    /// one, else by per-pair `rope_periods` when the model scales its RoPE,
    /// else at the model's base), window and gate, and the attention
    /// backend for this device and dtype.
    pub(super) fn assemble(
        config: ModelConfig,
        dtype: Dtype,
        embedding: Embedding,
        layers: Vec<LoadedLayer>,
        final_norm: Array,
        lm_head: Linear,
        rope_periods: Option<Array>,
    ) -> Transformer {
        let c = &config;
        // The CPU kernel's RoPE tables turn whole heads, and its rows know
        // nothing of recurrent state nor of layers of other shapes or
        // borrowed KV: a hybrid model's and Gemma 4's rows attend by MLX's ops.
        let backend = match c.hybrid.is_some() || c.layer_plan.is_some() {
            true => AttentionBackend::Mlx,
            false => AttentionBackend::pick(dtype),
        };
        let rope = |freqs| Rc::new(Rope { freqs, dims: c.rope_dims.unwrap_or(c.head_dim) as i32, traditional: c.rope_traditional });
        let global = rope(match rope_periods {
            Some(periods) => RopeFreqs::Periods(periods),
            None => RopeFreqs::Base(c.rope_theta),
        });
        let local = c.sliding_window.map(|w| rope(RopeFreqs::Base(w.local_rope_theta)));
        let gate = match (c.activation, backend) {
            (Activation::Silu, AttentionBackend::CpuKernel) => Gate::SwiGluCpu,
            (Activation::Silu, AttentionBackend::Mlx) => Gate::SwiGlu,
            (Activation::GeluTanh, _) => Gate::GeGlu,
        };
        let heads = Heads { q: c.n_heads as i32, kv: c.n_kv_heads as i32, dim: c.head_dim as i32 };
        let blocks = layers
            .into_iter()
            .enumerate()
            .map(|(i, layer)| {
                let mlp = |norm, gate_up, down, post_norm| Mlp { norm, gate_up, down, post_norm, gate, d_ff: c.d_ff as i32, eps: c.rms_eps, dtype };
                let w = match layer {
                    LoadedLayer::Attention(w) => w,
                    LoadedLayer::Recurrent(d, m) => return Block { mixer: Mixer::DeltaNet(d), mlp: mlp(m.ffn_norm, m.gate_up, m.down, None), tail: None },
                    LoadedLayer::Built(block) => return *block,
                };
                let window = c.layer_window(i);
                let rope = match (window, &local) {
                    (Some(_), Some(local)) => local.clone(),
                    _ => global.clone(),
                };
                Block {
                    mixer: Mixer::Attention(Attention {
                        norm: w.attn_norm,
                        qkv: w.qkv,
                        qk_norm: w.qk_norm,
                        value_norm: None,
                        kv_from: None,
                        out: w.attn_out,
                        gate: w.attn_gate,
                        post_norm: w.post_attn_norm,
                        rope,
                        window,
                        heads,
                        eps: c.rms_eps,
                    }),
                    mlp: mlp(w.ffn_norm, w.gate_up, w.down, w.post_ffn_norm),
                    tail: None,
                }
            })
            .collect();
        Transformer { config, dtype, embedding, layers: blocks, final_norm, lm_head, backend, kv_quantization: None, gpu_decode: None, per_layer_input: None }
    }

    pub fn new_cache(&self) -> KvCache {
        let c = &self.config;
        // The CPU's attention kernel reads keys stored in blocks in place.
        let cache = match self.backend {
            AttentionBackend::CpuKernel => KvCache::with_keys_in_blocks(c.kv_layers(), c.n_kv_heads, c.head_dim, self.dtype),
            AttentionBackend::Mlx => KvCache::new(c.kv_layers(), c.n_kv_heads, c.head_dim, self.dtype),
        };
        let cache = cache.with_layer_shapes(c.kv_shapes()).with_windows(c.layer_windows()).with_recurrent_layers(c.recurrent_layers());
        cache.with_quantization(self.kv_quantization).expect("checked by set_kv_quantization")
    }

    /// Batched slots hold codes as `q` says, from every slot's first
    /// position (`kv_batch.rs`), on any device: the batch encodes what it
    /// writes and decodes what MLX's attention reads, and the fused decode
    /// kernels read codes themselves. Rows' caches carry such codes to and
    /// from the prefix cache without decoding them.
    pub fn set_batched_kv_quantization(&mut self, q: Option<KvQuantization>) -> mlx::Result<()> {
        let c = &self.config;
        KvCache::new(c.kv_layers(), c.n_kv_heads, c.head_dim, self.dtype).with_quantization(q)?;
        self.kv_quantization = q.map(|q| KvQuantization { start: 0, ..q });
        Ok(())
    }

    /// Rows' caches turn to codes as `q` says: only where the CPU's
    /// attention kernel reads them (float32 on the CPU).
    pub fn set_kv_quantization(&mut self, q: Option<KvQuantization>) -> mlx::Result<()> {
        let c = &self.config;
        let probe = KvCache::with_keys_in_blocks(c.kv_layers(), c.n_kv_heads, c.head_dim, self.dtype);
        if q.is_some() && self.backend != AttentionBackend::CpuKernel {
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
        KvBatch::new(self.config.kv_layers(), self.config.n_kv_heads, self.config.head_dim, self.dtype)
            .with_windows(self.config.layer_windows())
            .with_quantization(self.kv_quantization)
    }

    /// Bytes held by the weights.
    pub fn nbytes(&self) -> usize {
        let layers: usize = self.layers.iter().map(Block::nbytes).sum();
        // A tied head held dense or quantized like the table is the
        // embedding's own arrays; laid out in panels it is a copy of its own.
        let head_is_embedding = self.config.tied_embeddings
            && matches!((&self.lm_head.weight, &self.embedding), (Weight::Dense(_), Embedding::Dense(_)) | (Weight::Quantized(_), Embedding::Quantized(_)));
        let head = if head_is_embedding { 0 } else { self.lm_head.nbytes() };
        let per_layer_input = self.per_layer_input.as_ref().map_or(0, PerLayerInput::nbytes);
        self.embedding.nbytes() + layers + self.final_norm.nbytes() + head + per_layer_input
    }

    /// Every projection: each layer's, then the LM head.
    pub fn linears(&self) -> impl Iterator<Item = &Linear> {
        self.layers.iter().flat_map(Block::linears).chain([&self.lm_head])
    }

    /// On a CPU that runs the panel kernel, lays every dense float32
    /// projection out in its panels (see `Weight::Panels`), layer by layer so
    /// only one layer's weights are held twice at a time. The tied head gets
    /// a copy of its own; the embedding stays dense for the row gathers.
    pub fn lay_out_for_cpu(&mut self) -> mlx::Result<()> {
        for layer in &mut self.layers {
            for linear in layer.linears_mut() {
                linear.lay_out_for_cpu()?;
            }
        }
        self.lm_head.lay_out_for_cpu()
    }

    /// `quantized` when any projection is held quantized, else `dense`.
    pub fn weight_form(&self) -> &'static str {
        match self.linears().any(|l| matches!(l.weight, Weight::Quantized(_))) {
            true => "quantized",
            false => "dense",
        }
    }

    /// Bytes of weights one decode step reads: every layer, the final norm and
    /// the LM head (the embedding table itself is only gathered a row at a time).
    pub fn decode_read_bytes(&self) -> usize {
        let layers: usize = self.layers.iter().map(Block::nbytes).sum();
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
    /// once (see `attention.rs`).
    /// Whether decode steps of few rows may run in the GPU's fused kernels.
    pub fn has_fused_decode(&self) -> bool {
        self.gpu_decode.is_some()
    }

    pub fn forward_step(&self, mut batched: Option<BatchedRows<'_>>, rows: &mut [RowInput<'_>]) -> mlx::Result<StepLogits> {
        if let (Some(gpu), Some(b), true) = (&self.gpu_decode, &mut batched, rows.is_empty()) {
            if let Some(logits) = gpu.step(self, b)? {
                return Ok(logits);
            }
        }
        let codes = self.kv_quantization.map_or(KvCodes::Float, |q| q.codes());
        let mut attention = StepAttention::begin(self.backend, self.heads(), self.dtype, codes, batched, rows)?;
        attention.keep_kv_of(self.layers.iter().filter_map(|b| b.attention()?.kv_from).collect());
        let ids = attention.ids()?;
        let h = self.embedding.rows(&ids, self.dtype)?; // [1, T, d]
        let mut h = gemma3::scale_embeddings(h, &self.config, self.dtype)?;
        let per_layer_inputs = match &self.per_layer_input {
            Some(p) => Some(p.inputs(&ids, &h, self.dtype)?),
            None => None,
        };
        // A row's KV holds the attention layers' keys, its recurrent state
        // the other layers', each counted in layer order; a KV-shared layer
        // reads the keys an earlier layer wrote.
        let (mut kv_layer, mut state_layer) = (0, 0);
        for layer in &self.layers {
            h = match &layer.mixer {
                Mixer::Attention(a) if a.kv_from.is_some() => a.forward(&h, |a, q| attention.attend_shared(a.kv_from.expect("matched"), a, q))?,
                Mixer::Attention(a) => {
                    kv_layer += 1;
                    a.forward(&h, |a, qkv| attention.attend(kv_layer - 1, a, qkv))?
                }
                Mixer::DeltaNet(d) => {
                    state_layer += 1;
                    d.forward(&h, |x| attention.recur(state_layer - 1, x, |x, state, capture| d.run(x, state, capture)))?
                }
            };
            h = layer.mlp.forward(&h)?;
            if let Some(tail) = &layer.tail {
                h = tail.forward(h, per_layer_inputs.as_ref())?;
            }
        }
        let slots = attention.slot_count();
        let spans = attention.finish();
        self.head(&h, &spans, slots)
    }

    /// The logits of the positions `spans` names (`(first, count)` in the
    /// flattened batch, the first `slots` of them batched slots'): only
    /// those go through the final norm and the head.
    fn head(&self, h: &Array, spans: &[(i32, i32)], slots: usize) -> mlx::Result<StepLogits> {
        let d = self.config.d_model as i32;
        let picks: Vec<Array> = spans.iter().filter(|(_, k)| *k > 0).map(|&(at, k)| h.slice(&[0, at, 0], &[1, at + k, d])).collect::<mlx::Result<_>>()?;
        if picks.is_empty() {
            // Only prompt chunks that do not end their prompts: no head at all.
            return Ok(StepLogits { batched: spans.iter().map(|_| None).collect(), rows: Vec::new(), fused: false });
        }
        let last = if picks.len() == 1 { picks[0].clone() } else { mlx::concatenate(&picks.iter().collect::<Vec<_>>(), 1)? };
        let logits = self.lm_head.forward_fused(&last, Some((&self.final_norm, self.config.rms_eps)), None)?.astype(Dtype::F32)?; // [1, sum of wanted, vocab]
        let logits = gemma4::softcap(logits, &self.config)?;
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
        let batched = (&mut split).take(slots).collect::<mlx::Result<Vec<_>>>()?;
        let rows = split.map(|l| l.map(|l| l.expect("rows always want logits"))).collect::<mlx::Result<Vec<_>>>()?;
        Ok(StepLogits { batched, rows, fused: false })
    }

    /// The first attention layer (a model with none does not load).
    fn first_attention(&self) -> &Attention {
        self.layers.iter().find_map(Block::attention).expect("invariant: every model has an attention layer")
    }

    fn heads(&self) -> Heads {
        let c = &self.config;
        Heads { q: c.n_heads as i32, kv: c.n_kv_heads as i32, dim: c.head_dim as i32 }
    }

    /// Runs the first layer's attention of a batched slot attending alone
    /// once, on zeros, for `queries` queries over a slot of `capacity` keys
    /// (a [`capacity_class`](super::kv_batch::capacity_class)), so that what
    /// MLX sets up for the shape at first use is done before serving.
    pub fn warm_alone_attention(&self, queries: usize, capacity: usize) -> mlx::Result<()> {
        let c = &self.config;
        let mut kv = KvBatch::new(1, c.n_kv_heads, c.head_dim, self.dtype);
        kv.admit(&KvCache::new(1, c.n_kv_heads, c.head_dim, self.dtype), capacity)?;
        let mask = kv.alone_mask(0, queries)?;
        let alone = AloneSlot { slot: 0, start: 0, tokens: queries, queries, offset: 0, mask: None };
        let qkv = Array::full(&[1, queries, self.heads().qkv_width() as usize], 0.0, self.dtype)?;
        let out = attention_alone(0, self.first_attention(), &qkv, &mut kv, &alone, &mask)?;
        mlx::eval(&[&out])
    }

    /// Runs the first layer's shared attention of batched slots once, on
    /// zeros, for `slots` slots (a power of two) of `n` queries each over
    /// `capacity` keys (a [`capacity_class`](super::kv_batch::capacity_class)):
    /// the same ops on the same shapes and layouts as a step, so that
    /// whatever MLX sets up for a shape at first use is done before serving.
    pub fn warm_shared_attention(&self, slots: usize, n: usize, capacity: usize) -> mlx::Result<()> {
        let c = &self.config;
        let mut kv = KvBatch::new(1, c.n_kv_heads, c.head_dim, self.dtype);
        let empty = KvCache::new(1, c.n_kv_heads, c.head_dim, self.dtype);
        for _ in 0..slots {
            kv.admit(&empty, capacity)?;
        }
        let mut rows = BatchedRows { kv: &mut kv, tokens: vec![vec![0; n]; slots], fed: None, logits: vec![0; slots], shared_scores: usize::MAX };
        let step = BatchStep::prepare(&mut rows, c.n_heads)?;
        // `full` materialises its value, so the rows are laid out as a projection's output.
        let qkv = Array::full(&[1, slots * n, self.heads().qkv_width() as usize], 0.0, self.dtype)?;
        let out = attention_batched(0, self.first_attention(), &qkv, rows.kv, &step)?;
        mlx::eval(&[&out])
    }
}

/// A step's float32 logits (lazy): per batched slot (`None` where it wanted
/// none) `[logits, vocab]`, and per row `[n_logits, vocab]`.
pub struct StepLogits {
    pub batched: Vec<Option<Array>>,
    pub rows: Vec<Array>,
    /// Whether the step ran in the GPU's fused kernels (`models/gpu`).
    pub fused: bool,
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
