//! Dequantization of ggml block formats to `f32`, bit-exact with ggml's
//! `dequantize_row_*` (and the `gguf` Python package's `quants.py`).
//!
//! Bit-exactness matters so that Tether's outputs can be compared with
//! llama.cpp and the Python reference without tolerance games: the kernels
//! perform the same f32 operations in the same order as ggml (e.g. `(d * sc) * q - dmin * m` for Q4_K), never fused or
//! re-associated.
//!
//! Speed matters too (a 500 MB model is dequantized at startup), so each
//! kernel works on fixed-size block arrays with constant-bound inner loops the
//! compiler can unroll and vectorize, and large tensors are split over threads.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::GgufError;
use crate::parallel::par_blocks;
use crate::types::{GgmlType, QK_K};

/// A kernel dequantizes a whole number of blocks: `src.len() / type_size`
/// blocks into `dst.len() / block_size` elements.
pub(crate) type Kernel = fn(src: &[u8], dst: &mut [f32]);

/// Dequantizes `n_elements` elements of type `ty` stored in `bytes`.
///
/// `bytes` must be exactly the tensor's data (`ty.bytes_for(n_elements)`
/// bytes). The result is in storage order, which for a GGUF tensor is
/// row-major with shape [`crate::TensorInfo::shape`].
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<Vec<f32>, GgufError> {
    // Validate before allocating: n_elements is caller-controlled.
    let (kernel, bs, ts) = prepare(ty, bytes.len(), n_elements)?;
    let mut out = vec![0.0f32; n_elements];
    par_blocks(bytes, &mut out, bs, ts, kernel);
    Ok(out)
}

/// Like [`dequantize`], writing into `out` (whose length is the element count).
///
/// Lets callers reuse buffers: for a large tensor, first-touch page faults
/// on a freshly allocated output can cost more than the decoding itself.
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), GgufError> {
    let (kernel, bs, ts) = prepare(ty, bytes.len(), out.len())?;
    par_blocks(bytes, out, bs, ts, kernel);
    Ok(())
}

fn prepare(ty: GgmlType, n_bytes: usize, n_elements: usize) -> Result<(Kernel, usize, usize), GgufError> {
    let ty = ty.normalized();
    let kernel: Kernel = match ty {
        GgmlType::F32 => f32_kernel,
        GgmlType::F16 => f16_kernel,
        GgmlType::BF16 => bf16_kernel,
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q5_K => q5_k,
        GgmlType::Q6_K => q6_k,
        GgmlType::Other(_) => return Err(GgufError::UnsupportedType { tensor: "<buffer>".into(), ty: ty.to_string() }),
    };
    let (bs, ts) = check_layout(ty, n_bytes, n_elements)?;
    Ok((kernel, bs, ts))
}

/// Checks that `n_elements` is whole blocks and `n_bytes` is exactly their size.
/// Returns `(block_size, type_size)`.
pub(crate) fn check_layout(ty: GgmlType, n_bytes: usize, n_elements: usize) -> Result<(usize, usize), GgufError> {
    let unsupported = || GgufError::UnsupportedType { tensor: "<buffer>".into(), ty: ty.to_string() };
    let bs = ty.block_size().ok_or_else(unsupported)?;
    let ts = ty.type_size().ok_or_else(unsupported)?;
    if !n_elements.is_multiple_of(bs) {
        return Err(GgufError::ShapeMismatch { what: "buffer".into(), ty: ty.to_string(), n: n_elements, block_size: bs });
    }
    let expected = (n_elements / bs).checked_mul(ts);
    if expected != Some(n_bytes) {
        return Err(GgufError::SizeMismatch { ty: ty.to_string(), n_elements, expected: expected.unwrap_or(usize::MAX), got: n_bytes });
    }
    Ok((bs, ts))
}

/// Runs `f` on each (block, output) pair as fixed-size arrays, so that the
/// kernels index with constants and carry no bounds checks in their loops.
#[inline(always)]
pub(crate) fn each_block<const TS: usize, const BS: usize>(src: &[u8], dst: &mut [f32], mut f: impl FnMut(&[u8; TS], &mut [f32; BS])) {
    for (b, y) in src.chunks_exact(TS).zip(dst.chunks_exact_mut(BS)) {
        // Always Ok: chunks_exact yields exactly TS / BS items.
        if let (Ok(b), Ok(y)) = (<&[u8; TS]>::try_from(b), <&mut [f32; BS]>::try_from(y)) {
            f(b, y);
        }
    }
}

