//! The prefix cache: KV state of finished turns, reused by later requests
//! that start with the same tokens in the same scope. A request reads its
//! own scope (its session's private history) and the shared scope (state a
//! client put there on purpose, such as a common system prompt), taking the
//! longer match; it writes only its own scope. Closing or expiring a
//! session drops all of its entries ([`PrefixCache::drop_scope`]).
//!
//! This facade runs the cache's operations over three parts, each with one
//! job:
//! - [`index`]: pure bookkeeping (no MLX): block hash chains, scopes,
//!   replacement, live/idle eviction order under moka's policy, and which
//!   entry is in RAM, the host tier or on disk;
//! - [`store`]: the entries' MLX state, kept in blocks shared by reference
//!   between the entries that continue one another ([`paged`], over the
//!   pure block pool of [`blocks`]), and the restores from files;
//! - [`tiers`]: the host and disk tiers below RAM ([`disk_tier`] writes the
//!   files), and whether restoring from them pays.
//!
//! A session's own entry may be lent whole to its next turn, through a
//! lease that carries a cancelled turn's history back ([`lease`]).
//!
//! The key decision: the index decides and the other parts carry out.
//! Every choice of which entry serves, goes or moves is made over token ids
//! and byte counts, so it is tested without a model, at random, 100,000
//! operations at a time; the MLX parts hold arrays and files keyed by the
//! index's entry ids. Everything runs on the engine thread: moka's eviction
//! listener only queues ids, which [`PrefixCache::maintain`] (called on a
//! fixed step cadence) acts on.
mod blocks;
mod disk_tier;
mod index;
mod lease;
mod paged;
mod stats;
mod store;
#[cfg(test)]
mod test_rng;
#[cfg(test)]
mod tests;
mod tiers;

use std::sync::mpsc;

pub use disk_tier::DiskTierConfig;
pub use index::Scope;
use index::{EntryId, Index, Place};
use lease::Returned;
pub use lease::{Hit, LentHistory};
pub use stats::{DiskStats, HostStats, PrefixStats};
use store::Store;
use tiers::Tiers;

use crate::models::KvCache;

/// Where a turn's state came from: the first `len` positions of entry
/// `id` in RAM. A turn that stores its state names it, so its entry takes
/// those positions' blocks by reference instead of a copy (see [`paged`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Origin {
    id: EntryId,
    len: usize,
}

pub struct PrefixCache {
    index: Index,
    store: Store,
    tiers: Tiers,
    /// Counters; what the cache holds is filled in by [`stats`](Self::stats).
    stats: PrefixStats,
    /// Histories lent and handed back (see [`LentHistory`]): taken in at
    /// the start of every operation, before anything can see the cache.
    returns: (mpsc::Sender<Returned>, mpsc::Receiver<Returned>),
}

impl PrefixCache {
    /// `budget_bytes` bounds the KV bytes held; `block` is the token
    /// granularity of matches; `namespace` identifies model and KV layout.
    #[cfg(test)]
    pub fn new(budget_bytes: usize, block: usize, namespace: u64) -> PrefixCache {
        Self::with_disk_tier(budget_bytes, block, namespace, None).expect("no disk tier to open")
    }

    /// The same, evicting to a disk tier when `disk` says where (its
    /// folder is made, or an error says why not).
    pub fn with_disk_tier(budget_bytes: usize, block: usize, namespace: u64, disk: Option<&DiskTierConfig>) -> std::io::Result<PrefixCache> {
        let disk = disk.map(disk_tier::DiskTier::new).transpose()?;
        Ok(PrefixCache {
            index: Index::new(budget_bytes, block, namespace),
            store: Store::new(namespace),
            tiers: Tiers::new(disk),
            stats: PrefixStats::default(),
            returns: mpsc::channel(),
        })
    }

    /// The same cache keeping up to `bytes` of evicted entries in memory
    /// before they go to disk (see [`tiers`]).
    pub fn with_host_tier(mut self, bytes: usize) -> PrefixCache {
        self.tiers.set_host_budget(bytes);
        self
    }

