//! One request's progress through the engine, as the scheduler and `apply`
//! see it: its tokens, how much of its prompt is computed, what it has
//! generated, the token it will feed next, its limits, its speculation and
//! its grammar. The KV cache, sampler and draft sources that go with it live
//! in the engine; this is the part that decisions are made from.
use std::time::Instant;

use crate::constraint::TokenConstraint;
use crate::drafting::Drafting;
use crate::request::{RequestId, TokenId};
use crate::scheduler::{DraftView, RowView};

/// What ends a request besides the edge: its token limit, its stop ids,
/// its deadline; and what it reports besides tokens.
#[derive(Clone, Debug, Default)]
pub struct Limits {
    /// Tokens it may generate; 0: it only warms the prefix cache.
    pub max_tokens: usize,
    /// Token ids that end generation; they are not emitted.
    pub stop_ids: Vec<TokenId>,
    /// Finish with `TimeLimit` once this instant passes.
    pub deadline: Option<Instant>,
    /// Report each emitted token's log-probability, with this many top alternatives.
    pub logprobs: Option<u8>,
    /// Prompt tokens per forward for this request (clamped to the engine's limits).
    pub prefill_chunk: Option<usize>,
}

/// What a row does in one step: the scheduler's [`crate::RowWork`] with the
/// drafts filled in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Work {
    /// Read the next `tokens` prompt tokens.
    Prefill { tokens: usize },
    /// The pending token, then draft tokens to verify (often none).
    Decode { drafts: Vec<TokenId> },
}

pub struct RequestProgress {
    pub id: RequestId,
    /// Prompt then generated tokens: what the KV cache holds, and more
    /// (the pending token, not yet fed back).
    pub tokens: Vec<TokenId>,
    prompt_len: usize,
    /// Prompt tokens already in the KV cache.
    pub prefilled: usize,
    /// Prompt tokens that came from the prefix cache.
    pub cached_tokens: usize,
    /// Tokens generated and published.
    pub generated: usize,
    /// The last sampled token, not yet fed back through the model.
    pub pending_token: Option<TokenId>,
    pub limits: Limits,
    /// Depth and counters of a speculating row (every constrained row
    /// speculates: the grammar's forced tokens are its drafts).
    pub drafting: Option<Drafting>,
    /// The matcher of a constrained request, advanced by emitted tokens.
    /// (A step's mask thread borrows it: `None` meanwhile.)
    pub constraint: Option<Box<dyn TokenConstraint>>,
}

impl std::fmt::Debug for RequestProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestProgress")
            .field("id", &self.id)
            .field("prompt_len", &self.prompt_len)
            .field("prefilled", &self.prefilled)
            .field("generated", &self.generated)
            .field("pending_token", &self.pending_token)
            .field("constrained", &self.constraint.is_some())
            .finish_non_exhaustive()
    }
}

impl AsMut<RequestProgress> for RequestProgress {
    fn as_mut(&mut self) -> &mut RequestProgress {
        self
    }
}

impl RequestProgress {
    pub fn new(id: RequestId, prompt: Vec<TokenId>, limits: Limits) -> RequestProgress {
        RequestProgress {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            prefilled: 0,
            cached_tokens: 0,
            generated: 0,
            pending_token: None,
            limits,
            drafting: None,
            constraint: None,
        }
    }

    pub fn prompt(&self) -> &[TokenId] {
        &self.tokens[..self.prompt_len]
    }

    pub fn prompt_remaining(&self) -> usize {
        self.prompt_len - self.prefilled
    }

    /// A request with `max_tokens: 0` only warms the prefix cache.
    pub fn is_prewarm(&self) -> bool {
        self.limits.max_tokens == 0
    }

    /// Tokens it may still generate after the next one.
    pub fn generation_room(&self) -> usize {
        self.limits.max_tokens.saturating_sub(self.generated + 1)
    }

    /// Starts from `len` prompt tokens the prefix cache held.
    pub fn resume_from_cache(&mut self, len: usize) {
        self.prefilled = len;
        self.cached_tokens = len;
    }

    /// Whether the step's forward for `work` ends with a token to sample:
    /// every decode, and the prefill chunk that completes the prompt.
    pub fn samples_after(&self, work: &Work) -> bool {
        match work {
            Work::Decode { .. } => true,
            Work::Prefill { tokens } => *tokens == self.prompt_remaining() && !self.is_prewarm(),
        }
    }

    /// This row's tokens for `work`'s forward (its progress moves in
    /// [`crate::apply`], once the step ran). `None`: a decode without a
    /// pending token, which planning never asks for.
    pub fn input(&self, work: &Work) -> Option<Vec<TokenId>> {
        match work {
            Work::Prefill { tokens } => Some(self.prompt()[self.prefilled..self.prefilled + tokens].to_vec()),
            Work::Decode { drafts } => {
                let mut input = Vec::with_capacity(1 + drafts.len());
                input.push(self.pending_token?);
                input.extend_from_slice(drafts);
                Some(input)
            }
        }
    }

    /// What the scheduler sees of this row. The engine adds what only it
    /// knows: its session, its KV reservation, whether its consumer has room,
    /// and the drafts it has ready (`None`: its adaptive depth).
    pub fn view<'a>(&'a self, session: Option<&'a str>, kv_bytes: usize, can_publish: bool, drafts_ready: Option<usize>) -> RowView<'a> {
        RowView {
            id: self.id,
            session,
            kv_bytes,
            prompt_remaining: self.prompt_remaining(),
            uncached_prompt: self.prompt_len - self.cached_tokens,
            decoding: self.pending_token.is_some(),
            can_publish,
            prefill_chunk: self.limits.prefill_chunk,
            generation_room: self.generation_room(),
            draft: self.drafting.as_ref().map(|d| DraftView { ready: drafts_ready.unwrap_or(d.depth()), recent_acceptance: d.recent_acceptance() }),
        }
    }

    /// The tokens whose keys and values a cache of `cache_len` positions
    /// holds for this row. (After a verification that ended on a stop token
    /// the cache may hold accepted drafts past the last emitted token.)
    pub fn cached_len(&self, cache_len: usize) -> usize {
        self.tokens.len().min(cache_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(prompt: usize, max_tokens: usize) -> RequestProgress {
        RequestProgress::new(RequestId(1), (0..prompt as u32).collect(), Limits { max_tokens, ..Default::default() })
    }

    #[test]
    fn only_the_chunk_that_completes_the_prompt_samples() {
        let mut p = progress(10, 4);
        assert!(!p.samples_after(&Work::Prefill { tokens: 6 }));
        assert!(p.samples_after(&Work::Prefill { tokens: 10 }));
        p.resume_from_cache(6);
        assert_eq!(p.input(&Work::Prefill { tokens: 4 }), Some(vec![6, 7, 8, 9]));
        assert!(p.samples_after(&Work::Prefill { tokens: 4 }));
        assert!(!progress(10, 0).samples_after(&Work::Prefill { tokens: 10 }), "a prewarm never samples");
    }

    #[test]
    fn a_decode_feeds_the_pending_token_then_its_drafts() {
        let mut p = progress(3, 4);
        assert_eq!(p.input(&Work::Decode { drafts: vec![] }), None, "nothing to feed yet");
        p.pending_token = Some(42);
        assert_eq!(p.input(&Work::Decode { drafts: vec![7, 8] }), Some(vec![42, 7, 8]));
    }
}
