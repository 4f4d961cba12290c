//! The prefix cache: KV state of finished turns, reused by later requests
//! that start with the same tokens in the same scope. A request reads its
//! own scope (its session's private history) and the shared scope (state a
//! client put there on purpose, such as a common system prompt), taking the
//! longer match; it writes only its own scope.
//!
//! Keys are hash chains over fixed-size token blocks: block `i`'s key hashes
//! the scope, the namespace and every token up to the end of block `i`, so
//! the longest cached prefix of a prompt is found by walking its own block
//! hashes from the longest down, with no scan over entries. A hit hands the
//! request a copy-on-write snapshot of the entry's KV cache truncated to the
//! matched blocks; prefill resumes from there.
//!
//! Ownership: MLX arrays are bound to the engine thread, while moka needs
//! `Send + Sync` values. So moka holds the policy only (entry ids weighted
//! by their bytes, with TinyLFU admission and LRU eviction under a byte
//! budget), and the arrays live in `entries`, owned here. moka's eviction
//! listener sends evicted ids down a channel; [`PrefixCache::maintain`]
//! (called on the engine thread on a fixed step cadence) runs moka's pending
//! work and drops the evicted entries' arrays.
//!
//! Live sessions outrank idle ones: the edge tells the engine when a
//! session's socket detaches (the session waits for a resume within its TTL)
//! and when one re-attaches ([`PrefixCache::set_scope_live`]). When an insert
//! would take the cache over its budget, entries of detached sessions are
//! evicted first, oldest first, until the new entry fits; only then may
//! moka's policy evict anything of a live session (or the shared scope).
//! Closing or expiring a session drops all of its entries
//! ([`PrefixCache::drop_scope`]). Scopes are live unless marked idle.
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::mpsc;

use crate::model::KvCache;

/// Whose entries these are: one session's private history, or entries any
/// session may reuse (e.g. a common system prompt).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    Session(String),
    Shared,
}

type EntryId = u64;

struct Entry {
    scope: Scope,
    tokens: Vec<u32>,
    cache: KvCache,
    /// Its weight in the policy (KiB, rounded up), as moka counts it.
    kib: u32,
    /// The index keys pointing at this entry, for removal.
    keys: Vec<u64>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefixStats {
    pub hits: u64,
    pub misses: u64,
    pub hit_tokens: u64,
    pub evictions: u64,
    pub entries: usize,
    pub bytes: usize,
}

pub struct PrefixCache {
    budget_bytes: usize,
    block: usize,
    /// Separates state computed under different models, layouts or dtypes.
    namespace: u64,
    policy: moka::sync::Cache<EntryId, u32>,
    evicted: mpsc::Receiver<EntryId>,
    entries: HashMap<EntryId, Entry>,
    /// Chain hash of a block boundary -> the entry holding that prefix.
    index: HashMap<u64, EntryId>,
    next_id: EntryId,
    /// Scopes whose session is detached (idle): their entries go first.
    idle: HashSet<Scope>,
    stats: PrefixStats,
}

/// Bytes are weighed in KiB so one entry's weight fits moka's u32.
const WEIGHT_UNIT: usize = 1024;

impl PrefixCache {
    /// `budget_bytes` bounds the KV bytes held; `block` is the token
    /// granularity of matches; `namespace` identifies model and KV layout.
    pub fn new(budget_bytes: usize, block: usize, namespace: u64) -> PrefixCache {
        let (tx, evicted) = mpsc::channel();
        let policy = moka::sync::Cache::builder()
            .max_capacity((budget_bytes / WEIGHT_UNIT) as u64)
            .weigher(|_id: &EntryId, kib: &u32| *kib)
            .eviction_listener(move |id: std::sync::Arc<EntryId>, _kib, cause| {
                // Explicit removals are already dropped by the caller.
                if cause != moka::notification::RemovalCause::Explicit && cause != moka::notification::RemovalCause::Replaced {
                    let _ = tx.send(*id);
                }
            })
            .build();
        PrefixCache {
            budget_bytes,
            block: block.max(1),
            namespace,
            policy,
            evicted,
            entries: HashMap::new(),
            index: HashMap::new(),
            next_id: 1,
            idle: HashSet::new(),
            stats: PrefixStats::default(),
        }
    }

    /// Chain hashes of each full block of `tokens` (block i covers tokens[..(i+1)*block]).
    fn block_keys(&self, scope: &Scope, tokens: &[u32]) -> Vec<u64> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.namespace.hash(&mut h);
        scope.hash(&mut h);
        tokens
            .chunks_exact(self.block)
            .map(|chunk| {
                chunk.hash(&mut h);
                h.finish()
            })
            .collect()
    }

    /// The longest cached prefix of `prompt` that a request of `scope` may
    /// reuse: its own scope's entries or the shared ones, leaving at least
    /// one prompt token to run (its logits start generation). Returns a
    /// copy-on-write snapshot of the KV state and the number of tokens it holds.
    pub fn lookup(&mut self, scope: &Scope, prompt: &[u32]) -> Option<(KvCache, usize)> {
        let own = self.longest_match(scope, prompt);
        let shared = if *scope == Scope::Shared { None } else { self.longest_match(&Scope::Shared, prompt) };
        let best = match (own, shared) {
            (Some(a), Some(b)) => Some(if b.1 > a.1 { b } else { a }),
            (a, b) => a.or(b),
        };
        let Some((id, len)) = best else {
            self.stats.misses += 1;
            return None;
        };
        let mut cache = self.entries[&id].cache.clone();
        cache.truncate(len);
        self.policy.get(&id); // counts as an access for the eviction policy
        self.stats.hits += 1;
        self.stats.hit_tokens += len as u64;
        Some((cache, len))
    }

