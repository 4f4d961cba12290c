//! Kernel warm-up before a GPU engine takes requests.
//!
//! MLX's CUDA backend compiles some kernels at first use (NVRTC), among them
//! the quantized matmuls of more than one row: several seconds each, and a
//! model has one per projection width. Left to the first requests, that
//! shows up as a first token after a minute and as "speculation is slow"
//! (verification is the first multi-row decode). One forward of each shape
//! class the engine runs moves that cost to start-up; compiled kernels are
//! also kept on disk by MLX, so a restarted server starts faster.
use crate::model::{BatchedRows, RowInput, Transformer, GATHERED_ROWS_MULTIPLE, SHARED_ATTENTION_SCORES};

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

/// Gathered row counts the warm-up runs (in steps of
/// [`GATHERED_ROWS_MULTIPLE`]): a prompt chunk beside decoding rows, up to
/// this many rows in all.
const WARM_UP_GATHERED_ROWS: usize = 256;

/// Runs, and discards, forwards of every row-count class through a row's
/// own cache and, when running rows are batched, through batch slots.
pub(super) fn warm_up(model: &Transformer, batched: bool) -> mlx::Result<()> {
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
            kv.admit(&cache)?;
        }
        let others = WARM_UP_SLOTS - 1;
        let gathered = (2 * GATHERED_ROWS_MULTIPLE..=WARM_UP_GATHERED_ROWS).step_by(GATHERED_ROWS_MULTIPLE).map(|rows| ((rows - others, 1), (1, 1)));
        for ((first, first_logits), (rest, rest_logits)) in WARM_UP_SLOT_STEPS.into_iter().chain(gathered) {
            let tokens = (0..WARM_UP_SLOTS).map(|s| vec![1; if s == 0 { first } else { rest }]).collect();
            let logits = (0..WARM_UP_SLOTS).map(|s| if s == 0 { first_logits } else { rest_logits }).collect();
            let rows = BatchedRows { kv: &mut kv, tokens, logits, shared_scores: SHARED_ATTENTION_SCORES };
            let step = model.forward_step(Some(rows), &mut [])?;
            let logits: Vec<&mlx::Array> = step.batched.iter().flatten().collect();
            mlx::eval(&logits.into_iter().chain(kv.buffers()).collect::<Vec<_>>())?;
            // Keep the slots short: these steps are about shapes, not lengths.
            for slot in 0..WARM_UP_SLOTS {
                kv.truncate(slot, cache.len());
            }
        }
    }
    Ok(())
}

