//! The scheduler: which waiting requests get rows, and what each running
//! row does in the next step. Plain data in, plain data out: no MLX, no
//! channels, no clocks; the engine feeds it views of the
//! queue and the rows and the time each step took, and carries out the
//! [`StepPlan`] it returns.
//!
//! Each step gives every running row work under a token budget: decode rows
//! first (one token each, in an order that rotates so no row is always
//! last), then draft tokens for rows that speculate, then prompt chunks of
//! rows still reading their prompt. While rows decode, prompt chunks are
//! held to an allowance learned from step times ([`StepCost`]) so a long
//! prompt joining does not stall the streams already running.
use std::collections::HashMap;

use crate::draft_cost::DraftCost;
use crate::request::RequestId;
use crate::step_cost::StepCost;

/// Prompts this short are prefilled whole even while streams decode (see
/// [`Scheduler::plan`]).
pub const SHORT_PROMPT_TOKENS: usize = 64;

/// Every this many steps a row whose drafts fell under the bar (see
/// [`DraftCost`]) drafts anyway, to measure its acceptance again.
const DRAFT_RETRY_EVERY: u64 = 32;

/// The scheduler's knobs (a subset of the engine's configuration).
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub max_running: usize,
    pub step_token_budget: usize,
    pub step_draft_budget: usize,
    pub prefill_chunk: usize,
    pub min_prefill_chunk: usize,
    pub max_prefill_chunk: usize,
    pub kv_budget_bytes: usize,
    /// Most tokens of a long prompt a step carries while the allowance is
    /// widened (see [`Scheduler::prefill_allowance`]): the waiting prompts
    /// then share it in small chunks that attend together beside the
    /// decoding rows, where a few large ones would each attend alone.
    pub widened_chunk_max: usize,
    /// Rows share one KV batch: every slot is as long as the longest row and
    /// slots come in powers of two (see [`Scheduler::kv_reservation`]).
    pub batched_kv: bool,
    /// Target time of a mixed step over a decode-only step (see [`StepCost`]).
    pub max_itl_inflation: f64,
}

/// What admission needs of a waiting request.
#[derive(Clone, Debug)]
pub struct WaitingView<'a> {
    pub id: RequestId,
    /// Sessions take turns for free rows; `None` counts as a session of its own.
    pub session: Option<&'a str>,
    /// KV bytes it can grow to (prompt + max_tokens, in cache blocks).
    pub kv_bytes: usize,
}

/// What planning needs of a running row.
#[derive(Clone, Debug)]
pub struct RowView<'a> {
    pub id: RequestId,
    pub session: Option<&'a str>,
    pub kv_bytes: usize,
    /// Prompt tokens not yet in the cache.
    pub prompt_remaining: usize,
    /// Prompt tokens past what the prefix cache held: whether the prompt is
    /// short enough to ride along whole (see [`SHORT_PROMPT_TOKENS`]).
    pub uncached_prompt: usize,
    /// It has a sampled token to feed back: it decodes this step.
    pub decoding: bool,
    /// Its consumer has room for this step's events; a row without is paused.
    pub can_publish: bool,
    /// Its own prompt chunk size, if it asked for one.
    pub prefill_chunk: Option<usize>,
    /// Tokens it may still generate after this step's first (a decode
    /// emits up to drafts + 1 tokens).
    pub generation_room: usize,
    /// Its speculation, if it speculates.
    pub draft: Option<DraftView>,
}

/// A speculating row's draft state, as planning needs it.
#[derive(Clone, Copy, Debug)]
pub struct DraftView {
    /// Drafts it has for this step: proposed on the host already, or the
    /// draft model's depth for it (at most its adaptive depth and room).
    pub ready: usize,
    /// Share of its recent drafts accepted; `None` before it drafted.
    pub recent_acceptance: Option<f64>,
}

impl DraftView {
    /// Whether its drafts pay in a step whose drafts must be accepted at
    /// least as often as `bar` (`None`: no bar, or not known yet); a row
    /// that has not drafted yet gets the benefit of the doubt.
    pub fn pays(&self, bar: Option<f64>) -> bool {
        match (bar, self.recent_acceptance) {
            (Some(bar), Some(acceptance)) => acceptance >= bar,
            _ => true,
        }
    }
}

/// One row's part in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowWork {
    /// Feed the pending token, plus at most `max_drafts` draft tokens.
    Decode { max_drafts: usize },
    /// Read the next `tokens` prompt tokens.
    Prefill { tokens: usize },
}