/// The little-endian f16 at `b[i..i + 2]`, widened exactly to f32.
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Unpacks the `j`-th (0..8) 6-bit scale and min of a Q4_K/Q5_K super-block
/// from its 12 packed bytes (ggml's `get_scale_min_k4`): bytes 0..4 hold
/// scales 0..4 (low 6 bits), bytes 4..8 mins 0..4; scales/mins 4..8 take their
/// low nibble from bytes 8..12 and their top two bits from the spare high bits
/// of bytes 0..8.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Copies `N` bytes starting at `at` into an array (e.g. the 12 packed
/// scale bytes of a Q4_K/Q5_K block at offset 4).
#[inline(always)]
pub(crate) fn bytes_at<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[at..at + N]);
    a
}

fn f32_kernel(src: &[u8], dst: &mut [f32]) {
    each_block::<4, 1>(src, dst, |b, y| y[0] = f32::from_le_bytes(*b));
}

fn f16_kernel(src: &[u8], dst: &mut [f32]) {
    // Convert in chunks so half can use its SIMD (F16C) slice path, which it
    // selects once per call rather than once per element.
    const CHUNK: usize = 256;
    let mut tmp = [f16::ZERO; CHUNK];
    for (s, d) in src.chunks(2 * CHUNK).zip(dst.chunks_mut(CHUNK)) {
        let n = d.len();
        for (t, b) in tmp.iter_mut().zip(s.chunks_exact(2)) {
            *t = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
        }
        tmp[..n].convert_to_f32_slice(d);
    }
}

fn bf16_kernel(src: &[u8], dst: &mut [f32]) {
    // bf16 is the top half of an f32.
    each_block::<2, 1>(src, dst, |b, y| y[0] = f32::from_bits((u16::from_le_bytes(*b) as u32) << 16));
}

