//! Per-type dequantization tests on hand-constructed blocks.
//!
//! Expected values are computed per element from the *documented* bit
//! layout (a different decomposition than the kernels' loops), with scales
//! chosen as powers of two so every expected value is exact.

#![allow(clippy::needless_range_loop)] // indices feed the expected-value formulas

use super::*;
use crate::testutil::{random_blocks, Rng};

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}

/// Nibble pattern used by the 32-element formats: byte j = j | (15 - j) << 4.
fn nibbles16() -> Vec<u8> {
    (0..16u8).map(|j| j | ((15 - j) << 4)).collect()
}

/// Low/high nibble of element i in a 32-element block.
fn nib32(qs: &[u8], i: usize) -> u8 {
    if i < 16 {
        qs[i] & 0x0F
    } else {
        qs[i - 16] >> 4
    }
}

#[test]
fn float_types() {
    let xs = [0.0f32, -0.0, 1.0, -2.5, 65504.0, 6.0e-8, f32::INFINITY];
    let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
    let y = dequantize(GgmlType::F32, &bytes, xs.len()).unwrap();
    assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), xs.iter().map(|v| v.to_bits()).collect::<Vec<_>>());

    // f16: every representable value is exact in f32, including subnormals.
    let f16_bits: Vec<u16> = vec![0x0000, 0x8000, 0x3C00, 0xC100, 0x7BFF, 0x0001, 0x03FF, 0x7C00, 0xFC00];
    let expect = [0.0f32, -0.0, 1.0, -2.5, 65504.0, 5.960_464_5e-8, 6.097_555e-5, f32::INFINITY, f32::NEG_INFINITY];
    // Long enough to cross the 256-element conversion chunk.
    let n = 1000;
    let bytes: Vec<u8> = (0..n).flat_map(|i| f16_bits[i % f16_bits.len()].to_le_bytes()).collect();
    let y = dequantize(GgmlType::F16, &bytes, n).unwrap();
    for (i, v) in y.iter().enumerate() {
        assert_eq!(v.to_bits(), expect[i % expect.len()].to_bits(), "f16 element {i}");
    }
    assert!(dequantize(GgmlType::F16, &0x7E00u16.to_le_bytes(), 1).unwrap()[0].is_nan());

    // bf16 is the high half of an f32.
    let bf: Vec<u16> = vec![0x3F80, 0xC020, 0x0000, 0x8000, 0x7F80, 0x4049];
    let bytes: Vec<u8> = bf.iter().flat_map(|b| b.to_le_bytes()).collect();
    let y = dequantize(GgmlType::BF16, &bytes, bf.len()).unwrap();
    assert_eq!(&y[..5], &[1.0, -2.5, 0.0, -0.0, f32::INFINITY]);
    assert_eq!(y[5], 3.140625);
}

#[test]
fn q4_0_known_block() {
    let mut b = h(0.5).to_vec();
    b.extend(nibbles16());
    let y = dequantize(GgmlType::Q4_0, &b, 32).unwrap();
    for i in 0..32 {
        assert_eq!(y[i], 0.5 * (nib32(&b[2..], i) as f32 - 8.0), "element {i}");
    }
    assert_eq!((y[0], y[1], y[16], y[31]), (-4.0, -3.5, 3.5, -4.0));
}

#[test]
fn q4_1_known_block() {
    let mut b = h(0.25).to_vec();
    b.extend(h(-1.0));
    b.extend(nibbles16());
    let y = dequantize(GgmlType::Q4_1, &b, 32).unwrap();
    for i in 0..32 {
        assert_eq!(y[i], 0.25 * nib32(&b[4..], i) as f32 - 1.0, "element {i}");
    }
    assert_eq!((y[0], y[15], y[16]), (-1.0, 2.75, 2.75));
}

const QH: u32 = 0xA5A5_0F0F;

fn q5_code(qs: &[u8], i: usize) -> u8 {
    nib32(qs, i) | ((((QH >> i) & 1) as u8) << 4)
}

#[test]
fn q5_0_known_block() {
    let mut b = h(0.5).to_vec();
    b.extend(QH.to_le_bytes());
    b.extend(nibbles16());
    let y = dequantize(GgmlType::Q5_0, &b, 32).unwrap();
    for i in 0..32 {
        assert_eq!(y[i], 0.5 * (q5_code(&b[6..], i) as f32 - 16.0), "element {i}");
    }
    // Element 0: nibble 0, high bit 1 -> 16 -> 0. Element 4: nibble 4, bit 4 of
    // 0x0F0F is 0 -> -6. Element 16: nibble 15, bit 16 set -> 31 -> 7.5.
    assert_eq!((y[0], y[4], y[16]), (0.0, -6.0, 7.5));
}

