//! Idle sessions' KV state on disk, over real sockets with the real model:
//! a server whose RAM budget holds one session's history writes the others'
//! to its disk tier; a session that comes back reads its own back (its
//! next turn hits the cache) and continues exactly as it would have had its
//! state stayed in RAM; other sessions never see it; and when the sessions
//! close, RAM, the tier and its folder are empty again. In full precision
//! and in 8-bit codes (whose files hold the codes as the cache does), and
//! after a system prompt kept in the shared scope (whose positions the
//! sessions' files leave out, to be taken from the shared entry); and with
//! a host tier in front of the disk, which keeps such files in memory.
mod ws_harness;

use std::time::Duration;

use serde_json::{json, Value};
use tether::engine::{DiskTierConfig, EngineConfig, EngineHandle, EngineStats};
use tether::loaded::LoadedModel;
use tether::models::KvQuantization;
use tether::server::ServerConfig;
use ws_harness::*;

/// One session's two turns: the second sends the whole conversation again.
const QUESTIONS: [&str; 4] = [
    "Tell me about the moon in three sentences.",
    "Name three rivers of Europe and say one thing about each.",
    "Describe how bread is baked, step by step.",
    "What makes a good chess opening? Explain briefly.",
];

/// A system prompt of ~190 tokens that every session of one test starts with.
const SYSTEM: &str = "You are a patient teacher for curious adults. Answer in plain words, one idea at a time, \
    and never use jargon without explaining it first. When a question has several parts, answer each part \
    in the order asked. When you are unsure, say so, and say what would settle it. Prefer concrete examples \
    from everyday life: kitchens, gardens, bicycles, weather, markets and trains. Keep every answer short \
    enough to read aloud in a minute, and end with one question the reader could explore next on their own. \
    If the reader seems to have misread an earlier answer, gently restate it before going on. Numbers should \
    come with a sense of scale, such as how long, how heavy or how far compared with something familiar.";

/// The conversation's messages, after `system` when there is one.
fn messages(system: Option<&str>, turns: &[(&str, &str)]) -> Vec<Value> {
    let system = system.map(|s| json!({"role": "system", "content": s}));
    system.into_iter().chain(turns.iter().map(|(role, content)| json!({"role": role, "content": content}))).collect()
}

fn turn_one(system: Option<&str>, q: &str) -> Value {
    json!({"messages": messages(system, &[("user", q)]), "max_tokens": 24, "temperature": 0})
}

fn turn_two(system: Option<&str>, q: &str, answer: &str) -> Value {
    let turns = [("user", q), ("assistant", answer), ("user", "Now say it again in one short sentence.")];
    json!({"messages": messages(system, &turns), "max_tokens": 24, "temperature": 0})
}

/// (text, cached prompt tokens) of one request on `c`.
async fn ask(c: &mut Client, id: &str, body: Value) -> (String, u64) {
    c.generate(id, body).await;
    let out = c.collect(id).await;
    (out.text(), u64::from(out.done().usage.cached_tokens))
}

async fn stats(engine: &EngineHandle) -> EngineStats {
    engine.stats().await.expect("engine running")
}

