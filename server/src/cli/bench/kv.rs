//! `tether bench --kv-quality`: what 8- and 4-bit KV cost in quality and buy in
//! decode speed, beside full precision in one run on one model.
//!
//! Quality is measured twice: the perplexity of a fixed text (every
//! position's log-likelihood of the next token, the text read in chunks as
//! a long prompt is), and greedy agreement, 64 greedy tokens after windows
//! of that text long enough to pass the quantization's start, compared
//! token by token with full precision's. Speed: decode tokens/s after a
//! long history, the variants alternating so a noisy machine slows both.
//!
//! Where the server keeps KV in batched slots (a GPU, or `--kv-layout
//! batched`), quality is measured there: one slot of a batch holding codes
//! from its first position (`kv_batch.rs`), read by MLX's ops or the fused
//! decode kernels as the server's steps are; speed is then the engine's
//! (`--streams`).
use std::ops::ControlFlow;

use serde::Serialize;

use tether::generate::{generate, prefill, GenerateOptions};
use tether::loaded::ModelWithTokenizer;
use tether::models::{BatchedRows, KvCache, KvQuantization, StepLogits, Transformer, SHARED_ATTENTION_SCORES};
use tether::sample::SamplingParams;

use super::throughput::prompt_tokens;
use super::BenchArgs;

/// Quality rows, then speed rows, one JSON line each.
pub(super) fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let mut model = args.model.load_here()?;
    let holder = match args.kv_layout.layout().batched_on(mlx::default_device()) {
        true => Holder::Slots,
        false => Holder::Rows,
    };
    let (group, start) = (args.kv.kv_group_size, args.kv.kv_quantized_start);
    // Both code widths unless --kv-bits names one.
    let bits = args.kv.quantization()?.map_or(vec![8, 4], |q| vec![q.bits]);
    let variants = variants(&bits, group, start);
    let text = std::fs::read_to_string(&args.kv_text).map_err(|e| anyhow::anyhow!("reading {:?}: {e}", args.kv_text))?;
    let mut text = model.tokenizer.encode(&text, false)?;
    anyhow::ensure!(text.len() >= args.kv_text_tokens, "{:?} holds {} tokens, fewer than --kv-text-tokens", args.kv_text, text.len());
    text.truncate(args.kv_text_tokens);
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&args.kv_prompts).map_err(|e| anyhow::anyhow!("reading {:?}: {e}", args.kv_prompts))?)?;
    let reference_prompts: Vec<Vec<u32>> = serde_json::from_value(
        fixture["cases"]
            .as_array()
            .ok_or_else(|| anyhow::anyhow!("{:?} has no cases", args.kv_prompts))?
            .iter()
            .map(|c| c["prompt_ids"].clone())
            .collect::<Vec<_>>()
            .into(),
    )?;
    // The windows pass the start, so their whole history turns to codes.
    let windows = text_windows(&text, 20, start + 64)?;
    for row in quality(&mut model, holder, &text, &[("reference", reference_prompts), ("text_windows", windows)], &variants)? {
        println!("{}", serde_json::to_string(&row)?);
    }
    if holder == Holder::Slots {
        return Ok(()); // their speed is the engine's: --streams with --kv-bits
    }
    let history = prompt_tokens(&model.tokenizer, args.prompt_tokens)?;
    // At a long history the from-0 variants hold what the others do.
    let speed_variants: Vec<_> = variants.iter().copied().filter(|v| v.quantization.is_none_or(|q| q.start == start)).collect();
    for row in speed(&mut model, &history, &speed_variants, args.gen_tokens, 3)? {
        println!("{}", serde_json::to_string(&row)?);
    }
    Ok(())
}

/// Where a variant's KV lives: rows' own caches, or a batch's slots.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Holder {
    Rows,
    Slots,
}

impl Holder {
    fn set(self, model: &mut Transformer, q: Option<KvQuantization>) -> mlx::Result<()> {
        match self {
            Holder::Rows => model.set_kv_quantization(q),
            Holder::Slots => model.set_batched_kv_quantization(q),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Holder::Rows => "rows",
            Holder::Slots => "batched_slots",
        }
    }
}

/// One sequence's KV state in its holder, stepped as the server steps it.
enum Sequence {
    Row(KvCache),
    Slot(tether::models::KvBatch),
}

impl Sequence {
    fn new(model: &Transformer, holder: Holder) -> anyhow::Result<Sequence> {
        Ok(match holder {
            Holder::Rows => Sequence::Row(model.new_cache()),
            Holder::Slots => {
                let mut batch = model.new_kv_batch();
                batch.admit(&model.new_cache(), 0)?;
                Sequence::Slot(batch)
            }
        })
    }

