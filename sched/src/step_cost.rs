//! How many prompt tokens a step may carry while rows are decoding, steered
//! by the steps the engine runs, so a long prompt joining does not stall the
//! streams already running.
//!
//! A prompt chunk shares its step with every decoding row, so each chunk
//! token delays all running streams. No fixed chunk size is right on every
//! machine: on a 2-core CPU a prompt token costs about 3 ms, so 16 of them
//! add half a decode step; on a GPU a chunk costs a few milliseconds for its
//! own attention kernels whatever its length, plus microseconds a token. A
//! model of the cost would have to tell those apart from timings with
//! one-off spikes (the first step of new shapes can take ten times the
//! usual: bench/results/gpu-h200-admit-trace.log). So this is a feedback
//! loop on what matters instead: each mixed step's time is compared with
//! `inflation` times a decode-only step, and the allowance grows while
//! mixed steps come in under that target and shrinks toward it when they
//! go over. A spike costs one shrink, not a long memory.
//!
//! Where a mixed step costs more than the target whatever its size (on a
//! GPU whose decode steps run fused kernels, a mixed step runs the general
//! graph: milliseconds of fixed cost over a decode step of one or two), no
//! allowance meets it, and the smallest chunks would make a long prompt
//! pay that fixed cost a hundred times over. So the mixed steps' added time
//! is also fitted as fixed + per-token cost ([`ChunkFit`]), and the
//! allowance is at least the chunk whose tokens cost as much as the fixed
//! part: no mixed step then spends most of its time on its overhead.

/// Weight of the past in the decode-only average (per step).
const DECAY: f64 = 0.8;
/// Least growth per mixed step that used its whole allowance and stayed
/// well under the target.
const GROW: f64 = 1.15;
/// Most growth per such step. A step far under the target grows the
/// allowance toward the size that would reach "well under" were its added
/// time all per-token cost: where a chunk has a fixed cost too (a GPU's
/// kernel launches) that underestimates the size, the safe side. By 15% a
/// step alone, a GPU's allowance took some twenty steps to grow from the
/// floor to the few hundred tokens it affords, most of a long prompt.
const MOST_GROW: f64 = 2.0;
/// "Well under": within this share of the margin over a decode step, so
/// that step-to-step noise around the target does not walk the allowance up.
const GROW_BELOW: f64 = 0.75;
/// Prompt tokens a prompt-only step must read for its time to say what a
/// token costs in bulk: a short step is mostly its fixed cost (on an H200
/// a 30-token step costs ten times a 512-token chunk's share per token).
const BULK_PREFILL_TOKENS: usize = 256;
/// Most a single slow step may shrink the allowance, so one spike does not
/// throw away what was learned.
const MOST_SHRINK: f64 = 0.5;
/// Weight of the past in the fit of mixed steps' cost (per mixed step).
const FIT_DECAY: f64 = 0.9;
/// A mixed step this many times over the fit's line is a spike.
const SPIKE: f64 = 3.0;

/// A line fitted by least squares to mixed steps' time over a decode-only
/// step against their prompt tokens, older steps weighing less.
#[derive(Debug, Default)]
struct ChunkFit {
    /// The last step was left out as a spike (see [`ChunkFit::add`]).
    skipped: bool,
    weight: f64,
    tokens: f64,
    added: f64,
    tokens_squared: f64,
    tokens_added: f64,
}

impl ChunkFit {
    /// Adds a step, unless it took more than [`SPIKE`] times what the line
    /// says (the first step of new shapes can take ten times the usual);
    /// a second such step in a row is taken as the cost having changed.
    fn add(&mut self, tokens: f64, added: f64) {
        let spike = self.line().is_some_and(|(fixed, per_token)| added > SPIKE * (fixed + per_token * tokens));
        self.skipped = spike && !self.skipped;
        if self.skipped {
            return;
        }
        for sum in [&mut self.weight, &mut self.tokens, &mut self.added, &mut self.tokens_squared, &mut self.tokens_added] {
            *sum *= FIT_DECAY;
        }
        self.weight += 1.0;
        self.tokens += tokens;
        self.added += added;
        self.tokens_squared += tokens * tokens;
        self.tokens_added += tokens * added;
    }

    /// (fixed seconds, seconds a token), once the steps' sizes differ
    /// enough to tell the two apart and both came out positive.
    fn line(&self) -> Option<(f64, f64)> {
        if self.weight < 3.0 {
            return None;
        }
        let mean = self.tokens / self.weight;
        let variance = self.tokens_squared / self.weight - mean * mean;
        // Sizes within ~10% of each other say nothing about the slope.
        if variance <= (0.1 * mean).powi(2) {
            return None;
        }
        let per_token = (self.tokens_added / self.weight - mean * self.added / self.weight) / variance;
        let fixed = self.added / self.weight - per_token * mean;
        (per_token > 0.0 && fixed > 0.0).then_some((fixed, per_token))
    }

