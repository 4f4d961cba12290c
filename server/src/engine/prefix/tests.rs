//! The prefix cache whole, over real (tiny) MLX state: hits, lending,
//! both tiers, restores and the budgets. The index's own rules are tested
//! without MLX, at random, in `index/tests.rs`.
use mlx::{Array, Dtype};

use super::*;
use crate::models::{KvQuantization, LayerKv};

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
    let (cache, len, lent, _) = hit.into_parts();
    assert!(lent.is_none(), "a snapshot was asked for");
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
    let id = cache.index.ids_of(&Scope::Shared, None)[0];
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
    let id = cache.index.ids_of(&session(0), None)[0];
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
    let Some(Hit::Lent { cache: kv, len, .. }) = cache.lookup(&session(0), &prompt, None, true) else { panic!("its own entry is lent") };
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
    let id = cache.index.ids_of(&session(0), None)[0];
    cache.evict(id);
    let Some(Hit::Shared { cache: kv, .. }) = cache.lookup(&session(0), &prompt, None, true) else { panic!("a hit from disk") };
    assert_eq!(first_value(&kv), 3.0);
    let s = cache.stats();
    assert_eq!((s.lent, s.disk.hits, s.disk.entries), (1, 1, 1), "{s:?}");
}

/// A cancelled turn hands its lease the state it holds: the history it
/// was lent goes back, cut to what was lent, at the cache's next
/// operation; a lease dropped empty (the turn stored its own state, or
/// failed) gives nothing back.
#[test]
fn a_lent_history_goes_back_through_its_lease() {
    let mut cache = PrefixCache::new(1 << 20, 16, 7);
    cache.insert(session(0), history(0), state(&history(0), 3.0));
    let mut prompt = history(0);
    prompt.extend([1, 2, 3]);
    let Some(Hit::Lent { cache: kv, len, lease }) = cache.lookup(&session(0), &prompt, None, true) else { panic!("its own entry is lent") };
    assert_eq!((len, cache.stats().entries), (64, 0));
    // The turn wrote its prompt's last tokens (values as in `state`), then
    // was cancelled.
    drop(kv);
    lease.give_back(prompt.clone(), state(&prompt, 3.0));
    assert_eq!(cache.stats().entries, 1, "the history is back");
    let Some(Hit::Lent { cache: kv, len, lease }) = cache.lookup(&session(0), &prompt, None, true) else { panic!("lent again") };
    assert_eq!((len, kv.len(), first_value(&kv)), (64, 64, 3.0), "cut to what was lent");
    drop(lease);
    assert!(cache.lookup(&session(0), &prompt, None, false).is_none(), "an empty lease gives nothing back");
    assert_eq!(cache.stats().lent, 2);
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
    let folder = cache.tiers.disk.as_mut().unwrap().dir().to_path_buf();
    // Wait for the writes: a read of each queues behind them.
    cache.tiers.disk.as_mut().unwrap().read(1).unwrap();
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
    let folder = cache.tiers.disk.as_mut().unwrap().dir().to_path_buf();
    // The removals are queued: a read of a removed file queues behind them.
    assert!(cache.tiers.disk.as_mut().unwrap().read(1).is_err());
    assert_eq!(std::fs::read_dir(folder).unwrap().count(), 0);
}

/// The KV layouts a paged entry must keep: floats with keys in position
/// order (a GPU's), in blocks (the CPU's), and 8- and 4-bit codes.
fn layouts() -> Vec<KvCache> {
    let blocks = || KvCache::with_keys_in_blocks(2, 2, 8, Dtype::F32);
    let codes = |bits| blocks().with_quantization(Some(KvQuantization { bits, group: 8, start: 0 })).unwrap();
    vec![KvCache::new(2, 2, 8, Dtype::F32), blocks(), codes(8), codes(4)]
}

/// `layout` holding `tokens.len()` positions whose values are `salt` plus
/// the position.
fn state_in(layout: &KvCache, tokens: &[u32], salt: f32) -> KvCache {
    let (heads, dim, len) = (2, 8, tokens.len());
    let data: Vec<f32> = (0..heads * len * dim).map(|i| salt + ((i / dim) % len) as f32 / 64.0).collect();
    let a = Array::from_f32(&data, &[1, heads, len, dim]).unwrap();
    let mut cache = layout.emptied();
    cache.fill(&[(a.clone(), a.clone()), (a.clone(), a)], len, 0).unwrap();
    cache
}

