//! MLX's fused kernels (`mlx::core::fast`).
use crate::array::{make_list, unwrap_list, wrap};
use crate::ffi::bridge;
use crate::{Array, Error, Result};

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

/// [`rope`] with the rotation's periods given per pair instead of derived
/// from a base: pair `i` turns by `position / freqs[i]` (`freqs`: `[dims / 2]`
/// float32; `base^(2i / dims)` is plain RoPE). For scaled RoPE (Llama 3).
pub fn rope_freqs(x: &Array, dims: i32, traditional: bool, scale: f32, offset: i32, freqs: &Array) -> Result<Array> {
    wrap("rope", bridge::rope_freqs(x.raw(), dims, traditional, scale, offset, freqs.raw()))
}

/// [`rope_offsets`] with per-pair periods (see [`rope_freqs`]).
pub fn rope_offsets_freqs(x: &Array, dims: i32, traditional: bool, scale: f32, offsets: &Array, freqs: &Array) -> Result<Array> {
    wrap("rope", bridge::rope_offsets_freqs(x.raw(), dims, traditional, scale, offsets.raw(), freqs.raw()))
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

/// Positions per block of a cache that stores its keys in blocks
/// ([`KeyLayout::Blocks`]); such a cache's capacity is a multiple of it.
pub const KEY_BLOCK: usize = 64;

/// Where a `[1, kv_heads, capacity, head_dim]` CPU cache keeps a position's
/// features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyLayout {
    /// As the shape reads, `[position][feature]` per head; views are fine.
    Positions,
    /// In blocks of [`KEY_BLOCK`] positions, each stored transposed,
    /// `[feature][position]`: the order [`cpu_attention`]'s score loop reads
    /// keys in, so it reads them in place instead of transposing every block
    /// of every row at every step. Only [`cpu_kv_write`] and
    /// [`cpu_attention`] know this order: to MLX's other ops the buffer's
    /// positions are whole blocks, and a slice must keep whole blocks.
    Blocks,
}

/// How a CPU cache stores each position's features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCodes {
    /// As float32: `[1, kv_heads, capacity, head_dim]`.
    Float,
    /// As `bits`-bit (8 or 4) affine codes in groups of `group` features
    /// (`x ~= code * scale + bias` with the group's min as bias and
    /// (max - min) / (2^bits - 1) as scale), each position's row holding its
    /// codes (4-bit: two a byte) then the groups' scales and biases as
    /// float32: uint8 `[1, kv_heads, capacity, width(head_dim)]`. At a group
    /// of 64, 9/32 of float32's bytes in 8 bits, 5/32 in 4.
    Affine { bits: u8, group: usize },
}

impl KvCodes {
    /// The last dimension of a cache of head size `head_dim`.
    pub fn width(self, head_dim: usize) -> usize {
        match self {
            KvCodes::Float => head_dim,
            KvCodes::Affine { bits, group } => head_dim * bits as usize / 8 + 8 * (head_dim / group),
        }
    }

    /// The group size and bits [`cpu_attention`] and [`cpu_kv_write`] take
    /// (group 0: float32).
    fn group_and_bits(self) -> (usize, usize) {
        match self {
            KvCodes::Float => (0, 8),
            KvCodes::Affine { bits, group } => (group, bits as usize),
        }
    }
}

/// One sequence's share of [`cpu_attention`].
#[derive(Clone, Copy)]
pub struct AttentionRow<'a> {
    /// `[1, kv_heads, capacity, head_dim]` float32: the row's cache, or a
    /// view of its first positions; or a uint8 cache of codes
    /// ([`KvCodes::Affine`], the step's `codes`).
    pub keys: &'a Array,
    pub values: &'a Array,
    /// The row's query tokens; they follow the previous rows' tokens in `q`.
    pub n: usize,
    /// The row's length after this step: its queries sit at positions
    /// `kv_len - n .. kv_len`, and query `i` attends the keys at positions
    /// `0 ..= kv_len - n + i` (within the window, if any).
    pub kv_len: usize,
    /// The position the cache's index 0 holds: a sliding-window layer's
    /// cache drops positions no query will see again (0: it holds all).
    pub first: usize,
}

