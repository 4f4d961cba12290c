//! The running rows' KV caches side by side, for GPUs.
//!
//! On a GPU a step is bound by how many kernels it launches, not by the bytes
//! it reads. Attention row by row (each row its own cache, see [`KvCache`])
//! costs a dozen kernels per row and layer; with 32 rows that is most of the
//! step, and a prompt chunk beside decoding rows costs as much again. Here
//! every running row, from its first prompt chunk to its last token, owns a
//! slot of one per-layer buffer `[slots, kv_heads, capacity, head_dim]`, so
//! a step writes all rows' new keys with one scatter and attends with one
//! masked attention per layer, however many rows there are and whatever
//! each is doing.
//!
//! Slots are allocated in powers of two and freed slots are reused, and
//! capacity takes one of a few sizes ([`capacity_class`]), so the shapes a
//! step sees change only when the slot count doubles or capacity moves up a
//! class, and the engine can meet every shape once at start-up. Free and
//! idle slots still flow through the forward (their token is padding, their
//! writes land past their length and their outputs are dropped): cheaper on
//! a GPU than changing shapes every step.
//!
//! A slot's valid positions are `..len`; anything written past it (padding,
//! rejected drafts) is masked out and overwritten later, so rolling back is
//! just lowering `len`.
//!
//! Sliding-window layers hold a window's worth, as a row's own cache does
//! (see [`KvCache`]): their buffers `[slots, kv_heads, window capacity,
//! head_dim]` hold each slot's positions from its own first one, at index
//! `p - first`, and a step that would overflow a slot first moves that
//! slot's visible positions to the front (one gather per window layer, only
//! on such steps). Their writes and masks use those indices; RoPE still
//! uses positions.
//!
//! With 8- or 4-bit KV (`--kv-bits`), the buffers hold each position as a
//! row of affine codes (`kv_codes.rs`, the CPU's row layout): uint8
//! `[slots, kv_heads, capacity, width]`. Every write above encodes its keys
//! and values first, and the attention on MLX's ops reads the buffers
//! decoded; the fused decode kernels read the codes themselves
//! (`models/gpu`). A slot holds codes from its first position: the buffers
//! have one form for every slot, where a row of its own turns to codes
//! only once past `--kv-quantized-start` (`kv_cache.rs`); a slot turning on
//! its own would need both forms' buffers for every slot.
use mlx::fast::{KvCodes, KEY_BLOCK};
use mlx::{Array, Dtype};

use super::kv_cache::{window_first, zeros_keeping, KvCache, KvQuantization, CAPACITY_STEP, WINDOW_ROOM};
use super::kv_codes;

/// The capacity a batch takes to hold `needed` positions: a multiple of
/// [`CAPACITY_STEP`] up to four of them, then four sizes per doubling (1,280,
/// 1,536, 1,792, 2,048, 2,560, ...), at most a quarter above `needed`.
/// Every capacity is a new attention shape, which MLX's CUDA backend sets up
/// for milliseconds at first use (bench/results/gpu-h200-first-shape-cost.jsonl);
/// a turn of a chat that grew the capacity block by block met one at every
/// turn. These few sizes are all warmed up before serving.
pub fn capacity_class(needed: usize) -> usize {
    let below = needed.saturating_sub(1).checked_ilog2().map_or(1, |log| 1usize << log);
    let step = (below / 4).max(CAPACITY_STEP);
    needed.max(1).div_ceil(step) * step
}

/// The capacity classes from the smallest up to the one holding `needed`.
pub fn capacity_classes(needed: usize) -> impl Iterator<Item = usize> {
    let last = capacity_class(needed);
    std::iter::successors(Some(capacity_class(1)), move |&c| (c < last).then(|| capacity_class(c + 1)))
}

pub struct KvBatch {
    /// Per layer (keys, values), `[slots, kv_heads, capacity, head_dim]`
    /// (window layers: `window_capacity`); empty until the first row is admitted.
    layers: Vec<(Array, Array)>,
    /// Per layer, its attention window (`None`: the whole history).
    windows: Vec<Option<usize>>,
    /// Valid positions of each slot; `None` for a free slot.
    lens: Vec<Option<usize>>,
    /// Per slot, the first position its window layers hold.
    firsts: Vec<usize>,
    capacity: usize,
    window_capacity: usize,
    n_layers: usize,
    kv_heads: usize,
    head_dim: usize,
    /// The features' dtype (the buffers' too, unless they hold codes).
    dtype: Dtype,
    /// The codes the buffers hold (`None`: features in `dtype`).
    quantization: Option<KvQuantization>,
    /// Whether kernels MLX does not know about may write the buffers in
    /// place (see [`may_write_in_place`](Self::may_write_in_place)): set
    /// once the buffers were found held by the batch alone, and cleared by
    /// every change that replaces them or lets another array see them.
    in_place: bool,
}

