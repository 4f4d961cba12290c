//! Kernel warm-up before a GPU engine takes requests.
//!
//! MLX's CUDA backend compiles some kernels at first use (NVRTC), among them
//! the quantized matmuls of more than one row: several seconds each, and a
//! model has one per projection width. Left to the first requests, that
//! shows up as a first token after a minute and as "speculation is slow"
//! (verification is the first multi-row decode). One forward of each shape
//! class the engine runs moves that cost to start-up; compiled kernels are
//! also kept on disk by MLX, so a restarted server starts faster.
//!
//! With the running rows' caches batched, attention over more than one
//! query per slot goes through matmuls that MLX's CUDA backend (cuBLAS) sets
//! up at the first use of each shape, ~4 ms each (bench/results/gpu-h200-first-shape-cost.jsonl).
//! A shape is (slots, queries per slot, capacity), all three from small
//! fixed sets, so every one a serving engine can meet is run once here
//! ([`attention_shapes`]): otherwise each turn of a chat, whose history has
//! moved capacity up a class, would pay ~9 ms before its first token.
use std::time::Instant;

use super::config::EngineConfig;
use crate::models::{
    alone_queries, capacity_classes, queries_per_slot, BatchedRows, ModelConfig, RowInput, Transformer, ALONE_QUERIES_MULTIPLE, GATHERED_ROWS_MULTIPLE,
    SHARED_ATTENTION_SCORES,
};

/// Token counts of the warm-up forwards. MLX picks a quantized matmul's
/// kernel by row count: under 8 rows a matrix-vector kernel, from 8 rows
/// tiles of 16, 32 and 64 rows (larger counts reuse the 64-row tile); each
/// tile is a separate compile (20-45 s each on an NVIDIA H200:
/// bench/results/gpu-h200-jit-compiles.txt). 8 and 16 rows are what batched
/// decode and draft verification (up to 16 tokens) hit first.
const WARM_UP_TOKENS: [usize; 5] = [1, 8, 16, 32, 64];

/// Slots of the warm-up's batch: what a busy engine has.
const WARM_UP_SLOTS: usize = 16;

/// Batched steps of the warm-up, as (tokens, logits wanted) of slot 0 and
/// of the other slots: decode; a 2-token verification (16 queries a slot,
/// padded); a 16-token verification or prompt chunk beside decoding slots
/// (real tokens gathered out of the padding); prompt chunks in every slot;
/// one long chunk alone. Together they reach every tile of the projections
/// and the output head, the masked attention at one and at several queries,
/// and the gathers.
const WARM_UP_SLOT_STEPS: [((usize, usize), (usize, usize)); 5] = [((1, 1), (1, 1)), ((2, 2), (1, 1)), ((16, 16), (1, 1)), ((8, 8), (8, 8)), ((64, 1), (0, 0))];

/// How far past the shared scores' bound a lone slot's shapes are warmed:
/// 4 x 256 MB of scores, a 512-token chunk over ~43k keys of a model with
/// 12 query heads. Longer sessions meet a shape's set-up at first use.
const LONE_SLOT_WARM_SCORES_FACTOR: usize = 4;

/// The shared attention's shapes a serving engine can meet, as (slots,
/// queries per slot, capacity): slot counts are powers of two up to the
/// running rows; queries one (decode) up to a default prompt chunk's;
/// capacities every class up to the model's context; within the KV budget,
/// and within the shared scores' bound (past it a chunk beside others
/// attends alone; a lone slot's, see [`LONE_SLOT_WARM_SCORES_FACTOR`]).
pub(super) fn attention_shapes(config: &EngineConfig, model: &ModelConfig, kv_bytes_per_token: usize) -> Vec<(usize, usize, usize)> {
    let slot_counts = std::iter::successors(Some(1usize), |&s| (s < config.max_running).then_some(s * 2));
    let largest_queries = queries_per_slot(config.prefill_chunk);
    let query_counts: Vec<usize> = std::iter::successors(Some(1usize), |&n| (n < largest_queries).then(|| queries_per_slot(n + 1))).collect();
    let mut shapes = Vec::new();
    for slots in slot_counts {
        for &n in &query_counts {
            for capacity in capacity_classes(model.context_length + 1) {
                let scores = slots * model.n_heads * n * capacity;
                let bytes = slots * capacity * kv_bytes_per_token;
                // A lone slot attends in the shared shape whatever its
                // scores; its shapes are warmed up to a few times the bound
                // (a warm-up step holds its scores too: a long-context model's
                // longest shapes would take gigabytes).
                let bound = if slots == 1 { LONE_SLOT_WARM_SCORES_FACTOR * config.shared_attention_scores } else { config.shared_attention_scores };
                if capacity > n && scores <= bound && bytes <= config.kv_budget_bytes {
                    shapes.push((slots, n, capacity));
                }
            }
        }
    }
    shapes
}

