//! Checks of the binding against values computed by hand, on the CPU device.
use std::sync::Mutex;

use mlx::{fast, random, Array, Dtype};

/// MLX's memory counters are process-wide; tests take this lock so the
/// memory test sees only its own allocations.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
}

#[test]
fn matmul_and_readback() {
    let _serial = serial();
    let a = Array::from_f32(&[1., 2., 3., 4., 5., 6.], &[2, 3]).unwrap();
    let b = Array::from_f32(&[1., 0., 0., 1., 1., 1.], &[3, 2]).unwrap();
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.shape(), vec![2, 2]);
    assert_eq!(c.to_vec_f32().unwrap(), vec![4., 5., 10., 11.]);
}

/// Raw bytes out of a view (a transposed slice) and back in, in float32
/// and bfloat16, give the same values; a wrong byte count is an error.
#[test]
fn raw_bytes_round_trip() {
    let _serial = serial();
    let base = Array::from_f32(&(0..24).map(|i| i as f32 * 0.5 - 3.0).collect::<Vec<_>>(), &[2, 3, 4]).unwrap();
    let view = base.transpose(&[0, 2, 1]).unwrap().slice(&[0, 1, 0], &[2, 4, 3]).unwrap();
    for dtype in [Dtype::F32, Dtype::BF16] {
        let a = view.astype(dtype).unwrap();
        let bytes = a.to_bytes().unwrap();
        assert_eq!(bytes.len(), a.size() * if dtype == Dtype::F32 { 4 } else { 2 });
        let back = Array::from_bytes(&bytes, &a.shape(), dtype).unwrap();
        assert_eq!(back.dtype(), dtype);
        assert_eq!(back.shape(), vec![2, 3, 3]);
        assert_eq!(back.to_vec_f32().unwrap(), a.to_vec_f32().unwrap());
    }
    assert!(Array::from_bytes(&[0u8; 7], &[2], Dtype::F32).is_err());
}

#[test]
fn errors_are_values_not_panics() {
    let _serial = serial();
    let a = Array::from_f32(&[1., 2., 3.], &[3]).unwrap();
    let b = Array::from_f32(&[1., 2.], &[2]).unwrap();
    let err = a.matmul(&b).unwrap_err();
    assert_eq!(err.op, "matmul");
    assert!(!err.message.is_empty());
    assert!(Array::from_f32(&[1., 2., 3.], &[2, 2]).is_err(), "length/shape mismatch must be an error");
    assert!(a.reshape(&[2, 2]).is_err());
}

#[test]
fn transposed_readback_is_row_major() {
    let _serial = serial();
    let a = Array::from_f32(&[1., 2., 3., 4., 5., 6.], &[2, 3]).unwrap();
    assert_eq!(a.transpose(&[1, 0]).unwrap().to_vec_f32().unwrap(), vec![1., 4., 2., 5., 3., 6.]);
}

#[test]
fn slice_update_writes_a_window() {
    let _serial = serial();
    let cache = Array::zeros(&[1, 4, 2], Dtype::F32).unwrap();
    let upd = Array::from_f32(&[1., 2., 3., 4.], &[1, 2, 2]).unwrap();
    let out = cache.slice_update(&upd, &[0, 1, 0], &[1, 3, 2]).unwrap();
    assert_eq!(out.to_vec_f32().unwrap(), vec![0., 0., 1., 2., 3., 4., 0., 0.]);
    let start = Array::from_i32(&[2], &[1]).unwrap();
    let out2 = cache.slice_update_dynamic(&upd, &start, &[1]).unwrap();
    assert_eq!(out2.to_vec_f32().unwrap(), vec![0., 0., 0., 0., 1., 2., 3., 4.]);
    let back = out2.slice(&[0, 2, 0], &[1, 4, 2]).unwrap();
    assert_eq!(back.to_vec_f32().unwrap(), vec![1., 2., 3., 4.]);
}

