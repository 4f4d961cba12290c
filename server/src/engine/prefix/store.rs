//! The prefix cache's store: the MLX state of its entries, and the
//! restores that bring an entry's state back from a tier's file. It holds
//! arrays and decides nothing: which entries exist, where each one is and
//! which leave RAM is the index's call; where files go is the tiers'.
//!
//! An entry in RAM holds its state as blocks shared by reference with the
//! entries it continues ([`paged`]); a hit hands the request a cache of
//! them (a copy-on-write snapshot of a cache stored as is, else the blocks
//! copied into buffers of its own); prefill resumes from there. An entry
//! out of RAM keeps an empty cache of its state's shape to decode its file
//! into. The arrays are bound to the engine thread (`mlx::Array` is
//! `!Send`), so this store lives and dies on it.
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
use super::paged::{Paged, Pages};
use super::{Origin, PrefixCache};
use crate::models::kv_file::{self, Encoded, KvFileError};
use crate::models::KvCache;

/// An entry's state as the store holds it.
enum Held {
    Ram(Paged),
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
    pages: Pages,
}

impl Store {
    pub fn new(namespace: u64) -> Store {
        Store { namespace, held: HashMap::new(), pages: Pages::default() }
    }

    /// `cache` in blocks, sharing those of the entry it resumed from
    /// (`origin`, when that is still in RAM: see [`paged`]); held by no
    /// entry until [`put`](Self::put).
    pub fn page(&mut self, cache: KvCache, origin: Option<Origin>) -> mlx::Result<Paged> {
        let origin = origin.and_then(|o| match self.held.get(&o.id) {
            Some(Held::Ram(paged)) => Some((paged, o.len)),
            _ => None,
        });
        self.pages.page(cache, origin)
    }

    /// Keeps `paged` as entry `id`'s state in RAM.
    pub fn put(&mut self, id: EntryId, paged: Paged) {
        self.pages.hold(id, &paged);
        self.held.insert(id, Held::Ram(paged));
    }

    /// Bytes the cache's budget books to entry `id` (see [`paged`]).
    pub fn owned_bytes(&self, id: EntryId) -> usize {
        match self.held.get(&id) {
            Some(Held::Ram(paged)) => self.pages.owned_bytes(id, paged),
            _ => 0,
        }
    }

    /// Bytes `paged` adds to what the cache holds (its segments no entry
    /// holds yet).
    pub fn unowned_bytes(&self, paged: &Paged) -> usize {
        self.pages.unowned_bytes(paged)
    }

    /// A cache of entry `id`'s first `len` positions, if it is in RAM.
    pub fn snapshot(&self, id: EntryId, len: usize) -> Option<mlx::Result<KvCache>> {
        match self.held.get(&id)? {
            Held::Ram(paged) => Some(self.pages.restore(paged, len)),
            Held::Away { .. } => None,
        }
    }

    /// Whether entry `id`'s state can be lent whole (see [`paged`]).
    pub fn lendable(&self, id: EntryId) -> bool {
        matches!(self.held.get(&id), Some(Held::Ram(paged)) if self.pages.lendable(paged))
    }

    /// Entry `id`'s state in RAM, taken out of the store whole (lent), if
    /// [`lendable`](Self::lendable).
    pub fn take(&mut self, id: EntryId) -> Option<KvCache> {
        if !self.lendable(id) {
            return None;
        }
        let Some(Held::Ram(paged)) = self.held.remove(&id) else { return None };
        self.pages.take_whole(id, paged)
    }

    /// Entry `id` gone; returns the entries now booked for what it was
    /// booked for (their bytes changed).
    pub fn remove(&mut self, id: EntryId) -> Vec<EntryId> {
        match self.held.remove(&id) {
            Some(Held::Ram(paged)) => self.pages.release(id, paged),
            _ => Vec::new(),
        }
    }

    /// Entry `id`'s state in RAM as its file, leaving out the first `base`
    /// positions (a shared entry's); its blocks go, an empty cache of their
    /// shape stays. Returns the file and the entries now booked for what it
    /// was booked for. On an error nothing changes.
    pub fn send_away(&mut self, id: EntryId, tokens: &[u32], base: usize) -> Result<(Encoded, Vec<EntryId>), KvFileError> {
        let Some(Held::Ram(paged)) = self.held.get(&id) else { return Err(KvFileError::Mismatch("the entry is not in RAM")) };
        let cache = self.pages.restore(paged, paged.len())?;
        let file = kv_file::encode(&cache, self.namespace, tokens, base)?;
        let shape = paged.shape().emptied();
        let Some(Held::Ram(paged)) = self.held.insert(id, Held::Away { shape }) else { unreachable!("checked above") };
        Ok((file, self.pages.release(id, paged)))
    }

