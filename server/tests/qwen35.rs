//! Qwen3.5 (GGUF `qwen35`: Gated DeltaNet layers beside gated attention
//! ones) on random weights of its real layout, against the independent
//! numpy forward of `tests/reference/qwen35.py`. No checkpoint of the
//! family reaches this machine, so the script writes a small GGUF from a
//! seed at test time (about 90 MB, Qwen2.5's tokenizer) with the expected
//! logits and greedy tokens, and these tests load it as a user's model
//! would be loaded. Then state rows: several rows decoding together equal
//! each alone, and through the engine a session's second turn equals a
//! fresh request with the whole history (resumed where the stored state is
//! exactly: a prompt holding the whole stored turn, or a state checkpoint
//! at a 64-token block boundary below the fork, also from the host tier
//! and disk; a damaged file is computed afresh), with drafts off; and over
//! HTTP a chat's second turn equals another tenant's fresh request.
mod common;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::*;
use serde_json::Value;
use tether::engine::speculate::{DraftKind, DraftModel, DraftModelSpec, Speculation};
use tether::engine::{DiskTierConfig, EngineConfig, EngineHandle, KvLayout, Scope, SubmitRequest};
use tether::generate::{greedy_tokens, prefill};
use tether::models::{load_transformer, LoadOptions, Transformer};

/// The numpy oracle computes in float64; ours in float32 (measured: 1.5e-5
/// on logits of spread ~8).
const MAX_ABS_ERROR: f32 = 1e-3;

/// The generated model and the oracle's expectations (once per test binary;
/// see [`generated_reference`]).
fn generated() -> &'static (PathBuf, Value) {
    static MODEL: OnceLock<(PathBuf, Value)> = OnceLock::new();
    MODEL.get_or_init(|| generated_reference("qwen35.py", "qwen35-random.gguf"))
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
    eprintln!("qwen35: logits max abs error {worst:.2e} over the first positions and the last");
    assert!(worst < MAX_ABS_ERROR, "logits differ by {worst} from the reference");

    // In chunks of 5 (the state carried between forwards) and token by token.
    for chunk in [5, 1] {
        let mut cache = model.new_cache();
        let got = prefill(&model, &mut cache, &prompt, chunk).unwrap().to_vec_f32().unwrap();
        assert!(max_abs(&got, &last) < MAX_ABS_ERROR, "chunks of {chunk}: last logits differ");
    }

    // Greedy tokens, up to the first step whose margin is within the bar.
    let want = ids(&expect["greedy_ids"]);
    let margins = floats(&expect["margins"]);
    let clear = margins.iter().position(|&m| m < 2.0 * MAX_ABS_ERROR).unwrap_or(want.len());
    let got = greedy_tokens(&model, &prompt, want.len()).unwrap();
    assert_eq!(got[..clear], want[..clear], "greedy tokens (clear margins for {clear} steps)");
}

/// Three rows of different prompts read and decode in the same forwards,
/// each with its own recurrent state, and give what each gives alone.
#[test]
fn rows_decoding_together_equal_each_alone() {
    let model = load();
    let prompt = ids(&generated().1["prompt_ids"]);
    let prompts = [prompt.clone(), prompt[5..].to_vec(), prompt[..9].iter().rev().copied().collect::<Vec<_>>()];
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| greedy_tokens(&model, p, 12).unwrap()).collect();

    let together = greedy_rows_together(&model, &prompts, 12);
    assert_eq!(together, alone, "rows beside each other must decode as alone");
}

/// A cache with recurrent state cut back below its length refuses to run
/// on (its row fails), and is never a prefix-cache entry's state again.
#[test]
fn rolled_back_state_refuses_to_run() {
    let model = load();
    let prompt = ids(&generated().1["prompt_ids"]);
    let mut cache = model.new_cache();
    mlx::eval(&[&model.forward(&prompt, &mut cache, 1).unwrap()]).unwrap();
    assert_eq!(cache.earliest_truncation(), prompt.len(), "state holds its own length only");
    cache.truncate(prompt.len() - 2);
    assert_eq!(cache.earliest_truncation(), usize::MAX);
    assert!(model.forward(&prompt[prompt.len() - 2..], &mut cache, 1).is_err(), "a rolled-back state must not run on");
}

