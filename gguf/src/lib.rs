//! GGUF reading and dequantization for Tether.
//!
//! [`GgufFile::open`] reads a GGUF (v2 or v3) file and validates its
//! entire header up front: every length, count and offset is checked against
//! the file size before anything is allocated, so a truncated or corrupt file
//! produces a descriptive [`GgufError`] instead of a panic or a huge
//! allocation. Tensor data stays in the file bytes until it is dequantized
//! ([`GgufFile::dequantize_f32`], bit-exact with ggml) or converted to an
//! exact scale/bias form ([`GgufFile::affine`]) for backends that support
//! affine group quantization natively.
//!
//! ```no_run
//! # fn main() -> Result<(), gguf::GgufError> {
//! let f = gguf::GgufFile::open(std::path::Path::new("model.gguf"))?;
//! let layers = f.arch_get("block_count").and_then(|v| v.as_u64());
//! let t = f.tensor("token_embd.weight").expect("embeddings");
//! let w: Vec<f32> = f.dequantize_f32(t)?; // row-major, shape t.shape()
//! # let _ = (layers, w); Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_debug_implementations)]

mod affine;
mod dequant;
mod error;
mod file;
mod header;
mod parallel;
mod reader;
mod types;
mod value;

#[cfg(test)]
mod testutil;

pub use affine::{to_affine, AffineQuant, AFFINE_GROUP_SIZE};
pub use dequant::{dequantize, dequantize_into};
pub use error::GgufError;
pub use file::GgufFile;
pub use header::{TensorInfo, DEFAULT_ALIGNMENT};
pub use types::{GgmlType, QK_K};
pub use value::Value;
