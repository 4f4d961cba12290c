//! Kernel warm-up before a GPU engine takes requests.
//!
//! MLX's CUDA backend compiles some kernels at first use (NVRTC), among them
//! the quantized matmuls of more than one row: several seconds each, and a
//! model has one per projection width. Left to the first requests, that
//! shows up as a first token after a minute and as "speculation is slow"
//! (verification is the first multi-row decode). One forward of each shape
//! class the engine runs moves that cost to start-up; compiled kernels are
//! also kept on disk by MLX, so a restarted server starts faster.
use crate::model::{BatchedRows, RowInput, Transformer};

/// Token counts of the warm-up forwards. MLX picks a quantized matmul's
/// kernel by row count: under 8 rows a matrix-vector kernel, from 8 rows
/// tiles of 16, 32 and 64 rows (larger counts reuse the 64-row tile); each
/// tile is a separate compile (20-45 s each on an NVIDIA H200:
/// bench/results/gpu-h200-jit-compiles.txt). 8 and 16 rows are what batched
/// decode and draft verification (up to 16 tokens) hit first.
const WARM_UP_TOKENS: [usize; 5] = [1, 8, 16, 32, 64];

/// Runs, and discards, forwards of every row-count class through a row's
/// own cache and, when decoding rows are batched, a decode step and
/// verifications of 2 and 16 tokens through a batch slot.
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
        kv.admit(&cache)?;
        for n in [1usize, 2, 16] {
            let ids = mlx::Array::from_i32(&vec![1; n], &[1, n])?;
            let step = model.forward_step(Some(BatchedRows { kv: &mut kv, ids, real: vec![n] }), &mut [])?;
            let logits: Vec<&mlx::Array> = step.batched.iter().flatten().collect();
            mlx::eval(&logits.into_iter().chain(kv.buffers()).collect::<Vec<_>>())?;
        }
    }
    Ok(())
}