fn to_i32(op: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::new(op, format!("{v} does not fit in i32")))
}

/// Causal grouped-query attention of a whole batched step on the CPU, each
/// row against its own cache, with scale `1/sqrt(head_dim)`. `q` holds the
/// step's roped queries, `[1, T, n_heads * head_dim]` or
/// `[T, n_heads, 1, head_dim]` (views are fine); rows tile its T tokens in
/// order. `keys`: how every row's keys are stored; with
/// [`KeyLayout::Blocks`] they must be whole caches written by
/// [`cpu_kv_write`] (no views). Returns `[1, T, n_heads * head_dim]` float32
/// (lazy, CPU stream).
/// `window`: how many positions a query sees, itself included, on a
/// sliding-window layer (`None`: all before it). `codes`: how the rows whose
/// caches are uint8 hold their codes (rows may differ in precision:
/// float32 caches are read as such).
pub fn cpu_attention(q: &Array, rows: &[AttentionRow<'_>], keys: KeyLayout, window: Option<usize>, codes: KvCodes) -> Result<Array> {
    const OP: &str = "cpu_attention";
    let step = StepArgs::new(OP, rows, window, codes)?;
    wrap(OP, bridge::cpu_attention(q.raw(), &step.kv, &step.n, &step.kv_len, &step.first, step.window, keys == KeyLayout::Blocks, step.group, step.bits))
}

/// How a layer's RoPE turns each token of a step, for [`cpu_layer_attention`].
pub struct RopeTable<'a> {
    /// `[T, head_dim]` float32: MLX's RoPE (as the model turns that layer,
    /// each token at its position) of a unit head, 1 at the first feature of
    /// every rotated pair and 0 at the second, which holds each pair's
    /// cosine and sine.
    pub table: &'a Array,
    /// Pairs are adjacent features (`2i, 2i + 1`), not the two halves.
    pub traditional: bool,
}

