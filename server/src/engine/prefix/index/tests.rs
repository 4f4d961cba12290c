//! The index under 100,000 random operations over a tiny vocabulary (as
//! TGI's radix-trie test does), checked after every one against the
//! invariants in the module doc and against brute force over the entries.
//! The operations are the ones the cache composes: insert (replacement,
//! room from idle sessions, the new entry), lookup, moves between RAM and
//! the tiers, an entry reweighed (shared blocks rebooked), removal, a scope dropped, a session going idle or live, and
//! moka's maintenance. The sequence is fixed by the seed; moka's own
//! choices may vary between runs (its hasher is seeded at random), and the
//! invariants must hold for any of them.
use super::super::test_rng::Rng;
use super::*;

const SEED: u64 = 0x7e74_e2c0_ffee_0049;
const OPERATIONS: usize = 100_000;
/// Two-token blocks over three token ids: prompts share prefixes, fork and
/// collide at every length.
const BLOCK: usize = 2;
const VOCAB: u64 = 3;
const MAX_TOKENS: usize = 10;
/// Room for a handful of entries of 1-5 KiB.
const BUDGET_BYTES: usize = 16 << 10;

/// The index's draws on the tests' generator.
trait Draws {
    fn scope(&mut self) -> Scope;
    fn tokens(&mut self, max: usize) -> Vec<u32>;
    fn pick(&mut self, ids: &[EntryId]) -> Option<EntryId>;
}

impl Draws for Rng {
    fn scope(&mut self) -> Scope {
        match self.below(4) {
            0 => Scope::Shared,
            n => Scope::Session(format!("s{n}")),
        }
    }

    fn tokens(&mut self, max: usize) -> Vec<u32> {
        (0..self.below(max + 1)).map(|_| (self.next() % VOCAB) as u32).collect()
    }

    fn pick(&mut self, ids: &[EntryId]) -> Option<EntryId> {
        (!ids.is_empty()).then(|| ids[self.below(ids.len())])
    }
}

#[test]
fn random_operations_keep_the_invariants() {
    let mut rng = Rng(SEED);
    let mut index = Index::new(BUDGET_BYTES, BLOCK, 7);
    let mut idle: HashSet<Scope> = HashSet::new();
    let (mut hits, mut replaced, mut evicted) = (0, 0, 0);
    for op in 0..OPERATIONS {
        let what = rng.below(100);
        match what {
            0..30 => {
                let (scope, tokens) = (rng.scope(), rng.tokens(MAX_TOKENS));
                replaced += insert(&mut rng, &mut index, scope, tokens);
            }
            30..55 => hits += usize::from(lookup(&mut rng, &mut index)),
            55..65 => {
                if let Some(id) = rng.pick(&index.ids_in(Some(Place::Ram))) {
                    leave_ram(&mut rng, &mut index, id);
                }
            }
            65..68 => {
                if let Some(id) = rng.pick(&index.ids_in(None).into_iter().filter(|id| !index.in_ram(*id)).collect::<Vec<_>>()) {
                    let bytes = 1 + rng.below(5 << 10);
                    index.move_to(id, Place::Ram, bytes);
                }
            }
            // Another entry sharing blocks left: one in RAM is booked for more (or less).
            68..70 => {
                if let Some(id) = rng.pick(&index.ids_in(None)) {
                    let (place, bytes) = (index.get(id).unwrap().place, rng.below(5 << 10));
                    index.reweigh(id, bytes);
                    let expected = if place == Place::Ram { bytes } else { index.get(id).unwrap().bytes };
                    assert_eq!(index.get(id).unwrap().bytes, expected, "op {op}: only an entry in RAM is reweighed");
                }
            }
            70..75 => {
                let place = if rng.one_in(2) { Place::Host } else { Place::Disk };
                let oldest = index.entries.iter().filter(|(_, e)| e.place == place).min_by_key(|(_, e)| e.since).map(|(id, _)| *id);
                assert_eq!(index.oldest(place), oldest, "op {op}: the oldest in {place:?}");
                if let Some(id) = oldest.filter(|_| place == Place::Host) {
                    index.move_to(id, Place::Disk, 1 + rng.below(2048));
                }
            }
            75..80 => {
                if let Some(id) = rng.pick(&index.ids_in(None)) {
                    assert!(index.remove(id).is_some());
                    assert!(index.get(id).is_none() && index.remove(id).is_none());
                }
            }
            80..85 => {
                let scope = rng.scope();
                index.set_scope_live(&scope, true);
                idle.remove(&scope);
                for id in index.ids_of(&scope, None) {
                    index.remove(id);
                }
                assert!(index.entries.values().all(|e| e.scope != scope), "op {op}: {scope:?} dropped");
            }
            85..95 => {
                let (scope, live) = (rng.scope(), rng.one_in(2));
                index.set_scope_live(&scope, live);
                if live || scope == Scope::Shared {
                    idle.remove(&scope);
                } else {
                    idle.insert(scope);
                }
            }
            _ => evicted += maintain(&mut rng, &mut index, op),
        }
        assert_eq!(index.idle, idle, "op {op}: the idle scopes");
        check(&index, op);
    }
    // The run reached the cases it is meant to check.
    assert!(hits > OPERATIONS / 20 && replaced > OPERATIONS / 100 && evicted > OPERATIONS / 200, "hits {hits}, replaced {replaced}, evicted {evicted}");
}

