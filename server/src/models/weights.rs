//! How a checkpoint's tensors become device arrays: dense in the compute
//! dtype, or kept in MLX's affine quantized form when that form is exact.

use mlx::{Array, Dtype, QuantizedWeights};

/// How projection weights are held on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// Dequantized to the compute dtype. Fastest on CPU, where MLX's float32
    /// matmul runs on OpenBLAS and its quantized kernels do not.
    Dense,
    /// Quantized blocks stay quantized where they map exactly onto an affine
    /// form with a kernel on this device (GGUF Q4_0, Q4_1, Q4_K as 4-bit;
    /// Q5_0, Q5_1, Q5_K as 5-bit on a CPU that reads those at speed, else as
    /// 8-bit, as Q8_0 is; Q6_K as 8-bit in groups of 16 on CPU only);
    /// everything else is dense. Decode is bound by the bytes it
    /// reads per token, on CPU and GPU alike.
    Quantized,
}

impl WeightFormat {
    pub fn parse(s: &str) -> Option<WeightFormat> {
        match s {
            "dense" | "float" => Some(WeightFormat::Dense),
            "quantized" | "q" => Some(WeightFormat::Quantized),
            _ => None,
        }
    }
}

/// Packs one unsigned `bits`-wide code per element (rows of `cols`) into
/// uint32 words the way the kernels read them: for 4 and 8 bits MLX's form
/// (element `j` of a word at bit `bits * j`), for 5 the CPU kernels' own
/// ([`mlx::pack_5bit_codes`]). Only the widths [`storage_bits`] gives.
pub fn pack_codes(codes: &[u8], bits: u32, cols: usize) -> Option<Vec<u32>> {
    if bits == 5 {
        return mlx::pack_5bit_codes(codes, cols);
    }
    if bits != 4 && bits != 8 {
        return None;
    }
    let per_word = (32 / bits) as usize;
    if !codes.len().is_multiple_of(per_word) {
        return None;
    }
    Some(codes.chunks_exact(per_word).map(|chunk| chunk.iter().enumerate().fold(0u32, |w, (j, &c)| w | (u32::from(c) << (bits as usize * j)))).collect())
}

/// The packed width for codes of `bits` significant bits: MLX's kernels and
/// Tether's CPU kernel read 4- and 8-bit words, and the CPU kernel 5-bit ones
/// where `five_bit` says so ([`five_bit_codes_here`]; groups of 32 and rows a
/// multiple of 64 wide). Other codes are stored wider, which keeps them exact.
pub fn storage_bits(bits: u32, five_bit: bool) -> Option<u32> {
    match bits {
        1..=4 => Some(4),
        5 if five_bit => Some(5),
        5..=8 => Some(8),
        _ => None,
    }
}

/// Whether 5-bit codes (GGUF's Q5 blocks) may be stored at 5 bits here: on
/// a CPU whose kernel reads them as fast as 8-bit ones, they cost 5/8 of the
/// bytes a decode step reads. MLX's GPU kernels take 4 and 8 bits only.
pub fn five_bit_codes_here() -> bool {
    mlx::default_device() == mlx::Device::Cpu && mlx::cpu_five_bit_codes_fast()
}

/// Whether the current default device's kernels take this group size: MLX's
/// quantized matmul takes 32, 64 and 128; Tether's CPU kernel takes any.
pub fn group_supported(group_size: usize) -> bool {
    mlx::default_device() == mlx::Device::Cpu || matches!(group_size, 32 | 64 | 128)
}

/// Builds MLX quantized weights for a `[rows, cols]` matrix from unpacked
/// codes and per-group scales/biases (group along `cols`), 5-bit codes at 5
/// bits where `five_bit` allows and the shape fits. `None` when the form has
/// no kernel here (the caller loads the tensor dense instead).
pub fn affine_to_mlx(rows: usize, cols: usize, quant: &gguf::AffineQuant, dtype: Dtype, five_bit: bool) -> mlx::Result<Option<QuantizedWeights>> {
    let gguf::AffineQuant { bits, group_size, codes, scales, biases } = quant;
    let group_size = *group_size;
    let five_bit = five_bit && group_size == 32 && cols.is_multiple_of(64);
    let Some(bits) = storage_bits(u32::from(*bits), five_bit).filter(|_| group_supported(group_size)) else { return Ok(None) };
    let Some(packed) = pack_codes(codes, bits, cols) else { return Ok(None) };
    let groups = cols / group_size;
    let words = cols * bits as usize / 32;
    Ok(Some(QuantizedWeights {
        packed: Array::from_u32(&packed, &[rows, words])?,
        scales: Array::from_f32(scales, &[rows, groups])?.astype(dtype)?,
        biases: Array::from_f32(biases, &[rows, groups])?.astype(dtype)?,
        group_size: group_size as i32,
        bits: bits as i32,
    }))
}

/// A dense array in `dtype` from float32 host data.
pub fn dense(data: &[f32], shape: &[usize], dtype: Dtype) -> mlx::Result<Array> {
    let a = Array::from_f32(data, shape)?;
    if dtype == Dtype::F32 {
        Ok(a)
    } else {
        a.astype(dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_matches_mlx_dequantize() {
        // Codes 0..15 repeating, scale 0.5, bias -1: value = 0.5 * code - 1.
        for bits in [4u32, 8] {
            let (rows, cols, group) = (2, 64, 32);
            let max = (1u32 << bits) - 1;
            let codes: Vec<u8> = (0..rows * cols).map(|i| (i as u32 * 7 % (max + 1)) as u8).collect();
            let scales = vec![0.5; rows * cols / group];
            let biases = vec![-1.0; rows * cols / group];
            let quant = gguf::AffineQuant { bits: bits as u8, group_size: group, codes: codes.clone(), scales, biases };
            let q = affine_to_mlx(rows, cols, &quant, Dtype::F32, false).unwrap().unwrap();
            let got = mlx::dequantize(&q, Dtype::F32).unwrap().to_vec_f32().unwrap();
            let want: Vec<f32> = codes.iter().map(|&c| 0.5 * c as f32 - 1.0).collect();
            assert_eq!(got, want, "bits {bits}");
        }
    }
}
