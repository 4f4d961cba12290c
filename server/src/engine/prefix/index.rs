//! The prefix cache's index: which entries exist, what tokens each holds,
//! where its state is (RAM, the host tier or disk) and in what order
//! entries leave RAM. Pure bookkeeping over token ids and byte counts: it
//! never sees an array or a file (those are the store's and the tiers'),
//! so it is built and tested without MLX.
//!
//! Keys are hash chains over fixed-size token blocks: block `i`'s key
//! hashes the namespace, the scope and every token up to the end of block
//! `i`, so the longest cached prefix of a prompt is found by walking its
//! own block keys from the longest down, with no scan over entries. A key
//! points at the newest entry holding its block. An entry of the same scope
//! whose every whole block a new one holds is replaced by it (it could
//! serve nothing the new one cannot), so no entry's last block is ever
//! taken over: each entry stays reachable through its own last key.
//!
//! RAM's policy is moka's (entry ids weighted by KiB, TinyLFU admission,
//! LRU eviction under the byte budget). moka needs `Send + Sync` values
//! while MLX arrays are bound to the engine thread, so moka holds only ids
//! and weights; its eviction listener sends the ids it evicts down a
//! channel that [`Index::policy_victims`] drains. Live sessions outrank
//! idle ones: room for a new entry is made from detached sessions'
//! entries first, least recently used first ([`Index::room_for`]), and
//! the budget is enforced the same way when moka has not caught up
//! ([`Index::over_budget`]). Scopes are live unless marked idle (the edge
//! marks a session idle when its socket detaches and it waits for a resume
//! within its TTL, and live when one re-attaches); the shared scope is
//! never idle.
//!
//! Invariants (checked after every operation by the randomized test in
//! `index/tests.rs`):
//! - every key in the map points at an entry that lists it, and every
//!   entry's keys are the chain of its scope and tokens, its last one
//!   pointing at it;
//! - of two entries of one scope, the newer never holds every whole block
//!   of the older (the older was replaced);
//! - a lookup finds the longest block-aligned match among the blocks the
//!   map points at, its own scope's on a tie, leaving a prompt token to run;
//! - the bytes and counts booked for each place equal the sums over the
//!   entries there, and moka holds only entries in RAM;
//! - the shared scope is never idle.
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::mpsc;

/// Whose entries these are: one session's private history, or entries any
/// session may reuse (e.g. a common system prompt).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    Session(String),
    Shared,
}

pub(super) type EntryId = u64;

/// Where an entry's state is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Place {
    /// KV buffers in RAM (device memory on a GPU): served by snapshot.
    Ram,
    /// Its file's bytes, in the host tier.
    Host,
    /// Its file, in the disk tier.
    Disk,
}

/// Bytes are weighed in KiB so one entry's weight fits moka's u32.
const WEIGHT_UNIT: usize = 1024;

pub(super) struct Entry {
    pub scope: Scope,
    /// Exactly the tokens its state holds.
    pub tokens: Vec<u32>,
    pub place: Place,
    /// What it takes where it is: its buffers in RAM, its file elsewhere.
    pub bytes: usize,
    /// The shortest prefix of `tokens` its state can serve (see
    /// `KvCache::earliest_truncation`).
    pub earliest_truncation: usize,
    /// Shorter prefixes it can serve too: a hybrid model's state
    /// checkpoints (`KvCache::checkpoint_lens`; at block boundaries, and
    /// where a turn's prompt ended), ascending.
    pub checkpoints: Vec<usize>,
    /// Its weight in the policy (KiB of its buffers when stored, rounded up).
    kib: u32,
    /// When it was last stored or served (a tick of the index's own):
    /// evictions outside moka's policy take the least recent first.
    used: u64,
    /// When it moved to its place (another tick): a tier's oldest go first.
    since: u64,
    /// Its block keys, for removal: key `i` covers `tokens[..(i + 1) * block]`.
    keys: Vec<u64>,
}

/// A new entry's tokens with their block keys, computed once for the
/// replacement check and the insert.
pub(super) struct Keyed {
    scope: Scope,
    tokens: Vec<u32>,
    keys: Vec<u64>,
}

