//! The prefix cache's KV state in blocks shared by reference: what an
//! entry in RAM holds (a block table into [`Pages`]) and how a row's cache
//! becomes one and comes back. The counts are [`super::blocks`]'s; this
//! module keeps the arrays behind the block ids.
//!
//! A turn that resumed from an entry in RAM (its *origin*) holds that
//! entry's state bit for bit in its first positions: they were copied from
//! it, and a row only writes past where it resumed. So its own entry takes
//! the origin's blocks by reference up to there (a shared partial block is
//! copied, [`BlockTable::grow`]) and copies only the rest out of the row's
//! buffers: N sessions that resumed from one shared system prompt hold its
//! KV once, and each turn of a session copies only what the turn added.
//!
//! Storage is by *segment*: the buffers one insert wrote, holding
//! consecutive blocks (`[1, kv heads, positions, width]` per layer, keys in
//! the cache's own layout, so a block of keys stored in blocks is one whole
//! key block, and a block of codes carries its scales). A segment's memory
//! goes when its last block is freed. A cache stored with nothing to share
//! is its own segment, as is (no copy); such an entry, held by no other,
//! is still lent whole to its session's next turn. Its bytes are booked to
//! one entry holding a block of it (the first still there), so the cache's
//! byte budget counts every segment once.
//!
//! What does not share yet: caches with window layers (their window
//! layers drop their first positions, so positions are not buffer rows)
//! and caches holding a hybrid model's recurrent state (a state is of one
//! length, with checkpoints at a few block boundaries, not of every block:
//! `models/state_rows.rs`) are stored whole and never shared. An entry that shares blocks is
//! restored for a turn as one cache again (a copy of its history, as a
//! copy-on-write snapshot costs): rows do not read through block tables
//! yet (docs/architecture.md, "Paged KV").
use std::collections::HashMap;

use mlx::fast::{KvCodes, KEY_BLOCK};
use mlx::Array;

use super::blocks::{BlockId, BlockPool, BlockTable, BLOCK};
use super::index::EntryId;
use crate::models::{KvCache, StoredCache, KV_CAPACITY_STEP};

const _: () = assert!(BLOCK == KEY_BLOCK, "a block of keys stored in blocks is one whole key block");
const _: () = assert!(BLOCK == crate::models::CHECKPOINT_INTERVAL, "a recurrent state's checkpoints are where blocks end");
const _: () = assert!(KV_CAPACITY_STEP.is_multiple_of(BLOCK), "a cache's room is whole blocks");

type SegmentId = u64;

/// Buffers holding consecutive blocks of one sequence.
struct Segment {
    /// Per layer, keys and values from that block's first position on.
    layers: Vec<(Array, Array)>,
    /// A cache stored as is (its buffers are `layers`): lent back whole.
    cache: Option<KvCache>,
    bytes: usize,
    /// Its blocks still held by some table.
    live_blocks: usize,
    /// Entries holding a block of it; the first is booked for its bytes.
    holders: Vec<EntryId>,
}

/// An entry's state in RAM: its positions as blocks.
pub(super) struct Paged {
    table: BlockTable,
    /// The segments its blocks are in (each once), for the bookings.
    segments: Vec<SegmentId>,
    /// An empty cache of the state's form, restored into.
    shape: KvCache,
    codes: KvCodes,
    /// Whether its blocks may be shared: not for window layers or
    /// recurrent state (see the module's notes), which are stored whole.
    shareable: bool,
}

impl Paged {
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// An empty cache of the state's form.
    pub fn shape(&self) -> &KvCache {
        &self.shape
    }
}

/// The blocks' arrays and counts.
#[derive(Default)]
pub(super) struct Pages {
    pool: BlockPool,
    /// block -> its segment, and its index there
    blocks: HashMap<BlockId, (SegmentId, usize)>,
    segments: HashMap<SegmentId, Segment>,
    next_segment: SegmentId,
}