    /// The fixed cost, given what a token costs, from the steps' mean:
    /// for steps all of one size (a loop at its floor), which give no slope.
    fn fixed_at(&self, per_token: f64) -> Option<f64> {
        (self.weight > 0.0).then(|| (self.added - per_token * self.tokens) / self.weight)
    }
}

#[derive(Debug)]
pub(crate) struct StepCost {
    /// Target time of a mixed step over a decode-only step; at most 1: no limit.
    inflation: f64,
    /// Fewest prompt tokens a mixed step carries, so a prompt always moves.
    floor: usize,
    /// Decayed average of decode-only steps' seconds.
    decode_s: Option<f64>,
    /// Seconds per prompt token of the latest prefill-only step, whole
    /// step counted (an overestimate, the safe side): the first guess,
    /// before any mixed step has been timed.
    prefill_only_token_s: Option<f64>,
    /// Prompt tokens per step with decoding rows, once a mixed step has
    /// been timed.
    allowance: Option<f64>,
    /// Seconds per prompt token of prompt-only steps of at least
    /// [`BULK_PREFILL_TOKENS`], decayed: what reading a long history costs.
    bulk_token_s: Option<f64>,
    /// Mixed steps' added time as fixed + per-token cost.
    fit: ChunkFit,
}

impl StepCost {
    pub fn new(inflation: f64, floor: usize) -> StepCost {
        StepCost { inflation, floor, decode_s: None, prefill_only_token_s: None, allowance: None, bulk_token_s: None, fit: ChunkFit::default() }
    }

    /// Records a step that ran `decode_rows` decoding rows and
    /// `prefill_tokens` prompt tokens in `seconds`, steering the allowance
    /// toward steps of `inflation` times a decode-only step.
    pub fn record(&mut self, decode_rows: usize, prefill_tokens: usize, seconds: f64) {
        let tokens = prefill_tokens as f64;
        match (decode_rows, prefill_tokens, self.decode_s) {
            (0, 0, _) => {}
            (_, 0, d) => self.decode_s = Some(d.map_or(seconds, |d| DECAY * d + (1.0 - DECAY) * seconds)),
            (0, _, _) => {
                self.prefill_only_token_s = Some(seconds / tokens);
                if prefill_tokens >= BULK_PREFILL_TOKENS {
                    let t = seconds / tokens;
                    self.bulk_token_s = Some(self.bulk_token_s.map_or(t, |b| DECAY * b + (1.0 - DECAY) * t));
                }
            }
            (_, _, Some(decode)) => {
                self.fit.add(tokens, seconds - decode);
                let target = self.inflation * decode;
                let current = self.allowance.or_else(|| self.first_guess()).unwrap_or(tokens);
                self.allowance = Some(if seconds <= target {
                    // Grow only from steps the allowance limited (a short
                    // last chunk says nothing about larger ones) that left
                    // room.
                    // Growth is by a step at a time, however many tokens a
                    // step carried (short prompts ride along whole).
                    let room = GROW_BELOW * (target - decode);
                    let added = seconds - decode;
                    if added <= room && tokens >= 0.9 * self.spendable(current) as f64 {
                        current * (room / added.max(f64::MIN_POSITIVE)).clamp(GROW, MOST_GROW)
                    } else {
                        current
                    }
                } else {
                    // Shrink toward the size that would have met the target
                    // were the added time all per-token cost.
                    let scale = ((target - decode).max(0.0) / (seconds - decode)).clamp(MOST_SHRINK, 1.0);
                    (current.min(tokens) * scale).max(1.0)
                });
            }
            (_, _, None) => {}
        }
    }

    /// Before any mixed step: the margin over a decode step, spent at the
    /// per-token cost of a prefill-only step.
    fn first_guess(&self) -> Option<f64> {
        Some((self.inflation - 1.0).max(0.0) * self.decode_s? / self.prefill_only_token_s?)
    }

    /// Seconds a prompt token costs to read in bulk, from steps that read
    /// at least [`BULK_PREFILL_TOKENS`] prompt tokens alone (whole step
    /// counted); `None` before one ran.
    pub fn prefill_token_seconds(&self) -> Option<f64> {
        self.bulk_token_s
    }

    /// Prompt tokens the next step with decoding rows may carry (at least
    /// the floor); `None` while nothing has been measured, or when the
    /// inflation is not above 1 (no limit).
    pub fn prefill_allowance(&self) -> Option<usize> {
        if self.inflation <= 1.0 {
            return None;
        }
        let learned = self.allowance.or_else(|| self.first_guess())?;
        Some(self.spendable(learned.max(self.amortizing_chunk().unwrap_or(0.0))))
    }