/// The work of one step, keyed by request id: decode rows first (in the
/// step's rotated order), then prefill chunks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub work: Vec<(RequestId, RowWork)>,
    /// The prefill allowance was widened for this step (see
    /// [`Scheduler::prefill_allowance`]); such a step does not teach the
    /// cost model.
    pub widened: bool,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.work.is_empty()
    }

    /// Tokens the plan may feed: decode tokens, their draft caps, prompt tokens.
    #[cfg(test)]
    pub fn max_tokens(&self) -> usize {
        self.work
            .iter()
            .map(|(_, w)| match w {
                RowWork::Decode { max_drafts } => 1 + max_drafts,
                RowWork::Prefill { tokens } => *tokens,
            })
            .sum()
    }
}

/// What a finished step cost, for the scheduler to learn from.
#[derive(Clone, Copy, Debug)]
pub struct StepTiming {
    pub decode_rows: usize,
    pub draft_tokens: usize,
    pub prefill_tokens: usize,
    pub widened: bool,
    pub seconds: f64,
}

pub struct Scheduler {
    config: SchedulerConfig,
    /// Where the next step's round-robin starts, so no row is always last.
    rotate: usize,
    /// Steps planned, for draft retries.
    steps: u64,
    step_cost: StepCost,
    /// What a draft token costs beside the step's rows (fed by decode-only steps).
    draft_cost: DraftCost,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Scheduler {
        let step_cost = StepCost::new(config.max_itl_inflation, config.min_prefill_chunk);
        Scheduler { config, rotate: 0, steps: 0, step_cost, draft_cost: DraftCost::default() }
    }

    /// KV bytes `requests` (bytes each can grow to) may take together.
    /// Batched, every slot is as long as the longest row and slots come in
    /// powers of two, so that is what they may take, however short the
    /// other rows are.
    pub fn kv_reservation(&self, requests: impl Iterator<Item = usize>) -> usize {
        let (count, sum, longest) = requests.fold((0usize, 0usize, 0usize), |(n, sum, max), bytes| (n + 1, sum + bytes, max.max(bytes)));
        if self.config.batched_kv {
            longest * count.next_power_of_two()
        } else {
            sum
        }
    }

    /// Whether a request of `kv_bytes` could ever run (alone).
    pub fn fits_alone(&self, kv_bytes: usize) -> bool {
        self.kv_reservation(std::iter::once(kv_bytes)) <= self.config.kv_budget_bytes
    }

    /// The waiting requests to move into rows now, in order: while rows
    /// and the KV budget allow, the earliest queued of those whose session
    /// has the fewest rows running. Arrival order alone would let a session
    /// that queues many requests take every row that frees up until all of
    /// them ran; this way sessions take turns. A request that does not fit
    /// yet blocks the others, so large requests are not starved by small ones.
    pub fn admit(&self, waiting: &[WaitingView<'_>], running: &[RowView<'_>]) -> Vec<RequestId> {
        let mut rows_of: HashMap<&str, usize> = HashMap::new();
        for session in running.iter().filter_map(|r| r.session) {
            *rows_of.entry(session).or_default() += 1;
        }
        let mut reserved: Vec<usize> = running.iter().map(|r| r.kv_bytes).collect();
        let mut taken = vec![false; waiting.len()];
        let mut admitted = Vec::new();
        while running.len() + admitted.len() < self.config.max_running {
            let rows = |w: &WaitingView<'_>| w.session.map_or(0, |s| rows_of.get(s).copied().unwrap_or(0));
            let next = waiting.iter().enumerate().filter(|(i, _)| !taken[*i]).min_by_key(|&(i, w)| (rows(w), i)).map(|(i, _)| i);
            let Some(next) = next else { break };
            let w = &waiting[next];
            reserved.push(w.kv_bytes);
            if self.kv_reservation(reserved.iter().copied()) > self.config.kv_budget_bytes {
                break;
            }
            taken[next] = true;
            if let Some(s) = w.session {
                *rows_of.entry(s).or_default() += 1;
            }
            admitted.push(w.id);
        }
        admitted
    }

