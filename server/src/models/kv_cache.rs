//! A sequence's key/value cache, preallocated in blocks and written in place.
//!
//! Each layer holds `[1, kv_heads, capacity, head_dim]` buffers. New keys are
//! written with `slice_update` at the current length; because the cache is the
//! buffer's only holder when the step is evaluated, MLX donates it and the
//! write happens in place (no per-step concatenation). Rolling back (rejected
//! draft tokens) is just moving `len` back: stale positions are overwritten
//! by the next write and never read, since attention only sees `..len`.
//!
//! Sliding-window layers (Gemma 3's local layers) keep only what a query can
//! still see: their buffers hold positions `first ..` (at index `p - first`),
//! and when a step would overflow them, the positions older than the window
//! are dropped in one copy and the buffer is sized again to the window plus
//! the step and a little room ([`WINDOW_ROOM`]), so however long a session
//! grows, those layers hold about a window. A window layer can then only be
//! rolled back as far as [`earliest_truncation`](KvCache::earliest_truncation).
//!
//! For the CPU's fused attention the keys are stored in blocks
//! ([`KeyLayout::Blocks`]): the order its score loop reads them in, written
//! so by its cache write, so no step transposes a row's whole history again.
//! Everything else here handles such keys in whole blocks, and
//! [`positions`](KvCache::positions) and [`fill`](KvCache::fill) convert
//! at the edges (moving a cache into a batch slot, or out of one).
//!
//! 8- and 4-bit KV (the CPU's fused attention only): a cache given a
//! [`KvQuantization`] holds float32 until its length would pass the
//! quantization's start, then turns its buffers into codes once
//! ([`mlx::fast::KvCodes::Affine`]) and writes every later position as codes:
//! a short exchange stays exact, and a long history takes a little over a
//! quarter (an eighth) of the bytes, and of the reading a decode step does. Positions
//! are still rows of the buffers' third axis, so growing, windows,
//! rollback and storing work on codes as on floats; only the write, the
//! attention and [`positions`](KvCache::positions) read inside a row.
use mlx::fast::{KeyLayout, KvCodes, KEY_BLOCK};
use mlx::{Array, Dtype};

use super::kv::{Kv, LayerKv};
use super::kv_codes;
use super::state_rows::RecurrentState;

/// Capacity grows in multiples of this many tokens.
pub const CAPACITY_STEP: usize = 256;
const _: () = assert!(CAPACITY_STEP.is_multiple_of(KEY_BLOCK), "caches with keys in blocks hold whole blocks");

/// Positions a window layer's buffer holds beyond the window and the step
/// when it is sized again: how many decode steps pass between the copies
/// that drop old positions (each copies about a window).
pub const WINDOW_ROOM: usize = 2 * KEY_BLOCK;

/// Positions a window layer keeps before the oldest one its next query
/// sees, so the cache can still be rolled back this far: a prefix-cache hit
/// lands on a 16-token block boundary below the stored length, and rejected
/// drafts roll back a few.
pub const WINDOW_ROLLBACK: usize = KEY_BLOCK;

/// The first position a window layer of `window` keeps at length `len`:
/// the oldest its next query sees, less [`WINDOW_ROLLBACK`], down to a whole
/// key block.
pub fn window_first(len: usize, window: usize) -> usize {
    len.saturating_sub(window - 1 + WINDOW_ROLLBACK) / KEY_BLOCK * KEY_BLOCK
}

/// `[1, heads, len, dim]` position-order keys laid out in blocks, padded
/// with zeros to whole blocks: `[1, heads, ceil(len / KEY_BLOCK) * KEY_BLOCK, dim]`.
fn into_blocks(keys: &Array, len: usize) -> mlx::Result<Array> {
    let (h, d) = (keys.dim(1), keys.dim(3));
    let padded = Array::zeros(&[1, h, whole_blocks(len), d], keys.dtype())?.slice_update(keys, &[0; 4], &[1, h as i32, len as i32, d as i32])?;
    transpose_blocks(&padded, (KEY_BLOCK, d))
}

/// The first `len` positions of a key buffer stored in blocks, in position
/// order (a copy).
fn out_of_blocks(keys: &Array, len: usize) -> mlx::Result<Array> {
    let (h, d) = (keys.dim(1) as i32, keys.dim(3) as i32);
    let whole = keys.slice(&[0; 4], &[1, h, whole_blocks(len) as i32, d])?;
    transpose_blocks(&whole, (d as usize, KEY_BLOCK))?.slice(&[0; 4], &[1, h, len as i32, d])
}

/// Positions rounded up to whole key blocks.
fn whole_blocks(len: usize) -> usize {
    len.div_ceil(KEY_BLOCK) * KEY_BLOCK
}

/// `[1, heads, n, dim]` (n whole blocks) with each block, read as `(rows,
/// cols)` = `block`, transposed, back in the same shape (a copy).
fn transpose_blocks(a: &Array, block: (usize, usize)) -> mlx::Result<Array> {
    let (h, n, d) = (a.dim(1) as i32, a.dim(2) as i32, a.dim(3) as i32);
    let blocks = n / KEY_BLOCK as i32;
    a.reshape(&[1, h, blocks, block.0 as i32, block.1 as i32])?.transpose(&[0, 1, 2, 4, 3])?.reshape(&[1, h, n, d])
}

/// A zeroed 4-d buffer of `shape` holding a copy of `old`'s leading
/// `keep` region (`[..keep[0], ..keep[1], ..]`), or nothing when there is
/// no `old` or the region is empty: how KV buffers grow.
pub(super) fn zeros_keeping(shape: &[usize; 4], dtype: Dtype, old: Option<&Array>, keep: [usize; 4]) -> mlx::Result<Array> {
    let fresh = Array::zeros(shape, dtype)?;
    match old {
        Some(old) if keep.iter().all(|&k| k > 0) => {
            let stop = keep.map(|k| k as i32);
            fresh.slice_update(&old.slice(&[0; 4], &stop)?, &[0; 4], &stop)
        }
        _ => Ok(fresh),
    }
}

/// When and into what codes a cache turns (see the module notes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvQuantization {
    /// Bits per code: 8 or 4.
    pub bits: u8,
    /// Features per group sharing a scale and a bias (divides the head size).
    pub group: usize,
    /// Positions a cache holds in full precision before it converts.
    pub start: usize,
}

impl KvQuantization {
    /// The codes a cache of this quantization turns into.
    pub fn codes(&self) -> KvCodes {
        KvCodes::Affine { bits: self.bits, group: self.group }
    }

