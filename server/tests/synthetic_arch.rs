//! Architectures with no real checkpoint reachable here (Qwen3, Llama 3's
//! RoPE scaling), checked on
//! synthetic models: `tests/reference/make_synthetic_fixtures.py` defines
//! every weight as a fixed integer hash of (tensor name, index), and its
//! numpy forward pass wrote the expected logits and greedy tokens into
//! `tests/fixtures/synthetic/`. This test writes the same weights into a
//! Hugging Face folder (config.json + model.safetensors) or a GGUF file,
//! loads it as a user's model would be loaded, and compares.
mod common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::{json, Value};
use tether::generate::{greedy_tokens, prefill};
use tether::models::{load_transformer, LoadOptions, WeightFormat};

const MAX_RELATIVE_ERROR: f64 = 1e-3;

fn fnv1a32(name: &str) -> u32 {
    name.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193))
}

fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// `x / 2^32 - 0.5` for element `i` of tensor `name` (as the fixture script).
fn unit(name: &str, i: usize) -> f64 {
    let x = lowbias32((i as u32).wrapping_add(fnv1a32(name)));
    x as f64 / 4_294_967_296.0 - 0.5
}

enum Init {
    /// A matrix `[rows, cols]` with values `unit * gain / sqrt(cols)`.
    Matrix { rows: usize, cols: usize, gain: f64 },
    /// A norm weight of `n` values `1 + 0.2 unit`.
    Norm(usize),
    /// The embedding `[rows, cols]`, values `unit`.
    Embedding { rows: usize, cols: usize },
}

fn values(name: &str, init: &Init) -> (Vec<usize>, Vec<f32>) {
    match *init {
        Init::Matrix { rows, cols, gain } => {
            let scale = gain / (cols as f64).sqrt();
            (vec![rows, cols], (0..rows * cols).map(|i| (unit(name, i) * scale) as f32).collect())
        }
        Init::Norm(n) => (vec![n], (0..n).map(|i| (1.0 + 0.2 * unit(name, i)) as f32).collect()),
        Init::Embedding { rows, cols } => (vec![rows, cols], (0..rows * cols).map(|i| unit(name, i) as f32).collect()),
    }
}