impl Pages {
    /// `cache` as an entry's state: when it resumed from `origin`'s first
    /// `resumed` positions (an entry in RAM, the same codes and no window
    /// layers), those come from the origin's blocks and the rest is
    /// copied into a segment of its own; otherwise the cache is the
    /// segment. Held by no entry until [`hold`](Self::hold).
    pub fn page(&mut self, cache: KvCache, origin: Option<(&Paged, usize)>) -> mlx::Result<Paged> {
        let origin = origin.filter(|(o, _)| o.shareable && shareable(&cache) && o.codes == cache.codes() && o.shape.geometry() == cache.geometry());
        let Some((origin, resumed)) = origin else { return self.whole(cache) };
        let resumed = resumed.min(cache.len()).min(origin.len());
        if resumed < BLOCK {
            return self.whole(cache);
        }
        let mut table = origin.table.fork(&mut self.pool, resumed);
        let growth = table.grow(&mut self.pool, cache.len());
        // The copy of a shared partial block is filled from the row, which
        // holds the same positions and the ones it wrote after them.
        let first = if growth.copied.is_some() { resumed / BLOCK } else { growth.fresh.start };
        let end = table.blocks().len();
        let mut segments: Vec<SegmentId> = table.blocks()[..first].iter().map(|b| self.blocks[b].0).collect();
        if first < end {
            let layers = match copy_positions(&cache, first * BLOCK, end * BLOCK) {
                Ok(layers) => layers,
                Err(e) => {
                    // The fresh blocks have no storage yet: only the shared ones go back.
                    let fresh: Vec<BlockId> = table.blocks()[first..].to_vec();
                    for b in table.release(&mut self.pool) {
                        if !fresh.contains(&b) {
                            self.free_block(b);
                        }
                    }
                    return Err(e);
                }
            };
            let bytes = layers.iter().map(|(k, v)| k.nbytes() + v.nbytes()).sum();
            let id = self.add_segment(layers, None, bytes, &table.blocks()[first..]);
            segments.push(id);
        }
        segments.sort_unstable();
        segments.dedup();
        Ok(Paged { table, segments, shape: cache.emptied(), codes: cache.codes(), shareable: true })
    }

    /// `cache` stored as is: one segment of its buffers (spare room
    /// included; a recurrent state's arrays and checkpoints too, which only
    /// the cache itself holds: such a cache is not shareable).
    fn whole(&mut self, cache: KvCache) -> mlx::Result<Paged> {
        let layers: Vec<(Array, Array)> = match cache.as_stored() {
            Some((_, buffers)) => buffers.into_iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            None => return Err(mlx::Error { op: "prefix_cache", message: "a layer of the cache holds nothing".into() }),
        };
        // Detached (they are evaluated, or are evaluated now): a buffer
        // otherwise holds the last step that wrote it, or the file and base
        // it was read back from.
        mlx::eval_detached(&cache.buffers())?;
        let mut table = BlockTable::default();
        table.grow(&mut self.pool, cache.len());
        let (shape, codes, shareable) = (cache.emptied(), cache.codes(), shareable(&cache));
        let bytes = cache.nbytes();
        let id = self.add_segment(layers, Some(cache), bytes, table.blocks());
        Ok(Paged { table, segments: vec![id], shape, codes, shareable })
    }

    fn add_segment(&mut self, layers: Vec<(Array, Array)>, cache: Option<KvCache>, bytes: usize, blocks: &[BlockId]) -> SegmentId {
        let id = self.next_segment;
        self.next_segment += 1;
        for (i, &b) in blocks.iter().enumerate() {
            self.blocks.insert(b, (id, i));
        }
        self.segments.insert(id, Segment { layers, cache, bytes, live_blocks: blocks.len(), holders: Vec::new() });
        id
    }

    /// Entry `id` holds `paged` from now on.
    pub fn hold(&mut self, id: EntryId, paged: &Paged) {
        for s in &paged.segments {
            self.segments.get_mut(s).expect("invariant: a held block's segment exists").holders.push(id);
        }
    }

