//! The prefix cache's tiers below RAM: where an entry evicted from RAM
//! goes instead of being dropped, and whether bringing one back pays. It
//! keeps files (as bytes in memory, or on disk through
//! [`super::disk_tier`]); the index books which entry is where, and the
//! store encodes and restores the state.
//!
//! The host tier (a byte budget of its own) comes first: an evicted entry
//! is kept in memory as its file's bytes, which leave out the shared
//! prefix (see [`crate::models::kv_file`]), so an agent's idle session takes
//! a quarter of its RAM entry's bytes or less there and comes back with a
//! copy, not a read. On a GPU it is the host memory beside the device's.
//! Over its budget, its oldest entries go on to disk (or are dropped
//! without a disk tier).
//!
//! With a disk tier, an entry is written to a file: it keeps its place in
//! the index, and a lookup that lands on it reads it back (checked: a
//! damaged or missing file is a miss, and the turn computes its state
//! afresh). The tier has its own byte budget, over which its oldest files
//! go; a session that re-attaches has its files read ahead.
//!
//! The key decision: a match in a tier is restored only when that is
//! expected to be faster than computing the tokens it adds over the best
//! match in RAM ([`PrefixCache::restoring_pays`]): on a CPU restoring
//! nearly always wins, while a GPU computes thousands of tokens in the
//! time a large file takes to read.
use std::collections::HashMap;

use super::disk_tier::DiskTier;
use super::index::{EntryId, Place, Scope};
use super::PrefixCache;
use crate::models::kv_file::Encoded;

/// What a disk read is taken to cost before this tier has timed one: a
/// local SSD's order of magnitude, including the checksum and the copy in.
const ASSUMED_READ_BYTES_PER_SECOND: f64 = 1e9;
/// The same for the host tier's first restore: a memory copy.
const ASSUMED_RESTORE_BYTES_PER_SECOND: f64 = 1e10;

pub(super) struct Tiers {
    /// Bytes the host tier may keep (0: none).
    host_budget_bytes: usize,
    /// The host tier: entries' files, in memory.
    host: HashMap<EntryId, Encoded>,
    pub disk: Option<DiskTier>,
}

impl Tiers {
    pub fn new(disk: Option<DiskTier>) -> Tiers {
        Tiers { host_budget_bytes: 0, host: HashMap::new(), disk }
    }

    pub fn set_host_budget(&mut self, bytes: usize) {
        self.host_budget_bytes = bytes;
    }

    /// Entry `id`'s file in the host tier.
    pub fn host_file(&self, id: EntryId) -> Option<&Encoded> {
        self.host.get(&id)
    }

    /// Entry `id`'s file read back from disk, checked whole.
    pub fn read(&mut self, id: EntryId) -> std::io::Result<Vec<u8>> {
        let disk = self.disk.as_mut().ok_or_else(|| std::io::Error::other("entries are on disk only with a disk tier"))?;
        disk.read(id)
    }

    /// Starts reading entry `id`'s file, for a turn that will want it soon.
    pub fn prefetch(&mut self, id: EntryId) {
        if let Some(disk) = self.disk.as_mut() {
            disk.prefetch(id);
        }
    }

    /// Entry `id`, in `place`, left that tier: its file goes.
    pub fn forget(&mut self, id: EntryId, place: Place) {
        match (place, self.disk.as_mut()) {
            (Place::Host, _) => drop(self.host.remove(&id)),
            (Place::Disk, Some(disk)) => disk.remove(id),
            _ => {}
        }
    }
}

impl PrefixCache {
    /// Whether restoring entry `id` (from the host tier or its file) is
    /// expected to take less than computing `added` prompt tokens at
    /// `recompute_token_seconds` each. The rate is what that tier's
    /// restores have taken so far (for a file: read, check and restore, as
    /// a turn waits for them), or an assumed one before the first.
    pub(super) fn restoring_pays(&self, id: EntryId, added: usize, recompute_token_seconds: Option<f64>) -> bool {
        let Some(per_token) = recompute_token_seconds else { return true };
        let (h, d) = (&self.stats.host, &self.stats.disk);
        let Some(entry) = self.index.get(id) else { return true };
        let rate = match entry.place {
            Place::Host if h.restore_seconds > 0.0 => h.restore_bytes as f64 / h.restore_seconds,
            Place::Host => ASSUMED_RESTORE_BYTES_PER_SECOND,
            Place::Disk if d.read_seconds > 0.0 => d.read_bytes as f64 / d.read_seconds,
            Place::Disk => ASSUMED_READ_BYTES_PER_SECOND,
            Place::Ram => return true,
        };
        entry.bytes as f64 / rate < added as f64 * per_token
    }

    /// Entry `id` leaves RAM: to the host tier when there is one and its
    /// file fits the budget, else to the disk tier on the same terms, else it
    /// is dropped. A session's file leaves out the prefix a shared-scope
    /// entry holds (a common system prompt), which comes from that entry
    /// when the file is restored.
    pub(super) fn evict(&mut self, id: EntryId) {
        self.stats.evictions += 1;
        if self.tiers.host_budget_bytes == 0 && self.tiers.disk.is_none() {
            return self.remove(id);
        }
        let Some(entry) = self.index.get(id).filter(|e| e.place == Place::Ram) else { return };
        let base = match entry.scope {
            Scope::Shared => 0,
            Scope::Session(_) => self.index.longest_match(&Scope::Shared, &entry.tokens, false).map_or(0, |(_, len)| len),
        };
        let file = match self.store.send_away(id, &entry.tokens, base) {
            Ok((file, rebooked)) => {
                self.rebook(rebooked);
                file
            }
            Err(e) => {
                eprintln!("warning: a prefix-cache entry could not be encoded ({e}); it is dropped");
                return self.remove(id);
            }
        };
        if file.len() > self.tiers.host_budget_bytes {
            return self.spill_to_disk(id, file);
        }
        self.stats.host.moves += 1;
        self.index.move_to(id, Place::Host, file.len());
        self.tiers.host.insert(id, file);
        // Over its budget, the host tier's oldest entries go on to disk.
        while self.index.booked(Place::Host).1 > self.tiers.host_budget_bytes {
            let Some(oldest) = self.index.oldest(Place::Host) else { break };
            let Some(file) = self.tiers.host.remove(&oldest) else { break };
            self.spill_to_disk(oldest, file);
        }
    }

    /// Entry `id`'s `file` goes to the disk tier when there is one and it
    /// fits its budget; else the entry is dropped.
    fn spill_to_disk(&mut self, id: EntryId, file: Encoded) {
        let Some(disk) = self.tiers.disk.as_mut().filter(|d| file.len() <= d.budget_bytes()) else { return self.remove(id) };
        self.stats.disk.writes += 1;
        self.stats.disk.written_bytes += file.len() as u64;
        if self.index.get(id).is_none() {
            return;
        }
        self.index.move_to(id, Place::Disk, file.len());
        disk.write(id, file);
        self.trim_disk();
    }

    /// Drops the oldest files until the disk tier is within its budget.
    fn trim_disk(&mut self) {
        let Some(budget) = self.tiers.disk.as_ref().map(DiskTier::budget_bytes) else { return };
        while self.index.booked(Place::Disk).1 > budget {
            let Some(oldest) = self.index.oldest(Place::Disk) else { break };
            self.stats.disk.evictions += 1;
            self.remove(oldest);
        }
    }
}