    /// Bytes one position holds across all layers once its cache holds codes.
    pub fn bytes_per_token(&self, config: &super::ModelConfig) -> usize {
        2 * config.n_layers * config.n_kv_heads * self.codes().width(config.head_dim)
    }
}

/// A cache's bookkeeping beside its buffers, when it is stored as is.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StoredCache {
    pub len: usize,
    pub capacity: usize,
    pub window_first: usize,
    pub window_capacity: usize,
    /// The (bits, group) of the codes the buffers hold (`None`: full precision).
    #[serde(default)]
    pub codes: Option<(u8, usize)>,
}

impl StoredCache {
    fn codes(&self) -> KvCodes {
        self.codes.map_or(KvCodes::Float, |(bits, group)| KvCodes::Affine { bits, group })
    }
}

/// Cloning shares every buffer (MLX arrays are reference-counted values): a
/// clone is a copy-on-write snapshot, and the first write to either side
/// copies that layer's buffer because it is no longer uniquely held.
#[derive(Clone)]
pub struct KvCache {
    layers: Vec<Option<(Array, Array)>>,
    /// Per layer, its attention window (`None`: it sees the whole history).
    windows: Vec<Option<usize>>,
    len: usize,
    /// Positions the whole-history layers have room for.
    capacity: usize,
    /// The window layers' span: the first position they hold, and room.
    window_first: usize,
    window_capacity: usize,
    /// Per layer, its (kv heads, head dim): one for every layer of most
    /// models; Gemma 4's window and whole-history layers differ.
    shapes: Vec<(usize, usize)>,
    /// Full precision's dtype (buffers of codes are uint8).
    dtype: Dtype,
    keys: KeyLayout,
    /// How the buffers hold features now, and when they turn to codes.
    codes: KvCodes,
    quantization: Option<KvQuantization>,
    /// A hybrid model's recurrent layers' state at `len` (see `state_rows.rs`;
    /// boxed: most caches have none).
    recurrent: Option<Box<RecurrentState>>,
}

impl KvCache {
    /// An empty cache storing keys in position order.
    pub fn new(n_layers: usize, kv_heads: usize, head_dim: usize, dtype: Dtype) -> KvCache {
        KvCache {
            layers: (0..n_layers).map(|_| None).collect(),
            windows: vec![None; n_layers],
            len: 0,
            capacity: 0,
            window_first: 0,
            window_capacity: 0,
            shapes: vec![(kv_heads, head_dim); n_layers],
            dtype,
            keys: KeyLayout::Positions,
            codes: KvCodes::Float,
            quantization: None,
            recurrent: None,
        }
    }

    /// The same cache also holding the state of `layers` recurrent layers
    /// (a hybrid model's); set before anything is stored.
    pub fn with_recurrent_layers(mut self, layers: usize) -> KvCache {
        assert!(self.is_empty(), "recurrent layers are set on an empty cache");
        self.recurrent = (layers > 0).then(|| Box::new(RecurrentState::new(layers)));
        self
    }

    /// The recurrent layers' state, if the model has such layers.
    pub fn recurrent(&self) -> Option<&RecurrentState> {
        self.recurrent.as_deref()
    }

    /// The recurrent layers' state, to read and replace within a step.
    pub fn recurrent_mut(&mut self) -> Option<&mut RecurrentState> {
        self.recurrent.as_deref_mut()
    }

    /// The same cache holding `state` as its recurrent layers' (read back
    /// from a file); an error when it has none or other layers.
    pub fn with_recurrent_state(mut self, state: RecurrentState) -> mlx::Result<KvCache> {
        match &self.recurrent {
            Some(s) if s.num_layers() == state.num_layers() => {
                self.recurrent = Some(Box::new(state));
                Ok(self)
            }
            _ => Err(mlx::Error { op: "kv_cache", message: "a recurrent state that does not fit this cache's layers".into() }),
        }
    }

    /// An empty cache storing keys in blocks, for the CPU's fused attention
    /// (written by [`write_step`](Self::write_step) or, through
    /// [`take_for_write`](Self::take_for_write), the CPU's layer attention node).
    pub fn with_keys_in_blocks(n_layers: usize, kv_heads: usize, head_dim: usize, dtype: Dtype) -> KvCache {
        KvCache { keys: KeyLayout::Blocks, ..KvCache::new(n_layers, kv_heads, head_dim, dtype) }
    }

    /// The same cache whose layers hold `shapes` (one (kv heads, head dim)
    /// per layer); set before anything is stored.
    pub fn with_layer_shapes(mut self, shapes: Vec<(usize, usize)>) -> KvCache {
        assert!(self.is_empty() && shapes.len() == self.layers.len(), "layer shapes are set on an empty cache, one per layer");
        self.shapes = shapes;
        self
    }

    /// The same cache whose layers attend within `windows` (one per layer,
    /// `None` for a whole-history layer); set before anything is stored.
    pub fn with_windows(mut self, windows: Vec<Option<usize>>) -> KvCache {
        assert!(self.is_empty() && windows.len() == self.layers.len(), "windows are set on an empty cache, one per layer");
        self.windows = windows;
        self
    }

    /// The same cache turning to codes as `q` says (`None`: never);
    /// set before anything is stored. Keys in blocks: float32 only (the
    /// CPU's fused attention writes and reads the codes). Keys in position
    /// order: the cache only carries rows of codes to and from batched
    /// slots, which write them (`kv_batch.rs`; [`fill_rows`](Self::fill_rows)).
    pub fn with_quantization(mut self, q: Option<KvQuantization>) -> mlx::Result<KvCache> {
        assert!(self.is_empty(), "quantization is set on an empty cache");
        if let Some(q) = q {
            let fits = self.shapes.iter().all(|&(_, d)| q.group > 0 && d.is_multiple_of(q.group) && (q.bits == 8 || (q.bits == 4 && d.is_multiple_of(2))));
            if (self.keys == KeyLayout::Blocks && self.dtype != Dtype::F32) || !fits {
                let why = format!(
                    "8- or 4-bit KV needs 8 or 4 bits, a group dividing the head size {}, and float32 where the CPU's fused attention reads it",
                    self.shapes.first().map_or(0, |s| s.1)
                );
                return Err(mlx::Error { op: "kv_cache", message: why });
            }
        }
        self.quantization = q;
        Ok(self)
    }