/// Q4_0: `{f16 d; u8 qs[16]}`, w = d * (q - 8); byte j holds element j in its
/// low nibble and element j + 16 in its high nibble.
fn q4_0(src: &[u8], dst: &mut [f32]) {
    each_block::<18, 32>(src, dst, |b, y| {
        let d = f16_at(b, 0);
        for j in 0..16 {
            let q = b[2 + j];
            y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
            y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    });
}

/// Q4_1: `{f16 d; f16 m; u8 qs[16]}`, w = d * q + m.
fn q4_1(src: &[u8], dst: &mut [f32]) {
    each_block::<20, 32>(src, dst, |b, y| {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        for j in 0..16 {
            let q = b[4 + j];
            y[j] = (q & 0x0F) as f32 * d + m;
            y[j + 16] = (q >> 4) as f32 * d + m;
        }
    });
}

/// `BIT_SPREAD[b][k]` is `0x10` if bit `k` of `b` is set, else 0.
///
/// Spreading the 32 fifth-bits of a Q5 block into bytes with four table
/// lookups keeps the per-element loop free of variable shifts, which baseline
/// x86-64 (SSE2) cannot vectorize; this made Q5_0 ~2x faster.
static BIT_SPREAD: [[u8; 8]; 256] = {
    let mut t = [[0u8; 8]; 256];
    let mut b = 0;
    while b < 256 {
        let mut k = 0;
        while k < 8 {
            t[b][k] = (((b >> k) & 1) << 4) as u8;
            k += 1;
        }
        b += 1;
    }
    t
};

/// The fifth bit of each element of a Q5_0/Q5_1 block, as 0 or 16: bit i of
/// the little-endian u32 `qh` (bytes `qh`) belongs to element i.
#[inline(always)]
pub(crate) fn q5_high_bits(qh: [u8; 4]) -> [u8; 32] {
    let mut h = [0u8; 32];
    for (k, &byte) in qh.iter().enumerate() {
        h[8 * k..8 * k + 8].copy_from_slice(&BIT_SPREAD[byte as usize]);
    }
    h
}

/// Q5_0: `{f16 d; u32 qh; u8 qs[16]}`, w = d * (q - 16).
fn q5_0(src: &[u8], dst: &mut [f32]) {
    each_block::<22, 32>(src, dst, |b, y| {
        let d = f16_at(b, 0);
        let h = q5_high_bits(bytes_at(b, 2));
        for j in 0..16 {
            let q = b[6 + j];
            y[j] = (((q & 0x0F) | h[j]) as i32 - 16) as f32 * d;
            y[j + 16] = (((q >> 4) | h[j + 16]) as i32 - 16) as f32 * d;
        }
    });
}

/// Q5_1: `{f16 d; f16 m; u32 qh; u8 qs[16]}`, w = d * q + m.
fn q5_1(src: &[u8], dst: &mut [f32]) {
    each_block::<24, 32>(src, dst, |b, y| {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let h = q5_high_bits(bytes_at(b, 4));
        for j in 0..16 {
            let q = b[8 + j];
            y[j] = ((q & 0x0F) | h[j]) as f32 * d + m;
            y[j + 16] = ((q >> 4) | h[j + 16]) as f32 * d + m;
        }
    });
}

/// Q8_0: `{f16 d; i8 qs[32]}`, w = d * q.
fn q8_0(src: &[u8], dst: &mut [f32]) {
    each_block::<34, 32>(src, dst, |b, y| {
        let d = f16_at(b, 0);
        for j in 0..32 {
            y[j] = (b[2 + j] as i8) as f32 * d;
        }
    });
}

/// Q4_K: `{f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}` per 256 elements, in
/// 8 sub-blocks of 32 with 6-bit scale `sc` and min `m`:
/// w = (d * sc) * q - dmin * m. Bytes `qs[32i..32i+32]` hold sub-block 2i in
/// their low nibbles and sub-block 2i + 1 in their high nibbles.
fn q4_k(src: &[u8], dst: &mut [f32]) {
    each_block::<144, QK_K>(src, dst, |b, y| {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let scales = &bytes_at::<12>(b, 4);
        for i in 0..4 {
            let (sc1, m1) = scale_min_k4(2 * i, scales);
            let (sc2, m2) = scale_min_k4(2 * i + 1, scales);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            let qs = &b[16 + 32 * i..16 + 32 * i + 32];
            let out = &mut y[64 * i..64 * i + 64];
            for l in 0..32 {
                out[l] = d1 * (qs[l] & 0x0F) as f32 - m1;
                out[l + 32] = d2 * (qs[l] >> 4) as f32 - m2;
            }
        }
    });
}

/// Q5_K: `{f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}` per 256.
/// As Q4_K, plus a fifth bit: bit `s` of `qh[l]` belongs to element l of
/// sub-block s.
fn q5_k(src: &[u8], dst: &mut [f32]) {
    each_block::<176, QK_K>(src, dst, |b, y| {
        let d = f16_at(b, 0);
        let dmin = f16_at(b, 2);
        let scales = &bytes_at::<12>(b, 4);
        let qh = &b[16..48];
        for i in 0..4 {
            let (sc1, m1) = scale_min_k4(2 * i, scales);
            let (sc2, m2) = scale_min_k4(2 * i + 1, scales);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            let qs = &b[48 + 32 * i..48 + 32 * i + 32];
            let out = &mut y[64 * i..64 * i + 64];
            for l in 0..32 {
                let h1 = ((qh[l] >> (2 * i)) & 1) << 4;
                let h2 = ((qh[l] >> (2 * i + 1)) & 1) << 4;
                out[l] = d1 * ((qs[l] & 0x0F) | h1) as f32 - m1;
                out[l + 32] = d2 * ((qs[l] >> 4) | h2) as f32 - m2;
            }
        }
    });
}

/// Q6_K: `{u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}` per 256 elements,
/// w = (d * scale[k / 16]) * (q - 32) with 6-bit q: low 4 bits from `ql`,
/// high 2 bits from `qh`. Each half (128 elements) uses 64 `ql`, 32 `qh`:
/// element l, l+32, l+64, l+96 take ql[l] low, ql[l+32] low, ql[l] high,
/// ql[l+32] high, and qh[l] bits 0-1, 2-3, 4-5, 6-7.
fn q6_k(src: &[u8], dst: &mut [f32]) {
    each_block::<210, QK_K>(src, dst, |b, y| {
        let d = f16_at(b, 208);
        let mut ds = [0.0f32; 16];
        for (k, s) in ds.iter_mut().enumerate() {
            *s = d * (b[192 + k] as i8) as f32;
        }
        for half in 0..2 {
            let ql = &b[64 * half..64 * half + 64];
            let qh = &b[128 + 32 * half..128 + 32 * half + 32];
            let ds = &ds[8 * half..8 * half + 8];
            let out = &mut y[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                out[l] = ds[is] * q1 as f32;
                out[l + 32] = ds[is + 2] * q2 as f32;
                out[l + 64] = ds[is + 4] * q3 as f32;
                out[l + 96] = ds[is + 6] * q4 as f32;
            }
        }
    });
}

#[cfg(test)]
mod tests;