    /// The longest cached prefix of `prompt` that a request of `scope` may
    /// reuse: its own scope's entries or the shared ones, leaving at least
    /// one prompt token to run (its logits start generation). Returns the
    /// KV state, the number of tokens it holds and how it was handed over
    /// ([`Hit`]). A match in a tier is restored only when that is expected
    /// to be faster than computing the tokens it adds over the best match
    /// in RAM at `recompute_token_seconds` a token (unknown: it is).
    ///
    /// With `lend`, a session's own entry in RAM is handed over whole and
    /// leaves the cache ([`Hit::Lent`], see [`lease`]). The caller lends
    /// only when no other request of the session is waiting or running,
    /// since they would miss it.
    pub fn lookup(&mut self, scope: &Scope, prompt: &[u32], recompute_token_seconds: Option<f64>, lend: bool) -> Option<Hit> {
        self.take_back();
        loop {
            let mut best = self.index.best_match(scope, prompt, false);
            if let Some((id, len)) = best.filter(|(id, _)| !self.index.in_ram(*id)) {
                let in_ram = self.index.best_match(scope, prompt, true);
                let added = len - in_ram.map_or(0, |(_, l)| l);
                if !self.restoring_pays(id, added, recompute_token_seconds) {
                    self.stats.disk.skipped += 1;
                    best = in_ram;
                }
            }
            let Some((id, len)) = best else {
                self.stats.misses += 1;
                return None;
            };
            let lent = if lend { self.lend(id, len) } else { None };
            // A file that cannot serve is gone now: look again.
            let (mut cache, lease, origin) = match lent {
                Some((cache, lease)) => (cache, Some(lease), None),
                None => match self.state_of(id, len) {
                    Some((cache, origin)) => (cache, None, origin),
                    None => continue,
                },
            };
            cache.truncate(len);
            self.index.touch(id);
            self.stats.hits += 1;
            self.stats.hit_tokens += len as u64;
            return Some(match lease {
                Some(lease) => Hit::Lent { cache, len, lease },
                None => Hit::Shared { cache, len, origin },
            });
        }
    }

    /// Entry `id`'s state taken out of the cache with a lease on its first
    /// `len` tokens, when it is a session's own, in RAM and shares no block
    /// with another entry (a cache stored as is); otherwise `None` and
    /// nothing changes.
    fn lend(&mut self, id: EntryId, len: usize) -> Option<(KvCache, LentHistory)> {
        let lendable = self.index.get(id).is_some_and(|e| e.scope != Scope::Shared && e.place == Place::Ram) && self.store.lendable(id);
        if !lendable {
            return None;
        }
        let entry = self.index.remove(id)?;
        let cache = self.store.take(id).expect("invariant: the store holds the state of every entry the index books in RAM");
        self.stats.lent += 1;
        Some((cache, LentHistory::new(entry.scope, len, self.returns.0.clone())))
    }

    /// Stores the KV state of `tokens` (exactly the tokens `cache` holds),
    /// replacing the entries of the same scope whose every whole block it
    /// holds (see [`index`]). Room is made from idle sessions' entries
    /// first; the policy evicts live ones only when they cannot free enough.
    #[cfg(test)]
    pub fn insert(&mut self, scope: Scope, tokens: Vec<u32>, cache: KvCache) {
        self.insert_continuing(scope, tokens, cache, None);
    }

    /// [`insert`](Self::insert) for a turn that resumed from `origin` (its
    /// hit's): the positions it resumed from are that entry's blocks,
    /// taken by reference when the entry is still in RAM.
    pub fn insert_continuing(&mut self, scope: Scope, tokens: Vec<u32>, cache: KvCache, origin: Option<Origin>) {
        self.take_back();
        self.insert_now(scope, tokens, cache, origin);
    }

