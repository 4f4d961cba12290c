//! A grammar that holds only part of the output: the output is free until
//! the model writes a trigger token (a tool call's opener), the grammar
//! holds it from there until the grammar is complete (the call's closing
//! tag), and the output is free again, for text or the next trigger. This
//! is how `tool_choice: "auto"` lets the model decide whether to call a
//! tool while every call it starts matches the tools' schemas.
use tether_sched::constraint::{Constraint, ConstraintSpec, TokenConstraint, TokenMask};

#[derive(Clone, Debug)]
pub struct Triggered {
    pub trigger: u32,
    /// The grammar of what follows the trigger.
    pub inner: Constraint,
    /// Logits per position (the width of a mask).
    pub vocab: usize,
}

impl ConstraintSpec for Triggered {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        Ok(Box::new(TriggeredMatcher { spec: self.clone(), tokens: Vec::new(), open_after: Vec::new(), call: None }))
    }
}

/// The grammar's matcher for the span it holds.
struct Span {
    /// Index in `tokens` of the span's first token (the one after the trigger).
    start: usize,
    matcher: Box<dyn TokenConstraint>,
    /// Tokens the matcher has consumed.
    len: usize,
}

struct TriggeredMatcher {
    spec: Triggered,
    /// Every token consumed.
    tokens: Vec<u32>,
    /// After each consumed token: the start of the span open then, if any
    /// (how a rollback knows where it lands).
    open_after: Vec<Option<usize>>,
    call: Option<Span>,
}

impl TriggeredMatcher {
    fn open_span(&self, start: usize) -> Result<Span, String> {
        let mut span = Span { start, matcher: self.spec.inner.start()?, len: 0 };
        for &t in &self.tokens[start..] {
            span.matcher.consume(&[t])?;
            span.len += 1;
        }
        Ok(span)
    }
}

impl TokenConstraint for TriggeredMatcher {
    fn allowed(&mut self) -> Result<TokenMask, String> {
        match &mut self.call {
            Some(span) => span.matcher.allowed(),
            None => Ok(TokenMask { words: vec![u32::MAX; self.spec.vocab.div_ceil(32)] }),
        }
    }

    fn accepts(&mut self, token: u32) -> Result<bool, String> {
        match &mut self.call {
            Some(span) => span.matcher.accepts(token),
            None => Ok((token as usize) < self.spec.vocab),
        }
    }

    fn consume(&mut self, tokens: &[u32]) -> Result<(), String> {
        for &t in tokens {
            self.tokens.push(t);
            if let Some(span) = &mut self.call {
                span.matcher.consume(&[t])?;
                span.len += 1;
                if span.matcher.is_finished() {
                    self.call = None;
                }
            } else if t == self.spec.trigger {
                let span = self.open_span(self.tokens.len())?;
                self.call = Some(span);
            }
            self.open_after.push(self.call.as_ref().map(|s| s.start));
        }
        Ok(())
    }

    fn rollback(&mut self, n: usize) -> Result<(), String> {
        let keep = self.tokens.len().checked_sub(n).ok_or("rollback past the start")?;
        self.tokens.truncate(keep);
        self.open_after.truncate(keep);
        let open = self.open_after.last().copied().flatten();
        self.call = match (open, self.call.take()) {
            (None, _) => None,
            // Still inside the span that is open: the matcher rolls back.
            (Some(start), Some(mut span)) if span.start == start => {
                let extra = span.len - (keep - start);
                span.matcher.rollback(extra)?;
                span.len -= extra;
                Some(span)
            }
            // Back inside a span that had closed: read it again.
            (Some(start), _) => Some(self.open_span(start)?),
        };
        Ok(())
    }

    fn forced(&mut self) -> Vec<u32> {
        self.call.as_mut().map(|s| s.matcher.forced()).unwrap_or_default()
    }

    fn is_finished(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use tether_sched::constraint::testing::Exactly;

    fn matcher() -> Box<dyn TokenConstraint> {
        Triggered { trigger: 9, inner: Arc::new(Exactly(vec![4, 5, 6])), vocab: 32 }.start().unwrap()
    }

    fn free(m: &mut Box<dyn TokenConstraint>) -> bool {
        m.allowed().unwrap().words == [u32::MAX]
    }

    #[test]
    fn free_until_the_trigger_held_until_the_span_ends() {
        let mut m = matcher();
        assert!(free(&mut m) && m.forced().is_empty());
        m.consume(&[1, 2, 9]).unwrap();
        assert!(!free(&mut m));
        assert_eq!(m.forced(), [4, 5, 6]);
        assert!(m.consume(&[7]).is_err());
        let mut m = matcher();
        m.consume(&[1, 9, 4, 5, 6]).unwrap();
        assert!(free(&mut m) && !m.is_finished());
        // A second span.
        m.consume(&[3, 9, 4]).unwrap();
        assert_eq!(m.forced(), [5, 6]);
    }

    #[test]
    fn rollback_lands_in_free_text_an_open_span_or_a_closed_one() {
        let mut m = matcher();
        m.consume(&[1, 9, 4, 5]).unwrap();
        m.rollback(1).unwrap();
        assert_eq!(m.forced(), [5, 6]);
        m.rollback(2).unwrap();
        assert!(free(&mut m));
        m.consume(&[9, 4, 5, 6, 2, 2]).unwrap();
        assert!(free(&mut m));
        // Back into the closed span: it is read again.
        m.rollback(3).unwrap();
        assert_eq!(m.forced(), [6]);
        m.consume(&[6]).unwrap();
        assert!(free(&mut m));
        assert!(m.rollback(99).is_err());
    }

    #[test]
    fn valid_prefix_walks_free_text_and_spans_and_moves_nothing() {
        let mut m = matcher();
        m.consume(&[1]).unwrap();
        assert_eq!(m.valid_prefix(&[2, 9, 4, 5, 7, 8]).unwrap(), 4, "the span allows 4, 5, 6 only");
        assert_eq!(m.valid_prefix(&[9, 4, 5, 6, 3, 40]).unwrap(), 5, "free again after the span; 40 is past the vocabulary");
        assert!(free(&mut m) && m.forced().is_empty(), "the matcher is where it was");
        m.consume(&[9]).unwrap();
        assert_eq!(m.valid_prefix(&[5]).unwrap(), 0);
        assert_eq!(m.forced(), [4, 5, 6]);
    }
}