/// One layer's attention for the rows of a step on the CPU as one graph
/// node: RoPE on the queries and keys of `qkv` (the fused projection,
/// `[1, T, (n_heads + 2 kv_heads) * head_dim]`, rows tiling its tokens),
/// each row's new keys and values written into its cache at positions
/// `kv_len - n ..` (index `kv_len - n - first`; as [`cpu_kv_write`]), and
/// [`cpu_attention`] over the updated caches. The rotation equals MLX's
/// RoPE bit for bit, so outputs equal those of the three ops apart.
/// Returns the attention `[1, T, n_heads * head_dim]` and each row's updated
/// keys and values (lazy, CPU stream). A row's cache is written in place
/// when nothing else holds its buffer at evaluation: drop the arrays passed
/// in `rows` before evaluating.
pub fn cpu_layer_attention(
    qkv: &Array,
    rope: RopeTable<'_>,
    n_heads: usize,
    rows: &[AttentionRow<'_>],
    keys: KeyLayout,
    window: Option<usize>,
    codes: KvCodes,
) -> Result<(Array, Vec<(Array, Array)>)> {
    const OP: &str = "cpu_layer_attention";
    let step = StepArgs::new(OP, rows, window, codes)?;
    let list = bridge::cpu_layer_attention(
        qkv.raw(),
        rope.table.raw(),
        rope.traditional,
        to_i32(OP, n_heads)?,
        &step.kv,
        &step.n,
        &step.kv_len,
        &step.first,
        step.window,
        keys == KeyLayout::Blocks,
        step.group,
        step.bits,
    )
    .map_err(|e| Error::from_cxx(OP, e))?;
    let mut outputs = unwrap_list(OP, &list)?.into_iter();
    let attention = outputs.next().ok_or_else(|| Error::new(OP, "no output"))?;
    let mut caches = Vec::with_capacity(rows.len());
    while let (Some(k), Some(v)) = (outputs.next(), outputs.next()) {
        caches.push((k, v));
    }
    Ok((attention, caches))
}

/// The per-row arguments [`cpu_attention`] and [`cpu_layer_attention`] pass
/// to C++.
struct StepArgs {
    kv: cxx::UniquePtr<bridge::ArrayList>,
    n: Vec<i32>,
    kv_len: Vec<i32>,
    first: Vec<i32>,
    window: i32,
    group: i32,
    bits: i32,
}

impl StepArgs {
    fn new(op: &'static str, rows: &[AttentionRow<'_>], window: Option<usize>, codes: KvCodes) -> Result<StepArgs> {
        let kv: Vec<&Array> = rows.iter().flat_map(|r| [r.keys, r.values]).collect();
        let ints = |f: fn(&AttentionRow<'_>) -> usize| rows.iter().map(|r| to_i32(op, f(r))).collect::<Result<Vec<_>>>();
        let (group, bits) = codes.group_and_bits();
        Ok(StepArgs {
            kv: make_list(op, &kv)?,
            n: ints(|r| r.n)?,
            kv_len: ints(|r| r.kv_len)?,
            first: ints(|r| r.first)?,
            window: to_i32(op, window.unwrap_or(0))?,
            group: to_i32(op, group)?,
            bits: to_i32(op, bits)?,
        })
    }
}

/// Writes tokens `start .. start + n` of `fresh` (keys or values of a step,
/// laid out like [`cpu_attention`]'s `q` with `kv_heads` heads) into `cache`
/// (`[1, kv_heads, capacity, head_dim]` float32) at positions `pos .. pos + n`;
/// returns the updated cache. Like `slice_update`, the write happens in place
/// when `cache`'s buffer has no other holder at evaluation, and on a copy
/// otherwise, so a shared (snapshotted) buffer is never modified. `layout`:
/// how `cache` stores positions (values always as [`KeyLayout::Positions`]).
/// `codes`: how `cache` holds features; codes are quantized here.
pub fn cpu_kv_write(cache: &Array, fresh: &Array, start: usize, n: usize, pos: usize, layout: KeyLayout, codes: KvCodes) -> Result<Array> {
    const OP: &str = "cpu_kv_write";
    let blocks = layout == KeyLayout::Blocks;
    let (group, bits) = codes.group_and_bits();
    wrap(
        OP,
        bridge::cpu_kv_write(cache.raw(), fresh.raw(), to_i32(OP, start)?, to_i32(OP, n)?, to_i32(OP, pos)?, blocks, to_i32(OP, group)?, to_i32(OP, bits)?),
    )
}

/// The first `len` positions of a cache of codes ([`KvCodes::Affine`],
/// stored as `layout` says), dequantized: `[1, kv_heads, len, head_dim]`
/// float32 (lazy, CPU stream).
pub fn cpu_kv_dequantize(cache: &Array, len: usize, layout: KeyLayout, codes: KvCodes) -> Result<Array> {
    const OP: &str = "cpu_kv_dequantize";
    let (group, bits) = codes.group_and_bits();
    wrap(OP, bridge::cpu_kv_dequantize(cache.raw(), to_i32(OP, len)?, layout == KeyLayout::Blocks, to_i32(OP, group)?, to_i32(OP, bits)?))
}

/// SwiGLU's activation on the CPU, `silu(gate) * up`, from the fused gate/up
/// projection's output `[..., 2 * ff]` (gate first) in one vectorised pass;
/// float32. Returns `[..., ff]` (lazy, CPU stream).
pub fn cpu_swiglu(gate_up: &Array) -> Result<Array> {
    wrap("cpu_swiglu", bridge::cpu_swiglu(gate_up.raw()))
}