impl KvBatch {
    pub fn new(n_layers: usize, kv_heads: usize, head_dim: usize, dtype: Dtype) -> KvBatch {
        KvBatch {
            layers: Vec::new(),
            windows: vec![None; n_layers],
            lens: Vec::new(),
            firsts: Vec::new(),
            capacity: 0,
            window_capacity: 0,
            n_layers,
            kv_heads,
            head_dim,
            dtype,
            quantization: None,
            in_place: false,
        }
    }

    /// The same (empty) batch holding codes as `q` says, from every slot's
    /// first position (see the module notes); `None`: features.
    pub fn with_quantization(mut self, q: Option<KvQuantization>) -> KvBatch {
        assert!(self.lens.is_empty(), "quantization is set on an empty batch");
        self.quantization = q;
        self
    }

    /// How the buffers hold features.
    pub fn codes(&self) -> KvCodes {
        self.quantization.map_or(KvCodes::Float, |q| q.codes())
    }

    /// The buffers' last dimension and dtype.
    fn form(&self) -> (usize, Dtype) {
        match self.codes() {
            KvCodes::Float => (self.head_dim, self.dtype),
            codes => (codes.width(self.head_dim), Dtype::U8),
        }
    }

    /// Features `[.., head_dim]` as the buffers hold them.
    fn encode(&self, x: &Array) -> mlx::Result<Array> {
        kv_codes::encode(x, self.codes())
    }

    /// Buffer rows back as features in the batch's dtype.
    fn decode(&self, rows: &Array) -> mlx::Result<Array> {
        kv_codes::decode(rows, self.codes(), self.head_dim, self.dtype)
    }

    /// The same (empty) batch whose layers attend within `windows`, one per layer.
    pub fn with_windows(mut self, windows: Vec<Option<usize>>) -> KvBatch {
        assert!(self.lens.is_empty() && windows.len() == self.n_layers, "windows are set on an empty batch, one per layer");
        self.windows = windows;
        self
    }

    /// Layers, window layers included.
    pub fn layer_count(&self) -> usize {
        self.n_layers
    }

