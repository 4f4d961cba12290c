//! Incremental detokenization.
//!
//! Byte-level BPE tokens can end in the middle of a multi-byte UTF-8 character
//! (an emoji is often 2-4 tokens).  [`StreamDecoder`] keeps the not-yet-emitted
//! bytes (the "window" after the last fully emitted character, at most 3 bytes
//! of an incomplete character plus the new token) and emits text only once it
//! is complete UTF-8.  Work per token is proportional to that token's length,
//! independent of how much text was generated before: O(1) amortized.
//!
//! Invariant: the concatenation of everything returned by [`StreamDecoder::push`]
//! and [`StreamDecoder::flush`] equals `TextTokenizer::decode` of the same ids
//! (both apply the same "maximal invalid subpart -> U+FFFD" rule as
//! `String::from_utf8_lossy`).  U+FFFD is emitted only for bytes that can never
//! become valid (an invalid byte, or a sequence broken by a following byte), or
//! for an incomplete tail at `flush`.

use super::TextTokenizer;

#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    skip_special: bool,
    /// Control tokens written as text even when skipping (a tool call's tags).
    kept: Vec<u32>,
    /// Bytes received but not yet emitted (always a prefix of one incomplete char
    /// between calls: at most 3 bytes).
    pending: Vec<u8>,
    /// Nothing emitted yet (SentencePiece-style tokenizers strip one leading space).
    at_start: bool,
    tokens: usize,
}

impl StreamDecoder {
    /// `skip_special`: drop control tokens (`<|im_end|>` ...) from the text, like
    /// `decode(.., true)`.
    pub fn new(skip_special: bool) -> Self {
        StreamDecoder { skip_special, kept: Vec::new(), pending: Vec::with_capacity(16), at_start: true, tokens: 0 }
    }

    /// Writes these control tokens as their text although others are skipped.
    pub fn keeping(mut self, ids: Vec<u32>) -> Self {
        self.kept = ids;
        self
    }

    /// Feed one generated token; returns newly completed text, if any.
    pub fn push(&mut self, tokenizer: &TextTokenizer, id: u32) -> Option<String> {
        self.tokens += 1;
        let skip = self.skip_special && !self.kept.contains(&id);
        let piece = tokenizer.token_bytes_table().decode_piece(id, skip);
        self.push_bytes(tokenizer, piece)
    }

    /// Feed raw bytes (e.g. from [`TextTokenizer::token_bytes`]).
    pub fn push_bytes(&mut self, tokenizer: &TextTokenizer, bytes: &[u8]) -> Option<String> {
        if bytes.is_empty() {
            return None;
        }
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let consumed = drain_complete(&self.pending, &mut out);
        self.pending.drain(..consumed);
        self.finish(tokenizer, out)
    }

    /// End of stream: emit whatever is left (an incomplete character becomes U+FFFD).
    pub fn flush(&mut self, tokenizer: &TextTokenizer) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        self.finish(tokenizer, out)
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    /// Number of tokens pushed so far.
    pub fn token_count(&self) -> usize {
        self.tokens
    }

    /// Forget all state (start a new generation).
    pub fn reset(&mut self) {
        self.pending.clear();
        self.at_start = true;
        self.tokens = 0;
    }

    fn finish(&mut self, tokenizer: &TextTokenizer, mut out: String) -> Option<String> {
        if out.is_empty() {
            return None;
        }
        if self.at_start {
            self.at_start = false;
            if tokenizer.strips_leading_space() && out.starts_with(' ') {
                out.remove(0);
                if out.is_empty() {
                    return None;
                }
            }
        }
        Some(out)
    }
}

/// Append the decodable part of `buf` to `out`; return how many bytes were
/// consumed.  Stops before a trailing incomplete (but so far valid) sequence;
/// replaces invalid sequences with U+FFFD exactly like `from_utf8_lossy`.
fn drain_complete(buf: &[u8], out: &mut String) -> usize {
    let mut pos = 0;
    loop {
        match std::str::from_utf8(&buf[pos..]) {
            Ok(s) => {
                out.push_str(s);
                return buf.len();
            }
            Err(e) => {
                let valid = e.valid_up_to();
                // SAFETY-free: from_utf8 just validated this prefix.
                out.push_str(std::str::from_utf8(&buf[pos..pos + valid]).unwrap());
                pos += valid;
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        pos += n;
                    }
                    None => return pos, // incomplete tail: wait for more bytes
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_rules() {
        let mut s = String::new();
        // "é" split: C3 | A9
        assert_eq!(drain_complete(b"a\xC3", &mut s), 1);
        assert_eq!(s, "a");
        s.clear();
        // invalid byte in the middle is replaced, incomplete tail kept
        assert_eq!(drain_complete(b"\xFFb\xF0\x9F", &mut s), 2);
        assert_eq!(s, "\u{FFFD}b");
        s.clear();
        // a broken sequence (F0 9F then ASCII) is replaced once, like from_utf8_lossy
        assert_eq!(drain_complete(b"\xF0\x9Fx", &mut s), 3);
        assert_eq!(s, String::from_utf8_lossy(b"\xF0\x9Fx"));
    }
}
