//! Times Tether's one-row CPU quantized product on weights that cannot stay
//! in cache: a model-sized set of matrices (more than the last-level cache)
//! visited in turn, as one decode step visits its layers. Prints the
//! effective read rate of everything the kernel touches (codes, scales,
//! biases), to compare with the machine's streaming read rate.
//! Run: cargo run --release -p tether-mlx --example qmm_dram_bench
mod common;

use std::time::Instant;

use common::{activation_rows, projection_weight};
use mlx::Dtype;

fn main() {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    // Qwen2.5-0.5B's gate/up projection shape, 48 copies: ~420 MB of 8-bit codes.
    let (k, n, copies) = (896usize, 9728usize, 48usize);
    let w = projection_weight(k, n);
    let x = activation_rows(1, k);
    for bits in [8, 4] {
        let mats: Vec<mlx::QuantizedWeights> = (0..copies)
            .map(|_| {
                let q = mlx::quantize(&w, 32, bits).unwrap();
                let m = mlx::QuantizedWeights { scales: q.scales.astype(Dtype::F32).unwrap(), biases: q.biases.astype(Dtype::F32).unwrap(), ..q };
                mlx::eval(&[&m.packed, &m.scales, &m.biases]).unwrap();
                m
            })
            .collect();
        let bytes: usize = mats.iter().map(|m| m.packed.nbytes() + m.scales.nbytes() + m.biases.nbytes()).sum();
        for round in 0..3 {
            let t = Instant::now();
            for m in &mats {
                mlx::cpu_quantized_matmul(&x, m).unwrap().eval().unwrap();
            }
            let s = t.elapsed().as_secs_f64();
            println!("{bits}-bit, {copies} x [{n},{k}], round {round}: {:.2} ms, {:.1} GB/s of {:.0} MB", s * 1e3, bytes as f64 / s / 1e9, bytes as f64 / 1e6);
        }
    }
}
