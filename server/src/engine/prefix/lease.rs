//! What a lookup hands a turn ([`Hit`]), and the lease on a session's own
//! history lent whole ([`LentHistory`]). The lease only carries a history
//! back; what to lend and what to keep is the cache's call.
//!
//! Lending: a session's own entry in RAM is handed to its turn whole and
//! leaves the cache, so the turn writes its tokens in place instead of
//! copying the whole history on its first write (the copy-on-write a
//! shared snapshot costs; ~130 ms for a 4k-token SmolLM2 history in
//! float32 on a 2-core CPU). A turn that ends normally stores the longer
//! state, which supersedes the history. A cancelled one gives the history
//! back: its row hands the lease the state it holds, and the lease's
//! `Drop` returns it to the cache (resources free themselves in `Drop`).
//!
//! The key decision: the lease cannot reach the cache it came from (the
//! engine owns the cache, and the row that holds the lease is the
//! engine's too), so it returns the history down a channel that the cache
//! drains at the start of each of its operations, on the same thread.
//! Nothing can observe the cache between the return and the drain, so it
//! behaves as if the history went back at once.
use std::sync::mpsc;

use super::index::Scope;
use super::Origin;
use crate::models::KvCache;

/// A prefix-cache hit: KV state holding the first `len` tokens of the prompt.
pub enum Hit {
    /// A copy: the entry stays cached (a copy-on-write snapshot of a cache
    /// stored as is, or its blocks copied out). `origin` names it while it
    /// is in RAM, for the turn's own entry to share its blocks.
    Shared { cache: KvCache, len: usize, origin: Option<Origin> },
    /// The session's own entry, handed over: it left the cache, and
    /// `lease` takes the history back if the turn is cancelled.
    Lent { cache: KvCache, len: usize, lease: LentHistory },
}

impl Hit {
    /// The state, its length, the lease on a lent history, and where a
    /// copy came from.
    pub fn into_parts(self) -> (KvCache, usize, Option<LentHistory>, Option<Origin>) {
        match self {
            Hit::Shared { cache, len, origin } => (cache, len, None, origin),
            Hit::Lent { cache, len, lease } => (cache, len, Some(lease), None),
        }
    }
}

/// A history handed back: its scope, tokens and state.
pub(super) type Returned = (Scope, Vec<u32>, KvCache);

/// A session's history lent to its turn: its first `len` tokens of `scope`.
/// Dropped holding the history (see [`give_back`](Self::give_back)), it
/// returns it to the cache; dropped empty (the turn stored its longer
/// state, or failed), it returns nothing.
pub struct LentHistory {
    scope: Scope,
    len: usize,
    /// What goes back on drop (boxed: a lease rides in every lent [`Hit`]).
    history: Option<Box<(Vec<u32>, KvCache)>>,
    returns: mpsc::Sender<Returned>,
}

impl LentHistory {
    pub(super) fn new(scope: Scope, len: usize, returns: mpsc::Sender<Returned>) -> LentHistory {
        LentHistory { scope, len, history: None, returns }
    }

    /// Gives the history back from a cancelled turn's `tokens` and `cache`
    /// (the history and what the turn added to it, which is freed). Nothing
    /// goes back when a sliding-window cache has already dropped positions
    /// a continuation of that history needs, or a recurrent state moved on
    /// with no checkpoint at the history's length.
    pub fn give_back(mut self, mut tokens: Vec<u32>, mut cache: KvCache) {
        let len = self.len;
        if cache.len() >= len && (cache.earliest_truncation() <= len || cache.checkpoint_lens().contains(&len)) {
            tokens.truncate(len);
            cache.truncate(len);
            self.history = Some(Box::new((tokens, cache)));
        }
    }
}

impl Drop for LentHistory {
    fn drop(&mut self) {
        if let Some((tokens, cache)) = self.history.take().map(|history| *history) {
            // A closed channel means the cache is gone (the engine is
            // stopping): the history goes with it.
            let _ = self.returns.send((std::mem::replace(&mut self.scope, Scope::Shared), tokens, cache));
        }
    }
}
