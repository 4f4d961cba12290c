//! How a step's queries meet their keys: the attention backends.
//!
//! A step's tokens run flattened through the per-token work (projections,
//! MLP); attention is where rows part. Two kinds of rows can share a step:
//! - rows whose caches live in a [`KvBatch`] (batched slots): MLX's masked
//!   attention over all slots at once (see `batch_step.rs` for the shapes),
//!   or over one slot's keys for a chunk that attends alone;
//! - rows with a [`KvCache`](super::KvCache) of their own, by the model's
//!   [`AttentionBackend`]: the CPU's fused kernel (one graph node a layer
//!   for every row) or MLX's attention row by row.
//!
//! The backend is picked once at load, from the device and dtype; a step
//! sets up what its backend needs ([`StepAttention::begin`]), and each layer
//! then only calls [`StepAttention::attend`]. Which layers are windowed and
//! how they turn is the layer's ([`Attention`]), not the backend's.
use std::sync::OnceLock;

use mlx::fast::{self, AttentionRow, KeyLayout, KvCodes, Mask};
use mlx::{Array, Dtype};

use super::batch_step::{AloneSlot, BatchStep, BatchedRows};
use super::gemma3;
use super::kv::{Kv, LayerKv};
use super::kv_batch::KvBatch;
use super::layers::{Attention, Heads, RopeTables};
use super::state_rows::LayerState;

/// A recurrent layer's run of one row: its outputs, its state after them,
/// and the states captured on the way (see [`StepAttention::recur`]).
pub type RecurOut = (Array, LayerState, Vec<LayerState>);
use super::transformer::RowInput;

/// How rows with caches of their own attend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionBackend {
    /// [`fast::cpu_layer_attention`]: RoPE, cache writes and attention of
    /// every row in one node a layer; keys are stored in blocks, and may be
    /// held in codes (`--kv-bits`). SwiGLU goes through its CPU kernel too.
    CpuKernel,
    /// MLX's ops: RoPE, a cache append and `sdpa`, row by row.
    Mlx,
}

impl AttentionBackend {
    /// The CPU's kernels on the CPU in float32, unless
    /// `TETHER_CPU_ATTENTION=0` asks for MLX's ops (kept for comparison and
    /// as a fallback); MLX's everywhere else.
    pub fn pick(dtype: Dtype) -> AttentionBackend {
        static ENABLED: OnceLock<bool> = OnceLock::new();
        let enabled = *ENABLED.get_or_init(|| std::env::var("TETHER_CPU_ATTENTION").map_or(true, |v| v != "0"));
        match enabled && dtype == Dtype::F32 && mlx::default_device() == mlx::Device::Cpu {
            true => AttentionBackend::CpuKernel,
            false => AttentionBackend::Mlx,
        }
    }
}

/// One step's attention, set up before its first layer.
pub(super) struct StepAttention<'s, 'r, 'c> {
    dtype: Dtype,
    slots: Option<Slots<'s>>,
    rows: Rows<'r, 'c>,
}

/// The batched slots' part of a step.
struct Slots<'s> {
    input: BatchedRows<'s>,
    step: BatchStep,
    /// Per alone slot, its window mask once built (one per step: its window
    /// layers all attend over the same positions).
    window_masks: Vec<Option<Array>>,
}

/// The rows with caches of their own.
struct Rows<'r, 'c> {
    inputs: &'r mut [RowInput<'c>],
    /// Per row, its tokens this step.
    lens: Vec<usize>,
    /// Per row, its cache's length before the step.
    offsets: Vec<i32>,
    /// Per row, where its tokens start in the flattened batch (after the slots').
    starts: Vec<i32>,
    path: RowPath,
    /// What the KV layers later layers read (Gemma 4's KV-shared layers)
    /// hold once written this step: `(layer, [(keys, values)] per row)`.
    kept: Vec<(usize, Vec<(Array, Array)>)>,
    /// The KV layers later layers read this step.
    keep: Vec<usize>,
}

/// The backend's state for one step.
enum RowPath {
    /// The step's RoPE tables and the codes quantized rows are held in.
    CpuKernel(RopeTables, KvCodes),
    /// Per row, its window mask once built.
    Mlx(Vec<Option<Array>>),
}