/// The shapes of a chunk attending alone beside the shared attention (see
/// [`crate::models::BatchedRows`]), as (queries, capacity): every multiple of
/// [`ALONE_QUERIES_MULTIPLE`] up to a step's most prompt tokens, over every
/// capacity class up to the model's context, within the KV budget and the
/// lone slot's scores' bound (as for [`attention_shapes`]).
pub(super) fn alone_shapes(config: &EngineConfig, model: &ModelConfig, kv_bytes_per_token: usize) -> Vec<(usize, usize)> {
    let most = config.step_token_budget.min(config.prefill_chunk).max(ALONE_QUERIES_MULTIPLE);
    let bound = LONE_SLOT_WARM_SCORES_FACTOR * config.shared_attention_scores;
    let mut shapes = Vec::new();
    for queries in (ALONE_QUERIES_MULTIPLE..=alone_queries(most)).step_by(ALONE_QUERIES_MULTIPLE) {
        for capacity in capacity_classes(model.context_length + 1) {
            if capacity > queries && model.n_heads * queries * capacity <= bound && capacity * kv_bytes_per_token <= config.kv_budget_bytes {
                shapes.push((queries, capacity));
            }
        }
    }
    shapes
}

/// Runs, and discards, forwards of every row-count class through a row's
/// own cache and, when running rows are batched, through batch slots, and
/// the batched attention at every shape of [`attention_shapes`].
pub(super) fn warm_up(model: &Transformer, config: &EngineConfig, batched: bool) -> mlx::Result<()> {
    let mut cache = model.new_cache();
    for n in WARM_UP_TOKENS {
        let ids = mlx::Array::from_i32(&vec![1; n], &[1, n])?;
        // Logits of every token: the output projection (often 8-bit, a
        // kernel of its own) then compiles its tiles too, as verification needs.
        let mut rows = [RowInput { ids, cache: &mut cache, n_logits: n }];
        let logits = model.forward_batch(&mut rows)?;
        mlx::eval(&logits.iter().chain(cache.buffers()).collect::<Vec<_>>())?;
    }
    if batched {
        let mut kv = model.new_kv_batch();
        for _ in 0..WARM_UP_SLOTS {
            kv.admit(&cache, 0)?;
        }
        let others = WARM_UP_SLOTS - 1;
        // Gathered row counts (in steps of GATHERED_ROWS_MULTIPLE): a prompt
        // chunk beside decoding rows, up to a step's whole budget; the same
        // counts cover a lone chunk's padded rows.
        let most_rows = config.step_token_budget.max(config.prefill_chunk).next_multiple_of(GATHERED_ROWS_MULTIPLE);
        let gathered = (2 * GATHERED_ROWS_MULTIPLE..=most_rows).step_by(GATHERED_ROWS_MULTIPLE).map(|rows| ((rows - others, 1), (1, 1)));
        for ((first, first_logits), (rest, rest_logits)) in WARM_UP_SLOT_STEPS.into_iter().chain(gathered) {
            let tokens = (0..WARM_UP_SLOTS).map(|s| vec![1; if s == 0 { first } else { rest }]).collect();
            let logits = (0..WARM_UP_SLOTS).map(|s| if s == 0 { first_logits } else { rest_logits }).collect();
            let rows = BatchedRows { kv: &mut kv, tokens, fed: None, logits, shared_scores: SHARED_ATTENTION_SCORES };
            let step = model.forward_step(Some(rows), &mut [])?;
            let logits: Vec<&mlx::Array> = step.batched.iter().flatten().collect();
            mlx::eval(&logits.into_iter().chain(kv.buffers()).collect::<Vec<_>>())?;
            // Keep the slots short: these steps are about shapes, not lengths.
            for slot in 0..WARM_UP_SLOTS {
                kv.truncate(slot, cache.len());
            }
        }
        warm_gpu_decode(model)?;
        let started = Instant::now();
        let shapes = attention_shapes(config, &model.config, model.config.kv_bytes_per_token(model.dtype.size()));
        for &(slots, n, capacity) in &shapes {
            model.warm_shared_attention(slots, n, capacity)?;
        }
        let alone = alone_shapes(config, &model.config, model.config.kv_bytes_per_token(model.dtype.size()));
        for &(queries, capacity) in &alone {
            model.warm_alone_attention(queries, capacity)?;
        }
        eprintln!("warm-up: {} shared and {} lone attention shapes in {:.1} s", shapes.len(), alone.len(), started.elapsed().as_secs_f64());
    }
    Ok(())
}