/// Inserts `tokens` as the cache does, checking the entries replaced and
/// the room made; returns how many entries it replaced.
fn insert(rng: &mut Rng, index: &mut Index, scope: Scope, tokens: Vec<u32>) -> usize {
    let bytes = 1 + rng.below(5 << 10);
    let earliest_truncation = if rng.one_in(8) { rng.below(tokens.len() + 1) } else { 0 };
    // Below that, some lengths it serves too (a hybrid model's state
    // checkpoints: at block boundaries, or anywhere a turn's prompt ended).
    let checkpoints: Vec<usize> = (1..earliest_truncation).filter(|_| rng.one_in(3)).collect();
    let new = index.keyed(scope.clone(), tokens.clone());
    if new.is_empty() {
        assert!(tokens.len() < BLOCK);
        return 0;
    }
    let whole = |e: &Entry| e.tokens[..e.keys.len() * BLOCK].to_vec();
    let mut expected: Vec<EntryId> = (index.entries.iter()).filter(|(_, e)| e.scope == scope && tokens.starts_with(&whole(e))).map(|(id, _)| *id).collect();
    expected.sort_unstable();
    let replaced = index.replaced_by(&new);
    assert_eq!(replaced, expected, "replaced: the entries of {scope:?} whose every whole block {tokens:?} holds");
    for id in &replaced {
        index.remove(*id);
    }
    let victims = index.room_for(bytes);
    check_room(index, &victims, bytes);
    for id in victims {
        leave_ram(rng, index, id);
    }
    let id = index.insert(new, bytes, earliest_truncation, checkpoints);
    assert!(index.in_ram(id) && replaced.iter().all(|old| index.get(*old).is_none()));
    replaced.len()
}

/// Room for `bytes` comes from idle sessions' entries in RAM, least
/// recently used first, and no more of them than it takes.
fn check_room(index: &Index, victims: &[EntryId], bytes: usize) {
    let capacity = (BUDGET_BYTES / WEIGHT_UNIT) as u64;
    let idle_in_ram: Vec<(u64, EntryId)> = {
        let mut v: Vec<_> =
            (index.entries.iter()).filter(|(_, e)| e.place == Place::Ram && index.idle.contains(&e.scope)).map(|(id, e)| (e.used, *id)).collect();
        v.sort_unstable();
        v
    };
    assert_eq!(victims, &idle_in_ram.iter().take(victims.len()).map(|(_, id)| *id).collect::<Vec<_>>(), "the least recent idle entries, in order");
    let held_after = |n: usize| index.ram_kib + u64::from(kib(bytes)) - victims[..n].iter().map(|id| u64::from(index.entries[id].kib)).sum::<u64>();
    if held_after(victims.len()) > capacity {
        assert_eq!(victims.len(), idle_in_ram.len(), "every idle entry goes when they cannot free enough");
    }
    if !victims.is_empty() {
        assert!(held_after(victims.len() - 1) > capacity, "one victim fewer would have fit: too many");
    }
}

/// A random lookup checked against brute force; a hit is counted (touched)
/// at random, as the cache counts the hits it serves. Whether it hit.
fn lookup(rng: &mut Rng, index: &mut Index) -> bool {
    let (scope, prompt, ram_only) = (rng.scope(), rng.tokens(MAX_TOKENS + 2), rng.one_in(3));
    let found = index.best_match(&scope, &prompt, ram_only);
    let own = brute_longest(index, &scope, &prompt, ram_only);
    let shared = if scope == Scope::Shared { None } else { brute_longest(index, &Scope::Shared, &prompt, ram_only) };
    let expected = match (own, shared) {
        (Some(a), Some(b)) if b.1 > a.1 => Some(b),
        (a, b) => a.or(b),
    };
    assert_eq!(found, expected, "{scope:?} {prompt:?} ram_only {ram_only}");
    let usable = prompt.len().saturating_sub(1);
    for e in index.entries.values().filter(|e| e.scope == scope || e.scope == Scope::Shared) {
        let full = e.keys.len() * BLOCK;
        if full <= usable && prompt.starts_with(&e.tokens[..full]) && e.earliest_truncation <= full && (!ram_only || e.place == Place::Ram) {
            assert!(found.is_some_and(|(_, len)| len >= full), "an entry whose every whole block the prompt holds is found, or a longer one");
        }
    }
    if let Some((id, len)) = found {
        let e = &index.entries[&id];
        let aligned_or_whole = len % BLOCK == 0 || (len == e.tokens.len() && e.earliest_truncation > len / BLOCK * BLOCK) || e.checkpoints.contains(&len);
        let servable = e.earliest_truncation <= len || len == e.tokens.len() || e.checkpoints.contains(&len);
        assert!(aligned_or_whole && servable && len < prompt.len() && e.tokens[..len] == prompt[..len] && (e.scope == scope || e.scope == Scope::Shared));
        if rng.one_in(2) {
            index.touch(id);
        }
    }
    found.is_some()
}

