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

pub use tether_sched::{accept_matching, SpecStats};
use tether_sched::{Drafting, Verified, START_DEPTH};

use crate::models::{KvCache, Transformer};

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

/// Where one row's drafts come from; its depth and counters are its
/// progress's [`Drafting`].
pub struct Drafter(Source);

impl Drafter {
    /// `None` when the request does not speculate (or asks for a draft
    /// model the engine does not have) and is not `constrained`: a
    /// constrained row always has a drafter, for its grammar's forced tokens
    /// (see `Row::drafts`), with no guesses of its own when speculation is off.
    pub fn new(spec: &Speculation, draft_model: Option<&Transformer>, constrained: bool) -> Option<(Drafter, Drafting)> {
        let constrained = constrained && spec.grammar_drafts;
        let max_draft = spec.max_draft.max(1);
        // Guesses start shallow and earn depth; forced tokens are certain.
        let (source, depth) = match &spec.kind {
            DraftKind::Off if constrained => (Source::Host(Box::new(NoGuesses)), 0),
            DraftKind::Off => return None,
            DraftKind::Echo => (Source::Host(Box::new(PromptLookup::default())), START_DEPTH),
            DraftKind::Forced(tokens) => (Source::Host(Box::new(ForcedDrafts::new(tokens.clone()))), max_draft),
            DraftKind::Model => match draft_model {
                Some(model) => (Source::Model(model.new_cache()), START_DEPTH),
                None if constrained => (Source::Host(Box::new(NoGuesses)), 0),
                None => return None,
            },
        };
        Some((Drafter(source), Drafting::new(max_draft, depth)))
    }

    /// This step's drafts: at most the row's adaptive `depth` and `room`.
    pub fn propose(&mut self, depth: usize, history: &[u32], generated: usize, room: usize) -> Proposal {
        let max = depth.min(room);
        match &mut self.0 {
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
        match &mut self.0 {
            Source::Model(cache) => Some(cache),
            Source::Host(_) => None,
        }
    }

    /// After a verification: rolls the draft model's cache back past the
    /// rejected drafts.
    pub fn verified(&mut self, v: Verified) {
        if let (Source::Model(cache), true) = (&mut self.0, v.drafted > 0) {
            cache.truncate(draft_cache_keep(v.history_len, v.drafted, v.accepted));
        }
    }
}
