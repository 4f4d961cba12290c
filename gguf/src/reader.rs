//! A bounds-checked little-endian byte cursor.
//!
//! All header parsing goes through [`Cursor`], so there is exactly one place
//! that can index into the mapped file; every read either succeeds or returns a
//! [`GgufError`] carrying the byte offset, never panics.

use crate::error::GgufError;

pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    /// Current byte offset from the start of the buffer (the file).
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes left after the current position.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Takes exactly `n` bytes. A shortfall is [`GgufError::Truncated`].
    pub(crate) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated { what: what.to_string(), offset: self.pos as u64 });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    pub(crate) fn u8(&mut self, what: &str) -> Result<u8, GgufError> {
        Ok(self.array::<1>(what)?[0])
    }
    pub(crate) fn u16(&mut self, what: &str) -> Result<u16, GgufError> {
        self.array(what).map(u16::from_le_bytes)
    }
    pub(crate) fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }
    pub(crate) fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }
    pub(crate) fn f32(&mut self, what: &str) -> Result<f32, GgufError> {
        self.array(what).map(f32::from_le_bytes)
    }
    pub(crate) fn f64(&mut self, what: &str) -> Result<f64, GgufError> {
        self.array(what).map(f64::from_le_bytes)
    }

    /// Reads a count/length prefix and checks that `count` items of at least
    /// `min_item_size` bytes each could fit in what remains of the file.
    ///
    /// This is the guard against absurd lengths: it runs before any
    /// allocation sized by `count`, so allocations are bounded by the file size.
    pub(crate) fn count(&mut self, min_item_size: usize, what: &str) -> Result<usize, GgufError> {
        let offset = self.pos as u64;
        let n = self.u64(what)?;
        let available = self.remaining() as u64;
        let needed = n.checked_mul(min_item_size.max(1) as u64);
        match needed {
            Some(needed) if needed <= available => Ok(n as usize),
            _ => Err(GgufError::ImplausibleLength { what: what.to_string(), len: n, offset, available }),
        }
    }

    /// Reads a GGUF string: `u64` byte length followed by UTF-8 bytes.
    ///
    /// Invalid UTF-8 is an error rather than a lossy conversion: every string
    /// consumer downstream (tokenizer vocab, chat template) needs the exact
    /// text, and silently substituting U+FFFD would corrupt it invisibly.
    pub(crate) fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.count(1, what)?;
        let start = self.pos;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(GgufError::InvalidMetadata(format!("{what} at byte offset {start} is not valid UTF-8 ({e})"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_little_endian_and_tracks_position() {
        let buf = [1u8, 0x34, 0x12, 0x78, 0x56, 0x34, 0x12];
        let mut c = Cursor::new(&buf);
        assert_eq!(c.u8("a").unwrap(), 1);
        assert_eq!(c.u16("b").unwrap(), 0x1234);
        assert_eq!(c.pos(), 3);
        assert_eq!(c.u32("c").unwrap(), 0x1234_5678);
        assert_eq!(c.remaining(), 0);
    }

    #[test]
    fn short_read_is_truncated_with_offset() {
        let buf = [0u8; 5];
        let mut c = Cursor::new(&buf);
        c.u32("first").unwrap();
        match c.u32("second") {
            Err(GgufError::Truncated { what, offset }) => {
                assert_eq!(what, "second");
                assert_eq!(offset, 4);
            }
            other => panic!("expected Truncated, got {other:?}"),
        }
        // A failed read does not advance.
        assert_eq!(c.pos(), 4);
    }

    #[test]
    fn count_rejects_lengths_that_cannot_fit() {
        let mut buf = 10u64.to_le_bytes().to_vec();
        buf.extend_from_slice(&[0u8; 39]);
        // 10 items * 4 bytes = 40 > 39 remaining.
        let err = Cursor::new(&buf).count(4, "things").unwrap_err();
        assert!(matches!(err, GgufError::ImplausibleLength { len: 10, available: 39, offset: 0, .. }), "{err:?}");
        // Exactly fitting is fine.
        assert_eq!(Cursor::new(&buf).count(3, "things").unwrap(), 10);
        // Overflow in len * size is also rejected, not wrapped.
        let huge = u64::MAX.to_le_bytes();
        assert!(matches!(Cursor::new(&huge).count(8, "x"), Err(GgufError::ImplausibleLength { .. })));
    }

    #[test]
    fn string_checks_utf8() {
        let mut buf = 3u64.to_le_bytes().to_vec();
        buf.extend_from_slice(b"abc");
        assert_eq!(Cursor::new(&buf).string("s").unwrap(), "abc");
        let mut bad = 2u64.to_le_bytes().to_vec();
        bad.extend_from_slice(&[0xff, 0xfe]);
        assert!(matches!(Cursor::new(&bad).string("s"), Err(GgufError::InvalidMetadata(_))));
    }
}
