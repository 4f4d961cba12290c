//! The prefix cache through the real engine: a session's second turn reuses
//! its first turn's KV state, outputs stay identical, scopes are isolated,
//! the byte budget holds, dropping a scope frees its entries, and entries of
//! detached (idle) sessions are evicted before those of live ones.
mod common;

use common::*;
use tether::engine::{EngineConfig, EngineHandle, FinishInfo, KvLayout, Scope, SubmitRequest};

fn start(config: EngineConfig) -> EngineHandle {
    start_smollm2_engine(config)
}

async fn run(engine: &EngineHandle, prompt: &[u32], max_tokens: usize, scope: Option<&str>) -> (Vec<u32>, FinishInfo) {
    let req = SubmitRequest { cache_scope: scope.map(|s| Scope::Session(s.to_string())), ..SubmitRequest::new(prompt.to_vec(), max_tokens) };
    run_request(engine, req).await
}

/// A 60-token first turn (the story prompt repeated).
fn first_turn() -> Vec<u32> {
    let fx = read_json("greedy/smollm2.json");
    let p = ids(&fx["cases"][4]["prompt_ids"]);
    p.iter().copied().cycle().take(60).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_turn_hits_and_matches_uncached_output() {
    second_turn_hits_and_matches_uncached_output_with(KvLayout::Rows).await;
}

/// The same with every row in a slot of one shared KV buffer (the GPU
/// layout): a hit is copied into the row's slot, a finished turn is copied
/// out of it into the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_turn_hits_and_matches_uncached_output_in_batched_kv() {
    second_turn_hits_and_matches_uncached_output_with(KvLayout::Batched).await;
}