impl<'s, 'r, 'c> StepAttention<'s, 'r, 'c> {
    /// Checks the step's rows, lays out the batched slots' part, reserves
    /// room in the rows' caches and builds what the backend needs.
    pub fn begin(
        backend: AttentionBackend,
        heads: Heads,
        dtype: Dtype,
        codes: KvCodes,
        batched: Option<BatchedRows<'s>>,
        inputs: &'r mut [RowInput<'c>],
    ) -> mlx::Result<Self> {
        let lens: Vec<usize> = inputs.iter().map(|r| r.ids.dim(-1)).collect();
        if (inputs.is_empty() && batched.is_none()) || inputs.iter().zip(&lens).any(|(r, &n)| n == 0 || r.n_logits == 0 || r.n_logits > n) {
            return Err(mlx::Error { op: "forward", message: format!("bad batch: token counts {lens:?}") });
        }
        let slots = match batched {
            Some(mut input) => {
                let step = BatchStep::prepare(&mut input, heads.q as usize)?;
                Some(Slots { window_masks: vec![None; step.alone.len()], input, step })
            }
            None => None,
        };
        let batch_tokens = slots.as_ref().map_or(0, |s| s.step.tokens) as i32;
        let offsets: Vec<i32> = inputs.iter().map(|r| r.cache.offset() as i32).collect();
        for (r, &n) in inputs.iter_mut().zip(&lens) {
            r.cache.reserve(n)?;
        }
        let starts: Vec<i32> = lens
            .iter()
            .scan(batch_tokens, |acc, &n| {
                let s = *acc;
                *acc += n as i32;
                Some(s)
            })
            .collect();
        // The CPU kernel turns every row token of the step by one table per
        // RoPE, each at its own position.
        let path = match backend {
            AttentionBackend::CpuKernel if !inputs.is_empty() => {
                let p: Vec<i32> = offsets.iter().zip(&lens).flat_map(|(&o, &n)| o..o + n as i32).collect();
                RowPath::CpuKernel(RopeTables::new(Array::from_i32(&p, &[p.len()])?), codes)
            }
            _ => RowPath::Mlx(vec![None; inputs.len()]),
        };
        Ok(StepAttention { dtype, slots, rows: Rows { inputs, lens, offsets, starts, path, kept: Vec::new(), keep: Vec::new() } })
    }

    /// Keeps what the KV layers `layers` hold after their writes this
    /// step, for the layers that attend over them ([`attend_shared`](Self::attend_shared)).
    pub fn keep_kv_of(&mut self, layers: Vec<usize>) {
        self.rows.keep = layers;
    }

    /// `[1, T]` int32: the step's token ids, the batched slots' first.
    pub fn ids(&self) -> mlx::Result<Array> {
        let mut all: Vec<&Array> = Vec::with_capacity(self.rows.inputs.len() + 1);
        all.extend(self.slots.as_ref().map(|s| &s.step.ids));
        all.extend(self.rows.inputs.iter().map(|r| &r.ids));
        match all[..] {
            [one] => Ok(one.clone()),
            _ => mlx::concatenate(&all, 1),
        }
    }

    /// Layer `layer`'s attention for the whole step: `qkv` is the step's
    /// `[1, T, (hq + 2 hkv) hd]` projection; returns `[1, T, hq hd]`.
    pub fn attend(&mut self, layer: usize, attention: &Attention, qkv: &Array) -> mlx::Result<Array> {
        let (width, total) = (attention.heads.qkv_width(), qkv.dim(1) as i32);
        let batch_tokens = self.slots.as_ref().map_or(0, |s| s.step.tokens) as i32;
        let mut parts: Vec<Array> = Vec::with_capacity(self.rows.inputs.len() + 1);
        if let Some(slots) = &mut self.slots {
            let mine = qkv.slice(&[0, 0, 0], &[1, batch_tokens, width])?;
            parts.push(slots.attend(layer, attention, &mine, self.dtype)?);
        }
        let rows = &mut self.rows;
        match &mut rows.path {
            RowPath::CpuKernel(tables, codes) => {
                let mine = if batch_tokens == 0 { qkv.clone() } else { qkv.slice(&[0, batch_tokens, 0], &[1, total, width])? };
                parts.push(attention_cpu_kernel(layer, attention, &mine, rows.inputs, &rows.lens, tables, *codes)?);
            }
            RowPath::Mlx(masks) => {
                let (keep, mut kept) = (rows.keep.contains(&layer), Vec::new());
                for (r, (row, mask)) in rows.inputs.iter_mut().zip(masks).enumerate() {
                    let (s, n) = (rows.starts[r], rows.lens[r] as i32);
                    let mine = qkv.slice(&[0, s, 0], &[1, s + n, width])?;
                    let at = (rows.offsets[r] as usize, row.cache.first(layer));
                    let write = |k: &Array, v: &Array| {
                        let held = row.cache.update_and_fetch(layer, k, v)?;
                        if keep {
                            kept.push(held.clone());
                        }
                        Ok(held)
                    };
                    parts.push(attention_own(attention, &mine, at, mask, self.dtype, write)?);
                }
                if keep {
                    rows.kept.push((layer, kept));
                }
            }
        }
        match parts.len() {
            1 => Ok(parts.pop().expect("one part")),
            _ => mlx::concatenate(&parts.iter().collect::<Vec<_>>(), 1),
        }
    }

    /// A KV-shared layer for the whole step: `q` is the step's `[1, T, hq
    /// hd]` queries (normed); each row's attend over what KV layer
    /// `source` holds after its writes this step (kept by
    /// [`keep_kv_of`](Self::keep_kv_of)). Returns `[1, T, hq hd]`. Only
    /// rows attending by MLX's ops have such layers (a model with them
    /// loads so; batched slots are refused at the engine).
    pub fn attend_shared(&mut self, source: usize, attention: &Attention, q: &Array) -> mlx::Result<Array> {
        let refused = |why: &str| mlx::Error { op: "shared_kv", message: why.into() };
        if self.slots.is_some() {
            return Err(refused("batched KV slots hold no KV-shared layers; such a model runs rows with caches of their own"));
        }
        let rows = &mut self.rows;
        let RowPath::Mlx(masks) = &mut rows.path else { return Err(refused("KV-shared layers attend by MLX's ops, not the CPU's fused attention")) };
        let kept = rows.kept.iter().find(|(l, _)| *l == source).map(|(_, kv)| kv).ok_or_else(|| refused("a KV-shared layer's source was not kept"))?;
        let width = attention.heads.q * attention.heads.dim;
        let mut parts = Vec::with_capacity(rows.inputs.len());
        for (r, ((row, mask), (keys, values))) in rows.inputs.iter().zip(masks).zip(kept).enumerate() {
            let (s, n) = (rows.starts[r], rows.lens[r] as i32);
            let mine = q.slice(&[0, s, 0], &[1, s + n, width])?;
            let (offset, first) = (rows.offsets[r] as usize, row.cache.first(source));
            let q = attention.rotated_queries(&mine, offset)?;
            parts.push(attention_over(attention, &q, keys, values, (offset, first), mask, self.dtype)?);
        }
        match parts.len() {
            1 => Ok(parts.pop().expect("one part")),
            _ => mlx::concatenate(&parts.iter().collect::<Vec<_>>(), 1),
        }
    }

    /// Recurrent layer `layer` for the whole step: `x` is the step's
    /// `[1, T, width]` projected input; `run` takes a row's share of it,
    /// that row's state (`None` before its first token) and the counts of
    /// its tokens after which to capture the state (the state's checkpoints,
    /// see `state_rows.rs`), and returns the row's outputs, its state after
    /// them, which replaces the old one, and the captured states.
    /// Only rows with caches of their own hold state: a batched slot does
    /// not (a hybrid model's server refuses that layout).
    pub fn recur(&mut self, layer: usize, x: &Array, run: impl Fn(&Array, Option<&LayerState>, &[usize]) -> mlx::Result<RecurOut>) -> mlx::Result<Array> {
        if self.slots.is_some() {
            return Err(mlx::Error {
                op: "recurrent_state",
                message: "batched KV slots hold no recurrent state; a hybrid model runs rows with caches of their own".into(),
            });
        }
        let rows = &mut self.rows;
        let width = x.dim(2) as i32;
        let (mut parts, single) = (Vec::with_capacity(rows.inputs.len()), rows.inputs.len() == 1);
        for (r, row) in rows.inputs.iter_mut().enumerate() {
            let (s, n) = (rows.starts[r], rows.lens[r] as i32);
            let state = row
                .cache
                .recurrent_mut()
                .ok_or_else(|| mlx::Error { op: "recurrent_state", message: "a recurrent layer's row has a cache without recurrent state".into() })?;
            let mine = if single { x.clone() } else { x.slice(&[0, s, 0], &[1, s + n, width])? };
            let offset = rows.offsets[r] as usize;
            let capture = state.capture_points(offset, n as usize, row.n_logits);
            let (out, next, captured) = run(&mine, state.layer(layer)?, &capture)?;
            state.set_layer(layer, next);
            for (t, at) in captured.into_iter().zip(&capture) {
                state.record(layer, offset + at, t);
            }
            parts.push(out);
        }
        match parts.len() {
            1 => Ok(parts.pop().expect("one part")),
            _ => mlx::concatenate(&parts.iter().collect::<Vec<_>>(), 1),
        }
    }

    /// After the last layer: every cache moves past the step's tokens.
    /// Returns, in the flattened batch, the (first position, count) of the
    /// tokens whose logits are wanted: each batched slot's last `logits`
    /// real tokens, then each row's last `n_logits`.
    pub fn finish(self) -> Vec<(i32, i32)> {
        let rows = self.rows;
        for (row, &n) in rows.inputs.iter_mut().zip(&rows.lens) {
            row.cache.advance(n);
        }
        let mut spans: Vec<(i32, i32)> = Vec::new();
        if let Some(slots) = self.slots {
            slots.input.kv.advance(&slots.step.real);
            spans.extend(slots.step.logit_spans(&slots.input.logits).map(|(at, k)| (at as i32, k as i32)));
        }
        spans.extend(rows.inputs.iter().enumerate().map(|(r, row)| (rows.starts[r] + rows.lens[r] as i32 - row.n_logits as i32, row.n_logits as i32)));
        spans
    }

    /// How many of [`finish`](Self::finish)'s spans are batched slots'.
    pub fn slot_count(&self) -> usize {
        self.slots.as_ref().map_or(0, |s| s.step.slots)
    }
}

