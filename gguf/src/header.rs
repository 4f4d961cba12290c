//! Parsing and validation of the GGUF header (metadata + tensor table).
//!
//! The layout of a GGUF (v2/v3, little-endian) file is:
//!
//! ```text
//! magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count x (key: string, value_type: u32, value)
//! tensor_count x (name: string, n_dims: u32, dims: n_dims x u64, type: u32, offset: u64)
//! padding to `general.alignment` (default 32)
//! data section: tensor data at `offset` (relative to the section start)
//! ```
//!
//! Everything is validated here, once, so that [`crate::GgufFile`]'s
//! accessors can be infallible and the dequantizers can trust the tensor table.

use std::collections::HashMap;

use crate::error::GgufError;
use crate::reader::Cursor;
use crate::types::GgmlType;
use crate::value::Value;

const MAGIC: &[u8; 4] = b"GGUF";
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;
/// Byte offsets of the two counts in the fixed header, for error messages.
const TENSOR_COUNT_OFFSET: u64 = 8;
const KV_COUNT_OFFSET: u64 = 16;
/// `general.alignment` when the key is absent (`GGUF_DEFAULT_ALIGNMENT`).
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Keys and tensor names longer than this are treated as corruption.
const MAX_NAME_LEN: usize = 65_535;

/// Description of one tensor in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGUF/ggml order: `dims[0]` (ne\[0\]) varies fastest.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset of the data, relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Row-major (PyTorch/NumPy) shape: `dims` reversed. Data laid out with
    /// ne\[0\] fastest *is* row-major data of the reversed shape, so no
    /// transposition is ever needed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Product of the dimensions (1 for a zero-dimensional tensor).
    /// Validated not to overflow for tensors that come from a [`GgufFile`](crate::GgufFile).
    pub fn n_elements(&self) -> usize {
        self.dims.iter().fold(1usize, |acc, &d| acc.saturating_mul(d as usize))
    }

    /// Size of the tensor's data in bytes. 0 for a type without a known block
    /// layout (which a [`GgufFile`](crate::GgufFile) never contains).
    pub fn n_bytes(&self) -> usize {
        self.ggml_type.bytes_for(self.n_elements()).unwrap_or(0)
    }

    /// Length of one row (ne\[0\]); the unit along which quantization blocks run.
    pub fn row_len(&self) -> usize {
        self.dims.first().map_or(1, |&d| d as usize)
    }
}

/// Everything parsed from the header; independent of where the bytes live.
#[derive(Debug)]
pub(crate) struct Header {
    pub(crate) version: u32,
    pub(crate) alignment: u64,
    pub(crate) data_offset: usize,
    pub(crate) metadata: Vec<(String, Value)>,
    pub(crate) meta_index: HashMap<String, usize>,
    pub(crate) tensors: Vec<TensorInfo>,
    pub(crate) tensor_index: HashMap<String, usize>,
}

impl Header {
    /// Parses and validates the header of a complete GGUF file in `buf`.
    pub(crate) fn parse(buf: &[u8]) -> Result<Header, GgufError> {
        let mut c = Cursor::new(buf);
        let magic = c.take(4, "magic")?;
        if magic != MAGIC {
            let mut found = [0u8; 4];
            found.copy_from_slice(magic);
            return Err(GgufError::NotGguf { found });
        }
        let version = c.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let tensor_count = c.u64("tensor count")?;
        let kv_count = c.u64("metadata count")?;

        let metadata = parse_metadata(&mut c, kv_count)?;
        let mut meta_index = HashMap::with_capacity(metadata.len());
        for (i, (k, _)) in metadata.iter().enumerate() {
            if meta_index.insert(k.clone(), i).is_some() {
                return Err(GgufError::InvalidMetadata(format!("duplicate key '{k}'")));
            }
        }
        // The spec types general.alignment as u32; any integer type is
        // accepted since converters have been inconsistent about widths.
        let alignment = match meta_index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let v = &metadata[i].1;
                match v.as_u64() {
                    Some(a) if a.is_power_of_two() && a <= 1 << 30 => a,
                    _ => return Err(GgufError::InvalidMetadata(format!("general.alignment must be a power-of-two integer, got {v} ({})", v.type_name()))),
                }
            }
        };

        let tensors = parse_tensor_infos(&mut c, tensor_count, alignment)?;
        let mut tensor_index = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if tensor_index.insert(t.name.clone(), i).is_some() {
                return Err(GgufError::InvalidTensor { tensor: t.name.clone(), reason: "duplicate tensor name".into() });
            }
        }

        // The data section starts at the next multiple of the alignment.
        // (alignment <= 2^30 and pos <= buf.len(), so this cannot overflow.)
        let a = alignment as usize;
        let data_offset = c.pos().div_ceil(a) * a;
        let data_len = buf.len().saturating_sub(data_offset) as u64;
        check_tensor_placement(&tensors, data_len)?;

        Ok(Header { version, alignment, data_offset, metadata, meta_index, tensors, tensor_index })
    }
}

