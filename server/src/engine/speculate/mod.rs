//! Speculative decode rows: draft tokens ride along with a running row's
//! decode token and are verified in the same batched forward as every other
//! row of the step.
//!
//! A row with pending token `t` and drafts `d1..dk` feeds `[t, d1..dk]` and
//! asks for `k + 1` logits. Position `i`'s logits judge draft `d(i+1)`; the
//! first rejected draft ends the run, and the target's own token at that
//! position replaces it, so every verification emits `accepted + 1` tokens.
//! The KV cache then rolls back exactly the rejected drafts (it only moves
//! its length back: a zero-draft step has nothing to roll back).
//!
//! All draft sources here are deterministic (a point-mass proposal), which
//! makes the acceptance rule simple and exact: a draft is accepted when it
//! equals the target's own token at its position, the argmax for greedy rows
//! and, for sampled rows, the Gumbel-max draw with that position's key
//! (`crate::sample::Sampler::draw`). A draft is then kept with probability
//! p(d) and a rejected position emits a draw from p other than d (standard
//! speculative sampling with q = δ_d), and the tokens are exactly those of
//! the same seed without drafts.
mod draft_model;
mod forced;
mod lookup;

pub use draft_model::{draft_cache_keep, DraftModel, DraftModelSpec, DraftRow};
pub use forced::ForcedDrafts;
pub use lookup::PromptLookup;

use crate::model::{KvCache, Transformer};

/// Where a request's draft tokens come from.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum DraftKind {
    /// No speculation.
    #[default]
    Off,
    /// Prompt lookup ("echo"): continuations copied from earlier in the
    /// prompt (FIM suffix and context files included) and the output so far.
    Echo,
    /// Tokens known in advance: a grammar's forced tokens, or a test's.
    /// Entry `i` is proposed as generated token `i`.
    Forced(Vec<u32>),
    /// The engine's draft model (see [`DraftModel`]); no drafts when the
    /// engine has none.
    Model,
}

impl DraftKind {
    pub fn name(&self) -> &'static str {
        match self {
            DraftKind::Off => "off",
            DraftKind::Echo => "echo",
            DraftKind::Forced(_) => "forced",
            DraftKind::Model => "draft_model",
        }
    }
}

/// A request's speculation settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Speculation {
    pub kind: DraftKind,
    /// Most draft tokens per verification.
    pub max_draft: usize,
    /// Whether a constrained request verifies its grammar's forced tokens
    /// as drafts (whatever `kind` says); off only when the request asked
    /// for no speculation at all.
    pub grammar_drafts: bool,
}

impl Default for Speculation {
    fn default() -> Self {
        Speculation { kind: DraftKind::Off, max_draft: DEFAULT_MAX_DRAFT, grammar_drafts: true }
    }
}

pub const DEFAULT_MAX_DRAFT: usize = 12;

/// Proposes tokens likely to follow a row's history. Implementations are
/// cheap host-side code run on the engine thread while it plans a step.
pub trait DraftSource: Send {
    /// Up to `max` tokens after `history` (prompt, generated tokens and the
    /// pending token, in order); `generated` of them are model output.
    fn propose(&mut self, history: &[u32], generated: usize, max: usize) -> Vec<u32>;
}

/// The draft source of a row whose only drafts are its grammar's.
struct NoGuesses;

impl DraftSource for NoGuesses {
    fn propose(&mut self, _history: &[u32], _generated: usize, _max: usize) -> Vec<u32> {
        Vec::new()
    }
}

/// Where one row's drafts come from.
enum Source {
    /// Proposed on the host while the step is planned.
    Host(Box<dyn DraftSource>),
    /// Proposed by the engine's draft model in a batched round before the
    /// verification forward; the row's KV cache in that model.
    Model(KvCache),
}

/// A row's drafts for one step.
pub enum Proposal {
    Ready(Vec<u32>),
    /// This many tokens, from the draft model.
    FromModel(usize),
}

impl Proposal {
    /// How many drafts it holds (or the draft model will make).
    pub fn count(&self) -> usize {
        match self {
            Proposal::Ready(d) => d.len(),
            Proposal::FromModel(n) => *n,
        }
    }

    /// The first `max` of them.
    pub fn truncated(self, max: usize) -> Proposal {
        match self {
            Proposal::Ready(mut d) => {
                d.truncate(max);
                Proposal::Ready(d)
            }
            Proposal::FromModel(n) => Proposal::FromModel(n.min(max)),
        }
    }
}

