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

/// Draws tokens for one sequence.
pub struct Sampler {
    params: SamplingParams,
    key: Option<Array>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> mlx::Result<Sampler> {
        let key = if params.is_greedy() { None } else { Some(random::key(params.seed.unwrap_or_else(entropy_seed))?) };
        Ok(Sampler { params, key })
    }

    /// Samples one token id per row of float32 `logits` `[rows, vocab]`;
    /// returns a lazy int32 array `[rows]`.
    pub fn sample(&mut self, logits: &Array) -> mlx::Result<Array> {
        let Some(draw_key) = self.next_key()? else {
            return logits.argmax(-1, false)?.astype(Dtype::I32);
        };
        random::categorical(&self.filtered(logits)?, -1, &draw_key)?.astype(Dtype::I32)
    }

    /// Verifies deterministic draft tokens by speculative sampling.
    /// `logits` `[k + 1, vocab]` are the target's after the pending token and
    /// each of the `k` drafts. Draft `i` is accepted with probability
    /// `p_i(d_i)` (the proposal is a point mass, so min(1, p/q) = p); a
    /// rejected draft is replaced by a draw from `p_i` without `d_i` (the
    /// normalised residual max(p - q, 0)). Returns a lazy int32 array
    /// `[2k + 1]`: k accept flags, k residual draws, one draw after the last
    /// draft (the bonus token when all are accepted); see
    /// [`crate::engine::speculate::accept_sampled`]. Greedy samplers must use
    /// [`sample`](Self::sample) and compare with argmax instead.
    pub fn verify(&mut self, logits: &Array, drafts: &[u32]) -> mlx::Result<Array> {
        let key = self.next_key()?.ok_or_else(|| mlx::Error { op: "verify", message: "greedy rows verify by argmax".into() })?;
        let k = drafts.len() as i32;
        let x = self.filtered(logits)?;
        let vocab = x.dim(-1) as i32;
        let bonus_key = random::split(&key, 3)?;
        let (u_key, resid_key, last_key) = (&bonus_key[0], &bonus_key[1], &bonus_key[2]);
        let last = x.slice(&[k, 0], &[k + 1, vocab])?;
        let bonus = random::categorical(&last, -1, last_key)?.astype(Dtype::I32)?;
        if k == 0 {
            return Ok(bonus);
        }
        let head = x.slice(&[0, 0], &[k, vocab])?;
        let ids: Vec<i32> = drafts.iter().map(|&d| d as i32).collect();
        let ids = Array::from_i32(&ids, &[drafts.len(), 1])?;
        let p_draft = head.softmax(-1, true)?.take_along_axis(&ids, -1)?.reshape(&[k])?;
        let accept = random::uniform(&[k], u_key)?.less(&p_draft)?.astype(Dtype::I32)?;
        let neg_inf = Array::full(&[drafts.len(), 1], f32::NEG_INFINITY, Dtype::F32)?;
        let residual = random::categorical(&head.put_along_axis(&ids, &neg_inf, -1)?, -1, resid_key)?.astype(Dtype::I32)?;
        mlx::concatenate(&[&accept, &residual, &bonus], 0)
    }

    /// A fresh PRNG key for this draw (`None` for greedy samplers).
    fn next_key(&mut self) -> mlx::Result<Option<Array>> {
        let Some(key) = self.key.take() else { return Ok(None) };
        let mut keys = random::split(&key, 2)?;
        let draw_key = keys.pop().expect("split gives two keys");
        self.key = keys.pop();
        Ok(Some(draw_key))
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
        let mut s = Sampler::new(params).unwrap();
        (0..n).map(|_| s.sample(&logits()).unwrap().to_vec_i32().unwrap()[0]).collect()
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
    fn speculative_verification_keeps_the_target_distribution() {
        // Position 0's distribution over 4 tokens; the draft proposes token 1.
        let rows = [0.5f32, 1.5, 0.0, 1.0, /* position 1 */ 0.0, 0.0, 3.0, 0.0];
        let logits = Array::from_f32(&rows, &[2, 4]).unwrap();
        let p = SamplingParams { temperature: 1.0, seed: Some(7), ..Default::default() };
        let mut s = Sampler::new(p).unwrap();
        let trials = 4000;
        let mut counts = [0usize; 4];
        let mut accepted = 0;
        for _ in 0..trials {
            let out = s.verify(&logits, &[1]).unwrap().to_vec_i32().unwrap();
            let (emitted, a) = crate::engine::speculate::accept_sampled(&[1], &out);
            counts[emitted[0] as usize] += 1;
            accepted += a;
            if a == 0 {
                assert_ne!(emitted[0], 1, "a rejected draft is never re-emitted");
            }
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