    fn insert_now(&mut self, scope: Scope, tokens: Vec<u32>, cache: KvCache, origin: Option<Origin>) {
        debug_assert_eq!(tokens.len(), cache.len());
        let new = self.index.keyed(scope, tokens);
        if new.is_empty() {
            return;
        }
        let (earliest_truncation, checkpoints) = (cache.earliest_truncation(), cache.checkpoint_lens());
        // Paged first: the origin is often an entry the new one replaces.
        let paged = match self.store.page(cache, origin) {
            Ok(paged) => paged,
            Err(e) => {
                eprintln!("warning: a turn's KV state could not be stored ({e})");
                return;
            }
        };
        for id in self.index.replaced_by(&new) {
            self.remove(id);
        }
        for id in self.index.room_for(self.store.unowned_bytes(&paged)) {
            self.evict(id);
        }
        // What it adds to RAM: its own blocks' buffers, and those of the
        // entries it shares that left meanwhile.
        let bytes = self.store.unowned_bytes(&paged);
        let id = self.index.insert(new, bytes, earliest_truncation, checkpoints);
        self.store.put(id, paged);
        debug_assert_eq!(self.store.owned_bytes(id), bytes);
        if self.index.booked(Place::Ram).1 > self.index.budget_bytes() {
            self.maintain_now();
        }
    }

    /// Marks `scope`'s session attached (`live`) or detached: entries of
    /// detached sessions are evicted before any live one. A session coming
    /// back has its entries on disk read ahead for its next turn.
    pub fn set_scope_live(&mut self, scope: &Scope, live: bool) {
        self.take_back();
        self.index.set_scope_live(scope, live);
        if live {
            for id in self.index.ids_of(scope, Some(Place::Disk)) {
                self.tiers.prefetch(id);
            }
        }
    }

    /// Drops every entry of `scope` (a session closed or expired), its
    /// files on disk included.
    pub fn drop_scope(&mut self, scope: &Scope) {
        self.take_back();
        self.index.set_scope_live(scope, true);
        for id in self.index.ids_of(scope, None) {
            self.remove(id);
        }
    }

    /// Runs moka's pending maintenance and evicts what it chose; then the
    /// oldest entries beyond the budget, idle sessions' first. Call from
    /// the engine thread (the eviction listener runs here).
    pub fn maintain(&mut self) {
        self.take_back();
        self.maintain_now();
    }

    fn maintain_now(&mut self) {
        for id in self.index.policy_victims() {
            if self.index.in_ram(id) {
                self.evict(id);
            }
        }
        for id in self.index.over_budget() {
            self.evict(id);
        }
    }

    /// The counters, with what the cache holds in RAM and in each tier.
    pub fn stats(&mut self) -> PrefixStats {
        self.take_back();
        let (ram, host, disk) = (self.index.booked(Place::Ram), self.index.booked(Place::Host), self.index.booked(Place::Disk));
        PrefixStats {
            entries: ram.0,
            bytes: ram.1,
            host: HostStats { entries: host.0, bytes: host.1, ..self.stats.host },
            disk: DiskStats { entries: disk.0, bytes: disk.1, ..self.stats.disk },
            ..self.stats
        }
    }

    /// Stores the histories lent and handed back since the last operation.
    fn take_back(&mut self) {
        while let Ok((scope, tokens, cache)) = self.returns.1.try_recv() {
            self.insert_now(scope, tokens, cache, None);
        }
    }

    /// Entry `id` gone from the index, the store and its tier.
    fn remove(&mut self, id: EntryId) {
        if let Some(entry) = self.index.remove(id) {
            let rebooked = self.store.remove(id);
            self.rebook(rebooked);
            self.tiers.forget(id, entry.place);
        }
    }

    /// `ids` are now booked for buffers an entry that left was: their
    /// bytes in the index follow, so the budget counts every buffer once.
    fn rebook(&mut self, ids: Vec<EntryId>) {
        for id in ids {
            self.index.reweigh(id, self.store.owned_bytes(id));
        }
    }
}