/// Compiles the fused GPU decode step's kernels (`models/gpu`) for each
/// row class, so NVRTC's compiles (seconds each) happen before serving.
/// No-op where the model does not run it.
fn warm_gpu_decode(model: &Transformer) -> mlx::Result<()> {
    let Some(gpu) = &model.gpu_decode else { return Ok(()) };
    let started = Instant::now();
    // One step of each compiled row class (see `row_class`).
    let classes = [1, crate::models::gpu::MAX_ROWS];
    for rows in classes {
        gpu.warm_up(model, rows)?;
    }
    eprintln!("warm-up: fused decode kernels for {classes:?} rows in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{capacity_class, Architecture};

    /// Qwen2.5-1.5B's attention: 12 query heads, 2 KV heads of 128.
    fn qwen_1_5b() -> ModelConfig {
        ModelConfig {
            arch: Architecture::Qwen2,
            vocab_size: 151_936,
            d_model: 1536,
            n_layers: 28,
            n_heads: 12,
            n_kv_heads: 2,
            head_dim: 128,
            d_ff: 8960,
            context_length: 32_768,
            rms_eps: 1e-6,
            rope_theta: 1e6,
            rope_scaling: None,
            rope_traditional: false,
            qkv_bias: true,
            qk_norm: false,
            tied_embeddings: true,
            embedding_scale: 1.0,
            activation: crate::models::Activation::Silu,
            post_norms: false,
            sliding_window: None,
            rope_dims: None,
            hybrid: None,
            layer_plan: None,
        }
    }

    #[test]
    fn warmed_attention_shapes_cover_a_chat_and_stay_few() {
        let (config, model) = (EngineConfig::default(), qwen_1_5b());
        let shapes = attention_shapes(&config, &model, model.kv_bytes_per_token(2));
        // Turn 12 of the agent benchmark: 4,340 tokens, 340 of them new,
        // read in one chunk by one slot (padded to 512 queries), then decoded.
        let capacity = capacity_class(4_340 + 1);
        assert!(shapes.contains(&(1, 512, capacity)) && shapes.contains(&(1, 1, capacity)));
        // 16 slots decoding or verifying beside 16-token chunks at 2k.
        assert!(shapes.contains(&(16, 16, capacity_class(2_100))));
        let bound = |s: usize| if s == 1 { LONE_SLOT_WARM_SCORES_FACTOR } else { 1 } * config.shared_attention_scores;
        assert!(shapes.iter().all(|&(s, n, c)| s * model.n_heads * n * c <= bound(s)));
        // A long session's next turn: one slot, 512 queries over 30k keys.
        assert!(shapes.contains(&(1, 512, capacity_class(30_000))));
        // 415 of them took 0.6 s on an NVIDIA H200 (bench/results/archive/gpu-h200-agent-warm-shapes.jsonl).
        assert!(shapes.len() < 1000, "{} shapes", shapes.len());
    }

    #[test]
    fn warmed_lone_chunk_shapes_cover_a_long_prompt_joining_streams() {
        let (config, model) = (EngineConfig::default(), qwen_1_5b());
        let shapes = alone_shapes(&config, &model, model.kv_bytes_per_token(2));
        // A 2,000-token prompt read beside decoding rows, in chunks of any
        // multiple of 16 up to the step's budget; its last chunk padded.
        let capacity = capacity_class(2_000 + 1);
        for queries in [16, 144, 208, 512] {
            assert!(shapes.contains(&(queries, capacity)), "{queries} queries over {capacity}");
        }
        assert!(shapes.contains(&(512, capacity_class(30_000))));
        assert!(!shapes.iter().any(|&(q, _)| q > 512 || q % 16 != 0));
        assert!(shapes.len() < 1000, "{} shapes", shapes.len());
    }
}