#[test]
fn sdpa_matches_softmax_attention() {
    let _serial = serial();
    let q = Array::from_f32(&[0.1, 0.2, 0.3, 0.4, -0.5, 0.6, 0.7, 0.8], &[1, 1, 2, 4]).unwrap();
    let k = Array::from_f32(&[0.3, -0.1, 0.2, 0.5, 0.1, 0.1, -0.4, 0.2], &[1, 1, 2, 4]).unwrap();
    let v = Array::from_f32(&[1., 2., 3., 4., 5., 6., 7., 8.], &[1, 1, 2, 4]).unwrap();
    let scale = 0.5f32;
    let got = fast::sdpa(&q, &k, &v, scale, fast::Mask::Causal).unwrap().to_vec_f32().unwrap();
    // Row 0 attends only to key 0; row 1 to both.
    let qv = q.to_vec_f32().unwrap();
    let kv = k.to_vec_f32().unwrap();
    let dot = |i: usize, j: usize| (0..4).map(|d| qv[i * 4 + d] * kv[j * 4 + d]).sum::<f32>() * scale;
    let (s0, s1) = (dot(1, 0), dot(1, 1));
    let (w0, w1) = ((s0).exp() / (s0.exp() + s1.exp()), (s1).exp() / (s0.exp() + s1.exp()));
    let mut want = vec![1., 2., 3., 4.];
    want.extend((0..4).map(|d| w0 * (1. + d as f32) + w1 * (5. + d as f32)));
    assert!(close(&got, &want, 1e-5), "{got:?} vs {want:?}");
}

#[test]
fn rms_norm_and_rope() {
    let _serial = serial();
    let x = Array::from_f32(&[3., 4.], &[1, 2]).unwrap();
    let w = Array::from_f32(&[1., 2.], &[2]).unwrap();
    let y = fast::rms_norm(&x, &w, 0.0).unwrap().to_vec_f32().unwrap();
    let r = (12.5f32).sqrt();
    assert!(close(&y, &[3. / r, 8. / r], 1e-6));
    // Position 1 rotates the pair (1, 0) by one radian (base irrelevant for dim 2).
    let x = Array::from_f32(&[1., 0.], &[1, 1, 1, 2]).unwrap();
    let y = fast::rope(&x, 2, true, 10000.0, 1.0, 1).unwrap().to_vec_f32().unwrap();
    assert!(close(&y, &[1f32.cos(), 1f32.sin()], 1e-6), "{y:?}");
}

#[test]
fn quantize_roundtrip_and_matmul() {
    let _serial = serial();
    let data: Vec<f32> = (0..64 * 8).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
    let w = Array::from_f32(&data, &[8, 64]).unwrap();
    let q = mlx::quantize(&w, 32, 4).unwrap();
    let back = mlx::dequantize(&q, Dtype::F32).unwrap().to_vec_f32().unwrap();
    assert!(close(&back, &data, 0.07), "4-bit roundtrip too far off");
    let x = Array::from_f32(&vec![0.5; 64], &[1, 64]).unwrap();
    let y = mlx::quantized_matmul(&x, &q).unwrap().to_vec_f32().unwrap();
    let deq = Array::from_f32(&back, &[8, 64]).unwrap();
    let want = x.matmul(&deq.transpose(&[1, 0]).unwrap()).unwrap().to_vec_f32().unwrap();
    assert!(close(&y, &want, 1e-4));
}

#[test]
fn seeded_sampling_is_reproducible() {
    let _serial = serial();
    let logits = Array::from_f32(&[0.0, 1.0, 2.0, 3.0], &[1, 4]).unwrap();
    let a = random::categorical(&logits, -1, &random::key(7).unwrap()).unwrap().to_vec_i32().unwrap();
    let b = random::categorical(&logits, -1, &random::key(7).unwrap()).unwrap().to_vec_i32().unwrap();
    assert_eq!(a, b);
    assert!((0..4).contains(&a[0]));
}

#[test]
fn memory_stats_track_live_arrays() {
    let _serial = serial();
    mlx::memory::clear_cache().unwrap();
    let before = mlx::memory::active();
    let a = Array::zeros(&[1024, 1024], Dtype::F32).unwrap();
    a.eval().unwrap();
    assert!(mlx::memory::active() >= before + 4 * 1024 * 1024);
    drop(a);
    assert!(mlx::memory::active() < before + 4 * 1024 * 1024);
}

