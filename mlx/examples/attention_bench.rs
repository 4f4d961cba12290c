//! Times the fused CPU attention against MLX's sdpa on the shapes that matter
//! for Tether on CPU: a 300-token turn over a 3,600-token cached history, and
//! a batched decode step of 32 sequences (MLX: one sdpa per sequence, with
//! the slicing and transposes a batched step needs around it), and the fused
//! kernel over keys stored in blocks (a Tether CPU cache's layout) beside the
//! same kernel transposing each block of position-order keys; then the
//! kernel over caches of 8- and 4-bit codes beside float32 ones.
//! Best of N, interleaved, since the machine is shared.
//! Run: cargo run --release -p tether-mlx --example attention_bench
mod common;

use common::best_ms;
use mlx::fast::{self, AttentionRow, KeyLayout, KvCodes, Mask};
use mlx::{Array, Dtype};

fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn random(shape: &[usize], seed: u64) -> Array {
    let a = Array::from_f32(&noise(shape.iter().product(), seed), shape).unwrap();
    a.eval().unwrap();
    a
}

/// `rows` of (n, kv_len): times MLX (per-row sdpa + layout ops + concat) and
/// the fused kernel, alternating, and prints both and their ratio.
fn compare(label: &str, heads: usize, kv_heads: usize, dim: usize, rows: &[(usize, usize)], iters: usize) {
    let total: usize = rows.iter().map(|r| r.0).sum();
    let width = (heads * dim) as i32;
    let q = random(&[1, total, heads * dim], 1);
    let caches: Vec<(Array, Array)> = rows
        .iter()
        .enumerate()
        .map(|(r, &(_, len))| {
            (random(&[1, kv_heads, len.next_multiple_of(256), dim], 2 + r as u64), random(&[1, kv_heads, len.next_multiple_of(256), dim], 900 + r as u64))
        })
        .collect();
    let scale = 1.0 / (dim as f32).sqrt();
    let view = |a: &Array, len: usize| a.slice(&[0, 0, 0, 0], &[1, kv_heads as i32, len as i32, dim as i32]).unwrap();

    let mut mlx_step = || {
        let mut outs = Vec::new();
        let mut s = 0i32;
        for (&(n, len), (k, v)) in rows.iter().zip(&caches) {
            let n = n as i32;
            let qr = q.slice(&[0, s, 0], &[1, s + n, width]).unwrap().reshape(&[1, n, heads as i32, dim as i32]).unwrap().transpose(&[0, 2, 1, 3]).unwrap();
            let o = fast::sdpa(&qr, &view(k, len), &view(v, len), scale, if n > 1 { Mask::Causal } else { Mask::None }).unwrap();
            outs.push(o.transpose(&[0, 2, 1, 3]).unwrap().reshape(&[1, n, width]).unwrap());
            s += n;
        }
        if outs.len() == 1 {
            outs.pop().unwrap()
        } else {
            mlx::concatenate(&outs.iter().collect::<Vec<_>>(), 1).unwrap()
        }
    };
    // (The timing does not depend on the keys' values, so the same random
    // buffers serve as keys in either layout.)
    let fused = |keys: KeyLayout| {
        let r: Vec<AttentionRow> = rows.iter().zip(&caches).map(|(&(n, kv_len), (k, v))| AttentionRow { keys: k, values: v, n, kv_len, first: 0 }).collect();
        fast::cpu_attention(&q, &r, keys, None, fast::KvCodes::Float).unwrap()
    };
    let mut by_positions = || fused(KeyLayout::Positions);
    let mut in_blocks = || fused(KeyLayout::Blocks);
    // Warm up all (allocator, thread pool).
    mlx_step().eval().unwrap();
    by_positions().eval().unwrap();
    in_blocks().eval().unwrap();
    let (mut a, mut b, mut c) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    for _ in 0..3 {
        a = a.min(best_ms(iters, &mut mlx_step));
        b = b.min(best_ms(iters, &mut by_positions));
        c = c.min(best_ms(iters, &mut in_blocks));
    }
    println!("{label:<44} mlx sdpa {a:>8.2} ms   fused {b:>7.2} ms (x{:.1})   keys in blocks {c:>7.2} ms (x{:.2} fused)", a / b, b / c);
}

