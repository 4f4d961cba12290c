//! The decode step on a CUDA GPU in kernels of our own: five launches a
//! layer instead of MLX's twenty-odd ops.
//!
//! MLX's CUDA backend spends about 12 us of host time on every primitive it
//! evaluates, so a one-row step of a 28-layer model (~20 primitives a layer)
//! costs milliseconds on the host while the GPU works for about one
//! (docs/performance.md, "GPU step cost"). For decode steps of up to
//! [`MAX_ROWS`] rows in batched slots, each layer here is:
//! 1. `matvec`: RMS norm, the fused q/k/v projection and its bias;
//! 2. `attention`: the q/k norms (Qwen3), RoPE, the new key and value written
//!    into the row's slot in place, and the attention over the slot;
//! 3. `matvec`: the output projection and the residual;
//! 4. `matvec`: RMS norm, the gate/up projection and the gate's activation;
//! 5. `matvec`: the down projection and the residual;
//!
//! and the head is one more `matvec` (final norm, projection, float32 out).
//! The kernels' sources sit beside this file; MLX compiles them with NVRTC
//! on the GPU at first use. Everything else (prefill, many rows, window
//! layers, quantized weights, CPUs) takes MLX's ops as before: a step that
//! does not fit returns `None` from [`GpuDecode::step`] and runs there.
//!
//! In place: a slot's buffers are written by the kernel itself, which MLX
//! does not know about, so a step takes this path only when the batch alone
//! holds every buffer ([`mlx::cuda::sole_holder`]): no snapshot, view or
//! pending op can see the write. After a step that grew or filled the
//! batch (its buffers still lazy), the step runs on MLX's ops, whose writes
//! leave them solely held again. Once found so, the buffers stay writable
//! through a chain of fused steps, each built while the one before it is
//! still on the device (the engine's lookahead), until anything else
//! touches them ([`super::KvBatch::may_write_in_place`]).
//!
//! A step's token ids may be an unread array (`BatchedRows::fed`, the
//! previous step's draws): the embedding gathers them on the device.
//!
//! Slots of 8- or 4-bit codes (`--kv-bits`, `kv_batch.rs`) can take the
//! same attention kernel in a variant that encodes the new position and
//! decodes what it reads; groups of codes must be whole multiples of a
//! lane's 8 features ([`codes_fit`]). That variant compiles for every shape
//! (`scripts/check-cuda-kernels.sh`) but has not yet run on a GPU, so it is
//! off unless `TETHER_GPU_KV_CODES=1` (`bench/gpu/run.sh`, `MODE=kvcodes`,
//! measures it against MLX's ops on the same codes); until then such steps
//! run on MLX's ops, which read the codes decoded.
use mlx::cuda::{sole_holder, CudaKernel, Launch, TemplateArg};
use mlx::fast::KvCodes;
use mlx::{Array, Dtype};

use super::batch_step::BatchedRows;
use super::config::Activation;
use super::layers::{Block, Heads, RopeFreqs};
use super::linear::{Linear, Weight};
use super::tracing;
use super::transformer::{StepLogits, Transformer};

/// Most rows a fused decode step takes; more go through MLX's matmuls,
/// which read each weight once for all rows anyway.
pub const MAX_ROWS: usize = 8;

/// Longest history a fused step attends over. Its attention runs one block
/// per (row, query head) over the whole history; past a few thousand
/// positions that costs more than the step saves (an estimate from ~1 us
/// per 64 positions a layer: measured only up to ~600), so longer rows take
/// MLX's attention, which splits the keys, until this one does.
pub const MAX_HISTORY: usize = 4096;

/// Threads of a block in both kernels (eight warps).
const BLOCK_THREADS: usize = 256;

const COMMON: &str = include_str!("common.cuh");
const MATVEC: &str = include_str!("matvec.cu");
const ATTENTION: &str = include_str!("attention.cu");

/// The most rows of the projection variant a step of `rows` rows runs: one
/// row has a variant of its own; 2 to [`MAX_ROWS`] share one that reads the
/// count at run time. Each variant is an NVRTC compile (about 1.5 s), so a
/// variant per count would cost the warm-up seconds for nothing measurable.
pub fn row_class(rows: usize) -> usize {
    if rows <= 1 {
        1
    } else {
        MAX_ROWS
    }
}