/// sqrt(sum (a - b)^2 / sum b^2): the error measure of the reference tests.
fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Where the CPU has AVX-512 VNNI the kernel multiplies x quantized to 16
/// bits per weight group. With activation_rows' outliers (100x, the group
/// holding one loses precision) it measured 0.7-1.6e-4 (the float kernel:
/// 4e-7); without them ~1e-5.
const QMM_MAX_RELATIVE_ERROR: f64 = 3e-4;

/// Activation rows with one outlier per row (100x the rest), as real
/// activations have: per-group scales keep the other groups precise.
fn activation_rows(m: usize, k: usize) -> Vec<f32> {
    (0..m * k).map(|i| if i % k == 37 { 50.0 } else { ((i * 7919) % 313) as f32 / 313.0 - 0.5 }).collect()
}

#[test]
fn cpu_quantized_matmul_matches_dequantized_product() {
    let _serial = serial();
    let (n, k) = (200, 576);
    let data: Vec<f32> = (0..n * k).map(|i| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0).collect();
    let w = Array::from_f32(&data, &[n, k]).unwrap();
    // Groups of 32 (GGUF's blocks) and 64 (mlx-lm's default).
    for (bits, group) in [(4, 32), (8, 32), (4, 64), (8, 64)] {
        let q = mlx::quantize(&w, group, bits).unwrap();
        let dense = mlx::dequantize(&q, Dtype::F32).unwrap();
        for m in [1usize, 3, 4, 5, 7, 16, 64] {
            let x = Array::from_f32(&activation_rows(m, k), &[m, k]).unwrap();
            let got = mlx::cpu_quantized_matmul(&x, &q).unwrap().to_vec_f32().unwrap();
            let want = x.matmul(&dense.transpose(&[1, 0]).unwrap()).unwrap().to_vec_f32().unwrap();
            let err = relative_error(&got, &want);
            assert!(err < QMM_MAX_RELATIVE_ERROR, "bits {bits}, groups of {group}, rows {m}: relative error {err:.2e}");
        }
    }
    let too_many = Array::zeros(&[mlx::cpu_quantized_matmul_max_rows() + 1, k], Dtype::F32).unwrap();
    let q = mlx::quantize(&w, 32, 4).unwrap();
    assert!(mlx::cpu_quantized_matmul(&too_many, &q).is_err());
}

/// The CPU's parallel dequantize gives MLX's values bit for bit (prefill
/// products use it in place of MLX's), for 4 and 8 bits in the group sizes
/// MLX quantizes to,
/// row counts that do and do not split evenly over the pool, and bad shapes
/// refused.
#[test]
fn cpu_dequantize_is_bit_identical_to_mlx() {
    let _serial = serial();
    for (n, k) in [(1usize, 128usize), (37, 640), (200, 1536)] {
        let data: Vec<f32> = (0..n * k).map(|i| ((i * 2654435761usize) % 1000) as f32 / 317.0 - 1.3).collect();
        let w = Array::from_f32(&data, &[n, k]).unwrap();
        for (bits, group) in [(4, 32), (8, 32), (4, 64), (8, 64), (4, 128)] {
            let q = mlx::quantize(&w, group, bits).unwrap();
            let want = mlx::dequantize(&q, Dtype::F32).unwrap().to_vec_f32().unwrap();
            let got = mlx::cpu_dequantize(&q).unwrap().to_vec_f32().unwrap();
            assert_eq!(got.len(), want.len());
            let differ = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(differ, 0, "{n}x{k}, {bits} bits, groups of {group}: {differ} values differ");
        }
    }
    let q = mlx::quantize(&Array::zeros(&[4, 64], Dtype::F32).unwrap(), 32, 4).unwrap();
    let odd = mlx::QuantizedWeights { bits: 3, ..q };
    assert!(mlx::cpu_dequantize(&odd).is_err());
}

