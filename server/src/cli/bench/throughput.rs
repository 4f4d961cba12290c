//! `tether bench`'s throughput runs: single-stream prefill/decode on this
//! thread, concurrent streams through the engine, and a multi-turn agent
//! session's time to first token.
//!
//! Single-stream is measured the way the peer script
//! (bench/peer/mlx_lm_decode.py) measures mlx-lm: a prompt of exactly P tokens,
//! G greedy tokens with end-of-text ignored, one warm-up run first.
use std::ops::ControlFlow;

use serde::Serialize;

use tether::engine::{EngineEvent, EngineHandle, EngineStats, Scope, SubmitRequest};
use tether::generate::{generate, GenerateOptions};
use tether::loaded::ModelWithTokenizer;
use tether::sample::SamplingParams;
use tether::tokenizer::TextTokenizer;

/// Text the benchmark prompt is cut from (repeated as needed).
const PROMPT_TEXT: &str = "The history of computing is a story of abstraction. Early machines were programmed \
by rewiring panels; later, stored programs let the same hardware run many tasks. Compilers turned \
human-readable code into machine instructions, operating systems shared one computer among many users, \
and networks joined computers into systems larger than any one of them. ";

#[derive(Debug, Serialize)]
pub(super) struct DecodeBench {
    engine: &'static str,
    model: String,
    device: String,
    /// The CPU kernels' instruction sets (see `mlx::cpu_isa`).
    cpu_isa: String,
    weights: String,
    prompt_tokens: usize,
    gen_tokens: usize,
    prefill_tok_s: f64,
    decode_tok_s: f64,
    /// Bytes of weights one decode step reads (layers, final norm, LM head).
    weight_bytes: usize,
    /// weight_bytes x decode_tok_s: the memory traffic decode sustains.
    decode_gb_s: f64,
}

/// Exactly `n` tokens of benchmark text.
pub(super) fn prompt_tokens(tokenizer: &TextTokenizer, n: usize) -> anyhow::Result<Vec<u32>> {
    let one = tokenizer.encode(PROMPT_TEXT, false)?;
    anyhow::ensure!(!one.is_empty(), "benchmark text encodes to no tokens");
    Ok(one.iter().copied().cycle().take(n).collect())
}

pub(super) fn run_decode_bench(model: &ModelWithTokenizer, prompt_len: usize, gen: usize) -> anyhow::Result<DecodeBench> {
    let prompt = prompt_tokens(&model.tokenizer, prompt_len)?;
    // No stop ids: every run produces exactly `gen` tokens.
    let opts = GenerateOptions { max_tokens: gen, sampling: SamplingParams::default(), stop_ids: vec![], prefill_chunk: 512 };
    generate(&model.transformer, &prompt, &GenerateOptions { max_tokens: 8, ..opts.clone() }, |_| ControlFlow::Continue(()))?;
    let stats = generate(&model.transformer, &prompt, &opts, |_| ControlFlow::Continue(()))?;
    let weight_bytes = model.transformer.decode_read_bytes();
    let decode = stats.decode_tokens_per_second();
    Ok(DecodeBench {
        engine: "tether",
        model: model.name.clone(),
        device: format!("{:?}", mlx::default_device()).to_lowercase(),
        cpu_isa: mlx::cpu_isa(),
        weights: model.transformer.weight_form().to_string(),
        prompt_tokens: stats.prompt_tokens,
        gen_tokens: stats.completion_tokens,
        prefill_tok_s: stats.prefill_tokens_per_second(),
        decode_tok_s: decode,
        weight_bytes,
        decode_gb_s: weight_bytes as f64 * decode / 1e9,
    })
}

/// Mean engine-thread milliseconds per step and phase over a run (see
/// [`tether::engine::StepTimes`]): says whether a run was bound by the host
/// recording graphs or by the device running them.
#[derive(Debug, Default, Serialize)]
pub(super) struct StepProfile {
    steps: u64,
    build_ms: f64,
    eval_ms: f64,
    publish_ms: f64,
}

impl StepProfile {
    /// The steps between two snapshots of one engine's statistics.
    pub(super) fn between(before: &EngineStats, after: &EngineStats) -> StepProfile {
        let steps = after.steps.saturating_sub(before.steps);
        let per_step = |a: u64, b: u64| if steps == 0 { 0.0 } else { a.saturating_sub(b) as f64 / steps as f64 / 1e3 };
        let (a, b) = (&after.step_time, &before.step_time);
        StepProfile {
            steps,
            build_ms: per_step(a.build_us, b.build_us),
            eval_ms: per_step(a.eval_us, b.eval_us),
            publish_ms: per_step(a.publish_us, b.publish_us),
        }
    }
}

#[derive(Debug, Serialize)]
pub(super) struct StreamsBench {
    engine: &'static str,
    model: String,
    device: String,
    /// The CPU kernels' instruction sets (see `mlx::cpu_isa`).
    cpu_isa: String,
    streams: usize,
    prompt_tokens: usize,
    gen_tokens: usize,
    /// All generated tokens over the wall time from submission to the last token.
    aggregate_tok_s: f64,
    mean_ttft_ms: f64,
    /// A hash of every stream's tokens, in stream order: equal across runs
    /// that generated the same tokens (e.g. with and without --lookahead).
    tokens_digest: String,
    /// Decode steps queued ahead and used, and dropped (see the engine's lookahead).
    lookahead_served: u64,
    lookahead_dropped: u64,
    step: StepProfile,
}

