//! Times Tether's CPU quantized matmul with many activation rows (batched
//! decode of 8-64 streams, draft verification) on SmolLM2-135M's projection
//! shapes, beside BLAS on the same weights expanded to float32: how far the
//! compute-bound tiled path is from the machine's GEMM. Prints GFLOP/s.
//! Best of N, interleaved, since the machine is shared.
//! Run: cargo run --release -p tether-mlx --example qmm_rows_bench
mod common;

use common::{activation_rows, best_ms, projection_weight, SMOLLM2_PROJECTIONS};
use mlx::Dtype;

fn main() {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    println!("{:>6} {:>6} {:>4} {:>5} {:>10} {:>10} {:>8}", "K", "N", "bits", "rows", "kernel", "f32 BLAS", "ratio");
    for (k, n) in SMOLLM2_PROJECTIONS {
        let w = projection_weight(k, n);
        let bits = if n == 49152 { 8 } else { 4 };
        let q = mlx::quantize(&w, 32, bits).unwrap();
        let q32 = mlx::QuantizedWeights { scales: q.scales.astype(Dtype::F32).unwrap(), biases: q.biases.astype(Dtype::F32).unwrap(), ..q.clone() };
        mlx::eval(&[&q32.packed, &q32.scales, &q32.biases]).unwrap();
        let dense = mlx::dequantize(&q32, Dtype::F32).unwrap();
        dense.eval().unwrap();
        for m in [8usize, 16, 32, 64] {
            let x = activation_rows(m, k);
            let flops = 2.0 * (m * k * n) as f64;
            let iters = if n > 10000 { 5 } else { 30 };
            let kernel = best_ms(iters, &mut || mlx::cpu_quantized_matmul(&x, &q32).unwrap());
            let blas = best_ms(iters, &mut || x.matmul(&dense.transpose(&[1, 0]).unwrap()).unwrap());
            println!("{k:>6} {n:>6} {bits:>4} {m:>5} {:>7.1} GF {:>7.1} GF {:>8.2}", flops / kernel / 1e6, flops / blas / 1e6, blas / kernel);
        }
    }
}
