//! Parsing tests over hand-built GGUF files.

use super::*;
use crate::testutil::{put_str, put_u32, put_u64, Builder, Rng, TempFile};
use crate::value::tag;
use crate::GgufFile;

fn open(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let f = TempFile::new(bytes);
    GgufFile::open(f.path())
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// One key of every value type, including nested and empty arrays.
fn all_types() -> Vec<(&'static str, Value)> {
    vec![
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60_000)),
        ("t.i16", Value::I16(-30_000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.u64", Value::U64(u64::MAX)),
        ("t.i64", Value::I64(i64::MIN)),
        ("t.f32", Value::F32(1.5e-6)),
        ("t.f64", Value::F64(-2.25e300)),
        ("t.bool", Value::Bool(true)),
        ("t.false", Value::Bool(false)),
        ("t.string", Value::String("héllo, wörld ✓".into())),
        ("t.empty_string", Value::String(String::new())),
        ("t.strings", Value::Array(vec![Value::String("a".into()), Value::String("".into()), Value::String("ĠHello".into())])),
        ("t.i32s", Value::Array(vec![Value::I32(1), Value::I32(-2), Value::I32(3)])),
        ("t.f32s", Value::Array(vec![Value::F32(0.5), Value::F32(-1.0)])),
        ("t.empty", Value::Array(vec![])),
        ("t.nested", Value::Array(vec![Value::Array(vec![Value::U8(1), Value::U8(2)]), Value::Array(vec![Value::U8(3)])])),
    ]
}

#[test]
fn parses_every_value_type_in_file_order() {
    let mut b = Builder::new();
    for (k, v) in all_types() {
        b = b.kv(k, v);
    }
    let f = open(&b.build()).unwrap();
    assert_eq!(f.version(), 3);
    let expected = all_types();
    assert_eq!(f.metadata().len(), expected.len());
    for ((k, v), (ek, ev)) in f.metadata().iter().zip(&expected) {
        assert_eq!(k, ek);
        assert_eq!(v, ev, "value of {k}");
    }
    assert!(f.tensors().is_empty());
}

#[test]
fn typed_getters_convert_loosely_but_never_lie() {
    let mut b = Builder::new().kv("general.architecture", Value::String("llama".into()));
    b = b.kv("llama.block_count", Value::U32(30));
    for (k, v) in all_types() {
        b = b.kv(k, v);
    }
    let f = open(&b.build()).unwrap();
    assert_eq!(f.get_u64("t.u8"), Some(200));
    assert_eq!(f.get_u64("t.u64"), Some(u64::MAX));
    assert_eq!(f.get_u64("t.i8"), None, "negative ints are not u64");
    assert_eq!(f.get_i64("t.i64"), Some(i64::MIN));
    assert_eq!(f.get_i64("t.u32"), Some(4_000_000_000));
    assert_eq!(f.get_f32("t.f32"), Some(1.5e-6));
    assert_eq!(f.get_f64("t.f64"), Some(-2.25e300));
    assert_eq!(f.get_f32("t.u32"), None);
    assert_eq!(f.get_bool("t.bool"), Some(true));
    assert_eq!(f.get_bool("t.u8"), None);
    assert_eq!(f.get_str("t.string"), Some("héllo, wörld ✓"));
    assert_eq!(f.get_str("t.u8"), None);
    assert_eq!(f.get_str("missing"), None);
    assert_eq!(f.get_str_array("t.strings").unwrap(), vec!["a", "", "ĠHello"]);
    assert_eq!(f.get_str_array("t.i32s"), None, "GGUF arrays are homogeneous");
    assert_eq!(f.get_f32_array("t.strings"), None);
    assert_eq!(f.get_str_array("t.string"), None);
    assert_eq!(f.get_i64_array("t.i32s").unwrap(), vec![1, -2, 3]);
    assert_eq!(f.get_f32_array("t.f32s").unwrap(), vec![0.5, -1.0]);
    assert_eq!(f.get_array("t.empty").unwrap().len(), 0);
    assert_eq!(f.get_array("t.nested").unwrap()[0].as_array().unwrap().len(), 2);
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(f.arch_get("block_count").and_then(Value::as_u64), Some(30));
}

#[test]
fn tensor_table_shapes_offsets_and_bytes() {
    let a: Vec<f32> = (0..6).map(|i| i as f32).collect();
    let q8 = vec![7u8; 34 * 2]; // 2 blocks of Q8_0 = 64 elements
    let b = Builder::new()
        .kv("general.architecture", Value::String("test".into()))
        .tensor("a", &[3, 2], GgmlType::F32, f32_bytes(&a))
        .tensor("q", &[32, 2], GgmlType::Q8_0, q8.clone())
        .tensor("scalar", &[], GgmlType::F32, f32_bytes(&[42.0]));
    let offsets = b.offsets();
    let f = open(&b.build()).unwrap();
    assert_eq!(f.tensors().len(), 3);
    assert_eq!(f.data_offset() % 32, 0);
    assert_eq!(f.alignment(), 32);

    let t = f.tensor("a").unwrap();
    assert_eq!(t.dims, vec![3, 2]);
    assert_eq!(t.shape(), vec![2, 3], "row-major shape is dims reversed");
    assert_eq!((t.n_elements(), t.n_bytes(), t.row_len()), (6, 24, 3));
    assert_eq!(t.offset, offsets[0]);
    assert_eq!(f.dequantize_f32(t).unwrap(), a);

    let q = f.tensor("q").unwrap();
    assert_eq!(q.ggml_type, GgmlType::Q8_0);
    assert_eq!(q.offset, offsets[1]);
    assert_eq!(q.offset % 32, 0);
    assert_eq!(f.tensor_bytes(q), &q8[..]);
    assert_eq!((q.n_elements(), q.n_bytes()), (64, 68));

    let s = f.tensor("scalar").unwrap();
    assert_eq!(s.shape(), Vec::<usize>::new());
    assert_eq!(f.dequantize_f32(s).unwrap(), vec![42.0]);
    assert!(f.tensor("nope").is_none());
    let names: Vec<_> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["a", "q", "scalar"], "file order is kept");
}