    /// A cache of the same model and layout (layers, heads, dtype, key
    /// layout, windows, quantization) holding nothing, in full precision:
    /// what [`fill`](Self::fill) restores a stored copy into.
    pub fn emptied(&self) -> KvCache {
        let empty = KvCache::new(self.layers.len(), 0, 0, self.dtype);
        let recurrent = self.recurrent.as_ref().map(|s| Box::new(s.emptied()));
        KvCache { keys: self.keys, quantization: self.quantization, recurrent, shapes: self.shapes.clone(), ..empty }.with_windows(self.windows.clone())
    }

    /// How the buffers hold features now.
    pub fn codes(&self) -> KvCodes {
        self.codes
    }

    /// Layer `layer`'s buffers' kv heads, last dimension and dtype when they hold `codes`.
    fn buffer_form(&self, layer: usize, codes: KvCodes) -> (usize, usize, Dtype) {
        let (heads, dim) = self.shapes[layer];
        match codes {
            KvCodes::Float => (heads, dim, self.dtype),
            KvCodes::Affine { .. } => (heads, codes.width(dim), Dtype::U8),
        }
    }

    /// The last dimension and dtype of each buffer of a stored copy, per
    /// layer by its room: what reading one back must produce (of the first
    /// layer's shape: a cache whose layers differ checks each in
    /// [`from_stored`](Self::from_stored)).
    pub fn stored_form(&self, stored: &StoredCache) -> (usize, Dtype) {
        let (_, width, dtype) = self.buffer_form(0, stored.codes());
        (width, dtype)
    }

    /// Turns a full-precision cache into `codes`, once: every position held
    /// so far is quantized, and later writes quantize theirs.
    fn quantize_held(&mut self, codes: KvCodes) -> mlx::Result<()> {
        let held = (0..self.layers.len()).map(|l| self.positions(l)).collect::<mlx::Result<Option<Vec<_>>>>()?;
        let mut codes = KvCache { codes, ..self.emptied() };
        match held {
            Some(layers) if !self.is_empty() => codes.fill(&layers, self.len, self.window_first)?,
            _ => {}
        }
        *self = codes;
        Ok(())
    }

    /// Its bookkeeping and every layer's whole buffers (spare room
    /// included, keys in the cache's own layout): what storing the cache
    /// elsewhere as is takes, besides its [`recurrent`](Self::recurrent)
    /// state if it has one. `None` for a cache with an empty layer.
    pub fn as_stored(&self) -> Option<(StoredCache, Vec<(&Array, &Array)>)> {
        let layers = self.layers.iter().map(|l| l.as_ref().map(|(k, v)| (k, v))).collect::<Option<Vec<_>>>()?;
        let codes = match self.codes {
            KvCodes::Float => None,
            KvCodes::Affine { bits, group } => Some((bits, group)),
        };
        let stored = StoredCache { len: self.len, capacity: self.capacity, window_first: self.window_first, window_capacity: self.window_capacity, codes };
        Some((stored, layers))
    }

    /// The cache [`as_stored`](Self::as_stored) described, shaped like this
    /// (empty) one, owning `layers` as its buffers; an error when they do
    /// not fit the bookkeeping or this cache's geometry.
    pub fn from_stored(&self, stored: &StoredCache, layers: Vec<(Array, Array)>) -> mlx::Result<KvCache> {
        let whole_fits = self.windows.iter().all(Option::is_some) || stored.len <= stored.capacity;
        let window_fits = self.widest_window().is_none() || (stored.window_first <= stored.len && stored.len <= stored.window_first + stored.window_capacity);
        // Codes are read only by the fused attention, and only in this
        // quantization's bits and groups (a server started with other settings misses).
        let codes_fit = match stored.codes() {
            KvCodes::Float => true,
            codes => self.quantization.is_some_and(|q| q.codes() == codes),
        };
        let fits = layers.len() == self.layers.len()
            && codes_fit
            && whole_fits
            && window_fits
            && layers.iter().zip(&self.windows).enumerate().all(|(layer, ((k, v), w))| {
                let room = if w.is_some() { stored.window_capacity } else { stored.capacity };
                let (heads, width, dtype) = self.buffer_form(layer, stored.codes());
                let shape = [1, heads, room, width];
                k.shape() == shape && v.shape() == shape && k.dtype() == dtype && v.dtype() == dtype
            });
        if !fits || !self.is_empty() {
            return Err(mlx::Error { op: "kv_cache", message: "stored buffers do not fit this cache".into() });
        }
        Ok(KvCache {
            layers: layers.into_iter().map(Some).collect(),
            len: stored.len,
            capacity: stored.capacity,
            window_first: stored.window_first,
            window_capacity: stored.window_capacity,
            codes: stored.codes(),
            ..self.clone()
        })
    }

    /// (layers, kv heads, head dim, dtype): what a stored copy must match
    /// (the first layer's heads and size; [`layer_shapes`](Self::layer_shapes) has each).
    pub fn geometry(&self) -> (usize, usize, usize, Dtype) {
        let (heads, dim) = self.shapes.first().copied().unwrap_or_default();
        (self.layers.len(), heads, dim, self.dtype)
    }

    /// Per layer, its (kv heads, head dim).
    pub fn layer_shapes(&self) -> &[(usize, usize)] {
        &self.shapes
    }

    /// The first position the window layers hold (0 without window layers).
    pub fn window_first(&self) -> usize {
        self.window_first
    }

    /// Per layer, its attention window.
    pub fn windows(&self) -> &[Option<usize>] {
        &self.windows
    }

    /// How the keys are stored.
    pub fn key_layout(&self) -> KeyLayout {
        self.keys
    }

    /// Positions a copy of the first `len` must take: whole blocks when
    /// keys are stored in blocks.
    fn copied_positions(&self, len: usize) -> usize {
        match self.keys {
            KeyLayout::Positions => len,
            KeyLayout::Blocks => whole_blocks(len),
        }
    }

    /// Tokens whose keys and values are stored.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first position layer `layer` holds (at index 0 of its buffers):
    /// 0 for a whole-history layer.
    pub fn first(&self, layer: usize) -> usize {
        if self.windows[layer].is_some() {
            self.window_first
        } else {
            0
        }
    }

    /// Whether some layer attends within a window (and so drops its oldest
    /// positions as the cache grows).
    pub fn has_windows(&self) -> bool {
        self.widest_window().is_some()
    }

    /// The largest window of the window layers (what they must keep).
    fn widest_window(&self) -> Option<usize> {
        self.windows.iter().flatten().copied().max()
    }

