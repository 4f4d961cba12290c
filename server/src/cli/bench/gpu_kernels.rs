//! `tether bench --gpu-kernels`: the fused decode step (`models/gpu`) beside
//! MLX's ops on the same rows, step by step, and both beside the model in
//! float32 (MLX's ops). For each row count, three batches of slots read the
//! same prompts (through MLX's ops), then decode the same greedy tokens
//! (the float32 model's), one batch through each path; the result says how
//! far each bfloat16 path's logits are from float32's (relative L2, top-1
//! agreement) and from each other's, the primitives each path's graph
//! evaluates, and each path's step time. One JSON line per row count.
use std::time::Instant;

use serde::Serialize;
use tether::models::{BatchedRows, KvBatch, KvCache, StepLogits, Transformer, SHARED_ATTENTION_SCORES};

#[derive(Serialize)]
pub(super) struct KernelCheck {
    rows: usize,
    steps: usize,
    /// Largest relative L2 distance of a row's fused logits from MLX's.
    worst_rel_l2: f64,
    worst_abs: f64,
    /// Steps x rows where both paths put the same token on top.
    top1_agree: usize,
    top1_total: usize,
    /// Each bfloat16 path beside float32: the mean relative L2 distance of
    /// a row's logits, and the steps x rows with float32's top-1 on top.
    fused_vs_f32_rel_l2: f64,
    mlx_vs_f32_rel_l2: f64,
    fused_top1_as_f32: usize,
    mlx_top1_as_f32: usize,
    /// Primitives one decode step evaluates, per path.
    fused_primitives: usize,
    mlx_primitives: usize,
    /// Median step time, build and evaluation, per path.
    fused_step_ms: f64,
    mlx_step_ms: f64,
    /// The first fused step's time (it compiles what no warm-up compiled).
    first_fused_step_ms: f64,
    /// Steps the fused path ran (a step it declines runs on MLX's ops).
    fused_steps: usize,
}

/// Runs the comparison at each of `row_counts` after prompts of about
/// `prompt_len` tokens (each row's a little longer than the last).
pub(super) fn run(model: &mut Transformer, reference: &Transformer, row_counts: &[usize], prompt_len: usize, steps: usize) -> anyhow::Result<Vec<KernelCheck>> {
    anyhow::ensure!(model.gpu_decode.is_some(), "the fused decode step does not run here (a CUDA GPU, bfloat16, a model it fits)");
    anyhow::ensure!(reference.gpu_decode.is_none(), "the reference must run on MLX's ops");
    row_counts.iter().map(|&rows| check(model, reference, rows, prompt_len, steps)).collect()
}

