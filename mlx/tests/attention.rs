//! The fused CPU attention and cache write against MLX's own ops:
//! `fast::sdpa` with a causal mask aligned to the cache's end, and
//! `slice_update`.
use std::sync::Mutex;

use mlx::fast::{self, AttentionRow, KeyLayout, KvCodes, Mask, KEY_BLOCK};
use mlx::{Array, Dtype};

/// MLX graph building is per thread and its memory counters are global.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Deterministic values in [-amp, amp).
fn noise(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

/// A `[1, heads, cap, dim]` cache with valid data in its first `len`
/// positions and NaN after them, so any read past `len` shows in the output.
fn cache(heads: usize, cap: usize, len: usize, dim: usize, seed: u64) -> Array {
    let mut data = noise(heads * cap * dim, seed, 1.0);
    for h in 0..heads {
        for p in len..cap {
            data[(h * cap + p) * dim..(h * cap + p + 1) * dim].fill(f32::NAN);
        }
    }
    Array::from_f32(&data, &[1, heads, cap, dim]).unwrap()
}

struct Case {
    heads: usize,
    kv_heads: usize,
    dim: usize,
    /// (n, kv_len) per row.
    rows: Vec<(usize, usize)>,
}

fn max_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(g, w)| if g.is_nan() || w.is_nan() { f32::INFINITY } else { (g - w).abs() / (1.0 + w.abs()) }).fold(0.0, f32::max)
}

/// Runs `case` through cpu_attention (queries given as `[1, T, H*D]`, as a
/// strided view, and as `[T, H, 1, D]`) and compares each row to sdpa.
fn check(case: &Case, seed: u64) {
    let (hq, hkv, d) = (case.heads, case.kv_heads, case.dim);
    let total: usize = case.rows.iter().map(|r| r.0).sum();
    let width = hq * d;
    // Queries with a wide range, so softmax is peaked and the running max moves.
    let q = Array::from_f32(&noise(total * width, seed, 4.0), &[1, total, width]).unwrap();
    let caches: Vec<(Array, Array)> = case
        .rows
        .iter()
        .enumerate()
        .map(|(r, &(_, len))| {
            let cap = len + 3 + r * 17; // capacities past kv_len, not block multiples
            (cache(hkv, cap, len, d, seed * 31 + r as u64), cache(hkv, cap, len, d, seed * 37 + r as u64))
        })
        .collect();
    let rows: Vec<AttentionRow> =
        case.rows.iter().zip(&caches).map(|(&(n, kv_len), (k, v))| AttentionRow { keys: k, values: v, n, kv_len, first: 0 }).collect();

    // The reference: sdpa per row over the first kv_len positions.
    let mut want = Vec::new();
    let mut start = 0;
    for (&(n, kv_len), (k, v)) in case.rows.iter().zip(&caches) {
        let view = |a: &Array| a.slice(&[0, 0, 0, 0], &[1, hkv as i32, kv_len as i32, d as i32]).unwrap();
        let mask = if n > 1 { Mask::Causal } else { Mask::None };
        want.extend(sdpa_row(&q, start, n, hq, (&view(k), &view(v)), mask));
        start += n;
    }

    let got = fast::cpu_attention(&q, &rows, KeyLayout::Positions, None, KvCodes::Float).unwrap();
    assert_eq!(got.shape(), vec![1, total, width]);
    let err = max_error(&got.to_vec_f32().unwrap(), &want);
    assert!(err <= 2e-5, "heads {hq}/{hkv} dim {d} rows {:?}: max error {err}", case.rows);

    // The same queries as a view inside a wider array (like q inside qkv).
    let wide = Array::from_f32(&noise(total * (width + 48), seed + 1, 4.0), &[1, total, width + 48]).unwrap();
    let wide = wide.slice_update(&q, &[0, 0, 8], &[1, total as i32, (8 + width) as i32]).unwrap();
    let view = wide.slice(&[0, 0, 8], &[1, total as i32, (8 + width) as i32]).unwrap();
    assert!(
        max_error(&fast::cpu_attention(&view, &rows, KeyLayout::Positions, None, KvCodes::Float).unwrap().to_vec_f32().unwrap(), &want) <= 2e-5,
        "strided q"
    );

    // And in the [T, H, 1, D] layout rope produces.
    let q4 = q.reshape(&[total as i32, hq as i32, 1, d as i32]).unwrap();
    assert!(
        max_error(&fast::cpu_attention(&q4, &rows, KeyLayout::Positions, None, KvCodes::Float).unwrap().to_vec_f32().unwrap(), &want) <= 2e-5,
        "[T, H, 1, D] q"
    );

    // Keys stored in blocks give the same output, bit for bit: the same
    // products in the same order. Positions past kv_len hold NaN, as stale
    // keys of a block would, and must not show.
    let blocked: Vec<Array> = case.rows.iter().zip(&caches).map(|(&(_, kv_len), (k, _))| keys_in_blocks(k, kv_len)).collect();
    let rows: Vec<AttentionRow> =
        case.rows.iter().zip(&caches).zip(&blocked).map(|((&(n, kv_len), (_, v)), k)| AttentionRow { keys: k, values: v, n, kv_len, first: 0 }).collect();
    let in_blocks = fast::cpu_attention(&q, &rows, KeyLayout::Blocks, None, KvCodes::Float).unwrap().to_vec_f32().unwrap();
    assert!(in_blocks == got.to_vec_f32().unwrap(), "heads {hq}/{hkv} dim {d} rows {:?}: keys in blocks differ", case.rows);
}