/// Weight of the past in a row's decayed acceptance, per verification.
const ACCEPTANCE_DECAY: f64 = 0.7;

/// A row's speculation: its draft source, adaptive depth and statistics.
pub struct DraftState {
    source: Source,
    max_draft: usize,
    /// Drafts to ask for next time: grows while drafts are accepted whole,
    /// shrinks to just past the last accepted position otherwise, so rows
    /// whose text does not repeat stop paying for long drafts.
    depth: usize,
    /// Share of drafted tokens accepted, decayed over verifications: what
    /// a draft of this row is worth (see the scheduler's `DraftView::pays`).
    recent_acceptance: Option<f64>,
    pub stats: SpecStats,
}

/// Per-request speculation counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Draft tokens verified.
    pub drafted: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
    /// Per draft position: how often a draft was offered there, and accepted.
    pub offered_at: Vec<u64>,
    pub accepted_at: Vec<u64>,
    /// Decode forwards this row took part in (with or without drafts).
    pub decode_forwards: u64,
    /// Tokens those forwards produced.
    pub decode_tokens: u64,
}

impl SpecStats {
    /// Acceptance rate at each draft position.
    pub fn acceptance_by_position(&self) -> Vec<f32> {
        self.offered_at.iter().zip(&self.accepted_at).map(|(&o, &a)| if o == 0 { 0.0 } else { a as f32 / o as f32 }).collect()
    }

    /// Tokens produced per target forward of this row's decode.
    pub fn tokens_per_forward(&self) -> f32 {
        if self.decode_forwards == 0 {
            0.0
        } else {
            self.decode_tokens as f32 / self.decode_forwards as f32
        }
    }
}

const START_DEPTH: usize = 4;

impl DraftState {
    /// `None` when the request does not speculate (or asks for a draft
    /// model the engine does not have) and is not `constrained`: a
    /// constrained row always has a state, for its grammar's forced tokens
    /// (see `Row::drafts`), with no guesses of its own when speculation is off.
    pub fn new(spec: &Speculation, draft_model: Option<&Transformer>, constrained: bool) -> Option<DraftState> {
        let constrained = constrained && spec.grammar_drafts;
        let max_draft = spec.max_draft.max(1);
        // Guesses start shallow and earn depth; forced tokens are certain.
        let (source, depth) = match &spec.kind {
            DraftKind::Off if constrained => (Source::Host(Box::new(NoGuesses)), 0),
            DraftKind::Off => return None,
            DraftKind::Echo => (Source::Host(Box::new(PromptLookup::default())), START_DEPTH.min(max_draft)),
            DraftKind::Forced(tokens) => (Source::Host(Box::new(ForcedDrafts::new(tokens.clone()))), max_draft),
            DraftKind::Model => match draft_model {
                Some(model) => (Source::Model(model.new_cache()), START_DEPTH.min(max_draft)),
                None if constrained => (Source::Host(Box::new(NoGuesses)), 0),
                None => return None,
            },
        };
        Some(DraftState { source, max_draft, depth, recent_acceptance: None, stats: SpecStats::default() })
    }

    /// Drafts it would verify now (its adaptive depth).
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The most drafts one verification may carry.
    pub fn max_draft(&self) -> usize {
        self.max_draft
    }

    /// Share of its drafted tokens accepted, decayed; `None` before it drafted.
    pub fn recent_acceptance(&self) -> Option<f64> {
        self.recent_acceptance
    }

    /// This step's drafts, at most `room` of them.
    pub fn propose(&mut self, history: &[u32], generated: usize, room: usize) -> Proposal {
        let max = self.depth.min(room);
        match &mut self.source {
            _ if max == 0 => Proposal::Ready(Vec::new()),
            Source::Host(source) => {
                let mut drafts = source.propose(history, generated, max);
                drafts.truncate(max);
                Proposal::Ready(drafts)
            }
            Source::Model(_) => Proposal::FromModel(max),
        }
    }

    /// The row's KV cache in the draft model, if it drafts with one.
    pub fn model_cache(&mut self) -> Option<&mut KvCache> {
        match &mut self.source {
            Source::Model(cache) => Some(cache),
            Source::Host(_) => None,
        }
    }

