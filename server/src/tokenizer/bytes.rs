//! Per-token raw bytes: the exact bytes each token id stands for.
//!
//! Decoding byte-level BPE is "concatenate the bytes of the ids, then UTF-8";
//! keeping the bytes per id makes `decode` a table walk and lets the stream
//! decoder work on bytes, so it never has to re-decode a window.

use std::sync::OnceLock;

/// GPT-2 `bytes_to_unicode`: byte -> printable char used in byte-level vocabularies.
pub fn byte_to_char() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = ['\0'; 256];
        let mut n = 0u32;
        for b in 0..=255u32 {
            let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
            t[b as usize] = if printable {
                char::from_u32(b).unwrap()
            } else {
                n += 1;
                char::from_u32(255 + n).unwrap()
            };
        }
        t
    })
}

/// Inverse of [`byte_to_char`], indexed by code point (all are < 0x144).
fn char_to_byte() -> &'static [i16; 0x144] {
    static TABLE: OnceLock<[i16; 0x144]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = [-1i16; 0x144];
        for (b, c) in byte_to_char().iter().enumerate() {
            t[*c as usize] = b as i16;
        }
        t
    })
}

/// Bytes of a byte-level BPE token string.  Mirrors HF's `ByteLevel` decoder:
/// if any char is not one of the 256 byte chars, the token's own UTF-8 is used.
pub fn byte_level_decode(token: &str, out: &mut Vec<u8>) {
    let table = char_to_byte();
    let start = out.len();
    for c in token.chars() {
        match table.get(c as usize) {
            Some(&b) if b >= 0 => out.push(b as u8),
            _ => {
                out.truncate(start);
                out.extend_from_slice(token.as_bytes());
                return;
            }
        }
    }
}

/// Bytes of a SentencePiece-style token (`▁` = space, `<0xAB>` = byte).
pub fn sentencepiece_decode(token: &str, byte_fallback: bool, out: &mut Vec<u8>) {
    if byte_fallback {
        if let Some(b) = parse_byte_token(token) {
            out.push(b);
            return;
        }
    }
    let mut buf = [0u8; 4];
    for c in token.chars() {
        let c = if c == '\u{2581}' { ' ' } else { c };
        out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
    }
}

/// `<0xAB>` -> 0xAB.
pub fn parse_byte_token(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// What a token is, for decoding and `skip_special`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum TokenKind {
    /// Ordinary vocabulary entry.
    Normal,
    /// Control / special token (`<|im_end|>`): parsed only with `parse_special`,
    /// dropped by `decode(.., skip_special = true)`.
    Control,
    /// User-defined added token (`<tool_call>` in Qwen): always parsed, always decoded.
    UserDefined,
    /// Unused / padding slot: never produced by encode, decodes to nothing.
    Unused,
}

/// Flat table of token bytes.
#[derive(Debug, Clone, Default)]
pub struct TokenBytes {
    data: Vec<u8>,
    offsets: Vec<u32>,
    kinds: Vec<TokenKind>,
}

impl TokenBytes {
    pub fn with_capacity(n: usize) -> Self {
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0);
        TokenBytes { data: Vec::with_capacity(n * 6), offsets, kinds: Vec::with_capacity(n) }
    }

    /// Append the next id; `fill` writes its bytes.
    pub fn push_with(&mut self, kind: TokenKind, fill: impl FnOnce(&mut Vec<u8>)) {
        if kind != TokenKind::Unused {
            fill(&mut self.data);
        }
        self.offsets.push(self.data.len() as u32);
        self.kinds.push(kind);
    }

    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    #[inline]
    pub fn get(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        if i >= self.kinds.len() {
            return None;
        }
        Some(&self.data[self.offsets[i] as usize..self.offsets[i + 1] as usize])
    }

    #[inline]
    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// Bytes to emit for `id` when decoding: empty for unknown ids, unused
    /// slots, and control tokens when `skip_special`.
    #[inline]
    pub fn decode_piece(&self, id: u32, skip_special: bool) -> &[u8] {
        match self.kind(id) {
            None | Some(TokenKind::Unused) => &[],
            Some(TokenKind::Control) if skip_special => &[],
            Some(_) => self.get(id).unwrap_or(&[]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_gpt2() {
        let t = byte_to_char();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        let mut v = Vec::new();
        byte_level_decode("ĠhelloĊ", &mut v);
        assert_eq!(v, b" hello\n");
        v.clear();
        // A token containing a char outside the byte alphabet is kept verbatim.
        byte_level_decode("a b", &mut v);
        assert_eq!(v, b"a b");
        v.clear();
        // UTF-8 for 'é' is C3 A9 -> chars 'Ã' '©'.
        byte_level_decode("Ã©", &mut v);
        assert_eq!(std::str::from_utf8(&v).unwrap(), "é");
    }

    #[test]
    fn sentencepiece_pieces() {
        let mut v = Vec::new();
        sentencepiece_decode("▁Hello", true, &mut v);
        sentencepiece_decode("<0xF0>", true, &mut v);
        assert_eq!(v, b" Hello\xF0");
    }
}
