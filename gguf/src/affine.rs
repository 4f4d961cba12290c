//! Exact affine (scale/bias) form of ggml quantization formats.
//!
//! Backends with native affine group quantization (e.g. MLX's
//! `w = scale * code + bias` per group of 32 along a row) can use GGUF weights
//! without dequantizing to f32 and re-quantizing, which would add a second
//! rounding error. That only works when the ggml format *is* such an affine
//! form, exactly: one unsigned code per element and one f32 (scale, bias) per
//! group of 32 consecutive elements of a row.
//!
//! * Q4_0: w = d·(q−8)     → code q (4 bit), scale d, bias −8d
//! * Q4_1: w = d·q + m     → code q (4 bit), scale d, bias m
//! * Q5_0: w = d·(q−16)    → code q (5 bit), scale d, bias −16d
//! * Q5_1: w = d·q + m     → code q (5 bit), scale d, bias m
//! * Q8_0: w = d·q, q: i8  → code q+128 (8 bit), scale d, bias −128d
//! * Q4_K/Q5_K: w = (d·sc)·q − dmin·m per sub-block of 32
//!   → scale d·sc, bias −dmin·m
//!
//! `scale * code + bias` evaluated in f32 reproduces [`crate::dequantize`]
//! exactly (up to the sign of zero): for the `_0` types both sides are exact
//! because `d` has an 11-bit significand and codes have at most 8 bits, so
//! every product and the final sum are representable; for the others the
//! operations are the same ones ggml performs, in the same order.
//!
//! * Q6_K: w = (d·sc)·(q − 32) per sub-block of 16 → scale d·sc, bias
//!   −32·d·sc, groups of 16 (the product may round differently from ggml's
//!   by one ulp: d·sc·q can need 25 significant bits).
//!
//! The float types have no affine form and yield `None`.

use crate::dequant::{bytes_at, check_layout, f16_at, q5_high_bits, scale_min_k4};
use crate::error::GgufError;
use crate::parallel::{plan, run_pieces};
use crate::types::{GgmlType, QK_K};

/// Elements per affine group for every supported type.
pub const AFFINE_GROUP_SIZE: usize = 32;

/// `w[i] = scales[g] * codes[i] as f32 + biases[g]` with
/// `g = i / group_size`, in row-major (storage) order.
#[derive(Clone, Debug, PartialEq)]
pub struct AffineQuant {
    /// Significant bits per code (4, 5 or 8); every code is `< 1 << bits`.
    pub bits: u8,
    /// Consecutive elements sharing a scale and bias; groups never straddle
    /// rows because ggml rows are whole blocks.
    pub group_size: usize,
    /// One unsigned code per element, unpacked (one byte each).
    pub codes: Vec<u8>,
    /// One per group.
    pub scales: Vec<f32>,
    /// One per group.
    pub biases: Vec<f32>,
}

impl AffineQuant {
    /// Number of groups (`codes.len() / group_size`).
    pub fn n_groups(&self) -> usize {
        self.scales.len()
    }

    /// Evaluates `scale * code + bias` for every element, in f32.
    pub fn dequantize(&self) -> Vec<f32> {
        let gs = self.group_size.max(1);
        let mut out = Vec::with_capacity(self.codes.len());
        for ((codes, &s), &b) in self.codes.chunks(gs).zip(&self.scales).zip(&self.biases) {
            out.extend(codes.iter().map(|&q| s * q as f32 + b));
        }
        out
    }
}

/// Output slices for one block: codes (block_size), scales and biases
/// (block_size / 32 each).
struct Out<'a, const BS: usize, const G: usize> {
    codes: &'a mut [u8; BS],
    scales: &'a mut [f32; G],
    biases: &'a mut [f32; G],
}

type AffineKernel = fn(&[u8], &mut [u8], &mut [f32], &mut [f32]);

