//! What a step costs, learned from the steps the engine runs, so prefill
//! chunks can be sized to keep decoding rows' inter-token latency bounded.
//!
//! A prompt chunk shares its step with every decoding row, so each chunk
//! token delays all running streams. A fixed chunk size cannot be right on
//! every machine (256 tokens cost ten decode steps on a 2-core CPU and
//! under one on a GPU), so the engine measures: how long steps with decode
//! rows and no prefill take, and how much each prefill token adds. A step
//! with decode rows then carries only as many prompt tokens as keep it
//! within a chosen multiple of a decode-only step.

/// Weight of the past in the decayed averages (per step).
const DECAY: f64 = 0.8;

#[derive(Debug, Default)]
pub(super) struct StepCost {
    /// Decayed average of decode-only steps' seconds.
    decode_s: Option<f64>,
    /// Decayed sums of prefill seconds (beyond the decode part of a step)
    /// and of prefill tokens; their ratio is the cost of a prompt token.
    /// Pooled rather than averaged per step, so a step with a handful of
    /// tokens cannot swing the estimate.
    prefill_s: f64,
    prefill_tokens: f64,
}

impl StepCost {
    /// Records a step that ran `decode_rows` decoding rows and
    /// `prefill_tokens` prompt tokens in `seconds`.
    pub fn record(&mut self, decode_rows: usize, prefill_tokens: usize, seconds: f64) {
        match (decode_rows, prefill_tokens) {
            (0, 0) => {}
            (_, 0) => self.decode_s = Some(self.decode_s.map_or(seconds, |d| DECAY * d + (1.0 - DECAY) * seconds)),
            (rows, tokens) => {
                // Prefill alone: the step's fixed costs count as prefill,
                // which overestimates a token's cost: the safe side.
                let decode_part = if rows == 0 { 0.0 } else { self.decode_s.unwrap_or(0.0) };
                self.prefill_s = DECAY * self.prefill_s + (seconds - decode_part).max(0.0);
                self.prefill_tokens = DECAY * self.prefill_tokens + tokens as f64;
            }
        }
    }

    /// Prompt tokens a step with decoding rows may carry so that it takes
    /// about `inflation` times a decode-only step; `None` until both costs
    /// have been seen (or when `inflation` is not above 1: no limit).
    pub fn prefill_allowance(&self, inflation: f64) -> Option<usize> {
        let decode = self.decode_s?;
        if inflation <= 1.0 || self.prefill_tokens <= 0.0 {
            return None;
        }
        let per_token = self.prefill_s / self.prefill_tokens;
        if per_token <= 0.0 {
            return None;
        }
        Some(((inflation - 1.0) * decode / per_token).floor().min(usize::MAX as f64 / 2.0) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowance_keeps_a_mixed_step_within_the_inflation() {
        let mut cost = StepCost::default();
        assert_eq!(cost.prefill_allowance(2.0), None, "nothing measured yet");
        for _ in 0..20 {
            cost.record(8, 0, 0.080); // decode-only steps: 80 ms
            cost.record(8, 100, 0.080 + 100.0 * 0.0005); // 0.5 ms per prompt token
        }
        // Twice a decode step leaves 80 ms for prompt tokens: 160 of them.
        let allow = cost.prefill_allowance(2.0).unwrap();
        assert!((155..=165).contains(&allow), "{allow}");
        assert_eq!(cost.prefill_allowance(1.0), None, "1x means no limit");
    }

    #[test]
    fn prefill_only_steps_overestimate_the_token_cost() {
        let mut cost = StepCost::default();
        cost.record(4, 0, 0.050);
        // A 10-token prefill-only step of 40 ms: mostly fixed cost.
        cost.record(0, 10, 0.040);
        let cautious = cost.prefill_allowance(2.0).unwrap();
        assert!(cautious <= 13, "{cautious}");
        // Mixed steps then measure the real cost and the allowance grows.
        for _ in 0..30 {
            cost.record(4, 0, 0.050);
            cost.record(4, 64, 0.050 + 64.0 * 0.0002);
        }
        assert!(cost.prefill_allowance(2.0).unwrap() > 150);
    }
}
