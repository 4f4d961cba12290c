//! Stop sequences over streamed text: text is released only once it cannot
//! be the beginning of a stop string, so a client never sees part of one.

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    /// The stop string that matched, once one has.
    matched: Option<String>,
}

/// What a piece of new text produced.
#[derive(Debug, PartialEq, Eq)]
pub enum StopScan {
    /// Text safe to emit; generation goes on.
    Continue(String),
    /// A stop string matched: emit this text (before the stop) and finish.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new(), matched: None }
    }

    pub fn push(&mut self, text: &str) -> StopScan {
        self.held.push_str(text);
        // The earliest match wins; at one position, the longer stop string.
        if let Some((pos, stop)) = self.stops.iter().filter_map(|s| Some((self.held.find(s.as_str())?, s))).min_by_key(|&(pos, s)| (pos, usize::MAX - s.len()))
        {
            let out = self.held[..pos].to_string();
            self.matched = Some(stop.clone());
            self.held.clear();
            return StopScan::Stopped(out);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).rev().filter(move |&n| s.is_char_boundary(n)).map(move |n| &s[..n]))
            .filter(|prefix| self.held.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopScan::Continue(out)
    }

    /// The stop string that ended the text (Anthropic's `stop_sequence`).
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Releases held text at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_across_pieces_and_holds_prefixes() {
        let mut m = StopMatcher::new(vec!["\n\n".into(), "END".into()]);
        assert_eq!(m.push("hello E"), StopScan::Continue("hello ".into()));
        assert_eq!(m.push("N"), StopScan::Continue("".into()));
        assert_eq!(m.push("Xy"), StopScan::Continue("ENXy".into()));
        assert_eq!(m.push("a\n"), StopScan::Continue("a".into()));
        assert_eq!(m.push("\nrest"), StopScan::Stopped("".into()));
    }

    #[test]
    fn earliest_stop_wins_and_finish_releases() {
        let mut m = StopMatcher::new(vec!["b".into(), "abc".into()]);
        assert_eq!(m.push("xxab"), StopScan::Stopped("xxa".into()));
        assert_eq!(m.matched(), Some("b"));
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("ST"), StopScan::Continue("".into()));
        assert_eq!(m.finish(), "ST");
    }

    #[test]
    fn multibyte_prefixes_are_safe() {
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("caf"), StopScan::Continue("caf".into()));
        assert_eq!(m.push("é"), StopScan::Continue("".into()));
        assert_eq!(m.push("?"), StopScan::Continue("é?".into()));
    }
}
