//! Constrained decoding, as the scheduler and the engine see it: a
//! per-request matcher over token ids that says which tokens may come next,
//! follows the tokens the row emits, and names the tokens it leaves no
//! choice about. The engine
//! knows nothing of grammars or text; the server's `grammar` module
//! implements these traits with llguidance.
//!
//! Each step, a constrained row's drafts are first checked against its
//! matcher (a draft the grammar forbids ends the row's drafts there: it could
//! never be accepted), then the forward starts, and while it runs the row's
//! allowed set is computed on the host for every position it verifies (its
//! next token, then one after each draft); the logits outside it are set to
//! -inf before the draw (greedy or sampled alike). The matcher itself only
//! ever advances by emitted tokens, so rejected drafts leave nothing to undo.
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
    /// Whether `token` may come next: what `allowed` says of one token,
    /// without computing the whole set.
    fn accepts(&mut self, token: u32) -> Result<bool, String>;
    /// Advances past `tokens`, which must be allowed one after another.
    fn consume(&mut self, tokens: &[u32]) -> Result<(), String>;
    /// Undoes the last `n` consumed tokens.
    fn rollback(&mut self, n: usize) -> Result<(), String>;
    /// Tokens the grammar forces next, whatever the model would say (a JSON
    /// key, a closing brace); often none.
    fn forced(&mut self) -> Vec<u32>;
    /// Whether the grammar is complete and allows nothing more.
    fn is_finished(&self) -> bool;

    /// How many of `tokens` the grammar allows one after another (stopping
    /// where it completes); the matcher is left where it was.
    fn valid_prefix(&mut self, tokens: &[u32]) -> Result<usize, String> {
        let mut walked = 0;
        while walked < tokens.len() && !self.is_finished() && self.accepts(tokens[walked])? {
            self.consume(&tokens[walked..walked + 1])?;
            walked += 1;
        }
        self.rollback(walked)?;
        Ok(walked)
    }
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

/// A constraint for unit tests: one fixed token sequence, masks of 32 ids.
#[cfg(any(test, feature = "testing"))]
pub mod testing {
    use super::*;

    /// A grammar of one fixed token sequence.
    #[derive(Debug)]
    pub struct Exactly(pub Vec<u32>);

    pub struct ExactlyMatcher(Vec<u32>, usize);

    impl ConstraintSpec for Exactly {
        fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
            Ok(Box::new(ExactlyMatcher(self.0.clone(), 0)))
        }
    }

    impl TokenConstraint for ExactlyMatcher {
        fn allowed(&mut self) -> Result<TokenMask, String> {
            let mut words = vec![0u32; 1];
            if let Some(&t) = self.0.get(self.1) {
                words[0] |= 1 << t;
            }
            Ok(TokenMask { words })
        }
        fn accepts(&mut self, token: u32) -> Result<bool, String> {
            Ok(self.0.get(self.1) == Some(&token))
        }
        fn consume(&mut self, tokens: &[u32]) -> Result<(), String> {
            for &t in tokens {
                if self.0.get(self.1) != Some(&t) {
                    return Err(format!("token {t} not allowed"));
                }
                self.1 += 1;
            }
            Ok(())
        }
        fn rollback(&mut self, n: usize) -> Result<(), String> {
            self.1 = self.1.checked_sub(n).ok_or("too far")?;
            Ok(())
        }
        fn forced(&mut self) -> Vec<u32> {
            self.0[self.1..].to_vec()
        }
        fn is_finished(&self) -> bool {
            self.1 == self.0.len()
        }
    }
}
