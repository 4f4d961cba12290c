//! What a verification forward costs: the time of one forward of n tokens
//! (the pending token plus n - 1 drafts) after a cached history, relative
//! to a plain one-token decode step. Speculation pays off while accepted
//! tokens per forward outgrow this ratio.
//!
//! cargo run --release -p tether --example verify_cost -- [model] [history]
use std::time::Instant;

use tether::loaded::LoadedModel;
use tether::models::LoadOptions;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "qwen2.5-coder-0.5b".into());
    let history: usize = args.next().map(|h| h.parse()).transpose()?.unwrap_or(512);
    mlx::set_default_device(mlx::Device::Cpu)?;
    let model = LoadedModel::load(&name, LoadOptions::for_device(mlx::Device::Cpu))?;
    let t = &model.transformer;
    // Which ids run does not change what a forward costs (as in warm_turn).
    let vocab = t.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..(history + 256) as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut base = t.new_cache();
    t.forward(&prompt[..history], &mut base, 1)?.eval()?;
    let mut one = 0.0;
    let sizes: Vec<usize> = std::env::var("SIZES").ok().map(|s| s.split(',').map(|x| x.parse().unwrap()).collect()).unwrap_or(vec![1, 2, 4, 8, 12, 16, 24, 32]);
    for n in sizes {
        let mut best = f64::MAX;
        for _ in 0..3 {
            let mut cache = base.clone();
            let start = Instant::now();
            t.forward(&prompt[history..history + n], &mut cache, n)?.eval()?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        if n == 1 {
            one = best;
        }
        println!("{{\"model\":\"{name}\",\"history\":{history},\"tokens\":{n},\"ms\":{:.1},\"vs_one\":{:.2}}}", best * 1e3, best / one);
    }
    Ok(())
}