/// The exact affine form of `n_elements` elements of type `ty` in `bytes`,
/// or `Ok(None)` if the type has none (F32, F16, BF16). Q6_K's form has
/// groups of 16 (`group_size` says so); all others groups of 32. Errors as
/// [`crate::dequantize`] for unsupported types and size mismatches.
pub fn to_affine(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<Option<AffineQuant>, GgufError> {
    let ty = ty.normalized();
    let (bits, gs, kernel): (u8, usize, AffineKernel) = match ty {
        GgmlType::Q4_0 => (4, AFFINE_GROUP_SIZE, q4_0),
        GgmlType::Q4_1 => (4, AFFINE_GROUP_SIZE, q4_1),
        GgmlType::Q5_0 => (5, AFFINE_GROUP_SIZE, q5_0),
        GgmlType::Q5_1 => (5, AFFINE_GROUP_SIZE, q5_1),
        GgmlType::Q8_0 => (8, AFFINE_GROUP_SIZE, q8_0),
        GgmlType::Q4_K => (4, AFFINE_GROUP_SIZE, q4_k),
        GgmlType::Q5_K => (5, AFFINE_GROUP_SIZE, q5_k),
        // Q6_K's scales cover 16 elements, so its exact form has groups of 16.
        GgmlType::Q6_K => (6, 16, q6_k),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            // Still validate, so a bad buffer is an error regardless of type.
            check_layout(ty, bytes.len(), n_elements)?;
            return Ok(None);
        }
        GgmlType::Other(_) => return Err(GgufError::UnsupportedType { tensor: "<buffer>".into(), ty: ty.to_string() }),
    };
    let (bs, ts) = check_layout(ty, bytes.len(), n_elements)?;
    let n_groups = n_elements / gs;
    let mut codes = vec![0u8; n_elements];
    let mut scales = vec![0.0f32; n_groups];
    let mut biases = vec![0.0f32; n_groups];

    let (per, n_threads) = plan(bytes.len() / ts, bs);
    let pieces = bytes.chunks(per * ts).zip(codes.chunks_mut(per * bs)).zip(scales.chunks_mut(per * bs / gs)).zip(biases.chunks_mut(per * bs / gs));
    run_pieces(pieces, n_threads, |(((src, c), s), b)| kernel(src, c, s, b));

    Ok(Some(AffineQuant { bits, group_size: gs, codes, scales, biases }))
}