    /// The entry holding the longest block-aligned prefix of `prompt` (all
    /// but its last token) in `scope`, and that prefix's length.
    fn longest_match(&self, scope: &Scope, prompt: &[u32]) -> Option<(EntryId, usize)> {
        let usable = prompt.len().saturating_sub(1);
        let keys = self.block_keys(scope, &prompt[..usable]);
        keys.iter().enumerate().rev().find_map(|(i, key)| {
            let id = *self.index.get(key)?;
            let len = (i + 1) * self.block;
            let entry = self.entries.get(&id)?;
            // A hash collision must never serve the wrong state; and a cache
            // whose sliding-window layers dropped the keys a continuation at
            // `len` would see cannot serve it (a miss, computed afresh).
            let usable = entry.cache.earliest_truncation() <= len;
            (usable && entry.scope == *scope && entry.tokens.len() >= len && entry.tokens[..len] == prompt[..len]).then_some((id, len))
        })
    }

    /// Stores the KV state of `tokens` (exactly the tokens `cache` holds).
    /// Entries of the same scope that this one extends are replaced.
    pub fn insert(&mut self, scope: Scope, tokens: Vec<u32>, cache: KvCache) {
        debug_assert_eq!(tokens.len(), cache.len());
        let keys = self.block_keys(&scope, &tokens);
        if keys.is_empty() {
            return;
        }
        let superseded: Vec<EntryId> = keys
            .iter()
            .filter_map(|k| self.index.get(k).copied())
            .filter(|id| self.entries.get(id).is_some_and(|e| e.scope == scope && tokens.starts_with(&e.tokens)))
            .collect();
        for id in superseded {
            self.remove(id);
        }
        let id = self.next_id;
        self.next_id += 1;
        for k in &keys {
            self.index.insert(*k, id);
        }
        let kib = cache.nbytes().div_ceil(WEIGHT_UNIT).min(u32::MAX as usize) as u32;
        // Make room from idle sessions first, so the policy only has to
        // evict live entries when idle ones cannot free enough.
        let capacity = (self.budget_bytes / WEIGHT_UNIT) as u64;
        let mut held: u64 = self.entries.values().map(|e| u64::from(e.kib)).sum();
        while held + u64::from(kib) > capacity {
            let Some(victim) = self.oldest_idle() else { break };
            held -= u64::from(self.entries[&victim].kib);
            self.stats.evictions += 1;
            self.remove(victim);
        }
        self.entries.insert(id, Entry { scope, tokens, cache, kib, keys });
        self.policy.insert(id, kib);
        if self.bytes() > self.budget_bytes {
            self.maintain();
        }
    }

    fn bytes(&self) -> usize {
        self.entries.values().map(|e| e.cache.nbytes()).sum()
    }

    /// The oldest entry of an idle scope, if any.
    fn oldest_idle(&self) -> Option<EntryId> {
        if self.idle.is_empty() {
            return None;
        }
        self.entries.iter().filter(|(_, e)| self.idle.contains(&e.scope)).map(|(id, _)| *id).min()
    }

    /// Marks `scope`'s session attached (`live`) or detached: entries of
    /// detached sessions are evicted before any live one.
    pub fn set_scope_live(&mut self, scope: &Scope, live: bool) {
        if live {
            self.idle.remove(scope);
        } else if *scope != Scope::Shared {
            self.idle.insert(scope.clone());
        }
    }

    /// Drops every entry of `scope` (a session closed or expired).
    pub fn drop_scope(&mut self, scope: &Scope) {
        self.idle.remove(scope);
        let ids: Vec<EntryId> = self.entries.iter().filter(|(_, e)| e.scope == *scope).map(|(id, _)| *id).collect();
        for id in ids {
            self.remove(id);
        }
    }

    fn remove(&mut self, id: EntryId) {
        if let Some(entry) = self.entries.remove(&id) {
            for k in entry.keys {
                if self.index.get(&k) == Some(&id) {
                    self.index.remove(&k);
                }
            }
        }
        self.policy.invalidate(&id);
    }

    /// Runs moka's pending maintenance and frees what it evicted. Call from
    /// the engine thread (the eviction listener runs here).
    pub fn maintain(&mut self) {
        self.policy.run_pending_tasks();
        while let Ok(id) = self.evicted.try_recv() {
            if self.entries.contains_key(&id) {
                self.stats.evictions += 1;
                self.remove(id);
            }
        }
        // The budget holds even if the policy has not caught up yet (or
        // declined to admit an entry): drop the oldest entries beyond it,
        // idle sessions' first.
        while self.bytes() > self.budget_bytes {
            let Some(oldest) = self.oldest_idle().or_else(|| self.entries.keys().min().copied()) else { break };
            self.stats.evictions += 1;
            self.remove(oldest);
        }
    }

    pub fn stats(&self) -> PrefixStats {
        PrefixStats { entries: self.entries.len(), bytes: self.bytes(), ..self.stats }
    }
}