impl Slots<'_> {
    /// The slots' attention of one layer: the shared attention (if any slot
    /// takes part), then each alone slot's, gathered back into the batched
    /// part's rows. `mine` is the batched part's `[1, tokens, ..]` projection.
    fn attend(&mut self, layer: usize, attention: &Attention, mine: &Array, dtype: Dtype) -> mlx::Result<Array> {
        let (step, kv) = (&self.step, &mut *self.input.kv);
        let width = attention.heads.qkv_width();
        let mut outputs = Vec::with_capacity(1 + step.alone.len());
        if step.shared {
            outputs.push(attention_batched(layer, attention, &step.to_shared(mine)?, kv, step)?);
        }
        for (alone, window_mask) in step.alone.iter().zip(&mut self.window_masks) {
            let (at, n) = (alone.start as i32, alone.queries as i32);
            let rows = mine.slice(&[0, at, 0], &[1, at + n, width])?;
            outputs.push(match &alone.mask {
                Some(mask) => attention_alone(layer, attention, &rows, kv, alone, mask)?,
                // A batch with window layers: each attends over its own keys.
                None => {
                    let first = kv.first(layer, alone.slot);
                    attention_own(attention, &rows, (alone.offset, first), window_mask, dtype, |k, v| kv.write_slot(layer, alone.slot, alone.offset, k, v))?
                }
            });
        }
        step.to_flat(&outputs)
    }
}