/// The model's decode step in fused kernels (see the module notes).
pub struct GpuDecode {
    matvec: CudaKernel,
    attention: CudaKernel,
    /// Each RoPE pair's turn per position, `[head_dim / 2]` float32.
    inv_freq: Array,
    /// A one-element array for a kernel input a model does not use.
    placeholder: Array,
    heads: Heads,
    traditional: bool,
    /// The gate's activation: 1 SwiGLU, 2 GeGLU (the kernel's `GLU`).
    glu: i32,
    /// The norms' epsilon times 1e12 (the kernels' `EPS_E12`).
    eps_e12: i32,
    /// Whether steps over slots of codes take the attention kernel's codes
    /// variant (see the module notes).
    reads_codes: bool,
}

impl GpuDecode {
    /// The fused step for `m`, where it can run: on a CUDA GPU, in
    /// bfloat16, with dense weights, no window layers and no post-norms
    /// (Gemma 3 keeps MLX's ops), and a head size the attention kernel
    /// knows. `TETHER_GPU_KERNELS=0` turns it off.
    pub fn for_model(m: &Transformer) -> mlx::Result<Option<GpuDecode>> {
        let enabled = std::env::var("TETHER_GPU_KERNELS").map_or(true, |v| v != "0");
        if !enabled || mlx::default_device() != mlx::Device::Gpu || !mlx::cuda::available() || m.dtype != Dtype::BF16 || !fits(m) {
            return Ok(None);
        }
        let c = &m.config;
        let rope = &m.layers[0].attention().expect("checked by fits").rope;
        let half = c.head_dim / 2;
        let inv_freq = match &rope.freqs {
            RopeFreqs::Base(theta) => {
                let turns: Vec<f32> = (0..half).map(|i| (*theta as f64).powf(-2.0 * i as f64 / c.head_dim as f64) as f32).collect();
                Array::from_f32(&turns, &[half])?
            }
            RopeFreqs::Periods(periods) => Array::scalar(1.0, Dtype::F32)?.divide(&periods.astype(Dtype::F32)?)?,
        };
        inv_freq.eval()?;
        let placeholder = Array::zeros(&[1], Dtype::BF16)?;
        placeholder.eval()?;
        let glu = match c.activation {
            Activation::Silu => 1,
            Activation::GeluTanh => 2,
        };
        Ok(Some(GpuDecode {
            matvec: CudaKernel::new("tether_matvec", &["x", "w", "norm_w", "bias", "res"], &["y"], MATVEC, COMMON)?,
            attention: CudaKernel::new(
                "tether_decode_attention",
                &["qkv", "k_cache", "v_cache", "rows", "inv_freq", "q_norm", "k_norm"],
                &["out"],
                ATTENTION,
                COMMON,
            )?,
            inv_freq,
            placeholder,
            heads: Heads { q: c.n_heads as i32, kv: c.n_kv_heads as i32, dim: c.head_dim as i32 },
            traditional: rope.traditional,
            glu,
            eps_e12: (c.rms_eps as f64 * 1e12).round() as i32,
            reads_codes: std::env::var("TETHER_GPU_KV_CODES").is_ok_and(|v| v == "1"),
        }))
    }

