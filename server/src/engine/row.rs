//! One request inside the engine: its KV cache, sampler and progress.
use super::api::{EngineEvent, Finish, FinishInfo, RequestId, StopHandle, StopReason, SubmitRequest, TokenLogprob};
use super::constraint::TokenConstraint;
use super::prefix::{Hit, LentHistory};
use super::scheduler::{DraftView, RowView};
use super::speculate::{DraftState, Proposal};
use crate::model::{KvCache, Transformer};
use crate::sample::Sampler;

pub(super) struct Row {
    pub id: RequestId,
    pub request: SubmitRequest,
    pub events: tokio::sync::mpsc::Sender<EngineEvent>,
    /// Set by the edge to end the request early.
    pub stop: StopHandle,
    /// KV bytes the request can grow to (see the scheduler's reservations).
    pub kv_bytes: usize,
    /// The row's KV cache, unless it is in the engine's batch (`slot`).
    pub cache: KvCache,
    /// Its slot in the engine's [`crate::model::KvBatch`], from admission
    /// on when caches are batched; `cache` is empty meanwhile.
    pub slot: Option<usize>,
    pub sampler: Sampler,
    /// Prompt tokens already in the cache.
    pub prefilled: usize,
    /// Tokens generated and published.
    pub generated: usize,
    /// The last sampled token, not yet fed back through the model.
    pub pending_token: Option<u32>,
    /// Prompt then generated tokens: what the KV cache holds, and more.
    pub tokens: Vec<u32>,
    /// Prompt tokens that came from the prefix cache.
    pub cached_tokens: usize,
    /// Held when those tokens' state was the session's own entry, lent whole
    /// (it left the cache): a cancelled turn gives that history back.
    pub lent: Option<LentHistory>,
    /// Draft source and counters of a speculating row (every constrained
    /// row speculates: the grammar's forced tokens are its drafts).
    pub draft: Option<DraftState>,
    /// The matcher of a constrained request, advanced by emitted tokens.
    pub constraint: Option<Box<dyn TokenConstraint>>,
}

/// What a row does in one step (the scheduler's [`RowWork`], with the
/// drafts filled in).
///
/// [`RowWork`]: super::scheduler::RowWork
pub(super) enum Work {
    Prefill {
        tokens: usize,
    },
    /// The pending token, then draft tokens to verify (often none).
    Decode {
        drafts: Vec<u32>,
    },
}

impl Row {
    pub fn new(admitted: Admitted, cache: KvCache, draft_model: Option<&Transformer>) -> mlx::Result<Row> {
        let Admitted { id, request, events, stop, kv_bytes } = admitted;
        let sampler = Sampler::new(request.sampling.clone());
        let tokens = request.prompt.clone();
        let constraint = match &request.constraint {
            Some(spec) => Some(spec.start().map_err(|message| mlx::Error { op: "constraint", message })?),
            None => None,
        };
        let draft = DraftState::new(&request.speculation, draft_model, constraint.is_some());
        Ok(Row {
            id,
            request,
            events,
            stop,
            kv_bytes,
            cache,
            slot: None,
            sampler,
            prefilled: 0,
            generated: 0,
            pending_token: None,
            tokens,
            cached_tokens: 0,
            lent: None,
            draft,
            constraint,
        })
    }