    /// Layer `layer`'s window, if it is a sliding-window layer.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.windows[layer]
    }

    /// The first position layer `layer` of `slot` holds (at index 0).
    pub fn first(&self, layer: usize, slot: usize) -> usize {
        if self.windows[layer].is_some() {
            self.firsts[slot]
        } else {
            0
        }
    }

    /// Slots, free ones included: the batch dimension of a step.
    pub fn slots(&self) -> usize {
        self.lens.len()
    }

    /// Valid positions of `slot` (0 for a free slot).
    pub fn len(&self, slot: usize) -> usize {
        self.lens[slot].unwrap_or(0)
    }

    /// Positions every slot has room for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn occupied(&self) -> usize {
        self.lens.iter().flatten().count()
    }

    /// Bytes reserved on the device.
    pub fn nbytes(&self) -> usize {
        self.layers.iter().map(|(k, v)| k.nbytes() + v.nbytes()).sum()
    }

    /// Moves a row's cache into a free slot (growing the slot count to the
    /// next power of two when none is free), with room for `room` positions
    /// in all (a row's whole prompt: one reallocation, where growing chunk by
    /// chunk would copy every slot at each class), and returns the slot.
    /// Window layers take only what the cache holds; they make room step by
    /// step ([`make_window_room`](Self::make_window_room)).
    pub fn admit(&mut self, cache: &KvCache, room: usize) -> mlx::Result<usize> {
        let len = cache.len();
        let first = self.windows.iter().position(Option::is_some).map_or(0, |l| cache.first(l));
        let free = self.lens.iter().position(Option::is_none);
        let slots = if free.is_some() { self.lens.len() } else { (self.lens.len() * 2).max(1) };
        let capacity = self.capacity.max(capacity_class(len.max(room)));
        let has_windows = self.windows.iter().any(Option::is_some);
        let window_capacity = if has_windows { self.window_capacity.max(window_class(len - first)) } else { 0 };
        if slots != self.lens.len() || capacity != self.capacity || window_capacity != self.window_capacity {
            self.resize(slots, capacity, window_capacity)?;
        }
        let slot = free.unwrap_or_else(|| self.lens.iter().position(Option::is_none).expect("grown by a slot at least"));
        self.firsts[slot] = first;
        if len > 0 {
            self.in_place = false;
            let (h, d) = (self.kv_heads as i32, self.form().0 as i32);
            let s = slot as i32;
            for layer in 0..self.n_layers {
                let n = (len - cache.first(layer)) as i32;
                let (ck, cv) = self.rows_of(cache, layer)?;
                let (k, v) = &mut self.layers[layer];
                *k = k.slice_update(&ck, &[s, 0, 0, 0], &[s + 1, h, n, d])?;
                *v = v.slice_update(&cv, &[s, 0, 0, 0], &[s + 1, h, n, d])?;
            }
        }
        self.lens[slot] = Some(len);
        Ok(slot)
    }

    /// A cache's positions of `layer` in the buffers' form: its rows as
    /// they are when it holds the same codes (a slot's, handed back), else
    /// its features, encoded.
    fn rows_of(&self, cache: &KvCache, layer: usize) -> mlx::Result<(Array, Array)> {
        let none = || mlx::Error { op: "kv_batch", message: "admitting a cache with no buffers".into() };
        if cache.codes() == self.codes() && cache.key_layout() == mlx::fast::KeyLayout::Positions {
            return cache.rows(layer)?.ok_or_else(none);
        }
        let (k, v) = cache.positions(layer)?.ok_or_else(none)?;
        Ok((self.encode(&k)?, self.encode(&v)?))
    }

    /// Frees `slot` and returns its contents as a row cache of their own
    /// (copied and evaluated now, so nothing keeps the shared buffers alive
    /// and the next step can still write them in place).
    pub fn release(&mut self, slot: usize) -> mlx::Result<KvCache> {
        let len = self.len(slot);
        let cache = KvCache::new(self.n_layers, self.kv_heads, self.head_dim, self.dtype).with_windows(self.windows.clone());
        let mut cache = cache.with_quantization(self.quantization)?;
        if len > 0 {
            let (h, d) = (self.kv_heads as i32, self.form().0 as i32);
            let s = slot as i32;
            let layers = (0..self.n_layers)
                .map(|layer| {
                    let (k, v) = &self.layers[layer];
                    let n = (len - self.first(layer, slot)) as i32;
                    Ok((k.slice(&[s, 0, 0, 0], &[s + 1, h, n, d])?, v.slice(&[s, 0, 0, 0], &[s + 1, h, n, d])?))
                })
                .collect::<mlx::Result<Vec<_>>>()?;
            cache.fill_rows(&layers, len, self.firsts[slot], self.codes())?;
            mlx::eval(&cache.buffers())?;
        }
        self.forget(slot);
        Ok(cache)
    }

    /// Frees `slot`, dropping its contents.
    pub fn forget(&mut self, slot: usize) {
        self.lens[slot] = None;
        self.firsts[slot] = 0;
        if self.occupied() == 0 {
            // Nothing decoding: give the memory back.
            self.layers.clear();
            self.in_place = false;
            self.lens.clear();
            self.firsts.clear();
            self.capacity = 0;
            self.window_capacity = 0;
        }
    }

    /// Keeps the first `len` positions of `slot`.
    pub fn truncate(&mut self, slot: usize, len: usize) {
        if let Some(l) = &mut self.lens[slot] {
            *l = (*l).min(len);
        }
    }

    /// Writes one layer's keys and values of a step, `[slots, kv_heads, n,
    /// head_dim]`, at `positions` (int32 `[slots, 1, n, 1]`, from
    /// [`write_positions`](Self::write_positions)) and returns the updated
    /// buffers. The capacity must hold them ([`ensure_capacity`](Self::ensure_capacity));
    /// [`advance`](Self::advance) commits after the last layer.
    pub fn write(&mut self, layer: usize, keys: &Array, values: &Array, positions: &Array) -> mlx::Result<(Array, Array)> {
        self.in_place = false;
        let (keys, values) = (self.encode(keys)?, self.encode(values)?);
        let (k, v) = self.layers.get_mut(layer).ok_or_else(|| mlx::Error { op: "kv_batch", message: "write to an empty batch".into() })?;
        // Replacing the held arrays leaves the graph as the only holder of
        // the old buffers, so MLX scatters into them in place.
        *k = k.put_along_axis(positions, &keys, 2)?;
        *v = v.put_along_axis(positions, &values, 2)?;
        let (k, v) = (k.clone(), v.clone());
        Ok((self.decode(&k)?, self.decode(&v)?))
    }

    /// Layer `layer`'s keys and values, `[slots, kv_heads, capacity,
    /// head_dim]` (or rows of codes, see [`codes`](Self::codes)): for kernels that write a step's positions into them in
    /// place (`models/gpu`, after [`may_write_in_place`](Self::may_write_in_place)),
    /// which then [`advance`](Self::advance) as [`write`](Self::write)'s callers do.
    pub fn layer(&self, layer: usize) -> Option<(&Array, &Array)> {
        self.layers.get(layer).map(|(k, v)| (k, v))
    }

    /// Whether a kernel MLX does not know about may write the buffers in
    /// place: no view, snapshot or pending op but such kernels' own may
    /// see them. `held_alone` tells whether the batch alone holds a buffer;
    /// it is asked only at the start of a chain of in-place steps, since a
    /// step of the chain still in flight (a lookahead, built before the
    /// step it follows was read) holds the buffers itself: its writes are
    /// ordered on the device's stream, and anything else that could see
    /// the buffers (a write through MLX, an admission, a growth, a window
    /// move) goes through this batch and ends the chain.
    pub fn may_write_in_place(&mut self, held_alone: impl Fn(&Array) -> bool) -> bool {
        if !self.in_place {
            self.in_place = !self.layers.is_empty() && self.layers.iter().all(|(k, v)| held_alone(k) && held_alone(v));
        }
        self.in_place
    }

    /// Per slot, where a step's `n` rows are written, as int32 `[slots, 1,
    /// n, 1]`: its `real[s]` tokens at `from[s] ..`, its padding rows at
    /// the same positions onwards but never past the last position, which a
    /// slot with padding leaves free (see [`padded_room`](Self::padded_room)):
    /// padding then needs no capacity of its own, and a 74-token chunk
    /// padded to 256 queries does not grow the batch by 256 positions.
    pub fn write_positions(&self, from: &[usize], real: &[usize], n: usize) -> mlx::Result<Array> {
        let last = self.capacity.saturating_sub(1);
        let pos: Vec<i32> = from.iter().zip(real).flat_map(|(&f, &r)| (0..n).map(move |i| if i < r { f + i } else { (f + i).min(last) } as i32)).collect();
        Array::from_i32(&pos, &[self.slots(), 1, n, 1])
    }

    /// Positions a slot needs to take `real` of a step's `n` rows at `from`
    /// (see [`write_positions`](Self::write_positions)): one more than its
    /// real tokens when it has padding, so padding lands past them.
    pub fn padded_room(from: usize, real: usize, n: usize) -> usize {
        from + real + usize::from(real < n)
    }

    /// Writes one layer's keys and values of one slot, `[1, kv_heads, n,
    /// head_dim]`, at positions `at .. at + n`, and returns that slot's keys
    /// and values from its first position up to there,
    /// `[1, kv_heads, at + n - first, head_dim]`.
    pub fn write_slot(&mut self, layer: usize, slot: usize, at: usize, keys: &Array, values: &Array) -> mlx::Result<(Array, Array)> {
        let end = self.put_slot(layer, slot, at, keys, values)?;
        self.slot_view(layer, slot, end)
    }

    /// [`write_slot`](Self::write_slot) on a layer without a window, returning
    /// the slot's whole capacity, `[1, kv_heads, capacity, head_dim]`: an
    /// attention over it has the shape of the capacity class, not of this
    /// chunk's end (see [`alone_mask`](Self::alone_mask)).
    pub fn write_slot_whole(&mut self, layer: usize, slot: usize, at: usize, keys: &Array, values: &Array) -> mlx::Result<(Array, Array)> {
        debug_assert!(self.windows[layer].is_none(), "window layers hold their own positions");
        self.put_slot(layer, slot, at, keys, values)?;
        self.slot_view(layer, slot, self.capacity)
    }

    /// Writes a slot's keys and values at `at ..`; returns the index past them.
    fn put_slot(&mut self, layer: usize, slot: usize, at: usize, keys: &Array, values: &Array) -> mlx::Result<usize> {
        self.in_place = false;
        let at = at - self.first(layer, slot);
        let (keys, values) = (self.encode(keys)?, self.encode(values)?);
        let (h, d, s, end) = (self.kv_heads as i32, self.form().0 as i32, slot as i32, (at + keys.dim(2)) as i32);
        let (k, v) = self.layers.get_mut(layer).ok_or_else(|| mlx::Error { op: "kv_batch", message: "write to an empty batch".into() })?;
        *k = k.slice_update(&keys, &[s, 0, at as i32, 0], &[s + 1, h, end, d])?;
        *v = v.slice_update(&values, &[s, 0, at as i32, 0], &[s + 1, h, end, d])?;
        Ok(end as usize)
    }

    /// A slot's keys and values at indices `..end` of a layer, as features.
    fn slot_view(&self, layer: usize, slot: usize, end: usize) -> mlx::Result<(Array, Array)> {
        let (k, v) = &self.layers[layer];
        let (h, d, s, end) = (self.kv_heads as i32, self.form().0 as i32, slot as i32, end as i32);
        let view = |a: &Array| self.decode(&a.slice(&[s, 0, 0, 0], &[s + 1, h, end, d])?);
        Ok((view(k)?, view(v)?))
    }

    /// The additive mask of `queries` queries of one slot at positions
    /// `offset ..` over its whole capacity, `[1, 1, queries, capacity]`:
    /// query `i` sees keys up to `offset + i`.
    pub fn alone_mask(&self, offset: usize, queries: usize) -> mlx::Result<Array> {
        let at: Vec<i32> = (offset..offset + queries).map(|p| p as i32).collect();
        self.step_mask(&Array::from_i32(&at, &[1, 1, queries, 1])?)
    }

    /// The additive attention mask of a step, `[slots, 1, n, capacity]` in
    /// the cache dtype, from its [`write_positions`](Self::write_positions):
    /// query `i` of a slot sits at `len + i` and sees keys up to there.
    pub fn step_mask(&self, query: &Array) -> mlx::Result<Array> {
        let keys = Array::arange(0.0, self.capacity as f64, 1.0, Dtype::I32)?.reshape(&[1, 1, 1, self.capacity as i32])?;
        let zero = Array::scalar(0.0, self.dtype)?;
        let blocked = Array::scalar(f32::NEG_INFINITY, self.dtype)?;
        mlx::where_(&keys.less_equal(query)?, &zero, &blocked)
    }

    /// Each slot's length as int32 `[slots]`: the rope offset of its first token.
    pub fn offsets(&self) -> mlx::Result<Array> {
        let lens: Vec<i32> = (0..self.slots()).map(|s| self.len(s) as i32).collect();
        Array::from_i32(&lens, &[lens.len()])
    }

    /// Commits a step: slot `s` keeps `real[s]` of the positions written.
    pub fn advance(&mut self, real: &[usize]) {
        for (len, &n) in self.lens.iter_mut().zip(real) {
            if let Some(l) = len {
                *l += n;
            }
        }
    }

    /// The buffers, for evaluating them along with a step's outputs.
    pub fn buffers(&self) -> Vec<&Array> {
        self.layers.iter().flat_map(|(k, v)| [k, v]).collect()
    }

    /// Makes room for `needed` positions in every slot, moving capacity up
    /// to the class that holds them ([`capacity_class`]).
    pub fn ensure_capacity(&mut self, needed: usize) -> mlx::Result<()> {
        if needed <= self.capacity {
            return Ok(());
        }
        self.resize(self.lens.len(), capacity_class(needed), self.window_capacity)
    }

    /// Makes room in the window layers for a step that writes slot `s`'s
    /// positions up to `ends[s]` (padding included): a slot that would
    /// overflow first drops the positions its queries can no longer see
    /// (as a row's cache does, see [`window_first`]), and the capacity grows
    /// if that is still not enough. No-op without window layers.
    pub fn make_window_room(&mut self, ends: &[usize]) -> mlx::Result<()> {
        let Some(window) = self.windows.iter().flatten().copied().max() else { return Ok(()) };
        let lens: Vec<usize> = (0..self.slots()).map(|s| self.len(s)).collect();
        let firsts: Vec<usize> = (0..self.slots())
            .map(|s| match ends[s] - self.firsts[s] > self.window_capacity {
                true => window_first(lens[s], window).max(self.firsts[s]),
                false => self.firsts[s],
            })
            .collect();
        let most = (0..self.slots()).map(|s| ends[s] - firsts[s]).max().unwrap_or(0);
        let capacity = if most > self.window_capacity { window_class(most) } else { self.window_capacity };
        if firsts == self.firsts && capacity == self.window_capacity {
            return Ok(());
        }
        // Index i of slot s takes old index i + (new first - old first);
        // past the old buffer it takes its last index (nothing a query sees:
        // those positions are written by this step before attention reads them).
        let old_capacity = self.window_capacity;
        let index: Vec<i32> = (0..self.slots())
            .flat_map(|s| {
                let shift = firsts[s] - self.firsts[s];
                (0..capacity).map(move |i| (i + shift).min(old_capacity - 1) as i32)
            })
            .collect();
        let index = Array::from_i32(&index, &[self.slots(), 1, capacity, 1])?;
        self.in_place = false;
        for ((k, v), _) in self.layers.iter_mut().zip(&self.windows).filter(|(_, w)| w.is_some()) {
            *k = k.take_along_axis(&index, 2)?;
            *v = v.take_along_axis(&index, 2)?;
        }
        self.firsts = firsts;
        self.window_capacity = capacity;
        Ok(())
    }

    /// [`write_positions`](Self::write_positions) for the window layers:
    /// each slot's positions as indices from its first, padding kept
    /// within the window capacity.
    pub fn window_write_positions(&self, from: &[usize], real: &[usize], n: usize) -> mlx::Result<Array> {
        let last = self.window_capacity.saturating_sub(1);
        let pos: Vec<i32> = (0..self.slots())
            .flat_map(|s| {
                let f = from[s] - self.firsts[s];
                let r = real[s];
                (0..n).map(move |i| if i < r { f + i } else { (f + i).min(last) } as i32)
            })
            .collect();
        Array::from_i32(&pos, &[self.slots(), 1, n, 1])
    }

    /// The window layers' additive mask, `[slots, 1, n, window capacity]`,
    /// from [`window_write_positions`](Self::window_write_positions): a
    /// query at index `q` sees indices `q - window + 1 ..= q`.
    pub fn window_step_mask(&self, query: &Array, window: usize) -> mlx::Result<Array> {
        let keys = Array::arange(0.0, self.window_capacity as f64, 1.0, Dtype::I32)?.reshape(&[1, 1, 1, self.window_capacity as i32])?;
        let oldest = query.subtract(&Array::scalar(window as f32 - 1.0, Dtype::I32)?)?;
        let seen = keys.less_equal(query)?.logical_and(&keys.greater_equal(&oldest)?)?;
        mlx::where_(&seen, &Array::scalar(0.0, self.dtype)?, &Array::scalar(f32::NEG_INFINITY, self.dtype)?)
    }

    /// Reallocates every layer as `[slots, .., capacity, ..]` (window
    /// layers: `window_capacity`), keeping the current contents (slots and
    /// capacities only grow).
    fn resize(&mut self, slots: usize, capacity: usize, window_capacity: usize) -> mlx::Result<()> {
        let old_slots = self.lens.len();
        self.in_place = false;
        let layers = std::mem::take(&mut self.layers);
        let (width, dtype) = self.form();
        let grow = |old: Option<&Array>, window: bool| {
            let (cap, old_cap) = if window { (window_capacity, self.window_capacity) } else { (capacity, self.capacity) };
            zeros_keeping(&[slots, self.kv_heads, cap, width], dtype, old, [old_slots, self.kv_heads, old_cap, width])
        };
        self.layers = (0..self.n_layers)
            .map(|l| {
                let window = self.windows[l].is_some();
                let old = layers.get(l);
                Ok((grow(old.map(|o| &o.0), window)?, grow(old.map(|o| &o.1), window)?))
            })
            .collect::<mlx::Result<_>>()?;
        self.lens.resize(slots, None);
        self.firsts.resize(slots, 0);
        self.capacity = capacity;
        self.window_capacity = window_capacity;
        Ok(())
    }
}