impl Keyed {
    /// Whether the tokens hold no whole block: nothing to index.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

pub(super) struct Index {
    block: usize,
    /// Separates state computed under different models, layouts or dtypes.
    namespace: u64,
    budget_bytes: usize,
    entries: HashMap<EntryId, Entry>,
    /// Chain hash of a block boundary -> the newest entry holding that prefix.
    keys: HashMap<u64, EntryId>,
    next_id: EntryId,
    /// Scopes whose session is detached (idle): their entries go first.
    idle: HashSet<Scope>,
    ticks: u64,
    policy: moka::sync::Cache<EntryId, u32>,
    evicted: mpsc::Receiver<EntryId>,
    /// Per place (indexed by `Place as usize`): entries there, and their bytes.
    booked: [(usize, usize); 3],
    /// KiB weights of the entries in RAM, as the policy counts them.
    ram_kib: u64,
}

impl Index {
    /// An index of `block`-token matches for state of `namespace`, whose
    /// entries in RAM stay within `budget_bytes`.
    pub fn new(budget_bytes: usize, block: usize, namespace: u64) -> Index {
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
        Index {
            block: block.max(1),
            namespace,
            budget_bytes,
            entries: HashMap::new(),
            keys: HashMap::new(),
            next_id: 1,
            idle: HashSet::new(),
            ticks: 0,
            policy,
            evicted,
            booked: [(0, 0); 3],
            ram_kib: 0,
        }
    }

    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    pub fn get(&self, id: EntryId) -> Option<&Entry> {
        self.entries.get(&id)
    }

    pub fn in_ram(&self, id: EntryId) -> bool {
        self.entries.get(&id).is_some_and(|e| e.place == Place::Ram)
    }

