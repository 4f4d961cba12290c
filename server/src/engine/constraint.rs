//! Constrained decoding, as the engine sees it: a per-request matcher over
//! token ids that says which tokens may come next, follows the tokens the
//! row emits, and names the tokens it leaves no choice about. The engine
//! knows nothing of grammars or text; `crate::grammar` implements these
//! traits with llguidance.
//!
//! Each step, a constrained row's allowed set is computed on the host for
//! every position it verifies (its next token, then one after each draft),
//! and the logits outside it are set to -inf before the draw (greedy or
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

    /// An additive bias over `vocab` logits: 0 where allowed, -inf elsewhere
    /// (ids past the mask, such as a model's padding rows, are never allowed).
    pub fn write_bias(&self, vocab: usize, out: &mut Vec<f32>) {
        let end = out.len() + vocab;
        // Word by word: most words of a mask are all-allowed or all-forbidden.
        for (w, &word) in self.words.iter().enumerate().take(vocab.div_ceil(32)) {
            let n = 32.min(vocab - w * 32);
            match word {
                0 => out.extend(std::iter::repeat_n(f32::NEG_INFINITY, n)),
                u32::MAX => out.extend(std::iter::repeat_n(0.0, n)),
                _ => out.extend((0..n).map(|b| if word >> b & 1 == 1 { 0.0 } else { f32::NEG_INFINITY })),
            }
        }
        out.resize(end, f32::NEG_INFINITY);
    }
}

/// One request's matcher. Runs on the engine thread; errors end the request.
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
    fn masks_read_bits_and_write_biases() {
        let m = TokenMask { words: vec![0b101, 1 << 1] };
        assert!(m.allows(0) && !m.allows(1) && m.allows(2) && m.allows(33) && !m.allows(64));
        let mut bias = Vec::new();
        m.write_bias(40, &mut bias);
        assert_eq!(bias.len(), 40);
        let allowed: Vec<usize> = (0..40).filter(|&t| bias[t] == 0.0).collect();
        assert_eq!(allowed, [0, 2, 33]);
        // Past the mask's words, and a mask wider than the logits.
        let mut bias = vec![1.0];
        m.write_bias(70, &mut bias);
        assert_eq!(bias.len(), 71);
        assert!(bias[65..].iter().all(|b| *b == f32::NEG_INFINITY));
        let full = TokenMask { words: vec![u32::MAX; 4] };
        let mut bias = Vec::new();
        full.write_bias(40, &mut bias);
        assert_eq!(bias, vec![0.0; 40]);
        assert!(!m.is_empty() && TokenMask { words: vec![0, 0] }.is_empty());
    }
}