/// A turn resumed from `hit`: positions up to `len` written after it as
/// a step would (values `salt` plus the position).
fn continued(mut cache: KvCache, len: usize, salt: f32) -> KvCache {
    let (heads, dim, start) = (2, 8, cache.len());
    let n = len - start;
    let data: Vec<f32> = (0..n * heads * dim).map(|i| salt + (start + i / (heads * dim)) as f32 / 64.0).collect();
    let a = Array::from_f32(&data, &[n, heads, 1, dim]).unwrap();
    cache.reserve(n).unwrap();
    for layer in 0..2 {
        cache.write_step(layer, &a, &a, 0, n).unwrap();
    }
    cache.advance(n);
    cache
}

fn values(cache: &KvCache) -> Vec<Vec<f32>> {
    (0..2)
        .flat_map(|l| {
            let (k, v) = cache.positions(l).unwrap().unwrap();
            [k.to_vec_f32().unwrap(), v.to_vec_f32().unwrap()]
        })
        .collect()
}

/// One turn of session `n` over `prompt`: its hit, then the turn writes
/// up to the prompt's end and stores its state naming the hit's entry.
/// Returns the hit's length and the state stored (its values).
fn turn(cache: &mut PrefixCache, layout: &KvCache, n: u32, prompt: &[u32]) -> (usize, Vec<Vec<f32>>) {
    let (kv, len, lent, origin) = cache.lookup(&session(n), prompt, None, true).expect("a hit").into_parts();
    assert!(lent.is_none(), "an entry that shares blocks is not lent");
    assert_eq!(kv.geometry(), layout.geometry());
    let kv = continued(kv, prompt.len(), 10.0 * (n + 1) as f32);
    let stored = values(&kv);
    cache.insert_continuing(session(n), prompt.to_vec(), kv, origin);
    (len, stored)
}

/// Sessions that resumed from a shared prompt hold it once: each entry
/// takes the prompt's blocks by reference (the partial block its turn
/// wrote into is its own copy) and copies only its own positions; every
/// session reads back exactly what its turn held; the bytes booked are
/// the buffers held, each once, also after the shared entry goes; and
/// with every entry gone no block is left. In every KV layout.
#[test]
fn sessions_resumed_from_a_shared_prompt_hold_it_once() {
    let _device = mlx::set_default_device(mlx::Device::Cpu);
    for layout in layouts() {
        let mut cache = PrefixCache::new(64 << 20, 16, 7);
        // 216 tokens: a hit of 208, inside the prompt's fourth block.
        let shared: Vec<u32> = (0..216).map(|t| 9000 + t).collect();
        cache.insert(Scope::Shared, shared.clone(), state_in(&layout, &shared, 0.0));
        let shared_bytes = cache.stats().bytes;
        let per_position = shared_bytes / 256; // its room: 256 positions
        let mut prompts = Vec::new();
        let mut stored = Vec::new();
        for n in 0..8 {
            let prompt = [&shared[..], &(0..104).map(|t| n * 1000 + t).collect::<Vec<u32>>()].concat();
            let (len, state) = turn(&mut cache, &layout, n, &prompt);
            assert_eq!(len, 208);
            prompts.push(prompt);
            stored.push(state);
        }
        // Each session's own blocks: positions 192..320 (the copied
        // partial block and its own), not the 320 it holds.
        let s = cache.stats();
        assert_eq!((s.entries, s.lent), (9, 0));
        assert_eq!(s.bytes, shared_bytes + 8 * 128 * per_position, "{:?}", layout.codes());
        assert_eq!(cache.store.held().1, s.bytes, "booked bytes are the buffers held");
        // The next turn of each shares its last turn's blocks.
        for n in 0..8u32 {
            let mut prompt = prompts[n as usize].clone();
            prompt.extend((0..48).map(|t| n * 1000 + 500 + t));
            let (len, state) = turn(&mut cache, &layout, n, &prompt);
            assert_eq!(len, 320);
            prompts[n as usize] = prompt;
            stored[n as usize] = state;
        }
        let check = |cache: &mut PrefixCache, prompts: &[Vec<u32>], stored: &[Vec<Vec<f32>>]| {
            for (n, (prompt, state)) in prompts.iter().zip(stored).enumerate() {
                let mut asked = prompt.clone();
                asked.push(1);
                let (kv, len, ..) = cache.lookup(&session(n as u32), &asked, None, false).expect("its entry").into_parts();
                assert_eq!((len, &values(&kv)), (prompt.len(), state), "session {n}");
            }
            assert_eq!(cache.store.held().1, cache.stats().bytes);
        };
        check(&mut cache, &prompts, &stored);
        assert_eq!(cache.stats().entries, 9, "each turn replaced the one before");
        // The shared entry goes; the sessions keep its blocks, booked now to one of them.
        cache.drop_scope(&Scope::Shared);
        assert_eq!(cache.stats().entries, 8);
        check(&mut cache, &prompts, &stored);
        for n in 0..8 {
            cache.drop_scope(&session(n));
        }
        assert_eq!(cache.store.held(), (0, 0), "every block freed");
        assert_eq!(cache.stats().bytes, 0);
    }
}

