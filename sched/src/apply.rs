//! What a step's results mean: `apply` takes the tokens the runner drew for
//! each row and decides, for every row of the step, what is accepted, what is
//! emitted, and whether the row ends (a stop token, its grammar's end, its
//! token limit, its deadline, a failed matcher). It moves each row's
//! progress; the engine then carries the decisions out: it drops rejected
//! drafts from the KV, sends the tokens, and finishes the rows that ended.
//!
//! The rule that makes drafts exact: a verification of `k` drafts yields
//! `k + 1` targets (the target's token after the pending one, then after
//! each draft); the drafts equal to their targets are accepted and the
//! target after the last accepted one is emitted with them, so every
//! verification emits `accepted + 1` tokens and the cache keeps exactly the
//! positions those tokens' predecessors wrote.
use std::time::Instant;

use crate::drafting::accept_matching;
use crate::progress::{RequestProgress, Work};
use crate::request::{EngineError, Finish, TokenId, TokenLogprob};

/// What the runner hands back for one step, by running row (the index the
/// step's work was given by).
#[derive(Debug, Default)]
pub struct StepOutput {
    /// The rows that sampled, with their draws.
    pub sampled: Vec<Sampled>,
    /// Rows whose grammar failed before they could sample (while their drafts
    /// were checked, or their masks made): they end with the reason.
    pub constraint_failed: Vec<(usize, String)>,
}

/// One sampling row's draws.
#[derive(Debug)]
pub struct Sampled {
    /// running row
    pub row: usize,
    /// The target's token after each input position of its decode (the
    /// pending token, then each draft), or after its prompt's last token.
    pub targets: Vec<TokenId>,
    /// Its float32 logits, position-major (`targets.len()` x vocab), when it
    /// asked for log-probabilities.
    pub logits: Option<Vec<f32>>,
}

/// How a row's part in a step ended it.
#[derive(Clone, Debug, PartialEq)]
pub enum End {
    Finished(Finish),
    Failed(EngineError),
}

/// A decode's verification, for the draft model's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verified {
    /// The row's tokens before the verification emitted any.
    pub history_len: usize,
    pub drafted: usize,
    pub accepted: usize,
}

/// What the engine carries out for one row after a step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowUpdate {
    /// running row
    pub row: usize,
    /// Positions the forward wrote for drafts that were rejected: its KV
    /// drops them.
    pub rejected_drafts: usize,
    /// Set for a decode of a speculating row.
    pub verified: Option<Verified>,
    /// Tokens to publish, in order, with their log-probabilities when asked.
    pub tokens: Vec<TokenId>,
    pub logprobs: Vec<TokenLogprob>,
    /// Set when the row ends with this step.
    pub end: Option<End>,
}

/// Engine-wide counters of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepCounts {
    pub generated_tokens: u64,
    pub drafted_tokens: u64,
    pub accepted_draft_tokens: u64,
    /// Decode forwards of speculating rows, and the tokens they produced.
    pub spec_decode_forwards: u64,
    pub spec_decode_tokens: u64,
}

#[derive(Debug, Default)]
pub struct Applied {
    /// The rows with something to carry out (tokens, a rollback, an end),
    /// in running order.
    pub updates: Vec<RowUpdate>,
    pub counts: StepCounts,
}

/// Applies a step's `output` to the running `rows`: `work[i]` is what row
/// `i` did (`None`: it sat the step out). Moves every row's progress (prompt
/// read, pending token fed) and decides what it emits and whether it ends;
/// rows past their deadline end too, whether or not they ran, and so do
/// prewarm rows whose prompt is read.
pub fn apply<R: AsMut<RequestProgress>>(rows: &mut [R], work: &[Option<Work>], output: StepOutput, now: Instant) -> Applied {
    let mut updates: Vec<Option<RowUpdate>> = (0..rows.len()).map(|_| None).collect();
    let mut counts = StepCounts::default();
    for (row, w) in rows.iter_mut().zip(work) {
        match w {
            Some(Work::Prefill { tokens }) => row.as_mut().prefilled += tokens,
            Some(Work::Decode { .. }) => row.as_mut().pending_token = None,
            None => {}
        }
    }
    for (i, e) in output.constraint_failed {
        updates[i] = Some(RowUpdate { row: i, end: Some(End::Failed(EngineError::Constraint(e))), ..Default::default() });
    }
    for s in output.sampled {
        let drafts: &[TokenId] = match &work[s.row] {
            Some(Work::Decode { drafts }) => drafts,
            _ => &[],
        };
        let decode = matches!(work[s.row], Some(Work::Decode { .. }));
        updates[s.row] = Some(accept(rows[s.row].as_mut(), s.row, decode, drafts, &s.targets, s.logits.as_deref(), &mut counts));
    }
    for (i, row) in rows.iter_mut().enumerate() {
        let row = row.as_mut();
        if updates[i].as_ref().is_some_and(|u| u.end.is_some()) {
            continue;
        }
        let end = if row.is_prewarm() && row.prompt_remaining() == 0 {
            Some(Finish::Length)
        } else if row.limits.deadline.is_some_and(|d| now >= d) {
            // Deadlines also end rows still reading a long prompt.
            Some(Finish::TimeLimit)
        } else {
            None
        };
        if let Some(reason) = end {
            updates[i].get_or_insert_with(|| RowUpdate { row: i, ..Default::default() }).end = Some(End::Finished(reason));
        }
    }
    Applied { updates: updates.into_iter().flatten().collect(), counts }
}

