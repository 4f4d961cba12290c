//! A speculating row's bookkeeping: how deep it drafts, how often its
//! drafts are accepted, and its counters. Where the drafts come from (a
//! prompt lookup, a grammar, a draft model) is the engine's business; this
//! is what verification teaches, whatever the source.
//!
//! Verification is exact and simple because every draft source is a point
//! mass: a draft is accepted when it equals the target's own token at its
//! position (the argmax for greedy rows, the position-keyed draw for sampled
//! ones), so the tokens are exactly those of the same seed without drafts.
use crate::request::TokenId;

/// Weight of the past in a row's decayed acceptance, per verification.
const ACCEPTANCE_DECAY: f64 = 0.7;

/// Drafts a row that guesses starts with: guesses earn their depth.
pub const START_DEPTH: usize = 4;

/// A row's adaptive draft depth and its speculation statistics.
#[derive(Clone, Debug)]
pub struct Drafting {
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

impl Drafting {
    /// `depth` drafts at first (at most `max_draft`, itself at least 1).
    pub fn new(max_draft: usize, depth: usize) -> Drafting {
        let max_draft = max_draft.max(1);
        Drafting { max_draft, depth: depth.min(max_draft), recent_acceptance: None, stats: SpecStats::default() }
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

    /// Records a verification of `drafted` drafts of which the first
    /// `accepted` held, producing `emitted` tokens, and adapts the depth.
    pub fn record(&mut self, drafted: usize, accepted: usize, emitted: usize) {
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
/// (the pending token, then each draft). Draft `i` is judged by
/// `targets[i]`; the tokens to emit are `targets[..=accepted]`.
pub fn accept_matching(drafts: &[TokenId], targets: &[TokenId]) -> usize {
    drafts.iter().zip(targets).take_while(|(d, t)| d == t).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::DraftView;

    #[test]
    fn acceptance_stops_at_first_mismatch() {
        assert_eq!(accept_matching(&[5, 6, 7], &[5, 6, 9, 1]), 2);
        assert_eq!(accept_matching(&[5, 6, 7], &[5, 6, 7, 1]), 3);
        assert_eq!(accept_matching(&[5], &[4, 1]), 0);
        assert_eq!(accept_matching(&[], &[4]), 0);
    }

    #[test]
    fn depth_adapts() {
        let mut s = Drafting::new(8, START_DEPTH);
        assert_eq!(s.depth(), 4);
        s.record(4, 4, 5);
        assert_eq!(s.depth(), 6);
        s.record(6, 6, 7);
        s.record(8, 8, 9);
        assert_eq!(s.depth(), 8, "capped at max_draft");
        s.record(8, 2, 3);
        assert_eq!(s.depth(), 3);
        s.record(3, 0, 1);
        assert_eq!(s.depth(), 1);
        assert_eq!(s.stats.drafted, 29);
        assert_eq!(s.stats.accepted, 20);
        assert_eq!(s.stats.acceptance_by_position()[0], 4.0 / 5.0);
        assert_eq!(s.stats.decode_tokens, 25);
        assert!((s.stats.tokens_per_forward() - 5.0).abs() < 1e-6);
    }

    #[test]
    fn drafts_pay_while_accepted_more_often_than_the_bar() {
        let pays = |s: &Drafting, bar| DraftView { ready: s.depth(), recent_acceptance: s.recent_acceptance() }.pays(bar);
        let mut s = Drafting::new(8, START_DEPTH);
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