/// Entries that share blocks go to the tiers as whole files (a session's
/// without the shared prompt) and come back whole; the budget counts a
/// shared block once, so sixteen sessions fit where whole copies would not.
#[test]
fn shared_blocks_are_counted_once_and_tiers_still_serve() {
    let _device = mlx::set_default_device(mlx::Device::Cpu);
    let layout = KvCache::with_keys_in_blocks(2, 2, 8, Dtype::F32);
    // Room for the shared prompt (64 KiB) and 16 sessions' own 32 KiB,
    // not for 16 copies of the prompt.
    let (_dir, cache) = tiered("paged", 1 << 10);
    let mut cache = PrefixCache { index: index::Index::new((64 + 16 * 32 + 8) << 10, 16, 7), ..cache };
    let shared: Vec<u32> = (0..216).map(|t| 9000 + t).collect();
    cache.insert(Scope::Shared, shared.clone(), state_in(&layout, &shared, 0.0));
    let mut stored = Vec::new();
    for n in 0..16 {
        let prompt = [&shared[..], &(0..104).map(|t| n * 1000 + t).collect::<Vec<u32>>()].concat();
        stored.push((prompt.clone(), turn(&mut cache, &layout, n, &prompt).1));
        cache.set_scope_live(&session(n), false);
    }
    cache.maintain();
    let s = cache.stats();
    assert_eq!((s.entries, s.evictions), (17, 0), "{s:?}");
    // Two sessions go to disk and come back whole.
    for n in [3, 11] {
        let id = cache.index.ids_of(&session(n), None)[0];
        cache.evict(id);
    }
    assert_eq!(cache.stats().disk.entries, 2);
    assert_eq!(cache.store.held().1, cache.stats().bytes);
    let shared_id = cache.index.ids_of(&Scope::Shared, None)[0];
    for n in [3, 11, 5] {
        let (prompt, state) = &stored[n as usize];
        let mut asked = prompt.clone();
        asked.push(1);
        let (kv, len, _, origin) = cache.lookup(&session(n), &asked, None, false).expect("a hit").into_parts();
        assert_eq!((len, &values(&kv)), (prompt.len(), state), "session {n}");
        // Read back from disk on top of the shared entry's first 192
        // positions, it names that entry, so its next state shares them.
        let from_disk = n != 5;
        assert_eq!(origin.map(|o| o.id) == Some(shared_id), from_disk, "session {n}: {origin:?}");
    }
    assert_eq!(cache.stats().disk.hits, 2);
    let (kv, _, _, origin) = cache.lookup(&session(3), &[&stored[3].0[..], &[1]].concat(), None, false).unwrap().into_parts();
    let before = cache.stats().bytes;
    let longer = [&stored[3].0[..], &[7; 64]].concat();
    cache.insert_continuing(session(3), longer.clone(), continued(kv, longer.len(), 5.0), origin);
    // Blocks 3..6 of its own (positions 192..384), its file superseded.
    assert_eq!(cache.stats().bytes - before, 192 * 256, "{:?}", cache.stats());
    assert_eq!(cache.store.held().1, cache.stats().bytes);
}

/// A hybrid model's cache of `tokens`: [`state`]'s KV beside a 2-layer
/// recurrent state whose every array holds `salt` plus the length it is
/// of, with checkpoints captured at the block boundaries it passed (a
/// prompt run in one step, as `state_rows.rs` keeps them).
fn hybrid(tokens: &[u32], salt: f32) -> KvCache {
    use crate::models::LayerState;
    let len = tokens.len();
    let at = |len: usize| {
        let a = Array::from_f32(&[salt + len as f32; 4], &[2, 2]).unwrap();
        LayerState { conv: a.clone(), delta: a }
    };
    let mut cache = KvCache::new(2, 2, 8, Dtype::F32).with_recurrent_layers(2);
    let kv = state(tokens, salt);
    let layers = (0..2).map(|l| kv.positions(l).unwrap().unwrap()).collect::<Vec<_>>();
    cache.fill(&layers, len, 0).unwrap();
    let state = cache.recurrent_mut().unwrap();
    for t in state.capture_points(0, len, 1) {
        (0..2).for_each(|l| state.record(l, t, at(t)));
    }
    (0..2).for_each(|l| state.set_layer(l, at(len)));
    state.thin(len);
    cache
}