/// A hybrid model cannot be a draft model: a draft's cache is cut back
/// after every verification.
#[test]
fn a_hybrid_model_is_refused_as_a_draft_model() {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let spec = DraftModelSpec { path: generated().0.clone(), options: LoadOptions::for_device(mlx::Device::Cpu) };
    let err = DraftModel::load(&spec, 151_936).err().expect("refused");
    assert!(err.to_string().contains("recurrent state"), "{err}");
}

fn start_engine_on(path: PathBuf) -> EngineHandle {
    start_engine_with(path, EngineConfig { kv_layout: KvLayout::Rows, ..Default::default() })
}

fn start_engine_with(path: PathBuf, config: EngineConfig) -> EngineHandle {
    EngineHandle::start(config, move || {
        mlx::set_default_device(mlx::Device::Cpu)?;
        Ok(tether::loaded::LoadedModel::load_path("qwen35-random", &path, LoadOptions::for_device(mlx::Device::Cpu))?)
    })
    .unwrap()
}

fn request(prompt: &[u32], max_tokens: usize, session: Option<&str>) -> SubmitRequest {
    SubmitRequest { cache_scope: session.map(|s| Scope::Session(s.to_string())), ..SubmitRequest::new(prompt.to_vec(), max_tokens) }
}

/// The server: a chat's second turn (the tenant's own cache consulted)
/// gives what another tenant's fresh request with the whole history gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_turn_over_http_equals_a_fresh_request() {
    let path = generated().0.clone();
    let engine = start_engine_on(path.clone());
    assert_a_chat_turn_equals_a_fresh_request(engine, &path, "qwen35-random").await;
}

/// Through the engine: concurrent rows each keep their own state, a
/// session's next turn gives what a fresh request with the whole history
/// gives (resuming where a state is kept exactly: the stored turn's whole
/// length, or a checkpoint below the fork), and a request asking for
/// drafts drafts and gives the same tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_and_concurrent_rows_through_the_engine() {
    let model = load();
    let engine = start_engine_on(generated().0.clone());
    let prompt = ids(&generated().1["prompt_ids"]); // 24 tokens

    // Two rows at once, each as alone.
    let (a, b) = (prompt.clone(), prompt[3..].to_vec());
    let (ra, rb) = tokio::join!(run_request(&engine, request(&a, 10, None)), run_request(&engine, request(&b, 10, None)));
    assert_eq!(ra.0, greedy_tokens(&model, &a, 10).unwrap());
    assert_eq!(rb.0, greedy_tokens(&model, &b, 10).unwrap());

    // Turn 1: 24 prompt tokens and 9 generated, so the stored state is at
    // 24 + 9 - 1 = 32, a whole number of 16-token blocks: turn 2 resumes it.
    let (out1, f1) = run_request(&engine, request(&prompt, 9, Some("s"))).await;
    assert_eq!(f1.cached_tokens, 0);
    let mut turn2 = prompt.clone();
    turn2.extend(&out1);
    turn2.extend([198, 785, 3974]);
    let (resumed, f2) = run_request(&engine, request(&turn2, 12, Some("s"))).await;
    assert_eq!(f2.cached_tokens, 32, "the state at exactly 32 tokens resumes");
    let (fresh, f3) = run_request(&engine, request(&turn2, 12, None)).await;
    assert_eq!(f3.cached_tokens, 0);
    assert_eq!(resumed, fresh, "a resumed turn must equal a fresh one");

    // Turn 3 carries all of turn 2: it resumes at the stored state's own
    // length, 36 + 12 - 1 = 47, off the 16-token blocks.
    let mut turn3: Vec<u32> = turn2.iter().chain(&resumed).copied().collect();
    turn3.extend([198, 11, 12]);
    let (resumed3, f4) = run_request(&engine, request(&turn3, 8, Some("s"))).await;
    assert_eq!(f4.cached_tokens, 47, "the whole stored state resumes");
    assert_eq!(resumed3, greedy_tokens(&model, &turn3, 8).unwrap());

    // A fork inside what turn 3 stored, past turn 2's prompt: turn 2's
    // state where its prompt ended (36 tokens) was kept for just this (a
    // checkpoint off the 64-token blocks), so it resumes there.
    let mut fork: Vec<u32> = turn3[..40].to_vec();
    fork.extend([11, 12, 13]);
    let (forked, f5) = run_request(&engine, request(&fork, 8, Some("s"))).await;
    assert_eq!(f5.cached_tokens, 36, "the state where turn 2's prompt ended");
    assert_eq!(forked, greedy_tokens(&model, &fork, 8).unwrap());

    // Drafts asked for: they run, and the tokens are plain decoding's.
    let echo = SubmitRequest { speculation: Speculation { kind: DraftKind::Echo, ..Default::default() }, ..request(&fork, 8, None) };
    let (echoed, f6) = run_request(&engine, echo).await;
    assert_eq!(echoed, forked);
    assert!(f6.speculative.is_some(), "a row with recurrent state drafts");
}