    /// Logits of the last `wanted` of `tokens`, read in as one step.
    fn forward(&mut self, model: &Transformer, tokens: &[u32], wanted: usize) -> anyhow::Result<mlx::Array> {
        match self {
            Sequence::Row(cache) => Ok(model.forward(tokens, cache, wanted)?),
            Sequence::Slot(kv) => {
                kv.ensure_capacity(kv.len(0) + tokens.len() + 1)?;
                let tokens = vec![tokens.iter().map(|&t| t as i32).collect()];
                let rows = BatchedRows { kv, tokens, fed: None, logits: vec![wanted], shared_scores: SHARED_ATTENTION_SCORES };
                let StepLogits { batched, .. } = model.forward_step(Some(rows), &mut [])?;
                batched.into_iter().next().flatten().ok_or_else(|| anyhow::anyhow!("the slot's step gave no logits"))
            }
        }
    }

    /// `prompt` in chunks of `chunk`; the last token's logits.
    fn prefill(&mut self, model: &Transformer, prompt: &[u32], chunk: usize) -> anyhow::Result<mlx::Array> {
        let mut last = None;
        for part in prompt.chunks(chunk) {
            last = Some(self.forward(model, part, 1)?);
        }
        last.ok_or_else(|| anyhow::anyhow!("an empty prompt"))
    }
}

/// One way of holding KV state.
#[derive(Clone, Copy)]
struct KvVariant {
    name: &'static str,
    quantization: Option<KvQuantization>,
}

/// The variants a run compares: full precision, then codes of each of
/// `bits` past `start` (the server's setting) and from the first token (the
/// worst case).
fn variants(bits: &[u8], group: usize, start: usize) -> Vec<KvVariant> {
    const NAMES: [(u8, &str, &str); 2] = [(8, "int8", "int8-from-0"), (4, "int4", "int4-from-0")];
    let mut out = vec![KvVariant { name: "float32", quantization: None }];
    for &(b, past_start, from_0) in NAMES.iter().filter(|(b, ..)| bits.contains(b)) {
        out.push(KvVariant { name: past_start, quantization: Some(KvQuantization { bits: b, group, start }) });
        out.push(KvVariant { name: from_0, quantization: Some(KvQuantization { bits: b, group, start: 0 }) });
    }
    out
}

#[derive(Serialize)]
struct Quality {
    kind: &'static str,
    kv: &'static str,
    /// Rows' own caches or batched slots (see [`Holder`]).
    kv_holder: &'static str,
    /// The codes' group (`None`: full precision).
    kv_group: Option<usize>,
    model: String,
    /// Which prompts the greedy comparison ran on.
    prompt_set: &'static str,
    text_tokens: usize,
    perplexity: f64,
    /// Relative to full precision's, in percent.
    perplexity_change_pct: f64,
    prompts: usize,
    /// Prompts whose greedy continuation equals full precision's, token by token.
    greedy_identical: usize,
    /// Mean tokens in common before the first difference.
    greedy_mean_common_prefix: f64,
    /// Where a prompt's tokens first differ: full precision's margin
    /// between its best and second-best logit there, median over the
    /// prompts that differ (a near-tie flips on any perturbation).
    median_margin_at_first_difference: Option<f32>,
}

#[derive(Serialize)]
struct Speed {
    kind: &'static str,
    kv: &'static str,
    model: String,
    history_tokens: usize,
    gen_tokens: usize,
    /// One per round, in run order.
    decode_tok_s: Vec<f64>,
    kv_bytes: usize,
}

/// Mean negative log-likelihood per predicted token of `tokens`, read in
/// chunks of `chunk` into one cache.
fn mean_nll(model: &Transformer, holder: Holder, tokens: &[u32], chunk: usize) -> anyhow::Result<f64> {
    let mut sequence = Sequence::new(model, holder)?;
    let mut total = 0.0;
    let mut next = 1; // the token the next logits row predicts
    for part in tokens.chunks(chunk) {
        let logits = sequence.forward(model, part, part.len())?;
        let vocab = *logits.shape().last().expect("logits have a vocab axis");
        let rows = logits.to_vec_f32()?;
        for row in rows.chunks(vocab) {
            if next >= tokens.len() {
                break;
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let log_sum = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            total += log_sum - row[tokens[next] as usize] as f64;
            next += 1;
        }
    }
    Ok(total / (tokens.len() - 1) as f64)
}

/// Greedy tokens, each with its logit margin (see [`greedy_with_margins`]).
type GreedyPath = Vec<(u32, f32)>;

/// `n` greedy tokens of `prompt`, each with the margin between the best
/// and the second-best logit it was chosen by.
fn greedy_with_margins(model: &Transformer, holder: Holder, prompt: &[u32], n: usize) -> anyhow::Result<GreedyPath> {
    let mut sequence = Sequence::new(model, holder)?;
    let mut logits = sequence.prefill(model, prompt, 512)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let row = logits.to_vec_f32()?;
        let (mut best, mut second) = ((0, f32::NEG_INFINITY), f32::NEG_INFINITY);
        for (i, &x) in row.iter().enumerate() {
            if x > best.1 {
                second = best.1;
                best = (i, x);
            } else if x > second {
                second = x;
            }
        }
        out.push((best.0 as u32, best.1 - second));
        logits = sequence.forward(model, &[best.0 as u32], 1)?;
    }
    Ok(out)
}

