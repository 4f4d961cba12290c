//! Token sampling on the device: greedy, temperature, top-k, top-p, min-p,
//! with an explicit PRNG key per request so a seed reproduces its tokens
//! whatever else shares the batch.
use mlx::{random, Array, Dtype};

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 disables.
    pub top_k: u32,
    /// Keep the smallest set of tokens whose probability reaches p; 1 disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables.
    pub min_p: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: None }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Checks ranges; the message names the offending field.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=100.0).contains(&self.temperature) || self.temperature.is_nan() {
            return Err(format!("temperature must be in [0, 100], got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) || self.min_p.is_nan() {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        Ok(())
    }
}

/// Draws the tokens of one sequence.
///
/// The draw at generated position `p` uses its own PRNG key, derived from the
/// request's seed and `p` alone, and is the Gumbel-max choice
/// `argmax(filtered logits + Gumbel noise of key p)`. So a position's token
/// depends only on its logits and the seed, never on how the steps grouped
/// positions: speculative verification draws every verified position at once
/// and accepts drafts while they equal the draws (as greedy verification
/// does with the argmax), which emits exactly the tokens plain sampling
/// would, whatever the draft source, draft depth or batch. It is also
/// speculative sampling's distribution: a draft `d` is kept with
/// probability `p(d)`, and a rejected position emits a draw from `p` that
/// is not `d`.
pub struct Sampler {
    params: SamplingParams,
    /// `None` for greedy samplers.
    seed: Option<u64>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let seed = if params.is_greedy() { None } else { Some(params.seed.unwrap_or_else(entropy_seed)) };
        Sampler { params, seed }
    }

    /// The tokens at generated positions `first`, `first + 1`, ... from the
    /// rows of float32 `logits` `[rows, vocab]` (row `i` holds the logits for
    /// position `first + i`); a lazy int32 array `[rows]`.
    pub fn draw(&self, logits: &Array, first: usize) -> mlx::Result<Array> {
        let Some(seed) = self.seed else {
            return logits.argmax(-1, false)?.astype(Dtype::I32);
        };
        let x = self.filtered(logits)?;
        let (rows, vocab) = (x.dim(0) as i32, x.dim(-1) as i32);
        let draws = (0..rows)
            .map(|r| {
                let key = random::key(position_seed(seed, first + r as usize))?;
                random::categorical(&x.slice(&[r, 0], &[r + 1, vocab])?, -1, &key)
            })
            .collect::<mlx::Result<Vec<Array>>>()?;
        let draws = if draws.len() == 1 { draws.into_iter().next().expect("one row") } else { mlx::concatenate(&draws.iter().collect::<Vec<_>>(), 0)? };
        draws.astype(Dtype::I32)
    }

    /// Logits with temperature applied and the tokens that top-k, top-p and
    /// min-p exclude set to -inf.
    fn filtered(&self, logits: &Array) -> mlx::Result<Array> {
        let p = &self.params;
        let neg_inf = Array::scalar(f32::NEG_INFINITY, Dtype::F32)?;
        let mut x = logits.divide(&Array::scalar(p.temperature, Dtype::F32)?)?;
        let vocab = x.dim(-1) as u32;
        if p.top_k > 0 && p.top_k < vocab {
            let kth = x.topk(p.top_k as i32, -1)?.min(&[-1], true)?;
            x = mlx::where_(&x.less(&kth)?, &neg_inf, &x)?;
        }
        if p.top_p < 1.0 {
            // Ascending sort: the tokens to drop are a prefix whose cumulative
            // probability stays at or under 1 - top_p.
            let sorted = x.sort(-1)?;
            let cum = sorted.softmax(-1, true)?.cumsum(-1, false, true)?;
            let dropped = cum.less_equal(&Array::scalar(1.0 - p.top_p, Dtype::F32)?)?.astype(Dtype::I32)?.sum(&[-1], true)?;
            let last = Array::scalar((vocab - 1) as f32, Dtype::I32)?;
            let threshold = sorted.take_along_axis(&dropped.minimum(&last)?, -1)?;
            x = mlx::where_(&x.less(&threshold)?, &neg_inf, &x)?;
        }
        if p.min_p > 0.0 {
            // p_i < min_p * p_max  <=>  logit_i < logit_max + ln(min_p)
            let floor = x.max(&[-1], true)?.add(&Array::scalar(p.min_p.ln(), Dtype::F32)?)?;
            x = mlx::where_(&x.less(&floor)?, &neg_inf, &x)?;
        }
        Ok(x)
    }
}