#[test]
fn honours_custom_alignment_and_v2() {
    let mut b = Builder::new().kv("general.alignment", Value::U32(64)).tensor("x", &[5], GgmlType::F32, f32_bytes(&[1.0; 5])).tensor(
        "y",
        &[3],
        GgmlType::F32,
        f32_bytes(&[2.0; 3]),
    );
    b.alignment = 64;
    b.version = 2;
    let f = open(&b.build()).unwrap();
    assert_eq!(f.version(), 2);
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.tensor("y").unwrap().offset, 64);
    assert_eq!(f.dequantize_f32(f.tensor("y").unwrap()).unwrap(), vec![2.0; 3]);
}

#[test]
fn zero_element_tensor_is_fine() {
    let f = open(&Builder::new().tensor("e", &[0, 4], GgmlType::F32, vec![]).build()).unwrap();
    let t = f.tensor("e").unwrap();
    assert_eq!(t.n_elements(), 0);
    assert!(f.dequantize_f32(t).unwrap().is_empty());
}

// ---- error cases ----------------------------------------------------------

#[test]
fn bad_magic_says_what_was_found() {
    let mut bytes = Builder::new().build();
    bytes[..4].copy_from_slice(b"PK\x03\x04");
    let err = open(&bytes).unwrap_err();
    assert!(matches!(err, GgufError::NotGguf { found } if &found == b"PK\x03\x04"), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("PK\\x03\\x04") && msg.contains("zip"), "{msg}");
}