#[test]
fn q5_1_known_block() {
    let mut b = h(0.25).to_vec();
    b.extend(h(0.5));
    b.extend(QH.to_le_bytes());
    b.extend(nibbles16());
    let y = dequantize(GgmlType::Q5_1, &b, 32).unwrap();
    for i in 0..32 {
        assert_eq!(y[i], 0.25 * q5_code(&b[8..], i) as f32 + 0.5, "element {i}");
    }
    assert_eq!((y[0], y[16]), (4.5, 8.25));
}

#[test]
fn q8_0_known_block() {
    let mut b = h(0.125).to_vec();
    b.extend((0..32).map(|j| (j * 8 - 128) as i8 as u8));
    let y = dequantize(GgmlType::Q8_0, &b, 32).unwrap();
    for (j, v) in y.iter().enumerate() {
        assert_eq!(*v, 0.125 * (j as f32 * 8.0 - 128.0));
    }
    assert_eq!((y[0], y[16], y[31]), (-16.0, 0.0, 15.0));
}

const SC: [u8; 8] = [1, 63, 17, 32, 5, 48, 33, 63];
const MN: [u8; 8] = [0, 63, 2, 40, 16, 31, 47, 1];

/// Packs 6-bit scales and mins the way ggml's k-quant quantizers do.
pub(crate) fn pack_scale_min(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    q
}

#[test]
fn scale_min_k4_unpacks_every_value() {
    for a in 0..64u8 {
        for c in 0..64u8 {
            let sc = [a, c, a ^ 21, c ^ 42, c, a, a ^ 63, c ^ 1];
            let m = [c, a, c ^ 7, a ^ 9, a, c, c ^ 63, a ^ 5];
            let packed = pack_scale_min(&sc, &m);
            for j in 0..8 {
                assert_eq!(scale_min_k4(j, &packed), (sc[j], m[j]), "a={a} c={c} j={j}");
            }
        }
    }
}

/// 4-bit code of element i of a Q4_K/Q5_K super-block: sub-block g = i / 32
/// lives in byte chunk g / 2, low nibble for even g, high for odd.
fn k_nibble(qs: &[u8], i: usize) -> u8 {
    let g = i / 32;
    let byte = qs[32 * (g / 2) + i % 32];
    if g.is_multiple_of(2) {
        byte & 0x0F
    } else {
        byte >> 4
    }
}

fn k_block_header() -> Vec<u8> {
    let mut b = h(0.5).to_vec();
    b.extend(h(0.25));
    b.extend(pack_scale_min(&SC, &MN));
    b
}

#[test]
fn q4_k_known_block() {
    let mut b = k_block_header();
    b.extend((0..128).map(|i| (i * 7 % 256) as u8));
    assert_eq!(b.len(), 144);
    let y = dequantize(GgmlType::Q4_K, &b, 256).unwrap();
    for i in 0..256 {
        let g = i / 32;
        let want = 0.5 * SC[g] as f32 * k_nibble(&b[16..], i) as f32 - 0.25 * MN[g] as f32;
        assert_eq!(y[i], want, "element {i}");
    }
    // Element 32: sub-block 1 (sc 63, m 63), high nibble of byte 0 = 0.
    assert_eq!(y[32], -15.75);
    // Element 1: sub-block 0 (sc 1, m 0), low nibble of 7 = 7 -> 3.5.
    assert_eq!(y[1], 3.5);
}

#[test]
fn q5_k_known_block() {
    let mut b = k_block_header();
    let qh: Vec<u8> = (0..32).map(|l| (l * 37 % 256) as u8).collect();
    b.extend(&qh);
    b.extend((0..128).map(|i| (i * 7 % 256) as u8));
    assert_eq!(b.len(), 176);
    let y = dequantize(GgmlType::Q5_K, &b, 256).unwrap();
    for i in 0..256 {
        let g = i / 32;
        let high = (qh[i % 32] >> g) & 1;
        let q = k_nibble(&b[48..], i) | (high << 4);
        let want = 0.5 * SC[g] as f32 * q as f32 - 0.25 * MN[g] as f32;
        assert_eq!(y[i], want, "element {i}");
    }
    // Element 33: sub-block 1, qh[1] = 37 = 0b100101 -> bit 1 = 0; byte 1 = 7,
    // high nibble 0 -> q = 0 -> -0.25 * 63.
    assert_eq!(y[33], -15.75);
    // Element 64: sub-block 2 (sc 17, m 2), qh[0] = 0 -> q = low nibble of byte 32 (224) = 0.
    assert_eq!(y[64], -0.5);
}

