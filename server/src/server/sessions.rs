//! All sessions of the server: creating them (and making room at the
//! limit), finding them for a resume, ending them on close or after their
//! TTL.
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dashmap::DashMap;

use super::conn::ConnCtl;
use super::session::{new_secret, Session, SessionLimits};
use crate::engine::EnginePool;

/// Why `session.open` with a `session_id` found no session to resume.
pub enum LookupError {
    NotFound,
    Expired,
}

/// All sessions of the server.
pub struct SessionRegistry {
    map: DashMap<String, Arc<Session>>,
    /// Ids of sessions that expired or were closed recently, for `session_expired`.
    tombstones: Mutex<HashMap<String, Instant>>,
    count: AtomicUsize,
    max: usize,
    ttl: Duration,
    limits: SessionLimits,
    /// Told each session id the registry forgets (closed or expired), so the
    /// engine can free that session's prefix-cache entries.
    on_forget: Box<dyn Fn(&str) + Send + Sync>,
}

const MAX_TOMBSTONES: usize = 65_536;

/// What [`SessionRegistry::create`] made.
pub struct NewSession {
    pub session: Arc<Session>,
    pub token: String,
    /// Detached sessions ended to make room for it.
    pub evicted: usize,
}

impl SessionRegistry {
    /// Calls `on_forget` with each session id it closes or expires.
    pub fn with_on_forget(mut self, on_forget: impl Fn(&str) + Send + Sync + 'static) -> SessionRegistry {
        self.on_forget = Box::new(on_forget);
        self
    }

    pub fn new(max: usize, ttl: Duration, limits: SessionLimits) -> SessionRegistry {
        SessionRegistry {
            map: DashMap::new(),
            tombstones: Mutex::new(HashMap::new()),
            count: AtomicUsize::new(0),
            max,
            ttl,
            limits,
            on_forget: Box::new(|_| {}),
        }
    }

    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// A new session attached to `conn`, pinned to its engine worker for
    /// its whole life; `None` when the limit is reached by attached
    /// sessions alone. At the limit a live client wins over a detached one:
    /// the session detached longest is ended for it (its resume then gets
    /// `session_expired`), and counted in [`NewSession::evicted`].
    pub fn create(&self, conn: Arc<ConnCtl>, engines: &EnginePool) -> Option<NewSession> {
        let mut evicted = 0;
        while self.count.fetch_add(1, Ordering::AcqRel) >= self.max {
            self.count.fetch_sub(1, Ordering::AcqRel);
            let oldest = self.map.iter().filter_map(|e| e.value().detached_since().map(|t| (t, e.value().clone()))).min_by_key(|(t, _)| *t);
            let (_, victim) = oldest?;
            self.close(&victim);
            evicted += 1;
        }
        let token = new_secret("rt_");
        let id = new_secret("s_");
        let engine = engines.for_session(&id).clone();
        let session = Arc::new(Session::new(id, token.clone(), conn, engine, self.limits));
        self.map.insert(session.id.clone(), session.clone());
        Some(NewSession { session, token, evicted })
    }

    pub fn get(&self, id: &str) -> Result<Arc<Session>, LookupError> {
        if let Some(s) = self.map.get(id) {
            return Ok(s.clone());
        }
        let tombs = self.tombstones.lock().unwrap_or_else(|e| e.into_inner());
        if tombs.contains_key(id) {
            Err(LookupError::Expired)
        } else {
            Err(LookupError::NotFound)
        }
    }

    /// `session.close`: cancels everything of the session and forgets it.
    pub fn close(&self, session: &Session) -> usize {
        let n = session.close();
        self.forget(&session.id);
        n
    }

    fn forget(&self, id: &str) {
        if self.map.remove(id).is_some() {
            (self.on_forget)(id);
            self.count.fetch_sub(1, Ordering::AcqRel);
            let mut tombs = self.tombstones.lock().unwrap_or_else(|e| e.into_inner());
            if tombs.len() >= MAX_TOMBSTONES {
                tombs.clear();
            }
            tombs.insert(id.to_string(), Instant::now());
        }
    }

    /// Closes sessions detached for longer than the TTL; returns how many.
    pub fn reap(&self) -> usize {
        let now = Instant::now();
        let due: Vec<Arc<Session>> = self.map.iter().map(|e| e.value().clone()).filter(|s| s.expire_if_due(now, self.ttl)).collect();
        for s in &due {
            self.forget(&s.id);
        }
        let keep = (self.ttl * 10).max(Duration::from_secs(600));
        self.tombstones.lock().unwrap_or_else(|e| e.into_inner()).retain(|_, t| now.duration_since(*t) < keep);
        due.len()
    }

    pub fn all(&self) -> Vec<Arc<Session>> {
        self.map.iter().map(|e| e.value().clone()).collect()
    }

    /// Closes every session (shutdown).
    pub fn close_all(&self) {
        for s in self.all() {
            self.close(&s);
        }
    }
}
