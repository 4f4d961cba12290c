//! The prefix cache's counters, as the engine reports them (summed over
//! engines by the pool). Plain data: what the cache did, in RAM and in
//! each tier; the cache keeps them, and fills in what it holds when asked.

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefixStats {
    pub hits: u64,
    /// Hits that handed a session's own entry to its turn (see [`super::Hit::Lent`]).
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
