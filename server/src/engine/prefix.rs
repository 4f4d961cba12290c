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
//!
//! With a disk tier ([`super::disk_tier`]), an entry evicted from RAM is
//! written to a file instead of dropped: it keeps its place in the index,
//! and a lookup that lands on it reads it back (checked: a damaged or
//! missing file is a miss, and the turn computes its state afresh). A
//! session's own entry stays on disk until its turn's end supersedes it
//! (the turn owns the restored buffers); a shared one comes back into RAM.
//! The tier has its own byte budget, over which its oldest files go; a
//! session that re-attaches has its files read ahead.
//!
//! A host tier (a byte budget of its own) sits between RAM and disk: an
//! evicted entry is kept in memory as its file's bytes, which leave out the
//! shared prefix (see [`kv_file`]), so an agent's idle session takes a
//! quarter of its RAM entry's bytes or less there and comes back with a
//! copy, not a read. On a GPU it is the host memory beside the device's.
//! Over its budget, its oldest entries go on to disk (or are dropped
//! without a disk tier).
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::mpsc;
use std::time::Instant;

use super::disk_tier::{DiskTier, DiskTierConfig};
use crate::model::kv_file::{self, Encoded};
use crate::model::KvCache;

/// Whose entries these are: one session's private history, or entries any
/// session may reuse (e.g. a common system prompt).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    Session(String),
    Shared,
}

impl PrefixStats {
    /// Sums another engine's counters into these.
    pub fn add(&mut self, o: &PrefixStats) {
        self.hits += o.hits;
        self.lent += o.lent;
        self.misses += o.misses;
        self.hit_tokens += o.hit_tokens;
        self.evictions += o.evictions;
        self.entries += o.entries;
        self.bytes += o.bytes;
        self.host.add(&o.host);
        self.disk.add(&o.disk);
    }
}

/// The host tier's counters (all zero without one).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostStats {
    pub entries: usize,
    pub bytes: usize,
    /// Entries moved there out of RAM.
    pub moves: u64,
    /// Hits served from it.
    pub hits: u64,
    /// Entries that could not serve (the shared prefix they leave out gone).
    pub failed: u64,
    /// Time spent restoring its entries for hits, and their bytes.
    pub restore_seconds: f64,
    pub restore_bytes: u64,
}

impl HostStats {
    /// Sums another engine's counters into these.
    pub fn add(&mut self, o: &HostStats) {
        self.entries += o.entries;
        self.bytes += o.bytes;
        self.moves += o.moves;
        self.hits += o.hits;
        self.failed += o.failed;
        self.restore_seconds += o.restore_seconds;
        self.restore_bytes += o.restore_bytes;
    }
}

impl DiskStats {
    /// Sums another engine's counters into these.
    pub fn add(&mut self, o: &DiskStats) {
        self.entries += o.entries;
        self.bytes += o.bytes;
        self.writes += o.writes;
        self.written_bytes += o.written_bytes;
        self.hits += o.hits;
        self.failed_reads += o.failed_reads;
        self.evictions += o.evictions;
        self.read_seconds += o.read_seconds;
        self.read_bytes += o.read_bytes;
        self.skipped += o.skipped;
    }
}

type EntryId = u64;

/// What a disk read is taken to cost before this tier has timed one: a
/// local SSD's order of magnitude, including the checksum and the copy in.
const ASSUMED_READ_BYTES_PER_SECOND: f64 = 1e9;
/// The same for the host tier's first restore: a memory copy.
const ASSUMED_RESTORE_BYTES_PER_SECOND: f64 = 1e10;

struct Entry {
    scope: Scope,
    tokens: Vec<u32>,
    held: Held,
    /// The shortest prefix of `tokens` its state can serve (see
    /// [`KvCache::earliest_truncation`]).
    earliest_truncation: usize,
    /// Its weight in the policy (KiB, rounded up), as moka counts it.
    kib: u32,
    /// When it was last stored or served (a tick of the cache's own):
    /// evictions outside moka's policy take the least recent first.
    used: u64,
    /// The index keys pointing at this entry, for removal.
    keys: Vec<u64>,
}

/// Where an entry's KV state is.
enum Held {
    Ram(KvCache),
    /// In the host tier: its file's bytes, when it moved there (the tier's
    /// move count then: older entries go on to disk first), and an empty
    /// cache of the state's shape to restore it into.
    Host {
        file: Encoded,
        moved: u64,
        shape: KvCache,
    },
    /// In the disk tier's file of the entry's id: the file's size, when it
    /// was written (the tier's write count then: older files are evicted
    /// first), and an empty cache of
    /// the state's shape to read it back into.
    Disk {
        bytes: usize,
        written: u64,
        shape: KvCache,
    },
}

/// A prefix-cache hit: KV state holding the first `len` tokens of the prompt.
pub enum Hit {
    /// A snapshot: the entry stays cached, and the turn's first write to
    /// each buffer copies it (copy-on-write).
    Shared { cache: KvCache, len: usize },
    /// The session's own entry, handed over: it left the cache.
    Lent { cache: KvCache, len: usize },
}

