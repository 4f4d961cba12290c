//! Whether draft tokens pay for their place in a step, from the steps the
//! engine runs.
//!
//! A decode step costs a fixed part (reading the weights, launching
//! kernels) and a part per token (the arithmetic). A draft token adds the
//! per-token part and yields, on average, its chance of being accepted in
//! tokens. Beside a step that makes `rows` tokens in `fixed + per_token *
//! rows` seconds, it pays when that chance exceeds `per_token * rows /
//! (fixed + per_token * rows)`: the compute share of the step. One row on a
//! 2-core CPU is mostly reading weights (24 ms a step, ~2.2 ms of it per
//! token: drafts accepted 10% of the time pay); 32 rows are mostly
//! arithmetic (93 ms: a draft must be accepted 75% of the time), so echo
//! drafts of chat text (about 40%) cost 32 streams more than they return
//! while those of a code edit (90%) still pay. On a GPU the fixed part
//! dominates and nearly any draft pays.
//!
//! The two parts come from a decayed least-squares line through the
//! decode-only steps' times against their tokens (rows plus drafts).

/// Weight of the past per step in the fit (an effective window of ~50 steps).
const DECAY: f64 = 0.98;
/// Fewest steps (by weight) and least spread of token counts (variance, in
/// tokens squared) before the fit is trusted.
const MIN_WEIGHT: f64 = 8.0;
const MIN_TOKEN_VARIANCE: f64 = 1.0;

#[derive(Debug, Default)]
pub(crate) struct DraftCost {
    /// Decayed sums over decode-only steps: weight, tokens, seconds,
    /// tokens squared, tokens times seconds.
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl DraftCost {
    /// Records a decode-only step of `tokens` tokens (rows plus drafts).
    pub fn record(&mut self, tokens: usize, seconds: f64) {
        let x = tokens as f64;
        self.w = DECAY * self.w + 1.0;
        self.x = DECAY * self.x + x;
        self.y = DECAY * self.y + seconds;
        self.xx = DECAY * self.xx + x * x;
        self.xy = DECAY * self.xy + x * seconds;
    }

    /// `(fixed, per_token)` seconds of a decode step, once the steps seen
    /// spread enough in size to tell them apart.
    fn line(&self) -> Option<(f64, f64)> {
        if self.w < MIN_WEIGHT {
            return None;
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        if var < MIN_TOKEN_VARIANCE {
            return None;
        }
        let per_token = (self.xy / self.w - mx * my) / var;
        Some((my - per_token * mx, per_token))
    }

    /// The acceptance rate a row's drafts need to pay beside `rows`
    /// decoding rows (see the module notes); `None` while unknown.
    pub fn bar(&self, rows: usize) -> Option<f64> {
        let (fixed, per_token) = self.line()?;
        let compute = per_token.max(0.0) * rows as f64;
        let total = fixed.max(0.0) + compute;
        (total > 0.0).then(|| compute / total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps of `rows` rows with 0..=`most` drafts on a machine whose steps
    /// take `fixed + per_token * tokens` seconds.
    fn measured(fixed: f64, per_token: f64, rows: usize, most: usize) -> DraftCost {
        let mut cost = DraftCost::default();
        for i in 0..60 {
            let tokens = rows + i % (most + 1);
            cost.record(tokens, fixed + per_token * tokens as f64);
        }
        cost
    }

    #[test]
    fn the_bar_is_the_compute_share_of_a_step() {
        // A 2-core CPU with SmolLM2: ~22 ms fixed, 2.2 ms a token.
        let cpu = measured(0.022, 0.0022, 32, 40);
        let at_32 = cpu.bar(32).unwrap();
        assert!((at_32 - 70.4 / 92.4).abs() < 1e-6, "{at_32}");
        let at_1 = cpu.bar(1).unwrap();
        assert!((at_1 - 2.2 / 24.2).abs() < 1e-6, "{at_1}");
        // A GPU: 8 ms fixed, 20 us a token: nearly any draft pays.
        assert!(measured(0.008, 0.00002, 32, 40).bar(32).unwrap() < 0.1);
    }

    #[test]
    fn unknown_until_steps_differ_in_size() {
        let mut cost = DraftCost::default();
        assert_eq!(cost.bar(8), None);
        for _ in 0..50 {
            cost.record(8, 0.04);
        }
        assert_eq!(cost.bar(8), None, "every step the same size: no line");
        cost.record(20, 0.07);
        cost.record(30, 0.09);
        assert!(cost.bar(8).is_some());
    }
}