/// Aggregate decode throughput of `streams` concurrent requests through the
/// engine thread (continuous batching), in-process.
pub(super) fn run_streams_bench(engine: &EngineHandle, name: &str, prompt: Vec<u32>, streams: usize, gen: usize) -> anyhow::Result<StreamsBench> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let before = engine.stats().await.unwrap_or_default();
        let start = std::time::Instant::now();
        let mut tasks = Vec::new();
        for s in 0..streams {
            // Distinct prompts (one token differs) so no two rows are identical.
            let mut p = prompt.clone();
            if let Some(first) = p.first_mut() {
                *first = first.wrapping_add(s as u32 % 7);
            }
            let req = SubmitRequest::new(p, gen);
            let mut rx = engine.submit(req)?.events;
            tasks.push(tokio::spawn(async move {
                let mut ttft = None;
                let mut tokens = Vec::new();
                while let Some(ev) = rx.recv().await {
                    match ev {
                        EngineEvent::Tokens { ids, .. } => {
                            ttft.get_or_insert_with(|| start.elapsed());
                            tokens.extend(ids);
                        }
                        EngineEvent::Finished(_) | EngineEvent::Failed(_) => break,
                        EngineEvent::Started { .. } => {}
                    }
                }
                (tokens, ttft.unwrap_or_default())
            }));
        }
        let mut total = 0;
        let mut ttft_sum = 0.0;
        let mut digest = std::collections::hash_map::DefaultHasher::new();
        for t in tasks {
            let (tokens, ttft) = t.await?;
            total += tokens.len();
            std::hash::Hash::hash(&tokens, &mut digest);
            ttft_sum += ttft.as_secs_f64();
        }
        let wall = start.elapsed().as_secs_f64();
        let after = engine.stats().await.unwrap_or_default();
        Ok(StreamsBench {
            engine: "tether",
            model: name.to_string(),
            device: format!("{:?}", mlx::default_device()).to_lowercase(),
            cpu_isa: mlx::cpu_isa(),
            streams,
            prompt_tokens: prompt.len(),
            gen_tokens: gen,
            aggregate_tok_s: total as f64 / wall,
            mean_ttft_ms: ttft_sum / streams as f64 * 1e3,
            tokens_digest: format!("{:016x}", std::hash::Hasher::finish(&digest)),
            lookahead_served: after.lookahead_served - before.lookahead_served,
            lookahead_dropped: after.lookahead_dropped - before.lookahead_dropped,
            step: StepProfile::between(&before, &after),
        })
    })
}

#[derive(Debug, Serialize)]
pub(super) struct AgentTurn {
    engine: &'static str,
    cache: bool,
    turn: usize,
    history_tokens: usize,
    cached_tokens: usize,
    ttft_ms: f64,
}

/// A multi-turn agent session: each turn sends the whole history plus
/// `new_tokens` new ones and generates `gen` tokens; returns time to first
/// token per turn, with the session's prefix cache on or off.
pub(super) fn run_agent_bench(
    engine: &EngineHandle,
    tokenizer: &TextTokenizer,
    turns: usize,
    new_tokens: usize,
    gen: usize,
    cache: bool,
) -> anyhow::Result<Vec<AgentTurn>> {
    let text = prompt_tokens(tokenizer, new_tokens * turns + 7)?;
    let scope = format!("agent-bench-{}", std::process::id());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut history: Vec<u32> = Vec::new();
    let mut out = Vec::new();
    for turn in 1..=turns {
        history.extend(&text[(turn - 1) * new_tokens..turn * new_tokens]);
        let req = SubmitRequest { cache_scope: cache.then(|| Scope::Session(scope.clone())), ..SubmitRequest::new(history.clone(), gen) };
        let start = std::time::Instant::now();
        let mut rx = engine.submit(req)?.events;
        let (generated, ttft, cached) = rt.block_on(async {
            let mut ids = Vec::new();
            let mut ttft = None;
            let mut cached = 0;
            while let Some(ev) = rx.recv().await {
                match ev {
                    EngineEvent::Tokens { ids: t, .. } => {
                        ttft.get_or_insert_with(|| start.elapsed());
                        ids.extend(t);
                    }
                    EngineEvent::Finished(f) => {
                        cached = f.cached_tokens;
                        break;
                    }
                    EngineEvent::Failed(e) => anyhow::bail!(e),
                    EngineEvent::Started { .. } => {}
                }
            }
            Ok((ids, ttft.unwrap_or_default(), cached))
        })?;
        out.push(AgentTurn { engine: "tether", cache, turn, history_tokens: history.len(), cached_tokens: cached, ttft_ms: ttft.as_secs_f64() * 1e3 });
        history.extend(generated);
    }
    engine.drop_scope(Scope::Session(scope));
    Ok(out)
}
