//! Speculative decode rows on the real model: drafts verified in the batched
//! forward never change greedy output, whatever the draft source, batch size
//! or position of the first wrong draft; the KV cache rolls back exactly.
mod common;

use common::*;
use tether::engine::speculate::{DraftKind, DraftModelSpec, SpecStats, Speculation};
use tether::engine::{EngineConfig, EngineHandle, Finish, FinishInfo, KvLayout, Scope, SubmitRequest};
use tether::generate::greedy_tokens;
use tether::models::{load_transformer, LoadOptions};
use tether::sample::SamplingParams;

const GEN: usize = 24;

fn speculating(prompt: Vec<u32>, max_tokens: usize, kind: DraftKind, max_draft: usize) -> SubmitRequest {
    SubmitRequest { speculation: Speculation { kind, max_draft, ..Default::default() }, ..SubmitRequest::new(prompt, max_tokens) }
}

async fn run(engine: &EngineHandle, req: SubmitRequest) -> (Vec<u32>, FinishInfo) {
    run_request(engine, req).await
}

/// Fixture prompts, each followed by a repeat of itself so that prompt
/// lookup has something to copy (the model tends to keep repeating).
fn prompts() -> Vec<Vec<u32>> {
    let fx = read_json("greedy/smollm2.json");
    fx["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let p = ids(&c["prompt_ids"]);
            let mut r = p.clone();
            r.extend(&p);
            r.extend(&p[..p.len() / 2]);
            r
        })
        .collect()
}

fn solo_greedy(prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let model = load_transformer(&model_path("smollm2-135m"), LoadOptions::for_device(mlx::Device::Cpu)).unwrap();
    prompts.iter().map(|p| greedy_tokens(&model, p, n).unwrap()).collect()
}

fn spec(f: &FinishInfo) -> &SpecStats {
    f.speculative.as_ref().expect("a speculating request reports its stats")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_drafts_keep_greedy_output_alone_and_batched() {
    echo_drafts_keep_greedy_output_with(KvLayout::Rows).await;
}

/// Verification in batched KV slots (the GPU layout): rows with different
/// draft counts are padded to the longest in one forward.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_drafts_keep_greedy_output_in_batched_kv() {
    echo_drafts_keep_greedy_output_with(KvLayout::Batched).await;
}

async fn echo_drafts_keep_greedy_output_with(kv_layout: KvLayout) {
    let prompts = prompts();
    let want = solo_greedy(&prompts, GEN);
    let engine = start_smollm2_engine(EngineConfig { prefill_chunk: 32, min_prefill_chunk: 1, kv_layout, ..Default::default() });

    // Alone: one row per step.
    let mut accepted = 0;
    for (p, want) in prompts.iter().zip(&want) {
        let (got, f) = run(&engine, speculating(p.clone(), GEN, DraftKind::Echo, 8)).await;
        assert_eq!(&got, want, "echo alone differs from greedy");
        assert_eq!(f.reason, Finish::Length);
        let s = spec(&f);
        assert!(s.accepted <= s.drafted);
        assert_eq!(s.decode_tokens as usize, GEN - 1, "every token after the first comes from a decode forward");
        accepted += s.accepted;
    }
    assert!(accepted > 0, "the repeated prompts must let echo drafts land");

    // Batched: every prompt at once, speculating and plain rows mixed, so
    // one forward carries rows with different numbers of drafts.
    let mut tasks = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let kind = if i % 3 == 2 { DraftKind::Off } else { DraftKind::Echo };
        let req = speculating(p.clone(), GEN, kind, 4 + i);
        let engine = engine.clone();
        tasks.push(tokio::spawn(async move { run(&engine, req).await }));
    }
    for (t, want) in tasks.into_iter().zip(&want) {
        let (got, _) = t.await.unwrap();
        assert_eq!(&got, want, "echo batched differs from greedy");
    }
    let stats = engine.stats().await.unwrap();
    assert!(stats.accepted_draft_tokens > 0 && stats.accepted_draft_tokens <= stats.drafted_tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_draft_at_any_position_rolls_back_exactly() {
    a_wrong_draft_rolls_back_exactly_with(KvLayout::Rows).await;
}

/// The same with the rows' caches in batched KV slots: a slot rolls back
/// alone, and a finished slot's cache comes out whole for the next turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_draft_at_any_position_rolls_back_exactly_in_batched_kv() {
    a_wrong_draft_rolls_back_exactly_with(KvLayout::Batched).await;
}

