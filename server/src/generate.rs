//! Single-sequence generation: chunked prefill, then a decode loop that
//! builds step N+1's graph from step N's still-lazy token and evaluates it
//! asynchronously while the host reads step N back.
use std::ops::ControlFlow;
use std::time::Instant;

use mlx::Array;

use crate::models::{KvCache, Transformer};
use crate::sample::{Sampler, SamplingParams};

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end generation (end-of-turn, end-of-text).
    pub stop_ids: Vec<u32>,
    /// Prompt tokens per forward during prefill: bounds the attention
    /// scores' memory on long prompts.
    pub prefill_chunk: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop sequence.
    Stop,
    /// `max_tokens` reached.
    Length,
}

#[derive(Clone, Debug)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub prefill_seconds: f64,
    /// From the first generated token to the last.
    pub decode_seconds: f64,
    pub finish: FinishReason,
}

impl GenerateStats {
    pub fn prefill_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_seconds.max(1e-9)
    }

    /// Tokens after the first, over the time they took.
    pub fn decode_tokens_per_second(&self) -> f64 {
        self.completion_tokens.saturating_sub(1) as f64 / self.decode_seconds.max(1e-9)
    }
}

/// Runs the prompt through `cache` and returns the last position's logits.
pub fn prefill(model: &Transformer, cache: &mut KvCache, prompt: &[u32], chunk: usize) -> mlx::Result<Array> {
    let chunk = chunk.max(1);
    let mut logits = None;
    for (i, part) in prompt.chunks(chunk).enumerate() {
        let is_last = (i + 1) * chunk >= prompt.len();
        let l = model.forward(part, cache, 1)?;
        if is_last {
            logits = Some(l);
        } else {
            mlx::eval(&cache.buffers())?;
        }
    }
    logits.ok_or_else(|| mlx::Error { op: "prefill", message: "empty prompt".into() })
}

/// Generates after `prompt`, calling `on_token` with each new token id;
/// `on_token` returning `Break` stops (e.g. a stop string matched).
/// End-of-generation tokens are not passed to `on_token`.
pub fn generate(model: &Transformer, prompt: &[u32], opts: &GenerateOptions, mut on_token: impl FnMut(u32) -> ControlFlow<()>) -> mlx::Result<GenerateStats> {
    let mut cache = model.new_cache();
    let sampler = Sampler::new(opts.sampling.clone());
    let start = Instant::now();
    let logits = prefill(model, &mut cache, prompt, opts.prefill_chunk)?;
    let mut token = sampler.draw(&logits, 0)?;
    mlx::async_eval(&[&token])?;

    let mut stats =
        GenerateStats { prompt_tokens: prompt.len(), completion_tokens: 0, prefill_seconds: 0.0, decode_seconds: 0.0, finish: FinishReason::Length };
    let mut first_token_at = None;
    for i in 0..opts.max_tokens {
        // Queue the next step before waiting on this one.
        let next = if i + 1 < opts.max_tokens {
            let logits = model.forward_ids(&token.reshape(&[1, 1])?, &mut cache, 1)?;
            let next = sampler.draw(&logits, i + 1)?;
            mlx::async_eval(&[&next])?;
            Some(next)
        } else {
            None
        };
        let id = token.to_vec_i32()?[0] as u32;
        let now = Instant::now();
        let first = *first_token_at.get_or_insert_with(|| {
            stats.prefill_seconds = (now - start).as_secs_f64();
            now
        });
        stats.decode_seconds = (now - first).as_secs_f64();
        if opts.stop_ids.contains(&id) {
            stats.finish = FinishReason::Stop;
            break;
        }
        stats.completion_tokens += 1;
        if on_token(id).is_break() {
            stats.finish = FinishReason::Stop;
            break;
        }
        match next {
            Some(n) => token = n,
            None => break,
        }
    }
    Ok(stats)
}

/// Greedy continuation without pipelining or stop tokens: the plain loop the
/// numerical tests compare against reference outputs.
pub fn greedy_tokens(model: &Transformer, prompt: &[u32], n: usize) -> mlx::Result<Vec<u32>> {
    let mut cache = model.new_cache();
    let mut logits = prefill(model, &mut cache, prompt, 512)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let id = logits.argmax(-1, false)?.to_vec_i32()?[0] as u32;
        out.push(id);
        logits = model.forward(&[id], &mut cache, 1)?;
    }
    Ok(out)
}
