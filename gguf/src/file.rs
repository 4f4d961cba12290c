//! [`GgufFile`]: a validated GGUF header plus the bytes it describes.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::affine::{to_affine, AffineQuant};
use crate::dequant::dequantize;
use crate::error::GgufError;
use crate::header::{Header, TensorInfo};
use crate::value::Value;

/// A parsed GGUF file. Owns the file's bytes; tensor data is borrowed from them.
///
/// The file is read into memory rather than memory-mapped: a mapping is
/// `unsafe` (another process could change the file under it), and Tether
/// keeps unsafe code in its MLX binding alone. Reading a model file costs a
/// fraction of a second next to building its weights on the device.
pub struct GgufFile {
    path: PathBuf,
    bytes: Vec<u8>,
    header: Header,
}

impl GgufFile {
    /// Reads and parses the file at `path`, validating the whole header and
    /// the position of every tensor. Tensor data is not read until used.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io_err = |source| GgufError::Io { path: path.to_path_buf(), source };
        let bytes = std::fs::read(path).map_err(io_err)?;
        let header = Header::parse(&bytes)?;
        Ok(GgufFile { path: path.to_path_buf(), bytes, header })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// Data alignment in bytes (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> usize {
        self.header.data_offset
    }

    /// Size of the mapped file in bytes.
    pub fn file_len(&self) -> usize {
        self.bytes.len()
    }

    /// All metadata key/value pairs, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.header.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        let i = *self.header.meta_index.get(key)?;
        Some(&self.header.metadata[i].1)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    /// Any non-negative integer value, widened (see [`Value::as_u64`]).
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.get(key)?.as_i64()
    }

    /// An `f32` or `f64` value as `f32`.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f32()
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key)?.as_f64()
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }

    pub fn get_array(&self, key: &str) -> Option<&[Value]> {
        self.get(key)?.as_array()
    }

    /// An array whose elements are all strings (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get_array(key)?.iter().map(Value::as_str).collect()
    }

    /// An array whose elements are all `f32`/`f64` (e.g. `tokenizer.ggml.scores`).
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get_array(key)?.iter().map(Value::as_f32).collect()
    }

    /// An array whose elements are all integers (e.g. `tokenizer.ggml.token_type`).
    pub fn get_i64_array(&self, key: &str) -> Option<Vec<i64>> {
        self.get_array(key)?.iter().map(Value::as_i64).collect()
    }

    /// `general.architecture`, e.g. `"llama"`; architecture-specific keys
    /// are prefixed with it.
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    /// Looks up `"{architecture}.{suffix}"`, e.g. `arch_get("block_count")`.
    pub fn arch_get(&self, suffix: &str) -> Option<&Value> {
        let arch = self.architecture()?;
        self.get(&format!("{arch}.{suffix}"))
    }

    /// Tensor descriptions, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        let i = *self.header.tensor_index.get(name)?;
        Some(&self.header.tensors[i])
    }

    /// The raw bytes of tensor `t`.
    ///
    /// For a `TensorInfo` taken from this file the slice is exactly
    /// `t.n_bytes()` long (checked at open). A `TensorInfo` from elsewhere
    /// whose range falls outside the file yields an empty slice rather than a
    /// panic; the dequantizers then report a [`GgufError::SizeMismatch`].
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let range = usize::try_from(t.offset)
            .ok()
            .and_then(|off| off.checked_add(self.header.data_offset))
            .and_then(|start| Some(start..start.checked_add(t.n_bytes())?));
        range.and_then(|r| self.bytes.get(r)).unwrap_or(&[])
    }

    /// Dequantizes tensor `t` to `f32`, row-major with shape `t.shape()`.
    pub fn dequantize_f32(&self, t: &TensorInfo) -> Result<Vec<f32>, GgufError> {
        dequantize(t.ggml_type, self.tensor_bytes(t), t.n_elements()).map_err(|e| name_tensor(e, &t.name))
    }

    /// The exact affine form of tensor `t` (see [`AffineQuant`]), or `None`
    /// for types that have no exact group-32 affine form.
    pub fn affine(&self, t: &TensorInfo) -> Result<Option<AffineQuant>, GgufError> {
        to_affine(t.ggml_type, self.tensor_bytes(t), t.n_elements()).map_err(|e| name_tensor(e, &t.name))
    }
}

/// The free-standing dequantizers do not know tensor names; fill them in.
fn name_tensor(e: GgufError, name: &str) -> GgufError {
    match e {
        GgufError::UnsupportedType { ty, .. } => GgufError::UnsupportedType { tensor: name.to_string(), ty },
        GgufError::ShapeMismatch { ty, n, block_size, .. } => GgufError::ShapeMismatch { what: format!("tensor '{name}'"), ty, n, block_size },
        other => other,
    }
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("file_len", &self.bytes.len())
            .field("n_metadata", &self.header.metadata.len())
            .field("n_tensors", &self.header.tensors.len())
            .finish()
    }
}