async fn a_wrong_draft_rolls_back_exactly_with(kv_layout: KvLayout) {
    let prompt = prompts().remove(0);
    let n = 20;
    let want = solo_greedy(std::slice::from_ref(&prompt), n).remove(0);
    let engine = start_smollm2_engine(EngineConfig { kv_layout, ..Default::default() });

    // Forced drafts are the true continuation with generated token `wrong`
    // replaced. Forced drafts start at full depth, so the first verification
    // (after generated token 0) offers tokens 1..=8 and must reject draft
    // position `wrong - 1` and everything after it, roll the cache back and
    // carry on from the target's own token. All variants run at once, in
    // one batch, so rows with different rollbacks share every forward.
    let max_draft = 8;
    let mut tasks = Vec::new();
    for wrong in 1..=max_draft {
        let mut forced = want.clone();
        forced[wrong] = forced[wrong].wrapping_add(1) % 49152;
        let req = speculating(prompt.clone(), n, DraftKind::Forced(forced), max_draft);
        let engine = engine.clone();
        tasks.push(tokio::spawn(async move { (wrong, run(&engine, req).await) }));
    }
    for t in tasks {
        let (wrong, (got, f)) = t.await.unwrap();
        assert_eq!(got, want, "wrong draft at generated token {wrong}: output changed");
        let s = spec(&f);
        assert!(s.accepted < s.drafted, "wrong draft at {wrong} was never rejected: {s:?}");
        let pos = wrong - 1;
        assert!(s.accepted_at[pos] < s.offered_at[pos], "no rejection at draft position {pos}: {s:?}");
        assert!(s.tokens_per_forward() > 1.0, "correct drafts must save forwards: {s:?}");
    }

    // All drafts right: every verification accepts everything it offered.
    let (got, f) = run(&engine, speculating(prompt.clone(), n, DraftKind::Forced(want.clone()), max_draft)).await;
    assert_eq!(got, want);
    let s = spec(&f);
    assert_eq!(s.accepted, s.drafted);
    assert!(s.decode_forwards < (n - 1) as u64 / 2, "{s:?}");

    // A turn that ends with rejected drafts leaves a cache entry holding
    // exactly its tokens: the next turn resumes from it with the same output.
    let scope = Scope::Session("spec-rollback".into());
    let mut forced = want.clone();
    forced[5] ^= 1;
    let req = SubmitRequest { cache_scope: Some(scope.clone()), ..speculating(prompt.clone(), n, DraftKind::Forced(forced), max_draft) };
    let (first, _) = run(&engine, req).await;
    let mut next = prompt.clone();
    next.extend(&first);
    next.extend(&prompt[..8]);
    let plain = solo_greedy(std::slice::from_ref(&next), 8).remove(0);
    let (again, f) = run(&engine, SubmitRequest { cache_scope: Some(scope), ..SubmitRequest::new(next.clone(), 8) }).await;
    assert!(f.cached_tokens > prompt.len(), "turn 2 must reuse turn 1: cached {}", f.cached_tokens);
    assert_eq!(again, plain);
}

/// A seed fixes a sampled request's tokens whatever drafts it verifies:
/// each position draws with its own key, so the request with echo drafts,
/// with shallower drafts, without drafts, alone or beside others, emits the
/// same tokens (the draft depth follows measured step times, so it differs
/// from run to run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_rows_speculate_reproducibly() {
    let prompt = prompts().remove(1);
    let engine = start_smollm2_engine(EngineConfig::default());
    let sampling = SamplingParams { temperature: 0.7, seed: Some(11), ..Default::default() };
    let with = |kind: DraftKind, depth: usize| SubmitRequest { sampling: sampling.clone(), ..speculating(prompt.clone(), GEN, kind, depth) };
    let (want, f) = run(&engine, with(DraftKind::Off, 0)).await;
    assert_eq!(want.len(), GEN);
    assert!(f.speculative.is_none_or(|s| s.drafted == 0));
    let (alone, f) = run(&engine, with(DraftKind::Echo, 8)).await;
    assert_eq!(alone, want, "echo drafts changed a seeded sample");
    assert!(spec(&f).drafted > 0);
    let mut tasks = Vec::new();
    for (kind, depth) in [(DraftKind::Echo, 8), (DraftKind::Echo, 2), (DraftKind::Off, 0)] {
        let (engine, req) = (engine.clone(), with(kind, depth));
        tasks.push(tokio::spawn(async move { run(&engine, req).await }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().0, want, "a seeded sample changed beside other rows");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_max_tokens_prewarms_the_cache() {
    let prompt = prompts().remove(2);
    let engine = start_smollm2_engine(EngineConfig::default());
    let scope = Scope::Session("prewarm".into());
    let req = SubmitRequest { cache_scope: Some(scope.clone()), ..SubmitRequest::new(prompt.clone(), 0) };
    let (ids, f) = run(&engine, req).await;
    assert!(ids.is_empty());
    assert_eq!((f.reason, f.completion_tokens, f.prompt_tokens), (Finish::Length, 0, prompt.len()));
    let mut next = prompt.clone();
    next.extend(&prompt[..5]);
    let (_, f) = run(&engine, SubmitRequest { cache_scope: Some(scope), ..SubmitRequest::new(next, 4) }).await;
    assert_eq!(f.cached_tokens, prompt.len() / 16 * 16, "the pre-warmed prompt serves the next request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_model_keeps_greedy_output_alone_and_batched() {
    // The target is SmolLM2's GGUF; the draft is the same model requantized
    // by mlx-lm to 4 bits in groups of 64 (bench/peer/setup.sh): the same
    // tokenizer, close but not identical predictions, so drafts are mostly
    // accepted and sometimes rolled back.
    let prompts = prompts();
    let want = solo_greedy(&prompts, GEN);
    let draft = DraftModelSpec { path: peer_dir("smollm2-135m-mlx4"), options: LoadOptions::for_device(mlx::Device::Cpu) };
    let engine = start_smollm2_engine(EngineConfig { draft_model: Some(draft), ..Default::default() });
    assert!(engine.info().draft_model.is_some());

    for (p, want) in prompts.iter().zip(&want).take(2) {
        let (got, f) = run(&engine, speculating(p.clone(), GEN, DraftKind::Model, 6)).await;
        assert_eq!(&got, want, "draft model alone differs from greedy");
        let s = spec(&f);
        assert!(s.drafted > 0 && s.accepted > 0, "{s:?}");
    }
    let mut tasks = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let kind = [DraftKind::Model, DraftKind::Echo, DraftKind::Off][i % 3].clone();
        let req = speculating(p.clone(), GEN, kind, 3 + i);
        let engine = engine.clone();
        tasks.push(tokio::spawn(async move { run(&engine, req).await }));
    }
    for (t, want) in tasks.into_iter().zip(&want) {
        let (got, _) = t.await.unwrap();
        assert_eq!(&got, want, "draft model batched differs from greedy");
    }
}
