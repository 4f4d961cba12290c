//! Encoding a text that extends an earlier one without re-reading the earlier part.
//!
//! A chat client sends its whole history every turn, and tokenizing 4,300
//! tokens of it took 9.5 ms of a 26 ms time to first token on an NVIDIA
//! H200's host (bench/results/gpu-h200-agent-trace-requests.log), where the
//! prefix cache had made the model's part 14 ms. The session keeps its last
//! prompt's encoding, cut into pieces at safe points, and the next prompt
//! re-encodes only what follows the last cut the two texts share.
//!
//! A safe cut is a line start: an ASCII letter or digit after a single
//! `'\n'` that follows a non-space. For byte-level BPE behind a regex
//! pre-tokenizer (GPT-2, Llama 3, Qwen2 and their relatives) no pre-token
//! spans it: every pattern that can take a newline ends with it or with more
//! whitespace, and none that takes a letter or digit may start with a
//! newline, so the scan restarts at the cut whatever came before; and the
//! newline is a pre-token of its own (or ends the punctuation before it)
//! whether a letter or the end of the text follows. After a run of
//! whitespace it would not be: GPT-2's `\s+(?!\S)` leaves a run's last space
//! to the next word, but takes the whole run at the end of a text. BPE
//! merges never cross a pre-token. Normalizers (NFC) do not compose across it either (ASCII
//! letters and digits combine with nothing before them). So the pieces'
//! encodings, concatenated, are the whole text's. Three kinds of tokenizer
//! break that argument, and get whole-text encoding: SentencePiece-style
//! ones (a space marker prepended to the text, not to every piece), and
//! those with an added token that contains a newline or starts with an ASCII
//! letter or digit (added tokens are matched before pre-tokenization). The
//! equality is tested against whole-text encoding on both test models.

use super::{Result, TextTokenizer};

/// Pieces are at least this many bytes (a line start inside a shorter
/// stretch is not a cut): fewer encoder calls, and a reused prefix loses at
/// most a few hundred bytes.
const MIN_PIECE_BYTES: usize = 256;

/// A text's ids with the cuts it was encoded at; what a session keeps.
#[derive(Clone, Debug, Default)]
pub struct PieceEncoding {
    text: String,
    ids: Vec<u32>,
    /// (byte offset in `text`, ids before it) at each cut, ascending.
    cuts: Vec<(usize, usize)>,
}

impl PieceEncoding {
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Ids a later text sharing the first `bytes` bytes would re-use.
    pub fn reused_for(&self, bytes: usize) -> usize {
        self.reusable(bytes).1.len()
    }

    /// Ids of the text up to the last cut before `bytes` (the cut's own
    /// byte must be shared too: it is what makes it a cut), and that cut.
    fn reusable(&self, bytes: usize) -> (usize, &[u32]) {
        match self.cuts.iter().rev().find(|&&(at, _)| at < bytes) {
            Some(&(at, n)) => (at, &self.ids[..n]),
            None => (0, &[]),
        }
    }
}

/// Whether byte `at` of `text` is a cut: a line that starts with an ASCII
/// letter or digit after one newline that follows a non-space.
fn is_cut(text: &str, at: usize) -> bool {
    let b = text.as_bytes();
    at >= 2 && at < b.len() && b[at - 1] == b'\n' && b[at].is_ascii_alphanumeric() && text[..at - 1].chars().next_back().is_some_and(|c| !c.is_whitespace())
}

impl TextTokenizer {
    /// Whether texts may be encoded in pieces cut at line starts (see the
    /// module notes), checked once: the tokenizer's kind, its added tokens,
    /// and a few probe texts encoded both ways (which also catches a
    /// pre-tokenizer that adds a prefix space to every text it is given).
    pub fn encodes_in_pieces(&self) -> bool {
        *self.encodes_in_pieces.get_or_init(|| {
            let added_ok = self.with_special.get_added_tokens_decoder().values().all(|t| {
                let first = t.content.bytes().next();
                !t.content.contains('\n') && !first.is_some_and(|b| b.is_ascii_alphanumeric())
            });
            let probes = [("Hello world.\n", "Next line 42\n"), ("  x = 1;\n", "y = 2\n"), ("end of a line\n", "7 items"), ("naïve café\n", "Zed")];
            let same = |a: &str, b: &str| -> Result<bool> {
                let mut pieces = self.encode(a, true)?;
                pieces.extend(self.encode(b, true)?);
                Ok(pieces == self.encode(&format!("{a}{b}"), true)?)
            };
            !self.strip_leading_space && added_ok && probes.iter().all(|(a, b)| same(a, b).unwrap_or(false))
        })
    }

    /// `encode(text, true)`, re-using `earlier`'s ids up to the last cut
    /// inside the part the two texts share; returns the encoding to keep for
    /// the next text. Falls back to whole-text encoding (no cuts) where
    /// [`encodes_in_pieces`](Self::encodes_in_pieces) says no.
    pub fn encode_extending(&self, text: &str, earlier: Option<&PieceEncoding>) -> Result<PieceEncoding> {
        if !self.encodes_in_pieces() {
            return Ok(PieceEncoding { text: text.to_string(), ids: self.encode(text, true)?, cuts: Vec::new() });
        }
        let shared = earlier.map_or(0, |e| common_prefix(&e.text, text));
        let (start, reused) = earlier.map_or((0, &[][..]), |e| e.reusable(shared));
        let mut out = PieceEncoding { text: text.to_string(), ids: reused.to_vec(), cuts: Vec::new() };
        if let Some(e) = earlier {
            out.cuts.extend(e.cuts.iter().copied().take_while(|&(at, _)| at <= start));
        }
        let mut piece_start = start;
        let mut at = start + MIN_PIECE_BYTES;
        while at < text.len() {
            if is_cut(text, at) {
                out.ids.extend(self.encode(&text[piece_start..at], true)?);
                out.cuts.push((at, out.ids.len()));
                piece_start = at;
                at += MIN_PIECE_BYTES;
            } else {
                at += 1;
            }
        }
        out.ids.extend(self.encode(&text[piece_start..], true)?);
        Ok(out)
    }
}

/// Length in bytes of the longest common prefix of `a` and `b` (a char boundary of both).
fn common_prefix(a: &str, b: &str) -> usize {
    let n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    (0..=n).rev().find(|&i| a.is_char_boundary(i) && b.is_char_boundary(i)).unwrap_or(0)
}