impl Hit {
    pub fn into_parts(self) -> (KvCache, usize, bool) {
        match self {
            Hit::Shared { cache, len } => (cache, len, false),
            Hit::Lent { cache, len } => (cache, len, true),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefixStats {
    pub hits: u64,
    /// Hits that handed a session's own entry to its turn (see [`Hit::Lent`]).
    pub lent: u64,
    pub misses: u64,
    pub hit_tokens: u64,
    /// Entries that left RAM under its budget (written to disk, or dropped).
    pub evictions: u64,
    pub entries: usize,
    /// KV bytes in RAM.
    pub bytes: usize,
    pub host: HostStats,
    pub disk: DiskStats,
}

/// The disk tier's counters (all zero without one).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DiskStats {
    pub entries: usize,
    pub bytes: usize,
    /// Entries written out of RAM.
    pub writes: u64,
    pub written_bytes: u64,
    /// Hits served from a file (taken back into RAM).
    pub hits: u64,
    /// Files that could not serve: unreadable, damaged or of other state.
    pub failed_reads: u64,
    /// Entries dropped from the tier under its budget.
    pub evictions: u64,
    /// Time spent reading and restoring files for hits, and their bytes.
    pub read_seconds: f64,
    pub read_bytes: u64,
    /// Matches on disk passed over: computing what they add was expected
    /// to be faster than reading them.
    pub skipped: u64,
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
    /// Bytes the host tier may keep (0: none), and where what it cannot
    /// keep goes, if anywhere.
    host_budget_bytes: usize,
    disk: Option<DiskTier>,
    /// Counts stores and hits, for `Entry::used`.
    ticks: u64,
    stats: PrefixStats,
}

/// Bytes are weighed in KiB so one entry's weight fits moka's u32.
const WEIGHT_UNIT: usize = 1024;

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
        let disk = disk.map(DiskTier::new).transpose()?;
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
        Ok(PrefixCache {
            budget_bytes,
            block: block.max(1),
            namespace,
            policy,
            evicted,
            entries: HashMap::new(),
            index: HashMap::new(),
            next_id: 1,
            idle: HashSet::new(),
            host_budget_bytes: 0,
            disk,
            ticks: 0,
            stats: PrefixStats::default(),
        })
    }

