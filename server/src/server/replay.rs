//! A session's replay ring: every frame its requests produce, in order, at
//! absolute positions that keep counting as old frames are evicted, so a
//! connection's cursor (the position of the next frame to give it) stays
//! valid across evictions and resumes.
//!
//! The ring only stores and counts; what may be evicted, and what a frame's
//! request makes of an eviction, is the session's business.
use std::collections::VecDeque;
use std::sync::Arc;

use super::session::RegistrationKey;

/// One stored frame.
pub struct Entry {
    /// The registration of the request that produced it.
    pub key: RegistrationKey,
    pub request_id: Arc<str>,
    /// `None` for a request's terminal `error` frame.
    pub seq: Option<u64>,
    pub json: Arc<str>,
}

#[derive(Default)]
pub struct ReplayRing {
    frames: VecDeque<Entry>,
    /// Absolute position of `frames[0]`.
    base: u64,
    bytes: usize,
}

impl ReplayRing {
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Bytes of JSON held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Absolute position of the oldest frame held.
    pub fn start(&self) -> u64 {
        self.base
    }

    /// Absolute position the next frame pushed will take.
    pub fn end(&self) -> u64 {
        self.base + self.frames.len() as u64
    }

    pub fn push(&mut self, entry: Entry) {
        self.bytes += entry.json.len();
        self.frames.push_back(entry);
    }

    /// Removes the oldest frame.
    pub fn pop_front(&mut self) -> Option<Entry> {
        let e = self.frames.pop_front()?;
        self.base += 1;
        self.bytes -= e.json.len();
        Some(e)
    }

    /// Frames held, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &Entry> {
        self.frames.iter()
    }

    /// At most `max` frames from absolute position `from` on (from the
    /// oldest held if `from` was evicted), with the position after them.
    pub fn read_from(&self, from: u64, max: usize) -> (Vec<Arc<str>>, u64) {
        let skip = from.saturating_sub(self.base) as usize;
        let out: Vec<Arc<str>> = self.frames.iter().skip(skip).take(max).map(|e| e.json.clone()).collect();
        let next = self.base + (skip.min(self.frames.len()) + out.len()) as u64;
        (out, next)
    }

    /// Drops every frame; positions keep counting from where they were.
    pub fn clear(&mut self) {
        self.base = self.end();
        self.frames.clear();
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(seq: u64, json: &str) -> Entry {
        Entry { key: RegistrationKey::FIRST, request_id: Arc::from("r"), seq: Some(seq), json: Arc::from(json) }
    }

    #[test]
    fn positions_survive_eviction() {
        let mut ring = ReplayRing::default();
        for (i, json) in ["a", "bb", "ccc"].into_iter().enumerate() {
            ring.push(frame(i as u64 + 1, json));
        }
        assert_eq!((ring.start(), ring.end(), ring.bytes()), (0, 3, 6));
        let (read, next) = ring.read_from(1, 10);
        assert_eq!(read.iter().map(|s| &**s).collect::<Vec<_>>(), ["bb", "ccc"]);
        assert_eq!(next, 3);
        assert_eq!(ring.pop_front().map(|e| e.seq), Some(Some(1)));
        assert_eq!((ring.start(), ring.end(), ring.bytes()), (1, 3, 5));
        // A cursor at an evicted position reads from the oldest frame held.
        let (read, next) = ring.read_from(0, 1);
        assert_eq!((read.len(), &*read[0], next), (1, "bb", 2));
    }

    #[test]
    fn a_cursor_at_the_end_reads_nothing_and_stays() {
        let mut ring = ReplayRing::default();
        ring.push(frame(1, "a"));
        let (read, next) = ring.read_from(1, 10);
        assert!(read.is_empty());
        assert_eq!(next, 1);
    }

    #[test]
    fn clear_keeps_positions_counting() {
        let mut ring = ReplayRing::default();
        ring.push(frame(1, "a"));
        ring.push(frame(2, "b"));
        ring.clear();
        assert_eq!((ring.start(), ring.end(), ring.bytes(), ring.len()), (2, 2, 0, 0));
        ring.push(frame(3, "c"));
        assert_eq!(ring.read_from(2, 10).0.len(), 1);
    }
}
