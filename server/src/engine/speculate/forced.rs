//! Forced drafts: tokens known before the model is asked, such as the
//! tokens a grammar leaves no choice about. This is the hook a constrained
//! decoder plugs into; verification still runs, so a wrong guess costs a
//! rollback, never a wrong output.
use super::DraftSource;

pub struct ForcedDrafts {
    /// Entry `i` is the guess for generated token `i`.
    tokens: Vec<u32>,
}

impl ForcedDrafts {
    pub fn new(tokens: Vec<u32>) -> ForcedDrafts {
        ForcedDrafts { tokens }
    }
}

impl DraftSource for ForcedDrafts {
    fn propose(&mut self, _history: &[u32], generated: usize, max: usize) -> Vec<u32> {
        let start = generated.min(self.tokens.len());
        self.tokens[start..(start + max).min(self.tokens.len())].to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_from_the_next_generated_position() {
        let mut f = ForcedDrafts::new(vec![10, 11, 12, 13]);
        assert_eq!(f.propose(&[], 1, 2), vec![11, 12]);
        assert_eq!(f.propose(&[], 3, 5), vec![13]);
        assert!(f.propose(&[], 4, 5).is_empty());
    }
}
