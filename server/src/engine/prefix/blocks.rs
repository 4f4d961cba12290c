//! KV positions in fixed-size blocks shared by reference: the block pool
//! (a reference count per block) and block tables (a sequence's positions
//! as a list of blocks). Pure bookkeeping over block ids: the MLX storage
//! behind an id is [`super::paged`]'s, which carries out what these
//! decide (a fresh block to fill, a block to copy before writing, a block
//! whose storage can go).
//!
//! A block holds [`BLOCK`] consecutive positions of every layer (64, the CPU
//! attention kernel's key block, so a block of keys stored in blocks is one
//! whole key block). Tables share blocks by reference: forking a table
//! takes one more reference on each block it keeps. Nothing is ever
//! written into a block more than one table holds: a table that grows into
//! a shared partial last block first swaps it for a copy of its own
//! ([`BlockTable::grow`], copy-on-write of that block alone). A block is
//! freed when its last reference goes, which a table's release or rollback
//! ([`BlockTable::truncate`]) reports so its storage can go too.
//!
//! The key decision: counts live in the pool, not in the storage, so who
//! holds what is checked without a model (a seeded randomized test below
//! writes through tables and checks every read and every count), and the
//! KV bytes held are counted once per block however many entries share it.

/// Positions per block.
pub const BLOCK: usize = 64;

/// A block of the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// Reference counts of blocks; freed ids are reused.
#[derive(Debug, Default)]
pub struct BlockPool {
    /// block id -> references held (0: free)
    counts: Vec<u32>,
    /// ids whose count is 0, reused first
    free: Vec<u32>,
    /// blocks with a count above 0
    num_used: usize,
}

impl BlockPool {
    /// A fresh block, held once.
    pub fn allocate(&mut self) -> BlockId {
        self.num_used += 1;
        match self.free.pop() {
            Some(id) => {
                self.counts[id as usize] = 1;
                BlockId(id)
            }
            None => {
                self.counts.push(1);
                BlockId((self.counts.len() - 1) as u32)
            }
        }
    }

    /// One more reference to `id` (held by the caller).
    pub fn share(&mut self, id: BlockId) -> BlockId {
        let count = &mut self.counts[id.0 as usize];
        assert!(*count > 0, "invariant: only a held block is shared");
        *count += 1;
        id
    }

    /// Drops one reference to `id`; true when that was the last (the block
    /// is free and its storage can go).
    pub fn release(&mut self, id: BlockId) -> bool {
        let count = &mut self.counts[id.0 as usize];
        assert!(*count > 0, "invariant: a block is released at most as often as it is held");
        *count -= 1;
        if *count > 0 {
            return false;
        }
        self.free.push(id.0);
        self.num_used -= 1;
        true
    }

    /// References held to `id`.
    pub fn count(&self, id: BlockId) -> u32 {
        self.counts.get(id.0 as usize).copied().unwrap_or(0)
    }

    /// Blocks held by anyone.
    #[cfg(test)]
    pub fn num_used(&self) -> usize {
        self.num_used
    }
}

/// What [`BlockTable::grow`] asks of the storage: fill the blocks at table
/// indices `fresh`, after copying the first `positions` positions of
/// `copied.0` into `copied.1` (the shared partial block swapped for one
/// of the table's own; its later positions are written anew).
#[derive(Debug, PartialEq, Eq)]
pub struct Growth {
    /// (shared block, its copy, positions to copy)
    pub copied: Option<(BlockId, BlockId, usize)>,
    /// table indices of the blocks allocated for the new positions
    pub fresh: std::ops::Range<usize>,
}

/// A sequence's positions `0..len` as blocks: position `p` is position
/// `p % BLOCK` of block `blocks[p / BLOCK]`. Holds one reference to each of
/// its blocks; give them back with [`release`](Self::release) (the
/// storage holder decides when, so a table is plain data).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<BlockId>,
    len: usize,
}

impl BlockTable {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// A table of this one's first `len` positions, sharing their blocks
    /// (a partial last block too: whoever writes into it copies it first).
    pub fn fork(&self, pool: &mut BlockPool, len: usize) -> BlockTable {
        let len = len.min(self.len);
        BlockTable { blocks: self.blocks[..len.div_ceil(BLOCK)].iter().map(|&b| pool.share(b)).collect(), len }
    }

    /// Makes the table hold `len` positions (at least as many as now),
    /// the new ones to be written: a shared partial last block is swapped
    /// for a copy first (copy-on-write), and fresh blocks are allocated
    /// for the rest. What the storage must copy and fill is returned.
    pub fn grow(&mut self, pool: &mut BlockPool, len: usize) -> Growth {
        assert!(len >= self.len, "a table grows; rollback is truncate");
        let mut copied = None;
        let partial = self.len % BLOCK;
        if len > self.len && partial > 0 {
            let last = self.blocks.len() - 1;
            let shared = self.blocks[last];
            if pool.count(shared) > 1 {
                let own = pool.allocate();
                pool.release(shared);
                self.blocks[last] = own;
                copied = Some((shared, own, partial));
            }
        }
        let from = self.blocks.len();
        while self.blocks.len() < len.div_ceil(BLOCK) {
            self.blocks.push(pool.allocate());
        }
        self.len = len;
        Growth { copied, fresh: from..self.blocks.len() }
    }

    /// Rolls back to the first `len` positions (no more than now): the
    /// blocks past them are released. Returns the blocks that were freed.
    pub fn truncate(&mut self, pool: &mut BlockPool, len: usize) -> Vec<BlockId> {
        let len = len.min(self.len);
        let kept = len.div_ceil(BLOCK);
        let freed = self.blocks.drain(kept..).filter(|&b| pool.release(b)).collect();
        self.len = len;
        freed
    }

