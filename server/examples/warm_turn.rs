//! Times the prefill of one warm agent turn on the CPU: NEW tokens over a
//! cached HISTORY, from a snapshot of the cache as the prefix cache hands
//! it out (so the turn's first write copies the shared buffers, as in the
//! server). Best of REPS. A profiler attached once it prints "history
//! cached" sees this prefill alone: where a warm turn's time goes.
//! Run: cargo run --release -p tether --example warm_turn [-- MODEL HISTORY NEW REPS]
//! (TETHER_CPU_ATTENTION=0 for MLX's per-row attention instead of the fused kernel.)
use std::time::Instant;

use tether::models::{load_transformer, LoadOptions};
use tether::registry::{models_dir, KNOWN_MODELS};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let name = args.get(1).map_or("smollm2-135m", String::as_str);
    let arg = |i: usize, default: usize| args.get(i).map_or(default, |s| s.parse().expect("a number"));
    let (history, new, reps) = (arg(2, 3648), arg(3, 300), arg(4, 5));
    let known = KNOWN_MODELS.iter().find(|m| m.name == name).expect("a known model name");
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let model = load_transformer(&models_dir().join(known.file_name), LoadOptions::for_device(mlx::Device::Cpu)).unwrap();
    let vocab = model.config.vocab_size as u32;
    let tokens: Vec<u32> = (0..(history + new) as u32).map(|i| (i * 7919 + 13) % vocab).collect();

    let mut cache = model.new_cache();
    for chunk in tokens[..history].chunks(512) {
        let logits = model.forward(chunk, &mut cache, 1).unwrap();
        let mut outs = cache.buffers();
        outs.push(&logits);
        mlx::eval(&outs).unwrap();
    }
    // A profiler attached from here on sees only warm turns.
    eprintln!("history cached (pid {})", std::process::id());
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let mut turn = cache.clone();
        let t = Instant::now();
        model.forward(&tokens[history..], &mut turn, 1).unwrap().eval().unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    let fused = std::env::var("TETHER_CPU_ATTENTION").map_or(true, |v| v != "0");
    println!("{name}: {new} tokens over {history} cached, fused attention {}: best {:.0} ms", if fused { "on" } else { "off" }, best * 1e3);
}
