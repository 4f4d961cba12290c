//! A sequence's key/value cache, preallocated in blocks and written in place.
//!
//! Each layer holds `[1, kv_heads, capacity, head_dim]` buffers. New keys are
//! written with `slice_update` at the current length; because the cache is the
//! buffer's only holder when the step is evaluated, MLX donates it and the
//! write happens in place (no per-step concatenation). Rolling back (rejected
//! draft tokens) is just moving `len` back: stale positions are overwritten
//! by the next write and never read, since attention only sees `..len`.
use mlx::{Array, Dtype};

/// Capacity grows in multiples of this many tokens.
pub const CAPACITY_STEP: usize = 256;

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

/// Cloning shares every buffer (MLX arrays are reference-counted values): a
/// clone is a copy-on-write snapshot, and the first write to either side
/// copies that layer's buffer because it is no longer uniquely held.
#[derive(Clone)]
pub struct KvCache {
    layers: Vec<Option<(Array, Array)>>,
    len: usize,
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: Dtype,
}

impl KvCache {
    pub fn new(n_layers: usize, kv_heads: usize, head_dim: usize, dtype: Dtype) -> KvCache {
        KvCache { layers: (0..n_layers).map(|_| None).collect(), len: 0, capacity: 0, kv_heads, head_dim, dtype }
    }

    /// Tokens whose keys and values are stored.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets everything after the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Bytes reserved on the device.
    pub fn nbytes(&self) -> usize {
        self.layers.iter().flatten().map(|(k, v)| k.nbytes() + v.nbytes()).sum()
    }

    /// Makes room for `extra` more tokens, growing all layers together.
    pub fn reserve(&mut self, extra: usize) -> mlx::Result<()> {
        let needed = self.len + extra;
        if needed <= self.capacity {
            return Ok(());
        }
        let new_cap = needed.div_ceil(CAPACITY_STEP) * CAPACITY_STEP;
        let shape = [1, self.kv_heads, new_cap, self.head_dim];
        let keep = [1, self.kv_heads, self.len, self.head_dim];
        for layer in &mut self.layers {
            let fresh = |old: Option<&Array>| zeros_keeping(&shape, self.dtype, old, keep);
            let (k, v) = match layer.take() {
                Some((k, v)) => (fresh(Some(&k))?, fresh(Some(&v))?),
                None => (fresh(None)?, fresh(None)?),
            };
            *layer = Some((k, v));
        }
        self.capacity = new_cap;
        Ok(())
    }

    /// Writes `[1, kv_heads, n, head_dim]` keys/values for layer `layer` at the
    /// current length and returns views of all `len + n` stored positions.
    /// `reserve(n)` must have been called for this step; `advance(n)` commits.
    pub fn append(&mut self, layer: usize, k: &Array, v: &Array) -> mlx::Result<(Array, Array)> {
        let n = k.dim(2);
        let end = self.len + n;
        if end > self.capacity {
            return Err(mlx::Error { op: "kv_cache", message: format!("append of {n} past capacity {}", self.capacity) });
        }
        let (h, d) = (self.kv_heads as i32, self.head_dim as i32);
        let (start, stop) = ([0, 0, self.len as i32, 0], [1, h, end as i32, d]);
        let (old_k, old_v) = self.layers[layer].take().ok_or_else(|| mlx::Error { op: "kv_cache", message: "layer not reserved".into() })?;
        let new_k = old_k.slice_update(k, &start, &stop)?;
        let new_v = old_v.slice_update(v, &start, &stop)?;
        drop((old_k, old_v)); // the graph now holds the only reference: MLX can donate the buffer
        let view = |a: &Array| a.slice(&[0, 0, 0, 0], &[1, h, end as i32, d]);
        let out = (view(&new_k)?, view(&new_v)?);
        self.layers[layer] = Some((new_k, new_v));
        Ok(out)
    }

    /// Like [`append`](Self::append) for the CPU's fused attention: writes
    /// tokens `start .. start + n` of a whole step's keys and values
    /// (`[1, T, kv_heads * head_dim]` or `[T, kv_heads, 1, head_dim]`, views
    /// allowed) at the current length, and returns the updated buffers whole
    /// (valid up to `len + n`). In place unless a snapshot shares the buffer.
    pub fn write_step(&mut self, layer: usize, keys: &Array, values: &Array, start: usize, n: usize) -> mlx::Result<(Array, Array)> {
        if self.len + n > self.capacity {
            return Err(mlx::Error { op: "kv_cache", message: format!("append of {n} past capacity {}", self.capacity) });
        }
        let (old_k, old_v) = self.layers[layer].take().ok_or_else(|| mlx::Error { op: "kv_cache", message: "layer not reserved".into() })?;
        let write = |old: &Array, fresh: &Array| mlx::fast::cpu_kv_write(old, fresh, start, n, self.len);
        match write(&old_k, keys).and_then(|k| Ok((k, write(&old_v, values)?))) {
            Ok((new_k, new_v)) => {
                drop((old_k, old_v)); // the graph now holds the only reference: the write can be in place
                self.layers[layer] = Some((new_k.clone(), new_v.clone()));
                Ok((new_k, new_v))
            }
            Err(e) => {
                self.layers[layer] = Some((old_k, old_v));
                Err(e)
            }
        }
    }

    /// Layer `layer`'s key and value buffers, if reserved.
    pub fn layer(&self, layer: usize) -> Option<(&Array, &Array)> {
        self.layers.get(layer)?.as_ref().map(|(k, v)| (k, v))
    }

    /// Replaces an empty cache's contents with copies of `layers`, each
    /// `[1, kv_heads, len, head_dim]` (views allowed): the cache then owns
    /// buffers of its own.
    pub fn fill(&mut self, layers: &[(Array, Array)], len: usize) -> mlx::Result<()> {
        if !self.is_empty() || layers.len() != self.layers.len() {
            return Err(mlx::Error { op: "kv_cache", message: format!("fill of {} layers into a cache of {} holding {}", layers.len(), self.layers.len(), self.len) });
        }
        self.reserve(len)?;
        let stop = [1, self.kv_heads as i32, len as i32, self.head_dim as i32];
        for (slot, (k, v)) in self.layers.iter_mut().zip(layers) {
            let (bk, bv) = slot.take().expect("reserved above");
            *slot = Some((bk.slice_update(k, &[0, 0, 0, 0], &stop)?, bv.slice_update(v, &[0, 0, 0, 0], &stop)?));
        }
        self.len = len;
        Ok(())
    }

    /// Commits `n` appended tokens (after every layer has appended them).
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// The stored buffers, for evaluating them along with a step's outputs.
    pub fn buffers(&self) -> Vec<&Array> {
        self.layers.iter().flatten().flat_map(|(k, v)| [k, v]).collect()
    }
}
