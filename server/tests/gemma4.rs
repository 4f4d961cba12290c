//! Gemma 4 (GGUF `gemma4`) on random weights of its real layout, against
//! the independent numpy forward of `tests/reference/gemma4.py`. No
//! checkpoint of the family reaches this machine, so the script writes a
//! small GGUF from a seed at test time (about 80 MB, Qwen2.5's tokenizer)
//! with the expected logits and greedy tokens, and these tests load it as
//! a user's model would be loaded. The model has every feature of the
//! dense family on: window and whole-history layers of different head
//! sizes and KV head counts, values from the keys' projection, proportional
//! RoPE, KV-shared layers, per-layer inputs, output scales, capped logits.
//! Then rows: several decoding together equal each alone; through the
//! engine a session's resumed turn and drafted decoding equal plain
//! decoding; over HTTP a chat's second turn equals a fresh request.
mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use common::*;
use serde_json::Value;
use tether::engine::speculate::{DraftKind, Speculation};
use tether::engine::{EngineConfig, EngineHandle, KvLayout, Scope, SubmitRequest};
use tether::generate::{greedy_tokens, prefill};
use tether::models::{load_transformer, LoadOptions, Transformer};

/// The numpy oracle computes in float64; ours in float32 (measured: see
/// the test's output, a few 1e-5 on logits of spread ~8).
const MAX_ABS_ERROR: f32 = 1e-3;

fn generated() -> &'static (PathBuf, Value) {
    static MODEL: OnceLock<(PathBuf, Value)> = OnceLock::new();
    MODEL.get_or_init(|| generated_reference("gemma4.py", "gemma4-random.gguf"))
}

fn load() -> Transformer {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    load_transformer(&generated().0, LoadOptions::for_device(mlx::Device::Cpu)).unwrap()
}

#[test]
fn logits_and_greedy_tokens_match_the_numpy_reference() {
    let model = load();
    let (_, expect) = generated();
    let prompt = ids(&expect["prompt_ids"]);

    // The whole prompt at once: every position's logits.
    let (worst, last) = whole_prompt_logits_error(&model, expect);
    eprintln!("gemma4: logits max abs error {worst:.2e} over the first positions and the last");
    assert!(worst < MAX_ABS_ERROR, "logits differ by {worst} from the reference");

    // Greedy tokens, up to the first step whose margin is within the bar.
    let want = ids(&expect["greedy_ids"]);
    let margins = floats(&expect["margins"]);
    let clear = margins.iter().position(|&m| m < 2.0 * MAX_ABS_ERROR).unwrap_or(want.len());
    let got = greedy_tokens(&model, &prompt, want.len()).unwrap();
    eprintln!("gemma4: greedy {}/{} equal, first {clear} compared", got.iter().zip(&want).filter(|(a, b)| a == b).count(), want.len());
    assert_eq!(got[..clear], want[..clear], "greedy tokens (clear margins for {clear} steps)");

    // In chunks of 5 and token by token, then greedy on: a cache grown a
    // few tokens at a time holds room for fewer positions, so its window
    // layers drop their oldest positions (a window of 12) on the way.
    for chunk in [5, 1] {
        let mut cache = model.new_cache();
        let logits = prefill(&model, &mut cache, &prompt, chunk).unwrap();
        let err = max_abs(&logits.to_vec_f32().unwrap(), &last);
        eprintln!("gemma4: chunks of {chunk}: last logits max abs error {err:.2e}");
        assert!(err < MAX_ABS_ERROR, "chunks of {chunk}: last logits differ by {err}");
        let got = greedy_from(&model, &mut cache, logits, want.len());
        assert_eq!(got[..clear], want[..clear], "chunks of {chunk}: greedy tokens");
        assert!(cache.window_first() > 0, "chunks of {chunk}: the window layers moved past their first positions");
    }
}

/// A row's cache holds buffers for the layers with KV of their own only,
/// each of its layer's shape: the KV-shared layers store nothing.
#[test]
fn kv_shared_layers_hold_nothing_and_layers_keep_their_shapes() {
    let model = load();
    let c = &model.config;
    assert_eq!((c.n_layers, c.kv_layers()), (7, 5), "the last two layers share earlier layers' KV");
    // Window layers: 2 KV heads of 32; whole-history ones: 1 of 64.
    assert_eq!(c.kv_shapes(), [(2, 32), (2, 32), (1, 64), (2, 32), (1, 64)]);
    assert_eq!(c.kv_bytes_per_token(4), 2 * (3 * 64 + 2 * 64) * 4);
    let prompt = ids(&generated().1["prompt_ids"]);
    let mut cache = model.new_cache();
    mlx::eval(&[&model.forward(&prompt, &mut cache, 1).unwrap()]).unwrap();
    let held: Vec<(usize, usize)> = (0..5).map(|l| cache.positions(l).unwrap().map(|(k, _)| (k.dim(1), k.dim(3))).unwrap()).collect();
    assert_eq!(held, c.kv_shapes());
    assert_eq!(cache.layer_shapes(), c.kv_shapes());
}

/// Three rows of different prompts read and decode in the same forwards,
/// each with its own caches, and give what each gives alone.
#[test]
fn rows_decoding_together_equal_each_alone() {
    let model = load();
    let prompt = ids(&generated().1["prompt_ids"]);
    let prompts = [prompt.clone(), prompt[5..].to_vec(), prompt[..9].iter().rev().copied().collect::<Vec<_>>()];
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| greedy_tokens(&model, p, 12).unwrap()).collect();

    let together = greedy_rows_together(&model, &prompts, 12);
    assert_eq!(together, alone, "rows beside each other must decode as alone");
}

