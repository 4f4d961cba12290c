//! Prompt lookup ("echo") drafts: when the text being written repeats text
//! seen earlier (a code edit reproducing most of a file, a FIM middle that
//! mirrors its suffix, a quoted passage), the tokens that followed the
//! earlier occurrence are a good guess for what follows now.
use super::DraftSource;

/// Finds the earlier position whose preceding tokens match the end of the
/// history for longest (at least `min_match` tokens, ties going to the most
/// recent) and proposes the tokens that followed it.
pub struct PromptLookup {
    pub min_match: usize,
    /// Matches longer than this rank equal: enough evidence, less scanning.
    pub max_match: usize,
}

impl Default for PromptLookup {
    fn default() -> Self {
        PromptLookup { min_match: 2, max_match: 16 }
    }
}

impl DraftSource for PromptLookup {
    fn propose(&mut self, history: &[u32], _generated: usize, max: usize) -> Vec<u32> {
        let n = history.len();
        if n < self.min_match + 1 || max == 0 {
            return Vec::new();
        }
        let last = history[n - 1];
        let mut best: Option<(usize, usize)> = None; // (match length, end of match)
                                                     // Candidates end at j < n - 1 with a continuation after them; newest first.
        for j in (0..n - 1).rev() {
            if history[j] != last {
                continue;
            }
            let len = (0..=j.min(self.max_match - 1)).take_while(|&i| history[j - i] == history[n - 1 - i]).count();
            if len >= self.min_match && best.is_none_or(|(b, _)| len > b) {
                best = Some((len, j));
                if len >= self.max_match {
                    break;
                }
            }
        }
        match best {
            Some((_, j)) => history[j + 1..(j + 1 + max).min(n)].to_vec(),
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(history: &[u32], max: usize) -> Vec<u32> {
        PromptLookup::default().propose(history, 0, max)
    }

    #[test]
    fn copies_what_followed_the_match() {
        // "1 2 3 4 5 ... 1 2" -> "3 4 5"
        assert_eq!(propose(&[1, 2, 3, 4, 5, 9, 1, 2], 3), vec![3, 4, 5]);
    }

    #[test]
    fn prefers_the_longest_match_then_the_newest() {
        // "7 1 2" matches the first occurrence for 3 tokens, the second for 2.
        let h = [7, 1, 2, 30, 31, 8, 1, 2, 40, 41, 7, 1, 2];
        assert_eq!(propose(&h, 2), vec![30, 31]);
        // Equal lengths: the newest wins.
        let h = [1, 2, 30, 1, 2, 40, 1, 2];
        assert_eq!(propose(&h, 1), vec![40]);
    }

    #[test]
    fn needs_a_real_match() {
        assert!(propose(&[1, 2, 3, 4], 4).is_empty());
        // A single shared token is not enough evidence.
        assert!(propose(&[5, 1, 9, 6, 1], 4).is_empty());
        assert!(propose(&[], 4).is_empty());
    }

    #[test]
    fn continuation_stops_at_the_history_end() {
        // The match's continuation runs into the tail itself.
        assert_eq!(propose(&[3, 3, 3, 3], 8), vec![3]);
    }
}
