//! Measures header parsing and full-model dequantization throughput.
//!
//! ```text
//! cargo run --release -p tether-gguf --example dequant_all [-- path/to/model.gguf]
//! ```
//! Defaults to the Qwen2.5-Coder-0.5B Q4_K_M file in ~/.cache/tether/models.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args_os().nth(1).map(PathBuf::from).unwrap_or_else(|| {
        let dir = std::env::var_os("TETHER_MODELS_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tether/models"));
        dir.join("Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf")
    });
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());

    let t0 = Instant::now();
    let f = gguf::GgufFile::open(&path)?;
    let open_time = t0.elapsed();
    println!(
        "{}: {} tensors, {} metadata keys, {:.1} MB; open+parse {:.1} ms; {threads} threads",
        path.display(),
        f.tensors().len(),
        f.metadata().len(),
        f.file_len() as f64 / 1e6,
        open_time.as_secs_f64() * 1e3
    );

    // Touch every page once so the timings measure decoding, not disk I/O.
    let warm: u64 = f.tensors().iter().map(|t| f.tensor_bytes(t).iter().step_by(4096).map(|&b| b as u64).sum::<u64>()).sum();
    std::hint::black_box(warm);

    for pass in 0..2 {
        let mut per_type: BTreeMap<String, (usize, usize, Duration)> = BTreeMap::new();
        let (mut elems, mut bytes) = (0usize, 0usize);
        let start = Instant::now();
        for t in f.tensors() {
            let s = Instant::now();
            let w = f.dequantize_f32(t)?;
            let e = per_type.entry(t.ggml_type.to_string()).or_default();
            e.0 += w.len();
            e.1 += t.n_bytes();
            e.2 += s.elapsed();
            elems += w.len();
            bytes += t.n_bytes();
            std::hint::black_box(&w);
        }
        let total = start.elapsed();
        println!(
            "pass {pass}: dequantize_f32 all tensors: {:.3} s, {:.1} M elements ({:.2} G elem/s, {:.2} GB/s in, {:.2} GB/s out)",
            total.as_secs_f64(),
            elems as f64 / 1e6,
            elems as f64 / total.as_secs_f64() / 1e9,
            bytes as f64 / total.as_secs_f64() / 1e9,
            elems as f64 * 4.0 / total.as_secs_f64() / 1e9
        );
        if pass == 1 {
            for (ty, (n, b, d)) in &per_type {
                println!(
                    "  {ty:5} {:8.1} M elements {:7.1} MB in {:7.1} ms  {:.2} G elem/s",
                    *n as f64 / 1e6,
                    *b as f64 / 1e6,
                    d.as_secs_f64() * 1e3,
                    *n as f64 / d.as_secs_f64() / 1e9
                );
            }
        }
    }

    // Decode cost alone: one reused output buffer, so no page faults from
    // fresh allocations.
    let max = f.tensors().iter().map(|t| t.n_elements()).max().unwrap_or(0);
    let mut buf = vec![0.0f32; max];
    buf.fill(1.0); // fault the pages in
    let s = Instant::now();
    for _ in 0..3 {
        buf.fill(2.0);
        std::hint::black_box(&buf);
    }
    let d = s.elapsed() / 3;
    println!(
        "baseline: single-thread fill of a {:.0} MB buffer: {:.1} ms ({:.2} GB/s)",
        max as f64 * 4e-6,
        d.as_secs_f64() * 1e3,
        max as f64 * 4.0 / d.as_secs_f64() / 1e9
    );
    let mut per_type: BTreeMap<String, (usize, Duration)> = BTreeMap::new();
    let start = Instant::now();
    for t in f.tensors() {
        let s = Instant::now();
        gguf::dequantize_into(t.ggml_type, f.tensor_bytes(t), &mut buf[..t.n_elements()])?;
        let e = per_type.entry(t.ggml_type.to_string()).or_default();
        e.0 += t.n_elements();
        e.1 += s.elapsed();
    }
    let total = start.elapsed();
    println!("dequantize_into a reused buffer, all tensors: {:.3} s", total.as_secs_f64());
    for (ty, (n, d)) in &per_type {
        println!("  {ty:5} {:7.1} ms  {:.2} G elem/s", d.as_secs_f64() * 1e3, *n as f64 / d.as_secs_f64() / 1e9);
    }

    let start = Instant::now();
    let mut n_affine = 0usize;
    for t in f.tensors() {
        if let Some(a) = f.affine(t)? {
            n_affine += a.codes.len();
            std::hint::black_box(&a);
        }
    }
    let d = start.elapsed();
    println!(
        "affine form of all eligible tensors: {:.3} s, {:.1} M elements ({:.2} G elem/s)",
        d.as_secs_f64(),
        n_affine as f64 / 1e6,
        n_affine as f64 / d.as_secs_f64() / 1e9
    );
    Ok(())
}
