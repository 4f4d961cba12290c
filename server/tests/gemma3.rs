//! Gemma 3 270M, whose local layers attend within a 512-token window and
//! keep only that window: the engine's greedy tokens against the numpy
//! reference's (tests/fixtures/greedy/gemma3-270m.json, one prompt longer
//! than the window) in every way a row runs: alone and beside others, in
//! row caches and in batched KV slots, with speculation off and on; and a
//! session four windows long whose window layers hold about a window while
//! its next tokens equal a full recompute, through the prefix cache too.
mod common;

use common::*;
use tether::engine::speculate::{DraftKind, Speculation};
use tether::engine::{EngineConfig, KvLayout, Scope, SubmitRequest};
use tether::generate::prefill;
use tether::models::{load_transformer, LoadOptions};

const MODEL: &str = "gemma3-270m";

struct Case {
    name: String,
    prompt: Vec<u32>,
    greedy: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let fx = read_json("greedy/gemma3-270m.json");
    fx["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case { name: c["name"].as_str().unwrap().to_string(), prompt: ids(&c["prompt_ids"]), greedy: ids(&c["greedy_ids"]) })
        .collect()
}

fn request(case: &Case, draft: &Option<DraftKind>) -> SubmitRequest {
    let speculation = match draft {
        Some(kind) => Speculation { kind: kind.clone(), max_draft: 6, ..Default::default() },
        None => Speculation { kind: DraftKind::Off, max_draft: 0, ..Default::default() },
    };
    SubmitRequest { speculation, ..SubmitRequest::new(case.prompt.clone(), case.greedy.len()) }
}

/// Every case alone, then all at once, each compared with the reference.
async fn cases_match_reference(config: EngineConfig, draft: Option<DraftKind>) {
    let kv_layout = config.kv_layout;
    let cases = cases();
    let window = 512;
    assert!(cases.iter().any(|c| c.prompt.len() > window + 100), "a prompt past the window");
    // Small chunks: the long prompt crosses the window in several steps.
    let engine = start_engine(MODEL, EngineConfig { prefill_chunk: 128, ..config });
    let mut failures = Vec::new();
    for case in &cases {
        let (got, _) = run_request(&engine, request(case, &draft)).await;
        if got != case.greedy {
            failures.push(format!("alone {}: got {got:?}, want {:?}", case.name, case.greedy));
        }
    }
    let together: Vec<_> = cases.iter().map(|case| engine.submit(request(case, &draft)).unwrap().events).collect();
    for (case, events) in cases.iter().zip(together) {
        let got = collect_tokens(events).await;
        if got != case.greedy {
            failures.push(format!("together {}: got {got:?}, want {:?}", case.name, case.greedy));
        }
    }
    assert!(failures.is_empty(), "{kv_layout:?}, drafts {draft:?}:\n{}", failures.join("\n"));
}

async fn collect_tokens(mut events: tokio::sync::mpsc::Receiver<tether::engine::EngineEvent>) -> Vec<u32> {
    use tether::engine::EngineEvent;
    let mut ids = Vec::new();
    while let Some(ev) = events.recv().await {
        match ev {
            EngineEvent::Tokens { ids: t, .. } => ids.extend(t),
            EngineEvent::Finished(_) => return ids,
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
            EngineEvent::Started { .. } => {}
        }
    }
    panic!("the engine dropped the request without a final event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_caches_match_reference() {
    cases_match_reference(EngineConfig { kv_layout: KvLayout::Rows, ..Default::default() }, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_caches_with_echo_drafts_match_reference() {
    cases_match_reference(EngineConfig { kv_layout: KvLayout::Rows, ..Default::default() }, Some(DraftKind::Echo)).await;
}

/// The GPU's layout, run on the CPU: window layers in slots of their own size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_slots_match_reference() {
    cases_match_reference(EngineConfig { kv_layout: KvLayout::Batched, ..Default::default() }, None).await;
}

/// With no room for shared scores, every slot bringing more than one
/// token (a prompt chunk, a verification) attends alone over its own slot
/// (`KvBatch::write_slot`, MLX's attention with a window mask).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_slots_with_echo_drafts_attending_alone_match_reference() {
    cases_match_reference(EngineConfig { kv_layout: KvLayout::Batched, shared_attention_scores: 1, ..Default::default() }, Some(DraftKind::Echo)).await;
}

/// A history of four windows and more, built turn by turn (a 100-token
/// message, 8 tokens of reply): the local layers' buffers stay about a
/// window however long it grows, and the next tokens after it equal those
/// of the whole history computed afresh.
#[test]
fn a_session_four_windows_long_keeps_a_window_and_matches_a_recompute() {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let model = load_transformer(&model_path(MODEL), LoadOptions::for_device(mlx::Device::Cpu)).unwrap();
    let window = model.config.sliding_window.expect("gemma3 has local layers").size;
    let local_layers = model.config.layer_windows().iter().filter(|w| w.is_some()).count();
    let per_position = 2 * model.config.n_kv_heads * model.config.head_dim * 4;
    let text: Vec<u32> = cases().into_iter().flat_map(|c| c.prompt).collect();

    let mut history: Vec<u32> = Vec::new();
    let mut cache = model.new_cache();
    let mut most_window_bytes = 0;
    let mut turn = 0;
    while history.len() < 4 * window + 100 {
        let message: Vec<u32> = text.iter().cycle().skip(turn * 100).take(100).copied().collect();
        let mut logits = prefill(&model, &mut cache, &message, 64).unwrap();
        history.extend(&message);
        for _ in 0..8 {
            let next = logits.argmax(-1, false).unwrap().to_vec_i32().unwrap()[0] as u32;
            history.push(next);
            logits = model.forward(&[next], &mut cache, 1).unwrap();
        }
        assert_eq!(cache.len(), history.len());
        most_window_bytes = most_window_bytes.max(cache.window_nbytes());
        turn += 1;
    }
    // A window, the rollback margin and a key block of alignment, the chunk
    // being read, the room between moves and a key block of rounding
    // (kv_cache.rs): well under what the whole history takes, and the same
    // at any length.
    let bound = local_layers * per_position * (window + 64 + 64 + 64 + 128 + 64);
    println!(
        "history {} tokens: window layers held at most {most_window_bytes} bytes ({} positions each), the whole history would take {}",
        history.len(),
        most_window_bytes / (local_layers * per_position),
        local_layers * per_position * history.len()
    );
    assert!(most_window_bytes <= bound, "window layers held {most_window_bytes} bytes, bound {bound}");
    assert!(history.len() >= 4 * window && 2 * most_window_bytes < local_layers * per_position * history.len(), "the history is several windows long");

    let last = *history.last().unwrap();
    let continued = greedy_after(&model, &mut cache, last, 16);
    let mut fresh = model.new_cache();
    prefill(&model, &mut fresh, &history, 512).unwrap();
    let recomputed = greedy_after(&model, &mut fresh, last, 16);
    assert_eq!(continued, recomputed, "a long session's next tokens equal a full recompute");
}

/// `n` greedy tokens after a cache's history, whose last token is `last`:
/// that token is rolled back and run again for its logits, so both caches
/// take the same path from there.
fn greedy_after(model: &tether::models::Transformer, cache: &mut tether::models::KvCache, last: u32, n: usize) -> Vec<u32> {
    cache.truncate(cache.len() - 1);
    let logits = model.forward(&[last], cache, 1).unwrap();
    greedy_from(model, cache, logits, n)
}

/// The same over the engine, 8 turns of 300 tokens and 8 of reply: each turn of a session continues from its
/// last turn's KV state in the prefix cache (window layers and all), and
/// the last turn's reply equals the reply to the whole history sent cold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_turns_past_the_window_reuse_the_prefix_cache() {
    for kv_layout in [KvLayout::Rows, KvLayout::Batched] {
        let engine = start_engine(MODEL, EngineConfig { kv_layout, ..Default::default() });
        let text: Vec<u32> = cases().into_iter().flat_map(|c| c.prompt).collect();
        let scope = Some(Scope::Session("long".into()));
        let mut history = vec![2u32];
        let mut last = Vec::new();
        for turn in 0..8 {
            let before = history.len();
            history.extend(text.iter().cycle().skip(turn * 300).take(300));
            let req = SubmitRequest { cache_scope: scope.clone(), ..SubmitRequest::new(history.clone(), 8) };
            let (out, finish) = run_request(&engine, req).await;
            if turn > 0 {
                // All but its last reply token, to a 16-token block.
                assert!(finish.cached_tokens + 16 >= before, "{kv_layout:?} turn {turn} re-read its history: cached {} of {before}", finish.cached_tokens);
            }
            history.extend(&out);
            last = out;
        }
        assert!(history.len() > 4 * 512);
        let cold = engine.submit(SubmitRequest::new(history[..history.len() - 8].to_vec(), 8)).unwrap().events;
        assert_eq!(collect_tokens(cold).await, last, "{kv_layout:?}: the reply from the cache equals the cold one");
    }
}