async fn wait_for(engine: &EngineHandle, what: &str, done: impl Fn(&EngineStats) -> bool) -> EngineStats {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let s = stats(engine).await;
        if done(&s) {
            return s;
        }
        assert!(tokio::time::Instant::now() < deadline, "waited for {what}: {:?}", s.prefix);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn start_engine(config: EngineConfig) -> EngineHandle {
    EngineHandle::start(config, || Ok(LoadedModel::load(MODEL, tether::models::LoadOptions::for_device(mlx::default_device()))?)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_go_to_disk_and_come_back_exactly() {
    // One SmolLM2 history (30 layers, 256 positions of capacity) is ~11.8 MB:
    // 20 MB of RAM holds one, so the others go to disk.
    sessions_go_to_disk_and_come_back_exactly(None, 20 << 20, None, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_of_eight_bit_kv_go_to_disk_and_come_back_exactly() {
    // In 8-bit codes from the first token a history is 72/256 of float32's
    // (~3.3 MB): 5.6 MB of RAM holds one.
    sessions_go_to_disk_and_come_back_exactly(Some(KvQuantization { bits: 8, group: 64, start: 0 }), 5_600_000, None, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_after_a_shared_system_prompt_file_only_their_own_part() {
    // The shared prompt's entry (~11.8 MB, 256 positions of capacity) and
    // one session's own blocks (it shares the prompt's first two: positions
    // 128..256, ~5.9 MB) fit in 20 MiB, two sessions' do not; the other
    // sessions go to disk as their positions past the shared prompt's first
    // 128 (whole key blocks): about half a history each.
    sessions_go_to_disk_and_come_back_exactly(None, 20 << 20, Some(SYSTEM), 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_in_the_host_tier_come_back_exactly() {
    // As above, with 8 MB of host tier: it keeps one session's file (about
    // 6 MB) in memory, and the others go on to disk.
    sessions_go_to_disk_and_come_back_exactly(None, 20 << 20, Some(SYSTEM), 8 << 20).await;
}

/// Sessions of a server whose RAM holds `ram_bytes` of history (about one
/// session's) detach, go to disk and come back, against a server with the
/// same KV layout that keeps them all hot. With `system`, every
/// conversation starts with that system prompt, which both servers first
/// keep in the shared scope. With `host_bytes`, a host tier of that many
/// bytes keeps what it can of the evicted state before the disk.
async fn sessions_go_to_disk_and_come_back_exactly(kv_quantization: Option<KvQuantization>, ram_bytes: usize, system: Option<&str>, host_bytes: usize) {
    let h = harness_for(MODEL, &[]);
    let folder = std::env::temp_dir().join(format!("tether-ws-kv-disk-{}-{}-{}", std::process::id(), kv_quantization.is_some(), system.is_some()));
    let folder = folder.with_extension(format!("host{host_bytes}"));
    let _ = std::fs::remove_dir_all(&folder);
    let tiered = start_engine(EngineConfig {
        prefix_cache_bytes: ram_bytes,
        kv_host_bytes: host_bytes,
        kv_disk: Some(DiskTierConfig { dir: folder.clone(), budget_bytes: 512 << 20 }),
        kv_quantization,
        ..EngineConfig::default()
    });
    let tiered_server = h.start_with_engines(ServerConfig::default(), tiered.clone().into()).await;
    // The same conversations on an engine with 1 GiB of RAM: hot.
    let hot_server = h.start_with_engines(ServerConfig::default(), start_engine(EngineConfig { kv_quantization, ..EngineConfig::default() }).into()).await;
    if let Some(system) = system {
        for server in [&tiered_server, &hot_server] {
            let mut c = server.client().await;
            c.open().await;
            let shared = json!({"messages": messages(Some(system), &[]), "max_tokens": 0, "cache": "shared"});
            ask(&mut c, "shared", shared).await;
            c.send(&json!({"type": "session.close"})).await;
        }
    }
    let shared_cached = |cached: u64| if system.is_some() { cached >= 128 } else { cached == 0 };

    // Every session takes its first turn and detaches (its socket drops):
    // idle sessions' state is the first to leave RAM.
    let mut sessions = Vec::new();
    for (i, q) in QUESTIONS.iter().enumerate() {
        let mut c = tiered_server.client().await;
        let ready = c.open().await;
        let (answer, cached) = ask(&mut c, &format!("t1-{i}"), turn_one(system, q)).await;
        assert!(shared_cached(cached), "only the shared prompt is cached (cached {cached})");
        c.drop_connection();
        sessions.push((ready, answer, cached));
    }
    let held_out = |s: &EngineStats| s.prefix.disk.entries + s.prefix.host.entries;
    let s = wait_for(&tiered, "the idle sessions' state out of RAM", |s| held_out(s) >= QUESTIONS.len() - 1).await;
    assert!(s.prefix.bytes <= ram_bytes, "RAM within its budget: {:?}", s.prefix);
    assert!(s.prefix.host.bytes <= host_bytes, "the host tier within its budget: {:?}", s.prefix);
    assert!(host_bytes == 0 || s.prefix.host.entries >= 1, "the host tier holds what fits: {:?}", s.prefix);
    assert!(s.prefix.disk.bytes > 0 && s.prefix.disk.writes >= 2, "{:?}", s.prefix);
    let files = || std::fs::read_dir(&folder).unwrap().flat_map(|d| std::fs::read_dir(d.unwrap().path()).unwrap()).count();
    // The tier writes on a thread of its own: an entry counts as on disk
    // once it is queued, its file appears when written.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while files() < s.prefix.disk.entries && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(files() >= s.prefix.disk.entries, "one file per entry on disk");
    if system.is_some() {
        let per_file = (s.prefix.disk.bytes + s.prefix.host.bytes) / held_out(&s);
        assert!(per_file < 7 << 20, "files hold the sessions' own positions only: {per_file} bytes a file");
    }

    // Isolation across tiers: a new session asking session 0's first turn
    // finds nothing (its state is private, wherever it is).
    let mut stranger = tiered_server.client().await;
    stranger.open().await;
    let (_, cached) = ask(&mut stranger, "stranger", turn_one(system, QUESTIONS[0])).await;
    assert_eq!(cached, sessions[0].2, "another session's state on disk never serves a stranger, only what is shared");
    stranger.send(&json!({"type": "session.close"})).await;

    // Each session comes back (in another order) and takes its second turn:
    // the cache serves its history from disk, and the text is what a server
    // that kept it in RAM writes.
    let mut from_disk = 0;
    let mut from_host = 0;
    for i in [2, 0, 3, 1] {
        let (ready, answer, shared_len) = &sessions[i];
        let before = stats(&tiered).await.prefix;
        let mut c = tiered_server.client().await;
        assert!(c.resume(&ready.session_id, &ready.resume_token, json!({})).await.resumed);
        let (text, cached) = ask(&mut c, &format!("t2-{i}"), turn_two(system, QUESTIONS[i], answer)).await;
        assert!(cached >= shared_len + 16, "session {i}'s second turn hits its own history (cached {cached})");
        let after = stats(&tiered).await.prefix;
        from_disk += usize::from(after.disk.hits > before.disk.hits);
        from_host += usize::from(after.host.hits > before.host.hits);
        c.send(&json!({"type": "session.close"})).await;

        let mut hot = hot_server.client().await;
        hot.open().await;
        let (hot_answer, _) = ask(&mut hot, "t1", turn_one(system, QUESTIONS[i])).await;
        assert_eq!(&hot_answer, answer);
        let (hot_text, hot_cached) = ask(&mut hot, "t2", turn_two(system, QUESTIONS[i], answer)).await;
        assert_eq!(hot_cached, cached, "the same history is served hot");
        assert_eq!(text, hot_text, "session {i}: from disk, the same greedy continuation as hot");
        hot.send(&json!({"type": "session.close"})).await;
    }
    let s = stats(&tiered).await.prefix;
    assert!(
        from_disk + from_host >= 3 && s.disk.failed_reads == 0 && s.host.failed == 0,
        "{from_disk} + {from_host} of 4 sessions served from disk and host: {s:?}"
    );
    assert!(host_bytes == 0 || from_host >= 1, "the host tier served: {s:?}");

    // Every session closed: nothing left in RAM (but the shared prompt), on
    // disk, or in the folder.
    let kept = usize::from(system.is_some());
    let s = wait_for(&tiered, "the closed sessions' state to go", |s| s.prefix.entries == kept && held_out(s) == 0).await;
    assert_eq!(s.prefix.disk.bytes, 0, "{:?}", s.prefix);
    assert!(system.is_some() || s.prefix.bytes == 0, "{:?}", s.prefix);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while files() > 0 {
        assert!(std::time::Instant::now() < deadline, "files left behind");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tiered.shutdown_and_join();
    assert!(!folder.read_dir().unwrap().any(|_| true), "the tier's folder goes with its engine");
    let _ = std::fs::remove_dir_all(&folder);
}
