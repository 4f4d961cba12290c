//! Times Tether's one-row CPU quantized product on weights that cannot stay
//! in cache: a model-sized set of matrices (more than the last-level cache)
//! visited in turn, as one decode step visits its layers. Prints the
//! effective read rate of everything the kernel touches (codes, scales,
//! biases), to compare with the machine's streaming read rate. 5-bit codes
//! are the 8-bit ones' top five bits, packed in Tether's layout.
//! Run: cargo run --release -p tether-mlx --example qmm_dram_bench
//! (`TETHER_CPU_ISA=avx2` for the AVX2 kernels on any x86 CPU; ROUNDS=N).
mod common;

use std::time::Instant;

use common::{activation_rows, projection_weight};
use mlx::{Array, Dtype};

/// `q` (8-bit codes) with each code's top five bits as Tether's 5-bit layout.
fn five_bit_from(q: &mlx::QuantizedWeights, n: usize, k: usize) -> mlx::QuantizedWeights {
    let words = q.packed.to_vec_u32().unwrap();
    let codes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).map(|b| b >> 3).collect();
    let packed = mlx::pack_5bit_codes(&codes, k).expect("rows of whole 64-code steps");
    mlx::QuantizedWeights { packed: Array::from_u32(&packed, &[n, k * 5 / 32]).unwrap(), bits: 5, ..q.clone() }
}

fn main() {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    // Qwen2.5-0.5B's gate/up projection shape, 48 copies: ~420 MB of 8-bit codes.
    let (k, n, copies) = (896usize, 9728usize, 48usize);
    let w = projection_weight(k, n);
    let x = activation_rows(1, k);
    let rounds: usize = std::env::var("ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(3);
    for bits in [8, 5, 4] {
        let mats: Vec<mlx::QuantizedWeights> = (0..copies)
            .map(|_| {
                let q = mlx::quantize(&w, 32, if bits == 5 { 8 } else { bits }).unwrap();
                let m = mlx::QuantizedWeights { scales: q.scales.astype(Dtype::F32).unwrap(), biases: q.biases.astype(Dtype::F32).unwrap(), ..q };
                let m = if bits == 5 { five_bit_from(&m, n, k) } else { m };
                mlx::eval(&[&m.packed, &m.scales, &m.biases]).unwrap();
                m
            })
            .collect();
        let bytes: usize = mats.iter().map(|m| m.packed.nbytes() + m.scales.nbytes() + m.biases.nbytes()).sum();
        for round in 0..rounds {
            let t = Instant::now();
            for m in &mats {
                mlx::cpu_quantized_matmul(&x, m).unwrap().eval().unwrap();
            }
            let s = t.elapsed().as_secs_f64();
            println!("{bits}-bit, {copies} x [{n},{k}], round {round}: {:.2} ms, {:.1} GB/s of {:.0} MB", s * 1e3, bytes as f64 / s / 1e9, bytes as f64 / 1e6);
        }
    }
}