    /// Entries in `place`, and their bytes.
    pub fn booked(&self, place: Place) -> (usize, usize) {
        self.booked[place as usize]
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

    /// The longer of `scope`'s own and the shared scope's matches (in RAM
    /// only, when `ram_only`); its own on a tie.
    pub fn best_match(&self, scope: &Scope, prompt: &[u32], ram_only: bool) -> Option<(EntryId, usize)> {
        let own = self.longest_match(scope, prompt, ram_only);
        let shared = if *scope == Scope::Shared { None } else { self.longest_match(&Scope::Shared, prompt, ram_only) };
        match (own, shared) {
            (Some(a), Some(b)) => Some(if b.1 > a.1 { b } else { a }),
            (a, b) => a.or(b),
        }
    }

    /// The entry holding the longest block-aligned prefix of `prompt` (all
    /// but its last token: that one must run to produce the logits that
    /// start generation) in `scope` (in RAM only, when `ram_only`), and
    /// that prefix's length. An entry that cannot be cut back to the
    /// block-aligned length serves instead at its own whole length when the
    /// prompt holds all of its tokens (a hybrid model's recurrent state is
    /// at its entry's length: a session's next turn, whose prompt carries
    /// the whole last turn, resumes there), else at its longest checkpoint
    /// at or past the block that the prompt holds (a state kept at a block
    /// boundary or where a turn's prompt ended, which may be off the
    /// blocks); else a shorter block serves, down to the deepest checkpoint
    /// below the match.
    pub fn longest_match(&self, scope: &Scope, prompt: &[u32], ram_only: bool) -> Option<(EntryId, usize)> {
        let usable = prompt.len().saturating_sub(1);
        let keys = self.block_keys(scope, &prompt[..usable]);
        keys.iter().enumerate().rev().find_map(|(i, key)| {
            let id = *self.keys.get(key)?;
            let len = (i + 1) * self.block;
            let entry = self.entries.get(&id)?;
            // A hash collision must never serve the wrong state; and a cache
            // whose sliding-window layers dropped the keys a continuation at
            // `len` would see cannot serve it (a miss, computed afresh).
            let held = entry.scope == *scope && entry.tokens.len() >= len && entry.tokens[..len] == prompt[..len] && (!ram_only || entry.place == Place::Ram);
            if !held {
                return None;
            }
            if entry.earliest_truncation <= len {
                return Some((id, len));
            }
            let whole = entry.tokens.len();
            let holds = |end: usize| end <= usable && prompt[len..end] == entry.tokens[len..end];
            if entry.earliest_truncation <= whole && holds(whole) {
                return Some((id, whole));
            }
            entry.checkpoints.iter().rev().find(|&&c| c >= len && holds(c)).map(|&c| (id, c))
        })
    }

    /// `tokens` of `scope` with their block keys, ready to [`insert`](Self::insert).
    pub fn keyed(&self, scope: Scope, tokens: Vec<u32>) -> Keyed {
        let keys = self.block_keys(&scope, &tokens);
        Keyed { scope, tokens, keys }
    }

    /// The entries `new` replaces: those of its scope whose every whole
    /// block it holds. Matches are block-aligned and the keys will point
    /// those blocks at `new`, so they could serve nothing it cannot. That
    /// covers a turn that extends its history and one that forks off its
    /// last partial block (a regenerated answer; a next prompt that carries
    /// the answer re-rendered, or leaves it out), which would otherwise hold
    /// a second copy of the whole history until evicted.
    pub fn replaced_by(&self, new: &Keyed) -> Vec<EntryId> {
        let mut ids: Vec<EntryId> = new
            .keys
            .iter()
            .filter_map(|k| self.keys.get(k).copied())
            .filter(|id| self.entries.get(id).is_some_and(|e| e.scope == new.scope && new.tokens.starts_with(&e.tokens[..e.keys.len() * self.block])))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The idle sessions' entries in RAM to evict, least recently used
    /// first, so that `bytes` more fit the budget (all of them when they
    /// cannot free enough: then the policy may evict live ones).
    pub fn room_for(&self, bytes: usize) -> Vec<EntryId> {
        let capacity = (self.budget_bytes / WEIGHT_UNIT) as u64;
        let mut held = self.ram_kib + u64::from(kib(bytes));
        let mut victims = Vec::new();
        for (id, entry) in self.eviction_order(true) {
            if held <= capacity {
                break;
            }
            held -= u64::from(entry.kib);
            victims.push(id);
        }
        victims
    }

    /// Entries in RAM to evict, idle sessions' first, each least recently
    /// used first, for RAM to be within its budget: the budget holds even
    /// when the policy has not caught up yet (or declined to admit an entry).
    pub fn over_budget(&self) -> Vec<EntryId> {
        let mut held = self.booked(Place::Ram).1;
        let mut victims = Vec::new();
        for (id, entry) in self.eviction_order(false) {
            if held <= self.budget_bytes {
                break;
            }
            held -= entry.bytes;
            victims.push(id);
        }
        victims
    }

    /// Entries in RAM of idle scopes, least recently used first; then,
    /// unless `idle_only`, those of live scopes in the same order.
    fn eviction_order(&self, idle_only: bool) -> Vec<(EntryId, &Entry)> {
        if idle_only && self.idle.is_empty() {
            return Vec::new();
        }
        let mut order: Vec<(bool, u64, EntryId, &Entry)> = (self.entries.iter())
            .filter(|(_, e)| e.place == Place::Ram)
            .map(|(id, e)| (!self.idle.contains(&e.scope), e.used, *id, e))
            .filter(|(live, ..)| !(idle_only && *live))
            .collect();
        order.sort_unstable_by_key(|(live, used, ..)| (*live, *used));
        order.into_iter().map(|(_, _, id, e)| (id, e)).collect()
    }

    /// Adds `new` in RAM, its state `bytes` long and servable from
    /// `earliest_truncation` on and at `checkpoints` (ascending), after its
    /// replaced entries went and room was made: its keys now point at it.
    pub fn insert(&mut self, new: Keyed, bytes: usize, earliest_truncation: usize, checkpoints: Vec<usize>) -> EntryId {
        let id = self.next_id;
        self.next_id += 1;
        for k in &new.keys {
            self.keys.insert(*k, id);
        }
        self.ticks += 1;
        let kib = kib(bytes);
        let Keyed { scope, tokens, keys } = new;
        let entry = Entry { scope, tokens, place: Place::Ram, bytes, earliest_truncation, checkpoints, kib, used: self.ticks, since: self.ticks, keys };
        self.book(&entry, true);
        self.entries.insert(id, entry);
        self.policy.insert(id, kib);
        id
    }

    /// Counts a hit on entry `id`, for the policy and the idle order.
    pub fn touch(&mut self, id: EntryId) {
        // An access for moka even when the entry was just lent (and left):
        // its frequency sketch counts the key.
        self.policy.get(&id);
        self.ticks += 1;
        if let Some(entry) = self.entries.get_mut(&id) {
            entry.used = self.ticks;
        }
    }

    /// Entry `id` is now in `place`, where it takes `bytes`. Out of RAM it
    /// leaves the policy; back in RAM it rejoins it at its stored weight.
    pub fn move_to(&mut self, id: EntryId, place: Place, bytes: usize) {
        let Some(mut entry) = self.entries.remove(&id) else { return };
        self.book(&entry, false);
        self.ticks += 1;
        (entry.place, entry.bytes, entry.since) = (place, bytes, self.ticks);
        self.book(&entry, true);
        match place {
            Place::Ram => self.policy.insert(id, entry.kib),
            _ => self.policy.invalidate(&id),
        }
        self.entries.insert(id, entry);
    }

    /// Entry `id`, in RAM, now takes `bytes` there (the buffers it is
    /// booked for changed: another entry sharing them left).
    pub fn reweigh(&mut self, id: EntryId, bytes: usize) {
        let Some(mut entry) = self.entries.remove(&id) else { return };
        if entry.place == Place::Ram {
            self.book(&entry, false);
            (entry.bytes, entry.kib) = (bytes, kib(bytes));
            self.book(&entry, true);
            self.policy.insert(id, entry.kib);
        }
        self.entries.insert(id, entry);
    }

    /// The entry that has been in `place` longest.
    pub fn oldest(&self, place: Place) -> Option<EntryId> {
        self.entries.iter().filter(|(_, e)| e.place == place).min_by_key(|(_, e)| e.since).map(|(id, _)| *id)
    }

    /// Entry `id` out of the keys and the policy.
    pub fn remove(&mut self, id: EntryId) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        for k in &entry.keys {
            if self.keys.get(k) == Some(&id) {
                self.keys.remove(k);
            }
        }
        self.policy.invalidate(&id);
        self.book(&entry, false);
        Some(entry)
    }

    /// Entries of `scope` in `place` (any place: `None`).
    pub fn ids_of(&self, scope: &Scope, place: Option<Place>) -> Vec<EntryId> {
        self.entries.iter().filter(|(_, e)| e.scope == *scope && place.is_none_or(|p| e.place == p)).map(|(id, _)| *id).collect()
    }

    /// Marks `scope`'s session attached (`live`) or detached: entries of
    /// detached sessions leave RAM before any live one. The shared scope
    /// serves every session and is never idle.
    pub fn set_scope_live(&mut self, scope: &Scope, live: bool) {
        if live {
            self.idle.remove(scope);
        } else if *scope != Scope::Shared {
            self.idle.insert(scope.clone());
        }
    }

    /// Runs moka's pending maintenance: the entries in RAM it chose to evict.
    pub fn policy_victims(&mut self) -> Vec<EntryId> {
        self.policy.run_pending_tasks();
        std::iter::from_fn(|| self.evicted.try_recv().ok()).filter(|id| self.in_ram(*id)).collect()
    }

    /// Books `entry` into (`add`) or out of its place's totals.
    fn book(&mut self, entry: &Entry, add: bool) {
        let (count, bytes) = &mut self.booked[entry.place as usize];
        let ram = entry.place == Place::Ram;
        if add {
            (*count, *bytes) = (*count + 1, *bytes + entry.bytes);
            self.ram_kib += if ram { u64::from(entry.kib) } else { 0 };
        } else {
            (*count, *bytes) = (*count - 1, *bytes - entry.bytes);
            self.ram_kib -= if ram { u64::from(entry.kib) } else { 0 };
        }
    }
}

/// `bytes` as the policy weighs them.
fn kib(bytes: usize) -> u32 {
    bytes.div_ceil(WEIGHT_UNIT).min(u32::MAX as usize) as u32
}

#[cfg(test)]
mod tests;
