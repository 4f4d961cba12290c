//! One request inside the engine: its KV cache, sampler and progress.
use super::speculate::{DraftState, Proposal};
use super::{EngineEvent, Finish, FinishInfo, RequestId, SubmitRequest, TokenLogprob};
use crate::model::{KvCache, Transformer};
use crate::sample::Sampler;

pub(super) struct Row {
    pub id: RequestId,
    pub request: SubmitRequest,
    pub events: tokio::sync::mpsc::Sender<EngineEvent>,
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
    /// Draft source and counters of a speculating row.
    pub draft: Option<DraftState>,
}

/// What a row does in one step.
pub(super) enum Work {
    Prefill {
        tokens: usize,
    },
    /// The pending token, then draft tokens to verify (often none).
    /// `model_depth` drafts are still to come from the draft model.
    Decode {
        drafts: Vec<u32>,
        model_depth: usize,
    },
}

impl Row {
    pub fn new(
        id: RequestId,
        request: SubmitRequest,
        events: tokio::sync::mpsc::Sender<EngineEvent>,
        cache: KvCache,
        draft_model: Option<&Transformer>,
    ) -> mlx::Result<Row> {
        let sampler = Sampler::new(request.sampling.clone())?;
        let tokens = request.prompt.clone();
        let draft = DraftState::new(&request.speculation, draft_model);
        Ok(Row { id, request, events, cache, slot: None, sampler, prefilled: 0, generated: 0, pending_token: None, tokens, cached_tokens: 0, draft })
    }

    pub fn prompt_remaining(&self) -> usize {
        self.request.prompt.len() - self.prefilled
    }

    /// Room for this step's events (a token batch now, a final event later).
    pub fn can_publish(&self) -> bool {
        self.events.capacity() >= 2
    }

    pub fn consumer_gone(&self) -> bool {
        self.events.is_closed()
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
    pub fn resume_from(&mut self, cache: KvCache, len: usize) {
        self.cache = cache;
        self.prefilled = len;
        self.cached_tokens = len;
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

    /// This decode step's drafts: as many as the source offers, within the
    /// step's remaining `budget` and the request's remaining `max_tokens`
    /// (a verification emits up to drafts + 1 tokens), and none when this
    /// row's drafts are not accepted often enough to pay beside the step's
    /// other rows (`bar`: see `DraftCost`).
    pub fn drafts(&mut self, budget: usize, bar: Option<f64>) -> Proposal {
        let room = budget.min(self.request.max_tokens.saturating_sub(self.generated + 1));
        let (history, generated) = (&self.tokens, self.generated);
        match &mut self.draft {
            Some(d) if d.pays(bar) => d.propose(history, generated, room),
            _ => Proposal::Ready(Vec::new()),
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