    /// After a verification of `drafted` drafts proposed after a history of
    /// `history_len` tokens, of which `accepted` held and `emitted` tokens
    /// came out: rolls the draft model's cache back, records, adapts depth.
    pub fn verified(&mut self, history_len: usize, drafted: usize, accepted: usize, emitted: usize) {
        if let (Source::Model(cache), true) = (&mut self.source, drafted > 0) {
            cache.truncate(draft_cache_keep(history_len, drafted, accepted));
        }
        self.record(drafted, accepted, emitted);
    }

    /// Records a verification of `drafted` drafts of which the first
    /// `accepted` held, producing `emitted` tokens, and adapts the depth.
    fn record(&mut self, drafted: usize, accepted: usize, emitted: usize) {
        let s = &mut self.stats;
        s.decode_forwards += 1;
        s.decode_tokens += emitted as u64;
        if drafted == 0 {
            return;
        }
        s.drafted += drafted as u64;
        s.accepted += accepted as u64;
        let rate = accepted as f64 / drafted as f64;
        self.recent_acceptance = Some(self.recent_acceptance.map_or(rate, |r| ACCEPTANCE_DECAY * r + (1.0 - ACCEPTANCE_DECAY) * rate));
        if s.offered_at.len() < drafted {
            s.offered_at.resize(drafted, 0);
            s.accepted_at.resize(drafted, 0);
        }
        for i in 0..drafted {
            s.offered_at[i] += 1;
            if i < accepted {
                s.accepted_at[i] += 1;
            }
        }
        self.depth = if accepted == drafted { (self.depth + 2).min(self.max_draft) } else { (accepted + 1).clamp(1, self.max_draft) };
    }
}

/// Verification: how many leading drafts equal the target's own draws.
/// `targets[i]` is the target's token after the row's input position `i`
/// (the pending token, then each draft): the argmax for greedy rows, the
/// position-keyed draw for sampled ones ([`crate::sample::Sampler::draw`]).
/// Draft `i` is judged by `targets[i]`; the tokens to emit are
/// `targets[..=accepted]`.
pub fn accept_matching(drafts: &[u32], targets: &[u32]) -> usize {
    drafts.iter().zip(targets).take_while(|(d, t)| d == t).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acceptance_stops_at_first_mismatch() {
        assert_eq!(accept_matching(&[5, 6, 7], &[5, 6, 9, 1]), 2);
        assert_eq!(accept_matching(&[5, 6, 7], &[5, 6, 7, 1]), 3);
        assert_eq!(accept_matching(&[5], &[4, 1]), 0);
        assert_eq!(accept_matching(&[], &[4]), 0);
    }

    #[test]
    fn depth_adapts() {
        let mut s = DraftState::new(&Speculation { kind: DraftKind::Echo, max_draft: 8, ..Default::default() }, None, false).unwrap();
        assert_eq!(s.depth, 4);
        s.record(4, 4, 5);
        assert_eq!(s.depth, 6);
        s.record(6, 6, 7);
        s.record(8, 8, 9);
        assert_eq!(s.depth, 8, "capped at max_draft");
        s.record(8, 2, 3);
        assert_eq!(s.depth, 3);
        s.record(3, 0, 1);
        assert_eq!(s.depth, 1);
        assert_eq!(s.stats.drafted, 29);
        assert_eq!(s.stats.accepted, 20);
        assert_eq!(s.stats.acceptance_by_position()[0], 4.0 / 5.0);
        assert_eq!(s.stats.decode_tokens, 25);
        assert!((s.stats.tokens_per_forward() - 5.0).abs() < 1e-6);
    }

    #[test]
    fn drafts_pay_while_accepted_more_often_than_the_bar() {
        let pays = |s: &DraftState, bar| crate::engine::scheduler::DraftView { ready: s.depth(), recent_acceptance: s.recent_acceptance() }.pays(bar);
        let mut s = DraftState::new(&Speculation { kind: DraftKind::Echo, max_draft: 8, ..Default::default() }, None, false).unwrap();
        assert!(pays(&s, Some(0.9)), "a row that has not drafted yet may");
        s.record(4, 1, 2); // a quarter accepted
        assert!(pays(&s, Some(0.1)) && !pays(&s, Some(0.5)) && pays(&s, None));
        for _ in 0..6 {
            s.record(4, 4, 5); // then all of them, for a while
        }
        assert!(pays(&s, Some(0.9)), "acceptance is weighted toward recent verifications");
        s.record(0, 0, 1); // a decode without drafts changes nothing
        assert!(pays(&s, Some(0.9)));
    }
}