fn parse_metadata(c: &mut Cursor<'_>, kv_count: u64) -> Result<Vec<(String, Value)>, GgufError> {
    // Smallest possible pair: empty-string key (8) + type (4) + 1-byte value.
    let n = bounded_count(c, kv_count, 8 + 4 + 1, "metadata count", KV_COUNT_OFFSET)?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let key_at = c.pos();
        let key = c.string("metadata key").map_err(|e| e.context(|| format!("metadata entry #{i}")))?;
        if key.is_empty() || key.len() > MAX_NAME_LEN {
            return Err(GgufError::InvalidMetadata(format!("metadata key #{i} at byte offset {key_at} has invalid length {}", key.len())));
        }
        let ty = c.u32("value type").map_err(|e| e.context(|| format!("key '{key}'")))?;
        let value = Value::parse(c, ty).map_err(|e| e.context(|| format!("key '{key}'")))?;
        out.push((key, value));
    }
    Ok(out)
}

/// Checks a count read from the fixed header against the remaining bytes
/// (the same rule as [`Cursor::count`], for counts that precede their items
/// by more than one field).
fn bounded_count(c: &Cursor<'_>, n: u64, min_item: usize, what: &str, offset: u64) -> Result<usize, GgufError> {
    let available = c.remaining() as u64;
    match n.checked_mul(min_item as u64) {
        Some(need) if need <= available => Ok(n as usize),
        _ => Err(GgufError::ImplausibleLength { what: what.to_string(), len: n, offset, available }),
    }
}

fn parse_tensor_infos(c: &mut Cursor<'_>, tensor_count: u64, alignment: u64) -> Result<Vec<TensorInfo>, GgufError> {
    // Smallest record: empty name (8) + n_dims (4) + type (4) + offset (8).
    let n = bounded_count(c, tensor_count, 8 + 4 + 4 + 8, "tensor count", TENSOR_COUNT_OFFSET)?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let name = c.string("tensor name").map_err(|e| e.context(|| format!("tensor info #{i}")))?;
        let ctx = |e: GgufError| e.context(|| format!("tensor '{name}'"));
        let invalid = |reason: String| GgufError::InvalidTensor { tensor: name.clone(), reason };
        if name.is_empty() || name.len() > MAX_NAME_LEN {
            return Err(invalid(format!("tensor #{i} has a name of invalid length {}", name.len())));
        }
        let n_dims = c.u32("n_dims").map_err(ctx)?;
        if n_dims > MAX_DIMS {
            return Err(invalid(format!("{n_dims} dimensions (ggml allows at most {MAX_DIMS})")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64("dimension").map_err(ctx)?);
        }
        let type_id = c.u32("tensor type").map_err(ctx)?;
        let offset = c.u64("tensor data offset").map_err(ctx)?;
        let ggml_type = GgmlType::from_id(type_id);

        // Each dim and the element count must fit in i64 (ggml's int64_t ne)
        // and in usize, so later `as usize` conversions are lossless.
        let fits = |n: u64| n <= i64::MAX as u64 && usize::try_from(n).is_ok();
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| if fits(d) { acc.checked_mul(d) } else { None })
            .filter(|&n| fits(n))
            .map(|n| n as usize)
            .ok_or_else(|| invalid(format!("element count of dims {dims:?} overflows")))?;
        let (Some(block_size), Some(_)) = (ggml_type.block_size(), ggml_type.type_size()) else {
            return Err(GgufError::UnsupportedType { tensor: name.clone(), ty: ggml_type.to_string() });
        };
        // ggml quantizes along rows, so each row must be whole blocks; that
        // also makes every quantization group lie within a single row.
        let row_len = dims.first().copied().unwrap_or(1) as usize;
        if !row_len.is_multiple_of(block_size) {
            return Err(GgufError::ShapeMismatch { what: format!("tensor '{name}' row (ne[0])"), ty: ggml_type.to_string(), n: row_len, block_size });
        }
        if ggml_type.bytes_for(n_elements).is_none() {
            return Err(invalid(format!("byte size of {n_elements} {ggml_type} elements overflows")));
        }
        if offset % alignment != 0 {
            return Err(invalid(format!("data offset {offset} is not a multiple of the alignment {alignment}")));
        }
        out.push(TensorInfo { name, dims, ggml_type, offset });
    }
    Ok(out)
}

/// Every tensor must lie inside the data section, and no two may overlap
/// (overlap means a corrupt tensor table, and would alias weights silently).
fn check_tensor_placement(tensors: &[TensorInfo], data_len: u64) -> Result<(), GgufError> {
    let mut spans: Vec<(u64, u64, usize)> = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let start = t.offset;
        // n_bytes fits in usize (checked while parsing), hence in u64.
        let end = start.checked_add(t.n_bytes() as u64);
        match end {
            Some(end) if end <= data_len => spans.push((start, end, i)),
            _ => return Err(GgufError::TensorOutOfBounds { tensor: t.name.clone(), start, end: end.unwrap_or(u64::MAX), data_len }),
        }
    }
    spans.sort_unstable();
    // Sweep in offset order, remembering the furthest end seen so far.
    let mut furthest: Option<(u64, usize)> = None;
    for &(start, end, i) in &spans {
        if start == end {
            continue; // empty tensors occupy no bytes
        }
        if let Some((prev_end, j)) = furthest {
            if start < prev_end {
                return Err(GgufError::InvalidTensor {
                    tensor: tensors[i].name.clone(),
                    reason: format!("data at {start}..{end} overlaps tensor '{}' (which ends at {prev_end})", tensors[j].name),
                });
            }
        }
        if furthest.is_none_or(|(e, _)| end > e) {
            furthest = Some((end, i));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