    /// The shortest length this cache can be truncated to and still go on:
    /// the next query must find its whole window in the window layers, and
    /// recurrent state holds its own length only (none, once rolled back),
    /// besides its [`checkpoint_lens`](Self::checkpoint_lens).
    pub fn earliest_truncation(&self) -> usize {
        match &self.recurrent {
            Some(state) if state.is_rolled_back() => return usize::MAX,
            Some(_) => return self.len,
            None => {}
        }
        match self.widest_window() {
            Some(w) if self.window_first > 0 => self.window_first + w - 1,
            _ => 0,
        }
    }

    /// The lengths below [`earliest_truncation`](Self::earliest_truncation)
    /// it can also be truncated to: a hybrid model's state checkpoints
    /// (see `state_rows.rs`).
    pub fn checkpoint_lens(&self) -> Vec<usize> {
        self.recurrent.as_ref().map_or_else(Vec::new, |s| s.checkpoint_lens(self.len))
    }

    /// Forgets everything after the first `len` tokens. Not below
    /// [`earliest_truncation`](Self::earliest_truncation), which the engine's
    /// rollbacks never reach (they stay at or after the last step's start)
    /// and the prefix cache checks.
    /// A cache with recurrent state cut back below its length goes back to
    /// its checkpoint there, or without one is rolled back (see
    /// `state_rows.rs`): it cannot run on nor serve.
    pub fn truncate(&mut self, len: usize) {
        if let Some(state) = self.recurrent.as_mut().filter(|_| len < self.len) {
            state.rewind(len);
        } else {
            debug_assert!(len >= self.earliest_truncation().min(self.len), "truncating to {len} drops keys the window still needs");
        }
        self.len = self.len.min(len);
    }

    /// Bytes reserved on the device.
    pub fn nbytes(&self) -> usize {
        let state = self.recurrent.as_ref().map_or(0, |s| s.nbytes(self.len));
        state + self.layers.iter().flatten().map(|(k, v)| k.nbytes() + v.nbytes()).sum::<usize>()
    }

    /// Bytes reserved by the window layers.
    pub fn window_nbytes(&self) -> usize {
        self.layers.iter().zip(&self.windows).filter(|(_, w)| w.is_some()).filter_map(|(l, _)| l.as_ref()).map(|(k, v)| k.nbytes() + v.nbytes()).sum()
    }

    /// Makes room for `extra` more tokens in every layer: whole-history
    /// layers grow together; window layers drop what no query will see
    /// again when they would overflow (see the module notes).
    /// A cache with a quantization turns to codes here, before the
    /// write that would take it past the start.
    pub fn reserve(&mut self, extra: usize) -> mlx::Result<()> {
        let needed = self.len + extra;
        if let Some(q) = self.quantization {
            if self.codes == KvCodes::Float && needed > q.start {
                self.quantize_held(q.codes())?;
            }
        }
        if needed > self.capacity && self.windows.iter().any(Option::is_none) {
            let new_cap = needed.div_ceil(CAPACITY_STEP) * CAPACITY_STEP;
            let kept = self.copied_positions(self.len);
            let forms: Vec<_> = (0..self.layers.len()).map(|l| self.buffer_form(l, self.codes)).collect();
            for ((layer, _), (heads, width, dtype)) in self.layers.iter_mut().zip(&self.windows).zip(forms).filter(|((_, w), _)| w.is_none()) {
                let (shape, keep) = ([1, heads, new_cap, width], [1, heads, kept, width]);
                let fresh = |old: Option<&Array>| zeros_keeping(&shape, dtype, old, keep);
                let (k, v) = match layer.take() {
                    Some((k, v)) => (fresh(Some(&k))?, fresh(Some(&v))?),
                    None => (fresh(None)?, fresh(None)?),
                };
                *layer = Some((k, v));
            }
            self.capacity = new_cap;
        }
        if let Some(window) = self.widest_window() {
            if needed > self.window_first + self.window_capacity {
                self.resize_window_layers(window, extra)?;
            }
        }
        Ok(())
    }

    /// Drops the positions no query from the current length on can see
    /// (keeping whole key blocks and [`WINDOW_ROLLBACK`]) and sizes the window layers for the
    /// window, `extra` new tokens and [`WINDOW_ROOM`].
    fn resize_window_layers(&mut self, window: usize, extra: usize) -> mlx::Result<()> {
        let first = window_first(self.len, window).max(self.window_first);
        // (An empty cache being filled may start past its length so far.)
        let capacity = (self.len + extra - first + WINDOW_ROOM).div_ceil(KEY_BLOCK) * KEY_BLOCK;
        // Indices in the old buffers: from the new first position to the
        // current length (for keys in blocks, to the end of its block).
        let from = (first - self.window_first) as i32;
        let held = self.len.saturating_sub(self.window_first);
        let (key_held, value_held) = (self.copied_positions(held) as i32, held as i32);
        let forms: Vec<_> = (0..self.layers.len()).map(|l| self.buffer_form(l, self.codes)).collect();
        for ((layer, _), (heads, width, dtype)) in self.layers.iter_mut().zip(&self.windows).zip(forms).filter(|((_, w), _)| w.is_some()) {
            let (h, d) = (heads as i32, width as i32);
            let kept = |to: i32| -> (i32, [i32; 4]) { (to - from, [1, h, to, d]) };
            let ((key_kept, key_stop), (value_kept, value_stop)) = (kept(key_held), kept(value_held));
            let move_over = |old: Option<&Array>, kept: i32, stop: [i32; 4]| -> mlx::Result<Array> {
                let fresh = Array::zeros(&[1, heads, capacity, width], dtype)?;
                match old {
                    Some(old) if kept > 0 => fresh.slice_update(&old.slice(&[0, 0, from, 0], &stop)?, &[0; 4], &[1, h, kept, d]),
                    _ => Ok(fresh),
                }
            };
            let old = layer.take();
            *layer = Some((move_over(old.as_ref().map(|o| &o.0), key_kept, key_stop)?, move_over(old.as_ref().map(|o| &o.1), value_kept, value_stop)?));
        }
        self.window_first = first;
        self.window_capacity = capacity;
        Ok(())
    }

    /// Room layer `layer` has, in positions from its first.
    fn layer_capacity(&self, layer: usize) -> usize {
        if self.windows[layer].is_some() {
            self.window_capacity
        } else {
            self.capacity
        }
    }