#[test]
fn empty_and_tiny_files_are_truncated() {
    assert!(matches!(open(b"").unwrap_err(), GgufError::Truncated { offset: 0, .. }));
    assert!(matches!(open(b"GG").unwrap_err(), GgufError::Truncated { offset: 0, .. }));
}

#[test]
fn unsupported_versions() {
    for (v, hint) in [(1u32, "obsolete"), (4, "v2 and v3"), (0x0300_0000, "big-endian")] {
        let mut b = Builder::new();
        b.version = v;
        let err = open(&b.build()).unwrap_err();
        assert!(matches!(err, GgufError::UnsupportedVersion(x) if x == v), "{err:?}");
        assert!(err.to_string().contains(hint), "{err}");
    }
}

#[test]
fn truncated_header_reports_offset() {
    let bytes = Builder::new().kv("a", Value::U32(1)).build();
    // Cut inside the tensor count (bytes 8..16).
    match open(&bytes[..10]).unwrap_err() {
        GgufError::Truncated { what, offset } => {
            assert_eq!(offset, 8);
            assert!(what.contains("tensor count"), "{what}");
        }
        e => panic!("expected Truncated, got {e:?}"),
    }
}

#[test]
fn truncated_value_names_the_key() {
    let bytes = Builder::new().kv("general.pi", Value::F64(3.25)).build();
    // Header(24) + key(8 + 10) + type(4) = 46; the f64 starts there.
    let err = open(&bytes[..46 + 3]).unwrap_err();
    match &err {
        GgufError::Truncated { what, offset } => {
            assert_eq!(*offset, 46);
            assert!(what.contains("general.pi"), "{what}");
        }
        e => panic!("expected Truncated, got {e:?}"),
    }
}

/// Raw file: header with given counts, then `body`.
fn raw(tensor_count: u64, kv_count: u64, body: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    put_u32(&mut b, 3);
    put_u64(&mut b, tensor_count);
    put_u64(&mut b, kv_count);
    b.extend_from_slice(body);
    b
}

#[test]
fn absurd_array_length_is_rejected_before_allocating() {
    let mut body = Vec::new();
    put_str(&mut body, "tokenizer.ggml.tokens");
    put_u32(&mut body, tag::ARRAY);
    put_u32(&mut body, tag::STRING);
    put_u64(&mut body, 1 << 60);
    body.extend_from_slice(&[0u8; 64]);
    let err = open(&raw(0, 1, &body)).unwrap_err();
    match &err {
        GgufError::ImplausibleLength { what, len, available, .. } => {
            assert_eq!(*len, 1 << 60);
            assert_eq!(*available, 64);
            assert!(what.contains("tokenizer.ggml.tokens"), "{what}");
        }
        e => panic!("expected ImplausibleLength, got {e:?}"),
    }
}

#[test]
fn absurd_string_and_counts_are_rejected() {
    let mut body = Vec::new();
    put_str(&mut body, "k");
    put_u32(&mut body, tag::STRING);
    put_u64(&mut body, u64::MAX);
    let err = open(&raw(0, 1, &body)).unwrap_err();
    assert!(matches!(err, GgufError::ImplausibleLength { len: u64::MAX, .. }), "{err:?}");

    let err = open(&raw(0, u64::MAX / 2, &[])).unwrap_err();
    assert!(matches!(err, GgufError::ImplausibleLength { offset: 16, .. }), "{err:?}");
    let err = open(&raw(1 << 40, 0, &[0; 100])).unwrap_err();
    assert!(matches!(err, GgufError::ImplausibleLength { offset: 8, .. }), "{err:?}");
}