    /// Runs the step of `b` if it is a decode step this path takes: every
    /// slot brings at most one token and wants its logits, at most
    /// [`MAX_ROWS`] do, none has more than [`MAX_HISTORY`] positions, and
    /// the batch alone holds its buffers. `None`: run
    /// it on MLX's ops (nothing was changed but the batch's capacity).
    pub fn step(&self, m: &Transformer, b: &mut BatchedRows<'_>) -> mlx::Result<Option<StepLogits>> {
        let Some(live) = decode_slots(&b.tokens, &b.logits, |s| b.kv.len(s)) else { return Ok(None) };
        let codes = b.kv.codes();
        if codes != KvCodes::Float && !(self.reads_codes && codes_fit(codes, m.config.head_dim)) {
            return Ok(None);
        }
        let needed = live.iter().map(|&s| b.kv.len(s) + 1).max().unwrap_or(0);
        b.kv.ensure_capacity(needed)?;
        if !b.kv.may_write_in_place(sole_holder) {
            if tracing() {
                eprintln!("[gpu_decode] {} rows on MLX's ops: the batch's buffers are shared or pending (a snapshot, a view, a growth)", live.len());
            }
            return Ok(None);
        }
        let rows = live.len();
        let ids = match &b.fed {
            Some(fed) => fed.reshape(&[1, rows as i32])?,
            None => Array::from_i32(&live.iter().map(|&s| b.tokens[s][0]).collect::<Vec<_>>(), &[1, rows])?,
        };
        let places: Vec<i32> = live.iter().flat_map(|&s| [s as i32, b.kv.len(s) as i32]).collect();
        let places = Array::from_i32(&places, &[live.len(), 2])?;
        let d = m.config.d_model;
        let mut h = m.embedding.rows(&ids, m.dtype)?.reshape(&[rows as i32, d as i32])?;
        for (layer, block) in m.layers.iter().enumerate() {
            let (keys, values) = b.kv.layer(layer).expect("checked above");
            h = self.layer(block, &h, (keys, values), &places, codes)?;
        }
        let logits = self.head(m, &h)?;
        let real: Vec<usize> = b.tokens.iter().map(Vec::len).collect();
        b.kv.advance(&real);
        let vocab = logits.dim(-1) as i32;
        let mut batched: Vec<Option<Array>> = vec![None; b.tokens.len()];
        for (i, &s) in live.iter().enumerate() {
            batched[s] = Some(match rows {
                1 => logits.clone(),
                _ => logits.slice(&[i as i32, 0], &[i as i32 + 1, vocab])?,
            });
        }
        Ok(Some(StepLogits { batched, rows: Vec::new(), fused: true }))
    }

    /// Compiles (NVRTC, at first launch) and runs once every kernel variant a
    /// step of `rows` rows launches, on scratch buffers: the first layer's
    /// and the head's, which every other layer shares.
    pub fn warm_up(&self, m: &Transformer, rows: usize) -> mlx::Result<()> {
        let c = &m.config;
        // In the form the model's batches hold (see `Transformer::new_kv_batch`).
        let codes = m.kv_quantization.map_or(KvCodes::Float, |q| q.codes());
        if codes != KvCodes::Float && !(self.reads_codes && codes_fit(codes, c.head_dim)) {
            return Ok(());
        }
        let (width, dtype) = if codes == KvCodes::Float { (c.head_dim, Dtype::BF16) } else { (codes.width(c.head_dim), Dtype::U8) };
        let cache = || Array::zeros(&[rows, c.n_kv_heads, 2, width], dtype);
        let (keys, values) = (cache()?, cache()?);
        let h = Array::zeros(&[rows, c.d_model], Dtype::BF16)?;
        mlx::eval(&[&keys, &values, &h])?;
        let places: Vec<i32> = (0..rows as i32).flat_map(|r| [r, 0]).collect();
        let places = Array::from_i32(&places, &[rows, 2])?;
        let h = self.layer(&m.layers[0], &h, (&keys, &values), &places, codes)?;
        mlx::eval(&[&self.head(m, &h)?])
    }

    /// One layer for the rows of the residual stream `h` (the module
    /// notes' five kernels); `cache`: the layer's slot buffers, which the
    /// attention writes at `places` (`[rows, 2]` int32: slot, position),
    /// holding features as `codes` says.
    fn layer(&self, block: &Block, h: &Array, cache: (&Array, &Array), places: &Array, codes: KvCodes) -> mlx::Result<Array> {
        let (a, mlp) = (block.attention().expect("checked by fits"), &block.mlp);
        let qkv = self.project(h, &a.qkv, Some(&a.norm), None, 0, Dtype::BF16)?;
        let heads = self.attend(&qkv, cache.0, cache.1, places, a.qk_norm.as_ref().map(|n| (&n.q, &n.k)), codes)?;
        let h = self.project(&heads, &a.out, None, Some(h), 0, Dtype::BF16)?;
        let gated = self.project(&h, &mlp.gate_up, Some(&mlp.norm), None, self.glu, Dtype::BF16)?;
        self.project(&gated, &mlp.down, None, Some(&h), 0, Dtype::BF16)
    }

    /// The final norm and the LM head: float32 logits `[rows, vocab]`.
    fn head(&self, m: &Transformer, h: &Array) -> mlx::Result<Array> {
        self.project(h, &m.lm_head, Some(&m.final_norm), None, 0, Dtype::F32)
    }