/// Attention of one layer for one sequence over its own keys: `qkv` is
/// its `[1, n, ..]` rows at positions `offset ..`; `write` stores the new
/// keys and values and returns all those held, positions `first ..`
/// (`first` > 0 only on a sliding-window layer). `window_mask` keeps the
/// row's window mask for its other window layers this step. Returns
/// `[1, n, n_heads * head_dim]`.
fn attention_own<W>(a: &Attention, qkv: &Array, at: (usize, usize), window_mask: &mut Option<Array>, dtype: Dtype, write: W) -> mlx::Result<Array>
where
    W: FnOnce(&Array, &Array) -> mlx::Result<(Array, Array)>,
{
    let (q, k, v) = a.rotated_heads(qkv, at.0)?;
    let (keys, values) = write(&k, &v)?;
    attention_over(a, &q, &keys, &values, at, window_mask, dtype)
}

/// The rotated queries `[1, hq, n, hd]` of one sequence at positions
/// `offset ..` over its `keys` and `values` of positions `first ..` (see
/// [`attention_own`]). Returns `[1, n, n_heads * head_dim]`.
fn attention_over(
    a: &Attention,
    q: &Array,
    keys: &Array,
    values: &Array,
    (offset, first): (usize, usize),
    window_mask: &mut Option<Array>,
    dtype: Dtype,
) -> mlx::Result<Array> {
    let Heads { q: hq, dim: hd, .. } = a.heads;
    let n = q.dim(2) as i32;
    let out = match a.window {
        // Causal: query i sits at offset + i and sees keys up to there.
        None => fast::sdpa(q, keys, values, a.scale(), if n > 1 { Mask::Causal } else { Mask::None })?,
        Some(window) => {
            if window_mask.is_none() {
                *window_mask = Some(gemma3::window_mask(offset, n as usize, first, window, dtype)?);
            }
            fast::sdpa(q, keys, values, a.scale(), Mask::Array(window_mask.as_ref().expect("built above")))?
        }
    };
    out.transpose(&[0, 2, 1, 3])?.reshape(&[1, n, hq * hd])
}