    /// Prompt tokens whose cost in a mixed step equals the step's fixed
    /// cost (see the module notes): from the fit where its steps' sizes
    /// differ, else with a token's cost in bulk (a long prompt read alone;
    /// whole step counted, so the fixed part comes out low: the safe side).
    fn amortizing_chunk(&self) -> Option<f64> {
        let (fixed, per_token) = self.fit.line().or_else(|| {
            let per_token = self.bulk_token_s?;
            Some((self.fit.fixed_at(per_token)?, per_token))
        })?;
        (fixed > 0.0).then(|| fixed / per_token)
    }

    /// The allowance as steps spend it: whole multiples of the floor, so a
    /// run of mixed steps repeats a few shapes (on a GPU the first step of
    /// each new shape pays for kernel set-up, several times a step's work:
    /// bench/results/gpu-h200-admit-trace-prefill-in-slots.log).
    fn spendable(&self, allowance: f64) -> usize {
        let floor = self.floor.max(1);
        let multiples = (allowance / floor as f64).floor().min(usize::MAX as f64 / 4.0 / floor as f64) as usize;
        multiples.max(1) * floor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives the engine's loop against a machine whose mixed steps take
    /// `decode + fixed + per_token * tokens` seconds; returns the allowances chosen.
    fn drive(cost: &mut StepCost, decode: f64, fixed: f64, per_token: f64, steps: usize) -> Vec<usize> {
        let mut chosen = Vec::new();
        for _ in 0..steps {
            let t = cost.prefill_allowance().unwrap();
            chosen.push(t);
            cost.record(8, t, decode + fixed + per_token * t as f64);
            cost.record(8, 0, decode);
        }
        chosen
    }

    fn started(decode: f64, per_token: f64, inflation: f64) -> StepCost {
        let mut cost = StepCost::new(inflation, 16);
        cost.record(8, 0, decode);
        cost.record(0, 64, 0.02 + 64.0 * per_token); // a first prompt, alone
        cost
    }

    /// The largest allowance of the last few steps.
    fn settled(chosen: &[usize]) -> usize {
        *chosen.iter().rev().take(4).max().unwrap()
    }

    /// Only long prompt-only steps say what a token costs in bulk: short
    /// ones are mostly their fixed cost.
    #[test]
    fn bulk_token_cost_comes_from_long_prompt_steps() {
        let mut cost = StepCost::new(1.5, 16);
        cost.record(0, 30, 0.010);
        assert_eq!(cost.prefill_token_seconds(), None);
        cost.record(0, 512, 0.016);
        assert_eq!(cost.prefill_token_seconds(), Some(0.016 / 512.0));
        cost.record(0, 30, 0.010);
        cost.record(4, 0, 0.009);
        assert_eq!(cost.prefill_token_seconds(), Some(0.016 / 512.0), "short and decode steps leave it");
    }

    #[test]
    fn nothing_measured_means_no_allowance() {
        let mut cost = StepCost::new(2.0, 16);
        assert_eq!(cost.prefill_allowance(), None);
        cost.record(0, 64, 0.1);
        assert_eq!(cost.prefill_allowance(), None, "no decode step timed yet");
        cost.record(8, 0, 0.08);
        // 80 ms of margin at 1.6 ms a token (the prompt's whole step): 51,
        // spent in multiples of the floor.
        assert_eq!(cost.prefill_allowance(), Some(48));
        let mut unlimited = StepCost::new(1.0, 16);
        unlimited.record(0, 64, 0.1);
        unlimited.record(8, 0, 0.08);
        assert_eq!(unlimited.prefill_allowance(), None, "1x means no limit");
    }

    #[test]
    fn per_token_costs_settle_near_the_target() {
        // A CPU-like machine: 80 ms decode steps, 0.5 ms per prompt token.
        // Twice a decode step leaves 80 ms for prompt tokens: 160 of them.
        let mut cost = started(0.080, 0.0005, 2.0);
        let chosen = drive(&mut cost, 0.080, 0.0, 0.0005, 60);
        let t = settled(&chosen);
        assert!((120..=200).contains(&t), "{chosen:?}");
    }

    #[test]
    fn a_fixed_chunk_cost_does_not_starve_the_prompt() {
        // An NVIDIA H200-like machine: 9.5 ms decode steps; a chunk adds
        // 2 ms whatever its size plus 25 us a token. At 1.5x, 2.75 ms are
        // left for tokens: ~110 of them, ~60 with room to spare (a per-token-
        // only model reading 16-token chunks would allow 16).
        let mut cost = started(0.0095, 0.0003, 1.5);
        let chosen = drive(&mut cost, 0.0095, 0.002, 0.000025, 40);
        let t = settled(&chosen);
        assert!((55..=140).contains(&t), "{chosen:?}");
    }

    #[test]
    fn a_cheap_chunk_grows_the_allowance_in_a_few_steps() {
        // An NVIDIA H200-like machine: 8.6 ms decode steps, a chunk adds
        // 1 ms plus 15 us a token. At 1.5x, "well under" is 3.2 ms added:
        // ~150 tokens, reached from the floor in a handful of steps.
        let mut cost = started(0.0086, 0.000015, 1.5);
        let chosen = drive(&mut cost, 0.0086, 0.001, 0.000015, 12);
        assert!(chosen[..6].iter().sum::<usize>() >= 400, "{chosen:?}");
        let t = settled(&chosen);
        assert!((128..=240).contains(&t), "{chosen:?}");
    }

    #[test]
    fn a_one_off_slow_step_costs_one_shrink() {
        let mut cost = started(0.0095, 0.0003, 1.5);
        drive(&mut cost, 0.0095, 0.002, 0.000025, 40);
        let before = cost.prefill_allowance().unwrap();
        cost.record(8, before, 0.083); // new shapes: 83 ms once
        let after = cost.prefill_allowance().unwrap();
        assert!(after * 2 >= before - 1, "{before} -> {after}");
        let chosen = drive(&mut cost, 0.0095, 0.002, 0.000025, 10);
        assert!(settled(&chosen) >= 55, "{chosen:?}");
    }

    #[test]
    fn noise_does_not_walk_the_allowance_up() {
        // A shared 2-core CPU: 90 ms decode steps, 3.4 ms a prompt token,
        // every step +-15% at random. The target (13 tokens at 1.5x) is
        // under the 16-token floor; chunks must stay near it.
        let mut cost = started(0.090, 0.0034, 1.5);
        let mut seed = 7u64;
        let mut noise = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            1.0 + 0.3 * ((seed >> 33) as f64 / (1u64 << 31) as f64 - 0.5)
        };
        let mut chosen = Vec::new();
        for _ in 0..300 {
            let t = cost.prefill_allowance().unwrap();
            chosen.push(t);
            cost.record(8, t, (0.090 + 0.0034 * t as f64) * noise());
            cost.record(8, 0, 0.090 * noise());
        }
        let big = chosen.iter().filter(|&&t| t > 24).count();
        assert!(big <= 3, "{big} chunks over 24 tokens: {chosen:?}");
    }

