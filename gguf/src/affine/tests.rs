//! The affine form must reproduce `dequantize` exactly.

use super::*;
use crate::dequant::dequantize;
use crate::testutil::{random_blocks, Rng};

const AFFINE_TYPES: [(GgmlType, u8); 7] =
    [(GgmlType::Q4_0, 4), (GgmlType::Q4_1, 4), (GgmlType::Q5_0, 5), (GgmlType::Q5_1, 5), (GgmlType::Q8_0, 8), (GgmlType::Q4_K, 4), (GgmlType::Q5_K, 5)];

/// Checks `a` against `w` element-wise: `scale * code + bias` in f32 must be
/// equal (`==`, so +0 and -0 match) or, failing that, within 1e-6 relative.
/// Returns how many elements were not bit-identical up to the sign of zero.
pub(crate) fn check_affine(a: &AffineQuant, w: &[f32], what: &str) -> usize {
    assert_eq!(a.codes.len(), w.len(), "{what}");
    assert_eq!(a.group_size, AFFINE_GROUP_SIZE);
    assert_eq!(a.scales.len(), w.len() / a.group_size, "{what}");
    assert_eq!(a.biases.len(), a.scales.len(), "{what}");
    let limit = 1u16 << a.bits;
    assert!(a.codes.iter().all(|&c| (c as u16) < limit), "{what}: code exceeds {} bits", a.bits);
    let mut inexact = 0;
    for (i, (&q, &want)) in a.codes.iter().zip(w).enumerate() {
        let g = i / a.group_size;
        let got = a.scales[g] * q as f32 + a.biases[g];
        if got != want {
            inexact += 1;
            assert!((got - want).abs() <= 1e-6 * want.abs().max(got.abs()), "{what}: element {i}: affine {got} vs dequantized {want}");
        }
    }
    inexact
}

#[test]
fn affine_equals_dequantize_exactly() {
    let mut rng = Rng::new(42);
    for (ty, bits) in AFFINE_TYPES {
        // Small (inline) and large (threaded) inputs.
        for n_blocks in [1, 3, 4097] {
            let n = n_blocks * ty.block_size().unwrap();
            let bytes = random_blocks(ty, n_blocks, &mut rng);
            let a = to_affine(ty, &bytes, n).unwrap().expect("has affine form");
            assert_eq!(a.bits, bits, "{ty}");
            let w = dequantize(ty, &bytes, n).unwrap();
            assert_eq!(check_affine(&a, &w, &ty.to_string()), 0, "{ty}: not exact");
            assert_eq!(a.dequantize().len(), n);
            assert!(a.dequantize().iter().zip(&w).all(|(x, y)| x == y), "{ty}");
            // The full code range is exercised.
            if n_blocks > 1000 {
                assert_eq!(*a.codes.iter().max().unwrap() as u16, (1u16 << bits) - 1, "{ty}");
            }
        }
    }
}

#[test]
fn known_values() {
    // Q8_0: q = -128 -> code 0, q = 127 -> code 255, q = 0 -> 128.
    let mut b = half::f16::from_f32(0.5).to_bits().to_le_bytes().to_vec();
    b.extend([0x80u8, 0x7F, 0x00]);
    b.extend([1u8; 29]);
    let a = to_affine(GgmlType::Q8_0, &b, 32).unwrap().unwrap();
    assert_eq!(&a.codes[..4], &[0, 255, 128, 129]);
    assert_eq!((a.scales[0], a.biases[0]), (0.5, -64.0));

    // Q4_0: bias is -8d.
    let mut b = half::f16::from_f32(-2.0).to_bits().to_le_bytes().to_vec();
    b.extend([0x5Au8; 16]);
    let a = to_affine(GgmlType::Q4_0, &b, 32).unwrap().unwrap();
    assert_eq!((a.scales[0], a.biases[0]), (-2.0, 16.0));
    assert_eq!((a.codes[0], a.codes[16]), (0xA, 0x5));
}

#[test]
fn types_without_affine_form_and_errors() {
    let mut rng = Rng::new(3);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        let n = ty.block_size().unwrap() * 2;
        let bytes = random_blocks(ty, 2, &mut rng);
        assert!(to_affine(ty, &bytes, n).unwrap().is_none(), "{ty}");
        assert!(matches!(to_affine(ty, &bytes[1..], n), Err(GgufError::SizeMismatch { .. })), "{ty}");
    }
    assert!(matches!(to_affine(GgmlType::Other(10), &[0; 84], 256), Err(GgufError::UnsupportedType { .. })));
    assert!(matches!(to_affine(GgmlType::Q4_K, &[0; 144], 128), Err(GgufError::ShapeMismatch { .. })));
}

#[test]
fn q6_k_affine_form_has_groups_of_16_and_matches_dequantize() {
    let mut rng = Rng::new(11);
    let bytes = random_blocks(GgmlType::Q6_K, 3, &mut rng);
    let n = 3 * 256;
    let a = to_affine(GgmlType::Q6_K, &bytes, n).unwrap().unwrap();
    assert_eq!((a.bits, a.group_size, a.scales.len()), (6, 16, n / 16));
    assert!(a.codes.iter().all(|&c| c < 64));
    let want = crate::dequantize(GgmlType::Q6_K, &bytes, n).unwrap();
    for (i, (&c, &w)) in a.codes.iter().zip(&want).enumerate() {
        let got = a.scales[i / 16] * c as f32 + a.biases[i / 16];
        assert!((got - w).abs() <= 1e-6 * w.abs().max(1e-30), "element {i}: {got} vs {w}");
    }
}