    /// Like [`update_and_fetch`](LayerKv::update_and_fetch) for the CPU's fused attention: writes
    /// tokens `start .. start + n` of a whole step's keys and values
    /// (`[1, T, kv_heads * head_dim]` or `[T, kv_heads, 1, head_dim]`, views
    /// allowed) at the current length, and returns the updated buffers whole
    /// (valid up to `len + n`, from `first(layer)`). In place unless a
    /// snapshot shares the buffer.
    pub fn write_step(&mut self, layer: usize, keys: &Array, values: &Array, start: usize, n: usize) -> mlx::Result<(Array, Array)> {
        let at = self.len - self.first(layer);
        let (old_k, old_v) = self.take_for_write(layer, n)?;
        let write = |old: &Array, fresh: &Array, layout| mlx::fast::cpu_kv_write(old, fresh, start, n, at, layout, self.codes);
        match write(&old_k, keys, self.keys).and_then(|k| Ok((k, write(&old_v, values, KeyLayout::Positions)?))) {
            Ok((new_k, new_v)) => {
                drop((old_k, old_v)); // the graph now holds the only reference: the write can be in place
                self.put_back(layer, new_k.clone(), new_v.clone());
                Ok((new_k, new_v))
            }
            Err(e) => {
                self.put_back(layer, old_k, old_v);
                Err(e)
            }
        }
    }

    /// Layer `layer`'s buffers, taken out of the cache for a graph node that
    /// writes `n` new positions at the current length (index
    /// `len - first(layer)`) and whose updated buffers go back through
    /// [`put_back`](Self::put_back), as [`write_step`](Self::write_step)
    /// does with its own node: once the caller drops these, the node holds
    /// the only reference, so its write can be in place.
    pub fn take_for_write(&mut self, layer: usize, n: usize) -> mlx::Result<(Array, Array)> {
        let at = self.len - self.first(layer);
        if at + n > self.layer_capacity(layer) {
            return Err(mlx::Error { op: "kv_cache", message: format!("append of {n} past capacity {}", self.layer_capacity(layer)) });
        }
        self.layers[layer].take().ok_or_else(|| mlx::Error { op: "kv_cache", message: "layer not reserved".into() })
    }

    /// Puts layer `layer`'s buffers back after [`take_for_write`](Self::take_for_write):
    /// the updated ones, or the taken ones when building the write failed.
    pub fn put_back(&mut self, layer: usize, keys: Array, values: Array) {
        self.layers[layer] = Some((keys, values));
    }

    /// Layer `layer`'s stored keys and values in position order, the
    /// positions `first(layer) .. len` as `[1, kv_heads, len - first, head_dim]`
    /// (lazy views, or a reordered copy of keys stored in blocks); `None`
    /// when the layer holds nothing.
    pub fn positions(&self, layer: usize) -> mlx::Result<Option<(Array, Array)>> {
        let Some((k, v)) = self.layers.get(layer).and_then(Option::as_ref) else { return Ok(None) };
        let held = self.len - self.first(layer);
        if held == 0 {
            return Ok(None);
        }
        if self.codes != KvCodes::Float && self.keys == KeyLayout::Blocks {
            let read = |a: &Array, layout| mlx::fast::cpu_kv_dequantize(a, held, layout, self.codes);
            return Ok(Some((read(k, self.keys)?, read(v, KeyLayout::Positions)?)));
        }
        let (heads, dim) = self.shapes[layer];
        if self.codes != KvCodes::Float {
            let (rk, rv) = self.rows(layer)?.expect("held above");
            let read = |a: &Array| kv_codes::decode(a, self.codes, dim, self.dtype);
            return Ok(Some((read(&rk)?, read(&rv)?)));
        }
        let stop = [1, heads as i32, held as i32, dim as i32];
        let keys = match self.keys {
            KeyLayout::Positions => k.slice(&[0; 4], &stop)?,
            KeyLayout::Blocks => out_of_blocks(k, held)?,
        };
        Ok(Some((keys, v.slice(&[0; 4], &stop)?)))
    }

    /// Replaces an empty cache's contents with copies of `layers`, each
    /// `[1, kv_heads, len - first, head_dim]` in position order (views
    /// allowed), where `first` is 0 for a whole-history layer and
    /// `window_first` for a window layer (a multiple of [`KEY_BLOCK`]): the
    /// cache then owns buffers of its own.
    pub fn fill(&mut self, layers: &[(Array, Array)], len: usize, window_first: usize) -> mlx::Result<()> {
        if !self.is_empty() || layers.len() != self.layers.len() || !window_first.is_multiple_of(KEY_BLOCK) || window_first > len {
            return Err(mlx::Error {
                op: "kv_cache",
                message: format!("fill of {} layers from {window_first} into a cache of {} holding {}", layers.len(), self.layers.len(), self.len),
            });
        }
        self.window_first = window_first;
        self.reserve(len)?;
        if self.codes != KvCodes::Float {
            return self.fill_codes(layers, len);
        }
        let keys_in_blocks = self.keys == KeyLayout::Blocks;
        for (layer, (k, v)) in layers.iter().enumerate() {
            let held = len - self.first(layer);
            let (heads, dim) = (self.shapes[layer].0 as i32, self.shapes[layer].1 as i32);
            let stop = [1, heads, held as i32, dim];
            let key_stop = [1, heads, self.copied_positions(held) as i32, dim];
            let (bk, bv) = self.layers[layer].take().expect("reserved above");
            let k = if keys_in_blocks { into_blocks(k, held)? } else { k.clone() };
            self.layers[layer] = Some((bk.slice_update(&k, &[0; 4], &key_stop)?, bv.slice_update(v, &[0; 4], &stop)?));
        }
        self.len = len;
        Ok(())
    }

    /// Layer `layer`'s positions `first(layer) .. len` as the buffers hold
    /// them, `[1, kv_heads, len - first, width]` (lazy views; codes stay
    /// codes), for a cache with keys in position order; `None` when the
    /// layer holds nothing.
    pub fn rows(&self, layer: usize) -> mlx::Result<Option<(Array, Array)>> {
        if self.keys != KeyLayout::Positions {
            return Err(mlx::Error { op: "kv_cache", message: "rows are read from caches with keys in position order".into() });
        }
        let Some((k, v)) = self.layers.get(layer).and_then(Option::as_ref) else { return Ok(None) };
        let held = self.len - self.first(layer);
        if held == 0 {
            return Ok(None);
        }
        let (heads, width, _) = self.buffer_form(layer, self.codes);
        let stop = [1, heads as i32, held as i32, width as i32];
        Ok(Some((k.slice(&[0; 4], &stop)?, v.slice(&[0; 4], &stop)?)))
    }

