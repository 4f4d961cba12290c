//! The `tether` command line on the real model: streamed output, and a clear
//! error naming the problem for each kind of bad model input.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn tether(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tether")).args(args).output().expect("runs tether");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn generate(model: &str) -> (bool, String, String) {
    tether(&["generate", "--device", "cpu", "--model", model, "--prompt", "The capital of France is", "--max-tokens", "6"])
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tether-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A copy of the real model with `find` replaced by `replace` (same length)
/// at its first occurrence after `anchor` in the header.
fn patched_copy(src: &Path, anchor: &[u8], find: &[u8], replace: &[u8], name: &str) -> PathBuf {
    assert_eq!(find.len(), replace.len());
    let mut bytes = std::fs::read(src).unwrap();
    let header = &bytes[..bytes.len().min(4 << 20)];
    let a = header.windows(anchor.len()).position(|w| w == anchor).expect("anchor in header");
    let at = a + header[a..].windows(find.len()).position(|w| w == find).expect("bytes after anchor");
    bytes[at..at + find.len()].copy_from_slice(replace);
    let path = scratch(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn generate_streams_a_continuation() {
    let (ok, out, err) = generate("smollm2-135m");
    assert!(ok, "{err}");
    assert!(out.starts_with(" Paris"), "{out:?}");
    let (ok, out, err) = tether(&["generate", "--device", "cpu", "--chat", "--prompt", "What is 2+2?", "--max-tokens", "16", "--stats"]);
    assert!(ok, "{err}");
    assert!(out.contains('4'), "{out:?}");
    assert!(err.contains("tok/s"), "{err}");
}

#[test]
fn unknown_and_missing_models_are_named() {
    let (ok, _, err) = generate("gpt-9");
    assert!(!ok);
    assert!(err.contains("unknown model \"gpt-9\"") && err.contains("smollm2-135m"), "{err}");
    let (ok, _, err) = generate("/nonexistent/model.gguf");
    assert!(!ok);
    assert!(err.contains("/nonexistent/model.gguf") && err.contains("does not exist"), "{err}");
    let (ok, _, err) = tether(&["fetch-model", "gpt-9"]);
    assert!(!ok && err.contains("unknown model"), "{err}");
}

#[test]
fn corrupt_and_truncated_files_are_named() {
    let garbage = scratch("garbage.gguf");
    std::fs::write(&garbage, b"this is not a model file at all, just text").unwrap();
    let (ok, _, err) = generate(garbage.to_str().unwrap());
    assert!(!ok);
    assert!(err.to_lowercase().contains("gguf"), "{err}");

    let real = common::model_path("smollm2-135m");
    let bytes = std::fs::read(&real).unwrap();
    let truncated = scratch("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let (ok, _, err) = generate(truncated.to_str().unwrap());
    assert!(!ok);
    assert!(err.contains("truncated.gguf") && (err.contains("bounds") || err.contains("runcated")), "{err}");
}

#[test]
fn unsupported_architecture_and_quant_type_are_named() {
    let real = common::model_path("smollm2-135m");
    let arch = patched_copy(&real, b"general.architecture", b"llama", b"gemma", "arch.gguf");
    let (ok, _, err) = generate(arch.to_str().unwrap());
    assert!(!ok);
    assert!(err.contains("unsupported architecture \"gemma\""), "{err}");

    // blk.0.ffn_down.weight: [1536, 576] Q4_1 (type 3) becomes Q2_K (type 10):
    // its tensor-info record is name, n_dims=2, dims 1536 and 576, then the type.
    let mut record = Vec::new();
    record.extend(2u32.to_le_bytes());
    record.extend(1536u64.to_le_bytes());
    record.extend(576u64.to_le_bytes());
    let mut find = record.clone();
    find.extend(3u32.to_le_bytes());
    let mut replace = record;
    replace.extend(10u32.to_le_bytes());
    let quant = patched_copy(&real, b"blk.0.ffn_down.weight", &find, &replace, "quant.gguf");
    let (ok, _, err) = generate(quant.to_str().unwrap());
    assert!(!ok);
    assert!(err.contains("Q2_K") && err.contains("blk.0.ffn_down.weight"), "{err}");
}