/// Quality of each variant against the first (full precision): the
/// perplexity of `text`, and per set of prompts (the caller's: reference
/// prompts, windows of the text) greedy agreement of 64 tokens after each.
fn quality(
    model: &mut ModelWithTokenizer,
    holder: Holder,
    text: &[u32],
    prompt_sets: &[(&'static str, Vec<Vec<u32>>)],
    variants: &[KvVariant],
) -> anyhow::Result<Vec<Quality>> {
    const GREEDY: usize = 64;
    let mut out: Vec<Quality> = Vec::new();
    let mut reference: Option<(f64, Vec<Vec<GreedyPath>>)> = None;
    for v in variants {
        // Slots hold codes from the first position: their "past start" variants are the from-0 ones.
        if holder == Holder::Slots && v.quantization.is_some_and(|q| q.start > 0) {
            continue;
        }
        holder.set(&mut model.transformer, v.quantization)?;
        let perplexity = mean_nll(&model.transformer, holder, text, 128)?.exp();
        let greedy = prompt_sets
            .iter()
            .map(|(_, prompts)| prompts.iter().map(|p| greedy_with_margins(&model.transformer, holder, p, GREEDY)).collect::<anyhow::Result<Vec<_>>>())
            .collect::<anyhow::Result<Vec<_>>>()?;
        let (base_ppl, base_greedy) = reference.get_or_insert_with(|| (perplexity, greedy.clone()));
        for (((set, prompts), greedy), base_greedy) in prompt_sets.iter().zip(&greedy).zip(base_greedy.iter()) {
            let common = |a: &[(u32, f32)], b: &[(u32, f32)]| a.iter().zip(b).take_while(|(x, y)| x.0 == y.0).count();
            let prefixes: Vec<usize> = greedy.iter().zip(base_greedy).map(|(a, b)| common(a, b)).collect();
            let mut margins: Vec<f32> = prefixes.iter().zip(base_greedy).filter(|(&n, _)| n < GREEDY).map(|(&n, base)| base[n].1).collect();
            margins.sort_by(f32::total_cmp);
            out.push(Quality {
                kind: "kv_quality",
                kv: v.name,
                kv_holder: holder.name(),
                kv_group: v.quantization.map(|q| q.group),
                model: model.name.clone(),
                prompt_set: set,
                text_tokens: text.len(),
                perplexity,
                perplexity_change_pct: (perplexity / *base_ppl - 1.0) * 100.0,
                prompts: prompts.len(),
                greedy_identical: prefixes.iter().filter(|&&n| n == GREEDY).count(),
                greedy_mean_common_prefix: prefixes.iter().sum::<usize>() as f64 / prefixes.len().max(1) as f64,
                median_margin_at_first_difference: margins.get(margins.len() / 2).copied(),
            });
        }
    }
    holder.set(&mut model.transformer, None)?;
    Ok(out)
}

/// `count` windows of `len` tokens spread evenly over `text`.
fn text_windows(text: &[u32], count: usize, len: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    anyhow::ensure!(text.len() >= len, "the text has {} tokens; windows of {len} need more", text.len());
    let stride = ((text.len() - len) / count.max(1)).max(1);
    Ok((0..count).map(|i| text[i * stride..i * stride + len].to_vec()).collect())
}

/// Decode speed of each variant after a `history`-token prompt, `rounds`
/// rounds with the variants alternating.
fn speed(model: &mut ModelWithTokenizer, history: &[u32], variants: &[KvVariant], gen: usize, rounds: usize) -> anyhow::Result<Vec<Speed>> {
    let opts = GenerateOptions { max_tokens: gen, sampling: SamplingParams::default(), stop_ids: vec![], prefill_chunk: 512 };
    let mut out: Vec<Speed> = variants
        .iter()
        .map(|v| Speed {
            kind: "kv_decode",
            kv: v.name,
            model: model.name.clone(),
            history_tokens: history.len(),
            gen_tokens: gen,
            decode_tok_s: vec![],
            kv_bytes: 0,
        })
        .collect();
    for _ in 0..rounds {
        for (v, row) in variants.iter().zip(out.iter_mut()) {
            model.transformer.set_kv_quantization(v.quantization)?;
            let stats = generate(&model.transformer, history, &opts, |_| ControlFlow::Continue(()))?;
            row.decode_tok_s.push(stats.decode_tokens_per_second());
            if row.kv_bytes == 0 {
                // What the history itself holds, once (the bytes do not vary by round).
                let mut cache = model.transformer.new_cache();
                prefill(&model.transformer, &mut cache, history, 512)?;
                mlx::eval(&cache.buffers())?;
                row.kv_bytes = cache.nbytes();
            }
        }
    }
    model.transformer.set_kv_quantization(None)?;
    Ok(out)
}