/// The PRNG seed of generated position `position`: SplitMix64's finaliser
/// over the request's seed and the position, so neighbouring positions and
/// seeds get unrelated keys.
fn position_seed(seed: u64, position: usize) -> u64 {
    let mut z = seed ^ (position as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn entropy_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Array {
        Array::from_f32(&[1.0, 3.0, 2.0, 0.5, 2.9], &[1, 5]).unwrap()
    }

    fn draws(params: SamplingParams, n: usize) -> Vec<i32> {
        let s = Sampler::new(params);
        (0..n).map(|p| s.draw(&logits(), p).unwrap().to_vec_i32().unwrap()[0]).collect()
    }

    #[test]
    fn greedy_is_argmax() {
        assert_eq!(draws(SamplingParams::default(), 3), vec![1, 1, 1]);
    }

    #[test]
    fn top_k_limits_support() {
        let p = SamplingParams { temperature: 1.0, top_k: 2, seed: Some(1), ..Default::default() };
        let d = draws(p, 200);
        assert!(d.iter().all(|&t| t == 1 || t == 4), "{d:?}");
        assert!(d.contains(&1) && d.contains(&4));
    }

    #[test]
    fn top_p_limits_support() {
        // softmax of the logits: token 1 ~0.38, token 4 ~0.35, token 2 ~0.14 ...
        let p = SamplingParams { temperature: 1.0, top_p: 0.7, seed: Some(2), ..Default::default() };
        let d = draws(p, 200);
        assert!(d.iter().all(|&t| t == 1 || t == 4), "{d:?}");
    }

    #[test]
    fn min_p_limits_support() {
        // p_i / p_max = exp(l_i - 3): token 2 -> 0.37, token 0 -> 0.14
        let p = SamplingParams { temperature: 1.0, min_p: 0.3, seed: Some(3), ..Default::default() };
        let d = draws(p, 300);
        assert!(d.iter().all(|&t| t == 1 || t == 4 || t == 2), "{d:?}");
        assert!(d.contains(&2));
    }

    #[test]
    fn seed_reproduces() {
        let p = SamplingParams { temperature: 1.0, seed: Some(42), ..Default::default() };
        assert_eq!(draws(p.clone(), 20), draws(p, 20));
    }

    #[test]
    fn a_position_draws_the_same_token_alone_or_among_others() {
        // Four positions' logits; drawing them in one call (a verification
        // step) or one by one (plain decoding) gives the same tokens.
        let rows: Vec<f32> = (0..4 * 6).map(|i| ((i * 7 % 11) as f32) * 0.3).collect();
        let all = Array::from_f32(&rows, &[4, 6]).unwrap();
        let s = Sampler::new(SamplingParams { temperature: 1.0, seed: Some(5), ..Default::default() });
        for first in [0, 9] {
            let together = s.draw(&all, first).unwrap().to_vec_i32().unwrap();
            let alone: Vec<i32> = (0..4)
                .map(|r| {
                    let row = Array::from_f32(&rows[r * 6..(r + 1) * 6], &[1, 6]).unwrap();
                    s.draw(&row, first + r).unwrap().to_vec_i32().unwrap()[0]
                })
                .collect();
            assert_eq!(together, alone);
        }
    }

    #[test]
    fn verification_by_matching_draws_keeps_the_target_distribution() {
        // Position 0's distribution over 4 tokens; the draft proposes token 1.
        // Over many seeds, the emitted token (the draw, whether or not it
        // equals the draft) follows p and the draft is kept with p(1).
        let rows = [0.5f32, 1.5, 0.0, 1.0, /* position 1 */ 0.0, 0.0, 3.0, 0.0];
        let logits = Array::from_f32(&rows, &[2, 4]).unwrap();
        let trials = 4000;
        let mut counts = [0usize; 4];
        let mut accepted = 0;
        for seed in 0..trials {
            let s = Sampler::new(SamplingParams { temperature: 1.0, seed: Some(seed), ..Default::default() });
            let targets: Vec<u32> = s.draw(&logits, 0).unwrap().to_vec_i32().unwrap().iter().map(|&t| t as u32).collect();
            let a = tether_sched::accept_matching(&[1], &targets);
            counts[targets[0] as usize] += 1;
            accepted += a;
        }
        let z: f32 = rows[..4].iter().map(|l| l.exp()).sum();
        for (t, &c) in counts.iter().enumerate() {
            let want = rows[t].exp() / z;
            let got = c as f32 / trials as f32;
            assert!((got - want).abs() < 0.03, "token {t}: {got} vs {want}");
        }
        let p1 = rows[1].exp() / z;
        assert!((accepted as f32 / trials as f32 - p1).abs() < 0.03);
    }

    #[test]
    fn validation_names_the_field() {
        let p = SamplingParams { top_p: 0.0, ..Default::default() };
        assert!(p.validate().unwrap_err().contains("top_p"));
        let p = SamplingParams { temperature: -1.0, ..Default::default() };
        assert!(p.validate().unwrap_err().contains("temperature"));
    }
}