    /// Gives back every block; returns the blocks that were freed.
    pub fn release(&mut self, pool: &mut BlockPool) -> Vec<BlockId> {
        self.truncate(pool, 0)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::test_rng::Rng;
    use super::*;

    /// Block contents as the storage would hold them: block -> its
    /// positions' values (a value is written once per position).
    type Storage = HashMap<BlockId, Vec<u64>>;

    /// Applies a growth as the storage does, then writes `values` into the
    /// table's new positions; panics if a write lands in a shared block.
    /// Returns whether it copied a shared block.
    fn write(table: &mut BlockTable, pool: &mut BlockPool, storage: &mut Storage, values: &[u64]) -> bool {
        let start = table.len();
        let growth = table.grow(pool, start + values.len());
        let copied = growth.copied.is_some();
        if let Some((from, to, positions)) = growth.copied {
            let kept = storage[&from][..positions].to_vec();
            assert!(storage.insert(to, kept).is_none(), "a copy goes into a fresh block");
        }
        for i in growth.fresh {
            assert!(storage.insert(table.blocks()[i], Vec::new()).is_none(), "a fresh block held nothing");
        }
        for (p, &v) in (start..).zip(values) {
            let block = table.blocks()[p / BLOCK];
            assert_eq!(pool.count(block), 1, "position {p} written into a shared block");
            let held = storage.get_mut(&block).expect("a table's blocks have storage");
            held.truncate(p % BLOCK); // rolled-back positions are written again
            held.push(v);
        }
        copied
    }

    fn read(table: &BlockTable, storage: &Storage) -> Vec<u64> {
        (0..table.len()).map(|p| storage[&table.blocks()[p / BLOCK]][p % BLOCK]).collect()
    }

    /// Returns how many were freed.
    fn drop_freed(storage: &mut Storage, freed: Vec<BlockId>) -> usize {
        for b in &freed {
            assert!(storage.remove(b).is_some(), "a freed block had storage");
        }
        freed.len()
    }

    const OPERATIONS: usize = 20_000;
    /// Few tables of a few blocks each: forks, shared partial blocks and
    /// frees meet often.
    const MAX_TABLES: usize = 12;
    const MAX_LEN: usize = 6 * BLOCK;

    /// Tables forked, grown, rolled back and released at random (each
    /// beside a plain vector of what it should read), checked after every
    /// operation: every table reads its own values (so no write reached a
    /// block another table holds), every count equals the references the
    /// tables hold, freed blocks are exactly those no table holds; at the
    /// end every count is back to zero.
    #[test]
    fn random_forks_writes_rollbacks_and_releases_keep_every_count() {
        let mut rng = Rng(0x0b10_c4ed_0052);
        let mut pool = BlockPool::default();
        let mut storage = Storage::new();
        let mut tables: Vec<(BlockTable, Vec<u64>)> = Vec::new();
        let mut next_value = 0u64;
        let (mut copies, mut frees) = (0, 0);
        for _ in 0..OPERATIONS {
            match rng.below(10) {
                // A new sequence, written in one or more steps.
                0 if tables.len() < MAX_TABLES => tables.push((BlockTable::default(), Vec::new())),
                // A fork of some table's prefix (a prefix-cache hit).
                1 | 2 if !tables.is_empty() && tables.len() < MAX_TABLES => {
                    let i = rng.below(tables.len());
                    let len = rng.below(tables[i].0.len() + 1);
                    let fork = tables[i].0.fork(&mut pool, len);
                    let expected = tables[i].1[..len].to_vec();
                    tables.push((fork, expected));
                }
                // A step of 1-150 positions (decode, drafts, prompt chunks).
                3..=6 if !tables.is_empty() => {
                    let i = rng.below(tables.len());
                    if tables[i].0.len() > MAX_LEN {
                        continue;
                    }
                    let longest = if rng.below(4) == 0 { 150 } else { 3 };
                    let n = 1 + rng.below(longest);
                    let values: Vec<u64> = (0..n as u64).map(|k| next_value + k).collect();
                    next_value += n as u64;
                    let (table, expected) = &mut tables[i];
                    copies += usize::from(write(table, &mut pool, &mut storage, &values));
                    expected.extend(&values);
                }
                // Rejected drafts, or a fork point inside a block.
                7 if !tables.is_empty() => {
                    let i = rng.below(tables.len());
                    let len = tables[i].0.len().saturating_sub(rng.below(80));
                    let freed = tables[i].0.truncate(&mut pool, len);
                    frees += drop_freed(&mut storage, freed);
                    tables[i].1.truncate(len);
                }
                // A sequence finished or evicted.
                8 | 9 if !tables.is_empty() => {
                    let (mut table, _) = tables.swap_remove(rng.below(tables.len()));
                    let freed = table.release(&mut pool);
                    frees += drop_freed(&mut storage, freed);
                }
                _ => {}
            }
            let mut held: HashMap<BlockId, u32> = HashMap::new();
            for (table, expected) in &tables {
                assert_eq!(&read(table, &storage), expected);
                assert_eq!(table.blocks().len(), table.len().div_ceil(BLOCK));
                for &b in table.blocks() {
                    *held.entry(b).or_default() += 1;
                }
            }
            assert_eq!(pool.num_used(), held.len());
            assert_eq!(storage.len(), held.len(), "storage of exactly the held blocks");
            for (b, n) in held {
                assert_eq!(pool.count(b), n);
            }
        }
        for (mut table, _) in tables {
            let freed = table.release(&mut pool);
            drop_freed(&mut storage, freed);
        }
        assert!(copies > 500 && frees > 500, "the run copied {copies} shared blocks and freed {frees}");
        assert_eq!(pool.num_used(), 0);
        assert!(storage.is_empty());
        assert!(pool.counts.iter().all(|&c| c == 0));
    }
}