/// MLX's attention for one row of a step: its `n` queries from token
/// `start` of `q` (`[1, T, heads * head_dim]`) over `keys`, `[1, n * width]`.
fn sdpa_row(q: &Array, start: usize, n: usize, heads: usize, (keys, values): (&Array, &Array), mask: Mask<'_>) -> Vec<f32> {
    let d = keys.dim(3);
    let width = heads * d;
    let qr = q
        .slice(&[0, start as i32, 0], &[1, (start + n) as i32, width as i32])
        .unwrap()
        .reshape(&[1, n as i32, heads as i32, d as i32])
        .unwrap()
        .transpose(&[0, 2, 1, 3])
        .unwrap();
    let o = fast::sdpa(&qr, keys, values, 1.0 / (d as f32).sqrt(), mask).unwrap();
    o.transpose(&[0, 2, 1, 3]).unwrap().reshape(&[1, n as i32, width as i32]).unwrap().to_vec_f32().unwrap()
}

/// A cache of whole blocks, NaN everywhere, with `keys`' first `len`
/// positions written in blocks by cpu_kv_write.
fn keys_in_blocks(keys: &Array, len: usize) -> Array {
    let (h, d) = (keys.dim(1) as i32, keys.dim(3) as i32);
    let cap = len.div_ceil(KEY_BLOCK) * KEY_BLOCK + KEY_BLOCK;
    let nan = Array::full(&[1, h as usize, cap, d as usize], f32::NAN, Dtype::F32).unwrap();
    // [len, heads, 1, dim]: the token layout the write takes.
    let fresh = keys.slice(&[0, 0, 0, 0], &[1, h, len as i32, d]).unwrap().transpose(&[2, 1, 0, 3]).unwrap();
    let out = fast::cpu_kv_write(&nan, &fresh, 0, len, 0, KeyLayout::Blocks, KvCodes::Float).unwrap();
    out.eval().unwrap();
    out
}

#[test]
fn matches_sdpa_for_mixed_rows() {
    let _s = serial();
    // Decode rows (n = 1), draft verification (small n), prefill chunks over a
    // history and from empty; lengths straddle the 64-key blocks.
    let rows = vec![(1, 1), (1, 130), (5, 70), (37, 37), (100, 300), (3, 64), (64, 129)];
    check(&Case { heads: 9, kv_heads: 3, dim: 64, rows: rows.clone() }, 1); // SmolLM2
    check(&Case { heads: 14, kv_heads: 2, dim: 64, rows: rows.clone() }, 2); // Qwen2.5-0.5B
    check(&Case { heads: 4, kv_heads: 4, dim: 128, rows: rows.clone() }, 3); // no grouping, wide heads
    check(&Case { heads: 6, kv_heads: 2, dim: 48, rows: rows.clone() }, 4); // 16-wide vector remainder
    check(&Case { heads: 4, kv_heads: 1, dim: 24, rows }, 5); // the portable path
}

#[test]
fn matches_sdpa_for_a_long_prefill_chunk() {
    let _s = serial();
    // A 300-token turn over a 3,600-token history, and a 512-token chunk.
    check(&Case { heads: 9, kv_heads: 3, dim: 64, rows: vec![(300, 3900)] }, 6);
    check(&Case { heads: 14, kv_heads: 2, dim: 64, rows: vec![(512, 1500), (1, 2000)] }, 7);
}

#[test]
fn rejects_inconsistent_rows() {
    let _s = serial();
    let q = Array::zeros(&[1, 4, 128], Dtype::F32).unwrap();
    let k = Array::zeros(&[1, 1, 8, 64], Dtype::F32).unwrap();
    let row = |n, kv_len| AttentionRow { keys: &k, values: &k, n, kv_len, first: 0 };
    assert!(fast::cpu_attention(&q, &[row(4, 8)], KeyLayout::Positions, None, KvCodes::Float).is_ok());
    assert!(fast::cpu_attention(&q, &[row(3, 8)], KeyLayout::Positions, None, KvCodes::Float).is_err(), "rows must cover q's tokens");
    assert!(fast::cpu_attention(&q, &[row(4, 9)], KeyLayout::Positions, None, KvCodes::Float).is_err(), "kv_len past the cache");
    assert!(fast::cpu_attention(&q, &[row(4, 3)], KeyLayout::Positions, None, KvCodes::Float).is_err(), "fewer keys than queries");
    let q3 = Array::zeros(&[1, 4, 96], Dtype::F32).unwrap();
    assert!(fast::cpu_attention(&q3, &[row(4, 8)], KeyLayout::Positions, None, KvCodes::Float).is_err(), "width not a multiple of head_dim");
    assert!(fast::cpu_attention(&q, &[row(4, 8)], KeyLayout::Blocks, None, KvCodes::Float).is_err(), "keys in blocks need whole blocks");
    let late = AttentionRow { keys: &k, values: &k, n: 4, kv_len: 12, first: 4 };
    assert!(fast::cpu_attention(&q, &[late], KeyLayout::Positions, Some(6), KvCodes::Float).is_err(), "a query sees position 3, which the cache dropped");
    assert!(fast::cpu_attention(&q, &[late], KeyLayout::Positions, Some(5), KvCodes::Float).is_ok());
}