    /// The rows of `x` through `linear` (see matvec.cu): normed by `norm`
    /// first, `residual` added after, gated (`glu` > 0: the gate's rows
    /// then the up rows), out in `out`.
    #[allow(clippy::too_many_arguments)]
    fn project(&self, x: &Array, linear: &Linear, norm: Option<&Array>, residual: Option<&Array>, glu: i32, out: Dtype) -> mlx::Result<Array> {
        let Weight::Dense(w) = &linear.weight else {
            return Err(mlx::Error { op: "gpu_decode", message: "a projection is not dense (checked at load)".into() });
        };
        let (rows, out_rows, k) = (x.dim(0), w.dim(0), w.dim(1));
        let outputs = if glu > 0 { out_rows / 2 } else { out_rows };
        let split = k_split(k);
        let per_block = 8 / split;
        let p = &self.placeholder;
        let inputs = [x, w, norm.unwrap_or(p), linear.bias.as_ref().unwrap_or(p), residual.unwrap_or(p)];
        let template = [
            ("MAX_ROWS", TemplateArg::Int(row_class(rows) as i32)),
            ("K", TemplateArg::Int(k as i32)),
            ("KSPLIT", TemplateArg::Int(split as i32)),
            ("NORM", TemplateArg::Bool(norm.is_some())),
            ("BIAS", TemplateArg::Bool(linear.bias.is_some())),
            ("RESIDUAL", TemplateArg::Bool(residual.is_some())),
            ("GLU", TemplateArg::Int(glu)),
            ("EPS_E12", TemplateArg::Int(self.eps_e12)),
        ];
        let launch = Launch::blocks(outputs.div_ceil(per_block), BLOCK_THREADS);
        let mut y = self.matvec.launch(&inputs, &[(&[rows, outputs], out)], launch, &template)?;
        Ok(y.pop().expect("one output"))
    }

    /// One layer's attention for the step's rows (see attention.cu):
    /// returns `[rows, heads * head_dim]`; writes each row's key and value
    /// into its slot.
    fn attend(&self, qkv: &Array, keys: &Array, values: &Array, places: &Array, qk_norm: Option<(&Array, &Array)>, codes: KvCodes) -> mlx::Result<Array> {
        let (Heads { q, kv, dim }, rows) = (self.heads, qkv.dim(0));
        let (bits, group) = match codes {
            KvCodes::Float => (0, 8),
            KvCodes::Affine { bits, group } => (bits as i32, group as i32),
        };
        let p = &self.placeholder;
        let (q_norm, k_norm) = qk_norm.unwrap_or((p, p));
        let inputs = [qkv, keys, values, places, &self.inv_freq, q_norm, k_norm];
        let template = [
            ("HD", TemplateArg::Int(dim)),
            ("HQ", TemplateArg::Int(q)),
            ("HKV", TemplateArg::Int(kv)),
            ("TRAD", TemplateArg::Bool(self.traditional)),
            ("QK_NORM", TemplateArg::Bool(qk_norm.is_some())),
            ("EPS_E12", TemplateArg::Int(self.eps_e12)),
            ("BITS", TemplateArg::Int(bits)),
            ("CODE_GROUP", TemplateArg::Int(group)),
        ];
        let launch = Launch::blocks(rows * q as usize, BLOCK_THREADS);
        let mut out = self.attention.launch(&inputs, &[(&[rows, (q * dim) as usize], Dtype::BF16)], launch, &template)?;
        Ok(out.pop().expect("one output"))
    }
}

/// The slots of a step this path takes, in order: every slot brings at most
/// one token and wants its logits, one to [`MAX_ROWS`] bring one, and none
/// of those holds [`MAX_HISTORY`] positions already (`len`: a slot's
/// length). `None`: the step runs on MLX's ops.
fn decode_slots(tokens: &[Vec<i32>], logits: &[usize], len: impl Fn(usize) -> usize) -> Option<Vec<usize>> {
    let decode_only = tokens.len() == logits.len() && tokens.iter().zip(logits).all(|(t, &l)| t.len() <= 1 && l == t.len());
    let live: Vec<usize> = (0..tokens.len()).filter(|&s| !tokens[s].is_empty()).collect();
    let fits = decode_only && (1..=MAX_ROWS).contains(&live.len()) && live.iter().all(|&s| len(s) < MAX_HISTORY);
    fits.then_some(live)
}

/// Whether the attention kernel reads slots holding `codes`: features in
/// bfloat16, or 8- or 4-bit codes in groups a lane's 8 features never
/// straddle (4 bits: half a head whole lanes too).
fn codes_fit(codes: KvCodes, head_dim: usize) -> bool {
    match codes {
        KvCodes::Float => true,
        KvCodes::Affine { bits, group } => {
            group.is_multiple_of(8) && head_dim.is_multiple_of(group) && (bits == 8 || (bits == 4 && head_dim.is_multiple_of(16)))
        }
    }
}

