//! Prints the tokenizer's encode throughput on both test models' GGUF
//! vocabularies: ~100 KB of the tokenizer fixtures' mixed text (warm: every
//! word already in the BPE cache, as in a server), and 20,000 words never
//! seen before (cold).
//! Run: cargo run --release -p tether --example encode_speed
use std::time::Instant;

use tether::registry::{models_dir, KNOWN_MODELS};
use tether::tokenizer::TextTokenizer;

/// The fixture corpus's texts, repeated to about 100 KB.
fn mixed_text() -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer/qwen2.5-coder.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("the tokenizer fixture")).expect("JSON");
    let texts: Vec<&str> = fixture["cases"].as_array().expect("cases").iter().filter_map(|c| c["text"].as_str()).collect();
    let mut big = String::new();
    while big.len() < 100_000 {
        for t in &texts {
            big.push_str(t);
            big.push('\n');
        }
    }
    big
}

fn main() {
    let big = mixed_text();
    let cold: String = (0..20_000).map(|i| format!("w{i:x}q{} ", i * 7919)).collect();
    for name in ["smollm2-135m", "qwen2.5-coder-0.5b"] {
        let known = KNOWN_MODELS.iter().find(|m| m.name == name).expect("a known model");
        let path = models_dir().join(known.file_name);
        let t = TextTokenizer::from_gguf_path(&path).unwrap_or_else(|e| panic!("{}: {e} (tether fetch-model {name})", path.display()));
        let _ = t.encode(&big, true).unwrap(); // warm the BPE cache like a server would
        let runs = 5;
        let start = Instant::now();
        let mut n = 0;
        for _ in 0..runs {
            n += t.encode(&big, true).unwrap().len();
        }
        let secs = start.elapsed().as_secs_f64();
        println!(
            "{name} warm: {} bytes -> {} tokens, {:.0} tokens/s ({:.1} MB/s)",
            big.len(),
            n / runs,
            n as f64 / secs,
            (big.len() * runs) as f64 / secs / 1e6
        );
        let start = Instant::now();
        let n = t.encode(&cold, true).unwrap().len();
        let secs = start.elapsed().as_secs_f64();
        println!("{name} cold words: {} bytes -> {n} tokens, {:.0} tokens/s", cold.len(), n as f64 / secs);
    }
}
