//! The KV protocol: what a running row and a model layer need of a
//! sequence's keys and values, whoever holds them.
//!
//! mlx-lm gives every layer a cache object with `update_and_fetch`,
//! `offset`, `trim` and a state to save; ours differs in two ways. One
//! [`KvCache`] holds every layer of a row, because growing, windows and
//! quantization are decided for all layers at once: a step reserves room
//! once ([`LayerKv::reserve`]), each layer writes and reads
//! ([`LayerKv::update_and_fetch`]), and the step commits once
//! ([`LayerKv::advance`]). And on a GPU a row's keys live in a slot of the
//! engine's [`KvBatch`](super::KvBatch), written for all slots at once by the batched step
//! ([`super::BatchedRows`]), so a slot has no per-layer write of its own: it
//! is held through a [`SlotLease`](super::SlotLease), which gives the slot
//! back when dropped.
//!
//! What the engine asks of either, [`Kv`]:
//! - [`offset`](Kv::offset): positions held, where the next token goes (its
//!   RoPE position);
//! - [`trim`](Kv::trim): rolling back rejected drafts (a cache is trimmed
//!   only down to [`KvCache::earliest_truncation`], which rollbacks after a
//!   step never reach);
//! - [`buffers`](Kv::buffers): what a step wrote that must be evaluated
//!   with it (none for a slot: the batch evaluates its buffers once);
//! - [`nbytes`](Kv::nbytes): device bytes it holds alone (none for a slot:
//!   the batch counts its buffers once).
//!
//! Snapshots need no method: a [`KvCache`] clone shares its buffers
//! copy-on-write (what the prefix cache stores), and a slot becomes a cache
//! of its own through [`SlotLease::release`](super::SlotLease::release).
//! The row cache's sliding-window and quantized forms are modes of
//! [`KvCache`] (see its notes), so they follow the protocol with it; the
//! CPU's fused attention writes a cache's buffers inside its own graph node
//! ([`KvCache::take_for_write`]) and stays outside the protocol.
//!
//! State rows (a hybrid model's recurrent layers, `state_rows.rs`) ride in
//! the row's [`KvCache`] beside its attention layers' KV, so every holder
//! of a row's KV carries them; what the protocol asks of them is that
//! [`trim`](Kv::trim) below a state's position leaves it rolled back (it
//! refuses to run on) and [`KvCache::earliest_truncation`] says no
//! rollback reaches below it. Paged KV plugs in here too: a new holder
//! implements [`Kv`], and [`LayerKv`] where layers write to it directly.
use mlx::Array;

use super::kv_cache::KvCache;

/// What the engine needs of a row's KV, wherever it lives.
pub trait Kv {
    /// Positions held: where the next token's keys go.
    fn offset(&self) -> usize;
    /// Forgets the last `n` positions (rejected drafts).
    fn trim(&mut self, n: usize);
    /// The buffers a step wrote that must be evaluated with it.
    fn buffers(&self) -> Vec<&Array>;
    /// Device bytes held by this KV alone.
    fn nbytes(&self) -> usize;
}

/// What a layer's attention needs of a KV it writes itself, one layer at
/// a time within a step.
pub trait LayerKv: Kv {
    /// Makes room for a step of `n` tokens in every layer (before any
    /// layer writes).
    fn reserve(&mut self, n: usize) -> mlx::Result<()>;
    /// The first position layer `layer` holds (a window layer drops older
    /// ones): what its fetched keys start at.
    fn first(&self, layer: usize) -> usize;
    /// Writes layer `layer`'s `[1, kv_heads, n, head_dim]` keys and values
    /// at the offset and returns everything it holds, positions
    /// `first(layer) .. offset + n`.
    fn update_and_fetch(&mut self, layer: usize, keys: &Array, values: &Array) -> mlx::Result<(Array, Array)>;
    /// Commits a step's `n` tokens, after every layer wrote them.
    fn advance(&mut self, n: usize);
}

/// Both kinds a row's KV comes in (see the module notes).
pub enum RowKv {
    /// A cache of the row's own.
    Own(KvCache),
    /// A slot of the engine's batch.
    Slot(super::SlotLease),
}

impl RowKv {
    fn as_kv(&self) -> &dyn Kv {
        match self {
            RowKv::Own(cache) => cache,
            RowKv::Slot(lease) => lease,
        }
    }
}

impl Kv for RowKv {
    fn offset(&self) -> usize {
        self.as_kv().offset()
    }

    fn trim(&mut self, n: usize) {
        match self {
            RowKv::Own(cache) => cache.trim(n),
            RowKv::Slot(lease) => lease.trim(n),
        }
    }

    fn buffers(&self) -> Vec<&Array> {
        self.as_kv().buffers()
    }

    fn nbytes(&self) -> usize {
        self.as_kv().nbytes()
    }
}
