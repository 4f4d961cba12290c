//! 8- and 4-bit KV with the real model (SmolLM2-135M on the CPU): a
//! session's rows, its next turn resumed from the prefix cache's codes, give
//! exactly the greedy tokens the plain loop gives taking the same steps with
//! the same quantization (a position's codes depend on its own features
//! only), and the cache keeps the codes at their size; a row that turns to
//! codes mid-stream does too; admission counts a row's bytes in codes; and
//! batched slots hold codes too.
//!
//! Rows are compared with the same row counts, not beside other rows:
//! products of 1-3 rows and of 4 or more differ in their last bits on the
//! CPU (docs/architecture.md, CPU kernels), and a last bit can move a code a
//! whole step, enough to flip a near-tie a few tokens on.
mod common;

use common::*;
use tether::engine::{EngineConfig, EngineError, EngineEvent, EngineHandle, KvLayout, Scope, SubmitRequest};
use tether::generate::{greedy_tokens, prefill};
use tether::models::{load_transformer, KvQuantization, LoadOptions};

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

/// An engine whose rows keep caches of their own in `q`'s codes; a lone
/// short prompt is read in one chunk, as the plain loop reads it.
fn start_engine_with(q: Option<KvQuantization>) -> EngineHandle {
    start_smollm2_engine(EngineConfig { kv_quantization: q, kv_layout: KvLayout::Rows, ..Default::default() })
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
async fn a_row_turns_to_codes_mid_stream_as_the_plain_loop_does() {
    let prompts = prompts();
    // Past every prompt: rows read their prompts in float32 and turn while decoding.
    let start = prompts.iter().map(Vec::len).max().unwrap() + 5;
    for bits in [8, 4] {
        let q = KvQuantization { bits, group: 32, start };
        let want = solo(&prompts, Some(q), 24);
        let engine = start_engine_with(Some(q));
        for (i, (p, want)) in prompts.iter().zip(&want).enumerate() {
            assert_eq!(&run(&engine, SubmitRequest::new(p.clone(), 24)).await.0, want, "{bits} bits, prompt {i}");
        }
    }
}

#[test]
fn codes_need_a_group_dividing_the_head_and_8_or_4_bits() {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let mut model = load_transformer(&model_path("smollm2-135m"), LoadOptions::for_device(mlx::Device::Cpu)).unwrap();
    for batched in [false, true] {
        let mut set = |q| if batched { model.set_batched_kv_quantization(Some(q)) } else { model.set_kv_quantization(Some(q)) };
        assert!(set(KvQuantization { bits: 8, group: 48, start: 0 }).is_err(), "a group that does not divide the head size (64)");
        assert!(set(KvQuantization { bits: 3, group: 64, start: 0 }).is_err(), "3 bits");
    }
}

/// Batched slots (the GPU's layout, here on the CPU through the same ops)
/// hold codes from a slot's first position: a session's state reaches the
/// prefix cache as codes, at their size, and its next turn resumes from
/// them; 8-bit codes decode as full precision does, token for token, on
/// all but near-ties.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_slots_keep_a_sessions_codes_and_decode_as_full_precision_does() {
    let prompts = prompts();
    let batched = |q| start_smollm2_engine(EngineConfig { kv_quantization: q, kv_layout: KvLayout::Batched, ..Default::default() });
    let float = batched(None);
    let (_, _, _, float_bytes) = two_turns(&float, &prompts).await;
    let mut float_tokens = Vec::new();
    for p in &prompts {
        float_tokens.push(run(&float, SubmitRequest::new(p.clone(), 16)).await.0);
    }
    drop(float);
    for bits in [8, 4] {
        // The start is for rows of their own; a slot holds codes throughout.
        let engine = batched(Some(KvQuantization { bits, group: 64, start: 256 }));
        let (_, _, cached, code_bytes) = two_turns(&engine, &prompts).await;
        assert_eq!(code_bytes * 256, float_bytes * (8 * bits as usize + 8), "the prefix cache holds the session's {bits}-bit state");
        assert!(cached >= 16, "{bits} bits: the second turn resumed from the first's codes ({cached} tokens cached)");
        if bits == 8 {
            let mut same = 0;
            for (p, want) in prompts.iter().zip(&float_tokens) {
                same += usize::from(&run(&engine, SubmitRequest::new(p.clone(), 16)).await.0 == want);
            }
            assert!(same + 1 >= prompts.len(), "8 bits: {same} of {} prompts decode as full precision", prompts.len());
        }
    }
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
    let codes = start_smollm2_engine(EngineConfig {
        kv_quantization: Some(KvQuantization { bits: 8, group: 64, start: 256 }),
        kv_budget_bytes: budget,
        ..Default::default()
    });
    let event = first_event(&codes).await;
    assert!(matches!(event, EngineEvent::Started { .. } | EngineEvent::Tokens { .. }), "admitted in codes: {event:?}");
    let float = start_smollm2_engine(EngineConfig { kv_budget_bytes: budget, ..Default::default() });
    let event = first_event(&float).await;
    assert!(matches!(event, EngineEvent::Failed(EngineError::OverKvBudget { .. })), "over the budget in float32: {event:?}");
}

/// Step for step: a lone session's rows (its prompt in one chunk, then one
/// token a step, then its next turn's new tokens in one chunk over the
/// cached prefix) against the plain loop taking the same steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_turns_in_codes_match_the_plain_loop_step_for_step() {
    let prompts = prompts();
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let mut model = load_transformer(&model_path("smollm2-135m"), LoadOptions::for_device(mlx::Device::Cpu)).unwrap();
    let session = |q: Option<KvQuantization>| {
        let engine = start_engine_with(q);
        let prompts = prompts.clone();
        async move { two_turns(&engine, &prompts).await }
    };
    let (_, _, _, float_bytes) = session(None).await;
    for bits in [8, 4] {
        let q = KvQuantization { bits, group: 64, start: 0 };
        let (next, continued, cached, code_bytes) = session(Some(q)).await;
        // What the session keeps is codes: (64 * bits / 8 + 8) bytes a position and head for float32's 256.
        assert_eq!(code_bytes * 256, float_bytes * (8 * bits as usize + 8), "the prefix cache holds the session's {bits}-bit state");
        assert!(cached >= 16, "{bits} bits: the second turn reused the first's state ({cached} tokens cached)");

        model.set_kv_quantization(Some(q)).unwrap();
        let mut cache = model.new_cache();
        let logits = prefill(&model, &mut cache, &prompts[0], 512).unwrap();
        let first = greedy_from(&model, &mut cache, logits, 16);
        assert_eq!(&next[prompts[0].len()..prompts[0].len() + 16], &first[..], "{bits} bits: the first turn");
        cache.truncate(cached);
        let logits = prefill(&model, &mut cache, &next[cached..], 512).unwrap();
        assert_eq!(continued, greedy_from(&model, &mut cache, logits, 12), "{bits} bits: the turn resumed from the session's codes");
    }
}