/// Runs `f` on each block with fixed-size views of its outputs.
#[inline(always)]
fn each_block<const TS: usize, const BS: usize, const G: usize>(
    src: &[u8],
    codes: &mut [u8],
    scales: &mut [f32],
    biases: &mut [f32],
    mut f: impl FnMut(&[u8; TS], Out<'_, BS, G>),
) {
    let blocks = src.chunks_exact(TS).zip(codes.chunks_exact_mut(BS)).zip(scales.chunks_exact_mut(G)).zip(biases.chunks_exact_mut(G));
    for (((b, c), s), m) in blocks {
        // Always Ok: chunks_exact yields exactly the requested lengths.
        if let (Ok(b), Ok(codes), Ok(scales), Ok(biases)) =
            (<&[u8; TS]>::try_from(b), <&mut [u8; BS]>::try_from(c), <&mut [f32; G]>::try_from(s), <&mut [f32; G]>::try_from(m))
        {
            f(b, Out { codes, scales, biases });
        }
    }
}

fn q4_0(src: &[u8], c: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    each_block::<18, 32, 1>(src, c, s, m, |b, o| {
        let d = f16_at(b, 0);
        o.scales[0] = d;
        o.biases[0] = -8.0 * d;
        for j in 0..16 {
            o.codes[j] = b[2 + j] & 0x0F;
            o.codes[j + 16] = b[2 + j] >> 4;
        }
    });
}

fn q4_1(src: &[u8], c: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    each_block::<20, 32, 1>(src, c, s, m, |b, o| {
        o.scales[0] = f16_at(b, 0);
        o.biases[0] = f16_at(b, 2);
        for j in 0..16 {
            o.codes[j] = b[4 + j] & 0x0F;
            o.codes[j + 16] = b[4 + j] >> 4;
        }
    });
}

/// The 5-bit codes of a Q5_0/Q5_1 block from its `qh` bytes and 16 `qs` bytes.
#[inline(always)]
fn q5_codes(qh: [u8; 4], qs: &[u8], codes: &mut [u8; 32]) {
    let h = q5_high_bits(qh);
    for j in 0..16 {
        codes[j] = (qs[j] & 0x0F) | h[j];
        codes[j + 16] = (qs[j] >> 4) | h[j + 16];
    }
}

fn q5_0(src: &[u8], c: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    each_block::<22, 32, 1>(src, c, s, m, |b, o| {
        let d = f16_at(b, 0);
        o.scales[0] = d;
        o.biases[0] = -16.0 * d;
        q5_codes(bytes_at(b, 2), &b[6..22], o.codes);
    });
}

fn q5_1(src: &[u8], c: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    each_block::<24, 32, 1>(src, c, s, m, |b, o| {
        o.scales[0] = f16_at(b, 0);
        o.biases[0] = f16_at(b, 2);
        q5_codes(bytes_at(b, 4), &b[8..24], o.codes);
    });
}

fn q8_0(src: &[u8], c: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    each_block::<34, 32, 1>(src, c, s, m, |b, o| {
        let d = f16_at(b, 0);
        o.scales[0] = d;
        o.biases[0] = -128.0 * d;
        for j in 0..32 {
            // i8 q -> q + 128 as u8 is flipping the sign bit.
            o.codes[j] = b[2 + j] ^ 0x80;
        }
    });
}

/// Scales and biases of the 8 sub-blocks of a Q4_K/Q5_K super-block.
#[inline(always)]
fn k_group_params(b: &[u8], scales: &mut [f32; 8], biases: &mut [f32; 8]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let packed = bytes_at::<12>(b, 4);
    for g in 0..8 {
        let (sc, mn) = scale_min_k4(g, &packed);
        scales[g] = d * sc as f32;
        // ggml subtracts dmin*m; adding its negation is the same IEEE result.
        biases[g] = -(dmin * mn as f32);
    }
}

fn q4_k(src: &[u8], c: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    each_block::<144, QK_K, 8>(src, c, s, m, |b, o| {
        k_group_params(b, o.scales, o.biases);
        for i in 0..4 {
            for l in 0..32 {
                let q = b[16 + 32 * i + l];
                o.codes[64 * i + l] = q & 0x0F;
                o.codes[64 * i + 32 + l] = q >> 4;
            }
        }
    });
}

/// Q6_K: `{u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}` per 256 elements;
/// group k (16 elements) is `(d * scales[k]) * (q - 32)` with a 6-bit q, so
/// scale `d * scales[k]`, bias `-32 * d * scales[k]`, code q.
fn q6_k(src: &[u8], c: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    each_block::<210, QK_K, 16>(src, c, s, m, |b, out| {
        let d = f16_at(b, 208);
        for k in 0..16 {
            let scale = d * (b[192 + k] as i8) as f32;
            out.scales[k] = scale;
            out.biases[k] = -32.0 * scale;
        }
        for half in 0..2 {
            let ql = &b[64 * half..64 * half + 64];
            let qh = &b[128 + 32 * half..128 + 32 * half + 32];
            let codes = &mut out.codes[128 * half..128 * half + 128];
            for l in 0..32 {
                codes[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
                codes[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                codes[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                codes[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
    });
}

fn q5_k(src: &[u8], c: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    each_block::<176, QK_K, 8>(src, c, s, m, |b, o| {
        k_group_params(b, o.scales, o.biases);
        for i in 0..4 {
            for l in 0..32 {
                let q = b[48 + 32 * i + l];
                let h = b[16 + l];
                o.codes[64 * i + l] = (q & 0x0F) | (((h >> (2 * i)) & 1) << 4);
                o.codes[64 * i + 32 + l] = (q >> 4) | (((h >> (2 * i + 1)) & 1) << 4);
            }
        }
    });
}

#[cfg(test)]
mod tests;