/// The match in `scope` by comparing tokens over every key in the map
/// (not by walking the prompt's own hash chain): of the keys whose block
/// the prompt holds, the longest that serves, at its block-aligned length
/// or, for an entry that cannot be cut back that far, at its whole length
/// when the prompt holds all of its tokens, else at its longest checkpoint
/// at or past that length that the prompt holds.
fn brute_longest(index: &Index, scope: &Scope, prompt: &[u32], ram_only: bool) -> Option<(EntryId, usize)> {
    let usable = prompt.len().saturating_sub(1);
    let mut held: Vec<(usize, EntryId)> = Vec::new();
    for (key, id) in &index.keys {
        let e = &index.entries[id];
        let len = (e.keys.iter().position(|k| k == key).expect("checked: entries list their keys") + 1) * BLOCK;
        if e.scope == *scope && len <= usable && e.tokens[..len] == prompt[..len] && (!ram_only || e.place == Place::Ram) {
            held.push((len, *id));
        }
    }
    held.sort_unstable_by(|a, b| b.cmp(a));
    held.into_iter().find_map(|(len, id)| {
        let e = &index.entries[&id];
        let whole = e.tokens.len();
        let holds = |end: usize| end <= usable && prompt.starts_with(&e.tokens[..end]);
        match e.earliest_truncation <= len {
            true => Some((id, len)),
            false if e.earliest_truncation <= whole && holds(whole) => Some((id, whole)),
            false => e.checkpoints.iter().filter(|&&c| c >= len && holds(c)).max().map(|&c| (id, c)),
        }
    })
}

/// Moves entry `id` out of RAM as an eviction does: to the host tier, to
/// disk (with a file of a random size) or gone.
fn leave_ram(rng: &mut Rng, index: &mut Index, id: EntryId) {
    match rng.below(3) {
        0 => index.move_to(id, Place::Host, 1 + rng.below(2048)),
        1 => index.move_to(id, Place::Disk, 1 + rng.below(2048)),
        _ => drop(index.remove(id)),
    }
    assert!(!index.in_ram(id));
}

/// moka's choices, then the budget: afterwards RAM is within it. Returns
/// how many entries left RAM.
fn maintain(rng: &mut Rng, index: &mut Index, op: usize) -> usize {
    let mut evicted = 0;
    for id in index.policy_victims() {
        if index.in_ram(id) {
            leave_ram(rng, index, id);
            evicted += 1;
        }
    }
    for id in index.over_budget() {
        assert!(index.in_ram(id));
        leave_ram(rng, index, id);
        evicted += 1;
    }
    assert!(index.booked(Place::Ram).1 <= BUDGET_BYTES, "op {op}: RAM within its budget");
    evicted
}

/// The invariants of the module doc.
fn check(index: &Index, op: usize) {
    for (key, id) in &index.keys {
        assert!(index.entries.get(id).is_some_and(|e| e.keys.contains(key)), "op {op}: key {key:x} points at entry {id}, which does not list it");
    }
    let mut booked = [(0, 0); 3];
    let mut ram_kib = 0;
    for (id, e) in &index.entries {
        assert_eq!(e.keys, index.block_keys(&e.scope, &e.tokens), "op {op}: entry {id}'s keys are its chain");
        assert_eq!(e.keys.last().and_then(|k| index.keys.get(k)), Some(id), "op {op}: entry {id}'s last block points at it");
        let (count, bytes) = &mut booked[e.place as usize];
        (*count, *bytes) = (*count + 1, *bytes + e.bytes);
        ram_kib += if e.place == Place::Ram { u64::from(e.kib) } else { 0 };
        assert!(e.place == Place::Ram || !index.policy.contains_key(id), "op {op}: entry {id} out of RAM is out of the policy");
    }
    assert_eq!((index.booked, index.ram_kib), (booked, ram_kib), "op {op}: booked bytes are the entries' sums");
    for (older_id, older) in &index.entries {
        let whole = &older.tokens[..older.keys.len() * BLOCK];
        let held = index.entries.iter().find(|(id, e)| *id > older_id && e.scope == older.scope && e.tokens.starts_with(whole));
        assert!(held.is_none(), "op {op}: entry {older_id} should have been replaced by {:?}", held.map(|(id, _)| id));
    }
    for (id, _) in index.policy.iter() {
        assert!(index.in_ram(*id), "op {op}: the policy holds only entries in RAM");
    }
    assert!(!index.idle.contains(&Scope::Shared));
}

impl Index {
    /// Every entry's id (in `place` only, when given), in id order.
    fn ids_in(&self, place: Option<Place>) -> Vec<EntryId> {
        let mut ids: Vec<EntryId> = self.entries.iter().filter(|(_, e)| place.is_none_or(|p| e.place == p)).map(|(id, _)| *id).collect();
        ids.sort_unstable();
        ids
    }
}