/// Tether's 5-bit codes (GGUF's Q5 blocks), groups of 32: `n` rows of `k`,
/// with the dense matrix they stand for (code * scale, then + bias, as the
/// CPU dequantize rounds).
fn five_bit_weights(n: usize, k: usize) -> (mlx::QuantizedWeights, Vec<f32>) {
    let codes: Vec<u8> = (0..n * k).map(|i| ((i * 2654435761usize) >> 7) as u8 % 32).collect();
    let groups = k / 32;
    let scales: Vec<f32> = (0..n * groups).map(|i| 0.01 + (i % 17) as f32 * 0.003).collect();
    let biases: Vec<f32> = (0..n * groups).map(|i| -0.2 + (i % 13) as f32 * 0.01).collect();
    let dense = codes.iter().enumerate().map(|(i, &c)| c as f32 * scales[i / 32] + biases[i / 32]).collect();
    let packed = mlx::pack_5bit_codes(&codes, k).expect("a packable shape");
    let q = mlx::QuantizedWeights {
        packed: Array::from_u32(&packed, &[n, k * 5 / 32]).unwrap(),
        scales: Array::from_f32(&scales, &[n, groups]).unwrap(),
        biases: Array::from_f32(&biases, &[n, groups]).unwrap(),
        group_size: 32,
        bits: 5,
    };
    (q, dense)
}

/// 5-bit codes: the CPU dequantize gives code * scale + bias exactly, the
/// decode kernel the dense product within the integer path's bar for every
/// row count (integer and tiled paths), a row's output does not depend on
/// its neighbours within each regime, and shapes the layout cannot hold are
/// refused.
#[test]
fn five_bit_codes_dequantize_exactly_and_multiply_like_dense() {
    let _serial = serial();
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let (n, k) = (133, 640);
    let (q, dense) = five_bit_weights(n, k);
    let got = mlx::cpu_dequantize(&q).unwrap().to_vec_f32().unwrap();
    let differ = got.iter().zip(&dense).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    assert_eq!(differ, 0, "{differ} of {} dequantized values differ", dense.len());
    let w = Array::from_f32(&dense, &[n, k]).unwrap();
    let xs = activation_rows(37, k);
    let product = |m: usize| mlx::cpu_quantized_matmul(&Array::from_f32(&xs[..m * k], &[m, k]).unwrap(), &q).unwrap().to_vec_f32().unwrap();
    for m in [1usize, 2, 3, 4, 5, 7, 16, 37] {
        let x = Array::from_f32(&xs[..m * k], &[m, k]).unwrap();
        let want = x.matmul(&w.transpose(&[1, 0]).unwrap()).unwrap().to_vec_f32().unwrap();
        let err = relative_error(&product(m), &want);
        assert!(err < QMM_MAX_RELATIVE_ERROR, "5 bits, rows {m}: relative error {err:.2e}");
    }
    for (batch, parts) in [(3usize, &[1usize, 2][..]), (37, &[4, 5, 9, 36][..])] {
        let batched = product(batch);
        for &m in parts {
            assert_eq!(product(m), batched[..m * n], "5 bits: the first {m} rows alone differ from the same rows among {batch}");
        }
    }
    assert!(mlx::pack_5bit_codes(&[0; 96], 96).is_none(), "rows of 96 are not whole steps");
    assert!(mlx::pack_5bit_codes(&[32; 64], 64).is_none(), "codes of 6 bits");
    let wide_groups = mlx::QuantizedWeights {
        scales: Array::zeros(&[n, k / 64], Dtype::F32).unwrap(),
        biases: Array::zeros(&[n, k / 64], Dtype::F32).unwrap(),
        group_size: 64,
        ..q
    };
    assert!(mlx::cpu_dequantize(&wide_groups).is_err());
    assert!(mlx::cpu_quantized_matmul(&Array::zeros(&[1, k], Dtype::F32).unwrap(), &wide_groups).is_err());
}