fn start_engine_on(path: PathBuf, config: EngineConfig) -> EngineHandle {
    EngineHandle::start(config, move || {
        mlx::set_default_device(mlx::Device::Cpu)?;
        Ok(tether::loaded::LoadedModel::load_path("gemma4-random", &path, LoadOptions::for_device(mlx::Device::Cpu))?)
    })
    .unwrap()
}

fn request(prompt: &[u32], max_tokens: usize, session: Option<&str>) -> SubmitRequest {
    SubmitRequest { cache_scope: session.map(|s| Scope::Session(s.to_string())), ..SubmitRequest::new(prompt.to_vec(), max_tokens) }
}

/// Through the engine: concurrent rows each as alone, a session's next
/// turns resume from the prefix cache (window layers and all) and give
/// what plain decoding of the whole history gives, and drafted decoding
/// (its rejected drafts rolled back) gives the same tokens as without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_drafts_and_concurrent_rows_through_the_engine() {
    let model = load();
    let engine = start_engine_on(generated().0.clone(), EngineConfig { kv_layout: KvLayout::Rows, ..Default::default() });
    let prompt = ids(&generated().1["prompt_ids"]); // 200 tokens

    let (a, b) = (prompt.clone(), prompt[3..].to_vec());
    let (ra, rb) = tokio::join!(run_request(&engine, request(&a, 10, None)), run_request(&engine, request(&b, 10, None)));
    assert_eq!(ra.0, greedy_tokens(&model, &a, 10).unwrap());
    assert_eq!(rb.0, greedy_tokens(&model, &b, 10).unwrap());

    // Three turns of a session, each past the window of 12: every later
    // turn resumes what the earlier stored and equals plain decoding.
    let mut history = prompt.clone();
    for (turn, extra) in [[198u32, 785, 3974], [198, 11, 12], [13, 14, 15]].iter().enumerate() {
        let (out, f) = run_request(&engine, request(&history, 12, Some("s"))).await;
        assert_eq!(out, greedy_tokens(&model, &history, 12).unwrap(), "turn {turn}");
        if turn > 0 {
            assert!(f.cached_tokens >= 32, "turn {turn} resumes the stored turn (cached {})", f.cached_tokens);
        }
        history.extend(&out);
        history.extend(extra);
    }

    // Drafts verified in the step, right ones accepted and the rejected
    // ones rolled back out of every layer holding KV (windows included):
    // plain decoding's tokens. The drafts are plain decoding's own with two
    // of them wrong.
    let plain = greedy_tokens(&model, &history, 16).unwrap();
    let mut drafts = plain.clone();
    drafts[4] ^= 1;
    drafts[9] ^= 1;
    let forced = SubmitRequest { speculation: Speculation { kind: DraftKind::Forced(drafts), ..Default::default() }, ..request(&history, 16, None) };
    let (drafted, f) = run_request(&engine, forced).await;
    let stats = f.speculative.expect("a drafting row reports its drafts");
    assert!(stats.accepted > 0 && stats.accepted < stats.drafted, "some drafts accepted, some rejected: {stats:?}");
    assert_eq!(drafted, plain, "drafted decoding must equal plain decoding");
}

/// A model with KV-shared layers cannot be served from batched KV slots
/// (one shape for every layer): the engine says so at start.
#[test]
fn batched_kv_slots_are_refused() {
    let path = generated().0.clone();
    let config = EngineConfig { kv_layout: KvLayout::Batched, ..Default::default() };
    let err = EngineHandle::start(config, move || {
        mlx::set_default_device(mlx::Device::Cpu)?;
        Ok(tether::loaded::LoadedModel::load_path("gemma4-random", &path, LoadOptions::for_device(mlx::Device::Cpu))?)
    })
    .err()
    .expect("refused");
    assert!(err.to_string().contains("--kv-layout rows"), "{err}");
}

/// The server, with the file's own chat template: a chat's second turn
/// (the tenant's own cache consulted) gives what another tenant's fresh
/// request with the whole history gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_turn_over_http_equals_a_fresh_request() {
    let path = generated().0.clone();
    let engine = start_engine_on(path.clone(), EngineConfig { kv_layout: KvLayout::Rows, ..Default::default() });
    assert_a_chat_turn_equals_a_fresh_request(engine, &path, "gemma4-random").await;
}

/// The prefix cache's host tier: a session's entry, too large for the
/// RAM's budget, goes to the host tier as a file, but is not restored from
/// it yet (the file holds one shape for every layer; Gemma 4's differ):
/// its next turn is computed afresh, never from a misread state, and
/// equals plain decoding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_pushed_to_the_host_tier_is_recomputed_exactly() {
    let model = load();
    let config = EngineConfig { kv_layout: KvLayout::Rows, prefix_cache_bytes: 64 << 10, kv_host_bytes: 64 << 20, ..Default::default() };
    let engine = start_engine_on(generated().0.clone(), config);
    let prompt = ids(&generated().1["prompt_ids"]);
    let (out, _) = run_request(&engine, request(&prompt, 8, Some("a"))).await;
    let stats = engine.stats().await.unwrap();
    assert!(stats.prefix.host.entries == 1 && stats.prefix.entries == 0, "the entry went to the host tier: {:?}", stats.prefix);
    let mut turn2: Vec<u32> = prompt.iter().chain(&out).copied().collect();
    turn2.extend([198, 11, 12]);
    let (resumed, f) = run_request(&engine, request(&turn2, 8, Some("a"))).await;
    assert_eq!(resumed, greedy_tokens(&model, &turn2, 8).unwrap());
    assert_eq!(f.cached_tokens, 0, "not restored from the host tier yet");
}
