//! Constrained decoding, as the engine sees it: a per-request matcher over
//! token ids that says which tokens may come next, follows the tokens the
//! row emits, and names the tokens it leaves no choice about. The engine
//! knows nothing of grammars or text; `crate::grammar` implements these
//! traits with llguidance.
//!
//! Each step, a constrained row's allowed set is computed on the host for
//! every position it verifies (its next token, then one after each draft),
//! and the logits outside it are set to -inf on the device before the draw (greedy or
//! sampled alike). Drafts are checked against the matcher while the masks
//! are made: a draft the grammar forbids ends the row's drafts there. The
//! matcher itself only ever advances by emitted tokens, so rejected drafts
//! leave nothing to undo.
use std::fmt::Debug;
use std::sync::Arc;

/// Tokens allowed at one position: bit `t % 32` of word `t / 32` is token `t`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenMask {
    pub words: Vec<u32>,
}

impl TokenMask {
    pub fn allows(&self, token: u32) -> bool {
        self.words.get(token as usize / 32).is_some_and(|w| w >> (token % 32) & 1 == 1)
    }

    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }
}

/// One request's matcher. Used by one engine thread at a time (a step makes
/// its rows' masks on several); errors end the request.
pub trait TokenConstraint: Send {
    /// Tokens allowed after the tokens consumed so far. When the grammar is
    /// complete this holds only end-of-sequence tokens.
    fn allowed(&mut self) -> Result<TokenMask, String>;
    /// Advances past `tokens`, which must be allowed one after another.
    fn consume(&mut self, tokens: &[u32]) -> Result<(), String>;
    /// Undoes the last `n` consumed tokens.
    fn rollback(&mut self, n: usize) -> Result<(), String>;
    /// Tokens the grammar forces next, whatever the model would say (a JSON
    /// key, a closing brace); often none.
    fn forced(&mut self) -> Vec<u32>;
    /// Whether the grammar is complete and allows nothing more.
    fn is_finished(&self) -> bool;
}

/// A compiled constraint that starts a fresh matcher for each request that
/// uses it. Cheap to clone; built by the edge, which reports grammar errors
/// before the request reaches the engine.
pub trait ConstraintSpec: Send + Sync + Debug {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String>;
}

pub type Constraint = Arc<dyn ConstraintSpec>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_read_bits() {
        let m = TokenMask { words: vec![0b101, 1 << 1] };
        assert!(m.allows(0) && !m.allows(1) && m.allows(2) && m.allows(33) && !m.allows(64));
        assert!(!m.is_empty() && TokenMask { words: vec![0, 0] }.is_empty());
    }
}
