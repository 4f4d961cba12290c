//! Times the CPU panel kernel for dense float32 weights (`cpu_panel_matmul`)
//! beside MLX's matmul (BLAS) on SmolLM2-135M's projection shapes, from one
//! row (decode) through 32 (batched decode) to prefill chunks. Prints GFLOP/s;
//! best of N, the two interleaved, since the machine is shared.
//! `PANEL_K=1536` times only the shapes with that input size.
//! Run: cargo run --release -p tether-mlx --example panel_bench
mod common;

use common::{activation_rows, best_ms, projection_weight, SMOLLM2_PROJECTIONS};

fn main() {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    if !mlx::cpu_panels_supported() {
        println!("this CPU has no AVX-512: the panel kernel is not used");
        return;
    }
    let only_k: Option<usize> = std::env::var("PANEL_K").ok().and_then(|v| v.parse().ok());
    println!("{:>6} {:>6} {:>5} {:>10} {:>10} {:>8}", "K", "N", "rows", "panels", "BLAS", "ratio");
    for (k, n) in SMOLLM2_PROJECTIONS {
        if only_k.is_some_and(|o| o != k) {
            continue;
        }
        let w = projection_weight(k, n);
        let panels = mlx::cpu_pack_panels(&w).unwrap();
        panels.eval().unwrap();
        let wt = w.transpose(&[1, 0]).unwrap();
        for m in [1usize, 8, 32, 64, 340, 512] {
            let x = activation_rows(m, k);
            let flops = 2.0 * (m * k * n) as f64;
            let iters = if n > 10000 || m > 300 { 5 } else { 30 };
            let (mut kernel, mut blas) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..2 {
                kernel = kernel.min(best_ms(iters, &mut || mlx::cpu_panel_matmul(&x, &panels, n).unwrap()));
                blas = blas.min(best_ms(iters, &mut || x.matmul(&wt).unwrap()));
                // OpenBLAS's threads spin for a while after a call, taking a
                // core from whatever runs next.
                std::thread::sleep(std::time::Duration::from_millis(300));
            }
            println!("{k:>6} {n:>6} {m:>5} {:>7.1} GF {:>7.1} GF {:>8.2}", flops / kernel / 1e6, flops / blas / 1e6, blas / kernel);
        }
    }
}