    /// Entry `id`'s state of `tokens` decoded from its `file`, on top of
    /// `base` when the file leaves out a shared prefix.
    fn decode(&self, id: EntryId, file: &[u8], tokens: &[u32], base: Option<&KvCache>) -> Result<KvCache, String> {
        let Some(Held::Away { shape }) = self.held.get(&id) else { return Err("the entry is not in a tier".into()) };
        kv_file::decode(file, shape, self.namespace, tokens, base).map_err(|e| e.to_string())
    }

    /// Blocks held, and the bytes of the buffers holding them.
    #[cfg(test)]
    pub fn held(&self) -> (usize, usize) {
        self.pages.held()
    }
}

impl PrefixCache {
    /// Entry `id`'s state (its first `len` positions when in RAM; a state
    /// restored from a tier holds them all): a snapshot when in RAM, else
    /// restored from the host tier or its file; `None` (and the entry
    /// removed) when it cannot serve. With it, the entry in RAM its first
    /// positions are a copy of, if any: this one, or the shared entry a
    /// session's file took its base from.
    pub(super) fn state_of(&mut self, id: EntryId, len: usize) -> Option<(KvCache, Option<Origin>)> {
        let entry = self.index.get(id)?;
        let (place, bytes, shared) = (entry.place, entry.bytes, entry.scope == Scope::Shared);
        if place == Place::Ram {
            return match self.store.snapshot(id, len)? {
                Ok(cache) => Some((cache, Some(Origin { id, len }))),
                Err(e) => {
                    eprintln!("warning: a prefix-cache entry could not be restored ({e}); the prompt is computed afresh");
                    self.remove(id);
                    None
                }
            };
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
        let (cache, base) = match restored {
            Ok(restored) => restored,
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
            return Some((cache, base));
        }
        // Shared state serves many sessions: back into RAM, and the file
        // goes. Room is made at the next insert, not here: writing another
        // entry out now would delay this request's first token.
        let snapshot = cache.clone();
        match self.store.page(cache, None) {
            Ok(paged) => {
                self.store.put(id, paged);
                self.index.move_to(id, Place::Ram, self.store.owned_bytes(id));
                self.tiers.forget(id, place);
                Some((snapshot, Some(Origin { id, len })))
            }
            // Served once, and gone: the file could not be kept either way.
            Err(_) => {
                self.remove(id);
                Some((snapshot, None))
            }
        }
    }

    /// Entry `id`'s state from its file: `read` from disk, else the one the
    /// host tier holds; the base the file leaves out (see [`kv_file`]) is
    /// taken from the shared scope, whose entry is returned as the state's
    /// origin when it is in RAM.
    fn restore(&mut self, id: EntryId, read: Option<&[u8]>) -> Result<(KvCache, Option<Origin>), String> {
        const LOST: &str = "the host tier lost the entry's file";
        let base_len = match read {
            Some(file) => kv_file::base_of(file).map_err(|e| e.to_string())?,
            None => self.tiers.host_file(id).ok_or(LOST)?.base(),
        };
        let (base, origin) = if base_len == 0 { (None, None) } else { self.shared_state(id, base_len).unzip() };
        let file = match read {
            Some(file) => file,
            None => self.tiers.host_file(id).ok_or(LOST)?.bytes(),
        };
        let tokens = &self.index.get(id).ok_or("the entry left the index")?.tokens;
        Ok((self.store.decode(id, file, tokens, base.as_ref())?, origin.flatten()))
    }

    /// The state of entry `id`'s first `len` tokens held by a shared-scope
    /// entry (read back if on disk), if one holds them, and its origin.
    fn shared_state(&mut self, id: EntryId, len: usize) -> Option<(KvCache, Option<Origin>)> {
        let tokens = self.index.get(id)?.tokens.get(..=len)?.to_vec();
        let (base, matched) = self.index.longest_match(&Scope::Shared, &tokens, false)?;
        (matched == len).then(|| self.state_of(base, len)).flatten()
    }
}