    #[test]
    fn an_unreachable_target_amortizes_the_fixed_cost() {
        // A fixed cost above the whole margin: no chunk size meets 1.5x.
        // The floor would pay 7 ms for every 16 tokens; chunks grow to
        // where their tokens cost as much as that (280 tokens).
        let mut cost = started(0.0095, 0.0003, 1.5);
        let chosen = drive(&mut cost, 0.0095, 0.007, 0.000025, 10);
        assert_eq!(settled(&chosen), 16, "nothing says yet what a token costs: {chosen:?}");
        cost.record(0, 1024, 0.005 + 1024.0 * 0.000025); // a long prompt, alone
        let chosen = drive(&mut cost, 0.0095, 0.007, 0.000025, 30);
        let t = settled(&chosen);
        assert!((240..=320).contains(&t), "{chosen:?}");
    }

    #[test]
    fn fused_decode_steps_do_not_starve_a_joining_prompt() {
        // An NVIDIA H100 whose decode steps run fused kernels (2 ms) while
        // a mixed step runs the general graph: 6 ms more plus 20 us a
        // token. A 2,000-token prompt at the 16-token floor would take 125
        // mixed steps, about a second; amortized, a handful.
        let gpu = || {
            let mut cost = started(0.002, 0.0001, 1.5);
            cost.record(0, 1024, 0.005 + 1024.0 * 0.000020); // the streams' prompts
            cost
        };
        let mut cost = gpu();
        let chosen = drive(&mut cost, 0.002, 0.006, 0.000020, 20);
        let t = settled(&chosen);
        assert!((256..=352).contains(&t), "{chosen:?}");
        let mut left = 2000usize;
        let mut steps = 0;
        let mut cost = gpu();
        while left > 0 {
            let t = cost.prefill_allowance().unwrap().min(left);
            cost.record(8, t, 0.002 + 0.006 + 0.000020 * t as f64);
            cost.record(8, 0, 0.002);
            left -= t;
            steps += 1;
        }
        assert!(steps <= 24, "{steps} mixed steps for 2,000 tokens");
    }

    #[test]
    fn the_fit_needs_steps_of_different_sizes() {
        let mut fit = ChunkFit::default();
        for _ in 0..10 {
            fit.add(64.0, 0.003);
        }
        assert_eq!(fit.line(), None, "one size: no slope");
        fit.add(128.0, 0.004);
        fit.add(256.0, 0.006);
        let (fixed, per_token) = fit.line().unwrap();
        assert!((fixed - 0.002).abs() < 1e-4 && (per_token - 1.5625e-5).abs() < 1e-6, "{fixed} {per_token}");
    }
}
