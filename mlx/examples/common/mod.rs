//! Timing shared by the benchmark examples.
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