/// Prompt-lookup drafts on a hybrid model give plain decoding's tokens:
/// each verification keeps the state after every position, and a rejected
/// draft rewinds to the state after the last accepted token. A prompt
/// that repeats itself, so drafts are offered, accepted and rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafts_on_a_hybrid_model_give_plain_decodings_tokens() {
    let model = load();
    let engine = start_engine_on(generated().0.clone());
    let base = ids(&generated().1["prompt_ids"]);
    let prompt: Vec<u32> = base.iter().chain(&base).chain(&base[..12]).copied().collect();
    let plain = greedy_tokens(&model, &prompt, 40).unwrap();
    // Its own output repeated, too: the second request drafts from it.
    let echo = |prompt: &[u32]| SubmitRequest { speculation: Speculation { kind: DraftKind::Echo, ..Default::default() }, ..request(prompt, 40, None) };
    let (got, f) = run_request(&engine, echo(&prompt)).await;
    assert_eq!(got, plain, "drafts must not change the tokens");
    let again: Vec<u32> = prompt.iter().chain(&plain).chain(&prompt).copied().collect();
    let (got2, f2) = run_request(&engine, echo(&again)).await;
    assert_eq!(got2, greedy_tokens(&model, &again, 40).unwrap());
    let (a, b) = (f.speculative.unwrap(), f2.speculative.unwrap());
    let (drafted, accepted) = (a.drafted + b.drafted, a.accepted + b.accepted);
    eprintln!("qwen35 drafts: {drafted} drafted, {accepted} accepted");
    assert!(drafted > accepted && accepted > 0, "drafts were both accepted and rejected: {drafted} drafted, {accepted} accepted");
}

/// A prompt of `n` tokens of no pattern the model knows (ids of its
/// vocabulary, spread out).
fn long_prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 100 + i * 7919 % 30_000).collect()
}

/// `prompt`'s first `at` tokens and then others: a prompt forking there.
fn fork(prompt: &[u32], at: usize) -> Vec<u32> {
    prompt[..at].iter().copied().chain([11, 12, 13]).collect()
}

