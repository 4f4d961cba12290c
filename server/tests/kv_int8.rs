//! 8-bit KV with the real model (SmolLM2-135M on the CPU): the engine's
//! rows, read in small chunks beside each other and resumed from the prefix
//! cache, give exactly the greedy tokens the plain loop gives with the same
//! quantization (a position's codes depend on its own features only); a row
//! that turns to codes mid-stream does too; and a server refuses 8-bit KV
//! where nothing reads it.
mod common;

use common::*;
use tether::engine::{EngineConfig, EngineError, EngineEvent, EngineHandle, KvLayout, Scope, SubmitRequest};
use tether::generate::greedy_tokens;
use tether::model::{load_transformer, KvQuantization, LoadOptions};

fn prompts() -> Vec<Vec<u32>> {
    let fx = read_json("greedy/smollm2.json");
    fx["cases"].as_array().unwrap().iter().map(|c| ids(&c["prompt_ids"])).collect()
}

/// Each prompt's greedy continuation of `n` tokens through the plain loop, with `q`.
fn solo(prompts: &[Vec<u32>], q: Option<KvQuantization>, n: usize) -> Vec<Vec<u32>> {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let mut model = load_transformer(&model_path("smollm2-135m"), LoadOptions::for_device(mlx::Device::Cpu)).unwrap();
    model.set_kv_quantization(q).unwrap();
    prompts.iter().map(|p| greedy_tokens(&model, p, n).unwrap()).collect()
}

/// (generated tokens, cached prompt tokens) of one request.
async fn run(engine: &EngineHandle, req: SubmitRequest) -> (Vec<u32>, usize) {
    let mut rx = engine.submit(req).unwrap().events;
    let mut ids = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            EngineEvent::Tokens { ids: t, .. } => ids.extend(t),
            EngineEvent::Finished(f) => return (ids, f.cached_tokens),
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
            EngineEvent::Started { .. } => {}
        }
    }
    panic!("the request ended without finishing")
}

fn start_engine_with(q: Option<KvQuantization>) -> EngineHandle {
    // Small chunks and budget so prompts are read across steps, beside other rows.
    start_smollm2_engine(EngineConfig {
        kv_quantization: q,
        kv_layout: KvLayout::Rows,
        prefill_chunk: 16,
        min_prefill_chunk: 1,
        step_token_budget: 24,
        ..Default::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_bit_rows_match_the_plain_loop_and_resume_from_the_prefix_cache() {
    let q = KvQuantization { group: 64, start: 0 };
    let prompts = prompts();
    let want = solo(&prompts, Some(q), 16);
    let engine = start_engine_with(Some(q));
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (engine, p) = (engine.clone(), p.clone());
            tokio::spawn(async move { run(&engine, SubmitRequest::new(p, 16)).await })
        })
        .collect();
    for (i, (h, want)) in handles.into_iter().zip(&want).enumerate() {
        assert_eq!(&h.await.unwrap().0, want, "prompt {i} beside the others");
    }

    // A session's next turn starts from its first turn's 8-bit state.
    let (next, continued, cached, int8_bytes) = two_turns(&engine, &prompts).await;
    assert!(cached >= 16, "the second turn reused the first's state ({cached} tokens cached)");
    assert_eq!(continued, solo(&[next], Some(q), 12)[0], "resumed 8-bit state continues as a fresh 8-bit read of the whole prompt");
    // What the session keeps is codes: (64 + 8) bytes a position and head for float32's 256.
    drop(engine);
    let (_, _, _, float_bytes) = two_turns(&start_engine_with(None), &prompts).await;
    assert_eq!(int8_bytes * 256, float_bytes * 72, "the prefix cache holds the session's 8-bit state");
}

/// A session's two turns, the second extending the first: (its prompt,
/// its tokens, its cached tokens, the prefix cache's bytes after it).
async fn two_turns(engine: &EngineHandle, prompts: &[Vec<u32>]) -> (Vec<u32>, Vec<u32>, usize, usize) {
    let scoped = |prompt: Vec<u32>, n| SubmitRequest { cache_scope: Some(Scope::Session("s".into())), ..SubmitRequest::new(prompt, n) };
    let (first, _) = run(engine, scoped(prompts[0].clone(), 16)).await;
    let next: Vec<u32> = prompts[0].iter().chain(&first).chain(&prompts[1]).copied().collect();
    let (continued, cached) = run(engine, scoped(next.clone(), 12)).await;
    let bytes = engine.stats().await.expect("engine running").prefix.bytes;
    (next, continued, cached, bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_turns_to_eight_bits_mid_stream_as_the_plain_loop_does() {
    let prompts = prompts();
    // Past every prompt: rows read their prompts in float32 and turn while decoding.
    let start = prompts.iter().map(Vec::len).max().unwrap() + 5;
    let q = KvQuantization { group: 32, start };
    let want = solo(&prompts, Some(q), 24);
    let engine = start_engine_with(Some(q));
    for (i, (p, want)) in prompts.iter().zip(&want).enumerate() {
        assert_eq!(&run(&engine, SubmitRequest::new(p.clone(), 24)).await.0, want, "prompt {i}");
    }
}

#[test]
fn eight_bit_kv_needs_the_cpu_rows_that_read_it() {
    let q = Some(KvQuantization { group: 64, start: 256 });
    let batched = tether::engine::EngineHandle::start(EngineConfig { kv_quantization: q, kv_layout: KvLayout::Batched, ..Default::default() }, || {
        mlx::set_default_device(mlx::Device::Cpu)?;
        Ok(tether::loaded::LoadedModel::load_path("smollm2-135m", &model_path("smollm2-135m"), LoadOptions::for_device(mlx::Device::Cpu))?)
    });
    assert!(batched.is_err(), "8-bit KV in batched slots");
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let mut model = load_transformer(&model_path("smollm2-135m"), LoadOptions::for_device(mlx::Device::Cpu)).unwrap();
    assert!(model.set_kv_quantization(Some(KvQuantization { group: 48, start: 0 })).is_err(), "a group that does not divide the head size (64)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_counts_a_row_in_the_codes_it_will_hold() {
    // SmolLM2 (30 layers, 3 KV heads of 64) holds 46,080 bytes a token in
    // float32 and 12,960 in codes of group 64: a budget between the two
    // admits a 2,048-token request only in codes.
    let budget = 2048 * 20_000;
    let prompt = prompts()[0].clone();
    let request = || SubmitRequest::new(prompt.clone(), 2048 - prompt.len());
    let first_event = |engine: &EngineHandle| {
        let mut rx = engine.submit(request()).unwrap().events;
        async move { rx.recv().await.expect("an event") }
    };
    let codes =
        start_smollm2_engine(EngineConfig { kv_quantization: Some(KvQuantization { group: 64, start: 256 }), kv_budget_bytes: budget, ..Default::default() });
    let event = first_event(&codes).await;
    assert!(matches!(event, EngineEvent::Started { .. } | EngineEvent::Tokens { .. }), "admitted in codes: {event:?}");
    let float = start_smollm2_engine(EngineConfig { kv_budget_bytes: budget, ..Default::default() });
    let event = first_event(&float).await;
    assert!(matches!(event, EngineEvent::Failed(EngineError::OverKvBudget { .. })), "over the budget in float32: {event:?}");
}