#[test]
fn tensor_past_end_of_file_is_out_of_bounds() {
    let bytes = Builder::new().tensor("w", &[64], GgmlType::F32, f32_bytes(&[1.0; 64])).build();
    // Drop the last 4 bytes of the tensor data.
    let err = open(&bytes[..bytes.len() - 4]).unwrap_err();
    match &err {
        GgufError::TensorOutOfBounds { tensor, start, end, data_len } => {
            assert_eq!(tensor, "w");
            assert_eq!((*start, *end, *data_len), (0, 256, 252));
        }
        e => panic!("expected TensorOutOfBounds, got {e:?}"),
    }
    assert!(err.to_string().contains("truncated"));

    let mut b = Builder::new().tensor("w", &[8], GgmlType::F32, f32_bytes(&[1.0; 8]));
    b.tensors[0].offset_override = Some(u64::MAX - 31);
    let err = open(&b.build()).unwrap_err();
    assert!(matches!(err, GgufError::TensorOutOfBounds { end: u64::MAX, .. }), "{err:?}");
}

#[test]
fn misaligned_and_overlapping_tensors() {
    let mut b = Builder::new().tensor("a", &[16], GgmlType::F32, f32_bytes(&[0.0; 16])).tensor("b", &[16], GgmlType::F32, f32_bytes(&[0.0; 16]));
    b.tensors[1].offset_override = Some(4);
    let err = open(&b.build()).unwrap_err();
    assert!(matches!(&err, GgufError::InvalidTensor { tensor, reason } if tensor == "b" && reason.contains("alignment")), "{err:?}");
    b.tensors[1].offset_override = Some(32);
    let err = open(&b.build()).unwrap_err();
    assert!(matches!(&err, GgufError::InvalidTensor { tensor, reason } if tensor == "b" && reason.contains("overlaps tensor 'a'")), "{err:?}");
}

#[test]
fn duplicates_are_rejected() {
    let b = Builder::new().kv("k", Value::U8(1)).kv("k", Value::U8(2));
    assert!(matches!(open(&b.build()).unwrap_err(), GgufError::InvalidMetadata(m) if m.contains("duplicate key 'k'")));
    let b = Builder::new().tensor("t", &[1], GgmlType::F32, f32_bytes(&[0.0])).tensor("t", &[1], GgmlType::F32, f32_bytes(&[0.0]));
    assert!(matches!(open(&b.build()).unwrap_err(), GgufError::InvalidTensor { reason, .. } if reason.contains("duplicate")));
}

#[test]
fn bad_dims() {
    let b = Builder::new().tensor("t", &[1, 1, 1, 1, 1], GgmlType::F32, f32_bytes(&[0.0]));
    assert!(matches!(open(&b.build()).unwrap_err(), GgufError::InvalidTensor { reason, .. } if reason.contains("5 dimensions")));
    let b = Builder::new().tensor("t", &[1 << 32, 1 << 32], GgmlType::F32, vec![]);
    assert!(matches!(open(&b.build()).unwrap_err(), GgufError::InvalidTensor { reason, .. } if reason.contains("overflows")));
    // Fits u64 and i64 as an element count, but not as a byte count.
    let b = Builder::new().tensor("t", &[1 << 31, 1 << 31], GgmlType::F32, vec![]);
    assert!(matches!(open(&b.build()).unwrap_err(), GgufError::InvalidTensor { .. }));
}

#[test]
fn types_are_checked() {
    let mut b = Builder::new().tensor("t", &[32], GgmlType::F32, vec![0; 18]);
    b.tensors[0].type_id = 4; // removed Q4_2: no known layout
    let err = open(&b.build()).unwrap_err();
    assert!(matches!(&err, GgufError::UnsupportedType { tensor, ty } if tensor == "t" && ty.contains('4')), "{err:?}");

    // Known layout but no dequantizer: opens; using it names the tensor.
    let f = open(&Builder::new().tensor("q2", &[256], GgmlType::Other(10), vec![0; 84]).build()).unwrap();
    let t = f.tensor("q2").unwrap();
    let err = f.dequantize_f32(t).unwrap_err();
    assert!(matches!(&err, GgufError::UnsupportedType { tensor, ty } if tensor == "q2" && ty == "Q2_K"), "{err:?}");
    assert!(matches!(f.affine(t).unwrap_err(), GgufError::UnsupportedType { .. }));

    // Rows must be whole blocks.
    let b = Builder::new().tensor("odd", &[16, 2], GgmlType::Q4_0, vec![0; 18]);
    let err = open(&b.build()).unwrap_err();
    assert!(matches!(&err, GgufError::ShapeMismatch { n: 16, block_size: 32, .. }), "{err:?}");
    assert!(err.to_string().contains("odd"), "{err}");
}