/// Warps splitting one output's inputs (1, 2, 4 or 8): enough that a long
/// row (a down projection's) is read by several warps at once, while each
/// still reads at least 128 16-byte words.
fn k_split(k: usize) -> usize {
    let words = k / 8;
    let mut split = 1;
    while split < 8 && words / (split * 2) >= 128 {
        split *= 2;
    }
    split
}

/// Whether every part of `m` is one the kernels implement.
fn fits(m: &Transformer) -> bool {
    let c = &m.config;
    let dense_bf16 = |l: &Linear| {
        matches!(&l.weight, Weight::Dense(w) if w.dtype() == Dtype::BF16 && w.dim(1).is_multiple_of(8))
            && l.bias.as_ref().is_none_or(|b| b.dtype() == Dtype::BF16)
    };
    let layers_fit = m.layers.iter().all(|b| {
        let (Some(a), mlp) = (b.attention(), &b.mlp) else { return false };
        a.window.is_none()
            && a.gate.is_none()
            && a.rope.dims == c.head_dim as i32
            && a.post_norm.is_none()
            && mlp.post_norm.is_none()
            && b.linears().into_iter().all(dense_bf16)
            && a.norm.dtype() == Dtype::BF16
            && mlp.norm.dtype() == Dtype::BF16
            && a.qk_norm.as_ref().is_none_or(|n| n.q.dtype() == Dtype::BF16 && n.k.dtype() == Dtype::BF16)
            && m.layers[0].attention().is_some_and(|first| std::rc::Rc::ptr_eq(&a.rope, &first.rope))
    });
    layers_fit
        && !m.layers.is_empty()
        && dense_bf16(&m.lm_head)
        && m.final_norm.dtype() == Dtype::BF16
        && c.embedding_scale == 1.0
        && matches!(c.head_dim, 64 | 128 | 256)
        && c.n_kv_heads > 0
        && c.n_heads.is_multiple_of(c.n_kv_heads)
        && c.d_model.is_multiple_of(8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_rows_split_across_warps_and_short_ones_do_not() {
        assert_eq!(k_split(576), 1); // SmolLM2's hidden size
        assert_eq!(k_split(1536), 1); // Qwen2.5-1.5B's
        assert_eq!(k_split(3584), 2); // Qwen2.5-7B's
        assert_eq!(k_split(8960), 8); // Qwen2.5-1.5B's down projection
        assert_eq!(k_split(18944), 8); // Qwen2.5-7B's
    }

    #[test]
    fn only_decode_steps_of_few_short_rows_take_the_fused_path() {
        let short = |_| 100;
        // Decoding slots beside idle ones: the decoding ones, in order.
        assert_eq!(decode_slots(&[vec![5], vec![], vec![7]], &[1, 0, 1], short), Some(vec![0, 2]));
        // Nothing to decode, a prompt chunk, a verification, a token without logits.
        assert_eq!(decode_slots(&[vec![], vec![]], &[0, 0], short), None);
        assert_eq!(decode_slots(&[vec![5], vec![1, 2, 3]], &[1, 1], short), None);
        assert_eq!(decode_slots(&[vec![5, 6]], &[2], short), None);
        assert_eq!(decode_slots(&[vec![5]], &[0], short), None);
        // More rows than the kernels take; a history too long for their attention.
        let many = vec![vec![1]; MAX_ROWS + 1];
        assert_eq!(decode_slots(&many, &[1; MAX_ROWS + 1], short), None);
        assert_eq!(decode_slots(&many[..MAX_ROWS], &[1; MAX_ROWS], short).map(|l| l.len()), Some(MAX_ROWS));
        assert_eq!(decode_slots(&[vec![5], vec![6]], &[1, 1], |s| if s == 1 { MAX_HISTORY } else { 10 }), None);
        assert_eq!(decode_slots(&[vec![5]], &[1], |_| MAX_HISTORY - 1), Some(vec![0]));
    }

    #[test]
    fn rows_share_few_compiled_variants() {
        let classes: Vec<usize> = (1..=MAX_ROWS).map(row_class).collect();
        assert_eq!(classes, [1, 8, 8, 8, 8, 8, 8, 8]);
    }
}
