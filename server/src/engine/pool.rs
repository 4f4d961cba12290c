//! Several engine workers behind one server, with session affinity.
//!
//! Each worker is an independent engine thread with its own copy of the
//! model (one per device, or replicas on one device). A session is pinned to
//! one worker for its whole life by a stable hash of its id, so every turn
//! runs where that session's prefix-cache entries are. A worker that fails
//! ends its own sessions' requests with errors; the others carry on.
use std::sync::Arc;

use super::{EngineHandle, EngineModelInfo, EngineStats, Scope};

#[derive(Clone)]
pub struct EnginePool {
    workers: Arc<Vec<EngineHandle>>,
}

impl EnginePool {
    /// # Panics
    /// With no workers: a server needs at least one.
    pub fn new(workers: Vec<EngineHandle>) -> EnginePool {
        assert!(!workers.is_empty(), "an engine pool needs at least one worker");
        EnginePool { workers: Arc::new(workers) }
    }

    pub fn workers(&self) -> &[EngineHandle] {
        &self.workers
    }

    /// The worker a session is pinned to: FNV-1a of its id, which (unlike
    /// std's randomly keyed hasher) is the same in every process and release.
    pub fn worker_index(&self, session_id: &str) -> usize {
        let hash = session_id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        (hash % self.workers.len() as u64) as usize
    }

    pub fn for_session(&self, session_id: &str) -> &EngineHandle {
        &self.workers[self.worker_index(session_id)]
    }

    /// Tells the session's worker whether its socket is attached (`live`) or
    /// detached: idle sessions' prefix-cache entries are evicted first.
    pub fn set_session_live(&self, session_id: &str, live: bool) {
        self.for_session(session_id).set_scope_live(Scope::Session(session_id.to_string()), live);
    }

    /// The model all workers serve.
    pub fn info(&self) -> &EngineModelInfo {
        self.workers[0].info()
    }

    /// Whether every worker's thread is running.
    pub fn is_alive(&self) -> bool {
        self.workers.iter().all(EngineHandle::is_alive)
    }

    /// All workers' statistics added up (memory figures are per process, so
    /// those are taken once); `None` when no worker answers.
    pub async fn stats(&self) -> Option<EngineStats> {
        let mut total: Option<EngineStats> = None;
        for w in self.workers.iter() {
            let Some(s) = w.stats().await else { continue };
            match &mut total {
                None => total = Some(s),
                Some(t) => {
                    t.running += s.running;
                    t.waiting += s.waiting;
                    t.steps += s.steps;
                    t.generated_tokens += s.generated_tokens;
                    t.prompt_tokens += s.prompt_tokens;
                    t.kv_bytes += s.kv_bytes;
                    t.prefix.add(&s.prefix);
                    t.drafted_tokens += s.drafted_tokens;
                    t.accepted_draft_tokens += s.accepted_draft_tokens;
                    t.spec_decode_forwards += s.spec_decode_forwards;
                    t.spec_decode_tokens += s.spec_decode_tokens;
                    t.step_time.add(&s.step_time);
                }
            }
        }
        total
    }

    pub fn shutdown(&self) {
        self.workers.iter().for_each(EngineHandle::shutdown);
    }

    pub fn shutdown_and_join(&self) {
        self.shutdown();
        self.workers.iter().for_each(EngineHandle::shutdown_and_join);
    }
}

impl From<EngineHandle> for EnginePool {
    fn from(engine: EngineHandle) -> EnginePool {
        EnginePool::new(vec![engine])
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn fnv1a_is_stable() {
        // Known FNV-1a 64 values: the pinning must not change between builds.
        let fnv = |s: &str| s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        assert_eq!(fnv(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
