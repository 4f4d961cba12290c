//! One running request inside the engine: its progress (in `tether_sched`,
//! what decisions are made from) beside what only the engine holds: its KV
//! KV (a cache of its own or a batch slot), its sampler, its draft source and its consumer.
use tether_sched::{EngineEvent, Finish, FinishInfo, RequestId, RequestProgress, RowView, StopHandle, StopReason};

use super::api::SubmitRequest;
use super::prefix::{Hit, LentHistory, Origin};
use super::speculate::{Drafter, Proposal};
use crate::models::{Kv, KvCache, RowKv, Transformer};
use crate::sample::Sampler;

pub(super) struct Row {
    pub progress: RequestProgress,
    pub request: SubmitRequest,
    pub events: tokio::sync::mpsc::Sender<EngineEvent>,
    /// Set by the edge to end the request early.
    pub stop: StopHandle,
    /// KV bytes the request can grow to (see the scheduler's reservations).
    pub kv_bytes: usize,
    /// The row's keys and values: a cache of its own, or from admission on
    /// when caches are batched, a slot of the engine's
    /// [`crate::models::KvBatch`] (freed when the row is dropped).
    pub kv: RowKv,
    pub sampler: Sampler,
    /// Held when its prefix-cache tokens' state was the session's own
    /// entry, lent whole (it left the cache): a cancelled turn gives that
    /// history back.
    pub lent: Option<LentHistory>,
    /// The prefix-cache entry its state was copied from, when it resumed
    /// from one in RAM: its stored state shares that entry's blocks.
    pub origin: Option<Origin>,
    /// Where a speculating row's drafts come from (its depth and counters
    /// are in its progress).
    pub drafter: Option<Drafter>,
}

impl AsMut<RequestProgress> for Row {
    fn as_mut(&mut self) -> &mut RequestProgress {
        &mut self.progress
    }
}

impl Row {
    pub fn new(admitted: Admitted, cache: KvCache, draft_model: Option<&Transformer>) -> mlx::Result<Row> {
        let Admitted { id, request, events, stop, kv_bytes } = admitted;
        let sampler = Sampler::new(request.sampling.clone());
        let limits = tether_sched::Limits {
            max_tokens: request.max_tokens,
            stop_ids: request.stop_ids.clone(),
            deadline: request.deadline,
            logprobs: request.logprobs,
            prefill_chunk: request.prefill_chunk,
        };
        let mut progress = RequestProgress::new(id, request.prompt.clone(), limits);
        progress.constraint = match &request.constraint {
            Some(spec) => Some(spec.start().map_err(|message| mlx::Error { op: "constraint", message })?),
            None => None,
        };
        // A row with recurrent state (a hybrid model's) drafts too: its
        // state keeps a snapshot per draft position through verification,
        // which a rejected draft rewinds to (see `models/state_rows.rs`).
        let (drafter, drafting) = Drafter::new(&request.speculation, draft_model, progress.constraint.is_some()).unzip();
        progress.drafting = drafting;
        let cache = anchored(cache, request.prompt.len());
        Ok(Row { progress, request, events, stop, kv_bytes, kv: RowKv::Own(cache), sampler, lent: None, origin: None, drafter })
    }

    pub fn id(&self) -> RequestId {
        self.progress.id
    }

    /// What the scheduler sees of this row, with `drafts_ready` drafts
    /// proposed for this step (`None`: as many as its depth).
    pub fn view(&self, drafts_ready: Option<usize>) -> RowView<'_> {
        self.progress.view(self.request.session.as_deref(), self.kv_bytes, self.can_publish(), drafts_ready)
    }

    /// Why the edge wants this row ended now, if it does: it asked, or its
    /// consumer went away (nobody to tell: cancelled).
    pub fn stop_requested(&self) -> Option<StopReason> {
        self.stop.requested().or_else(|| self.events.is_closed().then_some(StopReason::Cancel))
    }

    /// Room for this step's events (a token batch now, a final event later).
    pub fn can_publish(&self) -> bool {
        self.events.capacity() >= 2
    }

    /// Starts this row from a prefix-cache hit of `len` prompt tokens.
    pub fn resume_from(&mut self, hit: Hit) {
        let (cache, len, lent, origin) = hit.into_parts();
        self.kv = RowKv::Own(anchored(cache, self.request.prompt.len()));
        self.progress.resume_from_cache(len);
        self.lent = lent;
        self.origin = origin;
    }

    /// Hands the history a cancelled turn was lent back to its lease,
    /// which returns it to the prefix cache as it was before the turn (what
    /// the turn computed is freed, as for any cancelled turn). Nothing when
    /// nothing was lent. (Only a row with a cache of its own is lent one.)
    pub fn give_back_lent_history(self) {
        if let (Some(lease), RowKv::Own(cache)) = (self.lent, self.kv) {
            lease.give_back(self.progress.tokens, cache);
        }
    }

    /// The tokens whose keys and values its own cache holds, with the
    /// cache and the entry it resumed from; `None` for a row whose KV is
    /// still a batch slot (see the engine's `take_row`).
    pub fn into_cached_state(self) -> Option<(Vec<u32>, KvCache, Option<Origin>)> {
        let len = self.progress.cached_len(self.kv.offset());
        let RowKv::Own(mut cache) = self.kv else { return None };
        let mut tokens = self.progress.tokens;
        tokens.truncate(len);
        cache.truncate(len);
        Some((tokens, cache, self.origin))
    }

    /// This decode step's drafts: as many as the source offers within the
    /// row's adaptive depth and its `max_tokens` room (a verification emits
    /// up to drafts + 1 tokens). The scheduler then caps them. A constrained
    /// row's drafts are its grammar's forced tokens when there are any (its
    /// matcher has consumed the pending token already: see `apply`).
    pub fn drafts(&mut self) -> Proposal {
        let p = &mut self.progress;
        let room = p.generation_room();
        let grammar_drafts = self.request.speculation.grammar_drafts;
        if let Some(c) = p.constraint.as_mut().filter(|_| grammar_drafts) {
            let forced = c.forced();
            if !forced.is_empty() {
                let max = p.drafting.as_ref().map_or(0, |d| d.max_draft()).min(room);
                return Proposal::Ready(forced.into_iter().take(max).collect());
            }
        }
        match (&mut self.drafter, &p.drafting) {
            (Some(drafter), Some(drafting)) => drafter.propose(drafting.depth(), &p.tokens, p.generated, room),
            _ => Proposal::Ready(Vec::new()),
        }
    }

    pub fn final_event(&self, reason: Finish) -> EngineEvent {
        let p = &self.progress;
        EngineEvent::Finished(FinishInfo {
            reason,
            prompt_tokens: p.prompt().len(),
            cached_tokens: p.cached_tokens,
            completion_tokens: p.generated,
            speculative: p.drafting.as_ref().map(|d| d.stats.clone()),
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

/// `cache` keeping, of a hybrid model's state checkpoints, the one where
/// this turn's prompt of `prompt_len` tokens ends (see `state_rows.rs`):
/// the next turn's prompt may diverge right after it.
fn anchored(mut cache: KvCache, prompt_len: usize) -> KvCache {
    if let Some(state) = cache.recurrent_mut() {
        state.set_anchor(prompt_len);
    }
    cache
}
