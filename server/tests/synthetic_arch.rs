//! Architectures with no real checkpoint reachable here (Qwen3, Llama 3's
//! RoPE scaling), checked on
//! synthetic models: `tests/reference/make_synthetic_fixtures.py` defines
//! every weight as a fixed integer hash of (tensor name, index), and its
//! numpy forward pass wrote the expected logits and greedy tokens into
//! `tests/fixtures/synthetic/`. This test writes the same weights into a
//! Hugging Face folder (config.json + model.safetensors), loads it as a user's
//! folder would be loaded, and compares.
mod common;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use common::*;
use serde_json::{json, Value};
use tether::generate::{generate, greedy_tokens, prefill, GenerateOptions};
use tether::model::{load_transformer, LoadOptions, WeightFormat};
use tether::sample::SamplingParams;

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

/// The fixture's model as a Hugging Face folder.
fn write_model(spec: &Value, dir: &Path) {
    let n = |k: &str| spec[k].as_u64().unwrap() as usize;
    let (d, ff, hd, nh, nkv, vocab) = (n("n_embd"), n("n_ff"), n("head_dim"), n("n_head"), n("n_head_kv"), n("vocab"));
    let mut inits: Vec<(String, Init)> = vec![
        ("model.embed_tokens.weight".into(), Init::Embedding { rows: vocab, cols: d }),
        ("model.norm.weight".into(), Init::Norm(d)),
        ("lm_head.weight".into(), Init::Matrix { rows: vocab, cols: d, gain: 16.0 }),
    ];
    let matrix = |rows, cols| Init::Matrix { rows, cols, gain: 2.0 };
    for l in 0..n("n_layer") {
        let p = format!("model.layers.{l}.");
        inits.push((format!("{p}input_layernorm.weight"), Init::Norm(d)));
        inits.push((format!("{p}post_attention_layernorm.weight"), Init::Norm(d)));
        inits.push((format!("{p}self_attn.q_proj.weight"), matrix(nh * hd, d)));
        inits.push((format!("{p}self_attn.k_proj.weight"), matrix(nkv * hd, d)));
        inits.push((format!("{p}self_attn.v_proj.weight"), matrix(nkv * hd, d)));
        inits.push((format!("{p}self_attn.o_proj.weight"), matrix(d, nh * hd)));
        inits.push((format!("{p}mlp.gate_proj.weight"), matrix(ff, d)));
        inits.push((format!("{p}mlp.up_proj.weight"), matrix(ff, d)));
        inits.push((format!("{p}mlp.down_proj.weight"), matrix(d, ff)));
        if spec["qk_norm"].as_bool().unwrap() {
            inits.push((format!("{p}self_attn.q_norm.weight"), Init::Norm(hd)));
            inits.push((format!("{p}self_attn.k_norm.weight"), Init::Norm(hd)));
        }
    }
    let tensors: Vec<_> = inits
        .iter()
        .map(|(name, init)| {
            let (shape, data) = values(name, init);
            (name.clone(), shape, data)
        })
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    let mut config = json!({
        "architectures": [spec["hf_architecture"]],
        "hidden_size": d,
        "intermediate_size": ff,
        "num_hidden_layers": n("n_layer"),
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "vocab_size": vocab,
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

fn check(fixture: &str) {
    let fx = read_json(fixture);
    let dir: PathBuf = std::env::temp_dir().join(format!("tether-synthetic-{}-{}", fx["model"]["arch"].as_str().unwrap(), std::process::id()));
    write_model(&fx["model"], &dir);
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let model = load_transformer(&dir, LoadOptions { dtype: mlx::Dtype::F32, weights: WeightFormat::Dense }).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
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
    let opts = GenerateOptions { max_tokens: want.len(), sampling: SamplingParams::default(), stop_ids: vec![], prefill_chunk: 5 };
    let mut streamed = Vec::new();
    generate(&model, &prompt, &opts, |id| {
        streamed.push(id);
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(streamed, want, "{fixture}: pipelined generate");
}

#[test]
fn qwen3_matches_the_reference() {
    check("synthetic/qwen3.json");
}

/// Llama 3's RoPE scaling; the fixture script checked that the scaling moves
/// these logits by 2%, twenty times this test's tolerance.
#[test]
fn llama3_rope_scaling_matches_the_reference() {
    check("synthetic/llama3.json");
}
