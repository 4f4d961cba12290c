//! KV features to affine codes and back in MLX's ops, on any device: the
//! batched slots' 8- and 4-bit form (`kv_batch.rs`), in the CPU's row
//! layout (`mlx/src/cpu_attention.cc`, `CodeLayout` with keys in position
//! order): a position's row holds its codes (4-bit: features `d` and
//! `d + head/2` share byte `d`, low nibble first), then per group its
//! scale and bias as float32, `scale = (max - min) / (2^bits - 1)`, `bias =
//! min`, codes rounded to nearest. One format for both, so a row stored by
//! either reads back by the other's tools (the tests hold them together).
//!
//! Keys are not rotated here (the CPU rotates keys stored in blocks only):
//! at 8 bits the rotation moved SmolLM2's perplexity change from 0.0015% to
//! 0.0007%, both far under the 1% bar, and unrotated codes let a GPU
//! kernel score a key without turning the query.
use mlx::fast::KvCodes;
use mlx::{Array, Dtype};

/// `x` (`[..., head_dim]`, any float dtype) as rows of `codes`, uint8
/// `[..., codes.width(head_dim)]`.
pub fn encode(x: &Array, codes: KvCodes) -> mlx::Result<Array> {
    let KvCodes::Affine { bits, group } = codes else { return Ok(x.clone()) };
    let shape = x.shape();
    let (head_dim, lead) = (*shape.last().expect("a head axis") as i32, &shape[..shape.len() - 1]);
    let lead: Vec<i32> = lead.iter().map(|&d| d as i32).collect();
    let groups = head_dim / group as i32;
    let grouped = [lead.as_slice(), &[groups, group as i32]].concat();
    let xf = x.astype(Dtype::F32)?.reshape(&grouped)?;
    let lo = xf.min(&[-1], true)?;
    let hi = xf.max(&[-1], true)?;
    let levels = ((1u32 << bits) - 1) as f32;
    let scale = hi.subtract(&lo)?.divide(&Array::scalar(levels, Dtype::F32)?)?;
    // As the CPU's writer: a flat group (scale 0) codes every feature 0.
    let zero = Array::scalar(0.0, Dtype::F32)?;
    let inv = mlx::where_(&scale.greater(&zero)?, &Array::scalar(1.0, Dtype::F32)?.divide(&scale)?, &zero)?;
    let level = xf.subtract(&lo)?.multiply(&inv)?.maximum(&zero)?.minimum(&Array::scalar(levels, Dtype::F32)?)?;
    let flat = [lead.as_slice(), &[head_dim]].concat();
    let code = level.round()?.astype(Dtype::U8)?.reshape(&flat)?;
    let code = match bits {
        8 => code,
        _ => {
            let half = head_dim / 2;
            let split = |from: i32, to: i32| {
                let start: Vec<i32> = lead.iter().map(|_| 0).chain([from]).collect();
                let stop: Vec<i32> = lead.iter().copied().chain([to]).collect();
                code.slice(&start, &stop)
            };
            split(0, half)?.add(&split(half, head_dim)?.multiply(&Array::scalar(16.0, Dtype::U8)?)?)?
        }
    };
    // [.., groups, 1] scale and bias side by side, as bytes.
    let pairs = mlx::concatenate(&[&scale, &lo], -1)?.reshape(&[lead.as_slice(), &[groups * 2]].concat())?;
    let pair_bytes = pairs.contiguous()?.view_as(Dtype::U8)?;
    mlx::concatenate(&[&code, &pair_bytes], -1)
}

