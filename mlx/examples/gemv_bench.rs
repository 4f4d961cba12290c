//! Times one decode-shaped product (1 x K times K x N) on the CPU for dense
//! float32 and MLX's 4- and 8-bit affine forms, against a plain memory read of
//! the same weights: where a decode step's time goes on this machine.
//! Run: cargo run --release -p tether-mlx --example gemv_bench
use std::time::Instant;

use mlx::{Array, Dtype};

fn time_it(label: &str, bytes: usize, iters: usize, mut f: impl FnMut() -> Array) {
    f().eval().unwrap();
    let t = Instant::now();
    for _ in 0..iters {
        f().eval().unwrap();
    }
    let s = t.elapsed().as_secs_f64() / iters as f64;
    println!("{label:<28} {:>8.3} ms  {:>6.1} GB/s of weights", s * 1e3, bytes as f64 / s / 1e9);
}

fn main() {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    for (k, n) in [(576usize, 3072usize), (896, 9728), (576, 49152)] {
        println!("-- x[1,{k}] @ W[{n},{k}]^T");
        let data: Vec<f32> = (0..k * n).map(|i| ((i * 2654435761usize) % 1000) as f32 / 1000.0 - 0.5).collect();
        let w = Array::from_f32(&data, &[n, k]).unwrap();
        let x = Array::from_f32(&vec![0.1; k], &[1, k]).unwrap();
        w.eval().unwrap();
        let wt = w.transpose(&[1, 0]).unwrap();
        time_it("f32 matmul", n * k * 4, 50, || x.matmul(&wt).unwrap());
        time_it("f32 weight sum (read only)", n * k * 4, 50, || w.sum(&[0, 1], false).unwrap());
        let bf = w.astype(Dtype::BF16).unwrap();
        bf.eval().unwrap();
        let xb = x.astype(Dtype::BF16).unwrap();
        time_it("bf16 matmul", n * k * 2, 5, || xb.matmul(&bf.transpose(&[1, 0]).unwrap()).unwrap());
        for bits in [4, 8] {
            let q = mlx::quantize(&w, 32, bits).unwrap();
            mlx::eval(&[&q.packed, &q.scales, &q.biases]).unwrap();
            time_it(&format!("{bits}-bit quantized_matmul"), n * k * bits as usize / 8, 20, || mlx::quantized_matmul(&x, &q).unwrap());
            let q32 = mlx::QuantizedWeights { scales: q.scales.astype(Dtype::F32).unwrap(), biases: q.biases.astype(Dtype::F32).unwrap(), ..q.clone() };
            time_it(&format!("{bits}-bit tether cpu kernel"), n * k * bits as usize / 8, 50, || mlx::cpu_quantized_matmul(&x, &q32).unwrap());
            for m in [4usize, 16] {
                let xm = Array::from_f32(&vec![0.1; m * k], &[m, k]).unwrap();
                time_it(&format!("{bits}-bit tether kernel, {m} rows"), n * k * bits as usize / 8, 20, || mlx::cpu_quantized_matmul(&xm, &q32).unwrap());
            }
        }
    }
}