/// A cache of `codes` holding `floats` (`[1, kv_heads, cap, dim]`), keys in
/// `layout`, written by the kernel's own write.
fn written(floats: &Array, layout: KeyLayout, codes: KvCodes) -> Array {
    let (kv_heads, cap, dim) = (floats.dim(1), floats.dim(2), floats.dim(3));
    let empty = Array::zeros(&[1, kv_heads, cap, codes.width(dim)], if codes == KvCodes::Float { Dtype::F32 } else { Dtype::U8 }).unwrap();
    let c = fast::cpu_kv_write(&empty, &floats.transpose(&[2, 1, 0, 3]).unwrap(), 0, cap, 0, layout, codes).unwrap();
    c.eval().unwrap();
    c
}

/// `rows` of (n, kv_len) over caches of float32, 8-bit and 4-bit codes
/// (keys in blocks, group 64), alternating; prints each and the ratios.
fn compare_codes(label: &str, heads: usize, kv_heads: usize, dim: usize, rows: &[(usize, usize)], iters: usize) {
    let total: usize = rows.iter().map(|r| r.0).sum();
    let q = random(&[1, total, heads * dim], 1);
    let forms = [KvCodes::Float, KvCodes::Affine { bits: 8, group: 64 }, KvCodes::Affine { bits: 4, group: 64 }];
    let caches: Vec<Vec<(Array, Array)>> = forms
        .iter()
        .map(|&codes| {
            rows.iter()
                .enumerate()
                .map(|(r, &(_, len))| {
                    let shape = [1, kv_heads, len.next_multiple_of(256), dim];
                    (written(&random(&shape, 2 + r as u64), KeyLayout::Blocks, codes), written(&random(&shape, 900 + r as u64), KeyLayout::Positions, codes))
                })
                .collect()
        })
        .collect();
    let step = |form: usize| {
        let r: Vec<AttentionRow> =
            rows.iter().zip(&caches[form]).map(|(&(n, kv_len), (k, v))| AttentionRow { keys: k, values: v, n, kv_len, first: 0 }).collect();
        fast::cpu_attention(&q, &r, KeyLayout::Blocks, None, forms[form]).unwrap()
    };
    let mut best = [f64::INFINITY; 3];
    for _ in 0..3 {
        for (form, b) in best.iter_mut().enumerate() {
            step(form).eval().unwrap();
            *b = b.min(best_ms(iters, &mut || step(form)));
        }
    }
    let [f, e, h] = best;
    println!("{label:<44} float32 {f:>7.2} ms   8-bit {e:>7.2} ms (x{:.2})   4-bit {h:>7.2} ms (x{:.2})", f / e, f / h);
}

fn main() {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    for (name, heads, kv_heads) in [("smollm2 (9/3 heads)", 9, 3), ("qwen2.5-0.5b (14/2 heads)", 14, 2)] {
        println!("-- {name}, head_dim 64, one layer");
        compare("300 new tokens over 3,600 cached", heads, kv_heads, 64, &[(300, 3900)], 2);
        compare("512-token prefill chunk from empty", heads, kv_heads, 64, &[(512, 512)], 3);
        compare("decode, 1 row at 4,000", heads, kv_heads, 64, &[(1, 4000)], 20);
        let decode32: Vec<(usize, usize)> = (0..32).map(|i| (1, 600 + 7 * i)).collect();
        compare("decode, 32 rows at ~700", heads, kv_heads, 64, &decode32, 10);
        let verify: Vec<(usize, usize)> = (0..8).map(|i| (5, 900 + 31 * i)).collect();
        compare("draft verification, 8 rows of 5 at ~1,000", heads, kv_heads, 64, &verify, 10);
    }
    for (name, heads, kv_heads) in [("smollm2 (9/3 heads)", 9, 3), ("qwen2.5-0.5b (14/2 heads)", 14, 2)] {
        println!("-- {name}, head_dim 64, one layer, keys in blocks: float32 against codes (ratios: float32 time / codes time)");
        compare_codes("decode, 1 row at 4,000", heads, kv_heads, 64, &[(1, 4000)], 20);
        let decode32: Vec<(usize, usize)> = (0..32).map(|i| (1, 600 + 7 * i)).collect();
        compare_codes("decode, 32 rows at ~700", heads, kv_heads, 64, &decode32, 10);
        compare_codes("300 new tokens over 3,600 cached", heads, kv_heads, 64, &[(300, 3900)], 2);
    }
}