/// Through the engine: a prompt that forks inside a stored turn resumes
/// from the state checkpoint at the block boundary below the fork (a fork
/// at 140 from 128; one in the middle of a block, at 100, from 64) and
/// gives what a fresh request gives; one that forks before the first
/// boundary reads its prompt again. (Each fork in a session of its own: a
/// session's own entry is lent to its next turn, which keeps only what it
/// resumed from.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_inside_an_entry_resumes_from_the_checkpoint_below_it() {
    let model = load();
    let engine = start_engine_on(generated().0.clone());
    let prompt = long_prompt(150);
    for (at, resumed) in [(140, 128), (100, 64), (50, 0)] {
        let session = format!("fork-{at}");
        let (_, f1) = run_request(&engine, request(&prompt, 8, Some(&session))).await;
        assert_eq!(f1.cached_tokens, 0);
        let forked = fork(&prompt, at);
        let (got, f) = run_request(&engine, request(&forked, 8, Some(&session))).await;
        assert_eq!(f.cached_tokens, resumed, "a fork at {at}");
        assert_eq!(got, greedy_tokens(&model, &forked, 8).unwrap(), "a fork at {at} resumed from {resumed} must equal a fresh request");
    }
}

/// The `.kv` files under `dir` (any depth).
fn kv_files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries
        .flatten()
        .flat_map(|e| match e.path() {
            p if p.is_dir() => kv_files(&p),
            p if p.extension().is_some_and(|x| x == "kv") => vec![p],
            _ => Vec::new(),
        })
        .collect()
}

/// A hybrid turn pushed out of RAM (a prefix cache of one byte) into the
/// host tier or onto disk comes back with its state and checkpoints: a
/// fork inside it resumes from the checkpoint below the fork and equals a
/// fresh request. A damaged file is refused: the prompt is read again and
/// the tokens are still a fresh request's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_turn_resumes_from_the_host_tier_and_from_disk() {
    let model = load();
    let prompt = long_prompt(150);
    let dir = std::env::temp_dir().join(format!("tether-qwen35-tiers-{}", std::process::id()));
    for tier in ["host", "disk"] {
        let config = EngineConfig {
            kv_layout: KvLayout::Rows,
            prefix_cache_bytes: 1,
            kv_host_bytes: if tier == "host" { 1 << 30 } else { 0 },
            kv_disk: (tier == "disk").then(|| DiskTierConfig { dir: dir.clone(), budget_bytes: 1 << 30 }),
            ..Default::default()
        };
        let engine = start_engine_with(generated().0.clone(), config);
        run_request(&engine, request(&prompt, 8, Some("s"))).await;
        let forked = fork(&prompt, 140);
        let (got, f) = run_request(&engine, request(&forked, 8, Some("s"))).await;
        assert_eq!(f.cached_tokens, 128, "{tier}: resumed from the checkpoint at 128");
        assert_eq!(got, greedy_tokens(&model, &forked, 8).unwrap(), "{tier}");
        let stats = engine.stats().await.unwrap().prefix;
        assert_eq!((stats.host.hits + stats.disk.hits, stats.entries), (1, 0), "{tier}: {stats:?}");
        if tier == "disk" {
            // Both turns are on disk now (the fork did not replace the first
            // turn), the fork's once its file is written (files appear
            // whole, under their final name). Every file damaged.
            let mut files = kv_files(&dir);
            for _ in 0..200 {
                if files.iter().any(|f| f.ends_with("2.kv")) {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                files = kv_files(&dir);
            }
            assert_eq!(files.len(), 2, "{files:?}");
            for file in &files {
                let mut bytes = std::fs::read(file).unwrap();
                let at = bytes.len() - 100;
                bytes[at] ^= 0x10;
                std::fs::write(file, bytes).unwrap();
            }
            let again = fork(&forked, 100);
            let (got, f) = run_request(&engine, request(&again, 8, Some("s"))).await;
            assert_eq!(f.cached_tokens, 0, "a damaged file is computed afresh");
            assert_eq!(got, greedy_tokens(&model, &again, 8).unwrap());
            assert!(engine.stats().await.unwrap().prefix.disk.failed_reads >= 1);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