    /// Bytes of segments entry `id` is booked for (it holds `paged`).
    pub fn owned_bytes(&self, id: EntryId, paged: &Paged) -> usize {
        paged.segments.iter().map(|s| &self.segments[s]).filter(|s| s.holders.first() == Some(&id)).map(|s| s.bytes).sum()
    }

    /// Bytes of the segments `paged` (not yet held) would be booked for:
    /// those no entry holds.
    pub fn unowned_bytes(&self, paged: &Paged) -> usize {
        paged.segments.iter().map(|s| &self.segments[s]).filter(|s| s.holders.is_empty()).map(|s| s.bytes).sum()
    }

    /// Entry `id` lets go of `paged`: blocks no one else holds are freed,
    /// segments with no block left go. Returns the entries now booked for
    /// a segment `id` was booked for.
    pub fn release(&mut self, id: EntryId, mut paged: Paged) -> Vec<EntryId> {
        for b in paged.table.release(&mut self.pool) {
            self.free_block(b);
        }
        let mut rebooked = Vec::new();
        for s in paged.segments {
            let segment = self.segments.get_mut(&s).expect("invariant: a held segment exists");
            let was_owner = segment.holders.first() == Some(&id);
            segment.holders.retain(|&h| h != id);
            if segment.live_blocks == 0 {
                self.segments.remove(&s);
            } else if was_owner {
                rebooked.extend(segment.holders.first().copied());
            }
        }
        rebooked
    }

    /// Block `b`, freed, leaves its segment (which goes with its last
    /// block, unless an entry still books it: see [`release`](Self::release)).
    fn free_block(&mut self, b: BlockId) {
        let (s, _) = self.blocks.remove(&b).expect("invariant: a freed block had storage");
        let segment = self.segments.get_mut(&s).expect("invariant: a block's segment exists");
        segment.live_blocks -= 1;
        if segment.live_blocks == 0 && segment.holders.is_empty() {
            self.segments.remove(&s);
        }
    }

    /// Whether `paged` is a cache stored as is that no other entry shares:
    /// it can be handed out whole.
    pub fn lendable(&self, paged: &Paged) -> bool {
        let [s] = paged.segments[..] else { return false };
        self.segments[&s].cache.is_some() && paged.table.blocks().iter().all(|&b| self.pool.count(b) == 1)
    }

    /// The cache of a [`lendable`](Self::lendable) `paged`, taken out
    /// whole (entry `id` no longer holds it).
    pub fn take_whole(&mut self, id: EntryId, paged: Paged) -> Option<KvCache> {
        if !self.lendable(&paged) {
            self.release(id, paged);
            return None;
        }
        let s = paged.segments[0];
        let mut segment = self.segments.remove(&s)?;
        let mut table = paged.table;
        for b in table.release(&mut self.pool) {
            self.blocks.remove(&b);
        }
        // Its buffers' other references go first, so the turn writes in place.
        segment.layers.clear();
        segment.cache.take()
    }

    /// A cache of `paged`'s first `len` positions for a turn to resume
    /// from: a copy-on-write snapshot of a cache stored as is, else its
    /// blocks copied into buffers of its own.
    pub fn restore(&self, paged: &Paged, len: usize) -> mlx::Result<KvCache> {
        let len = len.min(paged.len());
        if let [s] = paged.segments[..] {
            if let Some(cache) = &self.segments[&s].cache {
                let mut snapshot = cache.clone();
                snapshot.truncate(len);
                return Ok(snapshot);
            }
        }
        let blocks = &paged.table.blocks()[..len.div_ceil(BLOCK)];
        let capacity = (len + 1).div_ceil(KV_CAPACITY_STEP) * KV_CAPACITY_STEP;
        let (n_layers, ..) = paged.shape.geometry();
        let mut layers = Vec::with_capacity(n_layers);
        for layer in 0..n_layers {
            layers.push((self.gather(blocks, layer, 0, capacity)?, self.gather(blocks, layer, 1, capacity)?));
        }
        let codes = match paged.codes {
            KvCodes::Float => None,
            KvCodes::Affine { bits, group } => Some((bits, group)),
        };
        let stored = StoredCache { len, capacity, window_first: 0, window_capacity: 0, codes };
        paged.shape.emptied().from_stored(&stored, layers)
    }