/// The window capacity that holds `needed` indices: whole key blocks with
/// [`WINDOW_ROOM`] to spare, so a decoding slot moves its window every
/// hundred-odd steps, not every step.
fn window_class(needed: usize) -> usize {
    (needed + WINDOW_ROOM).div_ceil(KEY_BLOCK) * KEY_BLOCK
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache_of(len: usize, fill: f32) -> KvCache {
        let mut cache = KvCache::new(2, 1, 4, Dtype::F32);
        if len > 0 {
            let layer = (Array::full(&[1, 1, len, 4], fill, Dtype::F32).unwrap(), Array::full(&[1, 1, len, 4], -fill, Dtype::F32).unwrap());
            cache.fill(&[layer.clone(), layer], len, 0).unwrap();
        }
        cache
    }

    #[test]
    fn slots_double_are_reused_and_give_their_contents_back() {
        mlx::set_default_device(mlx::Device::Cpu).unwrap();
        let mut kv = KvBatch::new(2, 1, 4, Dtype::F32);
        let slots: Vec<usize> = (0..3).map(|i| kv.admit(&cache_of(3 + i, i as f32 + 1.0), 0).unwrap()).collect();
        assert_eq!(slots, vec![0, 1, 2]);
        assert_eq!(kv.slots(), 4, "slot counts go 1, 2, 4");
        assert_eq!((kv.len(1), kv.len(3)), (4, 0));

        // A released slot's cache holds exactly its rows, and the slot is reused.
        let out = kv.release(1).unwrap();
        assert_eq!(out.len(), 4);
        let (k, v) = out.positions(1).unwrap().unwrap();
        let (k, v) = (k.to_vec_f32().unwrap(), v.to_vec_f32().unwrap());
        assert!(k.iter().all(|&x| x == 2.0) && v.iter().all(|&x| x == -2.0));
        assert_eq!(kv.admit(&cache_of(2, 9.0), 0).unwrap(), 1);
        assert_eq!(kv.occupied(), 3);

        // Rolling back only lowers the length; the last row out frees everything.
        kv.truncate(0, 1);
        assert_eq!(kv.len(0), 1);
        for slot in 0..3 {
            kv.forget(slot);
        }
        assert_eq!((kv.slots(), kv.nbytes()), (0, 0));
    }

    #[test]
    fn slots_of_codes_take_features_and_hand_codes_back_unchanged() {
        mlx::set_default_device(mlx::Device::Cpu).unwrap();
        let q = KvQuantization { bits: 8, group: 8, start: 0 };
        let (layers, heads, dim, len) = (2, 1, 16, 5);
        let mut kv = KvBatch::new(layers, heads, dim, Dtype::F32).with_quantization(Some(q));
        let features: Vec<f32> = (0..len * dim).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
        let layer = Array::from_f32(&features, &[1, heads, len, dim]).unwrap();
        let mut cache = KvCache::new(layers, heads, dim, Dtype::F32);
        cache.fill(&[(layer.clone(), layer.clone()), (layer.clone(), layer)], len, 0).unwrap();

        // Features in, codes out: the row comes back as codes of its features.
        let slot = kv.admit(&cache, 0).unwrap();
        let out = kv.release(slot).unwrap();
        assert_eq!(out.codes(), q.codes());
        let (rows, _) = out.rows(1).unwrap().unwrap();
        assert_eq!(rows.shape(), vec![1, heads, len, q.codes().width(dim)]);
        let back = out.positions(1).unwrap().unwrap().0.to_vec_f32().unwrap();
        let worst = back.iter().zip(&features).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        // Half a level of the widest group (-11/7 .. 11/7).
        assert!(worst <= 1.01 * 11.0 / 7.0 / 255.0, "decoded within half a level: {worst}");

        // Codes in, the same codes out: a session's state is not re-rounded.
        let slot = kv.admit(&out, 0).unwrap();
        let again = kv.release(slot).unwrap();
        assert_eq!(again.rows(0).unwrap().unwrap().1.to_bytes().unwrap(), out.rows(0).unwrap().unwrap().1.to_bytes().unwrap());

        // What a step writes is encoded, and attention reads it decoded.
        let slot = kv.admit(&out, 8).unwrap();
        let new = Array::full(&[1, heads, 1, dim], 0.5, Dtype::F32).unwrap();
        let (keys, _) = kv.write_slot(0, slot, len, &new, &new).unwrap();
        assert_eq!((keys.shape(), keys.dtype()), (vec![1, heads, len + 1, dim], Dtype::F32));
        let keys = keys.to_vec_f32().unwrap();
        assert!(keys[len * dim..].iter().all(|&x| x == 0.5), "{keys:?}");
    }

    #[test]
    fn capacity_comes_in_a_few_classes_at_most_a_quarter_above_the_need() {
        let classes: Vec<usize> = capacity_classes(5_000).collect();
        assert_eq!(classes, [256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120]);
        for needed in 1..40_000 {
            let c = capacity_class(needed);
            assert!(c >= needed && (c <= 1024 || c * 4 <= needed * 5), "{needed} -> {c}");
            assert_eq!(capacity_class(c), c, "a class holds itself");
        }
    }

    /// A batch of `n_layers` (one head of 4) holding these rows, each
    /// (length, fill value), in slots 0, 1, ....
    fn batch_of(n_layers: usize, rows: &[(usize, f32)]) -> KvBatch {
        mlx::set_default_device(mlx::Device::Cpu).unwrap();
        let mut kv = KvBatch::new(n_layers, 1, 4, Dtype::F32);
        for &(len, fill) in rows {
            kv.admit(&cache_of(len, fill), 0).unwrap();
        }
        kv
    }

    #[test]
    fn padding_rows_land_past_the_real_ones_within_capacity() {
        let mut kv = batch_of(1, &[(250, 1.0), (3, 1.0)]);
        assert_eq!(kv.capacity(), 256);
        // Slot 0 reads 5 tokens at 250 (padded to 16 queries), slot 1 decodes one.
        let needed = KvBatch::padded_room(250, 5, 16).max(KvBatch::padded_room(3, 1, 16));
        assert_eq!(needed, 256, "one position beyond the real tokens, none for the rest of the padding");
        kv.ensure_capacity(needed).unwrap();
        let pos = kv.write_positions(&[250, 3], &[5, 1], 16).unwrap().to_vec_i32().unwrap();
        assert_eq!(&pos[..16], &[250, 251, 252, 253, 254, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255]);
        assert_eq!(&pos[16..20], &[3, 4, 5, 6]);
    }

    #[test]
    fn a_slot_written_whole_shows_its_capacity_and_its_mask_its_keys() {
        let mut kv = batch_of(1, &[(3, 1.0), (2, 2.0)]);
        let new = Array::full(&[1, 1, 3, 4], 7.0, Dtype::F32).unwrap();
        let (keys, _) = kv.write_slot_whole(0, 1, 2, &new, &new).unwrap();
        assert_eq!(keys.shape(), vec![1, 1, kv.capacity(), 4]);
        let keys = keys.to_vec_f32().unwrap();
        assert!(keys[..8].iter().all(|&x| x == 2.0) && keys[8..20].iter().all(|&x| x == 7.0), "{keys:?}");
        // Four queries (the fourth padding) at 2 ..: each sees keys up to itself.
        let mask = kv.alone_mask(2, 4).unwrap();
        assert_eq!(mask.shape(), vec![1, 1, 4, kv.capacity()]);
        let mask = mask.to_vec_f32().unwrap();
        for q in 0..4 {
            let row = &mask[q * kv.capacity()..(q + 1) * kv.capacity()];
            assert!(row[..=2 + q].iter().all(|&x| x == 0.0) && row[3 + q..].iter().all(|&x| x == f32::NEG_INFINITY), "query {q}");
        }
    }

    #[test]
    fn a_slot_written_alone_shows_its_keys_and_leaves_the_others() {
        let mut kv = batch_of(2, &[(3, 1.0), (2, 2.0)]);
        // Three new positions of slot 1 after its two: it then sees five keys.
        let new = Array::full(&[1, 1, 3, 4], 7.0, Dtype::F32).unwrap();
        let (keys, values) = kv.write_slot(1, 1, 2, &new, &new).unwrap();
        assert_eq!((keys.shape(), values.shape()), (vec![1, 1, 5, 4], vec![1, 1, 5, 4]));
        let keys = keys.to_vec_f32().unwrap();
        assert!(keys[..8].iter().all(|&x| x == 2.0) && keys[8..].iter().all(|&x| x == 7.0), "{keys:?}");
        kv.advance(&[0, 3]);
        assert_eq!((kv.len(0), kv.len(1)), (3, 5));
        // Slot 0 is untouched, and layer 0 of slot 1 too.
        let (k0, _) = kv.release(0).unwrap().positions(1).unwrap().unwrap();
        assert!(k0.to_vec_f32().unwrap().iter().all(|&x| x == 1.0));
        let out = kv.release(1).unwrap();
        let (k_layer0, _) = out.positions(0).unwrap().unwrap();
        let k_layer0 = k_layer0.to_vec_f32().unwrap();
        assert!(k_layer0[8..].iter().all(|&x| x != 7.0), "only layer 1 was written");
    }
}
