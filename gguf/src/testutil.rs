//! Test helpers: a minimal GGUF writer, temp files and a tiny PRNG.
//!
//! The writer is deliberately independent of the parser (it shares only the
//! `Value` enum) so that parsing tests check the format, not the code against
//! itself.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use half::f16;

use crate::types::GgmlType;
use crate::value::{tag, Value};

pub(crate) struct TestTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub data: Vec<u8>,
    /// Written instead of the computed offset when set.
    pub offset_override: Option<u64>,
}

/// Builds GGUF files in memory.
pub(crate) struct Builder {
    pub version: u32,
    pub kvs: Vec<(String, Value)>,
    pub tensors: Vec<TestTensor>,
    /// Alignment used for layout; written as `general.alignment` only if the
    /// caller adds that key.
    pub alignment: usize,
}

impl Builder {
    pub fn new() -> Self {
        Builder { version: 3, kvs: Vec::new(), tensors: Vec::new(), alignment: 32 }
    }

    pub fn kv(mut self, key: &str, v: Value) -> Self {
        self.kvs.push((key.to_string(), v));
        self
    }

    pub fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Self {
        self.tensors.push(TestTensor { name: name.to_string(), dims: dims.to_vec(), type_id: ty.id(), data, offset_override: None });
        self
    }

    /// Data-section offsets the writer will use for each tensor.
    pub fn offsets(&self) -> Vec<u64> {
        let mut off = 0usize;
        self.tensors
            .iter()
            .map(|t| {
                let o = off;
                off = (off + t.data.len()).div_ceil(self.alignment) * self.alignment;
                o as u64
            })
            .collect()
    }

    pub fn build(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        put_u32(&mut b, self.version);
        put_u64(&mut b, self.tensors.len() as u64);
        put_u64(&mut b, self.kvs.len() as u64);
        for (k, v) in &self.kvs {
            put_str(&mut b, k);
            put_u32(&mut b, value_tag(v));
            put_value(&mut b, v);
        }
        let offsets = self.offsets();
        for (t, off) in self.tensors.iter().zip(&offsets) {
            put_str(&mut b, &t.name);
            put_u32(&mut b, t.dims.len() as u32);
            for &d in &t.dims {
                put_u64(&mut b, d);
            }
            put_u32(&mut b, t.type_id);
            put_u64(&mut b, t.offset_override.unwrap_or(*off));
        }
        pad_to(&mut b, self.alignment);
        let data_start = b.len();
        for (t, off) in self.tensors.iter().zip(&offsets) {
            b.resize(data_start + *off as usize, 0);
            b.extend_from_slice(&t.data);
        }
        if !self.tensors.is_empty() {
            pad_to(&mut b, self.alignment);
        }
        b
    }
}

fn pad_to(b: &mut Vec<u8>, a: usize) {
    b.resize(b.len().div_ceil(a) * a, 0);
}

pub(crate) fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_str(b: &mut Vec<u8>, s: &str) {
    put_u64(b, s.len() as u64);
    b.extend_from_slice(s.as_bytes());
}

pub(crate) fn value_tag(v: &Value) -> u32 {
    match v {
        Value::U8(_) => tag::U8,
        Value::I8(_) => tag::I8,
        Value::U16(_) => tag::U16,
        Value::I16(_) => tag::I16,
        Value::U32(_) => tag::U32,
        Value::I32(_) => tag::I32,
        Value::U64(_) => tag::U64,
        Value::I64(_) => tag::I64,
        Value::F32(_) => tag::F32,
        Value::F64(_) => tag::F64,
        Value::Bool(_) => tag::BOOL,
        Value::String(_) => tag::STRING,
        Value::Array(_) => tag::ARRAY,
    }
}

/// Encodes a value (without its type tag). Arrays take their element type
/// from the first element; empty arrays are written as arrays of u32.
pub(crate) fn put_value(b: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => b.push(*x),
        Value::I8(x) => b.push(*x as u8),
        Value::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => b.push(*x as u8),
        Value::String(s) => put_str(b, s),
        Value::Array(items) => {
            put_u32(b, items.first().map_or(tag::U32, value_tag));
            put_u64(b, items.len() as u64);
            for it in items {
                put_value(b, it);
            }
        }
    }
}

/// A file in the temp dir, removed on drop.
pub(crate) struct TempFile(pub PathBuf);

impl TempFile {
    pub fn new(bytes: &[u8]) -> TempFile {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!("tether-gguf-test-{}-{}.gguf", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        std::fs::write(&path, bytes).expect("write temp file");
        TempFile(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// xorshift64*: deterministic, dependency-free randomness for tests.
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next_u64() as u8;
        }
    }
    /// A finite f16 in roughly [-2, 2], as little-endian bytes.
    pub fn f16_bytes(&mut self) -> [u8; 2] {
        let x = (self.next_u64() % 40_001) as f32 / 10_000.0 - 2.0;
        f16::from_f32(x).to_bits().to_le_bytes()
    }
}

/// Byte offsets of the f16 scale fields within one block of `ty`.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// `n_blocks` random blocks of `ty` whose f16 scales are finite and modest,
/// so results contain no NaN/inf and can be compared exactly.
pub(crate) fn random_blocks(ty: GgmlType, n_blocks: usize, rng: &mut Rng) -> Vec<u8> {
    let ts = ty.type_size().expect("known type");
    let mut buf = vec![0u8; ts * n_blocks];
    rng.fill(&mut buf);
    for block in buf.chunks_exact_mut(ts) {
        for &at in f16_fields(ty) {
            block[at..at + 2].copy_from_slice(&rng.f16_bytes());
        }
    }
    if matches!(ty, GgmlType::F16 | GgmlType::BF16 | GgmlType::F32) {
        // Overwrite raw floats with finite values too.
        for x in buf.chunks_exact_mut(ts) {
            let v = (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0;
            match ty {
                GgmlType::F32 => x.copy_from_slice(&v.to_le_bytes()),
                GgmlType::F16 => x.copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes()),
                _ => x.copy_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes()),
            }
        }
    }
    buf
}