#[test]
fn bad_alignment_values() {
    for v in [Value::U32(0), Value::U32(3), Value::String("32".into()), Value::I32(-32)] {
        let b = Builder::new().kv("general.alignment", v.clone());
        let err = open(&b.build()).unwrap_err();
        assert!(matches!(&err, GgufError::InvalidMetadata(m) if m.contains("alignment")), "{v:?}: {err:?}");
    }
}

#[test]
fn unknown_value_type_and_bad_utf8() {
    let mut body = Vec::new();
    put_str(&mut body, "k");
    put_u32(&mut body, 13);
    body.extend_from_slice(&[0; 16]);
    let err = open(&raw(0, 1, &body)).unwrap_err();
    assert!(matches!(&err, GgufError::InvalidMetadata(m) if m.contains("unknown value type 13") && m.contains("'k'")), "{err:?}");

    let mut body = Vec::new();
    put_u64(&mut body, 2);
    body.extend_from_slice(&[0xC3, 0x28]); // invalid UTF-8
    put_u32(&mut body, tag::U8);
    body.push(0);
    let err = open(&raw(0, 1, &body)).unwrap_err();
    assert!(matches!(&err, GgufError::InvalidMetadata(m) if m.contains("UTF-8")), "{err:?}");
}

#[test]
fn missing_file_is_io_error_with_path() {
    let err = GgufFile::open(std::path::Path::new("/nonexistent/dir/model.gguf")).unwrap_err();
    assert!(matches!(&err, GgufError::Io { path, .. } if path.ends_with("model.gguf")));
    assert!(err.to_string().contains("/nonexistent/dir/model.gguf"));
}

/// A valid file with a bit of everything, for the robustness tests.
fn sample_file() -> Vec<u8> {
    let mut b = Builder::new();
    for (k, v) in all_types() {
        b = b.kv(k, v);
    }
    b.tensor("a", &[4, 2], GgmlType::F32, f32_bytes(&[1.0; 8])).tensor("q", &[32], GgmlType::Q4_0, vec![0x11; 18]).build()
}

#[test]
fn every_truncation_is_an_error_never_a_panic() {
    let bytes = sample_file();
    // Tensor "q" (18 bytes) sits at data offset 32; the padding after it may
    // be cut freely, anything before its end may not.
    let last_end = Header::parse(&bytes).unwrap().data_offset + 32 + 18;
    for len in 0..bytes.len() {
        match Header::parse(&bytes[..len]) {
            Ok(_) => assert!(len >= last_end, "prefix of {len} bytes parsed"),
            Err(_) => assert!(len < last_end),
        }
    }
}

#[test]
fn random_corruption_never_panics() {
    let bytes = sample_file();
    let mut rng = Rng::new(7);
    let mut n_err = 0;
    for _ in 0..3000 {
        let mut b = bytes.clone();
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(b.len());
            b[i] = rng.next_u64() as u8;
        }
        match Header::parse(&b) {
            Ok(h) => {
                // Whatever parsed must be internally consistent.
                for t in &h.tensors {
                    assert!(h.data_offset as u64 + t.offset + t.n_bytes() as u64 <= b.len() as u64);
                }
            }
            Err(e) => {
                n_err += 1;
                let _ = e.to_string();
            }
        }
    }
    assert!(n_err > 100, "corruption should usually be detected ({n_err})");
}

#[test]
fn gguf_file_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<GgufFile>();
}