#[test]
fn q6_k_known_block() {
    let scales: [i8; 16] = [-128, -1, 1, 127, 3, -7, 64, -64, 2, 5, -3, 100, -100, 0, 9, 11];
    let ql: Vec<u8> = (0..128).map(|i| (i * 13 % 256) as u8).collect();
    let qh: Vec<u8> = (0..64).map(|i| ((i * 29 + 3) % 256) as u8).collect();
    let mut b = ql.clone();
    b.extend(&qh);
    b.extend(scales.iter().map(|&s| s as u8));
    b.extend(h(0.5));
    assert_eq!(b.len(), 210);
    let y = dequantize(GgmlType::Q6_K, &b, 256).unwrap();
    for i in 0..256 {
        // Half of 128; within it, quarter k of 32 picks the ql byte (l or
        // l + 32), the nibble (low for k < 2) and the qh bit pair (2k).
        let (half, r) = (i / 128, i % 128);
        let (k, l) = (r / 32, r % 32);
        let lo_byte = ql[64 * half + l + 32 * (k % 2)];
        let lo = if k < 2 { lo_byte & 0x0F } else { lo_byte >> 4 };
        let hi = (qh[32 * half + l] >> (2 * k)) & 3;
        let q = (lo | (hi << 4)) as i32 - 32;
        let want = 0.5 * scales[i / 16] as f32 * q as f32;
        assert_eq!(y[i], want, "element {i}");
    }
    // Element 0: ql 0, qh[0] = 3 -> q = 48 - 32 = 16; scale -128 -> -1024.
    assert_eq!(y[0], -1024.0);
}

#[test]
fn rejects_bad_sizes_and_types() {
    assert!(matches!(dequantize(GgmlType::Q4_0, &[0; 18], 16), Err(GgufError::ShapeMismatch { n: 16, block_size: 32, .. })));
    assert!(matches!(dequantize(GgmlType::Q4_0, &[0; 17], 32), Err(GgufError::SizeMismatch { expected: 18, got: 17, .. })));
    assert!(matches!(dequantize(GgmlType::Q4_0, &[0; 36], 32), Err(GgufError::SizeMismatch { expected: 18, got: 36, .. })));
    assert!(matches!(
        dequantize(GgmlType::Other(10), &[0; 84], 256),
        Err(GgufError::UnsupportedType { ty, .. }) if ty == "Q2_K"
    ));
    assert!(matches!(dequantize(GgmlType::Other(99), &[], 0), Err(GgufError::UnsupportedType { .. })));
    // A huge claimed element count fails before any allocation.
    assert!(matches!(dequantize(GgmlType::F32, &[0; 4], usize::MAX / 2), Err(GgufError::SizeMismatch { .. })));
    // Other(id) of a named type is handled as that type.
    assert_eq!(dequantize(GgmlType::Other(0), &1.0f32.to_le_bytes(), 1).unwrap(), vec![1.0]);
    let mut out = [0.0f32; 2];
    dequantize_into(GgmlType::BF16, &[0x80, 0x3F, 0x00, 0x40], &mut out).unwrap();
    assert_eq!(out, [1.0, 2.0]);
}

/// The threaded path must equal a single straight pass of the kernel.
#[test]
fn parallel_split_matches_single_pass() {
    let mut rng = Rng::new(1);
    let kernels: [(GgmlType, Kernel); 11] = [
        (GgmlType::F32, f32_kernel),
        (GgmlType::F16, f16_kernel),
        (GgmlType::BF16, bf16_kernel),
        (GgmlType::Q4_0, q4_0),
        (GgmlType::Q4_1, q4_1),
        (GgmlType::Q5_0, q5_0),
        (GgmlType::Q5_1, q5_1),
        (GgmlType::Q8_0, q8_0),
        (GgmlType::Q4_K, q4_k),
        (GgmlType::Q5_K, q5_k),
        (GgmlType::Q6_K, q6_k),
    ];
    for (ty, kernel) in kernels {
        // An odd number of blocks, large enough to be split.
        let n_blocks = (300_001 / ty.block_size().unwrap()) | 1;
        let n = n_blocks * ty.block_size().unwrap();
        let bytes = random_blocks(ty, n_blocks, &mut rng);
        let par = dequantize(ty, &bytes, n).unwrap();
        let mut seq = vec![0.0f32; n];
        kernel(&bytes, &mut seq);
        assert!(par.iter().all(|v| v.is_finite()), "{ty}");
        assert!(par == seq, "{ty}: parallel result differs");
        assert!(seq.iter().any(|&v| v != 0.0), "{ty}: all zeros?");
    }
}
