//! The crate's single error type.
//!
//! Every failure names *what* went wrong and, where it helps, *where* in the
//! file (a byte offset) or *which* tensor/key, because a model file that fails
//! to load is usually a truncated download or a format Tether does not speak,
//! and the operator needs to tell those apart without a hex editor.

use std::path::PathBuf;

/// Errors from opening, parsing or dequantizing GGUF data.
///
/// Two variants deal with "the file is shorter than it claims":
/// * [`GgufError::Truncated`]: a fixed-size field (an integer, a float, the
///   header) runs past the end of the file.
/// * [`GgufError::ImplausibleLength`]: a length or count prefix (string length,
///   array count, tensor count, ...) declares more data than could possibly fit
///   in the bytes that remain. This is reported *before* anything is allocated,
///   which is what keeps a corrupt file from requesting terabytes of memory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened, stat'ed or mapped.
    #[error("cannot read GGUF file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: expected magic \"GGUF\", found {}", describe_magic(found))]
    NotGguf { found: [u8; 4] },

    /// The header's version field is not 2 or 3.
    #[error("unsupported GGUF version {v}{hint}", v = .0, hint = version_hint(*.0))]
    UnsupportedVersion(u32),

    /// A fixed-size field runs past the end of the file.
    #[error("GGUF file is truncated: {what} at byte offset {offset} runs past the end of the file")]
    Truncated { what: String, offset: u64 },

    /// A length/count prefix claims more data than the rest of the file can hold.
    #[error(
        "corrupt GGUF file: {what} at byte offset {offset} declares length {len}, \
         but only {available} bytes remain in the file"
    )]
    ImplausibleLength { what: String, len: u64, offset: u64, available: u64 },

    /// Structurally readable metadata that breaks a GGUF rule (bad UTF-8,
    /// duplicate key, unknown value type, bad alignment, ...).
    #[error("invalid GGUF metadata: {0}")]
    InvalidMetadata(String),

    /// A tensor-info record that breaks a GGUF rule (too many dims, element
    /// count overflow, misaligned offset, overlap, duplicate name, ...).
    #[error("invalid tensor '{tensor}': {reason}")]
    InvalidTensor { tensor: String, reason: String },

    /// A tensor's data does not lie inside the file's data section.
    #[error(
        "tensor '{tensor}' lies outside the file: its data spans bytes {start}..{end} \
         of the data section, which is only {data_len} bytes long (truncated file?)"
    )]
    TensorOutOfBounds { tensor: String, start: u64, end: u64, data_len: u64 },

    /// The tensor type is unknown, or known but not dequantizable by Tether.
    #[error("tensor '{tensor}' has type {ty}, which Tether does not support here")]
    UnsupportedType { tensor: String, ty: String },

    /// An element count that does not split into whole quantization blocks
    /// (for a tensor: its row length `ne[0]`, which ggml requires to be a
    /// multiple of the block size).
    #[error("{what}: {n} elements is not a multiple of the {ty} block size {block_size}")]
    ShapeMismatch { what: String, ty: String, n: usize, block_size: usize },

    /// A byte buffer whose length does not match the element count for its type.
    #[error("{ty} data for {n_elements} elements must be {expected} bytes, got {got}")]
    SizeMismatch { ty: String, n_elements: usize, expected: usize, got: usize },
}

impl GgufError {
    /// Prefixes the `what` of a [`Truncated`](Self::Truncated) or
    /// [`ImplausibleLength`](Self::ImplausibleLength) error with context such
    /// as the metadata key being read. Lazily built so the happy path never
    /// formats strings.
    pub(crate) fn context(self, ctx: impl FnOnce() -> String) -> Self {
        match self {
            GgufError::Truncated { what, offset } => GgufError::Truncated { what: format!("{} ({what})", ctx()), offset },
            GgufError::ImplausibleLength { what, len, offset, available } => {
                GgufError::ImplausibleLength { what: format!("{} ({what})", ctx()), len, offset, available }
            }
            GgufError::InvalidMetadata(msg) => GgufError::InvalidMetadata(format!("{}: {msg}", ctx())),
            other => other,
        }
    }
}

/// Renders the magic as printable ASCII with escapes, plus a hint for the
/// formats people most often hand us by mistake.
fn describe_magic(found: &[u8; 4]) -> String {
    let escaped: String = found.iter().flat_map(|b| std::ascii::escape_default(*b)).map(char::from).collect();
    let hint = match found {
        b"GGML" | b"lmgg" | b"GGJT" | b"tjgg" | b"GGMF" | b"fmgg" => " (a pre-GGUF ggml/GGJT file; convert it to GGUF)",
        b"FUGG" => " (byte-swapped magic)",
        [b'P', b'K', 3, 4] => " (a zip archive, e.g. a PyTorch checkpoint)",
        [b'<', ..] => " (an HTML/XML page; a failed download?)",
        [b'{', ..] => " (JSON)",
        _ => "",
    };
    format!("\"{escaped}\"{hint}")
}

/// GGUF v3 allows big-endian files; their version reads byte-swapped here.
fn version_hint(v: u32) -> &'static str {
    if v == 1 {
        " (GGUF v1 is obsolete; re-convert the model; Tether reads v2 and v3)"
    } else if (1..=3).contains(&v.swap_bytes()) {
        " (this looks like a big-endian GGUF file; Tether reads little-endian v2 and v3)"
    } else {
        " (Tether reads GGUF v2 and v3)"
    }
}