/// The norm in front, the bias and the residual after, folded into the
/// product's node, give what the separate ops give.
#[test]
fn cpu_quantized_matmul_fused_equals_norm_product_add() {
    let _serial = serial();
    let (n, k, m) = (96, 576, 3);
    let data: Vec<f32> = (0..n * k).map(|i| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0).collect();
    let q = mlx::quantize(&Array::from_f32(&data, &[n, k]).unwrap(), 32, 4).unwrap();
    let q = mlx::QuantizedWeights { scales: q.scales.astype(Dtype::F32).unwrap(), biases: q.biases.astype(Dtype::F32).unwrap(), ..q };
    let x = Array::from_f32(&activation_rows(m, k), &[1, m, k]).unwrap();
    let norm: Vec<f32> = (0..k).map(|i| 0.5 + (i % 7) as f32 / 7.0).collect();
    let norm = Array::from_f32(&norm, &[k]).unwrap();
    let residual: Vec<f32> = (0..m * n).map(|i| (i % 11) as f32 - 5.0).collect();
    let residual = Array::from_f32(&residual, &[1, m, n]).unwrap();
    let bias: Vec<f32> = (0..n).map(|i| (i % 5) as f32 * 0.25).collect();
    let bias = Array::from_f32(&bias, &[n]).unwrap();
    let all = mlx::QmmFusion { norm: Some((&norm, 1e-5)), bias: Some(&bias), residual: Some(&residual) };
    let got = mlx::cpu_quantized_matmul_fused(&x, &q, all).unwrap().to_vec_f32().unwrap();
    let normed = fast::rms_norm(&x, &norm, 1e-5).unwrap();
    let want = residual.add(&mlx::cpu_quantized_matmul(&normed, &q).unwrap().add(&bias).unwrap()).unwrap().to_vec_f32().unwrap();
    let err = relative_error(&got, &want);
    assert!(err < 1e-6, "fused vs four ops: relative error {err:.2e}");
    // The adds alone are exact.
    let product = mlx::cpu_quantized_matmul(&x, &q).unwrap();
    let adds = mlx::QmmFusion { bias: Some(&bias), residual: Some(&residual), ..Default::default() };
    let with_adds = mlx::cpu_quantized_matmul_fused(&x, &q, adds).unwrap().to_vec_f32().unwrap();
    assert_eq!(with_adds, residual.add(&product.add(&bias).unwrap()).unwrap().to_vec_f32().unwrap());
    let bad = Array::from_f32(&[0.0; 4], &[4]).unwrap();
    let refused = |f: mlx::QmmFusion<'_>| mlx::cpu_quantized_matmul_fused(&x, &q, f).is_err();
    assert!(refused(mlx::QmmFusion { norm: Some((&bad, 1e-5)), ..Default::default() }), "a norm weight of the wrong size is refused");
    assert!(refused(mlx::QmmFusion { bias: Some(&bad), ..Default::default() }), "a bias of the wrong size is refused");
    assert!(refused(mlx::QmmFusion { residual: Some(&bad), ..Default::default() }), "a residual of the wrong shape is refused");
}

/// A row's output does not depend on the other rows of the call. With
/// AVX-512, within each of the kernel's two regimes: 1-3 rows (decode and
/// short drafts; the integer path on a CPU with VNNI) and 4 or more (batched
/// decode, verification; the tiled float path). Without it (the AVX2 kernel,
/// one regime), across any number of rows.
#[test]
fn cpu_quantized_matmul_rows_do_not_depend_on_their_neighbours() {
    let _serial = serial();
    let (n, k) = (133, 640);
    let data: Vec<f32> = (0..n * k).map(|i| ((i * 2654435761usize) % 997) as f32 / 500.0 - 1.0).collect();
    let w = Array::from_f32(&data, &[n, k]).unwrap();
    let xs = activation_rows(37, k);
    let product =
        |q: &mlx::QuantizedWeights, m: usize| mlx::cpu_quantized_matmul(&Array::from_f32(&xs[..m * k], &[m, k]).unwrap(), q).unwrap().to_vec_f32().unwrap();
    for bits in [4, 8] {
        let q = mlx::quantize(&w, 32, bits).unwrap();
        let q = mlx::QuantizedWeights { scales: q.scales.astype(Dtype::F32).unwrap(), biases: q.biases.astype(Dtype::F32).unwrap(), ..q };
        // Vector kernels take up to 3 rows one way (integer dots on AVX2 and
        // AVX-512 VNNI) and more another: rows match within each regime.
        let regimes: &[(usize, &[usize])] = if mlx::cpu_isa() == "portable" { &[(37, &[1, 2, 3, 4, 5, 9, 36])] } else { &[(3, &[1, 2]), (37, &[4, 5, 9, 36])] };
        for &(batch, parts) in regimes {
            let batched = product(&q, batch);
            for &m in parts {
                assert_eq!(product(&q, m), batched[..m * n], "bits {bits}: the first {m} rows alone differ from the same rows among {batch}");
            }
        }
    }
}