async fn second_turn_hits_and_matches_uncached_output_with(kv_layout: KvLayout) {
    let engine = start(EngineConfig { kv_layout, ..Default::default() });
    let turn1 = first_turn();
    let (out1, f1) = run(&engine, &turn1, 10, Some("a")).await;
    assert_eq!(f1.cached_tokens, 0);

    // Turn 2: the whole history plus a new user message.
    let mut turn2 = turn1.clone();
    turn2.extend(&out1);
    turn2.extend([198, 504, 2988]);
    let (cached, f2) = run(&engine, &turn2, 12, Some("a")).await;
    // The cache holds prompt + all but the last generated token, in 16-token blocks.
    let held = turn1.len() + out1.len() - 1;
    assert_eq!(f2.cached_tokens, held / 16 * 16, "cached {} of {}", f2.cached_tokens, turn2.len());
    let (uncached, f3) = run(&engine, &turn2, 12, None).await;
    assert_eq!(f3.cached_tokens, 0);
    assert_eq!(cached, uncached, "a cache hit must not change greedy output");

    // Isolation: the same prompt in another session finds nothing.
    let (_, other) = run(&engine, &turn2, 2, Some("b")).await;
    assert_eq!(other.cached_tokens, 0);

    // A partial hit: only the first 40 tokens are shared.
    let mut partial = turn1[..40].to_vec();
    partial.extend([28, 29, 30, 31, 32, 33, 34, 35, 36, 37]);
    let (_, fp) = run(&engine, &partial, 2, Some("a")).await;
    assert_eq!(fp.cached_tokens, 32);

    let stats = engine.stats().await.unwrap();
    assert!(stats.prefix.hits >= 2 && stats.prefix.entries >= 1, "{:?}", stats.prefix);

    engine.drop_scope(Scope::Session("a".into()));
    engine.drop_scope(Scope::Session("b".into()));
    let stats = engine.stats().await.unwrap();
    assert_eq!((stats.prefix.entries, stats.prefix.bytes), (0, 0), "{:?}", stats.prefix);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn byte_budget_holds_by_evicting() {
    // One entry of this model (30 layers x 3 KV heads x 64 x 256 positions x
    // 2 x 4 bytes) is about 11.8 MB: a 20 MB budget holds one, not three.
    let budget = 20 << 20;
    let engine = start(EngineConfig { prefix_cache_bytes: budget, ..Default::default() });
    let turn = first_turn();
    for s in ["x", "y", "z"] {
        run(&engine, &turn, 2, Some(s)).await;
        let stats = engine.stats().await.unwrap();
        assert!(stats.prefix.bytes <= budget, "{:?}", stats.prefix);
    }
    let stats = engine.stats().await.unwrap();
    assert!(stats.prefix.evictions >= 2, "{:?}", stats.prefix);
    assert_eq!(stats.prefix.entries, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_are_evicted_before_live_ones() {
    // One entry is about 11.8 MB (see above): a 30 MiB budget holds two, not three.
    let budget = 30 << 20;
    let engine = start(EngineConfig { prefix_cache_bytes: budget, ..Default::default() });
    let turn = first_turn();
    let next = |out: &[u32]| {
        let mut t = turn.clone();
        t.extend(out);
        t.extend([198, 504, 2988]);
        t
    };
    // B's turn, then A's first and second turns: A is both the most recent
    // and the most used, so by recency and frequency alone B would go first.
    let (out_b, _) = run(&engine, &turn, 4, Some("b")).await;
    let (out_a, _) = run(&engine, &turn, 4, Some("a")).await;
    let a2 = next(&out_a);
    let (_, fa) = run(&engine, &a2, 4, Some("a")).await;
    assert!(fa.cached_tokens >= 48, "A's second turn should hit: {fa:?}");
    let stats = engine.stats().await.unwrap();
    assert_eq!((stats.prefix.entries, stats.prefix.evictions), (2, 0), "{:?}", stats.prefix);

    // A's socket detaches; live C's turn needs room.
    engine.set_scope_live(Scope::Session("a".into()), false);
    let (out_c, _) = run(&engine, &turn, 4, Some("c")).await;
    let stats = engine.stats().await.unwrap();
    assert_eq!((stats.prefix.entries, stats.prefix.evictions), (2, 1), "{:?}", stats.prefix);
    assert!(stats.prefix.bytes <= budget, "{:?}", stats.prefix);

    // B and C (live) kept their histories; idle A lost its own.
    let (_, fb) = run(&engine, &next(&out_b), 2, Some("b")).await;
    assert!(fb.cached_tokens >= 48, "live B was evicted: {fb:?}");
    let (_, fc) = run(&engine, &next(&out_c), 2, Some("c")).await;
    assert!(fc.cached_tokens >= 48, "live C was not kept: {fc:?}");
    let (_, fa) = run(&engine, &a2, 2, Some("a")).await;
    assert_eq!(fa.cached_tokens, 0, "idle A should have been evicted first");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_entries_serve_every_session_and_private_ones_stay_private() {
    let engine = start(EngineConfig::default());
    // A common "system prompt", pre-warmed into the shared scope.
    let system = first_turn()[..48].to_vec();
    let shared = SubmitRequest { cache_scope: Some(Scope::Shared), ..SubmitRequest::new(system.clone(), 0) };
    let (ids, f) = run_request(&engine, shared).await;
    assert!(ids.is_empty() && f.completion_tokens == 0);

    // Two sessions start with it: both reuse the shared blocks.
    let mut a_turn = system.clone();
    a_turn.extend(first_turn()[..20].iter().rev()); // 68 tokens: a's own history reaches block 4
    let (a_out, fa) = run(&engine, &a_turn, 8, Some("a")).await;
    assert_eq!(fa.cached_tokens, 48, "session a reuses the shared system prompt");
    let mut b_turn = system.clone();
    b_turn.extend([198, 31, 32, 33]);
    let (_, fb) = run(&engine, &b_turn, 4, Some("b")).await;
    assert_eq!(fb.cached_tokens, 48, "and so does session b");

    // Session a's own history (system prompt + its turn) stays private:
    // session b asking with a's exact history gets only the shared part.
    let mut a_next = a_turn.clone();
    a_next.extend(&a_out);
    a_next.extend([198, 40]);
    let (_, fa2) = run(&engine, &a_next, 2, Some("a")).await;
    assert!(fa2.cached_tokens > 48, "a's second turn resumes its own history: {}", fa2.cached_tokens);
    let (_, fb2) = run(&engine, &a_next, 2, Some("b")).await;
    assert_eq!(fb2.cached_tokens, 48, "b must not see a's private entries");

    // Closing sessions leaves the shared entry for the next one.
    engine.drop_scope(Scope::Session("a".into()));
    engine.drop_scope(Scope::Session("b".into()));
    let (_, fc) = run(&engine, &b_turn, 2, Some("c")).await;
    assert_eq!(fc.cached_tokens, 48);
}