/// Rows of `codes` (uint8 `[..., width]`, as [`encode`] writes them) back
/// as `[..., head_dim]` features in `dtype`.
pub fn decode(rows: &Array, codes: KvCodes, head_dim: usize, dtype: Dtype) -> mlx::Result<Array> {
    let KvCodes::Affine { bits, group } = codes else { return Ok(rows.clone()) };
    let shape = rows.shape();
    let lead: Vec<i32> = shape[..shape.len() - 1].iter().map(|&d| d as i32).collect();
    let (head_dim, width) = (head_dim as i32, codes.width(head_dim) as i32);
    let code_bytes = head_dim * bits as i32 / 8;
    let groups = head_dim / group as i32;
    let part = |from: i32, to: i32| {
        let start: Vec<i32> = lead.iter().map(|_| 0).chain([from]).collect();
        let stop: Vec<i32> = lead.iter().copied().chain([to]).collect();
        rows.slice(&start, &stop)
    };
    let code = part(0, code_bytes)?;
    let code = match bits {
        8 => code,
        _ => {
            let low = code.bitwise_and(&Array::scalar(15.0, Dtype::U8)?)?;
            let high = code.right_shift(&Array::scalar(4.0, Dtype::U8)?)?;
            mlx::concatenate(&[&low, &high], -1)?
        }
    };
    let pairs = part(code_bytes, width)?.contiguous()?.view_as(Dtype::F32)?.reshape(&[lead.as_slice(), &[groups, 2]].concat())?;
    let pair = |i: i32| pairs.slice(&[lead.iter().map(|_| 0).collect::<Vec<_>>().as_slice(), &[0, i]].concat(), &[lead.as_slice(), &[groups, i + 1]].concat());
    let (scale, bias) = (pair(0)?, pair(1)?);
    let grouped = code.astype(Dtype::F32)?.reshape(&[lead.as_slice(), &[groups, group as i32]].concat())?;
    grouped.multiply(&scale)?.add(&bias)?.reshape(&[lead.as_slice(), &[head_dim]].concat())?.astype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx::fast::KeyLayout;

    /// Seeded features with a few large ones, as real keys have.
    fn features(positions: usize, dim: usize) -> Vec<f32> {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        (0..positions * dim)
            .map(|i| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                if i % dim == 3 {
                    unit * 40.0
                } else {
                    unit
                }
            })
            .collect()
    }

    /// The CPU's own writer and reader of position rows are the oracle:
    /// encoding here gives its bytes, and decoding here its features.
    #[test]
    fn rows_match_the_cpu_kernels_position_rows() {
        mlx::set_default_device(mlx::Device::Cpu).unwrap();
        let (heads, n, dim) = (2, 9, 64);
        let data = features(heads * n, dim);
        // [1, heads, n, dim] as a cache's layer; the CPU writer takes a step's tokens [n, heads, 1, dim].
        let x = Array::from_f32(&data, &[1, heads, n, dim]).unwrap();
        for codes in [KvCodes::Affine { bits: 8, group: 32 }, KvCodes::Affine { bits: 4, group: 16 }, KvCodes::Affine { bits: 8, group: 64 }] {
            let width = codes.width(dim);
            let ours = encode(&x, codes).unwrap();
            assert_eq!(ours.shape(), vec![1, heads, n, width]);
            let buffer = Array::zeros(&[1, heads, n, width], Dtype::U8).unwrap();
            let theirs = mlx::fast::cpu_kv_write(&buffer, &x.transpose(&[2, 1, 0, 3]).unwrap(), 0, n, 0, KeyLayout::Positions, codes).unwrap();
            let (a, b) = (ours.to_bytes().unwrap(), theirs.to_bytes().unwrap());
            let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count();
            // Codes may differ by one where a level lands on a rounding tie.
            assert!(differ * 200 <= a.len(), "{codes:?}: {differ} of {} bytes differ", a.len());

            let back = decode(&theirs, codes, dim, Dtype::F32).unwrap().to_vec_f32().unwrap();
            let cpu = mlx::fast::cpu_kv_dequantize(&theirs, n, KeyLayout::Positions, codes).unwrap().to_vec_f32().unwrap();
            let worst = back.iter().zip(&cpu).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-5, "{codes:?}: decoded {worst} away from the CPU's reading");
            // And the round trip stays within half a level of the input.
            let KvCodes::Affine { bits, .. } = codes else { unreachable!() };
            let worst = back.iter().zip(&data).map(|(x, y)| (x - y).abs() / 40.0).fold(0f32, f32::max);
            assert!(worst <= 1.01 / ((1u32 << bits) - 1) as f32, "{codes:?}: round trip off by {worst} of the range");
        }
    }

    #[test]
    fn flat_groups_code_to_their_value() {
        mlx::set_default_device(mlx::Device::Cpu).unwrap();
        let x = Array::full(&[3, 64], 0.75, Dtype::BF16).unwrap();
        let codes = KvCodes::Affine { bits: 8, group: 64 };
        let back = decode(&encode(&x, codes).unwrap(), codes, 64, Dtype::F32).unwrap().to_vec_f32().unwrap();
        assert!(back.iter().all(|&v| v == 0.75), "{back:?}");
    }
}