#[test]
fn cpu_swiglu_matches_silu_times_up() {
    let _g = serial();
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    // 48 features (the AVX-512 path) and 13 (the scalar path), values far
    // into both tails of the sigmoid.
    for ff in [48usize, 13] {
        let rows = 5;
        let data: Vec<f32> = (0..rows * 2 * ff).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.9).collect();
        let gate_up = Array::from_f32(&data, &[1, rows, 2 * ff]).unwrap();
        let got = fast::cpu_swiglu(&gate_up).unwrap();
        assert_eq!(got.shape(), vec![1, rows, ff]);
        let gate = gate_up.slice(&[0, 0, 0], &[1, rows as i32, ff as i32]).unwrap();
        let up = gate_up.slice(&[0, 0, ff as i32], &[1, rows as i32, 2 * ff as i32]).unwrap();
        let want = gate.silu().unwrap().multiply(&up).unwrap().to_vec_f32().unwrap();
        let got = got.to_vec_f32().unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "ff {ff}: {g} vs {w}");
        }
    }
    // Bad input is an error, not a crash.
    assert!(fast::cpu_swiglu(&Array::from_f32(&[1.0, 2.0, 3.0], &[1, 3]).unwrap()).is_err());
}

/// `x @ w^T` for dense float32 weights, as a model runs it on this CPU:
/// through the panel kernel where the CPU has AVX-512 (the model packs its
/// weights at load, `Linear::lay_out_for_cpu`), else through MLX's matmul
/// (the weights stay as they are, and the kernel refuses to run). Either
/// way the product is checked against a float64 loop written here, and the
/// panel layout (plain MLX ops, on every CPU) element by element.
#[test]
fn dense_products_match_a_reference_through_panels_where_the_cpu_has_them() {
    let _serial = serial();
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    // 70 outputs: one full 48-wide panel and a short one; an input size that
    // is no multiple of a vector; row counts around the 8-row blocks, up to a
    // prefill chunk's.
    let (n, k) = (70usize, 90usize);
    // Uniform in [-1, 1): values of mixed sign, as activations and weights are.
    let values = |shape: &[i32], seed: u64| {
        random::uniform(shape, &random::key(seed).unwrap())
            .unwrap()
            .multiply(&Array::scalar(2.0, Dtype::F32).unwrap())
            .unwrap()
            .subtract(&Array::scalar(1.0, Dtype::F32).unwrap())
            .unwrap()
    };
    let w = values(&[n as i32, k as i32], 11);
    let w_host = w.to_vec_f32().unwrap();
    let panels = mlx::cpu_pack_panels(&w).unwrap();
    panels.eval().unwrap();
    assert_eq!(panels.shape(), vec![2, k, 48]);
    let packed = panels.to_vec_f32().unwrap();
    for (i, &got) in packed.iter().enumerate() {
        let (panel, input, lane) = (i / (k * 48), i / 48 % k, i % 48);
        let row = panel * 48 + lane;
        let want = if row < n { w_host[row * k + input] } else { 0.0 };
        assert_eq!(got, want, "panel {panel}, input {input}, lane {lane}");
    }

    let rows = values(&[300, k as i32], 5);
    let rows_host = rows.to_vec_f32().unwrap();
    let reference = |m: usize| -> Vec<f32> {
        let dot = |r: usize, o: usize| (0..k).map(|i| f64::from(rows_host[r * k + i]) * f64::from(w_host[o * k + i])).sum::<f64>() as f32;
        (0..m).flat_map(|r| (0..n).map(move |o| (r, o))).map(|(r, o)| dot(r, o)).collect()
    };
    let kernel = mlx::cpu_panels_supported();
    let mut alone = Vec::new();
    for m in [1usize, 2, 7, 8, 9, 32, 300] {
        // The first m rows of one set, so row 0 is the same row in every call.
        let x = rows.slice(&[0, 0], &[m as i32, k as i32]).unwrap().reshape(&[1, m as i32, k as i32]).unwrap();
        let got = if kernel { mlx::cpu_panel_matmul(&x, &panels, n) } else { x.matmul(&w.transpose(&[1, 0]).unwrap()) }.unwrap();
        assert_eq!(got.shape(), vec![1, m, n]);
        let got = got.to_vec_f32().unwrap();
        assert!(close(&got, &reference(m), 1e-4), "{m} rows (panel kernel: {kernel})");
        if !kernel {
            continue;
        }
        // The kernel's promise: one FMA chain per output, whatever the batch.
        if m == 1 {
            alone = got.clone();
        }
        assert_eq!(got[..n], alone[..], "row 0 of {m} rows differs from the row alone");
    }
    let x = values(&[4, k as i32], 1);
    if !kernel {
        // No AVX-512: the kernel refuses, rather than crash or compute on an
        // instruction set this CPU lacks.
        let refused = mlx::cpu_panel_matmul(&x, &panels, n).unwrap_err().to_string();
        assert!(refused.contains("AVX-512"), "{refused}");
        return;
    }
    // Bad input is an error, not a crash.
    assert!(mlx::cpu_panel_matmul(&x, &panels, 100).is_err(), "outputs that do not fit the panels");
    assert!(mlx::cpu_panel_matmul(&values(&[4, 64], 1), &panels, n).is_err(), "input size mismatch");
    assert!(mlx::cpu_panel_matmul(&x, &w, n).is_err(), "unpacked weights");
}