/// What length a hybrid cache's state is of (see [`hybrid`]), less `salt`.
fn state_len(cache: &KvCache, salt: f32) -> usize {
    let s = cache.recurrent().unwrap().layer(1).unwrap().unwrap();
    (s.delta.to_vec_f32().unwrap()[0] - salt) as usize
}

/// A hybrid entry serves a prompt that forks inside it from its deepest
/// checkpoint at or below the fork (a match ending mid-block resumes from
/// the boundary below), all of it when the prompt holds all of it, and
/// nothing below its first checkpoint; in RAM, from the host tier and from
/// disk alike; a damaged file is a miss, never wrong state.
#[test]
fn a_hybrid_entry_serves_from_its_checkpoints_in_every_tier() {
    let tokens: Vec<u32> = (0..150).collect();
    let fork = |at: usize| tokens[..at].iter().copied().chain([9999, 9998]).collect::<Vec<u32>>();
    // (prompt, resumed length): 64 and 128 are its checkpoints.
    let asks = [(fork(150), 150), (fork(140), 128), (fork(100), 64), (fork(128), 128), (fork(63), 0)];
    for tier in ["ram", "host", "disk"] {
        let (_dir, mut cache) = tiered(&format!("hybrid-{tier}"), 1 << 10);
        if tier == "host" {
            cache = cache.with_host_tier(1 << 20);
        }
        let salt = 0.5;
        cache.insert(session(0), tokens.clone(), hybrid(&tokens, salt));
        cache.set_scope_live(&session(0), false);
        if tier != "ram" {
            // Two more sessions push it out of RAM's one entry.
            for n in 1..3 {
                cache.insert(session(n), history(n), hybrid(&history(n), 0.0));
            }
        }
        let s = cache.stats();
        if tier == "ram" {
            // Its state and both checkpoints (at 64 and 128) count in the
            // byte weighing: 3 states of 2 layers of 2 arrays of 16 bytes.
            let (kv_only, whole) = (state(&tokens, salt).nbytes(), hybrid(&tokens, salt).nbytes());
            assert_eq!((s.bytes, whole), (whole, kv_only + 3 * 2 * 2 * 16), "{s:?}");
        }
        let away = if tier == "host" { s.host.entries } else { s.disk.entries };
        assert!(tier == "ram" || away == 2, "{tier}: {s:?}");
        for (prompt, want) in &asks {
            let hit = cache.lookup(&session(0), prompt, None, false).map(snapshot);
            match (hit, want) {
                (None, 0) => {}
                (Some((kv, len)), _) => {
                    assert_eq!((len, kv.len(), state_len(&kv, salt)), (*want, *want, *want), "{tier}: a fork at {}", prompt.len() - 2);
                    assert!(!kv.recurrent().unwrap().is_rolled_back());
                }
                (None, _) => panic!("{tier}: a fork at {} missed", prompt.len() - 2),
            }
        }
        let s = cache.stats();
        assert_eq!((s.host.hits, s.disk.hits), [(0, 0), (4, 0), (0, 4)][["ram", "host", "disk"].iter().position(|t| *t == tier).unwrap()], "{tier}: {s:?}");
    }
    // A damaged file: a miss, and the entry is gone.
    let (_dir, mut cache) = tiered("hybrid-damaged", 1 << 10);
    cache.insert(session(0), tokens.clone(), hybrid(&tokens, 0.5));
    cache.set_scope_live(&session(0), false);
    for n in 1..3 {
        cache.insert(session(n), history(n), hybrid(&history(n), 0.0));
    }
    let folder = cache.tiers.disk.as_mut().unwrap().dir().to_path_buf();
    cache.tiers.disk.as_mut().unwrap().read(1).unwrap();
    let damaged = folder.join("1.kv");
    let mut bytes = std::fs::read(&damaged).unwrap();
    let last_state_byte = bytes.len() - 5;
    bytes[last_state_byte] ^= 0x40;
    std::fs::write(&damaged, bytes).unwrap();
    assert!(cache.lookup(&session(0), &fork(140), None, false).is_none(), "damaged: a miss");
    assert_eq!(cache.stats().disk.failed_reads, 1);
}
