//! Checks against real model files and reference values produced by the
//! official `gguf` Python package (see `make_fixtures.py`).
//!
//! A missing model file fails the test: scripts/test.sh fetches the models.

mod common;

use std::path::Path;

use common::{test_model, Json};
use gguf::{GgmlType, GgufFile};

const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const QWEN: &str = "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf";
const REL_TOL: f64 = 1e-5;

fn load_fixture(model: &str) -> Json {
    let stem = model.trim_end_matches(".gguf");
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/{stem}.json"));
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
    Json::parse(&text).unwrap_or_else(|e| panic!("parse {}: {e}", p.display()))
}

fn close(got: f64, want: f64, rel: f64) -> bool {
    (got - want).abs() <= rel * want.abs()
}

/// Compares every fixture tensor of `model` against our dequantization.
fn check_against_fixture(model: &str) {
    let path = test_model(model);
    let f = GgufFile::open(&path).unwrap();
    let fx = load_fixture(model);
    assert_eq!(fx.get("model").str(), model);
    let tensors = fx.get("tensors").arr();
    assert!(!tensors.is_empty());
    for t in tensors {
        let name = t.get("name").str();
        let info = f.tensor(name).unwrap_or_else(|| panic!("tensor {name} missing"));
        assert_eq!(info.ggml_type.to_string(), t.get("type").str(), "{name}");
        let shape: Vec<usize> = t.get("shape").arr().iter().map(|d| d.num() as usize).collect();
        assert_eq!(info.shape(), shape, "{name}");
        assert_eq!(info.n_elements(), t.get("n_elements").num() as usize, "{name}");

        let w = f.dequantize_f32(info).unwrap();
        assert_eq!(w.len(), info.n_elements());
        for (i, want) in t.get("first").arr().iter().enumerate() {
            let (got, want) = (w[i] as f64, want.num());
            assert!(close(got, want, REL_TOL), "{name}[{i}]: {got} vs reference {want}");
        }
        for s in t.get("samples").arr() {
            let (i, want) = (s.arr()[0].num() as usize, s.arr()[1].num());
            let got = w[i] as f64;
            assert!(close(got, want, REL_TOL), "{name}[{i}]: {got} vs reference {want}");
        }
        // Whole-tensor checks. Values should be bit-identical, so sums differ
        // only by f64 summation order (~n * 1e-16 relative to sum_abs).
        let (mut sum, mut sum_sq, mut sum_abs) = (0.0f64, 0.0f64, 0.0f64);
        for &v in &w {
            let v = v as f64;
            sum += v;
            sum_sq += v * v;
            sum_abs += v.abs();
        }
        let ref_abs = t.get("sum_abs").num();
        assert!(close(sum_abs, ref_abs, 1e-9), "{name}: sum_abs {sum_abs} vs {ref_abs}");
        assert!(close(sum_sq, t.get("sum_sq").num(), 1e-9), "{name}: sum_sq {sum_sq}");
        let ref_sum = t.get("sum").num();
        assert!((sum - ref_sum).abs() <= 1e-9 * ref_abs, "{name}: sum {sum} vs {ref_sum}");
        eprintln!("ok: {model} {name} ({}, {} elements)", info.ggml_type, w.len());
    }
}

#[test]
fn smollm2_dequantization_matches_reference() {
    check_against_fixture(SMOLLM2);
}

#[test]
fn qwen_dequantization_matches_reference() {
    check_against_fixture(QWEN);
}

/// On the fixture tensors, the affine form must reproduce dequantize()
/// (`==` in f32; exactness is argued in `affine.rs`).
fn check_affine(model: &str) {
    let path = test_model(model);
    let f = GgufFile::open(&path).unwrap();
    for t in load_fixture(model).get("tensors").arr() {
        let info = f.tensor(t.get("name").str()).unwrap();
        let w = f.dequantize_f32(info).unwrap();
        let Some(a) = f.affine(info).unwrap() else {
            assert!(matches!(info.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16));
            continue;
        };
        assert_eq!(a.codes.len(), w.len());
        assert_eq!(a.scales.len() * a.group_size, w.len());
        let expect_bits = match info.ggml_type {
            GgmlType::Q8_0 => 8,
            GgmlType::Q6_K => 6,
            GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K => 5,
            _ => 4,
        };
        assert_eq!(a.bits, expect_bits);
        let mut mismatches = 0usize;
        for (i, (&q, &want)) in a.codes.iter().zip(&w).enumerate() {
            let g = i / a.group_size;
            let got = a.scales[g] * q as f32 + a.biases[g];
            if got != want {
                mismatches += 1;
                assert!((got - want).abs() <= 1e-6 * want.abs(), "{}[{i}]: affine {got} vs {want}", info.name);
            }
        }
        assert_eq!(mismatches, 0, "{}: affine form not exact", info.name);
        eprintln!("ok: {model} {} affine ({} bits)", info.name, a.bits);
    }
}