/// The graph census counts what an eval would run, once per primitive
/// (siblings share one) and not what is already evaluated.
#[test]
fn graph_census_counts_pending_primitives() {
    let _serial = serial();
    let a = Array::from_f32(&[1., 2., 3., 4.], &[2, 2]).unwrap();
    let b = a.add(&a).unwrap();
    let c = b.multiply(&b).unwrap().add(&a).unwrap();
    assert_eq!(mlx::cuda::primitive_count(&[&c]).unwrap(), 3);
    let census = mlx::cuda::graph_census(&[&c]).unwrap();
    assert!(census.contains("2 Add\n") && census.contains("1 Multiply\n"), "{census}");
    b.eval().unwrap();
    assert_eq!(mlx::cuda::primitive_count(&[&c]).unwrap(), 2);
    c.eval().unwrap();
    assert_eq!(mlx::cuda::primitive_count(&[&c]).unwrap(), 0);
}

/// A kernel may write in place only into a buffer nothing else can see:
/// not before it exists, not while another handle or a view shares it.
#[test]
fn sole_holder_sees_every_other_holder() {
    let _serial = serial();
    let a = Array::from_f32(&[1., 2., 3., 4.], &[2, 2]).unwrap().add(&Array::scalar(1.0, Dtype::F32).unwrap()).unwrap();
    assert!(!mlx::cuda::sole_holder(&a), "not evaluated yet");
    a.eval().unwrap();
    assert!(mlx::cuda::sole_holder(&a));
    let other = a.clone();
    assert!(!mlx::cuda::sole_holder(&a), "a second handle");
    drop(other);
    assert!(mlx::cuda::sole_holder(&a));
    let view = a.slice(&[0, 0], &[1, 2]).unwrap();
    view.eval().unwrap();
    assert!(!mlx::cuda::sole_holder(&a), "an evaluated view shares the buffer");
    drop(view);
    assert!(mlx::cuda::sole_holder(&a));
    let pending = a.multiply(&a).unwrap();
    assert!(!mlx::cuda::sole_holder(&a), "a pending op reads it");
    drop(pending);
    let transposed = a.transpose(&[1, 0]).unwrap();
    drop(a);
    transposed.eval().unwrap();
    assert!(!mlx::cuda::sole_holder(&transposed), "alone, but not row-major");
    assert!(!mlx::cuda::available(), "these tests run on the CPU");
}
