//! A row's hold on a slot of the engine's [`KvBatch`]: the slot is the
//! row's for as long as the lease lives, and dropping the lease frees it,
//! so a row that ends by any path (finished, cancelled, failed) gives its
//! slot back without the engine freeing it by hand.
//!
//! The batch is owned by the engine thread and shared with its leases
//! through an `Rc<RefCell<..>>` (MLX arrays are not `Send`, so neither
//! leaves that thread). The batch is borrowed mutably only within a step's
//! forward, when no row is dropped.
use std::cell::RefCell;
use std::rc::Rc;

use mlx::Array;

use super::kv::Kv;
use super::kv_batch::KvBatch;
use super::kv_cache::KvCache;

/// The engine's batch, shared with the leases on its slots.
pub type SharedKvBatch = Rc<RefCell<KvBatch>>;

pub struct SlotLease {
    batch: SharedKvBatch,
    slot: usize,
    /// Cleared when the slot went back through [`release`](Self::release).
    held: bool,
}

impl SlotLease {
    /// Moves `cache` into a free slot of `batch` with room for `room`
    /// positions (see [`KvBatch::admit`]) and holds that slot.
    pub fn admit(batch: &SharedKvBatch, cache: &KvCache, room: usize) -> mlx::Result<SlotLease> {
        let slot = batch.borrow_mut().admit(cache, room)?;
        Ok(SlotLease { batch: Rc::clone(batch), slot, held: true })
    }

    /// The slot held.
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// Gives the slot back with its contents as a cache of the row's own
    /// (see [`KvBatch::release`]); on an error the slot is freed all the same.
    pub fn release(mut self) -> mlx::Result<KvCache> {
        let cache = self.batch.borrow_mut().release(self.slot)?;
        self.held = false;
        Ok(cache)
    }
}

impl Kv for SlotLease {
    fn offset(&self) -> usize {
        self.batch.borrow().len(self.slot)
    }

    fn trim(&mut self, n: usize) {
        let mut batch = self.batch.borrow_mut();
        let len = batch.len(self.slot);
        batch.truncate(self.slot, len - n);
    }

    /// None: the step evaluates the batch's buffers once for all slots.
    fn buffers(&self) -> Vec<&Array> {
        Vec::new()
    }

    /// None: the batch's bytes are counted once for all slots.
    fn nbytes(&self) -> usize {
        0
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        if self.held {
            self.batch.borrow_mut().forget(self.slot);
        }
    }
}