/// Sliding-window rows whose caches start past position 0 (the positions
/// no query sees again dropped), against sdpa over the whole history with a
/// causal window mask; keys in position order and in blocks.
#[test]
fn matches_sdpa_with_a_sliding_window() {
    let _s = serial();
    let (hq, hkv, d, window) = (4, 1, 64, 100);
    // (n, kv_len, first): decode far past the window, a chunk crossing it,
    // a row still inside it, and a chunk wider than the window.
    let rows = [(1usize, 1000usize, 896usize), (37, 400, 256), (5, 60, 0), (150, 700, 448)];
    let total: usize = rows.iter().map(|r| r.0).sum();
    let width = hq * d;
    let q = Array::from_f32(&noise(total * width, 11, 4.0), &[1, total, width]).unwrap();
    let (mut want, mut start) = (Vec::new(), 0);
    let mut held = Vec::new();
    for (r, &(n, kv_len, first)) in rows.iter().enumerate() {
        let (k, v) = (cache(hkv, kv_len, kv_len, d, 40 + r as u64), cache(hkv, kv_len, kv_len, d, 50 + r as u64));
        let offset = kv_len - n;
        let mask: Vec<f32> = (0..n * kv_len)
            .map(|x| (offset + x / kv_len, x % kv_len))
            .map(|(qp, kp)| if kp <= qp && kp + window > qp { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        let mask = Array::from_f32(&mask, &[1, 1, n, kv_len]).unwrap();
        want.extend(sdpa_row(&q, start, n, hq, (&k, &v), Mask::Array(&mask)));
        start += n;
        // What the cache holds: positions first.., then NaN past kv_len.
        let kept = |a: &Array| {
            let tail = a.slice(&[0, 0, first as i32, 0], &[1, hkv as i32, kv_len as i32, d as i32]).unwrap();
            let out = Array::full(&[1, hkv, kv_len - first + 29, d], f32::NAN, Dtype::F32).unwrap();
            out.slice_update(&tail, &[0; 4], &[1, hkv as i32, (kv_len - first) as i32, d as i32]).unwrap()
        };
        held.push((kept(&k), kept(&v), kv_len - first));
    }
    let attention = |keys: &[Array], layout| {
        let rows: Vec<AttentionRow> =
            rows.iter().zip(keys).zip(&held).map(|((&(n, kv_len, first), k), (_, v, _))| AttentionRow { keys: k, values: v, n, kv_len, first }).collect();
        fast::cpu_attention(&q, &rows, layout, Some(window), KvCodes::Float).unwrap().to_vec_f32().unwrap()
    };
    let in_order = attention(&held.iter().map(|h| h.0.clone()).collect::<Vec<_>>(), KeyLayout::Positions);
    let err = max_error(&in_order, &want);
    assert!(err <= 2e-5, "window {window}: max error {err}");
    let blocked: Vec<Array> = held.iter().map(|(k, _, len)| keys_in_blocks(k, *len)).collect();
    assert!(attention(&blocked, KeyLayout::Blocks) == in_order, "keys in blocks differ");
}

#[test]
fn kv_write_matches_slice_update_and_respects_snapshots() {
    let _s = serial();
    let (heads, cap, dim, tokens) = (3, 40, 64, 7);
    let fresh = Array::from_f32(&noise(tokens * heads * dim, 9, 1.0), &[1, tokens, heads * dim]).unwrap();
    // Reference: tokens 2..6 written at positions 10..14 with slice_update.
    let update =
        fresh.slice(&[0, 2, 0], &[1, 6, (heads * dim) as i32]).unwrap().reshape(&[1, 4, heads as i32, dim as i32]).unwrap().transpose(&[0, 2, 1, 3]).unwrap();
    let base = Array::from_f32(&noise(heads * cap * dim, 10, 1.0), &[1, heads, cap, dim]).unwrap();
    base.eval().unwrap();
    let want = base.slice_update(&update, &[0, 0, 10, 0], &[1, heads as i32, 14, dim as i32]).unwrap().to_vec_f32().unwrap();
    let before = base.to_vec_f32().unwrap();

    // A snapshot shares the buffer: the write must go to a copy.
    let snapshot = base.clone();
    let written = fast::cpu_kv_write(&base, &fresh, 2, 4, 10, KeyLayout::Positions, KvCodes::Float).unwrap();
    assert_eq!(written.to_vec_f32().unwrap(), want);
    assert_eq!(snapshot.to_vec_f32().unwrap(), before, "a shared buffer was written in place");

    // The sole holder's buffer is written in place: no second buffer appears.
    drop(snapshot);
    let big = Array::zeros(&[1, heads, 4096, dim], Dtype::F32).unwrap().add(&Array::scalar(1.0, Dtype::F32).unwrap()).unwrap();
    big.eval().unwrap();
    let active = mlx::memory::active();
    let out = fast::cpu_kv_write(&big, &fresh, 0, tokens, 100, KeyLayout::Positions, KvCodes::Float).unwrap();
    drop(big);
    out.eval().unwrap();
    let grown = mlx::memory::active().saturating_sub(active);
    assert!(grown < heads * 4096 * dim * 4 / 2, "the write copied the cache ({grown} bytes more)");
    let v = out.slice(&[0, 1, 100, 0], &[1, 2, 101, dim as i32]).unwrap().to_vec_f32().unwrap();
    assert_eq!(v, fresh.slice(&[0, 0, dim as i32], &[1, 1, 2 * dim as i32]).unwrap().to_vec_f32().unwrap());
    assert_eq!(out.slice(&[0, 2, 99, 0], &[1, 3, 100, 1]).unwrap().to_vec_f32().unwrap(), vec![1.0]);

    // A broadcast zero buffer (a fresh cache) is materialized, then written.
    let zeros = Array::zeros(&[1, heads, 16, dim], Dtype::F32).unwrap();
    let out = fast::cpu_kv_write(&zeros, &fresh, 6, 1, 15, KeyLayout::Positions, KvCodes::Float).unwrap().to_vec_f32().unwrap();
    assert_eq!(out[(2 * 16 + 15) * dim..(2 * 16 + 16) * dim], fresh.slice(&[0, 6, 2 * dim as i32], &[1, 7, 3 * dim as i32]).unwrap().to_vec_f32().unwrap()[..]);
    assert!(out.chunks(dim).enumerate().filter(|(i, _)| i % 16 != 15).all(|(_, row)| row.iter().all(|&x| x == 0.0)));

    // In blocks: tokens 1..7 at positions 60..66 straddle a block boundary;
    // block b of a head holds [feature][position] for positions 64b..64b+63.
    let cap = 2 * KEY_BLOCK;
    let out = fast::cpu_kv_write(&Array::zeros(&[1, heads, cap, dim], Dtype::F32).unwrap(), &fresh, 1, 6, 60, KeyLayout::Blocks, KvCodes::Float)
        .unwrap()
        .to_vec_f32()
        .unwrap();
    let fresh_v = fresh.to_vec_f32().unwrap();
    for h in 0..heads {
        for p in 0..cap {
            for f in 0..dim {
                let stored = out[h * cap * dim + (p / KEY_BLOCK) * KEY_BLOCK * dim + f * KEY_BLOCK + p % KEY_BLOCK];
                let want = if (60..66).contains(&p) { fresh_v[(1 + p - 60) * heads * dim + h * dim + f] } else { 0.0 };
                assert_eq!(stored, want, "head {h} position {p} feature {f}");
            }
        }
    }
    let odd = Array::zeros(&[1, heads, KEY_BLOCK + 8, dim], Dtype::F32).unwrap();
    assert!(fast::cpu_kv_write(&odd, &fresh, 0, 1, 0, KeyLayout::Blocks, KvCodes::Float).is_err(), "a capacity of part blocks");
}

#[test]
fn rope_with_per_token_offsets_matches_per_row_rope() {
    // The batched forward ropes all tokens of a step at once as [T, H, 1, D]
    // with one position per token; MLX's rope takes one offset per leading index.
    let _s = serial();
    let (heads, dim) = (3, 64);
    let rows = [(0usize, 4usize), (17, 1), (250, 3)]; // (offset, n)
    let total: usize = rows.iter().map(|r| r.1).sum();
    let x = Array::from_f32(&noise(total * heads * dim, 11, 1.0), &[1, total, heads * dim]).unwrap();
    let positions: Vec<i32> = rows.iter().flat_map(|&(o, n)| (o..o + n).map(|p| p as i32)).collect();
    let pos = Array::from_i32(&positions, &[total]).unwrap();
    let all = fast::rope_offsets(&x.reshape(&[total as i32, heads as i32, 1, dim as i32]).unwrap(), dim as i32, false, 10000.0, 1.0, &pos).unwrap();
    let got = all.reshape(&[1, total as i32, (heads * dim) as i32]).unwrap().to_vec_f32().unwrap();
    let mut want = Vec::new();
    let mut s = 0;
    for &(offset, n) in &rows {
        let xr = x
            .slice(&[0, s as i32, 0], &[1, (s + n) as i32, (heads * dim) as i32])
            .unwrap()
            .reshape(&[1, n as i32, heads as i32, dim as i32])
            .unwrap()
            .transpose(&[0, 2, 1, 3])
            .unwrap();
        let r = fast::rope(&xr, dim as i32, false, 10000.0, 1.0, offset as i32).unwrap();
        want.extend(r.transpose(&[0, 2, 1, 3]).unwrap().reshape(&[1, n as i32, (heads * dim) as i32]).unwrap().to_vec_f32().unwrap());
        s += n;
    }
    assert!(max_error(&got, &want) <= 1e-6, "error {}", max_error(&got, &want));
}

/// The affine `bits`-bit codes of one group, written independently of the
/// kernel: (codes, scale, bias) with bias the group's min.
fn quantize_group(x: &[f32], bits: u8) -> (Vec<u8>, f32, f32) {
    let levels = ((1u32 << bits) - 1) as f32;
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let scale = (hi - lo) / levels;
    let codes = x.iter().map(|&v| if scale > 0.0 { ((v - lo) / scale).round().clamp(0.0, levels) as u8 } else { 0 }).collect();
    (codes, scale, lo)
}

/// `x <- H x / sqrt(n)` (H: Hadamard, Sylvester's order) by float32
/// butterflies, as the kernel rotates a head vector before quantizing it.
fn rotate(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let norm = (1.0 / (n as f64).sqrt()) as f32;
    x.iter_mut().for_each(|v| *v *= norm);
}

/// `[1, heads, len, dim]` position-order values written through a cache of
/// `codes` (`layout`), read back dequantized.
fn through_codes(values: &Array, layout: KeyLayout, codes: KvCodes) -> Array {
    let (h, len, d) = (values.dim(1), values.dim(2), values.dim(3));
    let cap = len.div_ceil(KEY_BLOCK) * KEY_BLOCK;
    let empty = Array::zeros(&[1, h, cap, codes.width(d)], Dtype::U8).unwrap();
    let fresh = values.transpose(&[2, 1, 0, 3]).unwrap(); // [len, heads, 1, dim]
    let cache = fast::cpu_kv_write(&empty, &fresh, 0, len, 0, layout, codes).unwrap();
    fast::cpu_kv_dequantize(&cache, len, layout, codes).unwrap()
}

#[test]
fn codes_round_trip_like_the_reference_quantizer() {
    let _s = serial();
    let (heads, len, dim, group) = (3, 130, 64, 32);
    let mut data = noise(heads * len * dim, 21, 3.0);
    data[5] = 40.0; // an outlier widens its group's scale (rotated, its position's groups') only
    data[dim..2 * dim].fill(0.5); // a constant position
    let values = Array::from_f32(&data, &[1, heads, len, dim]).unwrap();
    for bits in [8u8, 4] {
        let codes = KvCodes::Affine { bits, group };
        // Each head vector (64 features, a power of two) of keys (stored in
        // blocks) rotated, quantized in groups, dequantized and rotated back;
        // values only quantized.
        let want = |rotated: bool| -> Vec<f32> {
            data.chunks(dim)
                .flat_map(|position| {
                    let mut x = position.to_vec();
                    if rotated {
                        rotate(&mut x);
                    }
                    let mut back: Vec<f32> = x
                        .chunks(group)
                        .flat_map(|g| {
                            let (codes, scale, bias) = quantize_group(g, bits);
                            codes.into_iter().map(move |c| c as f32 * scale + bias)
                        })
                        .collect();
                    if rotated {
                        rotate(&mut back);
                    }
                    back
                })
                .collect()
        };
        for layout in [KeyLayout::Positions, KeyLayout::Blocks] {
            let want = want(layout == KeyLayout::Blocks);
            let got = through_codes(&values, layout, codes).to_vec_f32().unwrap();
            assert_eq!(got.len(), want.len());
            let err = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0.0, f32::max);
            assert!(err <= 1e-5, "{bits} bits, {layout:?}: differs from the reference quantizer by {err}");
            // A position's error is at most half a step per feature, in length
            // (which the rotation keeps; rotated features of noise in [-3, 3)
            // span less than 6 here), the outlier's position aside.
            let step = 6.0 / ((1u32 << bits) - 1) as f32;
            for (p, (g, x)) in got.chunks(dim).zip(data.chunks(dim)).enumerate().skip(1) {
                let err = g.iter().zip(x).map(|(g, x)| (g - x).powi(2)).sum::<f32>().sqrt();
                assert!(err <= (dim as f32).sqrt() * step / 2.0, "{bits} bits, {layout:?}: position {p}'s error {err} past half a step a feature");
            }
            // A constant position is exact (rotated, it is one nonzero feature).
            assert!(got[dim..2 * dim].iter().all(|&x| x == 0.5), "{bits} bits, {layout:?}: a constant position");

            // Written a few positions at a time (4-bit positions share bytes
            // with their neighbours), the cache reads back the same.
            let cap = len.div_ceil(KEY_BLOCK) * KEY_BLOCK;
            let fresh = values.transpose(&[2, 1, 0, 3]).unwrap();
            let mut cache = Array::zeros(&[1, heads, cap, codes.width(dim)], Dtype::U8).unwrap();
            for pos in (0..len).step_by(7).rev() {
                let n = 7.min(len - pos);
                cache = fast::cpu_kv_write(&cache, &fresh, pos, n, pos, layout, codes).unwrap();
                cache.eval().unwrap();
            }
            let piecewise = fast::cpu_kv_dequantize(&cache, len, layout, codes).unwrap().to_vec_f32().unwrap();
            assert!(piecewise == got, "{bits} bits, {layout:?}: written piecewise, read back differently");
        }
    }
    for (width, bits) in [(70, 8), (40, 4), (72, 3)] {
        let odd = Array::zeros(&[1, 1, 64, width], Dtype::U8).unwrap();
        let write = fast::cpu_kv_write(&odd, &values.transpose(&[2, 1, 0, 3]).unwrap(), 0, 1, 0, KeyLayout::Positions, KvCodes::Affine { bits, group: 32 });
        assert!(write.is_err(), "width {width} at {bits} bits is no head size's");
    }
}

#[test]
fn attention_over_caches_of_codes_equals_attention_over_their_values() {
    let _s = serial();
    for bits in [8, 4] {
        attention_over_codes_equals_attention_over_their_values(KvCodes::Affine { bits, group: 64 });
    }
}

fn attention_over_codes_equals_attention_over_their_values(codes: KvCodes) {
    let (hq, hkv, d) = (9, 3, 64);
    // (n, kv_len): decode far into a history, a chunk, and a short row.
    let shape = [(1usize, 700usize), (37, 300), (3, 5)];
    let total: usize = shape.iter().map(|r| r.0).sum();
    let q = Array::from_f32(&noise(total * hq * d, 31, 4.0), &[1, total, hq * d]).unwrap();
    let mut float_caches = Vec::new();
    let mut code_caches = Vec::new();
    for (r, &(_, len)) in shape.iter().enumerate() {
        let cap = len.div_ceil(KEY_BLOCK) * KEY_BLOCK;
        let k = Array::from_f32(&noise(hkv * len * d, 60 + r as u64, 2.0), &[1, hkv, len, d]).unwrap();
        let v = Array::from_f32(&noise(hkv * len * d, 70 + r as u64, 2.0), &[1, hkv, len, d]).unwrap();
        let write = |a: &Array, layout| {
            let empty = Array::zeros(&[1, hkv, cap, codes.width(d)], Dtype::U8).unwrap();
            let c = fast::cpu_kv_write(&empty, &a.transpose(&[2, 1, 0, 3]).unwrap(), 0, len, 0, layout, codes).unwrap();
            c.eval().unwrap();
            c
        };
        code_caches.push((write(&k, KeyLayout::Blocks), write(&v, KeyLayout::Positions)));
        // The float caches hold what the codes stand for.
        let (kd, vd) = (through_codes(&k, KeyLayout::Blocks, codes), through_codes(&v, KeyLayout::Positions, codes));
        float_caches.push((keys_in_blocks(&kd, len), vd));
    }
    let attend = |caches: &[(Array, Array)], mixed: bool| {
        let rows: Vec<AttentionRow> = shape
            .iter()
            .zip(caches)
            .enumerate()
            .map(|(r, (&(n, kv_len), (k, v)))| {
                let (k, v) = if mixed && r == 1 { (&float_caches[r].0, &float_caches[r].1) } else { (k, v) };
                AttentionRow { keys: k, values: v, n, kv_len, first: 0 }
            })
            .collect();
        fast::cpu_attention(&q, &rows, KeyLayout::Blocks, None, codes).unwrap().to_vec_f32().unwrap()
    };
    let want = attend(&float_caches, false);
    for mixed in [false, true] {
        let err = max_error(&attend(&code_caches, mixed), &want);
        assert!(err <= 1e-5, "{codes:?}, mixed {mixed}: max error {err}");
    }
}

/// A float32 array of the numpy oracle's KV codes fixture
/// (`tests/reference/make_kv_codes_fixture.py`).
fn kv_codes_fixture(name: &str, shape: &[usize]) -> Array {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/kv_codes").join(format!("{name}.f32"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let data: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    Array::from_f32(&data, shape).unwrap()
}

#[test]
fn codes_and_attention_over_them_match_the_numpy_oracle() {
    let _s = serial();
    for bits in [8, 4] {
        codes_and_attention_over_them_match_the_numpy_oracle_at(bits);
    }
}

fn codes_and_attention_over_them_match_the_numpy_oracle_at(bits: u8) {
    // The fixture's geometry (its meta.json).
    let (hq, hkv, d, len, group) = (6, 2, 64, 96, 32);
    let rows = [(1usize, 96usize), (8, 70), (3, 3)];
    let total: usize = rows.iter().map(|r| r.0).sum();
    let codes = KvCodes::Affine { bits, group };
    let kv = |name: &str| kv_codes_fixture(name, &[1, hkv, len, d]);
    let (keys, values) = (kv("keys"), kv("values"));
    let close = |got: &[f32], want: &[f32], what: &str| {
        assert_eq!(got.len(), want.len(), "{what}");
        // Codes must agree exactly: one code apart is a whole step (~0.1 here).
        let err = got.iter().zip(want).map(|(g, w)| (g - w).abs() / (1.0 + w.abs())).fold(0.0, f32::max);
        assert!(err <= 2e-6, "{what}: differs from numpy by {err}");
    };
    // Keys (in blocks) are quantized rotated, values (by position) as they are.
    for (values_in, kind, layout) in [(&keys, "keys", KeyLayout::Blocks), (&values, "values", KeyLayout::Positions)] {
        let want = format!("{kind}_dequantized_{bits}bit");
        close(&through_codes(values_in, layout, codes).to_vec_f32().unwrap(), &kv(&want).to_vec_f32().unwrap(), &want);
    }
    let cap = len.div_ceil(KEY_BLOCK) * KEY_BLOCK;
    let write = |a: &Array, layout| {
        let empty = Array::zeros(&[1, hkv, cap, codes.width(d)], Dtype::U8).unwrap();
        let c = fast::cpu_kv_write(&empty, &a.transpose(&[2, 1, 0, 3]).unwrap(), 0, len, 0, layout, codes).unwrap();
        c.eval().unwrap();
        c
    };
    let (k, v) = (write(&keys, KeyLayout::Blocks), write(&values, KeyLayout::Positions));
    let q = kv_codes_fixture("queries", &[1, total, hq * d]);
    let attention_rows: Vec<AttentionRow> = rows.iter().map(|&(n, kv_len)| AttentionRow { keys: &k, values: &v, n, kv_len, first: 0 }).collect();
    let got = fast::cpu_attention(&q, &attention_rows, KeyLayout::Blocks, None, codes).unwrap().to_vec_f32().unwrap();
    let want = kv_codes_fixture(&format!("attention_{bits}bit"), &[total, hq, d]).to_vec_f32().unwrap();
    let err = max_error(&got, &want);
    assert!(err <= 1e-5, "attention over {bits}-bit codes differs from numpy's by {err}");
}

/// One case of [`layer_attention_equals_rope_write_and_attention_apart`].
struct LayerCase {
    traditional: bool,
    /// Per-pair periods instead of a base (scaled RoPE).
    periods: bool,
    layout: KeyLayout,
    codes: KvCodes,
    window: Option<usize>,
}

#[test]
fn layer_attention_equals_rope_write_and_attention_apart() {
    // cpu_layer_attention is RoPE, two cache writes a row and cpu_attention
    // in one node: its attention and updated caches must equal those three
    // apart bit for bit, for either pairing of RoPE, per-pair periods, both
    // key layouts, caches of codes and a window.
    let _s = serial();
    let float = KvCodes::Float;
    let eight = KvCodes::Affine { bits: 8, group: 32 };
    let cases = [
        LayerCase { traditional: false, periods: false, layout: KeyLayout::Positions, codes: float, window: None },
        LayerCase { traditional: true, periods: false, layout: KeyLayout::Blocks, codes: float, window: None },
        LayerCase { traditional: false, periods: true, layout: KeyLayout::Blocks, codes: float, window: Some(40) },
        LayerCase { traditional: false, periods: false, layout: KeyLayout::Blocks, codes: eight, window: None },
        LayerCase { traditional: true, periods: false, layout: KeyLayout::Positions, codes: eight, window: None },
    ];
    for (i, case) in cases.iter().enumerate() {
        check_layer_case(case, 100 + i as u64);
    }
}

fn check_layer_case(case: &LayerCase, seed: u64) {
    let (hq, hkv, d) = (6usize, 2usize, 64usize);
    // (n, kv_len) per row: a decode token, a prompt chunk, a short fresh prompt.
    let rows = [(1usize, 150usize), (20, 90), (3, 3)];
    let total: usize = rows.iter().map(|r| r.0).sum();
    let cap = 3 * KEY_BLOCK;
    let width = (hq + 2 * hkv) * d;
    let qkv = Array::from_f32(&noise(total * width, seed, 2.0), &[1, total, width]).unwrap();
    let positions: Vec<i32> = rows.iter().flat_map(|&(n, kv_len)| (kv_len - n..kv_len).map(|p| p as i32)).collect();
    let positions = Array::from_i32(&positions, &[total]).unwrap();
    let periods = Array::from_f32(&(0..d / 2).map(|i| 3.0 * 500f32.powf(2.0 * i as f32 / d as f32)).collect::<Vec<_>>(), &[d / 2]).unwrap();
    let rope = |x: &Array| match case.periods {
        false => fast::rope_offsets(x, d as i32, case.traditional, 10000.0, 1.0, &positions).unwrap(),
        true => fast::rope_offsets_freqs(x, d as i32, case.traditional, 1.0, &positions, &periods).unwrap(),
    };
    // Each row's cache holds its earlier positions (whatever they are) in the case's form.
    let caches: Vec<(Array, Array)> = rows
        .iter()
        .enumerate()
        .map(|(r, &(n, kv_len))| {
            let held = kv_len - n;
            let form = |s: u64, layout| {
                let floats = Array::from_f32(&noise(held.max(1) * hkv * d, s, 1.0), &[held.max(1), hkv, 1, d]).unwrap();
                let empty = Array::zeros(&[1, hkv, cap, case.codes.width(d)], if case.codes == KvCodes::Float { Dtype::F32 } else { Dtype::U8 }).unwrap();
                let c = if held == 0 { empty.add(&empty).unwrap() } else { fast::cpu_kv_write(&empty, &floats, 0, held, 0, layout, case.codes).unwrap() };
                c.eval().unwrap();
                c
            };
            (form(seed * 10 + r as u64, case.layout), form(seed * 20 + r as u64, KeyLayout::Positions))
        })
        .collect();

    // Apart: MLX's RoPE on queries and keys, the writes, the attention.
    let qk = qkv.slice(&[0, 0, 0], &[1, total as i32, ((hq + hkv) * d) as i32]).unwrap().reshape(&[total as i32, (hq + hkv) as i32, 1, d as i32]).unwrap();
    let qk = rope(&qk);
    let q = qk.slice(&[0, 0, 0, 0], &[total as i32, hq as i32, 1, d as i32]).unwrap();
    let k = qk.slice(&[0, hq as i32, 0, 0], &[total as i32, (hq + hkv) as i32, 1, d as i32]).unwrap();
    let v = qkv.slice(&[0, 0, ((hq + hkv) * d) as i32], &[1, total as i32, width as i32]).unwrap();
    let mut start = 0;
    let mut apart = Vec::new();
    for ((keys, values), &(n, kv_len)) in caches.iter().zip(&rows) {
        let at = kv_len - n;
        apart.push((
            fast::cpu_kv_write(keys, &k, start, n, at, case.layout, case.codes).unwrap(),
            fast::cpu_kv_write(values, &v, start, n, at, KeyLayout::Positions, case.codes).unwrap(),
        ));
        start += n;
    }
    let step: Vec<AttentionRow<'_>> = apart.iter().zip(&rows).map(|((k, v), &(n, kv_len))| AttentionRow { keys: k, values: v, n, kv_len, first: 0 }).collect();
    let want = fast::cpu_attention(&q, &step, case.layout, case.window, case.codes).unwrap();

    // As one node, turned by the table MLX's RoPE makes of a unit head.
    let unit: Vec<f32> = (0..d).map(|f| if case.traditional { ((f + 1) % 2) as f32 } else { (f < d / 2) as u8 as f32 }).collect();
    let unit = Array::from_f32(&unit, &[1, 1, 1, d]).unwrap().broadcast_to(&[total as i32, 1, 1, d as i32]).unwrap();
    let table = rope(&unit).reshape(&[total as i32, d as i32]).unwrap();
    let step: Vec<AttentionRow<'_>> = caches.iter().zip(&rows).map(|((k, v), &(n, kv_len))| AttentionRow { keys: k, values: v, n, kv_len, first: 0 }).collect();
    let (got, updated) =
        fast::cpu_layer_attention(&qkv, fast::RopeTable { table: &table, traditional: case.traditional }, hq, &step, case.layout, case.window, case.codes)
            .unwrap();
    let what = format!("traditional {} periods {} {:?} {:?} window {:?}", case.traditional, case.periods, case.layout, case.codes, case.window);
    assert_eq!(got.to_bytes().unwrap(), want.to_bytes().unwrap(), "attention differs: {what}");
    assert_eq!(updated.len(), rows.len());
    for (r, ((k, v), (wk, wv))) in updated.iter().zip(&apart).enumerate() {
        assert_eq!(k.to_bytes().unwrap(), wk.to_bytes().unwrap(), "row {r}'s keys differ: {what}");
        assert_eq!(v.to_bytes().unwrap(), wv.to_bytes().unwrap(), "row {r}'s values differ: {what}");
    }
}

#[test]
fn layer_attention_writes_a_sole_cache_in_place_and_a_shared_one_on_a_copy() {
    let _s = serial();
    let (hq, hkv, d, cap) = (2usize, 1usize, 64usize, 4096usize);
    let qkv = Array::from_f32(&noise((hq + 2 * hkv) * d, 7, 1.0), &[1, 1, (hq + 2 * hkv) * d]).unwrap();
    let unit: Vec<f32> = (0..d).map(|f| (f < d / 2) as u8 as f32).collect();
    let table = fast::rope_offsets(&Array::from_f32(&unit, &[1, 1, 1, d]).unwrap(), d as i32, false, 10000.0, 1.0, &Array::from_i32(&[100], &[1]).unwrap())
        .unwrap()
        .reshape(&[1, d as i32])
        .unwrap();
    let buffer = || {
        let b = Array::zeros(&[1, hkv, cap, d], Dtype::F32).unwrap().add(&Array::scalar(1.0, Dtype::F32).unwrap()).unwrap();
        b.eval().unwrap();
        b
    };
    let run = |keys: &Array, values: &Array| {
        let rows = [AttentionRow { keys, values, n: 1, kv_len: 101, first: 0 }];
        fast::cpu_layer_attention(&qkv, fast::RopeTable { table: &table, traditional: false }, hq, &rows, KeyLayout::Blocks, None, KvCodes::Float).unwrap()
    };
    table.eval().unwrap();

    // Held elsewhere too (a snapshot): written on a copy, the original unchanged.
    let (keys, values) = (buffer(), buffer());
    let (out, updated) = run(&keys, &values);
    mlx::eval(&[&out, &updated[0].0, &updated[0].1]).unwrap();
    assert!(keys.to_vec_f32().unwrap().iter().all(|&x| x == 1.0), "a shared key buffer was written in place");
    assert!(values.to_vec_f32().unwrap().iter().all(|&x| x == 1.0), "a shared value buffer was written in place");
    let v = updated[0].1.slice(&[0, 0, 100, 0], &[1, 1, 101, d as i32]).unwrap().to_vec_f32().unwrap();
    assert_eq!(v, qkv.slice(&[0, 0, ((hq + hkv) * d) as i32], &[1, 1, ((hq + 2 * hkv) * d) as i32]).unwrap().to_vec_f32().unwrap());
    drop((out, updated));

    // The node's input is the last holder: no second buffer appears.
    // (The peak, not what is held after: a copy frees the buffer it copied.)
    let (keys, values) = (buffer(), buffer());
    let active = mlx::memory::active();
    mlx::memory::reset_peak();
    let (out, updated) = run(&keys, &values);
    drop((keys, values));
    mlx::eval(&[&out, &updated[0].0, &updated[0].1]).unwrap();
    let grown = mlx::memory::peak().saturating_sub(active);
    assert!(grown < hkv * cap * d * 4 / 2, "the write copied a cache ({grown} bytes more at the peak)");
}