    /// One buffer (`kind` 0: keys, 1: values) of layer `layer` holding
    /// `blocks` in order, then zeros up to `capacity` positions.
    fn gather(&self, blocks: &[BlockId], layer: usize, kind: usize, capacity: usize) -> mlx::Result<Array> {
        let mut pieces = Vec::new();
        let mut i = 0;
        while i < blocks.len() {
            let (s, at) = self.blocks[&blocks[i]];
            // A run of blocks stored one after another in one segment.
            let mut n = 1;
            while i + n < blocks.len() && self.blocks[&blocks[i + n]] == (s, at + n) {
                n += 1;
            }
            let segment = &self.segments[&s];
            let buffer = if kind == 0 { &segment.layers[layer].0 } else { &segment.layers[layer].1 };
            let (heads, width) = (buffer.dim(1) as i32, buffer.dim(3) as i32);
            pieces.push(buffer.slice(&[0, 0, (at * BLOCK) as i32, 0], &[1, heads, ((at + n) * BLOCK) as i32, width])?);
            i += n;
        }
        let first = pieces.first().ok_or_else(|| mlx::Error { op: "prefix_cache", message: "no blocks to restore".into() })?;
        let (heads, width, dtype) = (first.dim(1), first.dim(3), first.dtype());
        let room = capacity - blocks.len() * BLOCK;
        if room > 0 {
            pieces.push(Array::zeros(&[1, heads, room, width], dtype)?);
        }
        mlx::concatenate(&pieces.iter().collect::<Vec<_>>(), 2)
    }

    /// Blocks held by some entry, and the bytes of the segments holding them.
    #[cfg(test)]
    pub fn held(&self) -> (usize, usize) {
        (self.pool.num_used(), self.segments.values().map(|s| s.bytes).sum())
    }
}

/// Copies of positions `from..to` (whole blocks) of every layer of
/// `cache`'s buffers, evaluated so the cache's buffers can go.
fn copy_positions(cache: &KvCache, from: usize, to: usize) -> mlx::Result<Vec<(Array, Array)>> {
    let (_, buffers) = cache.as_stored().ok_or_else(|| mlx::Error { op: "prefix_cache", message: "a layer of the cache holds nothing".into() })?;
    let copy = |a: &Array| -> mlx::Result<Array> {
        let (heads, width) = (a.dim(1), a.dim(3));
        if to > a.dim(2) {
            return Err(mlx::Error { op: "prefix_cache", message: format!("positions up to {to} of a buffer of {}", a.dim(2)) });
        }
        // Times one: a new buffer of exactly these values (x * 1 is x, the
        // sign of a zero included). A slice is a view of the whole buffer,
        // and so are MLX's copies of it when they need none (`contiguous`
        // of one kv head, a `slice_update` covering its whole target).
        a.slice(&[0, 0, from as i32, 0], &[1, heads as i32, to as i32, width as i32])?.multiply(&Array::scalar(1.0, a.dtype())?)
    };
    let layers = buffers.iter().map(|(k, v)| Ok((copy(k)?, copy(v)?))).collect::<mlx::Result<Vec<_>>>()?;
    // Detached: evaluated arrays hold their inputs, here the row's whole buffers.
    mlx::eval_detached(&layers.iter().flat_map(|(k, v)| [k, v]).collect::<Vec<_>>())?;
    Ok(layers)
}

/// Whether a cache's positions are rows of its buffers and all of its
/// state: no window layers, no recurrent state.
fn shareable(cache: &KvCache) -> bool {
    !cache.has_windows() && cache.recurrent().is_none()
}
