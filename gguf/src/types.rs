//! ggml tensor types and their block layouts.
//!
//! ggml stores quantized tensors as a sequence of fixed-size *blocks*, each
//! encoding `block_size` consecutive elements of a row in `type_size` bytes.
//! Tether needs the layout of *every* ggml type, not just the ones it can
//! dequantize, so that it can bounds-check every tensor at open time and give a
//! precise "unsupported type" error only when such a tensor is actually used.

use std::fmt;

/// A ggml tensor element type.
///
/// Named variants are the types Tether can dequantize. Everything else is
/// `Other(id)` with the raw ggml id; [`GgmlType::from_id`] never produces
/// `Other` for an id that has a named variant, and every method normalizes
/// through the id, so a hand-built `Other(2)` still behaves like `Q4_0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
    Other(u32),
}

/// Elements per super-block for the k-quants.
pub const QK_K: usize = 256;

/// `(id, name, block_size, type_size)` for every type ggml has defined and not
/// removed. Sizes follow ggml's `type_traits` table (ggml.c) and the `gguf`
/// Python package's `GGML_QUANT_SIZES`.
const TYPE_TABLE: &[(u32, &str, usize, usize)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 2 + 16),
    (3, "Q4_1", 32, 2 + 2 + 16),
    (6, "Q5_0", 32, 2 + 4 + 16),
    (7, "Q5_1", 32, 2 + 2 + 4 + 16),
    (8, "Q8_0", 32, 2 + 32),
    (9, "Q8_1", 32, 4 + 4 + 32),
    (10, "Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
    (11, "Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
    (12, "Q4_K", QK_K, 2 + 2 + 12 + QK_K / 2),
    (13, "Q5_K", QK_K, 2 + 2 + 12 + QK_K / 8 + QK_K / 2),
    (14, "Q6_K", QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2),
    (15, "Q8_K", QK_K, 4 + QK_K + QK_K / 8),
    (16, "IQ2_XXS", QK_K, 2 + QK_K / 4),
    (17, "IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32),
    (18, "IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8),
    (19, "IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16),
    (20, "IQ4_NL", 32, 2 + 16),
    (21, "IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
    (22, "IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16),
    (23, "IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", QK_K, 2 + 4 * 13),
    (35, "TQ2_0", QK_K, 2 + 64),
    (39, "MXFP4", 32, 1 + 16),
];

impl GgmlType {
    /// Maps a raw ggml type id to a `GgmlType`.
    pub fn from_id(id: u32) -> GgmlType {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            30 => GgmlType::BF16,
            other => GgmlType::Other(other),
        }
    }

    /// The raw ggml type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::BF16 => 30,
            GgmlType::Other(id) => id,
        }
    }

    /// Collapses a hand-built `Other(id)` onto its named variant, if any.
    pub(crate) fn normalized(self) -> GgmlType {
        GgmlType::from_id(self.id())
    }

    fn entry(self) -> Option<&'static (u32, &'static str, usize, usize)> {
        let id = self.id();
        TYPE_TABLE.iter().find(|e| e.0 == id)
    }

    /// ggml's name for the type (`"Q4_K"`), or `None` for an unknown id.
    pub fn name(self) -> Option<&'static str> {
        self.entry().map(|e| e.1)
    }

    /// Elements per block, or `None` for an id ggml does not define.
    pub fn block_size(self) -> Option<usize> {
        self.entry().map(|e| e.2)
    }

    /// Bytes per block, or `None` for an id ggml does not define.
    pub fn type_size(self) -> Option<usize> {
        self.entry().map(|e| e.3)
    }

    /// Bytes needed for `n_elements` elements, or `None` if the type is
    /// unknown, `n_elements` is not a whole number of blocks, or it overflows.
    pub fn bytes_for(self, n_elements: usize) -> Option<usize> {
        let (bs, ts) = (self.block_size()?, self.type_size()?);
        if !n_elements.is_multiple_of(bs) {
            return None;
        }
        (n_elements / bs).checked_mul(ts)
    }

    /// Whether [`crate::dequantize`] supports this type.
    pub fn can_dequantize(self) -> bool {
        !matches!(self.normalized(), GgmlType::Other(_))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "unknown ggml type {}", self.id()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_names() {
        for &(id, name, _, _) in TYPE_TABLE {
            let t = GgmlType::from_id(id);
            assert_eq!(t.id(), id);
            assert_eq!(t.to_string(), name);
        }
        assert_eq!(GgmlType::from_id(12), GgmlType::Q4_K);
        assert_eq!(GgmlType::from_id(30), GgmlType::BF16);
        assert_eq!(GgmlType::from_id(10), GgmlType::Other(10));
        assert_eq!(GgmlType::Other(10).to_string(), "Q2_K");
        assert_eq!(GgmlType::Other(4).to_string(), "unknown ggml type 4");
        assert_eq!(GgmlType::Other(2).normalized(), GgmlType::Q4_0);
        assert!(GgmlType::Other(2).can_dequantize());
        assert!(!GgmlType::Other(10).can_dequantize());
    }

    #[test]
    fn block_layouts_match_ggml() {
        let l = |t: GgmlType| (t.block_size().unwrap(), t.type_size().unwrap());
        assert_eq!(l(GgmlType::F32), (1, 4));
        assert_eq!(l(GgmlType::F16), (1, 2));
        assert_eq!(l(GgmlType::BF16), (1, 2));
        assert_eq!(l(GgmlType::Q4_0), (32, 18));
        assert_eq!(l(GgmlType::Q4_1), (32, 20));
        assert_eq!(l(GgmlType::Q5_0), (32, 22));
        assert_eq!(l(GgmlType::Q5_1), (32, 24));
        assert_eq!(l(GgmlType::Q8_0), (32, 34));
        assert_eq!(l(GgmlType::Q4_K), (256, 144));
        assert_eq!(l(GgmlType::Q5_K), (256, 176));
        assert_eq!(l(GgmlType::Q6_K), (256, 210));
        assert_eq!(l(GgmlType::Other(10)), (256, 84));
        assert_eq!(l(GgmlType::Other(15)), (256, 292));
        assert_eq!(GgmlType::Other(5).block_size(), None);
        assert_eq!(GgmlType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q4_K.bytes_for(100), None);
        assert_eq!(GgmlType::F32.bytes_for(usize::MAX), None);
    }
}
