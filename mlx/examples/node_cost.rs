//! Host cost of one graph node on the CPU: a chain of N small adds evaluated
//! at once, per node. Run: cargo run --release -p tether-mlx --example node_cost
use std::time::Instant;

use mlx::Array;

fn main() {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let x = Array::from_f32(&vec![0.5; 576], &[1, 576]).unwrap();
    x.eval().unwrap();
    for n in [100usize, 600] {
        let mut best = f64::MAX;
        for _ in 0..20 {
            let t = Instant::now();
            let mut h = x.clone();
            for _ in 0..n {
                h = h.add(&x).unwrap();
            }
            h.eval().unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("{n} nodes: {:.1} us per node", best / n as f64 * 1e6);
    }
}