/// One sampling row: accepts its drafts, emits tokens up to a stop token,
/// its grammar's end or `max_tokens`, and advances its matcher by them.
fn accept(
    row: &mut RequestProgress,
    index: usize,
    decode: bool,
    drafts: &[TokenId],
    targets: &[TokenId],
    logits: Option<&[f32]>,
    counts: &mut StepCounts,
) -> RowUpdate {
    let accepted = accept_matching(drafts, targets);
    let emitted = &targets[..=accepted];
    // The forward appended the pending token and every draft; the cache
    // keeps the accepted ones only.
    let mut update = RowUpdate { row: index, rejected_drafts: drafts.len() - accepted, ..Default::default() };
    if let (Some(drafting), true) = (&mut row.drafting, decode) {
        update.verified = Some(Verified { history_len: row.tokens.len(), drafted: drafts.len(), accepted });
        drafting.record(drafts.len(), accepted, emitted.len());
        counts.drafted_tokens += drafts.len() as u64;
        counts.accepted_draft_tokens += accepted as u64;
        counts.spec_decode_forwards += 1;
        counts.spec_decode_tokens += emitted.len() as u64;
    }
    let mut finish = None;
    for (pos, &id) in emitted.iter().enumerate() {
        if row.limits.stop_ids.contains(&id) {
            finish = Some(Finish::Stop);
            break;
        }
        if let (Some(logits), Some(n)) = (logits, row.limits.logprobs) {
            let vocab = logits.len() / (drafts.len() + 1);
            update.logprobs.push(logprobs_of(&logits[pos * vocab..(pos + 1) * vocab], id, n as usize));
        }
        if let Some(c) = &mut row.constraint {
            if let Err(e) = c.consume(&[id]) {
                // Nothing of this step is published: the row fails here.
                update.tokens.clear();
                update.logprobs.clear();
                update.end = Some(End::Failed(EngineError::Constraint(e)));
                return update;
            }
        }
        update.tokens.push(id);
        row.generated += 1;
        row.tokens.push(id);
        if row.constraint.as_ref().is_some_and(|c| c.is_finished()) {
            // The grammar allows nothing more: the answer is complete.
            finish = Some(Finish::Stop);
            break;
        }
        if row.generated >= row.limits.max_tokens {
            finish = Some(Finish::Length);
            break;
        }
    }
    counts.generated_tokens += update.tokens.len() as u64;
    row.pending_token = update.tokens.last().copied();
    update.end = finish.map(End::Finished);
    update
}

/// The sampled token's log-probability and the top `n` alternatives, from a
/// row of float32 logits.
pub fn logprobs_of(logits: &[f32], token: TokenId, n: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_z = max + logits.iter().map(|l| (l - max).exp()).sum::<f32>().ln();
    let mut top: Vec<(TokenId, f32)> = Vec::with_capacity(n);
    if n > 0 {
        let mut idx: Vec<TokenId> = (0..logits.len() as TokenId).collect();
        let n = n.min(idx.len());
        idx.select_nth_unstable_by(n - 1, |a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        idx.truncate(n);
        idx.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        top = idx.into_iter().map(|i| (i, logits[i as usize] - log_z)).collect();
    }
    TokenLogprob { token_id: token, logprob: logits[token as usize] - log_z, top }
}

#[cfg(test)]
mod tests;