/// Attention of one layer for a batched slot's chunk on its own (see
/// [`BatchStep`]): `qkv` is its `[1, queries, ..]` rows, its real tokens
/// first, at positions `alone.offset ..`. Only the real tokens' keys and
/// values are written; every query attends over the slot's whole
/// capacity under `mask`, so the shape is (queries, capacity class)
/// whatever the chunk's end (a padding query's output is dropped).
/// Returns `[1, queries, n_heads * head_dim]`.
pub(super) fn attention_alone(layer: usize, a: &Attention, qkv: &Array, kv: &mut KvBatch, alone: &AloneSlot, mask: &Array) -> mlx::Result<Array> {
    let Heads { q: hq, kv: hkv, dim: hd } = a.heads;
    let n = qkv.dim(1) as i32;
    let (q, k, v) = a.rotated_heads(qkv, alone.offset)?;
    let real = alone.tokens as i32;
    let (k, v) = if real < n { (k.slice(&[0, 0, 0, 0], &[1, hkv, real, hd])?, v.slice(&[0, 0, 0, 0], &[1, hkv, real, hd])?) } else { (k, v) };
    let (keys, values) = kv.write_slot_whole(layer, alone.slot, alone.offset, &k, &v)?;
    let out = fast::sdpa(&q, &keys, &values, a.scale(), Mask::Array(mask))?;
    out.transpose(&[0, 2, 1, 3])?.reshape(&[1, n, hq * hd])
}

/// The shared attention of one layer for every slot of a [`KvBatch`]:
/// `qkv` is `[1, slots * n, ..]`, slot-major. One rope each for queries
/// and keys (each slot at its own offset), one scatter each into the key
/// and value buffers, one masked attention. Returns `[1, slots * n, n_heads * head_dim]`.
pub(super) fn attention_batched(layer: usize, a: &Attention, qkv: &Array, kv: &mut KvBatch, step: &BatchStep) -> mlx::Result<Array> {
    let Heads { q: hq, kv: hkv, dim: hd } = a.heads;
    let (slots, n) = (step.slots as i32, step.n as i32);
    let x = qkv.reshape(&[slots, n, hq + 2 * hkv, hd])?;
    let heads = |from: i32, to: i32| x.slice(&[0, 0, from, 0], &[slots, n, to, hd])?.transpose(&[0, 2, 1, 3]);
    let rope = |h: &Array| a.rope.apply_at(h, &step.offsets);
    let q = rope(&heads(0, hq)?)?;
    let k = rope(&heads(hq, hq + hkv)?)?;
    let v = heads(hq + hkv, hq + 2 * hkv)?;
    // Window layers index each slot's keys from its first position.
    let (positions, mask) = match (&step.window, kv.window(layer)) {
        (Some((positions, mask)), Some(_)) => (positions, mask),
        _ => (&step.positions, &step.mask),
    };
    let (keys, values) = kv.write(layer, &k, &v, positions)?;
    let out = fast::sdpa(&q, &keys, &values, a.scale(), Mask::Array(mask))?; // [slots, hq, n, hd]
    out.transpose(&[0, 2, 1, 3])?.reshape(&[1, slots * n, hq * hd])
}

/// Attention of one layer for the rows on the CPU, as one graph node
/// however many rows there are ([`fast::cpu_layer_attention`]): RoPE on
/// all tokens' queries and keys (each token at its own position, by the
/// step's table), each row's cache writes, and the attention over every
/// row's cache. Returns `[1, T, n_heads * head_dim]`.
fn attention_cpu_kernel(
    layer: usize,
    a: &Attention,
    qkv: &Array,
    rows: &mut [RowInput<'_>],
    lens: &[usize],
    rope_tables: &mut RopeTables,
    codes: KvCodes,
) -> mlx::Result<Array> {
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
        rope_tables.table(&a.rope).and_then(|rope| fast::cpu_layer_attention(qkv, rope, a.heads.q as usize, &attention_rows, keys, a.window, codes))
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

/// Hands each row its layer `layer` buffers back (see [`KvCache::take_for_write`](super::KvCache::take_for_write)).
fn put_back_all(rows: &mut [RowInput<'_>], layer: usize, buffers: Vec<(Array, Array)>) {
    for (row, (keys, values)) in rows.iter_mut().zip(buffers) {
        row.cache.put_back(layer, keys, values);
    }
}