    /// Replaces an empty cache's contents with copies of `layers` already in
    /// the form `codes` (what [`rows`](Self::rows) gives), each `[1,
    /// kv_heads, len - first, width]`, as [`fill`](Self::fill) does with
    /// features: how batched slots hand a row's codes back without
    /// decoding them. Keys in position order only; `codes` must be this
    /// cache's quantization's (or full precision).
    pub fn fill_rows(&mut self, layers: &[(Array, Array)], len: usize, window_first: usize, codes: KvCodes) -> mlx::Result<()> {
        let form_fits = codes == KvCodes::Float || self.quantization.is_some_and(|q| q.codes() == codes);
        if self.keys != KeyLayout::Positions || !form_fits {
            return Err(mlx::Error { op: "kv_cache", message: format!("rows of {codes:?} do not fit this cache") });
        }
        if codes == KvCodes::Float {
            return self.fill(layers, len, window_first);
        }
        if !self.is_empty() || layers.len() != self.layers.len() || !window_first.is_multiple_of(KEY_BLOCK) || window_first > len {
            return Err(mlx::Error {
                op: "kv_cache",
                message: format!("fill of {} rows into a cache of {} holding {}", layers.len(), self.layers.len(), self.len),
            });
        }
        self.codes = codes;
        self.window_first = window_first;
        self.reserve(len)?;
        for (layer, (k, v)) in layers.iter().enumerate() {
            let (heads, width, _) = self.buffer_form(layer, codes);
            let stop = [1, heads as i32, (len - self.first(layer)) as i32, width as i32];
            let (bk, bv) = self.layers[layer].take().expect("reserved above");
            self.layers[layer] = Some((bk.slice_update(k, &[0; 4], &stop)?, bv.slice_update(v, &[0; 4], &stop)?));
        }
        self.len = len;
        Ok(())
    }

    /// [`fill`](Self::fill)'s writes into a reserved cache of codes:
    /// each layer's positions quantized as a step's tokens would be.
    fn fill_codes(&mut self, layers: &[(Array, Array)], len: usize) -> mlx::Result<()> {
        let (codes, keys) = (self.codes, self.keys);
        for (layer, (k, v)) in layers.iter().enumerate() {
            let held = len - self.first(layer);
            if held == 0 {
                continue;
            }
            // [1, heads, held, dim] read as a step's tokens, [held, heads, 1, dim].
            let write = |buffer: &Array, a: &Array, layout| mlx::fast::cpu_kv_write(buffer, &a.transpose(&[2, 1, 0, 3])?, 0, held, 0, layout, codes);
            let (bk, bv) = self.layers[layer].take().expect("reserved above");
            self.layers[layer] = Some((write(&bk, k, keys)?, write(&bv, v, KeyLayout::Positions)?));
        }
        self.len = len;
        Ok(())
    }

    /// The stored buffers, for evaluating them along with a step's outputs.
    pub fn buffers(&self) -> Vec<&Array> {
        let state = self.recurrent.iter().flat_map(|s| s.buffers());
        self.layers.iter().flatten().flat_map(|(k, v)| [k, v]).chain(state).collect()
    }
}

/// The row cache in all its forms (whole-history, window and quantized
/// layers are modes of one cache) follows the KV protocol.
impl Kv for KvCache {
    fn offset(&self) -> usize {
        self.len
    }

    fn trim(&mut self, n: usize) {
        self.truncate(self.len - n);
    }

    fn buffers(&self) -> Vec<&Array> {
        KvCache::buffers(self)
    }

    fn nbytes(&self) -> usize {
        KvCache::nbytes(self)
    }
}

/// The MLX attention path's writes (the CPU's fused attention writes in its
/// own node, through [`KvCache::take_for_write`]).
impl LayerKv for KvCache {
    fn reserve(&mut self, n: usize) -> mlx::Result<()> {
        KvCache::reserve(self, n)
    }

    fn first(&self, layer: usize) -> usize {
        KvCache::first(self, layer)
    }

    /// Floats in position order only: a cache with keys in blocks or codes
    /// is written by the fused attention.
    fn update_and_fetch(&mut self, layer: usize, k: &Array, v: &Array) -> mlx::Result<(Array, Array)> {
        if self.keys == KeyLayout::Blocks || self.codes != KvCodes::Float {
            return Err(mlx::Error {
                op: "kv_cache",
                message: "update_and_fetch writes floats in position order; a cache with keys in blocks or codes takes write_step".into(),
            });
        }
        let n = k.dim(2);
        let (at, end) = (self.len - self.first(layer), self.len + n - self.first(layer));
        if end > self.layer_capacity(layer) {
            return Err(mlx::Error { op: "kv_cache", message: format!("append of {n} past capacity {}", self.layer_capacity(layer)) });
        }
        let (h, d) = (self.shapes[layer].0 as i32, self.shapes[layer].1 as i32);
        let (start, stop) = ([0, 0, at as i32, 0], [1, h, end as i32, d]);
        let (old_k, old_v) = self.layers[layer].take().ok_or_else(|| mlx::Error { op: "kv_cache", message: "layer not reserved".into() })?;
        let new_k = old_k.slice_update(k, &start, &stop)?;
        let new_v = old_v.slice_update(v, &start, &stop)?;
        drop((old_k, old_v)); // the graph now holds the only reference: MLX can donate the buffer
        let view = |a: &Array| a.slice(&[0, 0, 0, 0], &[1, h, end as i32, d]);
        let out = (view(&new_k)?, view(&new_v)?);
        self.layers[layer] = Some((new_k, new_v));
        Ok(out)
    }