fn check(model: &mut Transformer, reference: &Transformer, rows: usize, prompt_len: usize, steps: usize) -> anyhow::Result<KernelCheck> {
    let vocab = model.config.vocab_size;
    let prompts: Vec<Vec<i32>> = (0..rows).map(|r| (0..prompt_len + 7 * r).map(|i| ((i * 7919 + r * 104_729 + 13) % vocab) as i32).collect()).collect();
    let room = prompt_len + 7 * rows + steps + 1;
    let empty = KvCache::new(model.config.n_layers, model.config.n_kv_heads, model.config.head_dim, model.dtype);
    let mut fused_kv = model.new_kv_batch();
    let mut mlx_kv = model.new_kv_batch();
    let f32_empty = KvCache::new(reference.config.n_layers, reference.config.n_kv_heads, reference.config.head_dim, reference.dtype);
    let mut f32_kv = reference.new_kv_batch();
    for _ in 0..rows {
        fused_kv.admit(&empty, room)?;
        mlx_kv.admit(&empty, room)?;
        f32_kv.admit(&f32_empty, room)?;
    }
    let gpu = model.gpu_decode.take();
    for kv in [&mut fused_kv, &mut mlx_kv] {
        step(model, kv, prompts.clone())?;
    }
    model.gpu_decode = gpu;
    let mut next = greedy(&step(reference, &mut f32_kv, prompts)?.0)?;
    let mut result = KernelCheck {
        rows,
        steps,
        worst_rel_l2: 0.0,
        worst_abs: 0.0,
        top1_agree: 0,
        top1_total: 0,
        fused_primitives: 0,
        mlx_primitives: 0,
        fused_step_ms: 0.0,
        mlx_step_ms: 0.0,
        fused_vs_f32_rel_l2: 0.0,
        mlx_vs_f32_rel_l2: 0.0,
        fused_top1_as_f32: 0,
        mlx_top1_as_f32: 0,
        first_fused_step_ms: 0.0,
        fused_steps: 0,
    };
    let (mut fused_ms, mut mlx_ms) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let tokens: Vec<Vec<i32>> = next.iter().map(|&t| vec![t]).collect();
        let (fused, fused_count, fused_time) = step(model, &mut fused_kv, tokens.clone())?;
        let gpu = model.gpu_decode.take();
        let reference_step = step(model, &mut mlx_kv, tokens.clone());
        model.gpu_decode = gpu;
        let (mlx, mlx_count, mlx_time) = reference_step?;
        let exact = step(reference, &mut f32_kv, tokens.clone())?.0;
        result.fused_primitives = fused_count;
        result.mlx_primitives = mlx_count;
        result.fused_steps += usize::from(fused_count < mlx_count);
        if fused_ms.is_empty() {
            result.first_fused_step_ms = fused_time;
        }
        fused_ms.push(fused_time);
        mlx_ms.push(mlx_time);
        for ((a, b), e) in fused.iter().zip(&mlx).zip(&exact) {
            let (a, b, e) = (a.to_vec_f32()?, b.to_vec_f32()?, e.to_vec_f32()?);
            anyhow::ensure!(a.iter().all(|x| x.is_finite()), "fused logits are not finite");
            result.worst_rel_l2 = result.worst_rel_l2.max(rel_l2(&a, &b));
            result.worst_abs = result.worst_abs.max(a.iter().zip(&b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max));
            result.top1_agree += usize::from(argmax(&a) == argmax(&b));
            result.top1_total += 1;
            result.fused_vs_f32_rel_l2 += rel_l2(&a, &e);
            result.mlx_vs_f32_rel_l2 += rel_l2(&b, &e);
            result.fused_top1_as_f32 += usize::from(argmax(&a) == argmax(&e));
            result.mlx_top1_as_f32 += usize::from(argmax(&b) == argmax(&e));
        }
        next = greedy(&exact)?;
    }
    result.fused_vs_f32_rel_l2 /= result.top1_total.max(1) as f64;
    result.mlx_vs_f32_rel_l2 /= result.top1_total.max(1) as f64;
    result.fused_step_ms = median(&mut fused_ms);
    result.mlx_step_ms = median(&mut mlx_ms);
    Ok(result)
}

/// One step of `tokens` for each of the first slots (the batch holds a power
/// of two) through whichever path the model takes; returns their logits,
/// the primitives evaluated and the step's milliseconds.
fn step(model: &Transformer, kv: &mut KvBatch, mut tokens: Vec<Vec<i32>>) -> anyhow::Result<(Vec<mlx::Array>, usize, f64)> {
    let started = Instant::now();
    let mut logits = vec![1; tokens.len()];
    tokens.resize(kv.slots(), Vec::new());
    logits.resize(kv.slots(), 0);
    let StepLogits { batched, .. } =
        model.forward_step(Some(BatchedRows { kv, tokens, fed: None, logits, shared_scores: SHARED_ATTENTION_SCORES }), &mut [])?;
    let logits: Vec<mlx::Array> = batched.into_iter().flatten().collect();
    let mut outputs: Vec<&mlx::Array> = logits.iter().collect();
    outputs.extend(kv.buffers());
    let built = Instant::now();
    let count = mlx::cuda::primitive_count(&outputs)?;
    let counted = Instant::now();
    mlx::eval(&outputs)?;
    // Building and evaluating, not counting.
    let ms = ((built - started) + counted.elapsed()).as_secs_f64() * 1e3;
    Ok((logits, count, ms))
}

/// `|a - b| / |b|`.
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
    diff / norm.max(1e-30)
}

fn greedy(logits: &[mlx::Array]) -> anyhow::Result<Vec<i32>> {
    logits.iter().map(|l| Ok(argmax(&l.to_vec_f32()?) as i32)).collect()
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &x)| if x > best.1 { (i, x) } else { best }).0
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
