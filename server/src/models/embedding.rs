//! The token embedding table, of which a step reads only its tokens' rows.
use mlx::{Array, Dtype, QuantizedWeights};

pub enum Embedding {
    /// `[vocab, d_model]` in the compute dtype.
    Dense(Array),
    /// The checkpoint's exact affine form (GGUF Q8_0, Q4_K, ...; MLX
    /// quantized folders), `[vocab, d_model]` packed along `d_model`: a step
    /// dequantizes the rows it gathers. A large vocabulary held dense costs
    /// more than the rest of a small model (Gemma 3 270M's 262,144 x 640 is
    /// 671 MB in float32, 178 MB as Q8_0), and a tied output head reads the
    /// same arrays, so the table is held once.
    Quantized(QuantizedWeights),
}

impl Embedding {
    /// Whether rows of `q` can be gathered and dequantized on every device
    /// (MLX's dequantize takes groups of 32, 64 and 128; 5-bit codes exist on
    /// the CPU only, which dequantizes them itself).
    pub fn can_gather(q: &QuantizedWeights) -> bool {
        matches!(q.group_size, 32 | 64 | 128) && matches!(q.bits, 4 | 5 | 8)
    }

    /// The rows of `ids` (`[1, T]` int32) as `[1, T, d_model]` in `dtype`.
    pub fn rows(&self, ids: &Array, dtype: Dtype) -> mlx::Result<Array> {
        match self {
            Embedding::Dense(table) => table.take(ids, 0),
            Embedding::Quantized(q) => {
                let picked = QuantizedWeights {
                    packed: q.packed.take(ids, 0)?,
                    scales: q.scales.take(ids, 0)?,
                    biases: q.biases.take(ids, 0)?,
                    group_size: q.group_size,
                    bits: q.bits,
                };
                if q.bits != 5 {
                    return mlx::dequantize(&picked, dtype);
                }
                // [1, T, words] -> [T, d_model] -> [1, T, d_model].
                let t = ids.size() as i32;
                let flat = QuantizedWeights {
                    packed: picked.packed.reshape(&[t, -1])?,
                    scales: picked.scales.reshape(&[t, -1])?,
                    biases: picked.biases.reshape(&[t, -1])?,
                    ..picked
                };
                let rows = mlx::cpu_dequantize(&flat)?.reshape(&[1, t, -1])?;
                if dtype == Dtype::F32 {
                    Ok(rows)
                } else {
                    rows.astype(dtype)
                }
            }
        }
    }

    /// Rows: the vocabulary the table covers.
    pub fn vocab(&self) -> usize {
        match self {
            Embedding::Dense(table) => table.dim(0),
            Embedding::Quantized(q) => q.packed.dim(0),
        }
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.arrays().iter().map(|a| a.nbytes()).sum()
    }

    /// The arrays held, for evaluating them after loading.
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Embedding::Dense(table) => vec![table],
            Embedding::Quantized(q) => vec![&q.packed, &q.scales, &q.biases],
        }
    }
}
