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
//! Slots are allocated in powers of two and freed slots are reused, so the
//! shapes a step sees change only when the slot count doubles or capacity
//! grows by a block. Free and idle slots still flow through the forward
//! (their token is padding, their writes land past their length and their
//! outputs are dropped): cheaper on a GPU than changing shapes every step.
//!
//! A slot's valid positions are `..len`; anything written past it (padding,
//! rejected drafts) is masked out and overwritten later, so rolling back is
//! just lowering `len`.
use mlx::{Array, Dtype};

use super::kv_cache::{zeros_keeping, KvCache, CAPACITY_STEP};

pub struct KvBatch {
    /// Per layer (keys, values), `[slots, kv_heads, capacity, head_dim]`;
    /// empty until the first row is admitted.
    layers: Vec<(Array, Array)>,
    /// Valid positions of each slot; `None` for a free slot.
    lens: Vec<Option<usize>>,
    capacity: usize,
    n_layers: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: Dtype,
}

impl KvBatch {
    pub fn new(n_layers: usize, kv_heads: usize, head_dim: usize, dtype: Dtype) -> KvBatch {
        KvBatch { layers: Vec::new(), lens: Vec::new(), capacity: 0, n_layers, kv_heads, head_dim, dtype }
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
    /// next power of two when none is free) and returns the slot.
    pub fn admit(&mut self, cache: &KvCache) -> mlx::Result<usize> {
        let slot = match self.lens.iter().position(Option::is_none) {
            Some(slot) => slot,
            None => {
                let slot = self.lens.len();
                self.resize((slot * 2).max(1), self.capacity.max(CAPACITY_STEP))?;
                slot
            }
        };
        let len = cache.len();
        self.ensure_capacity(len)?;
        if len > 0 {
            let (h, d) = (self.kv_heads as i32, self.head_dim as i32);
            let (s, n) = (slot as i32, len as i32);
            for (layer, (k, v)) in self.layers.iter_mut().enumerate() {
                let (ck, cv) = cache.layer(layer).ok_or_else(|| mlx::Error { op: "kv_batch", message: "admitting a cache with no buffers".into() })?;
                let valid = |a: &Array| a.slice(&[0, 0, 0, 0], &[1, h, n, d]);
                *k = k.slice_update(&valid(ck)?, &[s, 0, 0, 0], &[s + 1, h, n, d])?;
                *v = v.slice_update(&valid(cv)?, &[s, 0, 0, 0], &[s + 1, h, n, d])?;
            }
        }
        self.lens[slot] = Some(len);
        Ok(slot)
    }

    /// Frees `slot` and returns its contents as a row cache of their own
    /// (copied and evaluated now, so nothing keeps the shared buffers alive
    /// and the next step can still write them in place).
    pub fn release(&mut self, slot: usize) -> mlx::Result<KvCache> {
        let len = self.len(slot);
        let mut cache = KvCache::new(self.n_layers, self.kv_heads, self.head_dim, self.dtype);
        if len > 0 {
            let (h, d) = (self.kv_heads as i32, self.head_dim as i32);
            let (s, n) = (slot as i32, len as i32);
            let layers = self
                .layers
                .iter()
                .map(|(k, v)| Ok((k.slice(&[s, 0, 0, 0], &[s + 1, h, n, d])?, v.slice(&[s, 0, 0, 0], &[s + 1, h, n, d])?)))
                .collect::<mlx::Result<Vec<_>>>()?;
            cache.fill(&layers, len)?;
            mlx::eval(&cache.buffers())?;
        }
        self.forget(slot);
        Ok(cache)
    }

    /// Frees `slot`, dropping its contents.
    pub fn forget(&mut self, slot: usize) {
        self.lens[slot] = None;
        if self.occupied() == 0 {
            // Nothing decoding: give the memory back.
            self.layers.clear();
            self.lens.clear();
            self.capacity = 0;
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
        let (k, v) = self.layers.get_mut(layer).ok_or_else(|| mlx::Error { op: "kv_batch", message: "write to an empty batch".into() })?;
        // Replacing the held arrays leaves the graph as the only holder of
        // the old buffers, so MLX scatters into them in place.
        *k = k.put_along_axis(positions, keys, 2)?;
        *v = v.put_along_axis(positions, values, 2)?;
        Ok((k.clone(), v.clone()))
    }

    /// Per slot, the positions `from[s] .. from[s] + n` as int32 `[slots, 1, n, 1]`.
    pub fn write_positions(&self, from: &[usize], n: usize) -> mlx::Result<Array> {
        let pos: Vec<i32> = from.iter().flat_map(|&f| (0..n).map(move |i| (f + i) as i32)).collect();
        Array::from_i32(&pos, &[self.slots(), 1, n, 1])
    }

    /// Writes one layer's keys and values of one slot, `[1, kv_heads, n,
    /// head_dim]`, at positions `at .. at + n`, and returns that slot's keys
    /// and values up to there, `[1, kv_heads, at + n, head_dim]`.
    pub fn write_slot(&mut self, layer: usize, slot: usize, at: usize, keys: &Array, values: &Array) -> mlx::Result<(Array, Array)> {
        let (k, v) = self.layers.get_mut(layer).ok_or_else(|| mlx::Error { op: "kv_batch", message: "write to an empty batch".into() })?;
        let (h, d, s, end) = (self.kv_heads as i32, self.head_dim as i32, slot as i32, (at + keys.dim(2)) as i32);
        *k = k.slice_update(keys, &[s, 0, at as i32, 0], &[s + 1, h, end, d])?;
        *v = v.slice_update(values, &[s, 0, at as i32, 0], &[s + 1, h, end, d])?;
        Ok((k.slice(&[s, 0, 0, 0], &[s + 1, h, end, d])?, v.slice(&[s, 0, 0, 0], &[s + 1, h, end, d])?))
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

    /// Makes room for `needed` positions in every slot. Admitting a row
    /// with its whole prompt's room costs one reallocation, where growing
    /// chunk by chunk would copy every slot at each capacity step.
    pub fn ensure_capacity(&mut self, needed: usize) -> mlx::Result<()> {
        if needed <= self.capacity {
            return Ok(());
        }
        self.resize(self.lens.len(), needed.div_ceil(CAPACITY_STEP) * CAPACITY_STEP)
    }

    /// Reallocates every layer as `[slots, .., capacity, ..]`, keeping the
    /// current contents (slots and capacity only grow).
    fn resize(&mut self, slots: usize, capacity: usize) -> mlx::Result<()> {
        let shape = [slots, self.kv_heads, capacity, self.head_dim];
        let keep = [self.lens.len(), self.kv_heads, self.capacity, self.head_dim];
        let grow = |old: Option<&Array>| zeros_keeping(&shape, self.dtype, old, keep);
        self.layers = if self.layers.is_empty() {
            (0..self.n_layers).map(|_| Ok((grow(None)?, grow(None)?))).collect::<mlx::Result<_>>()?
        } else {
            self.layers.iter().map(|(k, v)| Ok((grow(Some(k))?, grow(Some(v))?))).collect::<mlx::Result<_>>()?
        };
        self.lens.resize(slots, None);
        self.capacity = capacity;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache_of(len: usize, fill: f32) -> KvCache {
        let mut cache = KvCache::new(2, 1, 4, Dtype::F32);
        if len > 0 {
            let layer = (Array::full(&[1, 1, len, 4], fill, Dtype::F32).unwrap(), Array::full(&[1, 1, len, 4], -fill, Dtype::F32).unwrap());
            cache.fill(&[layer.clone(), layer], len).unwrap();
        }
        cache
    }

    #[test]
    fn slots_double_are_reused_and_give_their_contents_back() {
        mlx::set_default_device(mlx::Device::Cpu).unwrap();
        let mut kv = KvBatch::new(2, 1, 4, Dtype::F32);
        let slots: Vec<usize> = (0..3).map(|i| kv.admit(&cache_of(3 + i, i as f32 + 1.0)).unwrap()).collect();
        assert_eq!(slots, vec![0, 1, 2]);
        assert_eq!(kv.slots(), 4, "slot counts go 1, 2, 4");
        assert_eq!((kv.len(1), kv.len(3)), (4, 0));

        // A released slot's cache holds exactly its rows, and the slot is reused.
        let out = kv.release(1).unwrap();
        assert_eq!(out.len(), 4);
        let (k, v) = out.layer(1).unwrap();
        let k = k.slice(&[0, 0, 0, 0], &[1, 1, 4, 4]).unwrap().to_vec_f32().unwrap();
        let v = v.slice(&[0, 0, 0, 0], &[1, 1, 4, 4]).unwrap().to_vec_f32().unwrap();
        assert!(k.iter().all(|&x| x == 2.0) && v.iter().all(|&x| x == -2.0));
        assert_eq!(kv.admit(&cache_of(2, 9.0)).unwrap(), 1);
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
    fn a_slot_written_alone_shows_its_keys_and_leaves_the_others() {
        mlx::set_default_device(mlx::Device::Cpu).unwrap();
        let mut kv = KvBatch::new(2, 1, 4, Dtype::F32);
        kv.admit(&cache_of(3, 1.0)).unwrap();
        kv.admit(&cache_of(2, 2.0)).unwrap();
        // Three new positions of slot 1 after its two: it then sees five keys.
        let new = Array::full(&[1, 1, 3, 4], 7.0, Dtype::F32).unwrap();
        let (keys, values) = kv.write_slot(1, 1, 2, &new, &new).unwrap();
        assert_eq!((keys.shape(), values.shape()), (vec![1, 1, 5, 4], vec![1, 1, 5, 4]));
        let keys = keys.to_vec_f32().unwrap();
        assert!(keys[..8].iter().all(|&x| x == 2.0) && keys[8..].iter().all(|&x| x == 7.0), "{keys:?}");
        kv.advance(&[0, 3]);
        assert_eq!((kv.len(0), kv.len(1)), (3, 5));
        // Slot 0 is untouched, and layer 0 of slot 1 too.
        let (k0, _) = kv.release(0).unwrap().layer(1).map(|(k, v)| (k.clone(), v.clone())).unwrap();
        assert!(k0.slice(&[0, 0, 0, 0], &[1, 1, 3, 4]).unwrap().to_vec_f32().unwrap().iter().all(|&x| x == 1.0));
        let out = kv.release(1).unwrap();
        let (k_layer0, _) = out.layer(0).unwrap();
        let k_layer0 = k_layer0.slice(&[0, 0, 0, 0], &[1, 1, 5, 4]).unwrap().to_vec_f32().unwrap();
        assert!(k_layer0[8..].iter().all(|&x| x != 7.0), "only layer 1 was written");
    }
}