#[test]
fn smollm2_affine_is_exact() {
    check_affine(SMOLLM2);
}

#[test]
fn qwen_affine_is_exact() {
    check_affine(QWEN);
}

/// Structure shared by both files: every tensor readable, tokenizer arrays
/// consistent with each other.
fn check_common_structure(f: &GgufFile, n_vocab: usize) {
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.get_str("tokenizer.ggml.model"), Some("gpt2"));
    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), n_vocab);
    let types = f.get_i64_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!(types.len(), n_vocab);
    let merges = f.get_str_array("tokenizer.ggml.merges").unwrap();
    assert!(merges.len() > 40_000 && merges.iter().all(|m| m.contains(' ')));
    assert!(f.get_str("tokenizer.chat_template").unwrap().contains("im_start"));
    assert_eq!(f.get_u64("general.quantization_version"), Some(2));
    for t in f.tensors() {
        assert_eq!(f.tensor_bytes(t).len(), t.n_bytes(), "{}", t.name);
        assert_eq!(t.offset % 32, 0);
    }
    // Keys are unique and in file order, starting with the architecture.
    assert_eq!(f.metadata()[0].0, "general.architecture");
}

#[test]
fn smollm2_metadata() {
    let path = test_model(SMOLLM2);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(f.get_u64("llama.block_count"), Some(30));
    assert_eq!(f.arch_get("embedding_length").and_then(|v| v.as_u64()), Some(576));
    assert_eq!(f.get_u64("llama.attention.head_count"), Some(9));
    assert_eq!(f.get_u64("llama.attention.head_count_kv"), Some(3));
    assert_eq!(f.get_u64("llama.context_length"), Some(8192));
    assert_eq!(f.get_f32("llama.rope.freq_base"), Some(100_000.0));
    assert!((f.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap() - 1e-5).abs() < 1e-9);
    assert_eq!(f.get_str_array("general.languages").unwrap(), vec!["en"]);
    assert_eq!(f.get_bool("tokenizer.ggml.add_bos_token"), Some(false));
    assert_eq!(f.metadata().len(), 33);
    assert_eq!(f.tensors().len(), 272);
    let emb = f.tensor("token_embd.weight").unwrap();
    assert_eq!((emb.ggml_type, emb.shape()), (GgmlType::Q8_0, vec![49152, 576]));
    check_common_structure(&f, 49152);
}

#[test]
fn qwen_metadata() {
    let path = test_model(QWEN);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.architecture(), Some("qwen2"));
    assert_eq!(f.get_u64("qwen2.block_count"), Some(24));
    assert_eq!(f.get_u64("qwen2.embedding_length"), Some(896));
    assert_eq!(f.get_u64("qwen2.attention.head_count_kv"), Some(2));
    assert_eq!(f.get_f32("qwen2.rope.freq_base"), Some(1_000_000.0));
    assert_eq!(f.get_str("tokenizer.ggml.pre"), Some("qwen2"));
    assert_eq!(f.metadata().len(), 26);
    assert_eq!(f.tensors().len(), 291);
    let types: std::collections::BTreeSet<String> = f.tensors().iter().map(|t| t.ggml_type.to_string()).collect();
    assert_eq!(types.into_iter().collect::<Vec<_>>(), ["F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]);
    check_common_structure(&f, 151_936);
}

/// Every tensor of both files dequantizes to finite values, and wherever an
/// affine form exists it reproduces the dequantized values exactly.
///
/// Ignored by default: ~45 s in a debug build (~3 s in release). Run with
/// `cargo test --release -p tether-gguf -- --ignored`.
#[test]
#[ignore = "slow in debug builds; run with --release -- --ignored"]
fn every_tensor_dequantizes_and_affine_is_exact() {
    for model in [SMOLLM2, QWEN] {
        let path = test_model(model);
        let f = GgufFile::open(&path).unwrap();
        for t in f.tensors() {
            let w = f.dequantize_f32(t).unwrap();
            assert_eq!(w.len(), t.n_elements());
            assert!(w.iter().all(|v| v.is_finite()), "{model}: {} has non-finite values", t.name);
            if let Some(a) = f.affine(t).unwrap() {
                assert!(a.dequantize() == w, "{model}: {} affine form differs", t.name);
            }
        }
    }
}