/// A safetensors file of float32 tensors: an 8-byte header length, the JSON
/// header (padded to 8 bytes), then the data.
fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        let end = offset + data.len() * 4;
        header.insert(name.clone(), json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, end]}));
        offset = end;
    }
    let mut head = Value::Object(header).to_string().into_bytes();
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + head.len() + offset);
    out.extend_from_slice(&(head.len() as u64).to_le_bytes());
    out.extend_from_slice(&head);
    for (_, _, data) in tensors {
        for v in data {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    std::fs::write(path, out).unwrap();
}

/// Every tensor of the fixture's model: its Hugging Face name (which seeds
/// its values), its GGUF name, and how it is drawn.
fn tensors(spec: &Value) -> Vec<(String, String, Init)> {
    let n = |k: &str| spec[k].as_u64().unwrap() as usize;
    let (d, ff, hd, nh, nkv, vocab) = (n("n_embd"), n("n_ff"), n("head_dim"), n("n_head"), n("n_head_kv"), n("vocab"));
    let mut all: Vec<(String, String, Init)> = vec![
        ("model.embed_tokens.weight".into(), "token_embd.weight".into(), Init::Embedding { rows: vocab, cols: d }),
        ("model.norm.weight".into(), "output_norm.weight".into(), Init::Norm(d)),
        ("lm_head.weight".into(), "output.weight".into(), Init::Matrix { rows: vocab, cols: d, gain: 16.0 }),
    ];
    let matrix = |rows, cols| Init::Matrix { rows, cols, gain: 2.0 };
    for l in 0..n("n_layer") {
        let (hf, g) = (format!("model.layers.{l}."), format!("blk.{l}."));
        let mut add = |h: &str, gg: &str, init| all.push((format!("{hf}{h}"), format!("{g}{gg}"), init));
        add("input_layernorm.weight", "attn_norm.weight", Init::Norm(d));
        add("post_attention_layernorm.weight", "ffn_norm.weight", Init::Norm(d));
        add("self_attn.q_proj.weight", "attn_q.weight", matrix(nh * hd, d));
        add("self_attn.k_proj.weight", "attn_k.weight", matrix(nkv * hd, d));
        add("self_attn.v_proj.weight", "attn_v.weight", matrix(nkv * hd, d));
        add("self_attn.o_proj.weight", "attn_output.weight", matrix(d, nh * hd));
        add("mlp.gate_proj.weight", "ffn_gate.weight", matrix(ff, d));
        add("mlp.up_proj.weight", "ffn_up.weight", matrix(ff, d));
        add("mlp.down_proj.weight", "ffn_down.weight", matrix(d, ff));
        if spec["qk_norm"].as_bool().unwrap() {
            add("self_attn.q_norm.weight", "attn_q_norm.weight", Init::Norm(hd));
            add("self_attn.k_norm.weight", "attn_k_norm.weight", Init::Norm(hd));
        }
    }
    all
}

/// The fixture's model as a Hugging Face folder.
fn write_hf(spec: &Value, dir: &Path) {
    let n = |k: &str| spec[k].as_u64().unwrap() as usize;
    let tensors: Vec<_> = tensors(spec)
        .iter()
        .map(|(hf, _, init)| {
            let (shape, data) = values(hf, init);
            (hf.clone(), shape, data)
        })
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    let mut config = json!({
        "architectures": [spec["hf_architecture"]],
        "hidden_size": n("n_embd"),
        "intermediate_size": n("n_ff"),
        "num_hidden_layers": n("n_layer"),
        "num_attention_heads": n("n_head"),
        "num_key_value_heads": n("n_head_kv"),
        "head_dim": n("head_dim"),
        "vocab_size": n("vocab"),
        "max_position_embeddings": 4096,
        "rms_norm_eps": spec["rms_eps"],
        "rope_theta": spec["rope_base"],
        "tie_word_embeddings": false,
    });
    if let Some(s) = spec.get("rope_scaling") {
        config["rope_scaling"] = json!({
            "rope_type": "llama3",
            "factor": s["factor"],
            "low_freq_factor": s["low_freq_factor"],
            "high_freq_factor": s["high_freq_factor"],
            "original_max_position_embeddings": s["original_context"],
        });
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// A GGUF value: a u32, a f32 or a string.
enum Meta {
    U32(u32),
    F32(f32),
    Str(String),
}

fn gguf_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A GGUF (version 3) file of float32 tensors: the header, the metadata,
/// the tensor infos (dimensions fastest first), then the data, aligned to 32.
fn write_gguf_file(path: &Path, meta: &[(String, Meta)], tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    const ALIGN: usize = 32;
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    for (key, value) in meta {
        gguf_string(&mut out, key);
        match value {
            Meta::U32(v) => {
                out.extend_from_slice(&4u32.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            Meta::F32(v) => {
                out.extend_from_slice(&6u32.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
            }
            Meta::Str(v) => {
                out.extend_from_slice(&8u32.to_le_bytes());
                gguf_string(&mut out, v);
            }
        }
    }
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        gguf_string(&mut out, name);
        out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
        for dim in shape.iter().rev() {
            out.extend_from_slice(&(*dim as u64).to_le_bytes());
        }
        out.extend_from_slice(&0u32.to_le_bytes()); // F32
        out.extend_from_slice(&(offset as u64).to_le_bytes());
        offset += (data.len() * 4).div_ceil(ALIGN) * ALIGN;
    }
    out.resize(out.len().div_ceil(ALIGN) * ALIGN, 0);
    for (_, _, data) in tensors {
        let start = out.len();
        for v in data {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.resize(start + (out.len() - start).div_ceil(ALIGN) * ALIGN, 0);
    }
    std::fs::write(path, out).unwrap();
}

/// The fixture's model as a GGUF file, as llama.cpp's converter lays it out
/// (Llama 3's scaling as per-pair period factors, `rope_freqs.weight`).
fn write_gguf(fx: &Value, path: &Path) {
    let spec = &fx["model"];
    let n = |k: &str| spec[k].as_u64().unwrap() as u32;
    let arch = spec["arch"].as_str().unwrap();
    let key = |k: &str| format!("{arch}.{k}");
    let meta = vec![
        ("general.architecture".to_string(), Meta::Str(arch.into())),
        (key("block_count"), Meta::U32(n("n_layer"))),
        (key("embedding_length"), Meta::U32(n("n_embd"))),
        (key("feed_forward_length"), Meta::U32(n("n_ff"))),
        (key("attention.head_count"), Meta::U32(n("n_head"))),
        (key("attention.head_count_kv"), Meta::U32(n("n_head_kv"))),
        (key("attention.key_length"), Meta::U32(n("head_dim"))),
        (key("context_length"), Meta::U32(4096)),
        (key("attention.layer_norm_rms_epsilon"), Meta::F32(spec["rms_eps"].as_f64().unwrap() as f32)),
        (key("rope.freq_base"), Meta::F32(spec["rope_base"].as_f64().unwrap() as f32)),
    ];
    let mut all: Vec<_> = tensors(spec)
        .iter()
        .map(|(hf, gguf, init)| {
            let (shape, data) = values(hf, init);
            (gguf.clone(), shape, data)
        })
        .collect();
    if let Some(factors) = fx.get("rope_factors") {
        let factors: Vec<f32> = factors.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        all.push(("rope_freqs.weight".into(), vec![factors.len()], factors));
    }
    write_gguf_file(path, &meta, &all);
}

/// Where a synthetic model is written: its own file or folder under the temp dir.
fn scratch(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!("tether-synthetic-{what}-{}", std::process::id()))
}

/// How the test hands the model to Tether.
#[derive(Clone, Copy)]
enum Format {
    HuggingFace,
    Gguf,
}

fn check(fixture: &str, format: Format) {
    let fx = read_json(fixture);
    let kind = match format {
        Format::HuggingFace => "hf",
        Format::Gguf => "gguf",
    };
    let what = format!("{}-{kind}", fixture.replace(['/', '.'], "-"));
    let path = scratch(&what);
    match format {
        Format::HuggingFace => write_hf(&fx["model"], &path),
        Format::Gguf => write_gguf(&fx, &path),
    }
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let model = load_transformer(&path, LoadOptions { dtype: mlx::Dtype::F32, weights: WeightFormat::Dense }).unwrap();
    match format {
        Format::HuggingFace => std::fs::remove_dir_all(&path).unwrap(),
        Format::Gguf => std::fs::remove_file(&path).unwrap(),
    }
    let prompt = ids(&fx["prompt_ids"]);
    let want = ids(&fx["greedy_ids"]);
    let reference: Vec<f32> = fx["last_logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();

    let mut cache = model.new_cache();
    let got = prefill(&model, &mut cache, &prompt, 512).unwrap().to_vec_f32().unwrap();
    let err = relative_error(&got, &reference);
    println!("{fixture}: logits relative error {err:.2e}");
    assert!(err < MAX_RELATIVE_ERROR, "{fixture}: logits relative error {err:.2e}");
    assert_eq!(greedy_tokens(&model, &prompt, want.len()).unwrap(), want, "{fixture}: greedy tokens");
    // The pipelined decode loop, reading the prompt in chunks of 5.
    assert_eq!(pipelined_greedy(&model, &prompt, want.len(), 5), want, "{fixture}: pipelined generate");
}

#[test]
fn qwen3_matches_the_reference() {
    check("synthetic/qwen3.json", Format::HuggingFace);
}

/// A qwen3 GGUF rotates split halves like the Hugging Face folder: the same fixture.
#[test]
fn qwen3_gguf_matches_the_reference() {
    check("synthetic/qwen3.json", Format::Gguf);
}

/// Llama 3's RoPE scaling; the fixture script checked that the scaling moves
/// these logits by 2%, twenty times this test's tolerance.
#[test]
fn llama3_rope_scaling_matches_the_reference() {
    check("synthetic/llama3.json", Format::HuggingFace);
}

/// The same from a GGUF: the scaling as `rope_freqs.weight` factors, and
/// RoPE over interleaved pairs (llama GGUFs).
#[test]
fn llama3_gguf_rope_factors_match_the_reference() {
    check("synthetic/llama3-gguf.json", Format::Gguf);
}