    /// The same cache keeping up to `bytes` of evicted entries in memory
    /// before they go to disk (see the module notes).
    pub fn with_host_tier(self, bytes: usize) -> PrefixCache {
        PrefixCache { host_budget_bytes: bytes, ..self }
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
    /// one prompt token to run (its logits start generation). Returns the
    /// KV state, the number of tokens it holds and how it was handed over
    /// ([`Hit`]). A match on disk is read only when that is expected to be
    /// faster than computing the tokens it adds over the best match in RAM
    /// at `recompute_token_seconds` a token (unknown: it is read).
    ///
    /// With `lend`, a session's own entry in RAM is handed over whole and
    /// leaves the cache ([`Hit::Lent`]): the turn then writes its tokens in
    /// place instead of copying the whole history on its first write (the
    /// copy-on-write a shared snapshot costs; ~130 ms for a 4k-token
    /// SmolLM2 history in float32 on a 2-core CPU). Its end stores the
    /// longer state as usual. The caller lends only when no other request of
    /// the session is waiting or running, since they would miss it.
    pub fn lookup(&mut self, scope: &Scope, prompt: &[u32], recompute_token_seconds: Option<f64>, lend: bool) -> Option<Hit> {
        loop {
            let mut best = self.best_match(scope, prompt, false);
            if let Some((id, len)) = best.filter(|(id, _)| !self.is_in_ram(*id)) {
                let in_ram = self.best_match(scope, prompt, true);
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
            let lent = if lend { self.lend(id) } else { None };
            let was_lent = lent.is_some();
            // A file that cannot serve is gone now: look again.
            let Some(mut cache) = lent.or_else(|| self.state_of(id)) else { continue };
            cache.truncate(len);
            self.policy.get(&id); // counts as an access for the eviction policy
            self.ticks += 1;
            if let Some(entry) = self.entries.get_mut(&id) {
                entry.used = self.ticks;
            }
            self.stats.hits += 1;
            self.stats.hit_tokens += len as u64;
            return Some(if was_lent { Hit::Lent { cache, len } } else { Hit::Shared { cache, len } });
        }
    }

    /// The longer of `scope`'s own and the shared scope's matches (in RAM
    /// only, when `ram_only`).
    fn best_match(&self, scope: &Scope, prompt: &[u32], ram_only: bool) -> Option<(EntryId, usize)> {
        let own = self.longest_match(scope, prompt, ram_only);
        let shared = if *scope == Scope::Shared { None } else { self.longest_match(&Scope::Shared, prompt, ram_only) };
        match (own, shared) {
            (Some(a), Some(b)) => Some(if b.1 > a.1 { b } else { a }),
            (a, b) => a.or(b),
        }
    }

    fn is_in_ram(&self, id: EntryId) -> bool {
        self.entries.get(&id).is_some_and(|e| matches!(e.held, Held::Ram(_)))
    }

    /// Whether restoring entry `id` (from the host tier or its file) is
    /// expected to take less than computing `added` prompt tokens at
    /// `recompute_token_seconds` each. The rate is what that tier's
    /// restores have taken so far (for a file: read, check and restore, as
    /// a turn waits for them), or an assumed one before the first. On a CPU
    /// restoring nearly always wins (a SmolLM2 token takes milliseconds to
    /// compute); a GPU computes thousands of tokens in the time a large
    /// file takes to read.
    fn restoring_pays(&self, id: EntryId, added: usize, recompute_token_seconds: Option<f64>) -> bool {
        let Some(per_token) = recompute_token_seconds else { return true };
        let (h, d) = (&self.stats.host, &self.stats.disk);
        let (bytes, rate) = match self.entries.get(&id).map(|e| &e.held) {
            Some(Held::Host { file, .. }) => {
                (file.len(), if h.restore_seconds > 0.0 { h.restore_bytes as f64 / h.restore_seconds } else { ASSUMED_RESTORE_BYTES_PER_SECOND })
            }
            Some(Held::Disk { bytes, .. }) => (*bytes, if d.read_seconds > 0.0 { d.read_bytes as f64 / d.read_seconds } else { ASSUMED_READ_BYTES_PER_SECOND }),
            _ => return true,
        };
        bytes as f64 / rate < added as f64 * per_token
    }

    /// Entry `id`'s state taken out of the cache, when it is a session's
    /// own and in RAM; otherwise `None` and nothing changes.
    fn lend(&mut self, id: EntryId) -> Option<KvCache> {
        let lendable = self.entries.get(&id).is_some_and(|e| e.scope != Scope::Shared && matches!(e.held, Held::Ram(_)));
        if !lendable {
            return None;
        }
        let Held::Ram(cache) = self.take(id)?.held else { unreachable!("checked above") };
        self.stats.lent += 1;
        Some(cache)
    }

    /// Entry `id`'s state, restored if it is in the host tier or on disk;
    /// `None` (and the entry removed) when it cannot serve.
    fn state_of(&mut self, id: EntryId) -> Option<KvCache> {
        let entry = self.entries.get(&id)?;
        let (bytes, on_disk) = match &entry.held {
            Held::Ram(cache) => return Some(cache.clone()),
            Held::Host { file, .. } => (file.len(), false),
            Held::Disk { bytes, .. } => (*bytes, true),
        };
        let started = Instant::now();
        let read = if on_disk { Some(self.disk.as_mut().expect("entries are on disk only with a disk tier").read(id)) } else { None };
        let restored = match read {
            Some(Err(e)) => Err(e.to_string()),
            Some(Ok(file)) => self.restore(id, Some(&file)),
            None => self.restore(id, None),
        };
        let cache = match restored {
            Ok(cache) => cache,
            Err(e) => {
                eprintln!("warning: a prefix-cache entry could not be restored ({e}); the prompt is computed afresh");
                if on_disk {
                    self.stats.disk.failed_reads += 1;
                } else {
                    self.stats.host.failed += 1;
                }
                self.remove(id);
                return None;
            }
        };
        let seconds = started.elapsed().as_secs_f64();
        if on_disk {
            self.stats.disk.read_seconds += seconds;
            self.stats.disk.read_bytes += bytes as u64;
            self.stats.disk.hits += 1;
        } else {
            self.stats.host.restore_seconds += seconds;
            self.stats.host.restore_bytes += bytes as u64;
            self.stats.host.hits += 1;
        }
        let entry = self.entries.get_mut(&id).expect("looked up above");
        if entry.scope != Scope::Shared {
            // A session's own history: the returning turn owns the restored
            // buffers outright (its writes land in place, with no
            // copy-on-write of the whole history), and the file stays until
            // the turn's end stores the longer state that supersedes it (a
            // cancelled turn stores nothing and the file still serves).
            return Some(cache);
        }
        // Shared state serves many sessions: back into RAM, and the file
        // goes. Room is made at the next insert, not here: writing another
        // entry out now would delay this request's first token.
        let was = std::mem::replace(&mut entry.held, Held::Ram(cache.clone()));
        self.policy.insert(id, entry.kib);
        if let (Held::Disk { .. }, Some(disk)) = (was, self.disk.as_mut()) {
            disk.remove(id);
        }
        Some(cache)
    }

    /// Entry `id`'s state from its file: `read` from disk, else the one the
    /// host tier holds; the base the file leaves out (see [`kv_file`]) is
    /// taken from the shared scope.
    fn restore(&mut self, id: EntryId, read: Option<&[u8]>) -> Result<KvCache, String> {
        let base_len = match (read, &self.entries.get(&id).expect("restored entries are cached").held) {
            (Some(file), _) => kv_file::base_of(file),
            (None, Held::Host { file, .. }) => Ok(file.base()),
            _ => unreachable!("only the host tier's entries are restored without a read"),
        }
        .map_err(|e| e.to_string())?;
        let base = if base_len == 0 { None } else { self.shared_state(id, base_len) };
        let entry = self.entries.get(&id).expect("restored entries are cached");
        let (file, shape) = match (read, &entry.held) {
            (Some(file), Held::Disk { shape, .. }) => (file, shape),
            (None, Held::Host { file, shape, .. }) => (file.bytes(), shape),
            _ => unreachable!("a read is of a file on disk"),
        };
        kv_file::decode(file, shape, self.namespace, &entry.tokens, base.as_ref()).map_err(|e| e.to_string())
    }

    /// The state of entry `id`'s first `len` tokens held by a shared-scope
    /// entry (read back if on disk), if one holds them.
    fn shared_state(&mut self, id: EntryId, len: usize) -> Option<KvCache> {
        let tokens = self.entries.get(&id)?.tokens.get(..=len)?.to_vec();
        let (base, matched) = self.longest_match(&Scope::Shared, &tokens, false)?;
        (matched == len).then(|| self.state_of(base)).flatten()
    }

    /// The entry holding the longest block-aligned prefix of `prompt` (all
    /// but its last token) in `scope` (in RAM only, when `ram_only`), and
    /// that prefix's length.
    fn longest_match(&self, scope: &Scope, prompt: &[u32], ram_only: bool) -> Option<(EntryId, usize)> {
        let usable = prompt.len().saturating_sub(1);
        let keys = self.block_keys(scope, &prompt[..usable]);
        keys.iter().enumerate().rev().find_map(|(i, key)| {
            let id = *self.index.get(key)?;
            let len = (i + 1) * self.block;
            let entry = self.entries.get(&id)?;
            // A hash collision must never serve the wrong state; and a cache
            // whose sliding-window layers dropped the keys a continuation at
            // `len` would see cannot serve it (a miss, computed afresh).
            let usable = entry.earliest_truncation <= len && (!ram_only || matches!(entry.held, Held::Ram(_)));
            (usable && entry.scope == *scope && entry.tokens.len() >= len && entry.tokens[..len] == prompt[..len]).then_some((id, len))
        })
    }

    /// Stores the KV state of `tokens` (exactly the tokens `cache` holds).
    /// Entries of the same scope whose every whole block this one holds are
    /// replaced: matches are block-aligned and the index now points those
    /// blocks here, so they could serve nothing this one cannot. That covers
    /// a turn that extends its history and one that forks off its last
    /// partial block (a regenerated answer; a next prompt that carries the
    /// answer re-rendered, or leaves it out), which would otherwise hold a
    /// second copy of the whole history until evicted.
    pub fn insert(&mut self, scope: Scope, tokens: Vec<u32>, cache: KvCache) {
        debug_assert_eq!(tokens.len(), cache.len());
        let keys = self.block_keys(&scope, &tokens);
        if keys.is_empty() {
            return;
        }
        let superseded: Vec<EntryId> = keys
            .iter()
            .filter_map(|k| self.index.get(k).copied())
            .filter(|id| self.entries.get(id).is_some_and(|e| e.scope == scope && tokens.starts_with(&e.tokens[..e.keys.len() * self.block])))
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
        self.make_room(kib);
        let earliest_truncation = cache.earliest_truncation();
        self.ticks += 1;
        self.entries.insert(id, Entry { scope, tokens, held: Held::Ram(cache), earliest_truncation, kib, used: self.ticks, keys });
        self.policy.insert(id, kib);
        if self.bytes() > self.budget_bytes {
            self.maintain();
        }
    }

    /// Makes room in RAM for `kib` more from idle sessions first, so the
    /// policy only has to evict live entries when idle ones cannot free
    /// enough.
    fn make_room(&mut self, kib: u32) {
        let capacity = (self.budget_bytes / WEIGHT_UNIT) as u64;
        let mut held: u64 = self.entries.values().filter(|e| matches!(e.held, Held::Ram(_))).map(|e| u64::from(e.kib)).sum();
        while held + u64::from(kib) > capacity {
            let Some(victim) = self.oldest_idle() else { break };
            held -= u64::from(self.entries[&victim].kib);
            self.evict(victim);
        }
    }

    /// RAM bytes held.
    fn bytes(&self) -> usize {
        self.entries.values().filter_map(|e| if let Held::Ram(c) = &e.held { Some(c.nbytes()) } else { None }).sum()
    }

    /// The least recently used entry in RAM of an idle scope, if any.
    fn oldest_idle(&self) -> Option<EntryId> {
        if self.idle.is_empty() {
            return None;
        }
        self.least_recent(|e| self.idle.contains(&e.scope))
    }

    /// The least recently used entry in RAM that `pick` accepts.
    fn least_recent(&self, pick: impl Fn(&Entry) -> bool) -> Option<EntryId> {
        self.entries.iter().filter(|(_, e)| matches!(e.held, Held::Ram(_)) && pick(e)).min_by_key(|(_, e)| e.used).map(|(id, _)| *id)
    }

    /// Marks `scope`'s session attached (`live`) or detached: entries of
    /// detached sessions are evicted before any live one. A session coming
    /// back has its entries on disk read ahead for its next turn.
    pub fn set_scope_live(&mut self, scope: &Scope, live: bool) {
        if live {
            self.idle.remove(scope);
            if let Some(disk) = self.disk.as_mut() {
                for (id, _) in self.entries.iter().filter(|(_, e)| e.scope == *scope && matches!(e.held, Held::Disk { .. })) {
                    disk.prefetch(*id);
                }
            }
        } else if *scope != Scope::Shared {
            self.idle.insert(scope.clone());
        }
    }

    /// Drops every entry of `scope` (a session closed or expired), its
    /// files on disk included.
    pub fn drop_scope(&mut self, scope: &Scope) {
        self.idle.remove(scope);
        let ids: Vec<EntryId> = self.entries.iter().filter(|(_, e)| e.scope == *scope).map(|(id, _)| *id).collect();
        for id in ids {
            self.remove(id);
        }
    }

    /// Entry `id` leaves RAM: to the host tier when there is one and its
    /// file fits the budget, else to the disk tier on the same terms, else it
    /// is dropped. A session's file leaves out the prefix a shared-scope
    /// entry holds (a common system prompt), which comes from that entry
    /// when the file is restored.
    fn evict(&mut self, id: EntryId) {
        self.stats.evictions += 1;
        if self.host_budget_bytes == 0 && self.disk.is_none() {
            return self.remove(id);
        }
        let Some(entry) = self.entries.get(&id) else { return };
        let Held::Ram(cache) = &entry.held else { return };
        let base = match entry.scope {
            Scope::Shared => 0,
            Scope::Session(_) => self.longest_match(&Scope::Shared, &entry.tokens, false).map_or(0, |(_, len)| len),
        };
        let (file, shape) = match kv_file::encode(cache, self.namespace, &entry.tokens, base) {
            Ok(file) => (file, cache.emptied()),
            Err(e) => {
                eprintln!("warning: a prefix-cache entry could not be encoded ({e}); it is dropped");
                return self.remove(id);
            }
        };
        self.policy.invalidate(&id);
        if file.len() > self.host_budget_bytes {
            return self.spill_to_disk(id, file, shape);
        }
        self.stats.host.moves += 1;
        let moved = self.stats.host.moves;
        self.entries.get_mut(&id).expect("looked up above").held = Held::Host { file, moved, shape };
        // Over its budget, the host tier's oldest entries go on to disk.
        while self.host_bytes() > self.host_budget_bytes {
            let oldest = self.entries.iter().filter_map(|(id, e)| if let Held::Host { moved, .. } = e.held { Some((moved, *id)) } else { None }).min();
            let Some((_, oldest)) = oldest else { break };
            let Some(entry) = self.entries.get_mut(&oldest) else { break };
            // A stand-in until `spill_to_disk` sets where the entry is now.
            let Held::Host { file, shape, .. } = std::mem::replace(&mut entry.held, Held::Ram(KvCache::new(0, 0, 0, mlx::Dtype::F32))) else {
                unreachable!("picked from the host tier")
            };
            self.spill_to_disk(oldest, file, shape);
        }
    }

    /// Entry `id`'s `file` goes to the disk tier when there is one and it
    /// fits its budget; else the entry is dropped.
    fn spill_to_disk(&mut self, id: EntryId, file: Encoded, shape: KvCache) {
        let Some(disk) = self.disk.as_mut().filter(|d| file.len() <= d.budget_bytes()) else { return self.remove(id) };
        self.stats.disk.writes += 1;
        self.stats.disk.written_bytes += file.len() as u64;
        let Some(entry) = self.entries.get_mut(&id) else { return };
        entry.held = Held::Disk { bytes: file.len(), written: self.stats.disk.writes, shape };
        disk.write(id, file);
        self.trim_disk();
    }

    /// Bytes the host tier holds.
    fn host_bytes(&self) -> usize {
        self.entries.values().filter_map(|e| if let Held::Host { file, .. } = &e.held { Some(file.len()) } else { None }).sum()
    }

    /// Drops the oldest files until the disk tier is within its budget.
    fn trim_disk(&mut self) {
        let Some(budget) = self.disk.as_ref().map(DiskTier::budget_bytes) else { return };
        while self.disk_bytes() > budget {
            let oldest = self.entries.iter().filter_map(|(id, e)| if let Held::Disk { written, .. } = e.held { Some((written, *id)) } else { None }).min();
            let Some((_, id)) = oldest else { break };
            self.stats.disk.evictions += 1;
            self.remove(id);
        }
    }

    fn disk_bytes(&self) -> usize {
        self.entries.values().filter_map(|e| if let Held::Disk { bytes, .. } = e.held { Some(bytes) } else { None }).sum()
    }

    fn remove(&mut self, id: EntryId) {
        if let Some(entry) = self.take(id) {
            if let (Held::Disk { .. }, Some(disk)) = (&entry.held, self.disk.as_mut()) {
                disk.remove(id);
            }
        }
    }

    /// Entry `id` out of the index and the policy, its state with it.
    fn take(&mut self, id: EntryId) -> Option<Entry> {
        let entry = self.entries.remove(&id);
        for k in entry.iter().flat_map(|e| &e.keys) {
            if self.index.get(k) == Some(&id) {
                self.index.remove(k);
            }
        }
        self.policy.invalidate(&id);
        entry
    }

    /// Runs moka's pending maintenance and evicts what it chose. Call from
    /// the engine thread (the eviction listener runs here).
    pub fn maintain(&mut self) {
        self.policy.run_pending_tasks();
        while let Ok(id) = self.evicted.try_recv() {
            if self.entries.get(&id).is_some_and(|e| matches!(e.held, Held::Ram(_))) {
                self.evict(id);
            }
        }
        // The budget holds even if the policy has not caught up yet (or
        // declined to admit an entry): evict the oldest entries beyond it,
        // idle sessions' first.
        while self.bytes() > self.budget_bytes {
            let Some(oldest) = self.oldest_idle().or_else(|| self.least_recent(|_| true)) else { break };
            self.evict(oldest);
        }
    }

    pub fn stats(&self) -> PrefixStats {
        let on_disk = self.entries.values().filter(|e| matches!(e.held, Held::Disk { .. })).count();
        let on_host = self.entries.values().filter(|e| matches!(e.held, Held::Host { .. })).count();
        PrefixStats {
            entries: self.entries.len() - on_disk - on_host,
            bytes: self.bytes(),
            host: HostStats { entries: on_host, bytes: self.host_bytes(), ..self.stats.host },
            disk: DiskStats { entries: on_disk, bytes: self.disk_bytes(), ..self.stats.disk },
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use mlx::{Array, Dtype};

    use super::*;

    /// A 2-layer cache of `tokens.len()` positions whose values are `salt`
    /// plus the position: 64 KiB of buffers (256 positions of capacity).
    fn state(tokens: &[u32], salt: f32) -> KvCache {
        let (heads, dim, len) = (2, 8, tokens.len());
        let data: Vec<f32> = (0..heads * len * dim).map(|i| salt + ((i / dim) % len) as f32).collect();
        let a = Array::from_f32(&data, &[1, heads, len, dim]).unwrap();
        let mut cache = KvCache::new(2, heads, dim, Dtype::F32);
        cache.fill(&[(a.clone(), a.clone()), (a.clone(), a)], len, 0).unwrap();
        cache
    }

    fn first_value(cache: &KvCache) -> f32 {
        cache.positions(1).unwrap().unwrap().1.to_vec_f32().unwrap()[0]
    }

    fn session(n: u32) -> Scope {
        Scope::Session(format!("s{n}"))
    }

    /// Tokens of session `n`'s history: distinct per session.
    fn history(n: u32) -> Vec<u32> {
        (0..64).map(|t| n * 1000 + t).collect()
    }

    struct Folder(std::path::PathBuf);
    impl Drop for Folder {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A cache whose RAM holds one 64 KiB entry, with a disk tier of `disk_kib`.
    fn tiered(name: &str, disk_kib: usize) -> (Folder, PrefixCache) {
        let dir = std::env::temp_dir().join(format!("tether-prefix-test-{}-{name}", std::process::id()));
        let config = DiskTierConfig { dir: dir.clone(), budget_bytes: disk_kib << 10 };
        (Folder(dir), PrefixCache::with_disk_tier(100 << 10, 16, 7, Some(&config)).unwrap())
    }

    /// Session `n`'s turn ends: its state is stored, its socket detaches.
    fn store(cache: &mut PrefixCache, n: u32, salt: f32) {
        cache.insert(session(n), history(n), state(&history(n), salt));
        cache.set_scope_live(&session(n), false);
    }

    /// A hit that must be a snapshot (the entry stays), as state and length.
    fn snapshot(hit: Hit) -> (KvCache, usize) {
        let (cache, len, lent) = hit.into_parts();
        assert!(!lent, "a snapshot was asked for");
        (cache, len)
    }

    /// Session `n` comes back and asks with one more token than its
    /// history, so the whole history (its 4 blocks) can match; then goes idle.
    fn ask(cache: &mut PrefixCache, n: u32) -> Option<(KvCache, usize)> {
        let mut prompt = history(n);
        prompt.push(1);
        cache.set_scope_live(&session(n), true);
        let hit = cache.lookup(&session(n), &prompt, None, false).map(snapshot);
        cache.set_scope_live(&session(n), false);
        hit
    }

    #[test]
    fn evicted_entries_go_to_disk_and_come_back_whole() {
        let (_dir, mut cache) = tiered("round-trip", 1 << 10);
        for n in 0..3 {
            store(&mut cache, n, n as f32 * 100.0);
        }
        let s = cache.stats();
        assert_eq!((s.entries, s.disk.entries, s.disk.writes), (1, 2, 2), "{s:?}");
        for n in [0, 2, 1] {
            let (kv, len) = ask(&mut cache, n).expect("a hit from RAM or disk");
            assert_eq!(len, 64);
            assert_eq!(first_value(&kv), n as f32 * 100.0, "session {n}'s own state");
        }
        let s = cache.stats();
        assert_eq!(s.hits, 3);
        assert_eq!((s.disk.hits, s.disk.entries, s.entries), (2, 2, 1), "a session's files stay until superseded: {s:?}");
        assert_eq!(s.disk.failed_reads, 0);
        // A turn's end supersedes its file; RAM stays within its budget.
        let mut longer = history(0);
        longer.extend([7, 7, 7, 7]);
        cache.insert(session(0), longer.clone(), state(&longer, 0.0));
        let s = cache.stats();
        assert_eq!((s.entries, s.disk.entries, s.bytes), (1, 2, 64 << 10), "{s:?}");
        for n in 0..3 {
            assert_eq!(first_value(&ask(&mut cache, n).unwrap().0), n as f32 * 100.0);
        }
        // Shared state read back from disk comes back into RAM.
        let shared: Vec<u32> = (0..64).map(|t| 9000 + t).collect();
        cache.insert(Scope::Shared, shared.clone(), state(&shared, 5.0));
        let id = *cache.entries.iter().find(|(_, e)| e.scope == Scope::Shared).unwrap().0;
        cache.evict(id);
        let on_disk = cache.stats().disk.entries;
        let mut prompt = shared.clone();
        prompt.push(1);
        assert_eq!(first_value(&cache.lookup(&session(3), &prompt, None, false).map(snapshot).unwrap().0), 5.0);
        assert_eq!(cache.stats().disk.entries, on_disk - 1, "it came back into RAM");
    }

    /// A session's history after a shared prompt goes to disk without the
    /// prompt's positions, and comes back whole with them from the shared
    /// entry; with that entry gone the file cannot serve: a miss.
    #[test]
    fn a_sessions_file_leaves_out_the_shared_prompt() {
        let dir = std::env::temp_dir().join(format!("tether-prefix-test-{}-past-shared", std::process::id()));
        let _folder = Folder(dir.clone());
        let config = DiskTierConfig { dir, budget_bytes: 1 << 20 };
        let mut cache = PrefixCache::with_disk_tier(1 << 20, 16, 7, Some(&config)).unwrap();
        let shared: Vec<u32> = (0..128).map(|t| 9000 + t).collect();
        cache.insert(Scope::Shared, shared.clone(), state(&shared, 0.0));
        let mut own = shared.clone();
        own.extend((0..64).map(|t| 500 + t));
        let original = state(&own, 0.0);
        cache.insert(session(0), own.clone(), original.clone());
        let id = *cache.entries.iter().find(|(_, e)| e.scope == session(0)).unwrap().0;
        cache.evict(id);
        let s = cache.stats();
        assert_eq!((s.entries, s.disk.entries), (1, 1), "{s:?}");
        assert!((s.disk.written_bytes as usize) < original.nbytes() * 4 / 5, "{} of {} bytes", s.disk.written_bytes, original.nbytes());
        let mut prompt = own.clone();
        prompt.push(1);
        let (back, len) = cache.lookup(&session(0), &prompt, None, false).map(snapshot).expect("a hit from disk");
        assert_eq!(len, 192);
        for layer in 0..2 {
            let (k, v) = back.positions(layer).unwrap().unwrap();
            let (k0, v0) = original.positions(layer).unwrap().unwrap();
            assert_eq!((k.to_vec_f32().unwrap(), v.to_vec_f32().unwrap()), (k0.to_vec_f32().unwrap(), v0.to_vec_f32().unwrap()));
        }
        assert_eq!(cache.stats().disk.hits, 1);
        cache.drop_scope(&Scope::Shared);
        assert!(cache.lookup(&session(0), &prompt, None, false).is_none(), "no base, no hit");
        assert_eq!(cache.stats().disk.failed_reads, 1);
    }

    /// Evicted entries go to the host tier first, as their files' bytes,
    /// and come back whole; over its budget its oldest go on to disk, and
    /// come back from there; without a disk tier they are dropped.
    #[test]
    fn the_host_tier_keeps_evicted_entries_before_the_disk() {
        let (_dir, cache) = tiered("host", 1 << 10);
        // Room for one 64 KiB entry's file (its buffers and a header).
        let mut cache = cache.with_host_tier(100 << 10);
        for n in 0..3 {
            store(&mut cache, n, n as f32 * 100.0);
        }
        let s = cache.stats();
        assert_eq!((s.entries, s.host.entries, s.disk.entries), (1, 1, 1), "{s:?}");
        assert_eq!((s.host.moves, s.disk.writes), (2, 1), "{s:?}");
        assert!(s.host.bytes > 64 << 10 && s.host.bytes < 100 << 10, "{s:?}");
        for n in [0, 1, 2] {
            assert_eq!(first_value(&ask(&mut cache, n).expect("a hit").0), n as f32 * 100.0, "session {n}'s own state");
        }
        let s = cache.stats();
        assert_eq!((s.hits, s.host.hits, s.disk.hits), (3, 1, 1), "{s:?}");

        let mut cache = PrefixCache::new(100 << 10, 16, 7).with_host_tier(100 << 10);
        for n in 0..3 {
            store(&mut cache, n, n as f32 * 100.0);
        }
        let s = cache.stats();
        assert_eq!((s.entries, s.host.entries, s.disk.entries), (1, 1, 0), "{s:?}");
        assert!(ask(&mut cache, 0).is_none(), "the oldest went nowhere");
        assert_eq!(first_value(&ask(&mut cache, 1).expect("a hit from the host tier").0), 100.0);
        assert_eq!(cache.stats().host.hits, 1);
    }

    /// A file is read when computing what it adds would take longer, and
    /// passed over (a miss here: nothing in RAM matches) when computing is
    /// faster, as on a GPU.
    #[test]
    fn a_file_is_read_only_when_reading_beats_computing() {
        let (_dir, mut cache) = tiered("cost", 1 << 10);
        for n in 0..3 {
            store(&mut cache, n, n as f32);
        }
        let mut prompt = history(0);
        prompt.push(1);
        // 64 tokens at a nanosecond each: far less than reading ~64 KiB.
        assert!(cache.lookup(&session(0), &prompt, Some(1e-9), false).is_none());
        assert_eq!((cache.stats().disk.skipped, cache.stats().disk.hits), (1, 0));
        // At a second a token the file wins.
        assert_eq!(first_value(&cache.lookup(&session(0), &prompt, Some(1.0), false).map(snapshot).unwrap().0), 0.0);
        let d = cache.stats().disk;
        assert_eq!((d.skipped, d.hits), (1, 1));
        assert!(d.read_bytes > 0 && d.read_seconds > 0.0, "the read rate is measured: {d:?}");
    }

    /// A session's own entry in RAM is handed to its turn and leaves the
    /// cache; shared entries and files are never lent; the turn's end
    /// stores its state again.
    #[test]
    fn a_sessions_own_entry_is_lent_whole() {
        let (_dir, mut cache) = tiered("lend", 1 << 10);
        store(&mut cache, 0, 3.0);
        let mut prompt = history(0);
        prompt.push(1);
        let Some(Hit::Lent { cache: kv, len }) = cache.lookup(&session(0), &prompt, None, true) else { panic!("its own entry is lent") };
        assert_eq!((len, first_value(&kv)), (64, 3.0));
        let s = cache.stats();
        assert_eq!((s.entries, s.bytes, s.hits, s.lent), (0, 0, 1, 1), "it left the cache: {s:?}");
        assert!(cache.lookup(&session(0), &prompt, None, true).is_none(), "nothing is left to hit");
        cache.insert(session(0), history(0), kv);
        assert!(matches!(cache.lookup(&session(0), &prompt, None, false), Some(Hit::Shared { len: 64, .. })), "stored again, a snapshot when not lent");
        // Shared state serves every session: never lent.
        let shared: Vec<u32> = (0..64).map(|t| 9000 + t).collect();
        cache.insert(Scope::Shared, shared.clone(), state(&shared, 5.0));
        let mut asked = shared.clone();
        asked.push(1);
        assert!(matches!(cache.lookup(&session(1), &asked, None, true), Some(Hit::Shared { .. })));
        assert!(cache.lookup(&session(2), &asked, None, true).is_some(), "the shared entry stays");
        // A file comes back as the turn's own buffers already: it stays on
        // disk until superseded and is not lent.
        let id = *cache.entries.iter().find(|(_, e)| e.scope == session(0)).unwrap().0;
        cache.evict(id);
        let Some(Hit::Shared { cache: kv, .. }) = cache.lookup(&session(0), &prompt, None, true) else { panic!("a hit from disk") };
        assert_eq!(first_value(&kv), 3.0);
        let s = cache.stats();
        assert_eq!((s.lent, s.disk.hits, s.disk.entries), (1, 1, 1), "{s:?}");
    }

    /// At its budget the cache evicts as many entries as a new one needs
    /// room for and no more, least recently used first, with moka's own
    /// bookkeeping caught up only every few stores (the engine's cadence).
    #[test]
    fn a_full_cache_evicts_one_entry_for_one() {
        let mut cache = PrefixCache::new(10 * (64 << 10) + (32 << 10), 16, 7);
        for n in 0..30 {
            store(&mut cache, n, 0.0);
            if n % 3 == 0 {
                cache.maintain(); // the engine's cadence: every few steps
            }
        }
        cache.maintain();
        let s = cache.stats();
        assert_eq!((s.entries, s.evictions), (10, 20), "{s:?}");
        for n in 20..30 {
            assert!(ask(&mut cache, n).is_some(), "session {n} is among the last ten stored");
        }
    }

    /// A turn that forks off its history's last partial block replaces the
    /// entry it forked from; one that forks inside a whole block keeps it
    /// (that block still serves prompts that follow the older branch).
    #[test]
    fn a_fork_off_the_last_partial_block_replaces_its_entry() {
        let mut cache = PrefixCache::new(1 << 20, 16, 7);
        let first = history(0)[..56].to_vec(); // 3 whole blocks and 8 tokens
        cache.insert(session(0), first.clone(), state(&first, 0.0));
        let regenerated = [&first[..48], &[9; 20]].concat();
        cache.insert(session(0), regenerated, state(&[0; 68], 1.0));
        assert_eq!(cache.stats().entries, 1, "the first turn's entry holds no whole block of its own");
        let edited = [&first[..40], &[5; 30]].concat();
        cache.insert(session(0), edited, state(&[0; 70], 2.0));
        assert_eq!(cache.stats().entries, 2, "the regenerated turn's third block is its own");
        let mut prompt = first[..48].to_vec();
        prompt.push(1);
        let (hit, len) = snapshot(cache.lookup(&session(0), &prompt, None, false).expect("the older branch still serves"));
        assert_eq!((len, first_value(&hit)), (48, 1.0));
    }

    #[test]
    fn without_a_disk_tier_evicted_entries_are_gone() {
        let mut cache = PrefixCache::new(100 << 10, 16, 7);
        for n in 0..2 {
            store(&mut cache, n, 0.0);
        }
        assert!(ask(&mut cache, 0).is_none());
        assert!(ask(&mut cache, 1).is_some());
        assert_eq!(cache.stats().disk, DiskStats::default());
    }

    #[test]
    fn the_disk_budget_drops_the_oldest_files() {
        // Room for one file of ~64 KiB (the buffers as held: 256 positions
        // of room, 2 layers, keys and values).
        let (_dir, mut cache) = tiered("budget", 100);
        for n in 0..3 {
            store(&mut cache, n, 0.0);
        }
        let s = cache.stats();
        assert_eq!((s.disk.entries, s.disk.evictions), (1, 1), "{s:?}");
        assert!(ask(&mut cache, 0).is_none(), "the oldest file went");
        assert!(ask(&mut cache, 1).is_some(), "the newer one serves");
    }

    #[test]
    fn a_damaged_or_missing_file_is_a_miss() {
        let (_dir, mut cache) = tiered("damaged", 1 << 10);
        for n in 0..3 {
            store(&mut cache, n, 0.0);
        }
        let folder = cache.disk.as_mut().unwrap().dir().to_path_buf();
        // Wait for the writes: a read of each queues behind them.
        cache.disk.as_mut().unwrap().read(1).unwrap();
        let damaged = folder.join("1.kv");
        let mut bytes = std::fs::read(&damaged).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x40;
        std::fs::write(&damaged, bytes).unwrap();
        std::fs::remove_file(folder.join("2.kv")).unwrap();
        assert!(ask(&mut cache, 0).is_none(), "damaged: a miss, not wrong state");
        assert!(ask(&mut cache, 1).is_none(), "missing: a miss");
        assert_eq!(cache.stats().disk.failed_reads, 2);
        assert!(ask(&mut cache, 2).is_some(), "the entry in RAM is untouched");
        assert!(ask(&mut cache, 0).is_none(), "a failed entry is gone, not retried");
        assert_eq!(cache.stats().disk.failed_reads, 2);
    }

    #[test]
    fn a_closed_session_leaves_no_files() {
        let (_dir, mut cache) = tiered("closed", 1 << 10);
        for n in 0..3 {
            store(&mut cache, n, 0.0);
        }
        for n in 0..3 {
            cache.drop_scope(&session(n));
        }
        let s = cache.stats();
        assert_eq!((s.entries, s.disk.entries, s.disk.bytes), (0, 0, 0));
        let folder = cache.disk.as_mut().unwrap().dir().to_path_buf();
        // The removals are queued: a read of a removed file queues behind them.
        assert!(cache.disk.as_mut().unwrap().read(1).is_err());
        assert_eq!(std::fs::read_dir(folder).unwrap().count(), 0);
    }
}