    fn advance(&mut self, n: usize) {
        self.len += n;
        if let Some(state) = self.recurrent.as_mut() {
            state.thin(self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[tokens, heads, 1, dim]` keys (the fused path's token layout) whose
    /// values name their token, head and feature.
    fn step_keys(first: usize, tokens: usize, heads: usize, dim: usize) -> Array {
        let data: Vec<f32> = (0..tokens * heads * dim).map(|i| ((first + i / (heads * dim)) * 1000 + i % (heads * dim)) as f32).collect();
        Array::from_f32(&data, &[tokens, heads, 1, dim]).unwrap()
    }

    /// Writes `steps` (token counts) into a cache with keys in blocks and one
    /// in position order; returns both.
    fn written(steps: &[usize]) -> (KvCache, KvCache) {
        let (heads, dim) = (2, 16);
        let mut blocked = KvCache::with_keys_in_blocks(1, heads, dim, Dtype::F32);
        let mut plain = KvCache::new(1, heads, dim, Dtype::F32);
        for &n in steps {
            let keys = step_keys(blocked.len(), n, heads, dim);
            for cache in [&mut blocked, &mut plain] {
                cache.reserve(n).unwrap();
                cache.write_step(0, &keys, &keys, 0, n).unwrap();
                cache.advance(n);
            }
        }
        (blocked, plain)
    }

    fn positions(cache: &KvCache) -> (Vec<f32>, Vec<f32>) {
        let (k, v) = cache.positions(0).unwrap().unwrap();
        (k.to_vec_f32().unwrap(), v.to_vec_f32().unwrap())
    }

    #[test]
    fn keys_in_blocks_read_back_in_position_order_across_growth_and_rollback() {
        let _device = mlx::set_default_device(mlx::Device::Cpu);
        // 250 then 70 tokens: a block split by a step, and growth past 256
        // (which copies whole blocks into the larger buffer).
        let (mut blocked, mut plain) = written(&[3, 247, 70]);
        assert_eq!(blocked.len(), 320);
        assert_eq!(positions(&blocked), positions(&plain));
        // Rolled back into a block and written again.
        blocked.truncate(290);
        plain.truncate(290);
        let keys = step_keys(290, 5, 2, 16).multiply(&Array::scalar(-1.0, Dtype::F32).unwrap()).unwrap();
        for cache in [&mut blocked, &mut plain] {
            cache.reserve(5).unwrap();
            cache.write_step(0, &keys, &keys, 0, 5).unwrap();
            cache.advance(5);
        }
        assert_eq!(positions(&blocked), positions(&plain));
        assert!(blocked.update_and_fetch(0, &keys, &keys).is_err(), "position-order writes into keys in blocks");
    }

    /// A whole-history layer and a window layer written side by side, in
    /// steps of `steps` tokens.
    fn windowed(window: usize, steps: &[usize]) -> KvCache {
        let (heads, dim) = (1, 16);
        let mut cache = KvCache::with_keys_in_blocks(2, heads, dim, Dtype::F32).with_windows(vec![None, Some(window)]);
        for &n in steps {
            let keys = step_keys(cache.len(), n, heads, dim);
            cache.reserve(n).unwrap();
            for layer in 0..2 {
                cache.write_step(layer, &keys, &keys, 0, n).unwrap();
            }
            cache.advance(n);
        }
        cache
    }

    #[test]
    fn a_window_layer_keeps_about_a_window_and_its_positions_stay_in_place() {
        let _device = mlx::set_default_device(mlx::Device::Cpu);
        let window = 100;
        // A prompt of 300, then 500 decode steps.
        let steps: Vec<usize> = std::iter::once(300).chain(std::iter::repeat_n(1, 500)).collect();
        let cache = windowed(window, &steps);
        assert_eq!(cache.len(), 800);
        let first = cache.first(1);
        assert!(first > 0 && first.is_multiple_of(KEY_BLOCK) && first + window - 1 + WINDOW_ROLLBACK <= 800, "first {first}");
        assert_eq!(cache.earliest_truncation(), first + window - 1);
        let per_position = 16 * 4 * 2;
        assert!(cache.window_nbytes() <= (window + WINDOW_ROLLBACK + 2 * KEY_BLOCK + WINDOW_ROOM) * per_position, "{}", cache.window_nbytes());
        // The window layer holds positions first..800, the same values as the
        // whole-history layer's.
        let (all, _) = cache.positions(0).unwrap().unwrap();
        let (kept, _) = cache.positions(1).unwrap().unwrap();
        assert_eq!(kept.shape(), vec![1, 1, 800 - first, 16]);
        let all = all.to_vec_f32().unwrap();
        assert_eq!(kept.to_vec_f32().unwrap(), all[first * 16..].to_vec());

        // Filled from those positions, another cache reads back the same.
        let layers = [cache.positions(0).unwrap().unwrap(), cache.positions(1).unwrap().unwrap()];
        let mut copy = KvCache::with_keys_in_blocks(2, 1, 16, Dtype::F32).with_windows(vec![None, Some(window)]);
        copy.fill(&layers, 800, first).unwrap();
        assert_eq!(copy.positions(1).unwrap().unwrap().0.to_vec_f32().unwrap(), all[first * 16..].to_vec());
        assert_eq!(copy.earliest_truncation(), cache.earliest_truncation());
    }

    #[test]
    fn a_window_layer_rolls_back_across_the_move_of_its_window() {
        let _device = mlx::set_default_device(mlx::Device::Cpu);
        let window = 100;
        // Decode until the window moves, then roll back past the step that
        // moved it (as rejected drafts and prefix-cache hits do), and write
        // other keys there: both layers read back the same positions.
        let mut cache = windowed(window, &[200]);
        let moved_from = cache.first(1);
        let mut len = cache.len();
        while cache.first(1) == moved_from {
            cache = {
                let keys = step_keys(len, 3, 1, 16);
                cache.reserve(3).unwrap();
                for layer in 0..2 {
                    cache.write_step(layer, &keys, &keys, 0, 3).unwrap();
                }
                cache.advance(3);
                len += 3;
                cache
            };
        }
        let back = cache.earliest_truncation().max(len - 40);
        assert!(back < len - 3, "the rollback crosses the step that moved the window");
        cache.truncate(back);
        let other = step_keys(back, 50, 1, 16).multiply(&Array::scalar(-1.0, Dtype::F32).unwrap()).unwrap();
        cache.reserve(50).unwrap();
        for layer in 0..2 {
            cache.write_step(layer, &other, &other, 0, 50).unwrap();
        }
        cache.advance(50);
        let first = cache.first(1);
        let all = cache.positions(0).unwrap().unwrap().0.to_vec_f32().unwrap();
        assert_eq!(cache.positions(1).unwrap().unwrap().0.to_vec_f32().unwrap(), all[first * 16..].to_vec());
        assert_eq!(all[back * 16], -((back * 1000) as f32), "the rewritten positions are the new keys");
    }

    /// Zero-mean values of amplitude 0.01 (as real keys and values roughly
    /// are), smooth across positions and features.
    fn smooth_keys(first: usize, tokens: usize, heads: usize, dim: usize) -> Array {
        let data: Vec<f32> = (0..tokens * heads * dim).map(|i| 0.01 * (((first + i / (heads * dim)) * 7 + i % (heads * dim)) as f32 * 0.1).sin()).collect();
        Array::from_f32(&data, &[tokens, heads, 1, dim]).unwrap()
    }

    /// `steps` written into a cache turning to codes (`q`) and into a
    /// float32 one; both returned.
    fn written_quantized(q: KvQuantization, windows: Vec<Option<usize>>, steps: &[usize]) -> (KvCache, KvCache) {
        let (heads, dim, layers) = (2, 32, windows.len());
        let new = || KvCache::with_keys_in_blocks(layers, heads, dim, Dtype::F32).with_windows(windows.clone());
        let (mut codes, mut floats) = (new().with_quantization(Some(q)).unwrap(), new());
        for &n in steps {
            let keys = smooth_keys(codes.len(), n, heads, dim);
            for cache in [&mut codes, &mut floats] {
                cache.reserve(n).unwrap();
                for layer in 0..layers {
                    cache.write_step(layer, &keys, &keys, 0, n).unwrap();
                }
                cache.advance(n);
            }
        }
        (codes, floats)
    }

    fn max_difference(a: &KvCache, b: &KvCache, layer: usize) -> f32 {
        let (ak, av) = a.positions(layer).unwrap().unwrap();
        let (bk, bv) = b.positions(layer).unwrap().unwrap();
        let (ak, av, bk, bv) = (ak.to_vec_f32().unwrap(), av.to_vec_f32().unwrap(), bk.to_vec_f32().unwrap(), bv.to_vec_f32().unwrap());
        assert_eq!((ak.len(), av.len()), (bk.len(), bv.len()));
        ak.iter().zip(&bk).chain(av.iter().zip(&bv)).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    #[test]
    fn a_cache_turns_to_codes_once_past_its_start_and_reads_back_close() {
        let _device = mlx::set_default_device(mlx::Device::Cpu);
        for bits in [8, 4] {
            turns_to_codes_once_past_its_start(bits);
        }
    }

    fn turns_to_codes_once_past_its_start(bits: u8) {
        let q = KvQuantization { bits, group: 16, start: 100 };
        // Keys are quantized rotated (mlx/src/cpu_attention.cc): a head
        // vector of 32 features within 0.01 has length at most 0.01 * 32^0.5,
        // so do its rotated features, whose groups then span at most twice
        // that; half a step of that per feature, in length (which the
        // rotation back keeps), bounds any one feature's error.
        let bound = 32.0 * 0.01 / ((1u32 << bits) - 1) as f32;
        // Up to 100 tokens it stays float32, exactly.
        let (mut codes, mut floats) = written_quantized(q, vec![None], &[60, 40]);
        assert_eq!(codes.codes(), KvCodes::Float);
        assert_eq!(max_difference(&codes, &floats, 0), 0.0);
        // The next write turns it (all it held, then the new tokens), past a growth step too.
        for cache in [&mut codes, &mut floats] {
            let keys = smooth_keys(100, 200, 2, 32);
            cache.reserve(200).unwrap();
            cache.write_step(0, &keys, &keys, 0, 200).unwrap();
            cache.advance(200);
        }
        assert_eq!(codes.codes(), q.codes());
        let err = max_difference(&codes, &floats, 0);
        assert!(err > 0.0 && err <= bound, "{bits}-bit error {err}");
        // 32 codes (8 or 4 bits each), 2 groups' scales and biases: 48 or 32 bytes a position for 128.
        assert_eq!(codes.nbytes() * 128, floats.nbytes() * (32 * bits as usize / 8 + 16));

        // Rolled back and written again, stored and restored: still the same positions.
        for cache in [&mut codes, &mut floats] {
            cache.truncate(250);
            let keys = smooth_keys(250, 3, 2, 32).multiply(&Array::scalar(-1.0, Dtype::F32).unwrap()).unwrap();
            cache.reserve(3).unwrap();
            cache.write_step(0, &keys, &keys, 0, 3).unwrap();
            cache.advance(3);
        }
        assert!(max_difference(&codes, &floats, 0) <= bound);
        let (stored, layers) = codes.as_stored().unwrap();
        assert_eq!(stored.codes, Some((bits, 16)));
        let layers: Vec<(Array, Array)> = layers.into_iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let back = codes.emptied().from_stored(&stored, layers.clone()).unwrap();
        assert_eq!(max_difference(&back, &codes, 0), 0.0);
        let other = |bits, group| KvCache::with_keys_in_blocks(1, 2, 32, Dtype::F32).with_quantization(Some(KvQuantization { bits, group, start: 0 })).unwrap();
        assert!(other(bits, 32).from_stored(&stored, layers.clone()).is_err(), "codes of another group");
        assert!(other(12 - bits, 16).from_stored(&stored, layers).is_err(), "codes of other bits");
    }

    #[test]
    fn a_window_layer_of_codes_keeps_the_whole_layers_positions() {
        let _device = mlx::set_default_device(mlx::Device::Cpu);
        // A 300-token prompt, then decode past the window's moves, turning at 256.
        let steps: Vec<usize> = std::iter::once(200).chain(std::iter::repeat_n(1, 300)).collect();
        let q = KvQuantization { bits: 4, group: 32, start: 256 };
        let (codes, _) = written_quantized(q, vec![None, Some(100)], &steps);
        assert_eq!(codes.codes(), q.codes());
        let first = codes.first(1);
        assert!(first > 0);
        let all = codes.positions(0).unwrap().unwrap().0.to_vec_f32().unwrap();
        let kept = codes.positions(1).unwrap().unwrap().0.to_vec_f32().unwrap();
        // Per head: positions first.. of the whole layer's 500.
        let (len, dim) = (codes.len(), 32);
        let whole_tail: Vec<f32> = (0..2).flat_map(|h| all[(h * len + first) * dim..(h + 1) * len * dim].to_vec()).collect();
        assert!(kept == whole_tail, "the window layer's positions differ from the whole layer's");
    }

    #[test]
    fn a_cache_filled_from_positions_stores_its_keys_in_blocks() {
        let _device = mlx::set_default_device(mlx::Device::Cpu);
        let (_, plain) = written(&[100]);
        let (k, v) = plain.positions(0).unwrap().unwrap();
        let mut blocked = KvCache::with_keys_in_blocks(1, 2, 16, Dtype::F32);
        blocked.fill(&[(k, v)], 100, 0).unwrap();
        assert_eq!(positions(&blocked), positions(&plain));
        // The stored keys are in blocks: position 65, feature 3 of head 1 sits
        // at block 1, row 3, column 1 of that head's buffer.
        let (raw, _) = blocked.layers[0].as_ref().unwrap();
        let raw = raw.to_vec_f32().unwrap();
        let cap = blocked.capacity;
        assert_eq!(raw[cap * 16 + 64 * 16 + 3 * 64 + 1], (65 * 1000 + 16 + 3) as f32);
    }
}