    /// What the scheduler sees of this row.
    pub fn view(&self) -> RowView<'_> {
        RowView {
            id: self.id,
            session: self.request.session.as_deref(),
            kv_bytes: self.kv_bytes,
            prompt_remaining: self.prompt_remaining(),
            uncached_prompt: self.request.prompt.len() - self.cached_tokens,
            decoding: self.pending_token.is_some(),
            can_publish: self.can_publish(),
            prefill_chunk: self.request.prefill_chunk,
            generation_room: self.request.max_tokens.saturating_sub(self.generated + 1),
            // The step runner fills in `ready` from the row's proposal.
            draft: self.draft.as_ref().map(|d| DraftView { ready: d.depth(), recent_acceptance: d.recent_acceptance() }),
        }
    }

    /// Why the edge wants this row ended now, if it does: it asked, or its
    /// consumer went away (nobody to tell: cancelled).
    pub fn stop_requested(&self) -> Option<StopReason> {
        self.stop.requested().or_else(|| self.events.is_closed().then_some(StopReason::Cancel))
    }

    pub fn prompt_remaining(&self) -> usize {
        self.request.prompt.len() - self.prefilled
    }

    /// Room for this step's events (a token batch now, a final event later).
    pub fn can_publish(&self) -> bool {
        self.events.capacity() >= 2
    }

    /// This row's tokens for the step's forward; advances its progress.
    pub fn take_input(&mut self, work: &Work) -> mlx::Result<Vec<u32>> {
        match *work {
            Work::Prefill { tokens } => {
                let chunk = self.request.prompt[self.prefilled..self.prefilled + tokens].to_vec();
                self.prefilled += tokens;
                Ok(chunk)
            }
            Work::Decode { ref drafts, .. } => {
                let token = self.pending_token.take().ok_or_else(|| mlx::Error { op: "engine", message: "decode without a token".into() })?;
                let mut input = Vec::with_capacity(1 + drafts.len());
                input.push(token);
                input.extend_from_slice(drafts);
                Ok(input)
            }
        }
    }

    /// Starts this row from a prefix-cache hit of `len` prompt tokens.
    pub fn resume_from(&mut self, hit: Hit) {
        let (cache, len, lent) = hit.into_parts();
        self.cache = cache;
        self.prefilled = len;
        self.cached_tokens = len;
        self.lent = lent;
    }

    /// Hands the history a cancelled turn was lent back to its lease,
    /// which returns it to the prefix cache (what the turn computed is
    /// freed, as for any cancelled turn); frees everything when nothing
    /// was lent.
    pub fn give_back_lent_history(self) {
        if let Some(lease) = self.lent {
            lease.give_back(self.tokens, self.cache);
        }
    }

    /// The tokens whose keys and values the cache holds, with the cache.
    /// (After a verification that ended on a stop token the cache may hold
    /// accepted drafts past the last emitted token: those are dropped.)
    pub fn into_cached_state(self) -> (Vec<u32>, KvCache) {
        let (mut tokens, mut cache) = (self.tokens, self.cache);
        let len = tokens.len().min(cache.len());
        tokens.truncate(len);
        cache.truncate(len);
        (tokens, cache)
    }

    /// This decode step's drafts: as many as the source offers within the
    /// row's adaptive depth and its `max_tokens` room (a verification emits
    /// up to drafts + 1 tokens). The scheduler then caps them. A constrained
    /// row's drafts are its grammar's forced tokens when there are any (its
    /// matcher has consumed the pending token already: see the step's publish).
    pub fn drafts(&mut self) -> Proposal {
        let (history, generated) = (&self.tokens, self.generated);
        let room = self.request.max_tokens.saturating_sub(generated + 1);
        let grammar_drafts = self.request.speculation.grammar_drafts;
        if let Some(c) = self.constraint.as_mut().filter(|_| grammar_drafts) {
            let forced = c.forced();
            if !forced.is_empty() {
                let max = self.draft.as_ref().map_or(0, DraftState::max_draft).min(room);
                return Proposal::Ready(forced.into_iter().take(max).collect());
            }
        }
        match &mut self.draft {
            Some(d) => d.propose(history, generated, room),
            None => Proposal::Ready(Vec::new()),
        }
    }

    /// A request with `max_tokens: 0` only warms the prefix cache.
    pub fn is_prewarm(&self) -> bool {
        self.request.max_tokens == 0
    }

    /// Whether the step's forward ends with a token to sample: every decode
    /// step, and the prefill chunk that completes the prompt.
    pub fn samples_after(&self, work: &Work) -> bool {
        matches!(work, Work::Decode { .. }) || (self.prompt_remaining() == 0 && !self.is_prewarm())
    }

    pub fn final_event(&self, reason: Finish) -> EngineEvent {
        EngineEvent::Finished(FinishInfo {
            reason,
            prompt_tokens: self.request.prompt.len(),
            cached_tokens: self.cached_tokens,
            completion_tokens: self.generated,
            speculative: self.draft.as_ref().map(|d| d.stats.clone()),
        })
    }
}

/// A waiting request the scheduler admitted, before its row exists.
pub(super) struct Admitted {
    pub id: RequestId,
    pub request: SubmitRequest,
    pub events: tokio::sync::mpsc::Sender<EngineEvent>,
    pub stop: StopHandle,
    pub kv_bytes: usize,
}

/// The sampled token's log-probability and the top `n` alternatives, from a
/// row of float32 logits read back to the host.
pub(super) fn logprobs_of(logits: &[f32], token: u32, n: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_z = max + logits.iter().map(|l| (l - max).exp()).sum::<f32>().ln();
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n);
    if n > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let n = n.min(idx.len());
        idx.select_nth_unstable_by(n - 1, |a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        idx.truncate(n);
        idx.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]));
        top = idx.into_iter().map(|i| (i, logits[i as usize] - log_z)).collect();
    }
    TokenLogprob { token_id: token, logprob: logits[token as usize] - log_z, top }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_normalise_and_rank() {
        let lp = logprobs_of(&[0.0, 2.0, 1.0], 2, 2);
        let z = (1f32 + 2f32.exp() + 1f32.exp()).ln();
        assert!((lp.logprob - (1.0 - z)).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
    }
}
