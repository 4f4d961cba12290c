//! Timing shared by the benchmark examples.
//! (Each example uses part of this module.)
#![allow(dead_code)]
use std::time::Instant;

use mlx::Array;

/// Best wall time of `f` (built and evaluated) over `iters` runs, in ms,
/// after one untimed run (first use allocates and, on a GPU, compiles).
/// The best rather than the mean: the machines these run on are shared.
pub fn best_ms(iters: usize, f: &mut dyn FnMut() -> Array) -> f64 {
    f().eval().unwrap();
    (0..iters)
        .map(|_| {
            let t = Instant::now();
            f().eval().unwrap();
            t.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::INFINITY, f64::min)
}

/// SmolLM2-135M's projection shapes `(in, out)`: fused q/k/v, o, fused
/// gate/up, down, and the tied output head.
pub const SMOLLM2_PROJECTIONS: [(usize, usize); 5] = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)];

/// A `[out, in]` float32 weight of spread-out values in [-0.5, 0.5), evaluated.
pub fn projection_weight(in_features: usize, out_features: usize) -> Array {
    let data: Vec<f32> = (0..in_features * out_features).map(|i| ((i * 2654435761usize) % 1000) as f32 / 1000.0 - 0.5).collect();
    let w = Array::from_f32(&data, &[out_features, in_features]).unwrap();
    w.eval().unwrap();
    w
}

/// `rows` activation rows of `in_features`, evaluated.
pub fn activation_rows(rows: usize, in_features: usize) -> Array {
    let x = Array::from_f32(&(0..rows * in_features).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect::<Vec<_>>(), &[rows, in_features]).unwrap();
    x.eval().unwrap();
    x
}
