//! The prefix cache's store: the MLX state of its entries, and the
//! restores that bring an entry's state back from a tier's file. It holds
//! arrays and decides nothing: which entries exist, where each one is and
//! which leave RAM is the index's call; where files go is the tiers'.
//!
//! A hit on an entry in RAM hands the request a copy-on-write snapshot of
//! its KV cache (a clone sharing every buffer: the turn's first write to
//! each buffer copies it); prefill resumes from there. An entry out of RAM
//! keeps an empty cache of its state's shape to decode its file into. The
//! arrays are bound to the engine thread (`mlx::Array` is `!Send`), so this
//! store lives and dies on it.
//!
//! Restoring a session's own entry hands the returning turn the restored
//! buffers outright, and its file stays until the turn's end stores the
//! longer state that supersedes it; a shared entry comes back into RAM
//! (it serves many sessions) and its file goes. A file that leaves out a
//! shared prefix (see [`kv_file`]) is restored on top of the shared entry
//! that holds it; one that cannot be restored (damaged, missing, its base
//! gone) is a miss and its entry is dropped: the turn computes afresh.
use std::collections::HashMap;
use std::time::Instant;

use super::index::{EntryId, Place, Scope};
use super::PrefixCache;
use crate::models::kv_file::{self, Encoded, KvFileError};
use crate::models::KvCache;

/// An entry's state as the store holds it.
enum Held {
    Ram(KvCache),
    /// In a tier: an empty cache of the state's shape to restore it into.
    Away {
        shape: KvCache,
    },
}

pub(super) struct Store {
    /// Separates state computed under different models, layouts or dtypes
    /// (files carry it and are checked against it).
    namespace: u64,
    held: HashMap<EntryId, Held>,
}

impl Store {
    pub fn new(namespace: u64) -> Store {
        Store { namespace, held: HashMap::new() }
    }

    /// Keeps `cache` as entry `id`'s state in RAM.
    pub fn put(&mut self, id: EntryId, cache: KvCache) {
        self.held.insert(id, Held::Ram(cache));
    }

    /// A copy-on-write snapshot of entry `id`'s state, if it is in RAM.
    pub fn snapshot(&self, id: EntryId) -> Option<KvCache> {
        match self.held.get(&id)? {
            Held::Ram(cache) => Some(cache.clone()),
            Held::Away { .. } => None,
        }
    }

    /// Entry `id`'s state in RAM, taken out of the store whole (lent).
    pub fn take(&mut self, id: EntryId) -> Option<KvCache> {
        match self.held.remove(&id)? {
            Held::Ram(cache) => Some(cache),
            away => {
                self.held.insert(id, away);
                None
            }
        }
    }

    pub fn remove(&mut self, id: EntryId) {
        self.held.remove(&id);
    }

    /// Entry `id`'s state in RAM as its file, leaving out the first `base`
    /// positions (a shared entry's); its buffers go, an empty cache of their
    /// shape stays. On an error nothing changes.
    pub fn send_away(&mut self, id: EntryId, tokens: &[u32], base: usize) -> Result<Encoded, KvFileError> {
        let Some(Held::Ram(cache)) = self.held.get(&id) else { return Err(KvFileError::Mismatch("the entry is not in RAM")) };
        let file = kv_file::encode(cache, self.namespace, tokens, base)?;
        let shape = cache.emptied();
        self.held.insert(id, Held::Away { shape });
        Ok(file)
    }

    /// Entry `id`'s state of `tokens` decoded from its `file`, on top of
    /// `base` when the file leaves out a shared prefix.
    fn decode(&self, id: EntryId, file: &[u8], tokens: &[u32], base: Option<&KvCache>) -> Result<KvCache, String> {
        let Some(Held::Away { shape }) = self.held.get(&id) else { return Err("the entry is not in a tier".into()) };
        kv_file::decode(file, shape, self.namespace, tokens, base).map_err(|e| e.to_string())
    }
}

impl PrefixCache {
    /// Entry `id`'s state: a snapshot when in RAM, else restored from the
    /// host tier or its file; `None` (and the entry removed) when it
    /// cannot serve.
    pub(super) fn state_of(&mut self, id: EntryId) -> Option<KvCache> {
        let entry = self.index.get(id)?;
        let (place, bytes, shared) = (entry.place, entry.bytes, entry.scope == Scope::Shared);
        if place == Place::Ram {
            return self.store.snapshot(id);
        }
        let on_disk = place == Place::Disk;
        let started = Instant::now();
        let restored = if on_disk {
            match self.tiers.read(id) {
                Ok(file) => self.restore(id, Some(&file)),
                Err(e) => Err(e.to_string()),
            }
        } else {
            self.restore(id, None)
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
        if !shared {
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
        self.index.move_to(id, Place::Ram, cache.nbytes());
        self.store.put(id, cache.clone());
        self.tiers.forget(id, place);
        Some(cache)
    }

    /// Entry `id`'s state from its file: `read` from disk, else the one the
    /// host tier holds; the base the file leaves out (see [`kv_file`]) is
    /// taken from the shared scope.
    fn restore(&mut self, id: EntryId, read: Option<&[u8]>) -> Result<KvCache, String> {
        const LOST: &str = "the host tier lost the entry's file";
        let base_len = match read {
            Some(file) => kv_file::base_of(file).map_err(|e| e.to_string())?,
            None => self.tiers.host_file(id).ok_or(LOST)?.base(),
        };
        let base = if base_len == 0 { None } else { self.shared_state(id, base_len) };
        let file = match read {
            Some(file) => file,
            None => self.tiers.host_file(id).ok_or(LOST)?.bytes(),
        };
        let tokens = &self.index.get(id).ok_or("the entry left the index")?.tokens;
        self.store.decode(id, file, tokens, base.as_ref())
    }

    /// The state of entry `id`'s first `len` tokens held by a shared-scope
    /// entry (read back if on disk), if one holds them.
    fn shared_state(&mut self, id: EntryId, len: usize) -> Option<KvCache> {
        let tokens = self.index.get(id)?.tokens.get(..=len)?.to_vec();
        let (base, matched) = self.index.longest_match(&Scope::Shared, &tokens, false)?;
        (matched == len).then(|| self.state_of(base)).flatten()
    }
}