    /// This step's work for `rows` (in running order) under the token
    /// budget: every decoding row's token first, then their drafts, then
    /// prompt chunks. Rows whose consumer has no room are skipped (paused).
    pub fn plan(&mut self, rows: &[RowView<'_>]) -> StepPlan {
        let n = rows.len();
        let order: Vec<usize> = (0..n).map(|i| (i + self.rotate) % n.max(1)).collect();
        self.rotate = self.rotate.wrapping_add(1);
        self.steps += 1;
        let mut budget = self.config.step_token_budget;
        let mut decoding = Vec::new();
        for &i in &order {
            if rows[i].decoding && rows[i].can_publish && budget > 0 {
                decoding.push(i);
                budget -= 1;
            }
        }
        let mut draft_budget = budget.min(self.config.step_draft_budget);
        let bar = self.draft_cost.bar(decoding.len());
        let mut work = Vec::new();
        for &i in &decoding {
            let row = &rows[i];
            // A row held back by the bar still drafts now and then, so its
            // acceptance keeps up with what it is writing.
            let retry = (self.steps + row.id.0).is_multiple_of(DRAFT_RETRY_EVERY);
            let drafts = match row.draft {
                Some(d) if d.pays(bar.filter(|_| !retry)) => d.ready.min(row.generation_room).min(draft_budget),
                _ => 0,
            };
            draft_budget -= drafts;
            budget -= drafts;
            work.push((row.id, RowWork::Decode { max_drafts: drafts }));
        }
        // Prompt tokens ride along only as far as the decoding rows can
        // afford (until the costs are measured, chunks alone bound them).
        // Short prompts are exempt, though they use up the allowance: they
        // finish in one step, so holding them back would cost their time
        // to first token more than it spares the running streams (32
        // streams started together would otherwise start one per step).
        let (mut allowance, widened) = self.prefill_allowance(decoding.len(), rows);
        for &i in &order {
            let row = &rows[i];
            if row.prompt_remaining == 0 || !row.can_publish || budget == 0 {
                continue;
            }
            let chunk = row.prefill_chunk.unwrap_or(self.config.prefill_chunk).clamp(self.config.min_prefill_chunk, self.config.max_prefill_chunk);
            let mut tokens = row.prompt_remaining.min(chunk).min(budget);
            if let Some(left) = &mut allowance {
                // The exemption is for short prompts, not for the last
                // chunk of a long one.
                if held_back(row) {
                    tokens = tokens.min(*left);
                    if widened {
                        tokens = tokens.min(self.config.widened_chunk_max);
                    }
                }
                *left = left.saturating_sub(tokens);
            }
            if tokens == 0 {
                continue;
            }
            work.push((row.id, RowWork::Prefill { tokens }));
            budget -= tokens;
        }
        StepPlan { work, widened }
    }

    /// Prompt tokens this step may carry beside `decode_rows` decoding rows:
    /// none while nothing decodes (no limit), else the allowance the step
    /// costs have taught (see [`StepCost`]), widened by the ratio of long
    /// prompts waiting to rows decoding when they outnumber them. The
    /// allowance spares the running streams a prompt's cost; once the
    /// prompts it holds back outnumber the streams it protects, it costs
    /// more waiting than it saves (32 streams started together with
    /// 512-token prompts on an H200: one row decoding in 5 ms steps held the
    /// other 31 to 16 prompt tokens a step, 6 s mean time to first token).
    /// Widened, each prompt moves at most `widened_chunk_max` tokens a step,
    /// and the step does not teach the cost model.
    fn prefill_allowance(&self, decode_rows: usize, rows: &[RowView<'_>]) -> (Option<usize>, bool) {
        if decode_rows == 0 {
            return (None, false);
        }
        let Some(learned) = self.step_cost.prefill_allowance() else { return (None, false) };
        let waiting = rows.iter().filter(|r| r.prompt_remaining > 0 && r.can_publish && held_back(r)).count();
        let widen = (waiting / decode_rows).max(1);
        (Some(learned * widen), widen > 1)
    }

    /// Learns from a finished step's time.
    pub fn record(&mut self, step: StepTiming) {
        if !step.widened {
            self.step_cost.record(step.decode_rows, step.prefill_tokens, step.seconds);
        }
        if step.decode_rows > 0 && step.prefill_tokens == 0 {
            self.draft_cost.record(step.decode_rows + step.draft_tokens, step.seconds);
        }
    }

    /// The allowance the next mixed step would get (for traces).
    /// What reading one prompt token has cost (see [`StepCost`]): what
    /// recomputing a history costs, against reading it from disk.
    pub fn prefill_token_seconds(&self) -> Option<f64> {
        self.step_cost.prefill_token_seconds()
    }

    pub fn learned_allowance(&self) -> Option<usize> {
        self.step_cost.prefill_allowance()
    }
}

/// Whether the prefill allowance limits `row`'s prompt while rows decode:
/// prompts up to [`SHORT_PROMPT_TOKENS`] (past what the cache held) are
/// read whole.
fn held_back(row: &RowView<'_>) -> bool {
    row.uncached_prompt > SHORT_PROMPT_TOKENS
}

#[cfg(test)]
mod tests;
